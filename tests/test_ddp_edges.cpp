// DDP at the edges, on 2 and 4 ranks, on Gloo (forked ranks) and MPI (this file again under
// mpirun -np 2 and -np 4): parameters used on some ranks only, used only inside no_sync, tied
// parameters, buffers (broadcast_buffers), BatchNorm vs SyncBatchNorm, and ranks with uneven
// inputs, with and without dist::Join (whose cases also run on shm: this file again with
// NANODDP_TEST_BACKEND=shm). Inputs are the small ones of the bug reports, results computed by
// hand or by a float64 reference.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>

#include "core/autograd.h"
#include "core/ops.h"
#include "dist/comm_hooks.h"
#include "dist/ddp.h"
#include "dist/fsdp.h"
#include "dist/join.h"
#include "dist/sync_batch_norm.h"
#include "dist/zero_redundancy_optimizer.h"
#include "nn/batch_norm.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "tests/collectives_cases.h"
#include "tests/dist_ranks.h"
#include "tests/op_cases.h"

using namespace nanoddp;
using nanoddp::testing::expect;

namespace {

std::shared_ptr<nn::Linear> linear_1x1(float w, float b, bool bias = true) {
  auto layer = std::make_shared<nn::Linear>(1, 1, default_generator(), bias);
  layer->weight.copy_(Tensor::from_vector({w}, {1, 1}));
  if (bias) layer->bias.copy_(Tensor::from_vector({b}, {1}));
  return layer;
}

// Two branches a and c; the rank's data decides which one runs. d is never used by anyone.
struct Branches : nn::Module {
  std::shared_ptr<nn::Linear> a = register_module("a", linear_1x1(1, 0));
  std::shared_ptr<nn::Linear> c = register_module("c", linear_1x1(2, 1));
  std::shared_ptr<nn::Linear> d = register_module("d", linear_1x1(5, 5));
  bool use_a = true;
  Tensor forward(const Tensor& x) override { return use_a ? (*a)(x) : (*c)(x); }
};

// Bias-free A and B; micro-steps choose one.
struct Pair : nn::Module {
  std::shared_ptr<nn::Linear> A = register_module("A", linear_1x1(1, 0, false));
  std::shared_ptr<nn::Linear> B = register_module("B", linear_1x1(1, 0, false));
  bool use_A = true;
  Tensor forward(const Tensor& x) override { return use_A ? (*A)(x) : (*B)(x); }
};

float value(const Tensor& t) { return t.to_vector().at(0); }

// Bias-free Linear(1, 1) whose backward throws while `throwing` is set: an error inside the
// model, after DDP's output node has run and before any parameter's gradient is final.
struct ThrowsInBackward : nn::Module {
  std::shared_ptr<nn::Linear> inner = register_module("inner", linear_1x1(1, 0, /*bias=*/false));
  bool throwing = false;
  Tensor forward(const Tensor& x) override {
    Tensor y = (*inner)(x);
    if (!throwing) return y;
    return record("ThrowsBackward", y.detach(), {y}, {},
                  [](const Node&, const Tensor&) -> std::vector<Tensor> {
                    throw ValueError("thrown by the test's op");
                  });
  }
};

}  // namespace

TEST_CASE("find_unused_parameters: a parameter used on some ranks gets the same mean and update everywhere") {
  // Even ranks compute a(x), x = [[1], [3]]; odd ranks c(x), x = [[2], [4]]; MSE (mean) against
  // 0, SGD lr 1. Loss gradient: dL/dy = y (2y / 2 rows).
  //   a: y = [1, 3]  dw = 1*1 + 3*3 = 10, db = 4      c: y = [5, 9]  dw = 2*5 + 4*9 = 46, db = 14
  // Half the ranks used each branch, so the mean is half of each: a (5, 2), c (23, 7), and
  //   a = (1 - 5, 0 - 2) = (-4, -2),  c = (2 - 23, 1 - 7) = (-21, -6)  on every rank.
  // d is used by no rank: its .grad stays undefined and SGD leaves it at (5, 5).
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port);
      auto model = std::make_shared<Branches>();
      dist::DDPOptions options;
      options.find_unused_parameters = true;
      dist::DistributedDataParallel ddp(model, pg, options);
      nn::SGD opt(ddp.parameters(), {/*lr=*/1.0});
      model->use_a = rank % 2 == 0;
      const Tensor x =
          model->use_a ? Tensor::from_vector({1, 3}, {2, 1}) : Tensor::from_vector({2, 4}, {2, 1});
      opt.zero_grad();
      mse_loss(ddp(x), Tensor::zeros({2, 1})).backward();
      expect(value(model->a->weight.grad()) == 5 && value(model->a->bias.grad()) == 2, "rank ", rank,
             ": a's grad is (", model->a->weight.grad(), ", ", model->a->bias.grad(), "), want (5, 2)");
      expect(value(model->c->weight.grad()) == 23 && value(model->c->bias.grad()) == 7, "rank ", rank,
             ": c's grad is (", model->c->weight.grad(), ", ", model->c->bias.grad(), "), want (23, 7)");
      expect(!model->d->weight.grad().defined() && !model->d->bias.grad().defined(), "rank ", rank,
             ": d, used by no rank, got a .grad");
      opt.step();
      expect(value(model->a->weight) == -4 && value(model->a->bias) == -2, "rank ", rank, ": a is (",
             model->a->weight, ", ", model->a->bias, "), want (-4, -2)");
      expect(value(model->c->weight) == -21 && value(model->c->bias) == -6, "rank ", rank, ": c is (",
             model->c->weight, ", ", model->c->bias, "), want (-21, -6)");
      expect(value(model->d->weight) == 5 && value(model->d->bias) == 5, "rank ", rank, ": d was stepped");

      // The next iteration starts clean: everyone uses a, x = [[1]] -> dw = 2 * (-4 - 2) * 1 / 1
      // ... y = -4 - 2 = -6, dL/dy = 2y = -12: a.grad = (-12, -12); c and d get nothing.
      model->use_a = true;
      opt.zero_grad();
      mse_loss(ddp(Tensor::from_vector({1}, {1, 1})), Tensor::zeros({1, 1})).backward();
      expect(value(model->a->weight.grad()) == -12 && value(model->a->bias.grad()) == -12, "rank ", rank,
             ": second iteration a.grad (", model->a->weight.grad(), ", ", model->a->bias.grad(), ")");
      expect(!model->c->weight.grad().defined(), "rank ", rank, ": c got a .grad in the second iteration");
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("a parameter used in any no_sync micro-step counts as used when the synced step reduces") {
  // Micro-step 1 (inside no_sync) uses A with x = 1 on even ranks, 2 on odd: A.grad = x
  // locally. Micro-step 2 (synced) uses only B with the same x. The synced step reduces the
  // whole window: A.grad = B.grad = mean(1, 2) = 1.5 on every rank, with or without
  // find_unused_parameters.
  for (int world : {2, 4}) {
    for (bool find_unused : {true, false}) {
      CAPTURE(world);
      CAPTURE(find_unused);
      const int port = testing::free_port();
      const std::string failures = testing::on_ranks(world, [&](int rank) {
        auto pg = testing::join(rank, world, port);
        auto model = std::make_shared<Pair>();
        dist::DDPOptions options;
        options.find_unused_parameters = find_unused;
        dist::DistributedDataParallel ddp(model, pg, options);
        const Tensor x = Tensor::full({1, 1}, rank % 2 == 0 ? 1.0f : 2.0f);
        for (int iteration = 0; iteration < 2; ++iteration) {  // the window resets after a sync
          ddp.zero_grad();
          {
            auto guard = ddp.no_sync();
            model->use_A = true;
            sum(ddp(x)).backward();
          }
          model->use_A = false;
          sum(ddp(x)).backward();
          expect(value(model->A->weight.grad()) == 1.5f, "rank ", rank, " iteration ", iteration,
                 ": A.grad is ", model->A->weight.grad(), ", want 1.5");
          expect(value(model->B->weight.grad()) == 1.5f, "rank ", rank, " iteration ", iteration,
                 ": B.grad is ", model->B->weight.grad(), ", want 1.5");
        }
        testing::leave();
      });
      CHECK_MESSAGE(failures.empty(), failures);
    }
  }
}

