// Reduction CUDA kernels: sum (and its backward), argmax, and the column sum that is a bias
// gradient. All are deterministic: no atomics, fixed trees (Note [Deterministic reduction]
// in kernels/cuda/launch.cuh).

#include "kernels/cuda/launch.cuh"
#include "kernels/grad_norm_term.h"
#include "kernels/kernels.h"

namespace nanoddp::kernels::cuda {
namespace {

struct LoadValue {
  const float* in;
  __device__ float operator()(int64_t i) const { return in[i]; }
};

}  // namespace

// sum_forward's kernels are the shared sum_partials_kernel / sum_finish_kernel.
void sum_forward(float* out, const float* in, int64_t n) { deterministic_sum(out, LoadValue{in}, n, 1.0); }

// din[i] = dout[0] * scale. WRITES. dout stays on the device: no host round trip.
__global__ void broadcast_scalar_backward_kernel(float* din, const float* dout, float scale, int64_t n) {
  const float value = dout[0] * scale;
  for (int64_t i = first_index(); i < n; i += grid_stride()) din[i] = value;
}

void broadcast_scalar_backward(float* din, const float* dout, float scale, int64_t n) {
  if (n <= 0) return;
  broadcast_scalar_backward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(din, dout, scale, n);
  NANODDP_CUDA_CHECK_LAUNCH("broadcast_scalar_backward_kernel");
}

// ---- gradient norm ---------------------------------------------------------------------------

namespace {

// The largest value over a block of kThreads threads, NaN when any is; valid in thread 0.
// Static shared memory of its own: one call per kernel.
template <int kThreads>
__device__ __forceinline__ double block_nan_max(double value) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "block_nan_max needs whole warps");
  __shared__ double warp_maxima[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2)
    value = nan_max(value, __shfl_down_sync(kFullMask, value, offset));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_maxima[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kThreads / 32 ? warp_maxima[lane] : 0.0;
    for (int offset = 16; offset > 0; offset /= 2)
      value = nan_max(value, __shfl_down_sync(kFullMask, value, offset));
  }
  return value;
}

// Pass 1: block b's sum of |g|^p and its largest |g| into partials[2 b], partials[2 b + 1].
__global__ void grad_norm_partials_kernel(double* partials, const float* g, int64_t n, double norm_type,
                                          double rescale_by) {
  const bool sums = !isinf(norm_type);
  double sum = 0.0, largest = 0.0;
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const double a = fabs(static_cast<double>(g[i]));
    largest = nan_max(largest, a);
    if (sums) sum += norm_term(a, norm_type, rescale_by);
  }
  const double block_total = block_sum<kBlock>(sum);
  const double block_largest = block_nan_max<kBlock>(largest);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = block_total;
    partials[2 * blockIdx.x + 1] = block_largest;
  }
}

// Pass 2, one block: totals[0] += the blocks' sums, totals[1] = max(totals[1], their largest).
__global__ void grad_norm_finish_kernel(double* totals, const double* partials, int count) {
  const bool mine = static_cast<int>(threadIdx.x) < count;
  const double sum = block_sum<kMaxSumBlocks>(mine ? partials[2 * threadIdx.x] : 0.0);
  const double largest = block_nan_max<kMaxSumBlocks>(mine ? partials[2 * threadIdx.x + 1] : 0.0);
  if (threadIdx.x == 0) {
    totals[0] += sum;
    totals[1] = nan_max(totals[1], largest);
  }
}

}  // namespace

// Declared in nn/clip_grad.cpp. Both passes are fixed trees (Note [Deterministic reduction]);
// the totals stay on the device, so the host waits once per clip_grad_norm_, not per gradient.
void grad_norm_accumulate(double* totals, const float* g, int64_t n, double norm_type, double rescale_by) {
  if (n <= 0) return;
  const int blocks = sum_blocks(n);
  ScratchBuffer<double> partials(2 * blocks);
  grad_norm_partials_kernel<<<blocks, kBlock, 0, stream()>>>(partials.data(), g, n, norm_type, rescale_by);
  NANODDP_CUDA_CHECK_LAUNCH("grad_norm_partials_kernel");
  grad_norm_finish_kernel<<<1, kMaxSumBlocks, 0, stream()>>>(totals, partials.data(), blocks);
  NANODDP_CUDA_CHECK_LAUNCH("grad_norm_finish_kernel");
}

// ---- argmax ----------------------------------------------------------------------------------

// True when (value, index) beats (best, best_index) under torch.argmax's order: NaN above
// everything, then larger values, then the smaller index. best_index < 0 means "none yet".
// A total order, so the warp's combining order cannot change the answer.
__device__ __forceinline__ bool argmax_better(float value, int64_t index, float best, int64_t best_index) {
  if (best_index < 0) return index >= 0;
  if (index < 0) return false;
  const bool value_nan = isnan(value), best_nan = isnan(best);
  if (value_nan != best_nan) return value_nan;
  if (!value_nan && value != best) return value > best;
  return index < best_index;
}

constexpr int kRowsPerBlock = kBlock / 32;  // one warp per row

