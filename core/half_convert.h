// Float16 arrays to and from float32 at memory speed: what DDP's fp16 compression hook and
// every backend's float16 sum spend their time in. Each element comes out exactly as
// Float16::from_float / to_float (core/half.h) give it, NaN aside: a NaN stays a NaN, and the
// hardware may quiet a signalling one.
//
//   float16_from_floats(halves, floats, n);    // halves[i] = Float16::from_float(floats[i])
//   floats_from_float16(floats, halves, n);    // floats[i] = halves[i].to_float()
//   float16_add(sums, a, b, n);                // sums[i] = from_float(a[i].to_float() + b[i].to_float())
//
// The CPU's F16C instructions (vcvtps2ph, vcvtph2ps; every x86-64 CPU with AVX2 has them)
// convert 8 elements each, rounding to nearest even exactly as from_float does. Whether the
// CPU has them is checked once, at run time, so a portable build uses them too; without them
// the loops call from_float / to_float. Internal: not installed.
#pragma once

#include <cstdint>

#include "core/half.h"

namespace nanoddp {

// halves: (n,), floats: (n,). The two may not overlap.
void float16_from_floats(Float16* halves, const float* floats, int64_t n);
void floats_from_float16(float* floats, const Float16* halves, int64_t n);
// sums, a, b: (n,). sums may be a or b (an in-place sum); no other overlap.
void float16_add(Float16* sums, const Float16* a, const Float16* b, int64_t n);

// True when the loops above run on F16C (for benchmarks and tests to say which path ran).
bool float16_uses_f16c();

}  // namespace nanoddp
