// DDP at the edges, on 2 and 4 ranks, on Gloo (forked ranks) and MPI (this file again under
// mpirun -np 2 and -np 4): parameters used on some ranks only, used only inside no_sync, and
// tied parameters. Inputs are the small ones of the bug reports, results computed by hand.
#include <doctest/doctest.h>

#include "core/ops.h"
#include "dist/ddp.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "tests/dist_ranks.h"

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
      nn::SGD opt(ddp.parameters(), {/*lr=*/1.0f});
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
      nn::SGD opt(ddp.parameters(), {/*lr=*/0.1f});
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
      // Nothing was started: the group is still in step.
      Tensor t = Tensor::full({3}, static_cast<float>(rank + 1));
      pg->all_reduce(t)->wait();
      expect(t.to_vector() == std::vector<float>(3, world * (world + 1) / 2.0f), "rank ", rank, ": ", t);
      testing::leave();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

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
      nn::SGD opt(ddp.parameters(), {/*lr=*/1.0f});
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
