// A training program outside nanoddp: a layer of its own (Swish, with its backward),
// gradient-checked, then a small regression trained with DistributedDataParallel.
//
//   nanoddp-run --nproc-per-node 2 build/swish_regression
//
// Rank 0 ends with one JSON line: the gradient check's error, the loss (averaged over ranks)
// before and after training, and the largest difference of any parameter between ranks (0
// when DDP kept the replicas identical). Exits 1 when the check fails or replicas differ.
#include <cmath>
#include <cstdio>

#include <nanoddp/nanoddp.h>

using namespace nanoddp;

// ---- Swish (torch.nn.SiLU): y = x * sigmoid(x) ------------------------------------------

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

struct SwishBackward : Node {
  // dy/dx = s + x * s * (1 - s) with s = sigmoid(x). x is saved: a node's inputs are edges
  // that keep no memory (Note [Graph edges] in core/autograd.h).
  std::vector<Tensor> apply(const Tensor& dy) override {
    const Tensor& x = saved(0);
    Tensor dx = Tensor::empty(x.shape());
    const float* xs = x.data<float>();
    const float* g = dy.data<float>();
    float* out = dx.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double s = sigmoid(xs[i]);
      out[i] = static_cast<float>(g[i] * (s + xs[i] * s * (1.0 - s)));
    }
    return {dx};
  }
  const char* name() const override { return "SwishBackward"; }
};

// x: any shape, float32, CPU -> same shape.
Tensor swish(const Tensor& x) {
  NANODDP_CHECK(x.device().is_cpu(), DeviceError, "swish: this kernel is CPU-only, got a ", x.device(), " tensor");
  Tensor y = Tensor::empty(x.shape());
  const float* xs = x.data<float>();
  float* ys = y.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) ys[i] = static_cast<float>(xs[i] * sigmoid(xs[i]));
  auto node = std::make_shared<SwishBackward>();
  node->inputs = {x};
  node->save_for_backward({x});
  return make_result(y, node);
}

class Swish : public nn::Module {
 public:
  Tensor forward(const Tensor& input) override { return swish(input); }
};

// Largest |analytic - numeric| of d sum(swish(x) * w) / dx, numeric by central differences.
double gradient_check() {
  Generator gen(1);
  Tensor x = Tensor::randn({8, 4}, gen).set_requires_grad(true);
  const Tensor w = Tensor::randn({8, 4}, gen);
  swish(x).backward(w);
  const std::vector<float> xs = x.to_vector(), ws = w.to_vector(), grad = x.grad().to_vector();
  double worst = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    auto f = [&](double v) { return v * sigmoid(v) * ws[i]; };
    const double h = 1e-6, numeric = (f(xs[i] + h) - f(xs[i] - h)) / (2 * h);
    worst = std::max(worst, std::abs(grad[i] - numeric));
  }
  return worst;
}

// ---- training ---------------------------------------------------------------------------

// The mean of value over all ranks.
float mean_over_ranks(dist::ProcessGroup& pg, float value) {
  Tensor t = Tensor::from_vector({value});
  pg.all_reduce(t, dist::ReduceOp::Sum)->wait();
  return t.item() / static_cast<float>(pg.size());
}

// Largest |p - mean over ranks of p| over all parameters and ranks.
float replica_difference(dist::ProcessGroup& pg, nn::Module& model) {
  float worst = 0;
  for (const Tensor& p : model.parameters()) {
    const std::vector<float> mine = p.to_vector();
    Tensor sum = Tensor::from_vector(mine, p.shape());
    pg.all_reduce(sum, dist::ReduceOp::Sum)->wait();
    const std::vector<float> total = sum.to_vector();
    for (size_t i = 0; i < mine.size(); ++i)
      worst = std::max(worst, std::abs(mine[i] - total[i] / static_cast<float>(pg.size())));
  }
  Tensor t = Tensor::from_vector({worst});
  pg.all_reduce(t, dist::ReduceOp::Max)->wait();
  return t.item();
}

int main() {
  try {
    const double gradient_error = gradient_check();
    auto pg = dist::init_process_group();
    const int rank = pg->rank(), world_size = pg->size();

    // y = sin(x) on 256 points of [-3, 3]; rank r takes every world_size-th point from r.
    constexpr int kPoints = 256;
    std::vector<float> xs, ys;
    for (int i = rank; i < kPoints; i += world_size) {
      const float x = -3.0f + 6.0f * static_cast<float>(i) / (kPoints - 1);
      xs.push_back(x);
      ys.push_back(std::sin(x));
    }
    const int64_t n = static_cast<int64_t>(xs.size());
    const Tensor x = Tensor::from_vector(xs, {n, 1}), y = Tensor::from_vector(ys, {n, 1});

    Generator gen(0);
    auto model = std::make_shared<nn::Sequential>();
    model->add(nn::Linear(1, 32, gen));
    model->add(Swish());
    model->add(nn::Linear(32, 1, gen));
    dist::DistributedDataParallel ddp(model, pg);
    nn::SGD optimizer(ddp.parameters(), {/*lr=*/0.05, /*momentum=*/0.9f});

    float first_loss = 0, last_loss = 0;
    constexpr int kSteps = 300;
    for (int step = 0; step < kSteps; ++step) {
      optimizer.zero_grad();
      Tensor loss = mse_loss(ddp(x), y);
      loss.backward();
      optimizer.step();
      if (step == 0) first_loss = mean_over_ranks(*pg, loss.item());
    }
    {
      NoGradGuard no_grad;
      last_loss = mean_over_ranks(*pg, mse_loss((*model)(x), y).item());
    }
    const float difference = replica_difference(*pg, *model);
    if (rank == 0)
      std::printf(
          "{\"world_size\":%d,\"gradient_error\":%.3g,\"first_loss\":%.6f,\"last_loss\":%.6f,"
          "\"replica_difference\":%g}\n",
          world_size, gradient_error, first_loss, last_loss, difference);
    pg->barrier()->wait();  // rank 0 serves the store: let every rank finish first
    dist::destroy_process_group();
    if (gradient_error > 1e-3) throw ValueError("gradient check failed");
    if (difference != 0) throw ValueError("the ranks' parameters differ after training");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "swish_regression: %s\n", message_of(e).c_str());
    return 1;
  }
}
