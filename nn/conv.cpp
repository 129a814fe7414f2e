// Conv2d and MaxPool2d: forward, then backward right below; the convolution as im2col + GEMM per
// image on the CPU, per batch on CUDA (Note [Images per GEMM]).
#include "nn/conv.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/op_helpers.h"
#include "kernels/cpu/winograd.h"
#include "kernels/kernels.h"
#include "kernels/pool_window.h"
#include "nn/conv_groups.h"
#include "nn/init.h"

namespace nanoddp {

using kernels::Window2d;

// Kernels of this file (kernels/{cpu,cuda}/conv.*). images: N of [C, H, W].
// cols [C kh kw, N OH OW]: row (c kh + i) kw + j holds images[n, c, oh sh - ph + i dh,
// ow sw - pw + j dw] at column (n OH + oh) OW + ow, 0 where that falls in the padding.
NANODDP_DECLARE_KERNEL(im2col, float* cols, const float* images, int64_t N, Window2d window)
// dimages = the sum, over the cols entries that read each pixel, of dcols. WRITES.
NANODDP_DECLARE_KERNEL(col2im, float* dimages, const float* dcols, int64_t N, Window2d window)
// out[b, a, :] = in[a, b, :]: in [A, B, C] -> out [B, A, C] (the GEMM's [OC, N, OH OW]
// to NCHW, and back for the gradient).
NANODDP_DECLARE_KERNEL(swap_leading_dims, float* out, const float* in, int64_t A, int64_t B, int64_t C)
// out[n, c, :] += bias[c]; out: [N, C, HW].
NANODDP_DECLARE_KERNEL(channel_bias_forward, float* out, const float* bias, int64_t N, int64_t C, int64_t HW)
// dbias[c] = sum over n and hw of dout[n, c, hw]. WRITES. Deterministic.
NANODDP_DECLARE_KERNEL(channel_sum, float* dbias, const float* dout, int64_t N, int64_t C, int64_t HW)
// Per plane p of planes [H, W] -> [OH, OW]: out = the window's maximum (NaN wins), indices =
// its position h W + w in the plane (the first maximum on ties; int32: max_pool2d refuses
// planes of 2^31 elements or more); indices may be null, then only out is written (a forward
// that keeps no graph). window.channels is unused.
NANODDP_DECLARE_KERNEL(max_pool2d_forward, float* out, int32_t* indices, const float* in, int64_t planes,
                       Window2d window)
// din[p, indices[p, o]] += dout[p, o] over every output o of plane p, din 0 elsewhere. WRITES.
// Deterministic.
NANODDP_DECLARE_KERNEL(max_pool2d_backward, float* din, const float* dout, const int32_t* indices, int64_t planes,
                       Window2d window)

namespace {

// The window of op over input [N, C, H, W]; throws for bad sizes or an empty output.
Window2d make_window(const char* op, const Tensor& input, Size2 kernel, Size2 stride, Size2 padding, Size2 dilation) {
  check_float(op, input, "input");
  NANODDP_CHECK(input.dim() == 4, ShapeError, op, ": input ", input.shape(), " must be [N, C, H, W]");
  NANODDP_CHECK(kernel.h >= 1 && kernel.w >= 1 && stride.h >= 1 && stride.w >= 1 && dilation.h >= 1 &&
                    dilation.w >= 1 && padding.h >= 0 && padding.w >= 0,
                ValueError, op, ": kernel (", kernel.h, ", ", kernel.w, "), stride (", stride.h, ", ", stride.w,
                ") and dilation (", dilation.h, ", ", dilation.w, ") must be >= 1 and padding (", padding.h, ", ",
                padding.w, ") >= 0");
  Window2d w;
  w.channels = input.size(1);
  w.height = input.size(2);
  w.width = input.size(3);
  w.kernel_h = kernel.h;
  w.kernel_w = kernel.w;
  w.stride_h = stride.h;
  w.stride_w = stride.w;
  w.pad_h = padding.h;
  w.pad_w = padding.w;
  w.dilation_h = dilation.h;
  w.dilation_w = dilation.w;
  // torch takes any size here; these bounds keep every term of the kernels' position
  // arithmetic (o stride - pad + i dilation, with o stride + i dilation <= H + 2 pad) in int64.
  constexpr int64_t kLargest = int64_t{1} << 61;
  const auto extent = [](int64_t dilation, int64_t kernel) {
    return static_cast<__int128>(dilation) * static_cast<__int128>(kernel - 1);
  };
  NANODDP_CHECK(
      padding.h <= kLargest && padding.w <= kLargest && dilation.h <= kLargest && dilation.w <= kLargest &&
          stride.h <= kLargest && stride.w <= kLargest && extent(dilation.h, kernel.h) <= 2 * kLargest &&
          extent(dilation.w, kernel.w) <= 2 * kLargest,
      ValueError, op, ": kernel (", kernel.h, ", ", kernel.w, "), stride (", stride.h, ", ", stride.w,
      "), padding (", padding.h, ", ", padding.w, ") or dilation (", dilation.h, ", ", dilation.w,
      ") is beyond 2^61, or the kernel's extent, dilation (kernel - 1), beyond 2^62, which is not supported");
  const auto span = [&](int64_t size, int64_t pad, int64_t dilation, int64_t kernel) {
    return static_cast<__int128>(size) + 2 * static_cast<__int128>(pad) - extent(dilation, kernel) - 1;
  };
  const __int128 wide_span_h = span(w.height, w.pad_h, w.dilation_h, w.kernel_h);
  const __int128 wide_span_w = span(w.width, w.pad_w, w.dilation_w, w.kernel_w);
  NANODDP_CHECK(wide_span_h <= 2 * kLargest && wide_span_w <= 2 * kLargest, ShapeError, op, ": input ",
                input.shape(), " with padding (", padding.h, ", ", padding.w,
                ") spans more than 2^62 positions, which is not supported");
  const int64_t span_h = static_cast<int64_t>(wide_span_h), span_w = static_cast<int64_t>(wide_span_w);
  NANODDP_CHECK(span_h >= 0 && span_w >= 0, ShapeError, op, ": input ", input.shape(), " is smaller than the kernel (",
                kernel.h, ", ", kernel.w, ") with dilation (", dilation.h, ", ", dilation.w, ") and padding (",
                padding.h, ", ", padding.w, ")");
  w.out_h = span_h / w.stride_h + 1;
  w.out_w = span_w / w.stride_w + 1;
  return w;
}

// Note [Images per GEMM]
// conv2d runs im2col and the GEMM per group of images. On the CPU a group is one image: its
// cols [C kh kw, OH OW] are still in cache when the GEMM reads them, its output [OC, OH OW] is
// already the image's NCHW plane (no reordering pass, no zeroing of a batch-sized buffer), and
// in backward its dcols are still in cache for col2im. On CUDA a group is the batch (small
// GEMMs would leave the GPU idle) or, when cols are not kept for backward, a chunk of images
// whose cols take about kMaxUnsavedColsBytes (nn/conv_groups.h): a 1000-image test batch of
// the example's second convolution would otherwise need 139 MB of cols. Chunks start on a
// multiple of 48 columns, so that a GEMM that splits its columns into panels of up to 48 gives
// every column the panel, and so the rounding, it gets in one GEMM over the batch; images of
// fewer than 32 positions are not chunked (a last chunk that small could take a matrix-vector
// path). On the CPU the
// grouping is the same with or without a graph: tests/test_ops.cpp checks that a no_grad call
// equals one that records a graph, bit for bit.
//
// Backward needs each image's cols again (dweight = dout · cols^T). CUDA keeps them from
// forward. The CPU keeps the input instead and runs im2col again, one image at a time, into
// a buffer that stays in cache: the batch's cols are 4.5 times the input in the example's
// second convolution (8.9 MB against 1.4 MB at batch 64), and writing them in forward only to
// read them back from memory in backward cost more than the second im2col (and kept the
// working set of a training step larger than the L3 cache). PyTorch's CPU convolution
// (slow_conv2d) recomputes its columns in backward the same way.

// On the CPU a 3x3 convolution at stride 1 runs as Winograd F(2x2, 3x3) instead
// (kernels/cpu/winograd.h): forward, input gradient (such a convolution of dout) and weight
// gradient. A result with NaN or inf in it is computed again by im2col + GEMM, whose values
// are torch's (overflowed_winograd). That covers the two ways Winograd's values differ that
// matter in training:
// - a NaN or inf operand: the transforms add and subtract operands the direct sum only
//   multiplies, so inf can meet -inf (NaN) where conv2d gives +-inf. Such an operand always
//   reaches the result: every input pixel and weight lies in some output's window, and each
//   output's Winograd sum reads every operand of its window (0 * inf is NaN too);
// - finite operands near float32's largest values (above about 1e38 / 4): the transforms'
//   sums can overflow where the direct sum does not.
// Left: finite operands whose products overflow in the direct sum (inf - inf there, NaN in
// torch) can cancel in the transforms first and give a finite value here.
// Testing the result, not the operands, reads fewer values (the input and dout are both
// larger than the forward's output), and a training run's operands are finite.
bool uses_winograd(Device device, const Window2d& g, int64_t out_channels) {
  return !device.is_cuda() && kernels::cpu::winograd_applies(g, out_channels);
}
bool overflowed_winograd(const Tensor& result) {
  return result.defined() && !kernels::cpu::all_finite(ptr(result), result.numel());
}
}  // namespace

int64_t nn::detail::images_per_gemm(Device device, bool keeps_cols, int64_t N, int64_t CKK, int64_t OHW) {
  if (!device.is_cuda() || N == 0) return 1;
  if (keeps_cols || OHW < 32) return N;
  const int64_t align = 48 / std::gcd<int64_t>(OHW, 48);  // images per 48-column boundary
  const int64_t fit = kMaxUnsavedColsBytes / (CKK * OHW * int64_t{sizeof(float)});
  return std::min(N, std::max(align, fit / align * align));
}

// ---- conv2d -------------------------------------------------------------------------------

namespace {
// input, weight and bias: float32, or (Note [16-bit elementwise ops]) one 16-bit dtype. The
// node saves the 16-bit input (or, on CUDA, the float32 columns) and weight; the kernels read
// them widened: x, w and b here, and the saved ones again in backward.
Tensor conv2d_computed(const Tensor& input, const Tensor& weight, const Tensor& bias, Size2 stride, Size2 padding,
                       Size2 dilation) {
  const Tensor x = widened(input), w = widened(weight), b = widened(bias);
  check_float("conv2d", w, "weight");
  NANODDP_CHECK(weight.dim() == 4, ShapeError, "conv2d: weight ", weight.shape(), " must be [OC, C, kh, kw]");
  // torch: "expected weight to be at least 1 at dimension 0".
  NANODDP_CHECK(weight.size(0) >= 1, ShapeError, "conv2d: weight ", weight.shape(), " has no output channel");
  const Window2d g = make_window("conv2d", x, {weight.size(2), weight.size(3)}, stride, padding, dilation);
  check_same_dtype("conv2d", input, weight);
  check_same_device("conv2d", input, weight);
  NANODDP_CHECK(weight.size(1) == g.channels, ShapeError, "conv2d: input ", input.shape(), " has ", g.channels,
                " channels but weight ", weight.shape(), " expects ", weight.size(1));
  const int64_t N = input.size(0), OC = weight.size(0);
  if (bias.defined()) {
    check_float("conv2d", b, "bias");
    check_same_dtype("conv2d", input, bias);
    check_same_device("conv2d", input, bias);
    NANODDP_CHECK(bias.dim() == 1 && bias.size(0) == OC, ShapeError, "conv2d: bias ", bias.shape(),
                  " does not fit weight ", weight.shape(), " (expected [", OC, "])");
  }
  // Per group of n images (Note [Images per GEMM]): out^T [OC, n OH OW] = weight [OC, C kh kw]
  // · cols [C kh kw, n OH OW], reordered to [n, OC, OH, OW] (which for n == 1 it already is).
  const int64_t CKK = g.channels * g.kernel_h * g.kernel_w, OHW = g.out_h * g.out_w;
  const bool keeps_graph = is_grad_enabled() && (input.requires_grad() || weight.requires_grad() ||
                                                 (bias.defined() && bias.requires_grad()));
  const Device device = input.device();
  bool winograd = uses_winograd(device, g, OC);
  const int64_t group = nn::detail::images_per_gemm(device, keeps_graph, N, CKK, OHW);
  const int64_t image_size = g.channels * g.height * g.width;
  // Kept for backward on CUDA: every image's cols, [N / group groups of [C kh kw, group OH OW]]
  // (for group == N the layout of cols [C kh kw, N OH OW]); otherwise one group's.
  const bool keeps_cols = keeps_graph && device.is_cuda();
  Tensor out = Tensor::empty({N, OC, g.out_h, g.out_w}, DType::Float32, device);
  if (winograd) {
    kernels::cpu::conv3x3_winograd(ptr(out), ptr(x), ptr(w), N, OC, g);
    winograd = !overflowed_winograd(out);
    if (winograd && bias.defined())
      NANODDP_DISPATCH(device, channel_bias_forward, ptr(out), ptr(b), N, OC, OHW);
  }
  Tensor cols = winograd ? Tensor()
                         : Tensor::empty({keeps_cols ? N * CKK * OHW : group * CKK * OHW}, DType::Float32, device);
  Tensor out_t = !winograd && group > 1 ? Tensor::empty({OC, group * OHW}, DType::Float32, device) : Tensor();
  for (int64_t first = 0; first < N && !winograd; first += group) {
    const int64_t n = std::min(group, N - first);
    float* group_cols = ptr(cols) + (keeps_cols ? first * CKK * OHW : 0);
    float* group_out = ptr(out) + first * OC * OHW;
    NANODDP_DISPATCH(device, im2col, group_cols, ptr(x) + first * image_size, n, g);
    NANODDP_DISPATCH(device, matmul, group > 1 ? ptr(out_t) : group_out, ptr(w), group_cols, OC, CKK, n * OHW,
                     false, false, 0.0f);
    if (group > 1) NANODDP_DISPATCH(device, swap_leading_dims, group_out, ptr(out_t), OC, n, OHW);
    // Added while the group's output is still in cache.
    if (bias.defined()) NANODDP_DISPATCH(device, channel_bias_forward, group_out, ptr(b), n, OC, OHW);
  }

  // Backward reads the weight and, for dweight, the patches: the saved cols, or (on the CPU)
  // the input, whose cols it computes again (Note [Images per GEMM]).
  return record("Conv2dBackward", rounded_to(out, input.dtype()), {input, weight, bias},
                {keeps_cols ? cols : input, weight},
                [g, N, OC, CKK, group, keeps_cols](const Node& node, const Tensor& dout_as_given) {
    const Tensor patches = widened(node.saved(0));  // cols (float32 always), or the input
    const Tensor w = widened(node.saved(1));
    const Tensor dout = widened(dout_as_given);
    const Device device = w.device();
    const int64_t OHW = g.out_h * g.out_w, image_size = g.channels * g.height * g.width;
    const bool needs_dx = node.inputs[0].requires_grad(), needs_dw = node.inputs[1].requires_grad();
    Tensor dx, dw, db;
    if (needs_dx) dx = Tensor::empty(node.inputs[0].shape(), DType::Float32, device);
    bool winograd = !keeps_cols && (needs_dx || needs_dw) && uses_winograd(device, g, OC);
    if (winograd && needs_dx) kernels::cpu::conv3x3_winograd_input_grad(ptr(dx), ptr(dout), ptr(w), N, OC, g);
    if (winograd && needs_dw) {
      dw = empty_like(w);
      kernels::cpu::conv3x3_winograd_weight_grad(ptr(dw), ptr(patches), ptr(dout), N, OC, g);
    }
    if (winograd && (overflowed_winograd(dx) || overflowed_winograd(dw))) {
      winograd = false;  // both again by im2col + GEMM, below
      dw = Tensor();
    }
    // dw^T [C kh kw, OC], summed over the groups, then transposed once: Eigen packs the GEMM's
    // left operand with a transposing copy, and for dw^T that operand is the group's dout, not
    // its cols (4.5 times larger in the example's second convolution).
    Tensor dw_t = needs_dw && !winograd ? Tensor::zeros({CKK, OC}, DType::Float32, device) : Tensor();
    // The group's dout^T [OC, n OH OW]: dout itself for one image, else reordered.
    Tensor dout_t = group > 1 ? Tensor::empty({OC, group * OHW}, DType::Float32, device) : Tensor();
    Tensor dcols = needs_dx && !winograd ? Tensor::empty({CKK, group * OHW}, DType::Float32, device) : Tensor();
    Tensor cols = needs_dw && !keeps_cols && !winograd ? Tensor::empty({CKK, group * OHW}, DType::Float32, device)
                                                       : Tensor();
    // db is summed per group while the group's dout is still in cache (on the CPU, a 5.5 MB
    // dout for the example's first convolution is otherwise read again from memory), then over
    // the groups: each group's sum runs in double and is kept as float, the sum over the groups
    // runs in double again.
    const bool needs_db = node.inputs[2].defined() && node.inputs[2].requires_grad();
    const int64_t groups = (N + group - 1) / group;
    Tensor db_groups = needs_db ? Tensor::empty({groups, OC}, DType::Float32, device) : Tensor();
    for (int64_t first = 0; first < N; first += group) {
      const int64_t n = std::min(group, N - first);
      const float* group_dout = ptr(dout) + first * OC * OHW;
      if (group > 1) {
        NANODDP_DISPATCH(device, swap_leading_dims, ptr(dout_t), group_dout, n, OC, OHW);
        group_dout = ptr(dout_t);
      }
      if (needs_dw && !winograd) {  // dw^T += cols · dout
        if (!keeps_cols) NANODDP_DISPATCH(device, im2col, ptr(cols), ptr(patches) + first * image_size, n, g);
        const float* group_cols = keeps_cols ? ptr(patches) + first * CKK * OHW : ptr(cols);
        NANODDP_DISPATCH(device, matmul, ptr(dw_t), group_cols, group_dout, CKK, n * OHW, OC, false, true, 1.0f);
      }
      if (needs_dx && !winograd) {  // dx = col2im(w^T · dout^T)
        NANODDP_DISPATCH(device, matmul, ptr(dcols), ptr(w), group_dout, CKK, OC, n * OHW, true, false, 0.0f);
        NANODDP_DISPATCH(device, col2im, ptr(dx) + first * image_size, ptr(dcols), n, g);
      }
      if (needs_db)
        NANODDP_DISPATCH(device, channel_sum, ptr(db_groups) + first / group * OC, ptr(dout) + first * OC * OHW, n,
                         OC, OHW);
    }
    if (needs_dw && !winograd) {
      dw = empty_like(w);
      NANODDP_DISPATCH(device, swap_leading_dims, ptr(dw), ptr(dw_t), CKK, OC, 1);
    }
    if (needs_db) {  // db [OC] = the sum over groups of db_groups [groups, OC]
      db = Tensor::empty({OC}, DType::Float32, device);
      NANODDP_DISPATCH(device, channel_sum, ptr(db), ptr(db_groups), groups, OC, 1);
    }
    const auto as_input = [&node](const Tensor& grad, size_t i) {
      return grad.defined() ? rounded_to(grad, node.inputs[i].dtype()) : grad;
    };
    return std::vector<Tensor>{as_input(dx, 0), as_input(dw, 1), as_input(db, 2)};
  });
}

}  // namespace

// Note [Autocast], group 1. There is no 16-bit convolution kernel here: the operands, cast to
// 16 bits (recorded), are widened to float32 for the kernels, convolved, and the output rounded
// once (Note [16-bit elementwise ops]). That is the computation torch's CPU autocast does; on
// CUDA it costs float32 speed.
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, Size2 stride, Size2 padding,
              Size2 dilation) {
  ForwardSpan span("conv2d", {&input, &weight, &bias});
  const AutocastState autocast = autocast_state();
  if (!autocast.enabled && !(input.defined() && is_16bit_float(input.dtype())))
    return conv2d_computed(input, weight, bias, stride, padding, dilation);
  check_floating("conv2d", input, "input");
  check_floating("conv2d", weight, "weight");
  if (!autocast.enabled) check_same_dtype("conv2d", input, weight);
  if (!autocast.enabled && bias.defined()) check_same_dtype("conv2d", input, bias);
  const DType dtype = autocast.enabled ? autocast.dtype : input.dtype();
  auto cast = [dtype](const Tensor& t) { return t.defined() ? t.to(dtype) : t; };
  return conv2d_computed(cast(input), cast(weight), cast(bias), stride, padding, dilation);
}

