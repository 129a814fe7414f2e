// dist::ring_all_reduce, the textbook ring on send/recv: exact results on every backend with
// point-to-point, and the number of bytes each rank sends, counted at the send calls:
// 2(N-1)/N of the tensor, the figure the ring is known for (docs/ring-all-reduce.md).
#include <doctest/doctest.h>

#include "core/error.h"
#include "dist/init.h"
#include "dist/ring.h"
#include "tests/collectives_cases.h"
#include "tests/forwarding_group.h"

using namespace nanoddp;
using namespace nanoddp::dist;
using namespace std::chrono_literals;

namespace {

std::shared_ptr<ProcessGroup> join(Backend backend, int port, int rank, int world_size) {
  InitOptions o;
  o.backend = backend;
  o.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  o.rank = rank;
  o.world_size = world_size;
  o.timeout = 30000ms;
  return init_process_group(o);
}

std::vector<Backend> backends() {
  std::vector<Backend> list = {Backend::Shm};
#if NANODDP_WITH_GLOO
  list.push_back(Backend::Gloo);
#endif
  return list;
}

}  // namespace

TEST_CASE("ring_all_reduce: each rank sends 2(N-1)/N of the tensor, at N = 2, 3, 4") {
  for (Backend backend : backends()) {
    for (int world_size : {2, 3, 4}) {
      CAPTURE(std::string(backend_name(backend)));
      CAPTURE(world_size);
      int port = testing::free_port();
      std::string failures = testing::run_ranks(world_size, [&](int rank) {
        testing::SendCountingGroup pg(join(backend, port, rank, world_size));
        const int64_t numel = 12 * 1000;  // divisible by 2, 3 and 4: parts of equal size
        const size_t tensor_bytes = numel * sizeof(float);
        Tensor t = testing::make_tensor(DType::Float32, numel,
                                        [&](int64_t i) { return (rank + 1) * testing::pattern(i); });
        ring_all_reduce(pg, t);
        const double s = world_size * (world_size + 1) / 2.0;
        testing::expect_values(
            t, [&](int64_t i) { return s * testing::pattern(i); }, "ring sum");
        const size_t expected = 2 * (world_size - 1) * tensor_bytes / world_size;
        testing::expect(pg.sent_bytes == expected, "rank ", rank, " sent ", pg.sent_bytes,
                        " bytes, expected 2(N-1)/N * ", tensor_bytes, " = ", expected);
        destroy_process_group();
      });
      CHECK_MESSAGE(failures.empty(), failures);
    }
  }
}

TEST_CASE("ring_all_reduce: every op and dtype, sizes that do not divide by N") {
  for (Backend backend : backends()) {
    CAPTURE(std::string(backend_name(backend)));
    int port = testing::free_port();
    std::string failures = testing::run_ranks(3, [&](int rank) {
      auto pg = join(backend, port, rank, 3);
      for (int64_t numel : {1, 2, 7, 1000, 300001}) {
        for (DType dtype : {DType::Float32, DType::Int64}) {
          for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
            if (op == ReduceOp::Avg && dtype == DType::Int64) continue;
            Tensor t = testing::make_tensor(dtype, numel,
                                            [&](int64_t i) { return (rank + 1) * testing::pattern(i); });
            ring_all_reduce(*pg, t, op);
            const double factor = op == ReduceOp::Sum   ? 6.0
                                  : op == ReduceOp::Avg ? 2.0
                                  : op == ReduceOp::Max ? 3.0
                                                        : 1.0;
            testing::expect_values(
                t, [&](int64_t i) { return factor * testing::pattern(i); },
                std::string("ring ") + reduce_op_name(op) + " [" + std::to_string(numel) + "]");
          }
        }
      }
      Tensor i64 = Tensor::zeros({3}, DType::Int64);
      bool threw = false;
      try {
        ring_all_reduce(*pg, i64, ReduceOp::Avg);
      } catch (const ValueError&) {
        threw = true;
      }
      testing::expect(threw, "an int64 average was accepted");
      destroy_process_group();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}
