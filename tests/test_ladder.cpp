// The ladder's rungs (examples/ladder/) on real process groups: each equals one process on the
// global batch, issues exactly the all_reduces its header states, and accumulates uneven
// micro-batches into the big batch's gradient. Cases run their ranks on Gloo, forked; the
// last case reruns this file with NANODDP_TEST_BACKEND=shm.
#include <doctest/doctest.h>

#include <cstdlib>

#include "dist/explain.h"
#include "dist/gradient_accumulation.h"
#include "dist/init.h"
#include "tests/batches.h"
#include "tests/dist_ranks.h"
#include "tests/ladder_checks.h"
#include "tests/multiprocess.h"
#include "tests/subprocess.h"

using namespace nanoddp;
using namespace nanoddp::ladder_checks;
using nanoddp::testing::expect;
using nanoddp::testing::on_ranks;
using namespace std::chrono_literals;

namespace {

const char* const kRungs[] = {"naive", "flat", "overlap", "buckets", "zero1", "fsdp"};

nn::StateDict gradients_of(nn::Module& model) {
  nn::StateDict grads;
  for (auto& [name, param] : model.named_parameters()) grads[name] = param.grad().clone();
  return grads;
}

// One process, the whole batch: the gradient every accumulation must reproduce.
nn::StateDict big_batch_gradient(const Batch& b) {
  auto model = make_mlp(7);
  cross_entropy((*model)(b.x), b.y).backward();
  return gradients_of(*model);
}

// A model with no data parallelism around it: no_sync has nothing to hold back.
struct Local {
  nn::Module& model;
  Tensor operator()(const Tensor& x) { return model(x); }
  struct NoSyncGuard {};
  NoSyncGuard no_sync() { return {}; }
};

std::vector<dist::MicroBatch> micro_batches(const Batch& b, const std::vector<int64_t>& sizes) {
  std::vector<dist::MicroBatch> micro;
  int64_t begin = 0;
  for (int64_t n : sizes) {
    const Batch part = rows(b, begin, begin + n);
    micro.push_back({part.x, part.y});
    begin += n;
  }
  return micro;
}

Tensor cross_entropy_loss(const Tensor& out, const Tensor& y) { return cross_entropy(out, y); }

}  // namespace