// ---- max_pool2d ---------------------------------------------------------------------------

Tensor max_pool2d(const Tensor& input, Size2 kernel_size, Size2 stride, Size2 padding, Size2 dilation) {
  ForwardSpan span("max_pool2d", {&input});
  // Note [16-bit elementwise ops]: the node is on the 16-bit input (and saves only the
  // indices); the kernel reads x.
  const Tensor x = widened(input);
  Window2d g = make_window("max_pool2d", x, kernel_size, stride, padding, dilation);
  NANODDP_CHECK(g.channels > 0 && g.height > 0 && g.width > 0, ShapeError, "max_pool2d: input ", x.shape(),
                " has no channel, row or column; only the batch may be empty, as in torch");
  NANODDP_CHECK(2 * padding.h <= kernel_size.h && 2 * padding.w <= kernel_size.w, ValueError,
                "max_pool2d: padding (", padding.h, ", ", padding.w, ") must be at most half the kernel (",
                kernel_size.h, ", ", kernel_size.w, ")");
  // Before the scan below, which is as long as a plane's rows and columns (an empty batch
  // may claim any size) and keeps its sums in int64 only for planes of this size.
  NANODDP_CHECK(g.height * g.width <= INT32_MAX, ValueError, "max_pool2d: input ", input.shape(),
                " has planes of ", g.height * g.width,
                " elements; at most 2^31 - 1 are supported (the indices are int32)");
  // Note [Windows of padding only]
  // With dilation, a window can fall entirely on padding (kernel 2, dilation 2, padding 1 over
  // one row: it looks at rows -1 and 1). It has no maximum and no input element to send its
  // gradient to: PyTorch returns -inf there with an index outside the input, and its backward
  // writes out of bounds. Such a geometry is refused here, before any kernel runs.
  const auto first_empty_window = [](int64_t out, int64_t size, int64_t kernel, int64_t stride, int64_t pad,
                                     int64_t dilation) -> int64_t {
    for (int64_t o = 0; o < out; ++o) {
      const kernels::Taps taps = kernels::window_taps(o * stride - pad, size, kernel, dilation);
      if (taps.first >= taps.last) return o;
    }
    return -1;
  };
  const int64_t empty_row = first_empty_window(g.out_h, g.height, g.kernel_h, g.stride_h, g.pad_h, g.dilation_h);
  const int64_t empty_col = first_empty_window(g.out_w, g.width, g.kernel_w, g.stride_w, g.pad_w, g.dilation_w);
  NANODDP_CHECK(empty_row < 0 && empty_col < 0, ValueError, "max_pool2d: the window of output ",
                empty_row >= 0 ? "row " : "column ", empty_row >= 0 ? empty_row : empty_col,
                " covers only padding (input ", input.shape(), ", kernel (", kernel_size.h, ", ",
                kernel_size.w, "), stride (", stride.h, ", ", stride.w, "), padding (", padding.h, ", ",
                padding.w, "), dilation (", dilation.h, ", ", dilation.w, ")); use less padding or dilation");
  const int64_t planes = input.size(0) * input.size(1);
  const Device device = input.device();
  Tensor out = Tensor::empty({input.size(0), input.size(1), g.out_h, g.out_w}, DType::Float32, device);
  // The argmax indices serve backward only: under no_grad (evaluation) or for an input that
  // needs no gradient, none are made. They are int32 (4 bytes per output element; torch
  // keeps int64), an index into the input's [H, W] plane.
  if (!is_grad_enabled() || !input.requires_grad()) {
    NANODDP_DISPATCH(device, max_pool2d_forward, ptr(out), static_cast<int32_t*>(nullptr), ptr(x), planes, g);
    return rounded_to(out, input.dtype());
  }
  Tensor indices = Tensor::empty(out.shape(), DType::Int32, device);
  NANODDP_DISPATCH(device, max_pool2d_forward, ptr(out), indices.data<int32_t>(), ptr(x), planes, g);

  return record("MaxPool2dBackward", rounded_to(out, input.dtype()), {input}, {indices},
                [input_shape = input.shape(), dtype = input.dtype(), planes, g](const Node& node, const Tensor& dout) {
    const Tensor& indices = node.saved(0);
    const Tensor dy = widened(dout);
    Tensor dx = Tensor::empty(input_shape, DType::Float32, dout.device());
    NANODDP_DISPATCH(dout.device(), max_pool2d_backward, ptr(dx), ptr(dy), indices.data<int32_t>(), planes, g);
    return std::vector<Tensor>{rounded_to(dx, dtype)};
  });
}