// in: [N, C] -> out: [N] int64; one warp per row. With C == 0 every row gets 0, as on the CPU.
__global__ void argmax_forward_kernel(int64_t* out, const float* in, int64_t N, int64_t C) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;  // the whole warp leaves together, so the shuffles below stay full
  const float* x = in + row * C;
  float best = 0.0f;
  int64_t best_index = -1;
  for (int64_t c = lane; c < C; c += 32) {
    if (argmax_better(x[c], c, best, best_index)) {
      best = x[c];
      best_index = c;
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_down_sync(kFullMask, best, offset);
    const int64_t other_index = __shfl_down_sync(kFullMask, best_index, offset);
    if (argmax_better(other, other_index, best, best_index)) {
      best = other;
      best_index = other_index;
    }
  }
  if (lane == 0) out[row] = best_index < 0 ? 0 : best_index;
}

void argmax_forward(int64_t* out, const float* in, int64_t N, int64_t C) {
  if (N <= 0) return;
  const int64_t blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  NANODDP_CHECK(blocks <= 0x7fffffff, ValueError, "argmax: ", N, " rows is more than one launch takes");
  argmax_forward_kernel<<<static_cast<unsigned>(blocks), kBlock, 0, stream()>>>(out, in, N, C);
  NANODDP_CUDA_CHECK_LAUNCH("argmax_forward_kernel");
}

// ---- column sum (bias gradient) ----------------------------------------------------------------

// Block (32 columns) x (8 row lanes): a warp reads 32 adjacent floats of one row (one 128-byte
// transaction). Block (bx, by) sums rows [by * rows_per_chunk, ...) of columns
// [32 bx, 32 bx + 32) into partials[by, column]; the lanes' sums are added in a fixed order.
constexpr int kColumnTile = 32;
constexpr int kRowLanes = 8;

__global__ void column_sum_backward_kernel(float* __restrict__ partials, const float* __restrict__ d, int64_t N, int64_t F,
                                           int64_t rows_per_chunk) {
  __shared__ float lane_sums[kRowLanes][kColumnTile + 1];
  const int64_t column = static_cast<int64_t>(blockIdx.x) * kColumnTile + threadIdx.x;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t row_end = row_begin + rows_per_chunk < N ? row_begin + rows_per_chunk : N;
  float acc = 0.0f;
  if (column < F) {
#pragma unroll 8  // several loads in flight per thread: this kernel is bandwidth-bound
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += kRowLanes) acc += d[r * F + column];
  }
  lane_sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && column < F) {
    float total = 0.0f;
    for (int k = 0; k < kRowLanes; ++k) total += lane_sums[k][threadIdx.x];
    partials[static_cast<int64_t>(blockIdx.y) * F + column] = total;
  }
}

// out[f] = sum over chunks k (in order) of partials[k, f].
__global__ void column_sum_finish_kernel(float* out, const float* partials, int64_t chunks, int64_t F) {
  for (int64_t f = first_index(); f < F; f += grid_stride()) {
    float total = 0.0f;
    for (int64_t k = 0; k < chunks; ++k) total += partials[k * F + f];
    out[f] = total;
  }
}

void column_sum(float* out, const float* d, int64_t N, int64_t F) {
  if (F <= 0) return;
  if (N <= 0) {
    fill(out, 0.0f, F);
    return;
  }
  // Enough blocks to fill a large GPU (about 2048), from N and F alone so that the result
  // is the same on every GPU; at least 32 rows per chunk so a chunk is worth a block.
  const int64_t column_tiles = (F + kColumnTile - 1) / kColumnTile;
  NANODDP_CHECK(column_tiles <= 0x7fffffff, ValueError, "column_sum: ", F, " columns is more than one launch takes");
  int64_t chunks = (2048 + column_tiles - 1) / column_tiles;
  const int64_t max_chunks = (N + 31) / 32;
  if (chunks > max_chunks) chunks = max_chunks;
  if (chunks > 65535) chunks = 65535;
  if (chunks < 1) chunks = 1;
  const int64_t rows_per_chunk = (N + chunks - 1) / chunks;
  chunks = (N + rows_per_chunk - 1) / rows_per_chunk;

  const dim3 grid(static_cast<unsigned>(column_tiles), static_cast<unsigned>(chunks));
  const dim3 block(kColumnTile, kRowLanes);
  if (chunks == 1) {
    column_sum_backward_kernel<<<grid, block, 0, stream()>>>(out, d, N, F, rows_per_chunk);
    NANODDP_CUDA_CHECK_LAUNCH("column_sum_backward_kernel");
    return;
  }
  ScratchBuffer<float> partials(static_cast<size_t>(chunks * F));
  column_sum_backward_kernel<<<grid, block, 0, stream()>>>(partials.data(), d, N, F, rows_per_chunk);
  NANODDP_CUDA_CHECK_LAUNCH("column_sum_backward_kernel");
  column_sum_finish_kernel<<<grid_for(F), kBlock, 0, stream()>>>(out, partials.data(), chunks, F);
  NANODDP_CUDA_CHECK_LAUNCH("column_sum_finish_kernel");
}

}  // namespace nanoddp::kernels::cuda
