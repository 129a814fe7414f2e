// CPU elementwise kernels: fill, conversions, binary and scalar ops, relu, column sums.
#include <cmath>

#include "kernels/cpu/eigen_maps.h"
#include "kernels/kernels.h"

namespace nanoddp::kernels::cpu {

void fill(float* out, float value, int64_t n) { vec(out, n).setConstant(value); }

void bytes_to_unit_float(float* out, const uint8_t* in, int64_t n) {
  // A true division, as torchvision's ToTensor (byte / 255) does.
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]) / 255.0f;
}

void binary_forward(float* out, const float* a, const float* b, BinaryOp op, int64_t N, int64_t F,
                    bool broadcast_b) {
  auto o = mat(out, N, F);
  auto x = mat(a, N, F);
  if (broadcast_b) {
    const ConstRowVectorMap row(b, F);
    switch (op) {
      case BinaryOp::Add: o = x.rowwise() + row; break;
      case BinaryOp::Sub: o = x.rowwise() - row; break;
      case BinaryOp::Mul: o = (x.array().rowwise() * row.array()).matrix(); break;
    }
    return;
  }
  auto y = mat(b, N, F);
  switch (op) {
    case BinaryOp::Add: o = x + y; break;
    case BinaryOp::Sub: o = x - y; break;
    case BinaryOp::Mul: o = x.cwiseProduct(y); break;
  }
}

void scalar_forward(float* out, const float* a, ScalarOp op, float s, int64_t n) {
  if (op == ScalarOp::Mul) {
    vec(out, n) = vec(a, n) * s;
  } else {
    vec(out, n) = vec(a, n) / s;
  }
}

void accumulate(float* out, const float* a, float alpha, int64_t n) {
  if (alpha == 1.0f) {
    vec(out, n) += vec(a, n);
  } else {
    vec(out, n) += alpha * vec(a, n);
  }
}

void column_sum(float* out, const float* d, int64_t N, int64_t F) {
  // Row by row, in order: vectorised across columns and deterministic.
  auto o = vec(out, F);
  o.setZero();
  for (int64_t r = 0; r < N; ++r) o += vec(d + r * F, F);
}

void relu_forward(float* out, const float* in, int64_t n) {
  // Not max(x, 0): a NaN must stay NaN, as in torch.relu.
  for (int64_t i = 0; i < n; ++i) out[i] = std::isnan(in[i]) || in[i] > 0.0f ? in[i] : 0.0f;
}

void relu_backward(float* din, const float* dout, const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) din[i] = in[i] > 0.0f ? dout[i] : 0.0f;
}

}  // namespace nanoddp::kernels::cpu