namespace nn {

Conv2d::Conv2d(int64_t in_channels, int64_t out_channels, Size2 kernel_size, Generator& gen, Size2 stride,
               Size2 padding, Size2 dilation, bool with_bias)
    : stride_(stride), padding_(padding), dilation_(dilation) {
  NANODDP_CHECK(in_channels >= 1 && out_channels >= 1 && kernel_size.h >= 1 && kernel_size.w >= 1, ValueError,
                "Conv2d(", in_channels, ", ", out_channels, ", kernel (", kernel_size.h, ", ", kernel_size.w,
                ")): channels and kernel sizes must be >= 1");
  const int64_t fan_in = in_channels * kernel_size.h * kernel_size.w;
  // torch.nn.Conv2d.reset_parameters: the weight (row-major), then the bias.
  weight =
      register_parameter("weight", init::uniform({out_channels, in_channels, kernel_size.h, kernel_size.w},
                                                 init::kaiming_uniform_bound(fan_in), gen));
  if (with_bias)
    bias = register_parameter("bias", init::uniform({out_channels}, init::bias_bound(fan_in), gen));
}

Tensor Conv2d::forward(const Tensor& input) { return conv2d(input, weight, bias, stride_, padding_, dilation_); }

}  // namespace nn
}  // namespace nanoddp
