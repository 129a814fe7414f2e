// dist::GradScaler: torch.amp.GradScaler's growth and backoff, its errors and state_dict; the
// scaled float32 step bit for bit the unscaled one; and an inf on one rank only making every
// rank skip, halve the scale and keep its parameters, at 2 and 4 ranks on Gloo, shm (this
// file again with NANODDP_TEST_BACKEND=shm) and MPI (this file under mpirun).
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/ops.h"
#include "dist/ddp.h"
#include "dist/grad_scaler.h"
#include "dist/host_collectives.h"
#include "dist/join.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "tests/batches.h"
#include "tests/dist_ranks.h"
#include "tests/multiprocess.h"

using namespace nanoddp;
using nanoddp::testing::Batch;
using nanoddp::testing::expect;
using nanoddp::testing::make_mlp;
using nanoddp::testing::on_ranks;
using nanoddp::testing::under_mpirun;
using namespace std::chrono_literals;

namespace {

std::vector<std::vector<float>> values_of(const std::vector<Tensor>& params) {
  std::vector<std::vector<float>> values;
  for (const Tensor& p : params) values.push_back(p.to_vector());
  return values;
}

// One scaled step of the MLP on batch b; returns whether the optimizer stepped.
bool scaled_step(nn::Sequential& model, nn::Optimizer& opt, dist::GradScaler& scaler, const Batch& b) {
  opt.zero_grad();
  scaler.scale(cross_entropy(model(b.x), b.y)).backward();
  const bool stepped = scaler.step(opt);
  scaler.update();
  return stepped;
}

}  // namespace

TEST_CASE("growth after growth_interval finite steps, backoff on inf, update(new_scale), PyTorch's defaults") {
  const dist::GradScalerOptions defaults;
  CHECK(defaults.init_scale == 65536.0f);
  CHECK(defaults.growth_factor == 2.0f);
  CHECK(defaults.backoff_factor == 0.5f);
  CHECK(defaults.growth_interval == 2000);

  auto model = make_mlp(1);
  nn::SGD opt(model->parameters(), {/*lr=*/0.1});
  dist::GradScaler scaler({/*init_scale=*/8.0f, 2.0f, 0.5f, /*growth_interval=*/2});
  const Batch b = testing::random_batch(10, 4, 5, 3);
  CHECK(scaled_step(*model, opt, scaler, b));
  CHECK(scaler.get_scale() == 8.0f);
  CHECK(scaler.growth_tracker() == 1);
  CHECK(scaled_step(*model, opt, scaler, b));
  CHECK(scaler.get_scale() == 16.0f);  // 2 finite steps in a row
  CHECK(scaler.growth_tracker() == 0);
  CHECK(scaled_step(*model, opt, scaler, b));
  CHECK(scaler.growth_tracker() == 1);

  // A NaN gradient: the step is skipped, the scale halves, the count restarts.
  opt.zero_grad();
  scaler.scale(cross_entropy((*model)(b.x), b.y)).backward();
  model->parameters()[0].grad().copy_(Tensor::full(model->parameters()[0].shape(), std::nanf("")));
  const auto before = values_of(model->parameters());
  CHECK_FALSE(scaler.step(opt));
  CHECK(scaler.found_inf(opt));
  scaler.update();
  CHECK(values_of(model->parameters()) == before);
  CHECK(scaler.get_scale() == 8.0f);
  CHECK(scaler.growth_tracker() == 0);

  scaler.update(3.0f);
  CHECK(scaler.get_scale() == 3.0f);
}

