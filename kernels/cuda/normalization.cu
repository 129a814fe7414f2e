// CUDA kernels of LayerNorm (declared in nn/normalization.cpp): one warp per row, sums in
// double over a fixed lane order (deterministic), two passes as on the CPU. The weight and
// bias gradients split the rows into chunks over the grid, then add the chunks in order.

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

// ---- weight and bias gradients ----------------------------------------------------------------
// dweight[d] = sum over rows r of dout[r, d] xhat[r, d], dbias[d] = sum over r of dout[r, d].
// Block (32 columns) x (8 row lanes) sums rows [chunk * rows_per_chunk, ...) of its 32 columns
// (a warp reads 32 adjacent floats of a row), in double; partials [chunks, 2, D] are then added
// over the chunks in order. The chunking depends on N and D only, and no atomics are used, so
// the sums are the same on every run and every GPU, and a large N spreads over the grid.
constexpr int kColumnTile = 32;
constexpr int kRowLanes = 8;

__global__ void layer_norm_affine_backward_kernel(double* partials, const float* dout, const float* in,
                                                  const float* mean, const float* rstd, int64_t N, int64_t D,
                                                  int64_t rows_per_chunk) {
  __shared__ double lane_sums[2][kRowLanes][kColumnTile + 1];
  const int64_t d = static_cast<int64_t>(blockIdx.x) * kColumnTile + threadIdx.x;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t row_end = row_begin + rows_per_chunk < N ? row_begin + rows_per_chunk : N;
  double dw = 0.0, db = 0.0;
  if (d < D) {
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += kRowLanes) {
      const double dy = dout[r * D + d];
      dw += dy * (in[r * D + d] - double(mean[r])) * double(rstd[r]);
      db += dy;
    }
  }
  lane_sums[0][threadIdx.y][threadIdx.x] = dw;
  lane_sums[1][threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y == 0 && d < D) {
    double total_w = 0.0, total_b = 0.0;
    for (int k = 0; k < kRowLanes; ++k) {
      total_w += lane_sums[0][k][threadIdx.x];
      total_b += lane_sums[1][k][threadIdx.x];
    }
    partials[(2 * static_cast<int64_t>(blockIdx.y)) * D + d] = total_w;
    partials[(2 * static_cast<int64_t>(blockIdx.y) + 1) * D + d] = total_b;
  }
}

// dweight[d], dbias[d] = the sums over chunks k (in order) of partials[k, 0 or 1, d]; 0 for no chunk.
__global__ void layer_norm_affine_finish_kernel(float* dweight, float* dbias, const double* partials,
                                                int64_t chunks, int64_t D) {
  for (int64_t d = first_index(); d < D; d += grid_stride()) {
    double total_w = 0.0, total_b = 0.0;
    for (int64_t k = 0; k < chunks; ++k) {
      total_w += partials[(2 * k) * D + d];
      total_b += partials[(2 * k + 1) * D + d];
    }
    if (dweight != nullptr) dweight[d] = static_cast<float>(total_w);
    if (dbias != nullptr) dbias[d] = static_cast<float>(total_b);
  }
}

static void layer_norm_affine_backward(float* dweight, float* dbias, const float* dout, const float* in,
                                       const float* mean, const float* rstd, int64_t N, int64_t D) {
  // About 2048 blocks for a large GPU, from N and D alone; at least 32 rows per chunk.
  const int64_t column_tiles = (D + kColumnTile - 1) / kColumnTile;
  NANODDP_CHECK(column_tiles <= 0x7fffffff, ValueError, "layer_norm backward: ", D,
                " normalized elements is more than one launch takes");
  int64_t chunks = 0, rows_per_chunk = 0;
  if (N > 0) {
    chunks = (2048 + column_tiles - 1) / column_tiles;
    const int64_t max_chunks = (N + 31) / 32;
    if (chunks > max_chunks) chunks = max_chunks;
    if (chunks > 65535) chunks = 65535;
    if (chunks < 1) chunks = 1;
    rows_per_chunk = (N + chunks - 1) / chunks;
    chunks = (N + rows_per_chunk - 1) / rows_per_chunk;
  }
  ScratchBuffer<double> partials(static_cast<size_t>(chunks > 0 ? 2 * chunks * D : 1));
  if (chunks > 0) {
    const dim3 grid(static_cast<unsigned>(column_tiles), static_cast<unsigned>(chunks));
    const dim3 block(kColumnTile, kRowLanes);
    layer_norm_affine_backward_kernel<<<grid, block, 0, stream()>>>(partials.data(), dout, in, mean, rstd, N, D,
                                                                    rows_per_chunk);
    NANODDP_CUDA_CHECK_LAUNCH("layer_norm_affine_backward_kernel");
  }
  layer_norm_affine_finish_kernel<<<grid_for(D), kBlock, 0, stream()>>>(dweight, dbias, partials.data(), chunks, D);
  NANODDP_CUDA_CHECK_LAUNCH("layer_norm_affine_finish_kernel");
}

void layer_norm_backward(float* din, float* dweight, float* dbias, const float* dout, const float* in,
                         const float* mean, const float* rstd, const float* weight, int64_t N, int64_t D) {
  if (din != nullptr && N > 0) {
    layer_norm_backward_kernel<<<row_blocks(N), kBlock, 0, stream()>>>(din, dout, in, mean, rstd, weight, N, D);
    NANODDP_CUDA_CHECK_LAUNCH("layer_norm_backward_kernel");
  }
  if ((dweight != nullptr || dbias != nullptr) && D > 0)
    layer_norm_affine_backward(dweight, dbias, dout, in, mean, rstd, N, D);
}

}  // namespace nanoddp::kernels::cuda
