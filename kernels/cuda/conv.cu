// CUDA kernels of Conv2d and MaxPool2d (declared in nn/conv.cpp): im2col and col2im around
// cuBLAS's GEMM, the per-channel bias, and max pooling. Each kernel is followed by its host
// launcher. Every output element is written by one thread that reads what it needs (col2im
// and the pooling backward gather, never scatter), so results are deterministic.

#include <cmath>

#include "kernels/cuda/launch.cuh"
#include "kernels/kernels.h"
#include "kernels/pool_window.h"

namespace nanoddp::kernels::cuda {

// ---- im2col / col2im ----------------------------------------------------------------------

// One thread per cols element [C kh kw, N OH OW].
__global__ void im2col_forward_kernel(float* cols, const float* images, int64_t N, Window2d g, int64_t n) {
  const int64_t OHW = g.out_h * g.out_w, NOHW = N * OHW;
  for (int64_t e = first_index(); e < n; e += grid_stride()) {
    const int64_t row = e / NOHW, col = e % NOHW, image = col / OHW, pixel = col % OHW;
    const int64_t j = row % g.kernel_w, i = (row / g.kernel_w) % g.kernel_h, c = row / (g.kernel_w * g.kernel_h);
    const int64_t h = (pixel / g.out_w) * g.stride_h - g.pad_h + i * g.dilation_h;
    const int64_t w = (pixel % g.out_w) * g.stride_w - g.pad_w + j * g.dilation_w;
    cols[e] = h >= 0 && h < g.height && w >= 0 && w < g.width
                  ? images[((image * g.channels + c) * g.height + h) * g.width + w]
                  : 0.0f;
  }
}

void im2col(float* cols, const float* images, int64_t N, Window2d g) {
  const int64_t n = g.channels * g.kernel_h * g.kernel_w * N * g.out_h * g.out_w;
  if (n <= 0) return;
  im2col_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(cols, images, N, g, n);
  NANODDP_CUDA_CHECK_LAUNCH("im2col_forward_kernel");
}

// One thread per pixel [N, C, H, W]: sums the cols entries that read it. Kernel tap i reads
// pixel h from output row oh when oh stride = h + pad - i dilation; only the taps for which
// such a row exists are visited (taps_reaching, kernels/pool_window.h), in increasing order.
__global__ void col2im_backward_kernel(float* dimages, const float* dcols, int64_t N, Window2d g, int64_t n) {
  const int64_t OHW = g.out_h * g.out_w, NOHW = N * OHW;
  for (int64_t e = first_index(); e < n; e += grid_stride()) {
    const int64_t w = e % g.width, h = (e / g.width) % g.height, c = (e / (g.width * g.height)) % g.channels;
    const int64_t image = e / (g.width * g.height * g.channels);
    float total = 0.0f;
    const Taps rows = taps_reaching(h, g.pad_h, g.kernel_h, g.dilation_h, g.stride_h, g.out_h);
    const Taps columns = taps_reaching(w, g.pad_w, g.kernel_w, g.dilation_w, g.stride_w, g.out_w);
    for (int64_t i = rows.first; i < rows.last; ++i) {
      const int64_t oh_stride = h + g.pad_h - i * g.dilation_h;
      if (oh_stride % g.stride_h != 0) continue;
      for (int64_t j = columns.first; j < columns.last; ++j) {
        const int64_t ow_stride = w + g.pad_w - j * g.dilation_w;
        if (ow_stride % g.stride_w != 0) continue;
        const int64_t row = (c * g.kernel_h + i) * g.kernel_w + j;
        total += dcols[row * NOHW + image * OHW + (oh_stride / g.stride_h) * g.out_w + ow_stride / g.stride_w];
      }
    }
    dimages[e] = total;
  }
}

void col2im(float* dimages, const float* dcols, int64_t N, Window2d g) {
  const int64_t n = N * g.channels * g.height * g.width;
  if (n <= 0) return;
  col2im_backward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(dimages, dcols, N, g, n);
  NANODDP_CUDA_CHECK_LAUNCH("col2im_backward_kernel");
}

// One thread per element of out [B, A, C].
__global__ void swap_leading_dims_forward_kernel(float* out, const float* in, int64_t A, int64_t B, int64_t C,
                                                 int64_t n) {
  for (int64_t e = first_index(); e < n; e += grid_stride()) {
    const int64_t c = e % C, a = (e / C) % A, b = e / (C * A);
    out[e] = in[(a * B + b) * C + c];
  }
}

void swap_leading_dims(float* out, const float* in, int64_t A, int64_t B, int64_t C) {
  const int64_t n = A * B * C;
  if (n <= 0) return;
  swap_leading_dims_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(out, in, A, B, C, n);
  NANODDP_CUDA_CHECK_LAUNCH("swap_leading_dims_forward_kernel");
}

// ---- per-channel bias ---------------------------------------------------------------------

__global__ void channel_bias_forward_kernel(float* out, const float* bias, int64_t C, int64_t HW, int64_t n) {
  for (int64_t e = first_index(); e < n; e += grid_stride()) out[e] += bias[(e / HW) % C];
}

void channel_bias_forward(float* out, const float* bias, int64_t N, int64_t C, int64_t HW) {
  const int64_t n = N * C * HW;
  if (n <= 0) return;
  channel_bias_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(out, bias, C, HW, n);
  NANODDP_CUDA_CHECK_LAUNCH("channel_bias_forward_kernel");
}

// One block per channel; each thread sums a fixed strided subset in double, then a fixed tree.
__global__ void channel_sum_backward_kernel(float* dbias, const float* dout, int64_t N, int64_t C, int64_t HW) {
  const int64_t c = blockIdx.x;
  double total = 0.0;
  for (int64_t k = threadIdx.x; k < N * HW; k += blockDim.x) total += dout[((k / HW) * C + c) * HW + k % HW];
  total = block_sum<kBlock>(total);
  if (threadIdx.x == 0) dbias[c] = static_cast<float>(total);
}

void channel_sum(float* dbias, const float* dout, int64_t N, int64_t C, int64_t HW) {
  if (C <= 0) return;
  channel_sum_backward_kernel<<<static_cast<unsigned>(C), kBlock, 0, stream()>>>(dbias, dout, N, C, HW);
  NANODDP_CUDA_CHECK_LAUNCH("channel_sum_backward_kernel");
}

// ---- max pooling --------------------------------------------------------------------------

// One thread per output element [planes, OH, OW]; the window's rule is the CPU's
// (kernels/pool_window.h).
__global__ void max_pool2d_forward_kernel(float* out, int32_t* indices, const float* in, Window2d g, int64_t n) {
  const int64_t in_plane = g.height * g.width, out_plane = g.out_h * g.out_w;
  for (int64_t e = first_index(); e < n; e += grid_stride()) {
    const int64_t p = e / out_plane, oh = (e % out_plane) / g.out_w, ow = e % g.out_w;
    const WindowMax best = max_pool2d_window(in + p * in_plane, g, oh, ow);
    out[e] = best.value;
    if (indices != nullptr) indices[e] = static_cast<int32_t>(best.index);  // the same for every thread: no divergence
  }
}

void max_pool2d_forward(float* out, int32_t* indices, const float* in, int64_t planes, Window2d g) {
  const int64_t n = planes * g.out_h * g.out_w;
  if (n <= 0) return;
  max_pool2d_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(out, indices, in, g, n);
  NANODDP_CUDA_CHECK_LAUNCH("max_pool2d_forward_kernel");
}

// One thread per input element [planes, H, W]: it gathers the gradients of the outputs whose
// maximum it is (windows may overlap, so there can be several). No atomics, and all the work
// of a large plane spreads over the grid. The outputs that can see element (h, w) are those
// whose window has a tap on it, found as in col2im; they are visited in increasing output
// order (tap i descending gives oh ascending), so the float sum is the CPU's, bit for bit.
__global__ void max_pool2d_backward_kernel(float* din, const float* dout, const int32_t* indices, Window2d g,
                                           int64_t n) {
  const int64_t in_plane = g.height * g.width, out_plane = g.out_h * g.out_w;
  for (int64_t e = first_index(); e < n; e += grid_stride()) {
    const int64_t p = e / in_plane, k = e % in_plane, h = k / g.width, w = k % g.width;
    const int32_t* at = indices + p * out_plane;
    const float* grad = dout + p * out_plane;
    float total = 0.0f;
    const Taps rows = taps_reaching(h, g.pad_h, g.kernel_h, g.dilation_h, g.stride_h, g.out_h);
    const Taps columns = taps_reaching(w, g.pad_w, g.kernel_w, g.dilation_w, g.stride_w, g.out_w);
    for (int64_t i = rows.last - 1; i >= rows.first; --i) {
      const int64_t oh_stride = h + g.pad_h - i * g.dilation_h;
      if (oh_stride % g.stride_h != 0) continue;
      const int64_t row = (oh_stride / g.stride_h) * g.out_w;
      for (int64_t j = columns.last - 1; j >= columns.first; --j) {
        const int64_t ow_stride = w + g.pad_w - j * g.dilation_w;
        if (ow_stride % g.stride_w != 0) continue;
        const int64_t o = row + ow_stride / g.stride_w;
        if (at[o] == k) total += grad[o];
      }
    }
    din[e] = total;
  }
}

void max_pool2d_backward(float* din, const float* dout, const int32_t* indices, int64_t planes, Window2d window) {
  const int64_t n = planes * window.height * window.width;
  if (n <= 0) return;
  max_pool2d_backward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(din, dout, indices, window, n);
  NANODDP_CUDA_CHECK_LAUNCH("max_pool2d_backward_kernel");
}

}  // namespace nanoddp::kernels::cuda