TEST_CASE(
    "the scale is multiplied by the factors in double and rounded once, as torch's _amp_update_scale_") {
  auto model = make_mlp(7);
  nn::SGD opt(model->parameters(), {/*lr=*/0.0});
  const Batch b = testing::random_batch(70, 4, 5, 3);
  auto step_with = [&](dist::GradScaler& scaler, bool inf) {
    opt.zero_grad();
    scaler.scale(cross_entropy((*model)(b.x), b.y)).backward();
    if (inf) model->parameters()[0].grad().fill_(INFINITY);
    scaler.step(opt);
    scaler.update();
  };
  // torch 1.13: GradScaler(65536, growth_factor=2, backoff_factor=0.1, growth_interval=2).
  dist::GradScaler backoff({65536.0f, 2.0, /*backoff_factor=*/0.1, /*growth_interval=*/2});
  const std::vector<float> torch_scales = {6553.60009765625f, 655.3599853515625f, 65.53599548339844f};
  for (float expected : torch_scales) {
    step_with(backoff, /*inf=*/true);
    CHECK(backoff.get_scale() == expected);
  }
  step_with(backoff, false);
  step_with(backoff, false);
  CHECK(backoff.get_scale() == 131.07199096679688f);
  // Resumed from its state_dict after the first backoff, the same scales follow.
  dist::GradScaler first({65536.0f, 2.0, 0.1, 2});
  step_with(first, true);
  dist::GradScaler resumed({65536.0f, 2.0, 0.1, 2});
  resumed.load_state_dict(first.state_dict());
  step_with(resumed, true);
  step_with(resumed, true);
  CHECK(resumed.get_scale() == torch_scales[2]);
  // growth_factor 1.1 every step from 1: the seventh growth is torch's 1.94871724.
  dist::GradScaler growth({1.0f, /*growth_factor=*/1.1, 0.5, /*growth_interval=*/1});
  for (int i = 0; i < 7; ++i) step_with(growth, false);
  CHECK(growth.get_scale() == 1.9487172365188599f);
}