TEST_CASE("a tied parameter is reduced once and stepped once") {
  // Sequential(L, L) with one bias-free Linear(2, 2), W = [[.1, .2], [.3, .4]], x = [[1, 1]] on
  // every rank, loss sum, SGD lr 0.1: W' = [[.03, .09], [.21, .27]] (tests/test_nn.cpp derives it).
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port);
      auto shared = std::make_shared<nn::Linear>(2, 2, default_generator(), /*bias=*/false);
      shared->weight.copy_(Tensor::from_vector({0.1f, 0.2f, 0.3f, 0.4f}, {2, 2}));
      auto model = std::make_shared<nn::Sequential>();
      model->add(shared);
      model->add(shared);
      dist::DistributedDataParallel ddp(model, pg);
      const auto plan = ddp.reducer().bucket_plan();
      expect(plan == std::vector<std::vector<size_t>>{{0}}, "rank ", rank, ": DDP planned ", plan.size(),
             " buckets for one tied parameter");
      nn::SGD opt(ddp.parameters(), {/*lr=*/0.1});
      sum(ddp(Tensor::ones({1, 2}))).backward();
      opt.step();
      const std::vector<float> w = shared->weight.to_vector(), want = {0.03f, 0.09f, 0.21f, 0.27f};
      for (size_t i = 0; i < 4; ++i)
        expect(std::abs(w[i] - want[i]) < 1e-6f, "rank ", rank, ": W'[", i, "] = ", w[i], ", want ", want[i]);
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE(
    "a rank that ran out of batches: every rank gets a DistError naming both calls, none hangs or dies") {
  // The last rank has no batch left and reduces its 2-number metric while the others reduce
  // their gradients (Linear(4, 3): 12 + 3 = 15 floats, one bucket) at the end of backward.
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port, std::chrono::seconds(20));
      dist::DistributedDataParallel ddp(std::make_shared<nn::Linear>(4, 3), pg);
      const std::string metric_call = "rank " + std::to_string(world - 1) + ": all_reduce(sum) #";
      std::string message;
      try {
        if (rank == world - 1) {
          Tensor metric = Tensor::ones({2});
          pg->all_reduce(metric)->wait();
        } else {
          sum(ddp(Tensor::ones({2, 4}))).backward();
        }
      } catch (const TimeoutError& e) {
        expect(false, "rank ", rank, ": a timeout instead of a mismatch error: ", e.what());
      } catch (const DistError& e) {
        message = e.what();
      }
      for (const std::string& part : {std::string("rank 0: all_reduce(sum) #"), std::string(", 15 float32"),
                                      metric_call, std::string(", 2 float32")})
        expect(message.find(part) != std::string::npos, "rank ", rank, ": the error lacks '", part,
               "': ", message);
      // Nothing was started, and nothing after it will be: the last rank made one call fewer.
      testing::expect_out_of_step(*pg, rank, "#");
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

// ---- dist::Join: uneven inputs (Note [Join] in dist/join.cpp) --------------------------------
// Each rank r trains a bias-free Linear(1, 1) (w = 0) on its own batches, x = [[1]] and target
// t_r, loss mse (dL/dw = 2(w - t_r)), SGD lr 0.25. Rank r has batches_of(r) batches: 3 on even
// ranks, 5 on odd ones, so the even ranks run out after 3 iterations. Target t_r = 2r + 1.

TEST_CASE("a frozen parameter gets no bucket and no update, but rank 0's value everywhere") {
  // Sequential(F, T), both Linear(1, 1); F (frozen) is w = 2 + rank, b = 0 as built, rank 0's
  // w = 2 after DDP's broadcast. T: w = 1, b = 0. Rank r feeds x = r + 1, loss = sum, so
  // dL/dT.w = F(x) = 2x and dL/dT.b = 1. Mean over ranks: T.w.grad = 2 * mean(x) = W + 1 at
  // world W (x = 1..W), T.b.grad = 1; SGD lr 1: T = (1 - (W + 1), -1) = (-W, -1).
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port);
      auto frozen = linear_1x1(2.0f + rank, 0);
      frozen->weight.set_requires_grad(false);
      frozen->bias.set_requires_grad(false);
      auto trained = linear_1x1(1, 0);
      auto model = std::make_shared<nn::Sequential>();
      model->add(frozen);
      model->add(trained);
      dist::DistributedDataParallel ddp(model, pg);
      expect(value(frozen->weight) == 2, "rank ", rank, ": frozen weight ", frozen->weight,
             " after construction, want rank 0's 2");
      const auto plan = ddp.reducer().bucket_plan();
      expect(plan == std::vector<std::vector<size_t>>{{1, 0}}, "rank ", rank,
             ": the plan should hold T's two parameters only");
      nn::SGD opt(ddp.parameters(), {/*lr=*/1.0});
      opt.zero_grad();
      sum(ddp(Tensor::full({1, 1}, static_cast<float>(rank + 1)))).backward();
      expect(value(trained->weight.grad()) == world + 1 && value(trained->bias.grad()) == 1, "rank ", rank,
             ": T's grad is (", trained->weight.grad(), ", ", trained->bias.grad(), ")");
      expect(!frozen->weight.grad().defined(), "rank ", rank, ": the frozen weight got a .grad");
      opt.step();
      expect(value(trained->weight) == -world && value(trained->bias) == -1, "rank ", rank, ": T is (",
             trained->weight, ", ", trained->bias, ")");
      expect(value(frozen->weight) == 2 && value(frozen->bias) == 0, "rank ", rank, ": F changed");
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("requires_grad changed after construction: a ValueError naming it, not un-averaged gradients") {
  // Sequential(a, b), both Linear(1, 1) with w = 1, b = 0; rank r feeds x = r + 1, loss sum.
  // dL/d(b.w) = a(x) = x, dL/d(a.w) = b.w * x = x: the means over ranks 1 and 2 are 1.5. Built
  // with b frozen and b unfrozen afterwards, b has no hook: each rank would keep its own x.
  const int port = testing::free_port();
  const std::string failures = testing::on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port);
    auto a = linear_1x1(1, 0), b = linear_1x1(1, 0);
    auto model = std::make_shared<nn::Sequential>();
    model->add(a);
    model->add(b);
    const Tensor x = Tensor::full({1, 1}, static_cast<float>(rank + 1));
    auto forward_error = [&](dist::DistributedDataParallel& ddp) -> std::string {
      try {
        ddp(x);
      } catch (const ValueError& e) {
        return e.what();
      }
      return "";
    };
    {
      b->weight.set_requires_grad(false);
      b->bias.set_requires_grad(false);
      dist::DistributedDataParallel ddp(model, pg);
      b->weight.set_requires_grad(true);
      b->bias.set_requires_grad(true);
      const std::string message = forward_error(ddp);
      expect(message.find("requires_grad changed after DistributedDataParallel was constructed: "
                          "1.weight (unfrozen after wrapping), 1.bias (unfrozen after wrapping)") != std::string::npos,
             "rank ", rank, ": unfreezing gave '", message, "'");
      NoGradGuard no_grad;  // evaluation reduces nothing: allowed
      expect(value(ddp(x)) == rank + 1, "rank ", rank, ": the no-grad forward");
    }
    dist::DistributedDataParallel ddp(model, pg);  // rebuilt after unfreezing: b is averaged
    sum(ddp(x)).backward();
    expect(value(b->weight.grad()) == 1.5f && value(b->bias.grad()) == 1 && value(a->weight.grad()) == 1.5f,
           "rank ", rank, ": grads b.w ", b->weight.grad(), " b.b ", b->bias.grad(), " a.w ",
           a->weight.grad(), ", want 1.5, 1, 1.5");
    a->weight.set_requires_grad(false);
    const std::string message = forward_error(ddp);
    expect(message.find("constructed: 0.weight (frozen after wrapping)") != std::string::npos, "rank ", rank,
           ": freezing gave '", message, "'");
    testing::leave();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("a model with nothing to train is a ValueError on every rank, as in PyTorch, and the ranks stay in step") {
  const int port = testing::free_port();
  const std::string failures = testing::on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port, std::chrono::seconds(20));
    auto construction_error = [&](std::shared_ptr<nn::Module> model) -> std::string {
      try {
        dist::DistributedDataParallel ddp(std::move(model), pg);
      } catch (const ValueError& e) {
        return e.what();
      }
      return "";
    };
    auto frozen = linear_1x1(1, 0);
    frozen->weight.set_requires_grad(false);
    frozen->bias.set_requires_grad(false);
    std::string message = construction_error(frozen);
    expect(message.find("no parameter that requires a gradient (it has 2 parameters, all frozen)") != std::string::npos,
           "rank ", rank, ": all frozen gave '", message, "'");
    message = construction_error(std::make_shared<nn::ReLU>());
    expect(message.find("no parameter that requires a gradient (it has 0 parameters)") != std::string::npos, "rank ",
           rank, ": no parameters gave '", message, "'");
    // One trainable parameter is enough; the refusals left both ranks at the same collective.
    frozen->bias.set_requires_grad(true);
    dist::DistributedDataParallel ddp(frozen, pg);
    sum(ddp(Tensor::full({1, 1}, static_cast<float>(rank + 1)))).backward();
    expect(value(frozen->bias.grad()) == 1 && !frozen->weight.grad().defined(), "rank ", rank, ": bias grad ",
           frozen->bias.grad());
    testing::leave();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("a rank that catches an exception from its backward and goes on is stopped, never paired with another step") {
  // The "skip the bad batch" pattern on one rank only: its hook throws in step 1 and the
  // exception is caught. The other rank is inside step 1's bucket all_reduce. Going on, the
  // failed rank's step 2 would be averaged with the other's step 1, silently (Note
  // [Interrupted backward] in dist/reducer.cpp). Both ranks must raise instead. Not under
  // mpirun: there the refused collective leaves a request that never completes, and a process
  // that has one skips MPI_Finalize at exit (dist/process_group_mpi.cpp), which fails the job.
  if (testing::under_mpirun()) return;
  const int port = testing::free_port();
  const std::string failures = testing::on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port, std::chrono::seconds(10));
    auto model = linear_1x1(1, 0);
    dist::DistributedDataParallel ddp(model, pg);
    bool armed = false;
    if (rank == 1) testing::throw_when_armed(model->weight, &armed);
    std::string errors;
    for (int step = 0; step < 3; ++step) {
      armed = rank == 1 && step == 1;
      model->zero_grad();
      try {
        sum(ddp(Tensor::full({1, 1}, static_cast<float>(rank + step + 1)))).backward();
      } catch (const std::exception& e) {
        errors += "step " + std::to_string(step) + ": " + e.what() + "\n";
      }
    }
    if (rank == 1) {
      expect(errors.find("step 1: user hook failed") != std::string::npos &&
                 errors.find("step 2: DDP on rank 1/2: the previous backward on this rank ended by an exception, and "
                             "the other ranks did not end theirs the same way") != std::string::npos,
             "rank 1: ", errors);
    } else {
      expect(errors.find("step 1: ") != std::string::npos, "rank 0: step 1 completed, paired with rank 1's step 2");
    }
    testing::leave();  // the collective check kept the group in step: both compared, neither reduced
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("ranks that freeze different parameters fail at construction, naming the parameter") {
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port, std::chrono::seconds(20));
      auto layer = linear_1x1(1, 0);
      if (rank == world - 1) layer->bias.set_requires_grad(false);
      std::string message;
      try {
        dist::DistributedDataParallel ddp(layer, pg);
      } catch (const DistError& e) {
        message = e.what();
      }
      expect(message.find("'bias'") != std::string::npos && message.find("frozen") != std::string::npos,
             "rank ", rank, ": want a DistError naming the frozen 'bias', got: ", message);
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

