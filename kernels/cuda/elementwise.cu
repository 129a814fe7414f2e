// Elementwise CUDA kernels: fill, dropout masks, byte-to-float and 16-bit float conversions, binary and scalar ops, gradient
// accumulation, relu. One thread per element with grid-stride loops; each kernel is followed
// by its host launcher. Contracts (shapes, aliasing) are in kernels/kernel_list.inc.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/launch.cuh"
#include "kernels/dropout_mask.h"
#include "kernels/kernels.h"

namespace nanoddp::kernels::cuda {

// ---- memory ----------------------------------------------------------------------------------

// Declared in nn/dropout.cpp: the CPU's mask, drawn on the device (kernels/dropout_mask.h).
__global__ void dropout_mask_forward_kernel(float* mask, uint64_t key, float p, float keep_scale, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) mask[i] = dropout_uniform(key, i) >= p ? keep_scale : 0.0f;
}

void dropout_mask(float* mask, uint64_t key, float p, float keep_scale, int64_t n) {
  if (n <= 0) return;
  dropout_mask_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(mask, key, p, keep_scale, n);
  NANODDP_CUDA_CHECK_LAUNCH("dropout_mask_forward_kernel");
}

// Declared in nn/clip_grad.cpp: torch.clamp_, which keeps a NaN (fminf and fmaxf would drop it).
__global__ void clamp_in_place_kernel(float* x, float lo, float hi, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float v = x[i];
    x[i] = v != v ? v : fminf(fmaxf(v, lo), hi);
  }
}

void clamp_in_place(float* x, float lo, float hi, int64_t n) {
  if (n <= 0) return;
  clamp_in_place_kernel<<<grid_for(n), kBlock, 0, stream()>>>(x, lo, hi, n);
  NANODDP_CUDA_CHECK_LAUNCH("clamp_in_place_kernel");
}

__global__ void fill_forward_kernel(float* out, float value, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = value;
}

void fill(float* out, float value, int64_t n) {
  if (n <= 0) return;
  fill_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(out, value, n);
  NANODDP_CUDA_CHECK_LAUNCH("fill_forward_kernel");
}

void zero_bytes(void* out, size_t nbytes) {
  if (nbytes > 0) NANODDP_CUDA_CHECK(cudaMemsetAsync(out, 0, nbytes, stream()));
}

__global__ void bytes_to_unit_float_forward_kernel(float* out, const uint8_t* in, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = static_cast<float>(in[i]) / 255.0f;
}

void bytes_to_unit_float(float* out, const uint8_t* in, int64_t n) {
  if (n <= 0) return;
  bytes_to_unit_float_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(out, in, n);
  NANODDP_CUDA_CHECK_LAUNCH("bytes_to_unit_float_forward_kernel");
}

// 16-bit floats: the intrinsics round to nearest, ties to even, like core/half.h on the CPU.
__device__ __forceinline__ uint16_t round_to_16bit(float x, bool bfloat) {
  return bfloat ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}
__device__ __forceinline__ float widen_16bit(uint16_t bits, bool bfloat) {
  return bfloat ? __bfloat162float(__ushort_as_bfloat16(bits)) : __half2float(__ushort_as_half(bits));
}

__global__ void float_to_16bit_forward_kernel(uint16_t* out, const float* in, bool bfloat, float divisor, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride())
    out[i] = round_to_16bit(widen_16bit(round_to_16bit(in[i], bfloat), bfloat) / divisor, bfloat);
}

void float_to_16bit(uint16_t* out, const float* in, DType format, float divisor, int64_t n) {
  if (n <= 0) return;
  float_to_16bit_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(out, in, format == DType::BFloat16, divisor, n);
  NANODDP_CUDA_CHECK_LAUNCH("float_to_16bit_forward_kernel");
}

__global__ void float_from_16bit_forward_kernel(float* out, const uint16_t* in, bool bfloat, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = widen_16bit(in[i], bfloat);
}

void float_from_16bit(float* out, const uint16_t* in, DType format, int64_t n) {
  if (n <= 0) return;
  float_from_16bit_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(out, in, format == DType::BFloat16, n);
  NANODDP_CUDA_CHECK_LAUNCH("float_from_16bit_forward_kernel");
}

// ---- elementwise -----------------------------------------------------------------------------

__device__ __forceinline__ float apply(BinaryOp op, float a, float b) {
  switch (op) {
    case BinaryOp::Add: return a + b;
    case BinaryOp::Sub: return a - b;
    case BinaryOp::Mul: return a * b;
  }
  return 0.0f;
}

// a, out: [N, F]; b: [N, F], or [F] when broadcast_b. out may alias a.
__global__ void binary_forward_kernel(float* out, const float* a, const float* b, BinaryOp op, int64_t n,
                                      int64_t F, bool broadcast_b) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = apply(op, a[i], b[broadcast_b ? i % F : i]);
}

void binary_forward(float* out, const float* a, const float* b, BinaryOp op, int64_t N, int64_t F,
                    bool broadcast_b) {
  const int64_t n = N * F;
  if (n <= 0) return;
  binary_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(out, a, b, op, n, F, broadcast_b);
  NANODDP_CUDA_CHECK_LAUNCH("binary_forward_kernel");
}

__global__ void scalar_forward_kernel(float* out, const float* a, ScalarOp op, float s, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = op == ScalarOp::Mul ? a[i] * s : a[i] / s;
}

void scalar_forward(float* out, const float* a, ScalarOp op, float s, int64_t n) {
  if (n <= 0) return;
  scalar_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(out, a, op, s, n);
  NANODDP_CUDA_CHECK_LAUNCH("scalar_forward_kernel");
}

__global__ void accumulate_backward_kernel(float* out, const float* a, float alpha, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] += alpha * a[i];
}

void accumulate(float* out, const float* a, float alpha, int64_t n) {
  if (n <= 0) return;
  accumulate_backward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(out, a, alpha, n);
  NANODDP_CUDA_CHECK_LAUNCH("accumulate_backward_kernel");
}

// ---- activations -----------------------------------------------------------------------------

// torch.relu's clamp_min(x, 0): x unless x < 0, so NaN stays NaN (fmaxf would make it 0) and
// -0.0 stays -0.0.
__global__ void relu_forward_kernel(float* out, const float* in, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float x = in[i];
    out[i] = x < 0.0f ? 0.0f : x;
  }
}

void relu_forward(float* out, const float* in, int64_t n) {
  if (n <= 0) return;
  relu_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(out, in, n);
  NANODDP_CUDA_CHECK_LAUNCH("relu_forward_kernel");
}

// din = 0 where in <= 0, else dout: a NaN passes its gradient, as torch's threshold_backward.
// WRITES.
__global__ void relu_backward_kernel(float* din, const float* dout, const float* in, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) din[i] = in[i] <= 0.0f ? 0.0f : dout[i];
}

void relu_backward(float* din, const float* dout, const float* in, int64_t n) {
  if (n <= 0) return;
  relu_backward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(din, dout, in, n);
  NANODDP_CUDA_CHECK_LAUNCH("relu_backward_kernel");
}

}  // namespace nanoddp::kernels::cuda
