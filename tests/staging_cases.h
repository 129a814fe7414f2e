// Cases for a CPU group (Gloo, MPI) that stages another device's tensors through host memory
// (dist/host_staging.h), run inside each rank: cuda:0 in the gpu suite, where every rank
// shares one GPU; the host stand-in cpu:1 in the dist suite, which needs no GPU.
//
//   auto pg = dist::init_process_group(options);        // Gloo: staged
//   check_staged_collectives(*pg, Device::cuda(0));     // throws naming the first mismatch
//   check_ddp_matches_one_rank(pg, Device::cuda(0));
//
// Inputs are tests/collectives_cases.h's: exact in float32, expectations in double.
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>
#include <vector>

#include "core/ops.h"
#include "dist/ddp.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "tests/collectives_cases.h"

namespace nanoddp::testing {

inline Tensor on(Device device, DType dtype, int64_t numel, const std::function<double(int64_t)>& f) {
  return make_tensor(dtype, numel, f).to(device);
}

inline void expect_on(const Tensor& t, Device device, const std::string& what) {
  expect(t.device() == device, what, ": the result is on ", t.device(), ", expected ", device);
}

// Every collective on `device` tensors: exact values, results still on `device`.
inline void check_staged_collectives(dist::ProcessGroup& pg, Device device) {
  using dist::ReduceOp;
  const int n = pg.size(), rank = pg.rank();
  const double s = n * (n + 1) / 2.0;
  for (int64_t numel : {int64_t(1), int64_t(1000), int64_t(65537)}) {
    const std::string at = " n=" + std::to_string(numel) + " on " + device.str();
    Tensor sum = on(device, DType::Float32, numel, [&](int64_t i) { return (rank + 1) * pattern(i); });
    pg.all_reduce(sum, ReduceOp::Sum)->wait();
    expect_on(sum, device, "sum" + at);
    expect_values(sum, [&](int64_t i) { return s * pattern(i); }, "sum" + at);

    Tensor avg = on(device, DType::Float32, numel, [&](int64_t i) { return (rank + 1) * pattern(i); });
    pg.all_reduce(avg, ReduceOp::Avg)->wait();
    expect_values(avg, [&](int64_t i) { return s / n * pattern(i); }, "avg" + at);

    Tensor max = on(device, DType::Int64, numel, [&](int64_t i) { return (rank + 1) * (i % 1000); });
    pg.all_reduce(max, ReduceOp::Max)->wait();
    expect_on(max, device, "int64 max" + at);
    expect_values(max, [&](int64_t i) { return n * double(i % 1000); }, "int64 max" + at);

    Tensor b = on(device, DType::Float32, numel, [&](int64_t i) { return rank * 10.0 + (i % 3); });
    pg.broadcast(b, n - 1)->wait();
    expect_values(b, [&](int64_t i) { return (n - 1) * 10.0 + (i % 3); }, "broadcast" + at);

    std::vector<Tensor> gathered;
    for (int r = 0; r < n; ++r) gathered.push_back(Tensor::zeros({numel}, DType::Float32, device));
    pg.all_gather(gathered, on(device, DType::Float32, numel, [&](int64_t i) { return (rank + 1) * pattern(i); }))
        ->wait();
    for (int r = 0; r < n; ++r) {
      expect_on(gathered[r], device, "all_gather" + at);
      expect_values(gathered[r], [&](int64_t i) { return (r + 1) * pattern(i); },
                    "all_gather slot " + std::to_string(r) + at);
    }

    std::vector<Tensor> inputs;
    for (int r = 0; r < n; ++r)
      inputs.push_back(on(device, DType::Float32, numel, [&](int64_t i) { return (rank + 1) * (r + 1) * pattern(i); }));
    Tensor scattered = Tensor::zeros({numel}, DType::Float32, device);
    pg.reduce_scatter(scattered, inputs, ReduceOp::Sum)->wait();
    expect_on(scattered, device, "reduce_scatter" + at);
    expect_values(scattered, [&](int64_t i) { return s * (rank + 1) * pattern(i); }, "reduce_scatter" + at);
  }
  pg.barrier()->wait();
}

inline std::shared_ptr<nn::Sequential> staging_mlp() {
  Generator gen(21);
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Linear(5, 8, gen));
  model->add(nn::ReLU());
  model->add(nn::Linear(8, 3, gen));
  return model;
}

