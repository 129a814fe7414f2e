// CUDA kernels of LayerNorm (declared in nn/normalization.cpp): one warp per row, sums in
// double over a fixed lane order (deterministic), two passes as on the CPU. The weight and
// bias gradients take one thread per column, adding the rows in order.

#include "kernels/cuda/launch.cuh"

namespace nanoddp::kernels::cuda {

namespace {
constexpr int kWarp = 32;
constexpr int kRowsPerBlock = kBlock / kWarp;

// The row sum of f(d) over d < D by one warp, in every lane.
template <typename F>
__device__ double warp_row_sum(int64_t D, F f) {
  double acc = 0.0;
  for (int64_t d = threadIdx.x % kWarp; d < D; d += kWarp) acc += f(d);
  acc = warp_sum(acc);
  return __shfl_sync(kFullMask, acc, 0);
}

unsigned row_blocks(int64_t N) { return static_cast<unsigned>((N + kRowsPerBlock - 1) / kRowsPerBlock); }
}  // namespace

__global__ void layer_norm_forward_kernel(float* out, float* mean, float* rstd, const float* in, const float* weight,
                                          const float* bias, int64_t N, int64_t D, float eps) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (r >= N) return;  // whole warps leave together: the shuffles below see full warps
  const float* x = in + r * D;
  const double m = warp_row_sum(D, [&](int64_t d) { return double(x[d]); }) / double(D);
  const double var = warp_row_sum(D, [&](int64_t d) { return (x[d] - m) * (x[d] - m); }) / double(D);
  const double s = 1.0 / sqrt(var + eps);
  if (threadIdx.x % kWarp == 0) {
    mean[r] = static_cast<float>(m);
    rstd[r] = static_cast<float>(s);
  }
  for (int64_t d = threadIdx.x % kWarp; d < D; d += kWarp) {
    float y = static_cast<float>((x[d] - m) * s);
    if (weight != nullptr) y *= weight[d];
    if (bias != nullptr) y += bias[d];
    out[r * D + d] = y;
  }
}

void layer_norm_forward(float* out, float* mean, float* rstd, const float* in, const float* weight,
                        const float* bias, int64_t N, int64_t D, float eps) {
  if (N <= 0) return;
  layer_norm_forward_kernel<<<row_blocks(N), kBlock, 0, stream()>>>(out, mean, rstd, in, weight, bias, N, D, eps);
  NANODDP_CUDA_CHECK_LAUNCH("layer_norm_forward_kernel");
}

__global__ void layer_norm_backward_kernel(float* din, const float* dout, const float* in, const float* mean,
                                           const float* rstd, const float* weight, int64_t N, int64_t D) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (r >= N) return;
  const float* x = in + r * D;
  const float* dy = dout + r * D;
  const double m = mean[r], s = rstd[r];
  auto g = [&](int64_t d) { return double(dy[d]) * (weight != nullptr ? double(weight[d]) : 1.0); };
  const double g_mean = warp_row_sum(D, g) / double(D);
  const double gx_mean = warp_row_sum(D, [&](int64_t d) { return g(d) * (x[d] - m) * s; }) / double(D);
  for (int64_t d = threadIdx.x % kWarp; d < D; d += kWarp)
    din[r * D + d] = static_cast<float>(s * (g(d) - g_mean - (x[d] - m) * s * gx_mean));
}

__global__ void layer_norm_affine_backward_kernel(float* dweight, float* dbias, const float* dout, const float* in,
                                                  const float* mean, const float* rstd, int64_t N, int64_t D) {
  for (int64_t d = first_index(); d < D; d += grid_stride()) {
    double dw = 0.0, db = 0.0;
    for (int64_t r = 0; r < N; ++r) {
      const double dy = dout[r * D + d];
      dw += dy * (in[r * D + d] - double(mean[r])) * double(rstd[r]);
      db += dy;
    }
    if (dweight != nullptr) dweight[d] = static_cast<float>(dw);
    if (dbias != nullptr) dbias[d] = static_cast<float>(db);
  }
}

void layer_norm_backward(float* din, float* dweight, float* dbias, const float* dout, const float* in,
                         const float* mean, const float* rstd, const float* weight, int64_t N, int64_t D) {
  if (din != nullptr && N > 0) {
    layer_norm_backward_kernel<<<row_blocks(N), kBlock, 0, stream()>>>(din, dout, in, mean, rstd, weight, N, D);
    NANODDP_CUDA_CHECK_LAUNCH("layer_norm_backward_kernel");
  }
  if ((dweight != nullptr || dbias != nullptr) && D > 0) {
    layer_norm_affine_backward_kernel<<<grid_for(D), kBlock, 0, stream()>>>(dweight, dbias, dout, in, mean, rstd, N,
                                                                            D);
    NANODDP_CUDA_CHECK_LAUNCH("layer_norm_affine_backward_kernel");
  }
}

}  // namespace nanoddp::kernels::cuda
