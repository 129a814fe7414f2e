// CUDA kernels of the pointwise activations in nn/activations.h (declared there): one thread
// per element with grid-stride loops, each kernel followed by its checked host launcher.

#include "kernels/activation_constants.h"
#include "kernels/cuda/launch.cuh"

namespace nanoddp::kernels::cuda {

// ---- sigmoid ------------------------------------------------------------------------------

__global__ void sigmoid_forward_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) y[i] = 1.0f / (1.0f + expf(-x[i]));
}

void sigmoid_forward(float* y, const float* x, int64_t n) {
  if (n <= 0) return;
  sigmoid_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(y, x, n);
  NANODDP_CUDA_CHECK_LAUNCH("sigmoid_forward_kernel");
}

__global__ void sigmoid_backward_kernel(float* dx, const float* dy, const float* y, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) dx[i] = dy[i] * y[i] * (1.0f - y[i]);
}

void sigmoid_backward(float* dx, const float* dy, const float* y, int64_t n) {
  if (n <= 0) return;
  sigmoid_backward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(dx, dy, y, n);
  NANODDP_CUDA_CHECK_LAUNCH("sigmoid_backward_kernel");
}

// ---- tanh ---------------------------------------------------------------------------------

__global__ void tanh_forward_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) y[i] = tanhf(x[i]);
}

void tanh_forward(float* y, const float* x, int64_t n) {
  if (n <= 0) return;
  tanh_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(y, x, n);
  NANODDP_CUDA_CHECK_LAUNCH("tanh_forward_kernel");
}

__global__ void tanh_backward_kernel(float* dx, const float* dy, const float* y, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) dx[i] = dy[i] * (1.0f - y[i] * y[i]);
}

void tanh_backward(float* dx, const float* dy, const float* y, int64_t n) {
  if (n <= 0) return;
  tanh_backward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(dx, dy, y, n);
  NANODDP_CUDA_CHECK_LAUNCH("tanh_backward_kernel");
}

// ---- gelu ---------------------------------------------------------------------------------

__global__ void gelu_forward_kernel(float* y, const float* x, bool tanh_approximation, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float v = x[i];
    // x s(2u), the CPU's form (Note [GELU's tanh form] in kernels/cpu/activations.cpp).
    // Phi(x) as normcdff, accurate in the lower tail (Note [GELU's lower tail] in
    // kernels/cpu/activations.cpp).
    y[i] = tanh_approximation ? gelu_tanh_value(v) : v * normcdff(v);
  }
}

void gelu_forward(float* y, const float* x, bool tanh_approximation, int64_t n) {
  if (n <= 0) return;
  gelu_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(y, x, tanh_approximation, n);
  NANODDP_CUDA_CHECK_LAUNCH("gelu_forward_kernel");
}

__global__ void gelu_backward_kernel(float* dx, const float* dy, const float* x, bool tanh_approximation,
                                     int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float v = x[i];
    float slope;
    if (tanh_approximation) {
      slope = gelu_tanh_slope(v);
    } else {
      slope = normcdff(v) + v * kInvSqrt2Pi * expf(-0.5f * v * v);
    }
    dx[i] = dy[i] * slope;
  }
}

void gelu_backward(float* dx, const float* dy, const float* x, bool tanh_approximation, int64_t n) {
  if (n <= 0) return;
  gelu_backward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(dx, dy, x, tanh_approximation, n);
  NANODDP_CUDA_CHECK_LAUNCH("gelu_backward_kernel");
}

// ---- softplus -----------------------------------------------------------------------------

__global__ void softplus_forward_kernel(float* y, const float* x, float beta, float threshold, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride())
    y[i] = x[i] * beta > threshold ? x[i] : log1pf(expf(x[i] * beta)) / beta;
}

void softplus_forward(float* y, const float* x, float beta, float threshold, int64_t n) {
  if (n <= 0) return;
  softplus_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(y, x, beta, threshold, n);
  NANODDP_CUDA_CHECK_LAUNCH("softplus_forward_kernel");
}

__global__ void softplus_backward_kernel(float* dx, const float* dy, const float* x, float beta, float threshold,
                                         int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float z = expf(x[i] * beta);
    dx[i] = x[i] * beta > threshold ? dy[i] : dy[i] * z / (z + 1.0f);
  }
}

void softplus_backward(float* dx, const float* dy, const float* x, float beta, float threshold, int64_t n) {
  if (n <= 0) return;
  softplus_backward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(dx, dy, x, beta, threshold, n);
  NANODDP_CUDA_CHECK_LAUNCH("softplus_backward_kernel");
}

}  // namespace nanoddp::kernels::cuda