TEST_CASE("2 ranks: every rung (naive, flat, overlap, buckets, zero1, fsdp) equals one process on the global batch within 2e-5 (MLP, CNN; 4 SGD steps)") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(
      2,
      [&](int rank) {
        auto pg = testing::join(rank, 2, port);
        for (const char* rung : kRungs) {
          const std::string problem = equals_one_process(rung, pg);
          expect(problem.empty(), problem);
        }
      },
      240s);
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("2 ranks: after a backward that a hook ends by an exception on every rank, every rung trains on as if it had not happened") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(
      2,
      [&](int rank) {
        auto pg = testing::join(rank, 2, port);
        for (const char* rung : kRungs) {
          const std::string problem = equals_one_process(rung, pg, /*interrupt_first=*/true);
          expect(problem.empty(), problem);
        }
      },
      240s);
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("one step of the MLP: naive 4 all_reduces, flat 1, overlap 4, buckets 1, of 228 bytes in all; the same accumulated over 3 micro-batches") {
  // The MLP's 4 parameters hold 57 floats: 228 bytes, whatever the number of calls.
  CHECK(kMlpGradientBytes == 228);
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port);
    for (const char* rung : {"naive", "flat", "overlap", "buckets"}) {
      const StepCount got = count_one_step(rung, pg);
      const StepCount want = expected_step_count(rung);
      expect(got.calls == want.calls && got.bytes == want.bytes && got.other_collectives == 0, "rank ", rank,
             " ", rung, ": ", got.calls, " all_reduce calls of ", got.bytes, " bytes and ",
             got.other_collectives, " other collectives; expected ", want.calls, " calls of ", want.bytes,
             " bytes");
      // no_sync on the first two micro-batches: the step still reduces once per parameter or bucket.
      const std::string accumulated = counts_match(rung, pg, /*micro_batches=*/3);
      expect(accumulated.empty(), accumulated);
      if (std::string(rung) != "buckets") {  // and the sum is the big batch's, as one process's
        const std::string values = gradient_matches(rung, pg, /*micro_batches=*/3);
        expect(values.empty(), values);
      }
    }
    expect(expected_step_count("naive").calls == 4 && expected_step_count("flat").calls == 1 &&
               expected_step_count("overlap").calls == 4,
           "the rungs' promised counts changed");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("uneven micro-batches (5, 3, 4 rows) weighted by their share of the samples give the big batch's gradient; weights of 1/k do not") {
  const Batch b = global_batch(0, 5);
  const nn::StateDict want = big_batch_gradient(b);

  auto model = make_mlp(7);
  Local local{*model};
  const Tensor loss = dist::accumulate_gradients(local, micro_batches(b, {5, 3, 4}), cross_entropy_loss);
  const std::string report = differences(gradients_of(*model), want, 1e-6f);
  CHECK_MESSAGE(report.empty(), "weighted by n_i / N:\n", report);
  // The returned loss is the big batch's mean loss.
  auto again = make_mlp(7);
  CHECK(loss.item() == doctest::Approx(cross_entropy((*again)(b.x), b.y).item()).epsilon(1e-6));

  // The bug this guards against: a mean of the micro-batch means.
  auto wrong = make_mlp(7);
  for (const dist::MicroBatch& m : micro_batches(b, {5, 3, 4}))
    (cross_entropy((*wrong)(m.input), m.target) * (1.0f / 3)).backward();
  CHECK_MESSAGE(
      !differences(gradients_of(*wrong), want, 1e-4f).empty(),
      "weights of 1/k matched the big batch: the micro-batches are not uneven enough to test anything");
}

TEST_CASE("accumulate_gradients with a loss scale of 1024: every gradient exactly 1024 times the unscaled one, the loss unscaled") {
  const Batch b = global_batch(0, 5);
  auto plain = make_mlp(7), scaled = make_mlp(7);
  Local plain_local{*plain}, scaled_local{*scaled};
  const Tensor plain_loss = dist::accumulate_gradients(plain_local, micro_batches(b, {5, 3, 4}), cross_entropy_loss);
  const Tensor scaled_loss =
      dist::accumulate_gradients(scaled_local, micro_batches(b, {5, 3, 4}), cross_entropy_loss, 1024.0f);
  CHECK(scaled_loss.item() == plain_loss.item());
  // A power of two scales every float exactly (none of these overflow or fall below normal).
  const nn::StateDict want = gradients_of(*plain), got = gradients_of(*scaled);
  for (const auto& [key, grad] : want) {
    const std::string name = key;  // CAPTURE cannot name a structured binding (C++17)
    CAPTURE(name);
    std::vector<float> times_1024 = grad.to_vector();
    for (float& g : times_1024) g *= 1024.0f;
    CHECK(got.at(name).to_vector() == times_1024);
  }
}

TEST_CASE("split_micro_batches: 12 rows in 5 micro-batches are 3, 3, 2, 2, 2 consecutive rows; 13 micro-batches is a ValueError") {
  const Batch b = global_batch(0, 5);
  const auto micro = dist::split_micro_batches(b.x, b.y, 5);
  REQUIRE(micro.size() == 5);
  const std::vector<int64_t> sizes = {3, 3, 2, 2, 2};
  int64_t begin = 0;
  for (size_t i = 0; i < micro.size(); ++i) {
    CHECK(micro[i].input.size(0) == sizes[i]);
    CHECK(micro[i].input.size(1) == 5);
    CHECK(micro[i].input.to_vector() == rows(b, begin, begin + sizes[i]).x.to_vector());
    CHECK(micro[i].target.to_int_vector() == rows(b, begin, begin + sizes[i]).y.to_int_vector());
    begin += sizes[i];
  }
  CHECK_THROWS_AS(dist::split_micro_batches(b.x, b.y, 13), ValueError);
  CHECK_THROWS_AS(dist::split_micro_batches(b.x, b.y, 0), ValueError);
}