// DDP over pg with the model on `device`, rank r taking its share of each global batch of 16,
// against one process training the same model on the whole batch on the CPU: the parameters
// must agree within tolerance after every one of 5 SGD steps with momentum (float rounding;
// cuBLAS rounds otherwise than Eigen). Run once with gradients copied into the buckets and
// once with gradient_as_bucket_view (each .grad a view of its bucket on `device`).
inline void check_ddp_matches_one_rank(const std::shared_ptr<dist::ProcessGroup>& pg, Device device, float tolerance,
                                       bool gradient_as_bucket_view) {
  const int world = pg->size(), rank = pg->rank();
  constexpr int64_t kBatch = 16;
  expect(kBatch % world == 0, "world size ", world, " does not divide the batch");
  const int64_t share = kBatch / world;
  auto reference = staging_mlp(), model = staging_mlp();
  model->to(device);
  dist::DDPOptions options;
  options.gradient_as_bucket_view = gradient_as_bucket_view;
  dist::DistributedDataParallel ddp(model, pg, options);
  nn::SGD reference_opt(reference->parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
  nn::SGD opt(ddp.parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
  for (int step = 0; step < 5; ++step) {
    Generator gen(700 + step);
    const Tensor x = Tensor::randn({kBatch, 5}, gen);
    std::vector<int64_t> labels;
    for (int64_t i = 0; i < kBatch; ++i) labels.push_back(static_cast<int64_t>(gen.randint(3)));
    reference_opt.zero_grad();
    cross_entropy((*reference)(x), Tensor::from_vector(labels)).backward();
    reference_opt.step();

    const std::vector<float> xs = x.to_vector();
    const Tensor my_x = Tensor::from_vector(std::vector<float>(xs.begin() + rank * share * 5, xs.begin() + (rank + 1) * share * 5),
                                            {share, 5}, device);
    const Tensor my_y = Tensor::from_vector(
        std::vector<int64_t>(labels.begin() + rank * share, labels.begin() + (rank + 1) * share), {}, device);
    opt.zero_grad(/*set_to_none=*/!gradient_as_bucket_view);
    cross_entropy(ddp(my_x), my_y).backward();
    opt.step();
    if (gradient_as_bucket_view) {  // one bucket: every .grad in the same memory, on device
      const auto params = model->parameters();
      for (const Tensor& p : params)
        expect(p.grad().is_alias_of(params[0].grad()) && p.grad().device() == device, "rank ", rank,
               ": a .grad is not in the bucket on ", device);
    }

    const auto want = reference->named_parameters(), got = model->named_parameters();
    for (size_t p = 0; p < want.size(); ++p) {
      expect_on(got[p].second, device, "parameter " + got[p].first);
      const std::vector<float> a = got[p].second.to_vector(), b = want[p].second.to_vector();
      float worst = 0;
      for (size_t j = 0; j < a.size(); ++j) worst = std::max(worst, std::abs(a[j] - b[j]));
      expect(worst <= tolerance, "step ", step, " rank ", rank, ": ", got[p].first, " differs from 1-rank training by ",
             worst, gradient_as_bucket_view ? " (gradient_as_bucket_view)" : "");
    }
  }
}

inline void check_ddp_matches_one_rank(const std::shared_ptr<dist::ProcessGroup>& pg, Device device,
                                       float tolerance = 1e-5f) {
  for (const bool views : {false, true}) check_ddp_matches_one_rank(pg, device, tolerance, views);
}

}  // namespace nanoddp::testing
