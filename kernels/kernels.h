// Every compute kernel, declared once for both devices.
//
//   kernels::cpu::relu_forward(out, in, n);          // Eigen, kernels/cpu/*.cpp
//   kernels::cuda::relu_forward(out, in, n);         // hand-written, kernels/cuda/*.cu
//   NANODDP_DISPATCH(t.device(), relu_forward, out, in, n);   // picks by device
//
// The two namespaces declare the same list (kernels/kernel_list.inc: the core ops), so a CUDA
// kernel is a new definition, never a new signature. A layer declares its own kernels next to
// the forward and backward that call them, with NANODDP_DECLARE_KERNEL (one declaration, both
// namespaces): a layer is one place (docs/adding-a-layer.md). Conventions (llm.c's): outputs first, then inputs,
// then sizes; pointers are to device memory of the namespace's device; all tensors are dense
// row-major. Gradient buffers are d-prefixed and each comment says whether backward WRITES
// or ACCUMULATES. Scalars that live in tensors (a loss's gradient) are passed as pointers so
// CUDA never has to copy them to the host. n == 0 is always allowed and does nothing.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/device.h"
#include "core/error.h"
#include "kernels/device_memory.h"

namespace nanoddp::kernels {

enum class BinaryOp { Add, Sub, Mul };
enum class ScalarOp { Mul, Div };
enum class Reduction { None, Mean, Sum };  // torch's reduction='none' | 'mean' | 'sum'

// Hyper-parameters of one SGD step; the meaning is torch.optim.SGD's.
struct SgdConfig {
  float lr = 0.0f;
  float momentum = 0.0f;
  // 1 - dampening, computed in double and rounded once, as torch passes alpha=1 - dampening
  // (a Python float) to its float kernel: 1 - 0.09 is 0.91f, where 1.0f - 0.09f is 0.90999997f.
  float one_minus_dampening = 1.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  bool maximize = false;  // step along the gradient: torch's maximize, the gradient negated first
};

// Hyper-parameters of one torch.optim.Adam / AdamW step, with the step-dependent factors
// already computed on the host in double precision, as PyTorch computes them in Python floats:
//   step_size = lr / (1 - beta1^step), bias_correction2_sqrt = sqrt(1 - beta2^step),
//   param_scale = 1 - lr * weight_decay for AdamW (decoupled decay), 1 for Adam.
// l2 is Adam's weight_decay, added to the gradient (0 for AdamW).
struct AdamConfig {
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;  // 1 - beta1 in double, then rounded (PyTorch's alpha)
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float eps = 1e-8f;
  float l2 = 0.0f;
  float param_scale = 1.0f;
  float step_size = 0.0f;
  float bias_correction2_sqrt = 1.0f;
  bool amsgrad = false;
  bool maximize = false;  // the gradient negated first, as torch's maximize
};

// A sliding window over one [C, H, W] image (Conv2d's im2col, MaxPool2d): kernel, stride,
// zero padding on both sides and dilation per axis, and the output size they give:
// out = (in + 2 pad - dilation (kernel - 1) - 1) / stride + 1 (torch.nn.Conv2d's formula).
struct Window2d {
  int64_t channels = 0, height = 0, width = 0;
  int64_t kernel_h = 1, kernel_w = 1;
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
  int64_t dilation_h = 1, dilation_w = 1;
  int64_t out_h = 0, out_w = 0;
};

namespace cpu {
#include "kernels/kernel_list.inc"
}  // namespace cpu

namespace cuda {
#include "kernels/kernel_list.inc"
}  // namespace cuda

// True when this build has CUDA kernels (meson -Dcuda=enabled or auto with a toolkit found).
bool cuda_built();

[[noreturn]] void throw_no_cuda(const char* kernel);

}  // namespace nanoddp::kernels

// Declares `void name(params...)` in kernels::cpu and kernels::cuda, from inside namespace
// nanoddp:  NANODDP_DECLARE_KERNEL(tanh_forward, float* y, const float* x, int64_t n)
// kernels/cpu and kernels/cuda define it; a definition with other parameters fails to link.
#define NANODDP_DECLARE_KERNEL(name, ...)        \
  namespace kernels::cpu {                       \
  void name(__VA_ARGS__);                        \
  }                                              \
  namespace kernels::cuda {                      \
  void name(__VA_ARGS__);                        \
  }

// A CUDA kernel runs on the GPU that holds its tensors, whichever GPU this thread used last:
// the dispatch makes device current first (a no-op when it already is), so its compute stream,
// cuBLAS handle and scratch memory are that GPU's. Ops check beforehand that all their
// operands are on one device (core/ops.cpp).
#if NANODDP_WITH_CUDA
#define NANODDP_DISPATCH(device, kernel, ...)                                       \
  ((device).is_cuda() ? (::nanoddp::kernels::cuda::set_device((device).index),      \
                         ::nanoddp::kernels::cuda::kernel(__VA_ARGS__))              \
                      : ::nanoddp::kernels::cpu::kernel(__VA_ARGS__))
#else
#define NANODDP_DISPATCH(device, kernel, ...)                                       \
  ((device).is_cuda() ? ::nanoddp::kernels::throw_no_cuda(#kernel)                  \
                      : ::nanoddp::kernels::cpu::kernel(__VA_ARGS__))
#endif
