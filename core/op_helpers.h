// What every op's forward does first: check its operands, allocate its output, hand raw
// pointers to a kernel. Shared by core/ops.cpp and the layers in nn/.
//
//   check_float("tanh", x, "input");
//   Tensor y = empty_like(x);
//   NANODDP_DISPATCH(x.device(), tanh_forward, ptr(y), ptr(x), x.numel());
#pragma once

#include "core/tensor.h"

namespace nanoddp {

// Throws ValueError unless t is a defined float32 tensor; the message names op and what.
inline void check_float(const char* op, const Tensor& t, const char* what) {
  NANODDP_CHECK(t.defined(), ValueError, op, ": ", what, " is undefined");
  NANODDP_CHECK(t.dtype() == DType::Float32, ValueError, op, ": ", what, " must be float32, got ", t.dtype(),
                " (shape ", t.shape(), ")");
}

// Throws DeviceError unless a and b live on one device.
inline void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  NANODDP_CHECK(a.device() == b.device(), DeviceError, op, ": operands on ", a.device(), " and ", b.device(),
                " (shapes ", a.shape(), " and ", b.shape(), ")");
}

// An uninitialised float32 tensor of t's shape on t's device.
inline Tensor empty_like(const Tensor& t) { return Tensor::empty(t.shape(), DType::Float32, t.device()); }

// t's float32 data (a kernel argument).
inline float* ptr(const Tensor& t) { return t.data<float>(); }

}  // namespace nanoddp
