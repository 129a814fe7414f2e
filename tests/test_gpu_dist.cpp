// NCCL and DDP on one GPU (world size 1: one GPU cannot hold two NCCL ranks). The collectives
// must give exact results on CUDA tensors, and DDP on CUDA must train like the CPU reference.
#include <doctest/doctest.h>

#include <cmath>

#include "core/ops.h"
#include "dist/ddp.h"
#include "dist/init.h"
#include "nn/layers.h"
#include "nn/optim.h"

using namespace nanoddp;

namespace {

std::shared_ptr<dist::ProcessGroup> nccl_group() {
  if (dist::is_initialized()) return dist::default_process_group();
  dist::InitOptions options;
  options.backend = dist::Backend::Nccl;
  options.device = Device::cuda(0);
  options.world_size = 1;
  options.rank = 0;
  options.timeout = std::chrono::seconds(60);
  return dist::init_process_group(options);
}

std::shared_ptr<nn::Sequential> mlp() {
  Generator gen(3);
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Linear(6, 16, gen));
  model->add(nn::ReLU());
  model->add(nn::Linear(16, 4, gen));
  return model;
}

}  // namespace

TEST_CASE("NCCL collectives on a CUDA tensor, world size 1: exact values") {
#if !NANODDP_WITH_NCCL
  MESSAGE("this build has no NCCL: nothing to check");
  return;
#endif
  auto pg = nccl_group();
  CHECK(pg->backend_name() == "nccl");
  const Device gpu = Device::cuda(0);
  for (int64_t n : {1, 257, 65537, (1 << 20) + 3}) {
    CAPTURE(n);
    Tensor t = Tensor::full({n}, 1.0f, gpu);  // rank r contributes r + 1
    pg->all_reduce(t, dist::ReduceOp::Sum)->wait();
    for (float v : t.to_vector()) REQUIRE(v == 1.0f);
    pg->all_reduce(t, dist::ReduceOp::Avg)->wait();
    CHECK(t.to_vector()[static_cast<size_t>(n - 1)] == 1.0f);
  }
  Tensor counts = Tensor::from_vector(std::vector<int64_t>{7, 9}, {}, gpu);
  pg->all_reduce(counts, dist::ReduceOp::Max)->wait();
  CHECK(counts.to_int_vector() == std::vector<int64_t>{7, 9});
  Tensor b = Tensor::arange(5, gpu);
  pg->broadcast(b, 0)->wait();
  CHECK(b.to_vector() == std::vector<float>{0, 1, 2, 3, 4});
  std::vector<Tensor> gathered{Tensor::zeros({3}, DType::Float32, gpu)};
  pg->all_gather(gathered, Tensor::full({3}, 2.0f, gpu))->wait();
  CHECK(gathered[0].to_vector() == std::vector<float>{2, 2, 2});
  pg->barrier()->wait();
}

TEST_CASE("DDP on a GPU (NCCL, world size 1) trains like the same model on the CPU") {
#if !NANODDP_WITH_NCCL
  MESSAGE("this build has no NCCL: nothing to check");
  return;
#endif
  auto pg = nccl_group();
  auto cpu_model = mlp(), gpu_model = mlp();
  gpu_model->to(Device::cuda(0));
  dist::DistributedDataParallel ddp(gpu_model, pg);
  nn::SGD cpu_opt(cpu_model->parameters(), {/*lr=*/0.1f, /*momentum=*/0.9f});
  nn::SGD gpu_opt(ddp.parameters(), {/*lr=*/0.1f, /*momentum=*/0.9f});
  Generator gen(11);
  for (int step = 0; step < 10; ++step) {
    const Tensor x = Tensor::randn({32, 6}, gen);
    std::vector<int64_t> labels;
    for (int i = 0; i < 32; ++i) labels.push_back(static_cast<int64_t>(gen.randint(4)));
    const Tensor y = Tensor::from_vector(labels);
    cpu_opt.zero_grad();
    cross_entropy((*cpu_model)(x), y).backward();
    cpu_opt.step();
    gpu_opt.zero_grad();
    cross_entropy(ddp(x.to(Device::cuda(0))), y.to(Device::cuda(0))).backward();
    gpu_opt.step();
  }
  const auto cpu_params = cpu_model->named_parameters(), gpu_params = gpu_model->named_parameters();
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    CAPTURE(cpu_params[i].first);
    const std::vector<float> a = cpu_params[i].second.to_vector(), b = gpu_params[i].second.to_vector();
    float worst = 0;
    for (size_t j = 0; j < a.size(); ++j) worst = std::max(worst, std::abs(a[j] - b[j]));
    CHECK(worst < 1e-4f);
  }
}
