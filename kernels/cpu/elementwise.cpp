// CPU elementwise kernels: fill, dropout masks, conversions (bytes, 16-bit floats), binary and scalar ops, relu,
// column sums.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/half_convert.h"
#include "kernels/cpu/eigen_maps.h"
#include "kernels/dropout_mask.h"
#include "kernels/kernels.h"

namespace nanoddp::kernels::cpu {

void fill(float* out, float value, int64_t n) { vec(out, n).setConstant(value); }

void zero_bytes(void* out, size_t nbytes) {
  if (nbytes > 0) std::memset(out, 0, nbytes);
}

// Declared in nn/dropout.cpp: mask[i] = keep_scale where dropout_uniform(key, i) >= p, else 0.
void dropout_mask(float* mask, uint64_t key, float p, float keep_scale, int64_t n) {
  for (int64_t i = 0; i < n; ++i) mask[i] = dropout_uniform(key, i) >= p ? keep_scale : 0.0f;
}

// Declared in nn/clip_grad.cpp: x[i] = min(max(x[i], lo), hi), a NaN kept (torch.clamp_).
void clamp_in_place(float* x, float lo, float hi, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] != x[i] ? x[i] : std::min(std::max(x[i], lo), hi);
}

void bytes_to_unit_float(float* out, const uint8_t* in, int64_t n) {
  // A true division, as torchvision's ToTensor (byte / 255) does.
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]) / 255.0f;
}

namespace {
template <typename T>
void to_16bit(uint16_t* out, const float* in, float divisor, int64_t n) {
  if (divisor == 1.0f) {  // a plain cast (Tensor::to): x / 1 is x, so one rounding gives the same bits
    for (int64_t i = 0; i < n; ++i) out[i] = T::from_float(in[i]).bits;
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = T::from_float(T::from_float(in[i]).to_float() / divisor).bits;
}
template <typename T>
void from_16bit(float* out, const uint16_t* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = T{in[i]}.to_float();
}

// The same as to_16bit<Float16>, element for element, through the bulk conversions
// (core/half_convert.h) a block at a time: round, widen, divide, round.
void to_float16(uint16_t* out, const float* in, float divisor, int64_t n) {
  constexpr int64_t kBlock = 1024;  // a float block in L1
  float widened[kBlock];
  auto* halves = reinterpret_cast<Float16*>(out);
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t count = std::min(kBlock, n - begin);
    float16_from_floats(halves + begin, in + begin, count);
    floats_from_float16(widened, halves + begin, count);
    for (int64_t i = 0; i < count; ++i) widened[i] /= divisor;
    float16_from_floats(halves + begin, widened, count);
  }
}
}  // namespace

void float_to_16bit(uint16_t* out, const float* in, DType format, float divisor, int64_t n) {
  if (format == DType::BFloat16)
    to_16bit<BFloat16>(out, in, divisor, n);
  else
    to_float16(out, in, divisor, n);
}

void float_from_16bit(float* out, const uint16_t* in, DType format, int64_t n) {
  if (format == DType::BFloat16)
    from_16bit<BFloat16>(out, in, n);
  else
    floats_from_float16(out, reinterpret_cast<const Float16*>(in), n);
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

namespace {
// Whether 1/s is a float exactly: s = ±2^e with 2^-e a normal float. Then a * (1/s) and a / s
// are the same real number, so they round to the same float, NaN, inf and subnormals included.
bool has_exact_reciprocal(float s) {
  int exponent = 0;
  const float mantissa = std::frexp(s, &exponent);  // s = mantissa * 2^exponent, |mantissa| in [0.5, 1)
  return std::isfinite(s) && std::fabs(mantissa) == 0.5f && exponent >= -126 && exponent <= 127;  // 1/s = 2^(1 - exponent)
}
}  // namespace

void scalar_forward(float* out, const float* a, ScalarOp op, float s, int64_t n) {
  // DDP divides every gradient by world_size (Note [Averaging in the copy] in dist/reducer.cpp):
  // a vector division costs about 1.5x a multiplication here, and world sizes are often powers of two.
  if (op == ScalarOp::Mul || has_exact_reciprocal(s)) {
    vec(out, n) = vec(a, n) * (op == ScalarOp::Mul ? s : 1.0f / s);
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
  // torch.relu's clamp_min(x, 0): x unless x < 0, so NaN stays NaN and -0.0 stays -0.0.
  for (int64_t i = 0; i < n; ++i) out[i] = in[i] < 0.0f ? 0.0f : in[i];
}

void relu_backward(float* din, const float* dout, const float* in, int64_t n) {
  // Not in > 0: a NaN passes its gradient, as torch's threshold_backward (x <= 0 ? 0 : dout).
  for (int64_t i = 0; i < n; ++i) din[i] = in[i] <= 0.0f ? 0.0f : dout[i];
}

}  // namespace nanoddp::kernels::cpu
