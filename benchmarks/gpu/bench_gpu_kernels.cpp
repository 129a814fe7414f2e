// GPU kernel benchmark: each CUDA kernel's achieved bandwidth against a device-to-device
// copy measured in the same run, Linear forward+backward against bare cuBLAS, and the host
// syncs of a training step (MLP with SGD and AdamW, a small CNN).
//
//   bench_gpu_kernels              # markdown tables on stdout
//   bench_gpu_kernels --quick      # fewer repetitions (a smoke run)
//
// Formulas. bandwidth = bytes moved / time, bytes moved = bytes read + bytes written by the
// kernel's algorithm (a 64M-float SGD step with momentum reads param, grad, buffer and writes
// param, buffer: 20 bytes per parameter). The copy moves 2 x its size (read + write), so
// "% of copy" compares like with like. Time: CUDA events on the compute stream around one
// call, median of the repetitions after warm-up runs. Targets (issue: CUDA backend): SGD
// step >= 85% of copy; mse forward+backward and bias gradient (column_sum) >= 70%.
// Exit code 77 when there is no GPU, as the GPU tests.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/ops.h"
#include "core/random.h"
#include "core/tensor.h"
#include "kernels/device_memory.h"
#include "kernels/kernels.h"
#include "nn/adam.h"
#include "nn/conv.h"
#include "nn/layers.h"
#include "nn/optim.h"