TEST_CASE("2 ranks: every rung accumulating uneven micro-batches (3, 1, 2 rows per rank) gives one process's big-batch gradient") {
  const Batch global = global_batch(0, 5);
  const nn::StateDict want = big_batch_gradient(global);
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port);
    const Batch mine = share(global, rank, 2);
    for (const char* rung : {"naive", "flat", "overlap", "buckets"}) {
      auto model = make_mlp(rank == 0 ? 7 : 99);
      nn::StateDict got;
      if (std::string(rung) == "buckets") {
        dist::DistributedDataParallel ddp(model, pg);
        dist::accumulate_gradients(ddp, micro_batches(mine, {3, 1, 2}), cross_entropy_loss);
      } else {
        auto dp = make_rung(rung, model, pg);
        dist::accumulate_gradients(*dp, micro_batches(mine, {3, 1, 2}), cross_entropy_loss);
        dp->finish_gradient_sync();
      }
      const std::string report = differences(gradients_of(*model), want, 1e-6f);
      expect(report.empty(), "rank ", rank, " ", rung, " accumulating 3, 1, 2 rows:\n", report);
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("a rung whose parameter got no gradient throws a DistError naming it") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port);
    for (const char* rung : {"naive", "flat"}) {
      auto model = make_mlp(7);
      auto dp = make_rung(rung, model, pg);
      const Batch b = share(global_batch(0, 5), rank, 2);
      (*dp)(b.x);  // no backward: no parameter has a gradient
      bool named = false;
      try {
        dp->finish_gradient_sync();
      } catch (const DistError& e) {
        named = std::string(e.what()).find("0.weight") != std::string::npos;
      }
      expect(named, "rank ", rank, " ", rung, ": no DistError naming 0.weight");
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE(
    "2 ranks: every rung reduces only trainable parameters (a frozen first layer), and throws DistError for "
    "a layer "
    "that got no gradient") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port);
    for (const char* rung : {"naive", "flat", "overlap"}) {
      const std::string frozen = ladder_checks::frozen_layer_problems(rung, pg);
      expect(frozen.empty(), frozen);
      const std::string unused = ladder_checks::unused_parameter_problems(rung, pg);
      expect(unused.empty(), unused);
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("docs answers: one step of fashion_mnist's MLP (235146 parameters) at 2 ranks: naive 6 all_reduces, flat 1, overlap 6, buckets 1, each step 940584 bytes") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port);
    for (const char* rung : {"naive", "flat", "overlap", "buckets"}) {
      // fashion_mnist's default MLP: 784 -> 256 -> 128 -> 10, 6 parameters.
      auto model = testing::make_fashion_mnist_mlp();
      expect(dist::numel_of(model->parameters()) == 235146, "the MLP has ",
             dist::numel_of(model->parameters()), " parameters");
      const StepCount got = count_one_step(rung, pg, 1, model, 784);
      const int64_t calls = std::string(rung) == "flat" || std::string(rung) == "buckets" ? 1 : 6;
      expect(got.calls == calls && got.bytes == 940584, "rank ", rank, " ", rung, ": ", got.calls,
             " all_reduce calls of ", got.bytes, " bytes; expected ", calls, " of 940584");
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("every case passes on the shm backend too (this file with NANODDP_TEST_BACKEND=shm)") {
  if (std::getenv("NANODDP_TEST_BACKEND") != nullptr) return;
  const testing::RunResult r = testing::run(
      {"/bin/sh", "-c", "NANODDP_TEST_BACKEND=shm exec \"$0\" --test-case-exclude='*NANODDP_TEST_BACKEND*'",
       testing::built("tests/test_ladder")},
      300s);
  CHECK_MESSAGE(r.code() == 0, "shm run failed:\n", r.out, r.err);
}