TEST_CASE("the scaled float32 step is bit for bit the unscaled one (powers of two scale exactly)") {
  auto plain = make_mlp(2), scaled = make_mlp(2);
  nn::SGD plain_opt(plain->parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
  nn::SGD scaled_opt(scaled->parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
  dist::GradScaler scaler;
  for (int step = 0; step < 5; ++step) {
    const Batch b = testing::random_batch(20 + static_cast<uint64_t>(step), 8, 5, 3);
    plain_opt.zero_grad();
    cross_entropy((*plain)(b.x), b.y).backward();
    plain_opt.step();
    CHECK(scaled_step(*scaled, scaled_opt, scaler, b));
  }
  CHECK(values_of(scaled->parameters()) == values_of(plain->parameters()));
  CHECK(scaler.get_scale() == 65536.0f);
  CHECK(scaler.growth_tracker() == 5);
}

TEST_CASE("unscale_ and step out of order are errors; state_dict round trips; a disabled scaler does nothing") {
  auto model = make_mlp(3);
  nn::SGD opt(model->parameters(), {/*lr=*/0.1});
  dist::GradScaler scaler({/*init_scale=*/1024.0f, 4.0f, 0.25f, /*growth_interval=*/7});
  const Batch b = testing::random_batch(30, 4, 5, 3);
  CHECK_THROWS_WITH_AS(scaler.update(), doctest::Contains("no inf checks were recorded"), ValueError);
  scaler.scale(cross_entropy((*model)(b.x), b.y)).backward();
  scaler.unscale_(opt);
  CHECK_THROWS_WITH_AS(scaler.unscale_(opt), doctest::Contains("has already been called on this optimizer"),
                       ValueError);
  CHECK(scaler.step(opt));
  CHECK_THROWS_WITH_AS(scaler.step(opt), doctest::Contains("has already been called since the last update"),
                       ValueError);
  CHECK_THROWS_WITH_AS(scaler.unscale_(opt), doctest::Contains("after step()"), ValueError);
  scaler.update();

  const nn::StateDict state = scaler.state_dict();
  CHECK(state.at("scale").to_vector() == std::vector<float>{1024.0f});
  CHECK(state.at("growth_factor").to_vector() == std::vector<float>{4.0f});
  CHECK(state.at("backoff_factor").to_vector() == std::vector<float>{0.25f});
  CHECK(state.at("growth_interval").to_int_vector() == std::vector<int64_t>{7});
  CHECK(state.at("_growth_tracker").to_int_vector() == std::vector<int64_t>{1});
  dist::GradScaler restored;
  restored.load_state_dict(state);
  CHECK(restored.get_scale() == 1024.0f);
  CHECK(restored.growth_tracker() == 1);
  CHECK(restored.state_dict().at("growth_interval").to_int_vector() == std::vector<int64_t>{7});
  nn::StateDict broken = state;
  broken.erase("scale");
  CHECK_THROWS_WITH_AS(restored.load_state_dict(broken), doctest::Contains("no \"scale\""), ValueError);

  // A scale backed off to 0 (2^-126 times 2^-30; torch's goes there too after 166 infs in a
  // row from 65536) is a state the scaler saved: it loads back. A negative one does not.
  dist::GradScaler vanishing(
      {/*init_scale=*/std::ldexp(1.0f, -126), 2.0f, /*backoff_factor=*/std::ldexp(1.0, -30), 2000});
  for (Tensor p : opt.params()) p.set_grad(Tensor::full(p.shape(), INFINITY));
  CHECK_FALSE(vanishing.step(opt));
  vanishing.update();
  CHECK(vanishing.get_scale() == 0.0f);
  restored.load_state_dict(vanishing.state_dict());
  CHECK(restored.get_scale() == 0.0f);
  // With it, 1/scale is inf: the step is refused by name, not taken with 0 x inf = NaN
  // gradients (or skipped for ever), and the parameters keep their values.
  const auto before_zero_scale = values_of(opt.params());
  CHECK_THROWS_WITH_AS(scaled_step(*model, opt, restored, b),
                       doctest::Contains("so small that 1/scale is not finite in float32"), ValueError);
  CHECK(values_of(opt.params()) == before_zero_scale);
  // An integer loss is named as the scaler's.
  CHECK_THROWS_WITH_AS(
      restored.scale(Tensor::zeros({1}, DType::Int64)),
      doctest::Contains("GradScaler::scale: the loss must be float32, float16 or bfloat16, got int64"),
      ValueError);
  nn::StateDict negative = vanishing.state_dict();
  negative.at("scale") = Tensor::from_vector({-1.0f});
  CHECK_THROWS_WITH_AS(restored.load_state_dict(negative),
                       doctest::Contains("\"scale\" must be a finite number >= 0"), ValueError);

  CHECK_THROWS_AS(dist::GradScaler({/*init_scale=*/0.0f}), ValueError);
  CHECK_THROWS_AS(dist::GradScaler({65536.0f, /*growth_factor=*/1.0f}), ValueError);
  CHECK_THROWS_AS(dist::GradScaler({65536.0f, 2.0f, /*backoff_factor=*/1.0f}), ValueError);
  CHECK_THROWS_AS(dist::GradScaler({65536.0f, 2.0f, 0.5f, /*growth_interval=*/0}), ValueError);

  dist::GradScalerOptions off;
  off.enabled = false;
  dist::GradScaler disabled(off);
  const Tensor loss = cross_entropy((*model)(b.x), b.y);
  CHECK(disabled.scale(loss).is_same(loss));
  CHECK(disabled.get_scale() == 1.0f);
  CHECK(disabled.state_dict().empty());
}

TEST_CASE("as torch: a 16-bit loss scales to float32, the scale never grows to inf, a step with no gradient is "
          "refused, a disabled scaler ignores a state") {
  // 1.5 * 65536 = 98304 is beyond float16's 65504: kept 16-bit it would be inf.
  for (const DType dtype : {DType::Float16, DType::BFloat16}) {
    const Tensor loss = Tensor::from_vector({1.5f}).to(dtype);
    const Tensor scaled = dist::GradScaler().scale(loss);
    CHECK(scaled.dtype() == DType::Float32);
    CHECK(scaled.shape() == loss.shape());
    CHECK(scaled.to_vector() == std::vector<float>{98304.0f});
  }

  // 2^127 * 2 overflows float32: the scale stays, and the count restarts (torch's
  // _amp_update_scale_), so a later inf can still back it off.
  auto model = make_mlp(5);
  nn::SGD opt(model->parameters(), {/*lr=*/0.0});
  const float largest_power = std::ldexp(1.0f, 127);
  dist::GradScaler scaler({largest_power, 2.0f, 0.5f, /*growth_interval=*/1});
  const Batch b = testing::random_batch(50, 4, 5, 3);
  opt.zero_grad();
  cross_entropy((*model)(b.x), b.y).backward();  // finite gradients, unscaled: any check passes
  CHECK(scaler.step(opt));
  scaler.update();
  CHECK(scaler.get_scale() == largest_power);
  CHECK(scaler.growth_tracker() == 0);

  // No parameter has a .grad: torch asserts "No inf checks were recorded for this optimizer",
  // again at a second step(), and update() has nothing to count.
  opt.zero_grad();  // set_to_none: the gradients are gone
  CHECK_THROWS_WITH_AS(scaler.step(opt), doctest::Contains("no inf checks were recorded for this optimizer"),
                       ValueError);
  CHECK_THROWS_WITH_AS(scaler.step(opt), doctest::Contains("no inf checks were recorded for this optimizer"),
                       ValueError);
  CHECK_THROWS_WITH_AS(scaler.update(), doctest::Contains("no inf checks were recorded prior to update"),
                       ValueError);
  CHECK(scaler.growth_tracker() == 0);

  dist::GradScalerOptions off;
  off.enabled = false;
  off.growth_factor = 0.5;  // torch checks the factors only when enabled
  dist::GradScaler disabled(off);
  disabled.load_state_dict({});
  disabled.load_state_dict(dist::GradScaler().state_dict());
  CHECK(disabled.get_scale() == 1.0f);
  CHECK(disabled.state_dict().empty());
}

TEST_CASE("a rank whose optimizer has no gradient: every rank's step() raises it, none waits") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = testing::join(rank, 2, port);
    auto model = make_mlp(6);
    nn::SGD opt(model->parameters(), {/*lr=*/0.1});
    dist::GradScaler scaler({}, pg);
    opt.zero_grad();
    if (rank == 0) {
      const Batch b = testing::random_batch(60, 4, 5, 3);
      scaler.scale(cross_entropy((*model)(b.x), b.y)).backward();
    }
    try {
      scaler.step(opt);
      expect(false, "rank ", rank, ": step() did not throw");
    } catch (const ValueError& e) {
      expect(std::string(e.what()).find("none of its parameters has a .grad on at least one rank") !=
                 std::string::npos,
             "rank ", rank, ": ", e.what());
    }
    testing::leave();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("an inf on one rank only: every rank skips, halves the scale and keeps its parameters (2 and 4 ranks)") {
  for (const int world : {2, 4}) {
    const int port = testing::free_port();
    const std::string failures = on_ranks(world, [port, world](int rank) {
      auto pg = testing::join(rank, world, port);
      dist::DistributedDataParallel ddp(make_mlp(4), pg);
      nn::SGD opt(ddp.parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
      dist::GradScaler scaler({}, pg);
      for (int step = 0; step < 3; ++step) {
        const Batch b = testing::rows(testing::random_batch(40 + static_cast<uint64_t>(step), 4 * world, 5, 3),
                                      4 * rank, 4 * rank + 4);
        opt.zero_grad();
        scaler.scale(cross_entropy(ddp(b.x), b.y)).backward();
        // Step 1: after DDP's all-reduce, the last rank alone gets an inf (a local overflow).
        const bool poisoned = step == 1 && rank == world - 1;
        if (poisoned) {
          Tensor grad = ddp.parameters()[1].grad();
          std::vector<float> values = grad.to_vector();
          values[0] = std::numeric_limits<float>::infinity();
          grad.copy_(Tensor::from_vector(values, grad.shape()));
        }
        const auto before = values_of(ddp.parameters());
        const bool stepped = scaler.step(opt);
        scaler.update();
        if (step == 1) {
          expect(!stepped, "rank ", rank, " of ", world,
                 ": stepped although rank ", world - 1, " found an inf");
          expect(values_of(ddp.parameters()) == before, "rank ", rank, " of ", world,
                 ": parameters changed in the skipped step");
          expect(scaler.get_scale() == 32768.0f && scaler.growth_tracker() == 0, "rank ", rank, " of ", world,
                 ": scale ", scaler.get_scale(), " and growth count ", scaler.growth_tracker(),
                 " after the skip, expected 32768 and 0");
        } else {
          expect(stepped, "rank ", rank, " of ", world, ": step ", step, " was skipped");
        }
      }
      // Replicas stayed equal: every rank's parameters are rank 0's.
      std::vector<float> mine;
      for (const Tensor& p : ddp.parameters())
        for (float v : p.to_vector()) mine.push_back(v);
      const std::vector<float> sum = dist::all_reduce_host(*pg, mine, dist::ReduceOp::Sum);
      for (size_t i = 0; i < mine.size(); ++i)
        expect(sum[i] == mine[i] * static_cast<float>(world), "rank ", rank, ": parameters differ across ranks");
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), "world ", world, ": ", failures);
  }
}

TEST_CASE(
    "inside a Join with uneven inputs: with a group the mismatch names the scaler and the join; without "
    "one every rank trains and the replicas stay equal") {
  for (const bool with_group : {true, false}) {
    const int port = testing::free_port();
    const std::string failures = on_ranks(2, [port, with_group](int rank) {
      auto pg = testing::join(rank, 2, port);
      dist::DistributedDataParallel ddp(make_mlp(4), pg);
      nn::SGD opt(ddp.parameters(), {/*lr=*/0.1});
      dist::GradScaler scaler({}, with_group ? pg : nullptr);
      const int batches = rank == 0 ? 2 : 4;  // rank 0 joins while rank 1 has two to go
      std::string error;
      try {
        dist::Join join({ddp});
        for (int step = 0; step < batches; ++step) {
          const Batch b = testing::rows(testing::random_batch(70 + static_cast<uint64_t>(step), 8, 5, 3),
                                        4 * rank, 4 * rank + 4);
          opt.zero_grad();
          scaler.scale(cross_entropy(ddp(b.x), b.y)).backward();
          scaler.step(opt);
          scaler.update();
        }
        join.finish();
      } catch (const DistError& e) {
        error = e.what();
      }
      if (with_group) {
        expect(error.find("GradScaler.unscale_'s inf/NaN check") != std::string::npos &&
                   error.find("Join's count of ranks still training") != std::string::npos,
               "rank ", rank, ": the error does not name both calls: '", error, "'");
      } else {
        expect(error.empty(), "rank ", rank, ": ", error);
        std::vector<float> mine;
        for (const Tensor& p : ddp.parameters())
          for (float v : p.to_vector()) mine.push_back(v);
        const std::vector<float> sum = dist::all_reduce_host(*pg, mine, dist::ReduceOp::Sum);
        for (size_t i = 0; i < mine.size(); ++i)
          expect(sum[i] == 2 * mine[i], "rank ", rank, ": parameters differ across ranks");
      }
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), (with_group ? "with a group: " : "without: "), failures);
  }
}

TEST_CASE("every case passes on the shm backend too (this file with NANODDP_TEST_BACKEND=shm)") {
  if (under_mpirun() || std::getenv("NANODDP_TEST_BACKEND") != nullptr) return;
  const testing::RunResult r = testing::rerun_with_backend(
      "tests/test_grad_scaler", "shm", "--test-case-exclude='*mpirun*,*NANODDP_TEST_BACKEND*'", 120s);
  CHECK_MESSAGE(r.code() == 0, "shm run failed:\n", r.out, r.err);
}

TEST_CASE("the rank cases pass on the MPI backend too (this file under mpirun -np 2 and -np 4)") {
  if (under_mpirun()) return;
  if (!testing::have_mpirun()) {
    MESSAGE("mpirun not found: the MPI half of this file did not run");
    return;
  }
  for (const int np : {2, 4}) {
    const testing::RunResult r =
        testing::mpirun_self("tests/test_grad_scaler", np, "--test-case='*one rank only*'", 180s);
    CHECK_MESSAGE(r.code() == 0, "mpirun -np ", np, " failed:\n", r.out, r.err);
  }
}
