// What every op's forward does first: check its operands, allocate its output, hand raw
// pointers to a kernel. Shared by core/ops.cpp and the layers in nn/.
//
//   check_float("tanh", x, "input");
//   Tensor y = empty_like(x);
//   NANODDP_DISPATCH(x.device(), tanh_forward, ptr(y), ptr(x), x.numel());
#pragma once

#include "core/tensor.h"

namespace nanoddp {

// dst's values become src's (same shape and dtype, any devices; ShapeError otherwise), as
// Tensor::copy_, but not counted as an in-place change (Note [Version counter] in
// core/storage.h): for the library's own writes, a collective filling its output.
void copy_values(const Tensor& dst, const Tensor& src);

// Throws ValueError unless t is a defined float32 tensor; the message names op and what.
inline void check_float(const char* op, const Tensor& t, const char* what) {
  NANODDP_CHECK(t.defined(), ValueError, op, ": ", what, " is undefined");
  NANODDP_CHECK(t.dtype() == DType::Float32, ValueError, op, ": ", what, " must be float32, got ", t.dtype(),
                " (shape ", t.shape(), ")");
}

// Throws ValueError unless t is a defined Float32, Float16 or BFloat16 tensor.
inline void check_floating(const char* op, const Tensor& t, const char* what) {
  NANODDP_CHECK(t.defined(), ValueError, op, ": ", what, " is undefined");
  NANODDP_CHECK(t.dtype() == DType::Float32 || is_16bit_float(t.dtype()), ValueError, op, ": ", what,
                " must be float32, float16 or bfloat16, got ", t.dtype(), " (shape ", t.shape(), ")");
}

// Throws ValueError unless a and b have one dtype (torch's matmul refuses mixed dtypes too).
inline void check_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  NANODDP_CHECK(a.dtype() == b.dtype(), ValueError, op, ": operands are ", a.dtype(), " and ", b.dtype(),
                " (shapes ", a.shape(), " and ", b.shape(), "); cast one with .to(dtype), or run under nn::autocast");
}

// Throws DeviceError unless a and b live on one device.
inline void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  NANODDP_CHECK(a.device() == b.device(), DeviceError, op, ": operands on ", a.device(), " and ", b.device(),
                " (shapes ", a.shape(), " and ", b.shape(), ")");
}

// An uninitialised float32 tensor of t's shape on t's device.
inline Tensor empty_like(const Tensor& t) { return Tensor::empty(t.shape(), DType::Float32, t.device()); }

// An uninitialised tensor of t's shape, dtype and device.
inline Tensor empty_same(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), t.device()); }

// t's float32 data (a kernel argument).
inline float* ptr(const Tensor& t) { return t.data<float>(); }

// t's 16-bit data as raw bits (a kernel argument, with t.dtype() naming the format).
inline uint16_t* bits16(const Tensor& t) {
  return t.dtype() == DType::BFloat16 ? reinterpret_cast<uint16_t*>(t.data<BFloat16>())
                                      : reinterpret_cast<uint16_t*>(t.data<Float16>());
}

// Note [16-bit elementwise ops]
// Kernels other than matrix products compute in float32 only; given a 16-bit tensor, an op
// computes in float32 and rounds its output back to the input's dtype, once. That is what
// most of torch's CPU kernels do for bfloat16 on CPUs without 16-bit arithmetic: the output is
// as if computed exactly and rounded. A few of torch 1.13's round intermediate values to
// bfloat16 too (the tanh-form GELU, the gradients of sigmoid and tanh; matmul of two operands
// stored row by row adds bfloat16 products one at a time): there ours differ from torch's by a
// few units in the last place, and are the nearer to the exact value. It is done in one of two
// ways:
//  - relu, max_pool2d and conv2d (the layers a CNN keeps most activations for) record one
//    node on the 16-bit tensors, save 16-bit tensors where backward reads values (relu its
//    output, conv2d its input and weight; max_pool2d only int32 indices), and widen them
//    into float32 temporaries, not recorded, for each kernel call, in forward and again in
//    backward (widened, rounded_to). A 16-bit activation then costs 2 bytes per element, as
//    autocast means it to, not 2 plus a kept float32 copy (on CUDA, conv2d still keeps its
//    float32 im2col columns for backward, as it does for float32);
//  - other ops go through computed_in_float32: recorded casts around the float32 op. A float32
//    op that saves its operand (mul, the GELU) keeps the float32 copy until backward; one that
//    saves nothing (add, sub, mul and div by a scalar) keeps nothing. Same bits.
// A binary op follows torch's type promotion: two operands of one 16-bit dtype give that
// dtype; a 16-bit and a float32 operand (a float16 and a bfloat16 one) give float32.

// fn(t) for float32 t; for 16-bit t, fn(t in float32) rounded back to t's dtype.
template <typename Fn>
Tensor computed_in_float32(const Tensor& t, Fn&& fn) {
  if (!t.defined() || !is_16bit_float(t.dtype())) return fn(t);
  return fn(t.to(DType::Float32)).to(t.dtype());
}

// A kernel's float32 operand: a 16-bit t widened (exactly) into a temporary that no graph
// records or keeps; t itself otherwise.
inline Tensor widened(const Tensor& t) {
  return t.defined() && is_16bit_float(t.dtype()) ? t.detach().to(DType::Float32) : t;
}

// A float32 kernel result rounded to dtype (nearest, ties to even), not recorded; wide itself
// for float32.
inline Tensor rounded_to(const Tensor& wide, DType dtype) {
  return dtype == DType::Float32 ? wide : wide.detach().to(dtype);
}

// t, cast up to float32 (recorded) when it is 16-bit: the operand of an op that computes in
// float32 and returns float32 (Note [Autocast] in core/autocast.h, group 2).
inline Tensor as_float32(const Tensor& t) {
  return t.defined() && is_16bit_float(t.dtype()) ? t.to(DType::Float32) : t;
}

}  // namespace nanoddp