namespace {

constexpr float kJoinLr = 0.25f;
int batches_of(int rank) { return rank % 2 == 0 ? 3 : 5; }
float target_of(int rank) { return 2.0f * rank + 1.0f; }

// The float64 reference of what Join must produce: in iteration s the ranks with more than s
// batches train; their gradients are summed (a joined rank adds 0) and divided by the world
// size (divide_by_initial_world_size) or by their number.
double joined_training_reference(int world, bool divide_by_initial_world_size) {
  double w = 0;
  for (int s = 0; s < batches_of(1); ++s) {
    double sum = 0;
    int active = 0;
    for (int r = 0; r < world; ++r)
      if (batches_of(r) > s) sum += 2 * (w - target_of(r)), ++active;
    w -= kJoinLr * sum / (divide_by_initial_world_size ? world : active);
  }
  return w;
}

// This rank's loop over its batches; returns the weight's .grad of each iteration.
std::vector<float> train_uneven(int rank, dist::DistributedDataParallel& ddp, nn::Linear& model, nn::SGD& opt) {
  std::vector<float> grads;
  for (int b = 0; b < batches_of(rank); ++b) {
    opt.zero_grad();
    mse_loss(ddp(Tensor::ones({1, 1})), Tensor::full({1, 1}, target_of(rank))).backward();
    grads.push_back(value(model.weight.grad()));
    opt.step();
  }
  return grads;
}

}  // namespace