namespace {

using namespace nanoddp;
namespace gpu = nanoddp::kernels::cuda;

#define BENCH_CUDA(call)                                                                             \
  do {                                                                                               \
    cudaError_t e_ = (call);                                                                         \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #call, cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

int g_warmup = 5;
int g_repeats = 50;

// Median milliseconds of fn over g_repeats runs after g_warmup, each timed by events.
double median_ms(const std::function<void()>& fn) {
  cudaStream_t stream = static_cast<cudaStream_t>(gpu::compute_stream());
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < g_warmup; ++i) fn();
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> times;
  for (int i = 0; i < g_repeats; ++i) {
    BENCH_CUDA(cudaEventRecord(start, stream));
    fn();
    BENCH_CUDA(cudaEventRecord(stop, stream));
    BENCH_CUDA(cudaEventSynchronize(stop));
    float ms = 0.0f;
    BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  BENCH_CUDA(cudaEventDestroy(start));
  BENCH_CUDA(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// A float buffer on the current GPU filled with value (RAII).
struct Buffer {
  explicit Buffer(size_t n, float value = 0.5f) : n(n), data(static_cast<float*>(gpu::allocate(n * sizeof(float), 0))) {
    kernels::cuda::fill(data, value, static_cast<int64_t>(n));
  }
  ~Buffer() { gpu::deallocate(data, 0); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  size_t n;
  float* data;
};

struct Row {
  std::string kernel, size;
  double bytes, ms;
  const char* target;  // "" or ">= 85%"
  double target_fraction;
};

void print_bandwidth_table(const std::vector<Row>& rows, double copy_gbps) {
  std::printf("\n## Kernel bandwidth (copy: %.0f GB/s)\n\n", copy_gbps);
  std::printf("| kernel | size | MB moved | median us | GB/s | %% of copy | target |\n");
  std::printf("| --- | --- | ---: | ---: | ---: | ---: | --- |\n");
  for (const Row& r : rows) {
    const double gbps = r.bytes / (r.ms * 1e-3) / 1e9;
    const double fraction = gbps / copy_gbps;
    std::string verdict = r.target;
    if (r.target_fraction > 0) verdict += fraction >= r.target_fraction ? " (met)" : " (MISSED)";
    std::printf("| %s | %s | %.1f | %.1f | %.0f | %.0f%% | %s |\n", r.kernel.c_str(), r.size.c_str(), r.bytes / 1e6,
                r.ms * 1e3, gbps, 100.0 * fraction, verdict.c_str());
  }
}

void bench_kernels() {
  const int64_t n = int64_t(64) << 20;  // 64M floats, 256 MiB: far beyond L2
  const double fbytes = 4.0 * double(n);
  Buffer a(n, 0.25f), b(n, -0.5f), c(n), d(n, 0.1f), scalar(1, 1.0f);

  const double copy_ms = median_ms([&] {
    gpu::copy_async(c.data, a.data, n * sizeof(float), gpu::CopyKind::DeviceToDevice);
  });
  const double copy_gbps = 2.0 * fbytes / (copy_ms * 1e-3) / 1e9;

  std::vector<Row> rows;
  const std::string size64 = "64M";
  rows.push_back({"device-to-device copy", size64, 2 * fbytes, copy_ms, "", 0});
  rows.push_back({"fill", size64, fbytes, median_ms([&] { kernels::cuda::fill(c.data, 1.0f, n); }), "", 0});
  rows.push_back({"binary_forward add", size64, 3 * fbytes,
                  median_ms([&] { kernels::cuda::binary_forward(c.data, a.data, b.data, kernels::BinaryOp::Add, 1, n, false); }), "", 0});
  rows.push_back({"accumulate", size64, 3 * fbytes, median_ms([&] { kernels::cuda::accumulate(c.data, a.data, 1e-3f, n); }), "", 0});
  rows.push_back({"relu_forward", size64, 2 * fbytes, median_ms([&] { kernels::cuda::relu_forward(c.data, b.data, n); }), "", 0});
  rows.push_back({"relu_backward", size64, 3 * fbytes,
                  median_ms([&] { kernels::cuda::relu_backward(c.data, a.data, b.data, n); }), "", 0});
  rows.push_back({"sum_forward", size64, fbytes, median_ms([&] { kernels::cuda::sum_forward(scalar.data, a.data, n); }), "", 0});
  // mse forward (mean) reads input and target; backward reads them again and writes dinput.
  rows.push_back({"mse forward+backward", size64, 5 * fbytes, median_ms([&] {
                    kernels::cuda::mse_forward(scalar.data, a.data, b.data, n, kernels::Reduction::Mean);
                    kernels::cuda::mse_backward(c.data, scalar.data, a.data, b.data, n, kernels::Reduction::Mean);
                  }), ">= 70%", 0.70});
  // The bias gradient of a [16384, 4096] output: reads it once.
  rows.push_back({"column_sum (bias grad)", "16384x4096", fbytes,
                  median_ms([&] { kernels::cuda::column_sum(c.data, a.data, 16384, 4096); }), ">= 70%", 0.70});
  kernels::SgdConfig sgd{1e-3f, 0.9f, /*one_minus_dampening=*/1.0f, 1e-4f, false};
  rows.push_back({"sgd_step (momentum, decay)", size64, 5 * fbytes,
                  median_ms([&] { kernels::cuda::sgd_step(a.data, d.data, b.data, n, sgd, false); }), ">= 85%", 0.85});
  kernels::SgdConfig plain{1e-3f, 0.0f, /*one_minus_dampening=*/1.0f, 0.0f, false};
  rows.push_back({"sgd_step (plain)", size64, 3 * fbytes,
                  median_ms([&] { kernels::cuda::sgd_step(a.data, nullptr, b.data, n, plain, false); }), "", 0});

  // Cross-entropy over [65536, 1024] logits: forward reads logits, writes probs; backward
  // reads probs, writes dlogits (targets are 0.5 MB, ignored).
  const int64_t N = 65536, C = 1024;
  std::vector<int64_t> host_target(N);
  for (int64_t i = 0; i < N; ++i) host_target[i] = (i * 7) % C;
  auto* target = static_cast<int64_t*>(gpu::allocate(N * sizeof(int64_t), 0));
  gpu::copy(target, host_target.data(), N * sizeof(int64_t), gpu::CopyKind::HostToDevice);
  rows.push_back({"cross_entropy fwd+bwd", "65536x1024", 4 * fbytes, median_ms([&] {
                    kernels::cuda::cross_entropy_forward(
                        scalar.data, c.data, a.data, target, /*weight=*/nullptr, N, C,
                        /*ignore_index=*/-100, /*label_smoothing=*/0.0f, kernels::Reduction::Mean);
                    kernels::cuda::cross_entropy_backward(
                        d.data, scalar.data, c.data, target, /*weight=*/nullptr, N, C,
                        /*ignore_index=*/-100, /*label_smoothing=*/0.0f, kernels::Reduction::Mean);
                  }),
                  "", 0});
  auto* indices = static_cast<int64_t*>(gpu::allocate(N * sizeof(int64_t), 0));
  rows.push_back({"argmax_forward", "65536x1024", fbytes, median_ms([&] { kernels::cuda::argmax_forward(indices, a.data, N, C); }), "", 0});
  gpu::synchronize();
  gpu::deallocate(target, 0);
  gpu::deallocate(indices, 0);

  print_bandwidth_table(rows, copy_gbps);
}

#define BENCH_CUBLAS(call)                                                                   \
  do {                                                                                       \
    cublasStatus_t s_ = (call);                                                              \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                       \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #call, cublasGetStatusString(s_), __FILE__, __LINE__); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

// Linear forward + backward, y = x W^T + b with x: [B, I], W: [O, I]: three GEMMs
// (y = x W^T, dx = dy W, dW = dy^T x), 6 B I O flops in all.
void bench_linear() {
  struct Shape3 { int64_t B, I, O; };
  const Shape3 shapes[] = {{256, 784, 256}, {4096, 1024, 1024}, {8192, 4096, 4096}};
  cublasHandle_t handle;
  BENCH_CUBLAS(cublasCreate(&handle));
  BENCH_CUBLAS(cublasSetStream(handle, static_cast<cudaStream_t>(gpu::compute_stream())));
  std::printf("\n## Linear forward+backward (float32, TF32 %s)\n\n", NANODDP_TF32 ? "on" : "off");
  std::printf("| B x in -> out | bare cuBLAS us | nanoddp kernels us | autograd linear us | kernels / cuBLAS | autograd / cuBLAS | cuBLAS TFLOP/s |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const Shape3& s : shapes) {
    Buffer x(s.B * s.I, 0.01f), w(s.O * s.I, 0.02f), bias(s.O, 0.1f), y(s.B * s.O), dy(s.B * s.O, 1e-3f),
        dx(s.B * s.I), dw(s.O * s.I), db(s.O);
    const int B = int(s.B), I = int(s.I), O = int(s.O);
    const float one = 1.0f, zero = 0.0f;
    // Column-major view of row-major arrays (Note [Row-major through cuBLAS], kernels/cuda/matmul.cu).
    const double bare = median_ms([&] {
      BENCH_CUBLAS(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, O, B, I, &one, w.data, I, x.data, I, &zero, y.data, O));
      BENCH_CUBLAS(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, I, B, O, &one, w.data, I, dy.data, O, &zero, dx.data, I));
      BENCH_CUBLAS(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_T, I, O, B, &one, x.data, I, dy.data, O, &zero, dw.data, I));
    });
    const double ours = median_ms([&] {
      kernels::cuda::matmul(y.data, x.data, w.data, s.B, s.I, s.O, false, true, 0.0f);
      kernels::cuda::binary_forward(y.data, y.data, bias.data, kernels::BinaryOp::Add, s.B, s.O, true);
      kernels::cuda::matmul(dx.data, dy.data, w.data, s.B, s.O, s.I, false, false, 0.0f);
      kernels::cuda::matmul(dw.data, dy.data, x.data, s.O, s.B, s.I, true, false, 0.0f);
      kernels::cuda::column_sum(db.data, dy.data, s.B, s.O);
    });
    // Through Tensor and autograd: allocations, graph and host work included.
    Generator gen(0);
    const Device cuda = Device::cuda(0);
    Tensor tx = Tensor::randn({s.B, s.I}, gen).to(cuda).set_requires_grad(true);
    Tensor tw = Tensor::randn({s.O, s.I}, gen).to(cuda).set_requires_grad(true);
    Tensor tb = Tensor::randn({s.O}, gen).to(cuda).set_requires_grad(true);
    const Tensor tdy = Tensor::full({s.B, s.O}, 1e-3f, cuda);
    const double autograd = median_ms([&] {
      tx.set_grad(Tensor());  // as zero_grad(set_to_none=True)
      tw.set_grad(Tensor());
      tb.set_grad(Tensor());
      linear(tx, tw, tb).backward(tdy);
    });
    const double tflops = 6.0 * double(s.B) * double(s.I) * double(s.O) / (bare * 1e-3) / 1e12;
    std::printf("| %lld x %lld -> %lld | %.1f | %.1f | %.1f | %.2f | %.2f | %.1f |\n", (long long)s.B, (long long)s.I,
                (long long)s.O, bare * 1e3, ours * 1e3, autograd * 1e3, ours / bare, autograd / bare, tflops);
  }
  BENCH_CUBLAS(cublasDestroy(handle));
}

// Host syncs per training step (Note [Host syncs], kernels/device_memory.h): the difference of
// host_syncs() around forward, backward and the optimizer step, the loss never read, in the
// steady state (the second step: the first builds optimizer state). The goal is 0.
void bench_host_syncs() {
  const Device cuda = Device::cuda(0);
  struct Case {
    const char* name;
    std::function<std::shared_ptr<nn::Module>(Generator&)> model;
    std::vector<int64_t> sample;
    bool adamw;
  };
  const auto mlp = [](Generator& gen) -> std::shared_ptr<nn::Module> {
    auto model = std::make_shared<nn::Sequential>();
    model->add(nn::Linear(784, 256, gen));
    model->add(nn::ReLU());
    model->add(nn::Linear(256, 10, gen));
    return model;
  };
  const auto cnn = [](Generator& gen) -> std::shared_ptr<nn::Module> {
    auto model = std::make_shared<nn::Sequential>();
    model->add(nn::Conv2d(1, 8, 3, gen, /*stride=*/1, /*padding=*/1));
    model->add(nn::ReLU());
    model->add(nn::MaxPool2d(2));
    model->add(nn::Flatten());
    model->add(nn::Linear(8 * 14 * 14, 10, gen));
    return model;
  };
  const Case cases[] = {{"MLP 784-256-10, SGD", mlp, {784}, false},
                        {"MLP 784-256-10, AdamW", mlp, {784}, true},
                        {"CNN conv-relu-pool-linear, SGD", cnn, {1, 28, 28}, false}};
  std::printf("\n## Host syncs per training step (batch 64, loss not read; goal 0)\n\n");
  std::printf("| model | host syncs per step |\n| --- | ---: |\n");
  for (const Case& c : cases) {
    Generator gen(1);
    std::shared_ptr<nn::Module> model = c.model(gen);
    model->to(cuda);
    std::unique_ptr<nn::Optimizer> opt;
    if (c.adamw)
      opt = std::make_unique<nn::AdamW>(model->parameters(), nn::AdamWOptions{});
    else
      opt = std::make_unique<nn::SGD>(model->parameters(), nn::SGDOptions{/*lr=*/0.01});
    std::vector<int64_t> batch_shape{64};
    batch_shape.insert(batch_shape.end(), c.sample.begin(), c.sample.end());
    const Tensor x = Tensor::randn(Shape(batch_shape), gen).to(cuda);
    const Tensor y = Tensor::from_vector(std::vector<int64_t>(64, 3)).to(cuda);
    uint64_t syncs = 0;
    for (int step = 0; step < 2; ++step) {
      const uint64_t start = gpu::host_syncs();
      opt->zero_grad();
      cross_entropy((*model)(x), y).backward();
      opt->step();
      syncs = gpu::host_syncs() - start;
    }
    gpu::synchronize();
    std::printf("| %s | %llu |\n", c.name, static_cast<unsigned long long>(syncs));
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      g_warmup = 2;
      g_repeats = 5;
    } else {
      // A usage error as argparse reports one: named, exit status 2 (tools/cli_checks.h).
      std::fprintf(stderr, "bench_gpu_kernels: unknown argument '%s'; usage: %s [--quick]\n", argv[i], argv[0]);
      return 2;
    }
  }
  if (gpu::device_count() == 0) {
    std::printf("SKIP: no usable GPU: %s\n", gpu::unavailable_reason().c_str());
    return 77;
  }
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("# GPU kernel benchmark on %s (%d SMs, %.0f GB memory), %d repetitions after %d warm-up\n", prop.name,
              prop.multiProcessorCount, prop.totalGlobalMem / 1e9, g_repeats, g_warmup);
  bench_kernels();
  bench_linear();
  bench_host_syncs();
  return 0;
}
