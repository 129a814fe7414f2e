// The shared-memory group between forked ranks on this host: the cases every CPU backend
// passes (tests/collectives_cases.h), then what is particular to it: ranks out of step are
// named, a dead peer is reported at once, the segment leaves nothing in /dev/shm, waiting
// ranks sleep, Max/Min propagate NaN, send/recv, and the bytes each rank sends in a ring.
#include <dirent.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/mman.h>
#include <time.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>

#include "core/error.h"
#include "core/random.h"
#include "core/half.h"
#include "dist/init.h"
#include "dist/ring.h"
#include "tests/collectives_cases.h"

using namespace nanoddp;
using namespace nanoddp::dist;
using namespace std::chrono_literals;

namespace {

std::shared_ptr<ProcessGroup> join(int port, int rank, int world_size,
                                   std::chrono::milliseconds timeout = 30000ms,
                                   bool check_collectives = true) {
  InitOptions o;
  o.backend = Backend::Shm;
  // false: the backend alone, to test its own detection (the check would catch it first).
  o.check_collectives = check_collectives;
  o.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  o.rank = rank;
  o.world_size = world_size;
  o.timeout = timeout;
  return init_process_group(o);
}

// Names in /dev/shm that start with prefix.
std::vector<std::string> shm_entries(const std::string& prefix) {
  std::vector<std::string> names;
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(dir))
      if (std::string(e->d_name).rfind(prefix, 0) == 0) names.push_back(e->d_name);
    ::closedir(dir);
  }
  return names;
}

uint8_t* bytes(const Tensor& t) { return static_cast<uint8_t*>(t.impl()->storage->data()); }

double cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("shm: every collective is exact for world sizes 1 to 4") {
  for (int world_size = 1; world_size <= 4; ++world_size) {
    CAPTURE(world_size);
    int port = testing::free_port();
    std::string failures = testing::run_ranks(world_size, [&](int rank) {
      auto pg = join(port, rank, world_size);
      testing::expect(pg->backend_name() == "shm", "backend is ", pg->backend_name());
      testing::check_collectives(*pg, {1, 7, 1000, 65537});
      destroy_process_group();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("shm: all_reduce and broadcast of 2^20 + 3 elements") {
  for (int world_size : {2, 3, 4}) {
    CAPTURE(world_size);
    int port = testing::free_port();
    std::string failures = testing::run_ranks(world_size, [&](int rank) {
      auto pg = join(port, rank, world_size);
      testing::check_large_collectives(*pg);
      destroy_process_group();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("auto picks shm when every rank is on this machine, unless NANODDP_BACKEND says") {
  for (const char* launcher_backend : {"", "gloo"}) {
    CAPTURE(launcher_backend);
    int port = testing::free_port();
    std::string failures = testing::run_ranks(2, [&](int rank) {
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", "2", 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", "2", 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("NANODDP_BACKEND", launcher_backend, 1);
      InitOptions o;
      o.timeout = 30000ms;
      auto pg = init_process_group(o);
      std::string want = *launcher_backend ? launcher_backend : "shm";
      testing::expect(pg->backend_name() == want, "auto picked ", pg->backend_name());
      Tensor t = testing::make_tensor(DType::Float32, 3, [&](int64_t) { return rank + 1.0; });
      pg->all_reduce(t)->wait();
      testing::expect_values(
          t, [](int64_t) { return 3.0; }, "env all_reduce");
      destroy_process_group();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("shm: a rank that never joins gives a TimeoutError naming the collective and the peer") {
  int port = testing::free_port();
  std::string failures = testing::run_ranks(2, [&](int rank) {
    auto pg = join(port, rank, 2, 20000ms, /*check_collectives=*/false);
    if (rank == 1) {
      std::this_thread::sleep_for(1500ms);  // alive, but never calls all_reduce
      return;
    }
    Tensor t = Tensor::ones({4});
    auto work = pg->all_reduce(t);
    auto start = std::chrono::steady_clock::now();
    try {
      work->wait(300ms);
      testing::expect(false, "wait returned without the peer");
    } catch (const TimeoutError& e) {
      std::string what = e.what();
      for (const char* part :
           {"rank 0/2", "shm", "all_reduce(sum)", "[4]", "float32", "300 ms", "waiting for rank 1"})
        testing::expect(what.find(part) != std::string::npos, "message lacks '", part, "': ", what);
    }
    auto elapsed = std::chrono::steady_clock::now() - start;
    testing::expect(elapsed >= 290ms && elapsed < 3000ms, "timeout took ",
                    std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count(), " ms");
    // The group is unusable now, and says so.
    std::string later = error_of([&] { pg->all_reduce(t); });
    testing::expect(later.find("unusable") != std::string::npos, "later issue: '", later, "'");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("shm: a timeout names the rank that never began the collective, not only the neighbour waited on") {
  // Three ranks; rank 1 never calls the all_gather. Ranks 0 and 2 wait on their ring
  // neighbours, one of which is rank 2, itself waiting for rank 1.
  int port = testing::free_port();
  std::string failures = testing::run_ranks(3, [&](int rank) {
    auto pg = join(port, rank, 3, 20000ms, /*check_collectives=*/false);
    Tensor warm = Tensor::ones({4});
    pg->all_reduce(warm)->wait();  // every rank has begun one collective
    if (rank == 1) {
      std::this_thread::sleep_for(2500ms);  // alive, but never calls all_gather
      return;
    }
    // Rank 0 times out first, and rank 2 learns of it from rank 0's abort.
    std::vector<Tensor> outputs{Tensor::zeros({4}), Tensor::zeros({4}), Tensor::zeros({4})};
    const std::string what =
        error_of([&] { pg->all_gather(outputs, Tensor::ones({4}))->wait(rank == 0 ? 500ms : 5000ms); });
    const std::string expected = "waiting for rank 2; rank 1 has not begun it";
    if (rank == 0)
      testing::expect(what.find("did not complete within 500 ms (" + expected) != std::string::npos, what);
    else
      testing::expect(what.find("aborted by rank 0") != std::string::npos && what.find(expected) != std::string::npos,
                      what);
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("shm: works not run when the group ends fail, and the shared segment goes with the group") {
  // Mappings of shared memory in this process (the group's segment is one, until it goes).
  auto shared_mappings = [] {
    std::ifstream maps("/proc/self/maps");
    int n = 0;
    for (std::string line; std::getline(maps, line);) n += line.find("/dev/shm/") != std::string::npos;
    return n;
  };
  for (const bool check : {false, true}) {
    CAPTURE(check);
    int port = testing::free_port();
    std::string failures = testing::run_ranks(2, [&](int rank) {
      const int before = shared_mappings();
      auto pg = join(port, rank, 2, 20000ms, check);
      testing::expect(shared_mappings() > before, "the group maps no shared memory");
      Tensor t = Tensor::ones({4});
      std::shared_ptr<Work> held = pg->all_reduce(t);  // never waited on: it never runs
      pg->all_reduce(t);                                // dropped, the same
      pg.reset();
      const auto start = std::chrono::steady_clock::now();
      destroy_process_group();
      testing::expect(std::chrono::steady_clock::now() - start < 5s, "destroy waited for the peers");
      const std::string what = error_of([&] { held->wait(5000ms); });
      testing::expect(what.find("destroyed before") != std::string::npos, "wait after the group's end: '", what, "'");
      testing::expect_values(t, [](int64_t) { return 1.0; }, "an all_reduce that never ran");
      held.reset();
      testing::expect(shared_mappings() == before, "the segment outlived the group: ", shared_mappings(), " vs ",
                      before);
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("shm: without the collective check, a wait still ends by the group's timeout") {
  int port = testing::free_port();
  std::string failures = testing::run_ranks(2, [&](int rank) {
    auto pg = join(port, rank, 2, 2000ms, /*check_collectives=*/false);
    if (rank == 1) {
      std::this_thread::sleep_for(9000ms);  // alive, but never calls all_reduce
      return;
    }
    Tensor t = Tensor::ones({4});
    const auto start = std::chrono::steady_clock::now();
    const std::string what = error_of([&] { pg->all_reduce(t)->wait(); });  // the default: 5 minutes
    const auto elapsed = std::chrono::steady_clock::now() - start;
    testing::expect(what.find("did not complete within 2000 ms") != std::string::npos, "error: '", what, "'");
    testing::expect(elapsed < 7000ms, "the wait took ",
                    std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count(), " ms");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("shm: ranks out of step are named on both sides, at once") {
  struct Mismatch {
    const char* name;
    std::function<void(ProcessGroup&, int)> call;
    const char* expected;  // in every rank's message
  };
  const std::vector<Mismatch> cases = {
      {"sizes",
       [](ProcessGroup& pg, int rank) {
         Tensor t = Tensor::ones({4 + rank});
         pg.all_reduce(t)->wait(20000ms);
       },
       "all_reduce(sum) #1 of 5 float32"},
      {"collectives",
       [](ProcessGroup& pg, int rank) {
         Tensor t = Tensor::ones({4});
         if (rank == 0)
           pg.all_reduce(t)->wait(20000ms);
         else
           pg.broadcast(t, 0)->wait(20000ms);
       },
       "broadcast from rank 0 #1"},
      {"ops",
       [](ProcessGroup& pg, int rank) {
         Tensor t = Tensor::ones({4});
         pg.all_reduce(t, rank == 0 ? ReduceOp::Sum : ReduceOp::Max)->wait(20000ms);
       },
       "all_reduce(max) #1"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    int port = testing::free_port();
    std::string failures = testing::run_ranks(2, [&](int rank) {
      auto pg = join(port, rank, 2, 20000ms, /*check_collectives=*/false);
      Tensor warm = Tensor::ones({3});
      pg->all_reduce(warm)->wait();  // collective #0 agrees
      auto start = std::chrono::steady_clock::now();
      std::string what;
      try {
        c.call(*pg, rank);
      } catch (const DistError& e) {
        what = e.what();
      }
      testing::expect(!what.empty(), "the mismatch went unnoticed");
      testing::expect(what.find(c.expected) != std::string::npos, "message lacks '", c.expected, "': ", what);
      testing::expect(what.find("same order") != std::string::npos, "no advice: ", what);
      testing::expect(std::chrono::steady_clock::now() - start < 2000ms, "noticed late");
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

// Note [Shm direct all-reduce]: the same bits as the ring, for every op and dtype the ring
// takes, with parts of unequal length (65,537 elements) and a part that is empty (3 elements
// at world size 4).
TEST_CASE("shm: all_reduce of collective buffers gives the ring's bits, and leaves nothing behind") {
  for (int world_size : {2, 3, 4}) {
    CAPTURE(world_size);
    int port = testing::free_port();
    std::string failures = testing::run_ranks(world_size, [&](int rank) {
      auto pg = join(port, rank, world_size);
      struct Case {
        DType dtype;
        ReduceOp op;
        int64_t numel;
      };
      for (Case c : {Case{DType::Float32, ReduceOp::Sum, 65537}, Case{DType::Float32, ReduceOp::Avg, 65537},
                     Case{DType::Float32, ReduceOp::Max, 3}, Case{DType::Int64, ReduceOp::Min, 1000},
                     Case{DType::BFloat16, ReduceOp::Sum, 4097}}) {
        const std::string what = std::string(dtype_name(c.dtype)) + " " + reduce_op_name(c.op);
        Tensor buffer = pg->new_collective_buffer(c.numel, c.dtype, Device::cpu());
        testing::expect(buffer.numel() == c.numel && buffer.dtype() == c.dtype, what, ": buffer is ", buffer.str());
        // What a trace's bucket span says: the buffer runs the direct all-reduce, a tensor the ring.
        testing::expect(pg->all_reduce_algorithm_for(buffer) == (world_size > 1 ? "direct" : "ring") &&
                            pg->all_reduce_algorithm_for(Tensor::zeros({c.numel})) == "ring",
                        what, ": all_reduce_algorithm_for says ", pg->all_reduce_algorithm_for(buffer));
        // Values whose float32 sums round differently in different orders; NaN on the last rank.
        Generator gen(1000 + rank);
        Tensor values = Tensor::randn({c.numel}, gen);
        if (c.op == ReduceOp::Max && rank == world_size - 1) values.data<float>()[1] = NAN;
        Tensor ring = c.dtype == DType::Int64       ? Tensor::from_vector([&] {
                                                      std::vector<int64_t> v(c.numel);
                                                      for (int64_t i = 0; i < c.numel; ++i) v[i] = (i * 7 + rank * 13) % 101 - 50;
                                                      return v;
                                                    }())
                      : c.dtype == DType::BFloat16 ? Tensor::empty({c.numel}, DType::BFloat16)
                                                   : values.clone();
        if (c.dtype == DType::BFloat16)
          for (int64_t i = 0; i < c.numel; ++i) ring.data<BFloat16>()[i] = BFloat16::from_float(values.data<float>()[i]);
        std::memcpy(bytes(buffer), bytes(ring), ring.nbytes());
        pg->all_reduce(ring, c.op)->wait();
        pg->all_reduce(buffer, c.op)->wait();
        testing::expect(std::memcmp(bytes(buffer), bytes(ring), ring.nbytes()) == 0, what,
                        ": the direct all-reduce differs from the ring");
        if (c.op == ReduceOp::Max) testing::expect(std::isnan(buffer.data<float>()[1]), what, ": NaN lost");
      }
      // Twice in a row on one buffer: the last rendezvous keeps a rank from overwriting what a
      // peer still reads.
      Tensor counts = pg->new_collective_buffer(4096, DType::Int64, Device::cpu());
      for (int64_t step = 1; step <= 20; ++step) {
        for (int64_t i = 0; i < 4096; ++i) counts.data<int64_t>()[i] = step * (rank + 1) + i;
        pg->all_reduce(counts)->wait();
        const int64_t ranks_sum = world_size * (world_size + 1) / 2;
        for (int64_t i : {int64_t{0}, int64_t{2047}, int64_t{4095}})
          testing::expect(counts.data<int64_t>()[i] == step * ranks_sum + world_size * i, "step ", step,
                          ": element ", i, " is ", counts.data<int64_t>()[i]);
      }
      pg->barrier()->wait();
      testing::expect(shm_entries("nanoddp." + std::to_string(::getpid()) + ".").empty(),
                      "a collective buffer still has a name in /dev/shm");
      destroy_process_group();
      counts.data<int64_t>()[0] = 1;  // still mapped: the tensor owns its buffer
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("shm: reduce_scatter only reads its inputs, and gives the ring all_reduce's bits") {
  // S = 70001 floats is two slots' worth, so the running sums travel piece by piece, through
  // the one scratch part, at 3 and 4 ranks.
  for (int world_size : {2, 3, 4}) {
    CAPTURE(world_size);
    int port = testing::free_port();
    std::string failures = testing::run_ranks(world_size, [&](int rank) {
      auto pg = join(port, rank, world_size);
      for (auto [dtype, op] : {std::pair{DType::Float32, ReduceOp::Sum}, std::pair{DType::Float32, ReduceOp::Avg},
                               std::pair{DType::Float32, ReduceOp::Max}, std::pair{DType::Float16, ReduceOp::Sum},
                               std::pair{DType::BFloat16, ReduceOp::Sum}}) {
        const std::string what = std::string(dtype_name(dtype)) + " " + reduce_op_name(op);
        const int64_t S = dtype == DType::Float32 ? 70001 : 140001;
        // Values whose sums round differently in different orders.
        Generator gen(2000 + rank);
        Tensor values = Tensor::randn({S * world_size}, gen);
        Tensor flat = dtype == DType::Float32 ? values : Tensor::empty({S * world_size}, dtype);
        for (int64_t i = 0; dtype != DType::Float32 && i < flat.numel(); ++i) {
          const float v = values.data<float>()[i];
          if (dtype == DType::Float16) flat.data<Float16>()[i] = Float16::from_float(v);
          else flat.data<BFloat16>()[i] = BFloat16::from_float(v);
        }
        std::vector<Tensor> inputs;
        for (int r = 0; r < world_size; ++r) inputs.push_back(flat.slice_view(r * S, {S}).clone());
        const Tensor before = flat.clone();
        Tensor output = Tensor::empty({S}, dtype);
        pg->reduce_scatter(output, inputs, op)->wait();
        for (int r = 0; r < world_size; ++r)
          testing::expect(std::memcmp(bytes(inputs[r]), bytes(before) + r * inputs[r].nbytes(), inputs[r].nbytes()) == 0,
                          what, ": input ", r, " was changed");
        Tensor ring = before.clone();
        pg->all_reduce(ring, op)->wait();
        testing::expect(std::memcmp(bytes(output), bytes(ring) + rank * output.nbytes(), output.nbytes()) == 0, what,
                        ": the result differs from part ", rank, " of the ring all-reduce");
      }
      destroy_process_group();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

// Note [Bytes moved]: the ring cuts 2 floats on 3 ranks into parts of 1, 1 and 0 elements, so
// rank 0 sends 8 bytes and ranks 1 and 2 send 12 (the formula's 10.7 is nobody's); the direct
// all-reduce posts nothing and reads 12, 12 and 8 bytes from its peers' buffers.
TEST_CASE("shm: bytes moved are measured as they cross: 8 or 12 for the ring's 8 bytes on 3 ranks, read in place by direct") {
  const int port = testing::free_port();
  const std::string failures = testing::run_ranks(3, [port](int rank) {
    auto pg = join(port, rank, 3, 30000ms, /*check_collectives=*/false);  // no fingerprints in the count
    Tensor plain = Tensor::from_vector({1.0f, 2.0f});
    const MovedBytes before = pg->moved_bytes();
    testing::expect(before.measured, "rank ", rank, ": shm does not measure");
    pg->all_reduce(plain)->wait();
    const MovedBytes after_ring = pg->moved_bytes();
    const int64_t ring_bytes = after_ring.bytes - before.bytes;
    testing::expect(ring_bytes == (rank == 0 ? 8 : 12), "rank ", rank, ": the ring moved ", ring_bytes, " bytes");
    testing::expect(after_ring.all_reduces_by_algorithm.at("ring") == 1, "rank ", rank, ": ring all-reduces ",
                    after_ring.all_reduces_by_algorithm.at("ring"));
    Tensor buffer = pg->new_collective_buffer(2, DType::Float32, Device::cpu());
    buffer.copy_(Tensor::from_vector({1.0f, 2.0f}));
    const MovedBytes before_direct = pg->moved_bytes();
    pg->all_reduce(buffer)->wait();
    const MovedBytes after_direct = pg->moved_bytes();
    const int64_t direct_bytes = after_direct.bytes - before_direct.bytes;
    testing::expect(direct_bytes == (rank == 2 ? 8 : 12), "rank ", rank, ": the direct all-reduce moved ",
                    direct_bytes, " bytes");
    testing::expect(after_direct.all_reduces_by_algorithm.at("direct") == 1 && buffer.to_vector()[1] == 6.0f,
                    "rank ", rank, ": direct all-reduces ", after_direct.all_reduces_by_algorithm.at("direct"));
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("shm: collective buffers that ranks disagree on are named on both sides") {
  int port = testing::free_port();
  std::string failures = testing::run_ranks(2, [&](int rank) {
    auto pg = join(port, rank, 2, 20000ms, /*check_collectives=*/false);
    // One rank passes its buffer, the other an ordinary tensor of the same size: the ring
    // and the direct all-reduce must not wait for each other until the timeout.
    Tensor buffer = pg->new_collective_buffer(1000, DType::Float32, Device::cpu());
    Tensor plain = Tensor::ones({1000});
    auto start = std::chrono::steady_clock::now();
    std::string what = error_of([&] { pg->all_reduce(rank == 0 ? buffer : plain)->wait(20000ms); });
    testing::expect(what.find("in collective buffer #0") != std::string::npos, "message: ", what);
    testing::expect(std::chrono::steady_clock::now() - start < 2000ms, "noticed late");
  });
  CHECK_MESSAGE(failures.empty(), failures);

  port = testing::free_port();
  failures = testing::run_ranks(2, [&](int rank) {
    auto pg = join(port, rank, 2, 20000ms);
    std::string what = error_of([&] { pg->new_collective_buffer(4 + rank, DType::Float32, Device::cpu()); });
    testing::expect(what.find(rank == 0 ? "rank 1 made its buffer #0 20 bytes, this rank 16"
                                        : "rank 0 made its buffer #0 16 bytes, this rank 20") != std::string::npos,
                    "message: ", what);
    // Nothing was mapped: the group is still usable, and this keeps rank 0 (the store's
    // server) alive until rank 1 has its message.
    pg->barrier()->wait();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("shm: a peer that exits is reported within a fraction of the timeout") {
  int port = testing::free_port();
  std::string failures = testing::run_ranks(2, [&](int rank) {
    auto pg = join(port, rank, 2, 20000ms, /*check_collectives=*/false);
    pg->barrier()->wait();
    if (rank == 1) ::_exit(0);  // gone without a word
    Tensor t = Tensor::ones({1000});
    auto start = std::chrono::steady_clock::now();
    std::string what = error_of([&] { pg->all_reduce(t)->wait(20000ms); });
    testing::expect(what.find("rank 1 (pid") != std::string::npos && what.find("exited") != std::string::npos,
                    "message: '", what, "'");
    testing::expect(std::chrono::steady_clock::now() - start < 2000ms, "noticed late");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("shm: a segment past the file size limit (ulimit -f) is an error naming the limit, not SIGXFSZ") {
  // /dev/shm counts against RLIMIT_FSIZE; sizing the segment past it raised SIGXFSZ, which
  // ended rank 0 before it could say why (Note [File size limit]).
  const int port = testing::free_port();
  const std::string failures = testing::run_ranks(2, [&](int rank) {
    ::signal(SIGXFSZ, SIG_DFL);
    const rlimit limit{65536, 65536};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    const std::string what = error_of([&] { join(port, rank, 2, 10000ms); });
    if (rank == 0) {  // rank 0 makes the segment; rank 1 then loses the store it served
      testing::expect(what.find("sizing the segment") != std::string::npos &&
                          what.find("File too large (the file size limit, ulimit -f, is 65536 bytes)") !=
                              std::string::npos &&
                          what.find("the gloo backend needs no shared memory (--backend gloo)") !=
                              std::string::npos,
                      "message: '", what, "'");
    } else {
      testing::expect(what.find("rank 0") != std::string::npos, "rank 1's message: '", what, "'");
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("shm: the segment has no name once the group is up, and stale ones are removed") {
  // A segment named as if its creator (a reaped child, so a pid that no longer runs) died
  // between creating it and the unlink.
  pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  const std::string stale = "nanoddp." + std::to_string(dead) + ".0";
  int fd = ::shm_open(("/" + stale).c_str(), O_CREAT | O_RDWR, 0600);
  REQUIRE(fd >= 0);
  ::close(fd);
  REQUIRE(shm_entries(stale).size() == 1);

  int port = testing::free_port();
  std::string failures = testing::run_ranks(3, [&](int rank) {
    auto pg = join(port, rank, 3);
    pg->barrier()->wait();
    // Every rank has mapped it, so rank 0 has unlinked its name.
    if (rank == 0)
      testing::expect(shm_entries("nanoddp." + std::to_string(::getpid()) + ".").empty(),
                      "rank 0's segment still has a name in /dev/shm");
    testing::expect(shm_entries(stale).empty(), "the stale segment ", stale, " is still there");
    Tensor t = Tensor::ones({10});
    pg->all_reduce(t)->wait();
    testing::expect_values(
        t, [](int64_t) { return 3.0; }, "all_reduce after setup");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("shm: a waiting rank sleeps instead of spinning") {
  int port = testing::free_port();
  std::string failures = testing::run_ranks(2, [&](int rank) {
    auto pg = join(port, rank, 2);
    pg->barrier()->wait();
    if (rank == 1) std::this_thread::sleep_for(800ms);
    const double cpu_before = cpu_seconds();
    Tensor t = Tensor::ones({16});
    pg->all_reduce(t)->wait();
    const double cpu = cpu_seconds() - cpu_before;
    testing::expect_values(
        t, [](int64_t) { return 2.0; }, "all_reduce");
    // Rank 0 waited ~800 ms; spinning would have cost as much CPU time.
    if (rank == 0) testing::expect(cpu < 0.1, "rank 0 used ", cpu, " s of CPU while waiting");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("shm: max and min propagate NaN; sum carries it") {
  for (int world_size : {2, 3}) {
    CAPTURE(world_size);
    int port = testing::free_port();
    std::string failures = testing::run_ranks(world_size, [&](int rank) {
      auto pg = join(port, rank, world_size);
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (ReduceOp op : {ReduceOp::Max, ReduceOp::Min, ReduceOp::Sum}) {
        // Element i is NaN on rank i % world_size only (the first, a middle or the last rank);
        // element 3 is NaN nowhere.
        std::vector<float> v = {1.0f + rank, 1.0f + rank, 1.0f + rank, 1.0f + rank};
        if (rank < 3) v[rank] = nan;
        Tensor t = Tensor::from_vector(v);
        pg->all_reduce(t, op)->wait();
        auto out = t.to_vector();
        for (int i = 0; i < 3; ++i)
          testing::expect(i >= world_size || std::isnan(out[i]), reduce_op_name(op), ": element ", i, " is ",
                          out[i], ", expected NaN");
        const double want = op == ReduceOp::Max   ? world_size
                            : op == ReduceOp::Min ? 1.0
                                                  : world_size * (world_size + 1) / 2.0;
        testing::expect(out[3] == want, reduce_op_name(op), ": element 3 is ", out[3]);
      }
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("shm: send and recv, in order, both ways at once, with the wrong tag named") {
  int port = testing::free_port();
  std::string failures = testing::run_ranks(3, [&](int rank) {
    auto pg = join(port, rank, 3, 20000ms);
    // An exchange of 3 MB each way between ranks 0 and 1, far more than the channel holds:
    // it completes only if both sends progress while both receives do.
    if (rank < 2) {
      const int peer = 1 - rank;
      const int64_t n = 3 << 18;
      Tensor out =
          testing::make_tensor(DType::Float32, n, [&](int64_t i) { return rank * 1e6 + (i % 1000); });
      Tensor in = Tensor::zeros({n});
      auto sent = pg->send(out, peer);
      auto received = pg->recv(in, peer);
      received->wait();
      sent->wait();
      testing::expect_values(
          in, [&](int64_t i) { return peer * 1e6 + (i % 1000); }, "exchange");
    }
    // Three messages from 2 to 0 arrive in the order sent; an int64 one keeps its values.
    if (rank == 2) {
      for (int k = 0; k < 3; ++k) {
        Tensor m = testing::make_tensor(DType::Int64, 5, [&](int64_t i) { return 10 * k + i; });
        pg->send(m, 0, /*tag=*/7)->wait();
      }
    }
    if (rank == 0) {
      for (int k = 0; k < 3; ++k) {
        Tensor m = Tensor::zeros({5}, DType::Int64);
        pg->recv(m, 2, 7)->wait();
        testing::expect_values(
            m, [&](int64_t i) { return 10.0 * k + i; }, "message " + std::to_string(k));
      }
    }
    Tensor t = Tensor::ones({2});
    testing::expect(!error_of([&] { pg->send(t, rank); }).empty(), "a send to itself was accepted");
    testing::expect(!error_of([&] { pg->recv(t, 3); }).empty(), "a recv from rank 3 was accepted");
    pg->barrier()->wait();
    // A tag that does not match is reported by the receiver.
    if (rank == 1) pg->send(t, 0, /*tag=*/1)->wait();
    if (rank == 0) {
      std::string what = error_of([&] { pg->recv(t, 1, /*tag=*/2)->wait(); });
      testing::expect(what.find("tag 1") != std::string::npos && what.find("tag 2") != std::string::npos &&
                          what.find("received in the order sent, whatever their tags") != std::string::npos,
                      "message: '", what, "'");
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("shm: a message sent before a collective and received after it is a DistError that says why") {
  // torch's isend, all_reduce, irecv works on Gloo; shm's pair channel is one queue, in order.
  const int port = testing::free_port();
  const std::string failures = testing::run_ranks(2, [&](int rank) {
    auto pg = join(port, rank, 2, 20000ms);
    Tensor message = Tensor::full({1}, 42.0f), x = Tensor::ones({2});
    const std::string error = error_of([&] {
      std::shared_ptr<dist::Work> sent;
      if (rank == 0) sent = pg->send(message, 1);
      pg->all_reduce(x)->wait();
      if (rank == 1) pg->recv(message, 0)->wait();
      if (sent) sent->wait();
    });
    testing::expect(!error.empty(), "rank ", rank, ": no error");
    if (rank == 1)
      testing::expect(
          error.find("a message sent before a collective is received before it") != std::string::npos,
          "rank 1: '", error, "'");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

#if NANODDP_WITH_GLOO
TEST_CASE("shm+gloo: auto picks two levels for 2 nodes x 2 ranks, and every collective is exact") {
  int port = testing::free_port();
  std::string failures = testing::run_ranks(4, [&](int rank) {
    // What nanoddp-run --nnodes 2 --node-rank k --nproc-per-node 2 sets (node = GROUP_RANK).
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("WORLD_SIZE", "4", 1);
    ::setenv("LOCAL_RANK", std::to_string(rank % 2).c_str(), 1);
    ::setenv("LOCAL_WORLD_SIZE", "2", 1);
    ::setenv("GROUP_RANK", std::to_string(rank / 2).c_str(), 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    ::unsetenv("NANODDP_BACKEND");
    InitOptions o;
    o.timeout = 30000ms;
    auto pg = init_process_group(o);
    testing::expect(pg->backend_name() == "shm+gloo", "auto picked ", pg->backend_name());
    testing::check_collectives(*pg, {1, 7, 1000, 65537});
    testing::check_large_collectives(*pg);
    destroy_process_group();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}
#endif
