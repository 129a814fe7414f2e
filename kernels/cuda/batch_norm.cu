// CUDA kernels of BatchNorm (declared in nn/batch_norm.cpp). The per-channel reductions take
// one block per channel, summing in double over a fixed thread order (deterministic, as the
// CPU's); the elementwise ones a grid-stride loop over all N * C * L values.

#include "kernels/cuda/launch.cuh"

namespace nanoddp::kernels::cuda {

namespace {
// f(i) summed over channel c's N * L values (i: the value's index in [N, C, L]) by the whole
// block, returned to every thread. The __syncthreads() pair lets a kernel call it repeatedly.
template <typename F>
__device__ double channel_block_sum(int64_t N, int64_t C, int64_t L, int64_t c, F f) {
  __shared__ double total;
  double acc = 0.0;
  for (int64_t k = threadIdx.x; k < N * L; k += blockDim.x) acc += f((k / L * C + c) * L + k % L);
  acc = block_sum<kBlock>(acc);
  if (threadIdx.x == 0) total = acc;
  __syncthreads();
  const double result = total;
  __syncthreads();
  return result;
}

unsigned channel_blocks(int64_t C) { return static_cast<unsigned>(C); }
}  // namespace

__global__ void batch_norm_stats_kernel(float* mean, float* var, const float* in, int64_t N, int64_t C, int64_t L) {
  const int64_t c = blockIdx.x;
  const double count = double(N * L);
  const double m = channel_block_sum(N, C, L, c, [&](int64_t i) { return double(in[i]); }) / count;
  const double v = channel_block_sum(N, C, L, c, [&](int64_t i) { return (in[i] - m) * (in[i] - m); }) / count;
  if (threadIdx.x == 0) {
    mean[c] = static_cast<float>(m);
    var[c] = static_cast<float>(v);
  }
}

void batch_norm_stats(float* mean, float* var, const float* in, int64_t N, int64_t C, int64_t L) {
  if (C <= 0) return;
  batch_norm_stats_kernel<<<channel_blocks(C), kBlock, 0, stream()>>>(mean, var, in, N, C, L);
  NANODDP_CUDA_CHECK_LAUNCH("batch_norm_stats_kernel");
}

__global__ void batch_norm_invstd_kernel(float* invstd, const float* var, int64_t C, float eps,
                                         bool zero_for_no_spread) {
  for (int64_t c = first_index(); c < C; c += grid_stride())
    invstd[c] = zero_for_no_spread && var[c] == 0.0f && eps == 0.0f
                    ? 0.0f
                    : static_cast<float>(1.0 / sqrt(double(var[c]) + eps));
}

void batch_norm_invstd(float* invstd, const float* var, int64_t C, float eps, bool zero_for_no_spread) {
  if (C <= 0) return;
  batch_norm_invstd_kernel<<<grid_for(C), kBlock, 0, stream()>>>(invstd, var, C, eps, zero_for_no_spread);
  NANODDP_CUDA_CHECK_LAUNCH("batch_norm_invstd_kernel");
}

__global__ void batch_norm_update_running_kernel(float* running_mean, float* running_var, const float* mean,
                                                 const float* var, int64_t C, float momentum,
                                                 double unbiased_scale) {
  for (int64_t c = first_index(); c < C; c += grid_stride()) {
    running_mean[c] = static_cast<float>((1.0 - momentum) * running_mean[c] + double(momentum) * mean[c]);
    running_var[c] =
        static_cast<float>((1.0 - momentum) * running_var[c] + double(momentum) * var[c] * unbiased_scale);
  }
}

void batch_norm_update_running(float* running_mean, float* running_var, const float* mean, const float* var,
                               int64_t C, float momentum, double unbiased_scale) {
  if (C <= 0) return;
  batch_norm_update_running_kernel<<<grid_for(C), kBlock, 0, stream()>>>(running_mean, running_var, mean, var, C,
                                                                         momentum, unbiased_scale);
  NANODDP_CUDA_CHECK_LAUNCH("batch_norm_update_running_kernel");
}

__global__ void batch_norm_count_batch_kernel(int64_t* count) { ++*count; }

void batch_norm_count_batch(int64_t* count) {
  batch_norm_count_batch_kernel<<<1, 1, 0, stream()>>>(count);
  NANODDP_CUDA_CHECK_LAUNCH("batch_norm_count_batch_kernel");
}

__global__ void batch_norm_forward_kernel(float* out, const float* in, const float* mean, const float* invstd,
                                          const float* weight, const float* bias, int64_t N, int64_t C,
                                          int64_t L) {
  for (int64_t i = first_index(); i < N * C * L; i += grid_stride()) {
    const int64_t c = i / L % C;
    const double scale = double(invstd[c]) * (weight != nullptr ? weight[c] : 1.0f);
    out[i] = static_cast<float>((in[i] - double(mean[c])) * scale + (bias != nullptr ? bias[c] : 0.0f));
  }
}

void batch_norm_forward(float* out, const float* in, const float* mean, const float* invstd, const float* weight,
                        const float* bias, int64_t N, int64_t C, int64_t L) {
  if (N * C * L <= 0) return;
  batch_norm_forward_kernel<<<grid_for(N * C * L), kBlock, 0, stream()>>>(out, in, mean, invstd, weight, bias, N, C,
                                                                          L);
  NANODDP_CUDA_CHECK_LAUNCH("batch_norm_forward_kernel");
}

__global__ void batch_norm_backward_reduce_kernel(float* sums, const float* dout, const float* in,
                                                  const float* mean, const float* invstd, int64_t N, int64_t C,
                                                  int64_t L) {
  const int64_t c = blockIdx.x;
  const double m = mean[c], s = invstd[c];
  const double dy_sum = channel_block_sum(N, C, L, c, [&](int64_t i) { return double(dout[i]); });
  const double dy_xhat_sum = channel_block_sum(N, C, L, c, [&](int64_t i) { return dout[i] * (in[i] - m); }) * s;
  if (threadIdx.x == 0) {
    sums[c] = static_cast<float>(dy_sum);
    sums[C + c] = static_cast<float>(dy_xhat_sum);
  }
}

void batch_norm_backward_reduce(float* sums, const float* dout, const float* in, const float* mean,
                                const float* invstd, int64_t N, int64_t C, int64_t L) {
  if (C <= 0) return;
  batch_norm_backward_reduce_kernel<<<channel_blocks(C), kBlock, 0, stream()>>>(sums, dout, in, mean, invstd, N, C,
                                                                                L);
  NANODDP_CUDA_CHECK_LAUNCH("batch_norm_backward_reduce_kernel");
}

__global__ void batch_norm_backward_kernel(float* din, float* dweight, float* dbias, const float* dout,
                                           const float* in, const float* mean, const float* invstd,
                                           const float* weight, const float* local_sums, const float* total_sums,
                                           double count, int64_t N, int64_t C, int64_t L) {
  for (int64_t i = first_index(); i < N * C * L || i < C; i += grid_stride()) {
    if (i < C) {
      if (dweight != nullptr) dweight[i] = local_sums[C + i];
      if (dbias != nullptr) dbias[i] = local_sums[i];
    }
    if (din == nullptr || i >= N * C * L) continue;
    const int64_t c = i / L % C;
    const double s = invstd[c], g = s * (weight != nullptr ? weight[c] : 1.0f);
    if (count == 0) {  // constant statistics: no x term, so a NaN or inf input keeps a finite gradient
      din[i] = static_cast<float>(g * dout[i]);
      continue;
    }
    const double dy_mean = total_sums[c] / count, dy_xhat_mean = total_sums[C + c] / count;
    din[i] = static_cast<float>(g * (dout[i] - dy_mean - (in[i] - double(mean[c])) * s * dy_xhat_mean));
  }
}

void batch_norm_backward(float* din, float* dweight, float* dbias, const float* dout, const float* in,
                         const float* mean, const float* invstd, const float* weight, const float* local_sums,
                         const float* total_sums, double count, int64_t N, int64_t C, int64_t L) {
  const int64_t n = N * C * L > C ? N * C * L : C;
  if (n <= 0) return;
  batch_norm_backward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(din, dweight, dbias, dout, in, mean, invstd,
                                                                   weight, local_sums, total_sums, count, N, C, L);
  NANODDP_CUDA_CHECK_LAUNCH("batch_norm_backward_kernel");
}

}  // namespace nanoddp::kernels::cuda
