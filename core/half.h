// 16-bit floats: IEEE half (float16) and bfloat16, as storage types for communication and
// for autocast's low-precision outputs.
//
//   Float16 h = Float16::from_float(0.1f);       // rounded to nearest, ties to even
//   float back = h.to_float();                   // 0.0999755859375f, exactly
//   BFloat16 b = BFloat16::from_float(1.0f / 3);  // 8 bits of mantissa: 0.333984375f
//
// Tensors of DType::Float16 / BFloat16 hold these; kernels widen them to float32 to compute.
// DDP's compression hooks (dist/comm_hooks.h) all-reduce them at half the bytes: every backend sums
// them by widening each element to float32, adding, and rounding the sum back (what Gloo's
// float16 sum and NCCL's half sum do), so a sum of N values is rounded N-1 times.
// Conversions follow torch's .to(torch.float16 / torch.bfloat16): round to nearest, ties to
// even; overflow goes to +-inf; NaN stays a NaN, but its bits may differ from torch's (a
// payload kept; a signalling float16 NaN widened to a signalling float32 one, which torch
// quiets).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace nanoddp {

namespace half_detail {
inline uint32_t bits_of(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  return x;
}
inline float float_of(uint32_t x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
}  // namespace half_detail

// IEEE 754 binary16: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits. Largest finite
// value 65504; smallest subnormal 2^-24.
struct Float16 {
  uint16_t bits = 0;

  static Float16 from_float(float f) {
    using half_detail::bits_of;
    const uint32_t x = bits_of(f);
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    const uint32_t magnitude = x & 0x7fffffffu;
    // NaN: quieted, its payload's top bits kept, as F16C's vcvtps2ph does (so a NaN's bits do
    // not depend on whether the bulk conversion took it through F16C or through here).
    if (magnitude > 0x7f800000u)
      return {static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu))};
    // 65520 is halfway between 65504 (largest half, odd mantissa) and 65536: ties to even
    // round it, and everything above, to infinity.
    if (magnitude >= 0x477ff000u) return {static_cast<uint16_t>(sign | 0x7c00u)};
    if (magnitude < 0x38800000u) {
      // Below 2^-14: a subnormal half, m * 2^-24. Scaling by 2^24 is exact; nearbyint rounds
      // ties to even in the default rounding mode. m == 1024 is the smallest normal's pattern.
      const float m = std::nearbyint(half_detail::float_of(magnitude) * 16777216.0f);
      return {static_cast<uint16_t>(sign | static_cast<uint16_t>(m))};
    }
    // Normal: rebias the exponent (127 -> 15) and drop 13 mantissa bits, rounding; a carry
    // out of the mantissa correctly bumps the exponent.
    uint32_t h = (magnitude - (112u << 23)) >> 13;
    const uint32_t dropped = magnitude & 0x1fffu;
    if (dropped > 0x1000u || (dropped == 0x1000u && (h & 1u))) ++h;
    return {static_cast<uint16_t>(sign | h)};
  }

  float to_float() const {
    const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    const uint32_t exponent = (bits >> 10) & 0x1fu;
    const uint32_t mantissa = bits & 0x3ffu;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
      const float value = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
      return sign ? -value : value;
    }
    if (exponent == 31) return half_detail::float_of(sign | 0x7f800000u | (mantissa << 13));
    return half_detail::float_of(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
};

// bfloat16: float32's sign and 8-bit exponent with 7 mantissa bits (the top half of a float32).
struct BFloat16 {
  uint16_t bits = 0;

  static BFloat16 from_float(float f) {
    const uint32_t x = half_detail::bits_of(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((x >> 16) | 0x40u)};  // quiet NaN
    // Add just under half of the dropped unit, plus one when the kept part is odd: ties to even.
    const uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
    return {static_cast<uint16_t>(rounded >> 16)};
  }

  float to_float() const { return half_detail::float_of(static_cast<uint32_t>(bits) << 16); }
};

static_assert(sizeof(Float16) == 2 && sizeof(BFloat16) == 2, "16-bit floats are stored as their bits");

}  // namespace nanoddp