TEST_CASE("Join: ranks with 3 and 5 batches end with the hand-computed weight, divide_by_initial_world_size on and off") {
  // World 2, t = (1, 3), computed by hand in float64 (every value is a dyadic fraction, so
  // float32 holds it exactly and the test compares with ==):
  //   iterations 1-3, both ranks: mean grad = (2(w - 1) + 2(w - 3)) / 2 = 2w - 4,
  //     w <- w - 0.25 (2w - 4) = w/2 + 1:                  0 -> 1 -> 1.5 -> 1.75
  //   iterations 4-5, rank 1 alone (rank 0 all-reduces zeros): summed grad 2(w - 3)
  //     divide_by_initial_world_size = true,  grad = w - 3: w <- 0.75 w + 0.75
  //       1.75 -> 2.0625 -> 2.296875   (rank 1's grad in iteration 4: -1.25)
  //     divide_by_initial_world_size = false, grad = 2(w - 3): w <- 0.5 w + 1.5
  //       1.75 -> 2.375 -> 2.6875      (rank 1's grad in iteration 4: -2.5)
  // Rank 0 stops stepping at 1.75; finish() broadcasts rank 1's weight, the last joiner's.
  // World 4 (batches 3, 5, 3, 5; t = 1, 3, 5, 7) is checked against joined_training_reference.
  CHECK(joined_training_reference(2, true) == 2.296875);
  CHECK(joined_training_reference(2, false) == 2.6875);
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port);
      for (bool divide_by_initial_world_size : {true, false}) {
        auto model = linear_1x1(0, 0, /*bias=*/false);
        dist::DistributedDataParallel ddp(model, pg);
        nn::SGD opt(ddp.parameters(), {kJoinLr});
        dist::JoinOptions options;
        options.divide_by_initial_world_size = divide_by_initial_world_size;
        dist::Join join({ddp}, options);
        const std::vector<float> grads = train_uneven(rank, ddp, *model, opt);
        if (world == 2 && rank == 0)
          expect(value(model->weight) == 1.75f, "rank 0 before finish(): w = ", model->weight, ", want 1.75");
        if (world == 2 && rank == 1)
          expect(grads[3] == (divide_by_initial_world_size ? -1.25f : -2.5f), "rank 1, divide_by_initial_world_size ",
                 divide_by_initial_world_size, ": grad in iteration 4 = ", grads[3]);
        join.finish();
        const double want = joined_training_reference(world, divide_by_initial_world_size);
        expect(std::abs(value(model->weight) - want) <= 1e-6 * std::abs(want), "rank ", rank,
               ", divide_by_initial_world_size ", divide_by_initial_world_size, ": final w = ", model->weight,
               ", want ", want);
        // The Join is over: DDP divides by the world size again.
        expect(ddp.reducer().divide_factor() == world, "rank ", rank, ": divide factor ",
               ddp.reducer().divide_factor(), " after the Join");
      }
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("Join with a comm hook: the joined rank runs the hook on zeros, and the weights are the hand-computed ones") {
  // The first Join case with fp16_compress_hook: every gradient and mean there (2w - 4, w - 3
  // at w = 0 ... 2.0625, halved) has few enough bits for float16, so compression changes
  // nothing, while a joined rank that shadowed with float32 all-reduces would fail the check.
  const int port = testing::free_port();
  const std::string failures = testing::on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port);
    auto model = linear_1x1(0, 0, /*bias=*/false);
    dist::DistributedDataParallel ddp(model, pg);
    ddp.register_comm_hook(pg, dist::fp16_compress_hook);
    nn::SGD opt(ddp.parameters(), {kJoinLr});
    dist::Join join({ddp});
    train_uneven(rank, ddp, *model, opt);
    join.finish();
    expect(value(model->weight) == 2.296875f, "rank ", rank, ": final w = ", model->weight, ", want 2.296875");
    testing::leave();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE(
    "Join with ZeroRedundancyOptimizer: every rank ends with what an unsharded SGD in the same Join gives") {
  // Linear(1, 1) with a bias, SGD with momentum; batches 3, 5 (and 3 at world 3). ZeRO gives
  // the weight to rank 0 and the bias to rank 1 (rank 2 owns nothing), so at world 2 the
  // weight's owner joins after 3 iterations and must go on stepping it, with the gradients
  // the ranks still training average (divided by them alone without
  // divide_by_initial_world_size), for rank 1 to get the weight it needs. The reference runs
  // on the same ranks: plain SGD in a Join (a joined rank stops stepping, finish() broadcasts
  // the last joiner's model). Both see the same all-reduced bits, so they compare with ==.
  for (int world : {2, 3}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port);
      for (bool divide_by_initial_world_size : {true, false})
        for (bool find_unused : {false, true}) {
          dist::JoinOptions options;
          options.divide_by_initial_world_size = divide_by_initial_world_size;
          auto train = [&](bool zero) {
            // find_unused: even ranks use branch a, odd ones c, d nobody. Once rank 0 has
            // joined, nobody uses a; rank 0 owns a.weight and must not step it with the
            // gradient of its own last batch (the others' a.grad is undefined after zero_grad).
            std::shared_ptr<nn::Module> model = linear_1x1(0.5f, -0.25f);
            if (find_unused) {
              auto branches = std::make_shared<Branches>();
              branches->use_a = rank % 2 == 0;
              model = branches;
            }
            dist::DDPOptions ddp_options;
            ddp_options.find_unused_parameters = find_unused;
            dist::DistributedDataParallel ddp(model, pg, ddp_options);
            const auto make_sgd = [](std::vector<Tensor> params) {
              return std::make_unique<nn::SGD>(std::move(params), nn::SGDOptions{kJoinLr, 0.9f});
            };
            std::unique_ptr<nn::Optimizer> opt;
            std::unique_ptr<dist::Join> join;
            if (zero) {
              auto zero_opt = std::make_unique<dist::ZeroRedundancyOptimizer>(ddp.parameters(), pg, make_sgd);
              join = std::make_unique<dist::Join>(
                  std::vector<std::reference_wrapper<dist::Joinable>>{ddp, *zero_opt}, options);
              opt = std::move(zero_opt);
            } else {
              opt = make_sgd(ddp.parameters());
              join = std::make_unique<dist::Join>(std::vector<std::reference_wrapper<dist::Joinable>>{ddp},
                                                  options);
            }
            for (int b = 0; b < batches_of(rank); ++b) {
              opt->zero_grad();
              mse_loss(ddp(Tensor::ones({1, 1})), Tensor::full({1, 1}, target_of(rank))).backward();
              opt->step();
            }
            join->finish();
            std::vector<float> values;
            for (const Tensor& p : model->parameters()) values.push_back(value(p));
            return values;
          };
          const std::vector<float> plain = train(false), sharded = train(true);
          std::ostringstream both;
          for (size_t i = 0; i < plain.size(); ++i) both << " " << sharded[i] << "/" << plain[i];
          expect(sharded == plain, "rank ", rank, ", divide_by_initial_world_size ", divide_by_initial_world_size,
                 ", find_unused_parameters ", find_unused, ": parameters with ZeRO / unsharded SGD:", both.str());
        }
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("Join: a rank with no batch at all shadows the first backward, the static_graph map and the re-plan") {
  // World 2, static_graph: rank 0 has no batch, rank 1 has 3 (t = 3). Rank 1's first backward
  // all-reduces the used map (static_graph, first iteration only) and its second forward
  // re-plans the buckets (Note [Bucket rebuild]: a broadcast of rank 0's order); joined rank 0
  // must issue both, although it never ran a backward, or the collective check stops the
  // ranks. By hand, rank 0 adding zeros and the sum divided by 2: grad = w - 3,
  // w <- 0.75 w + 0.75: 0 -> 0.75 -> 1.3125 -> 1.734375 on both ranks after finish().
  const int port = testing::free_port();
  const std::string failures = testing::on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port);
    auto model = linear_1x1(0, 0, /*bias=*/false);
    dist::DDPOptions options;
    options.static_graph = true;
    dist::DistributedDataParallel ddp(model, pg, options);
    nn::SGD opt(ddp.parameters(), {kJoinLr});
    pg->reset_counts();
    dist::Join join({ddp});
    for (int b = 0; b < (rank == 0 ? 0 : 3); ++b) {
      opt.zero_grad();
      mse_loss(ddp(Tensor::ones({1, 1})), Tensor::full({1, 1}, 3.0f)).backward();
      opt.step();
    }
    join.finish();
    expect(value(model->weight) == 1.734375f, "rank ", rank, ": final w = ", model->weight, ", want 1.734375");
    expect(ddp.reducer().buckets_rebuilt(), "rank ", rank, ": the buckets were not re-planned");
    // The re-plan's broadcast, then finish()'s of the final parameters.
    expect(pg->count(dist::Collective::Broadcast).calls == 2, "rank ", rank, ": ",
           pg->count(dist::Collective::Broadcast).calls, " broadcasts, expected 2");
    testing::leave();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("Join: without it, the same loop fails on every rank with the collective-mismatch DistError") {
  // The even ranks finish their 3 batches and reach the barrier that ends the loop while the
  // odd ranks all-reduce their bucket (1 float32) in iteration 4: the collective check stops
  // both sides with one DistError; nobody hangs or dies, and the group stays usable.
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port, std::chrono::seconds(20));
      auto model = linear_1x1(0, 0, /*bias=*/false);
      dist::DistributedDataParallel ddp(model, pg);
      nn::SGD opt(ddp.parameters(), {kJoinLr});
      std::string message;
      try {
        train_uneven(rank, ddp, *model, opt);
        pg->barrier()->wait();
      } catch (const TimeoutError& e) {
        expect(false, "rank ", rank, ": a timeout instead of the mismatch error: ", e.what());
      } catch (const DistError& e) {
        message = e.what();
      }
      for (const std::string& part : {std::string("rank 0: barrier #"), std::string("rank 1: all_reduce(sum) #"),
                                      std::string(", 1 float32")})
        expect(message.find(part) != std::string::npos, "rank ", rank, ": the error lacks '", part, "': ", message);
      testing::expect_out_of_step(*pg, rank, "#");
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("Join: throw_on_early_termination: every rank throws a DistError naming the ranks that ran out") {
  // The even ranks run out after iteration 3: they throw from finish(), the odd ranks from
  // the forward of iteration 4, before any gradient of it is reduced. So every rank ends at
  // iteration 3's weight: 1.75 at world 2 (see the first Join case); the world-4 weight
  // after 3 iterations of t = 1, 3, 5, 7: w <- w - 0.25 (2w - 8) = w/2 + 2: 0 -> 2 -> 3 -> 3.5.
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port);
      auto model = linear_1x1(0, 0, /*bias=*/false);
      dist::DistributedDataParallel ddp(model, pg);
      nn::SGD opt(ddp.parameters(), {kJoinLr});
      dist::JoinOptions options;
      options.throw_on_early_termination = true;
      std::string message;
      try {
        dist::Join join({ddp}, options);
        train_uneven(rank, ddp, *model, opt);
        join.finish();
      } catch (const DistError& e) {
        message = e.what();
      }
      const std::string ran_out = world == 2 ? "rank 0 has exhausted all inputs" : "ranks 0, 2 have exhausted all inputs";
      expect(message.find(ran_out) != std::string::npos, "rank ", rank, ": want '", ran_out, "' in: ", message);
      const float want = world == 2 ? 1.75f : 3.5f;
      expect(value(model->weight) == want, "rank ", rank, ": w = ", model->weight, ", want ", want);
      Tensor t = Tensor::full({1}, 1.0f);
      pg->all_reduce(t)->wait();
      expect(value(t) == world, "rank ", rank, ": the group is out of step after the error: ", t);
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("Join: with find_unused_parameters, a parameter only joined ranks used is stepped by nobody") {
  // Pair's bias-free A and B, both w = 0, x = [[1]], SGD lr 0.25, divide_by_initial_world_size.
  // Even ranks use A (target 1, 2 batches), odd ranks B (target 3, 3 batches); half the ranks
  // use each, so the mean grads are A: (W/2) 2(w_A - 1) / W = w_A - 1, and B: w_B - 3.
  //   iterations 1-2: w_A 0 -> 0.25 -> 0.4375;  w_B 0 -> 0.75 -> 1.3125
  //   iteration 3, even ranks joined: B's grad is still (W/2) 2(w_B - 3) / W = -1.6875,
  //     w_B -> 1.734375; A is used by no rank still training: its .grad stays undefined and
  //     w_A stays 0.4375.
  // finish() broadcasts an odd rank's (0.4375, 1.734375) to every rank.
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port);
      auto model = std::make_shared<Pair>();
      model->A->weight.copy_(Tensor::zeros({1, 1}));
      model->B->weight.copy_(Tensor::zeros({1, 1}));
      model->use_A = rank % 2 == 0;
      dist::DDPOptions ddp_options;
      ddp_options.find_unused_parameters = true;
      dist::DistributedDataParallel ddp(model, pg, ddp_options);
      nn::SGD opt(ddp.parameters(), {kJoinLr});
      dist::Join join({ddp});
      const int batches = model->use_A ? 2 : 3;
      const float target = model->use_A ? 1.0f : 3.0f;
      for (int b = 0; b < batches; ++b) {
        opt.zero_grad();
        mse_loss(ddp(Tensor::ones({1, 1})), Tensor::full({1, 1}, target)).backward();
        if (b == 2)
          expect(!model->A->weight.grad().defined(), "rank ", rank, ": A got a .grad after every user of A joined");
        opt.step();
      }
      join.finish();
      expect(value(model->A->weight) == 0.4375f && value(model->B->weight) == 1.734375f, "rank ", rank,
             ": (w_A, w_B) = (", model->A->weight, ", ", model->B->weight, "), want (0.4375, 1.734375)");
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("Join: a no_sync micro-step and a no-grad forward are shadowed without bucket all-reduces") {
  // World 2, the first case's model and targets (t = 1, 3), lr 0.25. Rank 0 has 1 batch.
  // Rank 1: iteration 1 synced; 2 under no_sync; 3 a forward under NoGradGuard (evaluation);
  // 4 synced, no zero_grad since 2. The joined rank 0 must issue bucket all-reduces in
  // iteration 4 only (DDP's forward tells it whether backward will sync).
  //   iteration 1: mean of 2(0 - 1) and 2(0 - 3) = -4, w = 0 - 0.25 (-4) = 1
  //   iteration 2: rank 1's local grad 2(1 - 3) = -4, kept in .grad
  //   iteration 4: .grad = -4 + -4 = -8, divided by the initial world size: -4, w = 2
  const int port = testing::free_port();
  const std::string failures = testing::on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port);
    auto model = linear_1x1(0, 0, /*bias=*/false);
    dist::DistributedDataParallel ddp(model, pg);
    nn::SGD opt(ddp.parameters(), {kJoinLr});
    dist::Join join({ddp});
    const Tensor x = Tensor::ones({1, 1}), target = Tensor::full({1, 1}, target_of(rank));
    opt.zero_grad();
    mse_loss(ddp(x), target).backward();
    opt.step();
    if (rank == 1) {
      opt.zero_grad();
      {
        auto guard = ddp.no_sync();
        mse_loss(ddp(x), target).backward();
      }
      {
        NoGradGuard evaluation;
        ddp(x);
      }
      mse_loss(ddp(x), target).backward();
      expect(value(model->weight.grad()) == -4, "rank 1: grad after the synced step ", model->weight.grad(),
             ", want -4");
      opt.step();
    }
    join.finish();
    expect(value(model->weight) == 2, "rank ", rank, ": w = ", model->weight, ", want 2");
    testing::leave();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("Join: destroyed without finish(), it says what to fix and terminates instead of leaving peers waiting") {
  if (testing::under_mpirun()) return;  // forks a rank of its own
  const std::string log =
      (std::filesystem::temp_directory_path() / ("nanoddp_join_" + std::to_string(::getpid()) + ".log")).string();
  const int port = testing::free_port();
  const std::string failures = testing::run_ranks(1, [&](int rank) {
    auto pg = testing::join(rank, 1, port);
    dist::DistributedDataParallel ddp(linear_1x1(0, 0, /*bias=*/false), pg);
    if (std::freopen(log.c_str(), "w", stderr) == nullptr) throw std::runtime_error("cannot open " + log);
    std::signal(SIGABRT, SIG_DFL);  // doctest's crash report is for the parent's cases
    dist::Join join({ddp});
  });
  std::ifstream in(log);
  const std::string printed((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(log.c_str());
  CHECK_MESSAGE(failures.find("killed by signal 6") != std::string::npos, "want SIGABRT (std::terminate), got: ", failures);
  CHECK_MESSAGE(printed.find("destroyed without finish(): the other ranks would wait") != std::string::npos, printed);
  CHECK_MESSAGE(printed.find("Call join.finish()") != std::string::npos, printed);
}

namespace {
// |got - want| <= 1e-5 max(1, |want|) everywhere, else a message naming what and where.
void expect_close(const std::vector<float>& got, const std::vector<double>& want, const std::string& what, int rank) {
  expect(got.size() == want.size(), "rank ", rank, ": ", what, " has ", got.size(), " values, expected ", want.size());
  for (size_t i = 0; i < want.size(); ++i)
    expect(std::abs(got[i] - want[i]) <= 1e-5 * std::max(1.0, std::abs(want[i])), "rank ", rank, ": ", what, "[", i,
           "] = ", got[i], ", expected ", want[i]);
}
}  // namespace

TEST_CASE("broadcast_buffers: every forward starts from rank 0's running stats; off, each rank keeps its own") {
  // BatchNorm1d(2) alone; rank r at step s sees x = [[r + s, 2r], [r + s + 2, 2r + 4]]: batch
  // means (r + s + 1, 2r + 2), unbiased vars (2, 8). With broadcast_buffers, rank r ends step s
  // with 0.9 R0 + 0.1 mean_r, R0 being rank 0's running stats after step s - 1 (its own
  // recurrence); without, with 0.9 R_r + 0.1 mean_r, its own.
  constexpr int kSteps = 3;
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port);
      for (bool broadcast : {true, false}) {
        dist::DDPOptions options;
        options.broadcast_buffers = broadcast;
        auto norm = std::make_shared<nn::BatchNorm1d>(2);
        dist::DistributedDataParallel ddp(norm, pg, options);
        double rank0_mean[2] = {0, 0}, rank0_var[2] = {1, 1}, own_mean[2] = {0, 0}, own_var[2] = {1, 1};
        for (int s = 0; s < kSteps; ++s) {
          const float r = static_cast<float>(rank);
          sum(ddp(Tensor::from_vector({r + s, 2 * r, r + s + 2, 2 * r + 4}, {2, 2}))).backward();
          const double mean_r[2] = {rank + s + 1.0, 2.0 * rank + 2}, mean_0[2] = {s + 1.0, 2}, var[2] = {2, 8};
          const double* start_mean = broadcast ? rank0_mean : own_mean;
          const double* start_var = broadcast ? rank0_var : own_var;
          const std::vector<double> want_mean = {0.9 * start_mean[0] + 0.1 * mean_r[0], 0.9 * start_mean[1] + 0.1 * mean_r[1]};
          const std::vector<double> want_var = {0.9 * start_var[0] + 0.1 * var[0], 0.9 * start_var[1] + 0.1 * var[1]};
          const std::string what = std::string(broadcast ? "with" : "without") + " broadcast, step " + std::to_string(s);
          expect_close(norm->running_mean.to_vector(), want_mean, "running_mean " + what, rank);
          expect_close(norm->running_var.to_vector(), want_var, "running_var " + what, rank);
          expect(norm->num_batches_tracked.to_int_vector() == std::vector<int64_t>{s + 1}, "rank ", rank, ": ", what,
                 ": num_batches_tracked ", norm->num_batches_tracked);
          for (int c = 0; c < 2; ++c) {
            rank0_mean[c] = 0.9 * rank0_mean[c] + 0.1 * mean_0[c];
            rank0_var[c] = 0.9 * rank0_var[c] + 0.1 * var[c];
            own_mean[c] = want_mean[c];
            own_var[c] = want_var[c];
          }
        }
      }
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

namespace {

// A bias-free Linear(1, 1) and a float32 buffer "count" that every forward raises by rank + 1.
struct CountingForwards : nn::Module {
  std::shared_ptr<nn::Linear> fc = register_module("fc", linear_1x1(1, 0, false));
  Tensor count = register_buffer("count", Tensor::zeros({1}));
  float step;
  explicit CountingForwards(int rank) : step(static_cast<float>(rank + 1)) {}
  Tensor forward(const Tensor& x) override {
    {
      NoGradGuard no_grad;
      count.copy_(count + Tensor::full({1}, step));
    }
    return (*fc)(x);
  }
};

}  // namespace

TEST_CASE("broadcast_buffers: a forward takes rank 0's buffers when the forward before it synced, as PyTorch 1.13's") {
  // torch's forward broadcasts when require_forward_param_sync is set, which the previous
  // forward sets (grad enabled, not under no_sync) or clears. Rank r's count after each of
  // six forwards (each adds r + 1):
  //   1 synced (the first broadcasts 0):         r + 1
  //   2 under no_grad (1 synced: rank 0's 1):    r + 2
  //   3 synced (2 did not sync: its own):        2r + 3
  //   4 under no_sync (3 synced: rank 0's 3):    r + 4
  //   5 synced (4 did not sync: its own):        2r + 5
  //   6 under no_grad (5 synced: rank 0's 5):    r + 6
  // Deciding by the current forward instead gives rank 1 4, 5, 7, 8, 11 from the second on.
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port);
      auto model = std::make_shared<CountingForwards>(rank);
      dist::DistributedDataParallel ddp(model, pg);
      const Tensor x = Tensor::ones({1, 1});
      const auto synced = [&] { sum(ddp(x)).backward(); };
      const auto no_grad = [&] {
        NoGradGuard guard;
        ddp(x);
      };
      const auto no_sync = [&] {
        auto guard = ddp.no_sync();
        sum(ddp(x)).backward();
      };
      const std::vector<std::function<void()>> forwards = {synced, no_grad, synced, no_sync, synced, no_grad};
      const std::vector<float> want = {rank + 1.0f, rank + 2.0f, 2.0f * rank + 3, rank + 4.0f, 2.0f * rank + 5,
                                       rank + 6.0f};
      for (size_t i = 0; i < forwards.size(); ++i) {
        forwards[i]();
        expect(value(model->count) == want[i], "rank ", rank, ": count after forward ", i + 1, " is ",
               model->count, ", want ", want[i]);
      }
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE(
    "a backward through the bare model, not DDP's forward, stays local and issues nothing, on one rank or "
    "all") {
  // Bias-free Linear(1, 1), w = 1, x = r + 1 on rank r, loss sum: local gradient r + 1, mean
  // 1.5. Only a backward through DDP's output reduces (DDP's header): calling ddp.module()
  // directly (a per-rank diagnostic) must neither average nor pair with the peer's next
  // collective.
  const int world = 2, port = testing::free_port();
  const std::string failures = testing::on_ranks(world, [&](int rank) {
    auto pg = testing::join(rank, world, port);
    auto model = std::make_shared<ThrowsInBackward>();
    dist::DistributedDataParallel ddp(model, pg);
    const Tensor x = Tensor::full({1, 1}, rank + 1.0f);
    const float local = rank + 1.0f, mean = 1.5f;
    const auto all_reduces = [&] { return pg->count(dist::Collective::AllReduce).calls; };
    const auto bare_backward = [&](const char* when) {
      ddp.zero_grad();
      const int64_t before = all_reduces();
      sum((*model)(x)).backward();
      expect(value(model->inner->weight.grad()) == local && all_reduces() == before, "rank ", rank,
             ": bare backward ", when, " gave ", model->inner->weight.grad(), " after ",
             all_reduces() - before, " all_reduce(s), want the local ", local, " after none");
    };
    const auto ddp_step = [&](const char* when) {
      ddp.zero_grad();
      sum(ddp(x)).backward();
      expect(value(model->inner->weight.grad()) == mean, "rank ", rank, ": DDP backward ", when, " gave ",
             model->inner->weight.grad(), ", want the mean ", mean);
    };
    if (rank == 0) bare_backward("on rank 0 alone, before any DDP forward");
    ddp_step("after rank 0's bare one");
    // A DDP backward that an exception inside the model ends after the output's node ran, before
    // any gradient was final: the bare backwards after it are still local.
    ddp.zero_grad();
    model->throwing = true;
    bool thrown = false;
    try {
      sum(ddp(x)).backward();
    } catch (const ValueError&) {
      thrown = true;
    }
    model->throwing = false;
    expect(thrown, "rank ", rank, ": the model's backward did not throw");
    bare_backward("on every rank, after a DDP backward that threw");
    if (rank == 0) bare_backward("on rank 0 alone, after a DDP backward that threw");
    ddp_step("after the backward that threw");
    bare_backward("on every rank, after a DDP step");
    if (rank == 0) bare_backward("on rank 0 alone, after a DDP step");
    ddp_step("after the bare ones");
    // A second backward through one DDP forward's graph is still reduced (DDP's header).
    ddp.zero_grad();
    Tensor loss = sum(ddp(x));
    loss.backward(Tensor(), /*retain_graph=*/true);
    loss.backward();
    expect(value(model->inner->weight.grad()) == 2 * mean, "rank ", rank,
           ": two backwards of one forward gave ", model->inner->weight.grad(), ", want ", 2 * mean);
    testing::leave();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE(
    "a parameter only the loss uses (a regulariser's) is reduced, though its gradient is final before DDP's "
    "output node runs") {
  // loss = sum(ddp(x)) + sum(extra * (r + 1)), the second term built last, so the engine
  // finishes extra's gradient (r + 1) before it reaches DDP's output node. It must still get
  // the mean 1.5 on every rank, with find_unused_parameters or without.
  struct WithExtra : nn::Module {
    std::shared_ptr<nn::Linear> used = register_module("used", linear_1x1(1, 0, /*bias=*/false));
    std::shared_ptr<nn::Linear> extra = register_module("extra", linear_1x1(1, 0, /*bias=*/false));
    Tensor forward(const Tensor& x) override { return (*used)(x); }
  };
  for (bool find_unused : {false, true}) {
    CAPTURE(find_unused);
    const int world = 2, port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port);
      auto model = std::make_shared<WithExtra>();
      dist::DDPOptions options;
      options.find_unused_parameters = find_unused;
      dist::DistributedDataParallel ddp(model, pg, options);
      const Tensor x = Tensor::full({1, 1}, rank + 1.0f);
      for (int step = 0; step < 2; ++step) {
        ddp.zero_grad();
        const Tensor from_output = sum(ddp(x));
        const Tensor from_loss_only = sum(model->extra->weight * Tensor::full({1, 1}, rank + 1.0f));
        (from_output + from_loss_only).backward();
        expect(value(model->extra->weight.grad()) == 1.5f && value(model->used->weight.grad()) == 1.5f,
               "rank ", rank, " step ", step, ": extra.grad ", model->extra->weight.grad(), ", used.grad ",
               model->used->weight.grad(), ", want the means 1.5 and 1.5");
      }
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("no_sync is decided by the forward, as PyTorch's: only a backward of a forward outside it reduces") {
  // Bias-free Linear(1, 1), w = 1, x = r + 1 on rank r, loss sum: the local gradient is r + 1,
  // the mean over W ranks (W + 1) / 2. The forward is what prepares the backward in torch
  // (prepare_for_backward), so where the backward runs does not matter.
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port);
      auto model = linear_1x1(1, 0, /*bias=*/false);
      dist::DistributedDataParallel ddp(model, pg);
      const Tensor x = Tensor::full({1, 1}, rank + 1.0f);
      const float local = rank + 1.0f, mean = (world + 1) / 2.0f;
      // Forward inside no_sync, backward outside: local, as torch (no all-reduce).
      ddp.zero_grad();
      Tensor y;
      {
        auto guard = ddp.no_sync();
        y = ddp(x);
      }
      sum(y).backward();
      expect(value(model->weight.grad()) == local, "rank ", rank, ": forward under no_sync gave ",
             model->weight.grad(), ", want the local ", local);
      // Forward outside, backward inside: reduced (the accumulated 2 (r + 1) averaged).
      y = ddp(x);
      {
        auto guard = ddp.no_sync();
        sum(y).backward();
      }
      expect(value(model->weight.grad()) == 2 * mean, "rank ", rank, ": backward under no_sync gave ",
             model->weight.grad(), ", want the mean ", 2 * mean);
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("Join: a forward under no_sync whose backward runs outside it is shadowed as a no_sync step") {
  // Rank 0 runs 2 iterations, rank 1 one; rank 0's second has only its forward under no_sync.
  // Iteration 1: both reduce, w.grad = mean(1, 3) = 2. Iteration 2: rank 0 alone, local:
  // 2 + 1 = 3, and rank 1, joined, issues no bucket all-reduce for it.
  const int port = testing::free_port();
  const std::string failures = testing::on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port);
    auto model = linear_1x1(1, 0, /*bias=*/false);
    dist::DistributedDataParallel ddp(model, pg);
    const Tensor x = Tensor::full({1, 1}, rank == 0 ? 1.0f : 3.0f);
    {
      dist::Join join({ddp});
      for (int s = 0; s < (rank == 0 ? 2 : 1); ++s) {
        Tensor y;
        if (s == 1) {
          auto guard = ddp.no_sync();
          y = ddp(x);
        } else {
          y = ddp(x);
        }
        sum(y).backward();
      }
      join.finish();
    }
    const float want = rank == 0 ? 3.0f : 2.0f;
    expect(value(model->weight.grad()) == want, "rank ", rank, ": w.grad is ", model->weight.grad(), ", want ",
           want);
    testing::leave();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

namespace {

// Linear(2, 1) with one buffer of each dtype: uint8 [3], int32 [2], float16 [2], bfloat16 [1],
// float32 [1], int64 [1], holding bytes_tensor's pattern of the rank.
struct EveryDtypeBuffers : nn::Module {
  std::shared_ptr<nn::Linear> fc;
  explicit EveryDtypeBuffers(int rank) : fc(register_module("fc", std::make_shared<nn::Linear>(2, 1, default_generator()))) {
    const std::pair<DType, int64_t> specs[] = {{DType::UInt8, 3},   {DType::Int32, 2},   {DType::Float16, 2},
                                               {DType::BFloat16, 1}, {DType::Float32, 1}, {DType::Int64, 1}};
    int k = 0;
    for (const auto& [dtype, numel] : specs)
      register_buffer("b" + std::to_string(k++), testing::bytes_tensor(dtype, numel, rank));
  }
  Tensor forward(const Tensor& x) override { return (*fc)(x); }
  // Throws unless every buffer holds bytes_tensor's pattern of seed.
  void expect_buffers(int seed, const std::string& what) const {
    for (const auto& [name, b] : named_buffers()) testing::expect_bytes(b, seed, what + ", buffer " + name);
  }
};

}  // namespace

TEST_CASE("buffers of any dtype start as rank 0's under DDP and FSDP, and broadcast_buffers sends them each forward") {
  // PyTorch's DDP and FSDP broadcast buffers of any dtype (a uint8 mask, an int32 index).
  const int port = testing::free_port();
  const std::string failures = testing::on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port);
    auto model = std::make_shared<EveryDtypeBuffers>(rank);
    {
      dist::DistributedDataParallel ddp(model, pg);
      model->expect_buffers(0, "rank " + std::to_string(rank) + ": DDP's construction");
      // Rank 1 changes its buffers; the next forward that syncs brings rank 0's back.
      if (rank == 1)
        for (Tensor& b : model->buffers()) b.copy_(testing::bytes_tensor(b.dtype(), b.numel(), 5));
      sum(ddp(Tensor::ones({1, 2}))).backward();
      model->expect_buffers(0, "rank " + std::to_string(rank) + ": DDP's forward");
    }
    auto sharded = std::make_shared<EveryDtypeBuffers>(rank);
    dist::FullyShardedDataParallel fsdp(sharded, pg);
    sharded->expect_buffers(0, "rank " + std::to_string(rank) + ": FSDP's construction");
    testing::leave();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("Join: buffers come from the highest rank still training, and the last joiner's at the end") {
  // BatchNorm1d(1) alone, 2 ranks: rank 0 has 1 batch, rank 1 has 3. Rank r's batch s is
  // {a, a + 2}, a = 10 r + s: mean a + 1, unbiased var 2. Inside the Join the broadcast source
  // is rank 1 (the highest rank training), so rank 1 updates only its own running stats:
  //   running_mean 0.1 * 11 = 1.1, then 0.9 * 1.1 + 0.1 * 12 = 2.19, then 0.9 * 2.19 + 1.3 = 3.271
  //   running_var  0.9 + 0.2 = 1.1, then 1.19, then 1.271; num_batches_tracked 3.
  // Rank 0, joined, shadows the broadcasts (else: the collective-mismatch error) and ends with
  // rank 1's buffers from the final model sync.
  const int port = testing::free_port();
  const std::string failures = testing::on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port);
    auto norm = std::make_shared<nn::BatchNorm1d>(1);
    dist::DistributedDataParallel ddp(norm, pg);
    {
      dist::Join join({ddp});
      for (int s = 0; s < (rank == 0 ? 1 : 3); ++s) {
        const float a = 10.0f * rank + s;
        sum(ddp(Tensor::from_vector({a, a + 2}, {2, 1}))).backward();
      }
      join.finish();
    }
    expect_close(norm->running_mean.to_vector(), {3.271}, "running_mean", rank);
    expect_close(norm->running_var.to_vector(), {1.271}, "running_var", rank);
    expect(norm->num_batches_tracked.to_int_vector() == std::vector<int64_t>{3}, "rank ", rank,
           ": num_batches_tracked ", norm->num_batches_tracked);
    testing::leave();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("SyncBatchNorm on 2 and 4 ranks equals BatchNorm1d on the global batch: output, gradients, running stats") {
  // The global batch x [8, 3, 2] and an output gradient g of the same shape; rank r of W takes
  // samples [8r/W, 8(r+1)/W). Loss = sum(y * g), so the gradient of the sum of every rank's
  // loss is the 1-rank gradient: dx must match the float64 reference on each rank's rows, and
  // the ranks' weight and bias gradients must sum to the reference's.
  constexpr int64_t N = 8, C = 3, L = 2;
  Generator gen(42);
  const std::vector<float> x = Tensor::randn({N, C, L}, gen).to_vector(), g = Tensor::randn({N, C, L}, gen).to_vector();
  const std::vector<float> weight = {1.5f, -0.5f, 2.0f}, bias = {0.25f, 0.0f, -1.0f};
  // float64 reference: y from tests/op_cases.h's ref_batch_norm; dx = w invstd (g - mean(g) - xhat mean(g xhat)).
  const testing::Values xs(x.begin(), x.end()), ws(weight.begin(), weight.end()), bs(bias.begin(), bias.end());
  const testing::Values want_y = testing::ref_batch_norm(xs, ws, bs, N, C, L);
  testing::Values want_dx(x.size()), want_dw(C), want_db(C), mean(C), var(C);
  for (int64_t c = 0; c < C; ++c) {
    double s = 0, s2 = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) s += xs[(n * C + c) * L + l];
    mean[c] = s / (N * L);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) s2 += std::pow(xs[(n * C + c) * L + l] - mean[c], 2);
    var[c] = s2 / (N * L);
    const double invstd = 1 / std::sqrt(var[c] + 1e-5);
    double g_sum = 0, gx_sum = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) {
        const size_t i = (n * C + c) * L + l;
        g_sum += g[i];
        gx_sum += g[i] * (xs[i] - mean[c]) * invstd;
      }
    want_dw[c] = gx_sum;
    want_db[c] = g_sum;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) {
        const size_t i = (n * C + c) * L + l;
        want_dx[i] = ws[c] * invstd * (g[i] - g_sum / (N * L) - (xs[i] - mean[c]) * invstd * gx_sum / (N * L));
      }
  }
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      auto pg = testing::join(rank, world, port);
      const int64_t rows = N / world, begin = rows * rank * C * L, end = rows * (rank + 1) * C * L;
      dist::SyncBatchNorm norm(C, pg);
      norm.weight.copy_(Tensor::from_vector(weight));
      norm.bias.copy_(Tensor::from_vector(bias));
      const Tensor input =
          Tensor::from_vector(std::vector<float>(x.begin() + begin, x.begin() + end), {rows, C, L}).set_requires_grad(true);
      const Tensor y = norm(input);
      sum(y * Tensor::from_vector(std::vector<float>(g.begin() + begin, g.begin() + end), {rows, C, L})).backward();
      expect_close(y.to_vector(), testing::Values(want_y.begin() + begin, want_y.begin() + end), "y", rank);
      expect_close(input.grad().to_vector(), testing::Values(want_dx.begin() + begin, want_dx.begin() + end), "dx", rank);
      Tensor dw = norm.weight.grad().clone(), db = norm.bias.grad().clone();
      pg->all_reduce(dw)->wait();
      pg->all_reduce(db)->wait();
      expect_close(dw.to_vector(), want_dw, "sum of dweight", rank);
      expect_close(db.to_vector(), want_db, "sum of dbias", rank);
      const double unbiased = double(N * L) / (N * L - 1);
      expect_close(norm.running_mean.to_vector(), {0.1 * mean[0], 0.1 * mean[1], 0.1 * mean[2]}, "running_mean", rank);
      expect_close(norm.running_var.to_vector(),
                   {0.9 + 0.1 * var[0] * unbiased, 0.9 + 0.1 * var[1] * unbiased, 0.9 + 0.1 * var[2] * unbiased},
                   "running_var", rank);
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("per-rank BatchNorm1d and SyncBatchNorm on the same data: the statistics differ, by hand") {
  // Rank 0 holds x = {1, 3}, rank 1 holds {5, 7} (one channel).
  //   BatchNorm1d, per rank: rank 0 mean 2, biased var 1 (y = -1, 1), rank 1 mean 6, var 1 (y = -1, 1);
  //     running_mean 0.2 and 0.6, running_var 0.9 + 0.1 * 2 = 1.1 on both.
  //   SyncBatchNorm: {1, 3, 5, 7}: mean 4, biased var 5 (rank 0: y = -3/sqrt5, -1/sqrt5;
  //     rank 1: 1/sqrt5, 3/sqrt5), unbiased 20/3: running_mean 0.4 and running_var
  //     0.9 + 0.1 * 20/3 = 1.5667 on both ranks.
  const int port = testing::free_port();
  const std::string failures = testing::on_ranks(2, [&](int rank) {
    auto pg = testing::join(rank, 2, port);
    const float first = rank == 0 ? 1.0f : 5.0f;
    const Tensor x = Tensor::from_vector({first, first + 2}, {2, 1});
    nn::BatchNorm1d local(1);
    const double e = 1e-5;
    expect_close(local(x).to_vector(), {-1 / std::sqrt(1 + e), 1 / std::sqrt(1 + e)}, "BatchNorm1d y", rank);
    expect_close(local.running_mean.to_vector(), {rank == 0 ? 0.2 : 0.6}, "BatchNorm1d running_mean", rank);
    expect_close(local.running_var.to_vector(), {1.1}, "BatchNorm1d running_var", rank);
    dist::SyncBatchNorm synced(1, pg);
    const double d = std::sqrt(5 + e), a = rank == 0 ? -3 : 1;
    expect_close(synced(x).to_vector(), {a / d, (a + 2) / d}, "SyncBatchNorm y", rank);
    expect_close(synced.running_mean.to_vector(), {0.4}, "SyncBatchNorm running_mean", rank);
    expect_close(synced.running_var.to_vector(), {0.9 + 0.1 * 20.0 / 3}, "SyncBatchNorm running_var", rank);
    // convert_sync_batchnorm makes a model's BatchNorm1d the synced one.
    auto model = std::make_shared<nn::Sequential>();
    model->add(std::make_shared<nn::BatchNorm1d>(1));
    dist::convert_sync_batchnorm(model, pg);
    expect_close((*model)(x).to_vector(), {a / d, (a + 2) / d}, "converted y", rank);
    // The same data shifted by 2^16: the statistics move by the shift only. Merging the ranks'
    // own means and variances keeps var = 5 exactly; sum x^2 / M - mean^2 from float32 sums
    // (x^2 ~ 4.3e9, one float step 512) did not keep a digit of it.
    const Tensor shifted = Tensor::from_vector({65536 + first, 65536 + first + 2}, {2, 1});
    dist::SyncBatchNorm far(1, pg);
    expect_close(far(shifted).to_vector(), {a / d, (a + 2) / d}, "shifted SyncBatchNorm y", rank);
    expect_close(far.running_mean.to_vector(), {0.1 * 65540}, "shifted SyncBatchNorm running_mean", rank);
    expect_close(far.running_var.to_vector(), {0.9 + 0.1 * 20.0 / 3}, "shifted SyncBatchNorm running_var", rank);
    // Rank 1 with no rows at all: the statistics are rank 0's {1, 3} (mean 2, biased var 1).
    dist::SyncBatchNorm uneven(1, pg);
    const Tensor rows = rank == 0 ? Tensor::from_vector({1.0f, 3.0f}, {2, 1}) : Tensor::zeros({0, 1});
    const std::vector<double> want_rows =
        rank == 0 ? std::vector<double>{-1 / std::sqrt(1 + e), 1 / std::sqrt(1 + e)} : std::vector<double>{};
    expect_close(uneven(rows).to_vector(), want_rows, "SyncBatchNorm y with an empty rank", rank);
    expect_close(uneven.running_mean.to_vector(), {0.2}, "SyncBatchNorm running_mean with an empty rank", rank);
    expect_close(uneven.running_var.to_vector(), {0.9 + 0.1 * 2}, "SyncBatchNorm running_var with an empty rank", rank);
    testing::leave();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("the DDP edge cases pass on MPI too (this file under mpirun -np 2 and -np 4)") {
  if (testing::under_mpirun()) return;
  if (!testing::have_mpirun()) {
    MESSAGE("mpirun not found: the MPI half of this file did not run");
    return;
  }
  for (int np : {2, 4}) {
    CAPTURE(np);
    const testing::RunResult r =
        testing::mpirun_self("tests/test_ddp_edges", np, "--test-case-exclude='*mpirun*'");
    CHECK_MESSAGE(r.code() == 0, "mpirun -np ", np, " failed:\n", r.out, r.err);
  }
}

TEST_CASE("the Join cases pass on the shm backend too (this file with NANODDP_TEST_BACKEND=shm)") {
  if (testing::under_mpirun() || std::getenv("NANODDP_TEST_BACKEND") != nullptr) return;
  const testing::RunResult r =
      testing::rerun_with_backend("tests/test_ddp_edges", "shm", "--test-case='Join:*'", std::chrono::seconds(120));
  CHECK_MESSAGE(r.code() == 0, "shm run failed:\n", r.out, r.err);
}
