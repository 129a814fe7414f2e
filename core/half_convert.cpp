#include "core/half_convert.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace nanoddp {

namespace {

void float16_from_floats_scalar(Float16* halves, const float* floats, int64_t n) {
  for (int64_t i = 0; i < n; ++i) halves[i] = Float16::from_float(floats[i]);
}
void floats_from_float16_scalar(float* floats, const Float16* halves, int64_t n) {
  for (int64_t i = 0; i < n; ++i) floats[i] = halves[i].to_float();
}
void float16_add_scalar(Float16* sums, const Float16* a, const Float16* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) sums[i] = Float16::from_float(a[i].to_float() + b[i].to_float());
}

#if defined(__x86_64__)
// Compiled for AVX + F16C whatever the build's -m flags; called only where the CPU has both.
#define NANODDP_F16C __attribute__((target("avx,f16c")))

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // ties to even, as from_float

NANODDP_F16C void float16_from_floats_f16c(Float16* halves, const float* floats, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(halves + i), _mm256_cvtps_ph(_mm256_loadu_ps(floats + i), kRound));
  float16_from_floats_scalar(halves + i, floats + i, n - i);
}

NANODDP_F16C void floats_from_float16_f16c(float* floats, const Float16* halves, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(floats + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + i))));
  floats_from_float16_scalar(floats + i, halves + i, n - i);
}

NANODDP_F16C void float16_add_f16c(Float16* sums, const Float16* a, const Float16* b, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    const __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(sums + i), _mm256_cvtps_ph(_mm256_add_ps(x, y), kRound));
  }
  float16_add_scalar(sums + i, a + i, b + i, n - i);
}

#endif

}  // namespace

bool float16_uses_f16c() {
#if defined(__x86_64__)
  // CPUID leaf 1 names AVX and F16C; XCR0 says the OS saves the AVX registers (bits 1 and 2).
  // Asked directly: not every compiler's __builtin_cpu_supports knows "f16c" (clang 14).
  static const bool has_f16c = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
    if ((ecx & bit_OSXSAVE) == 0 || (ecx & bit_AVX) == 0 || (ecx & bit_F16C) == 0) return false;
    unsigned xcr0_low = 0, xcr0_high = 0;
    __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
    return (xcr0_low & 0x6) == 0x6;
  }();
  return has_f16c;
#else
  return false;
#endif
}

void float16_from_floats(Float16* halves, const float* floats, int64_t n) {
#if defined(__x86_64__)
  if (float16_uses_f16c()) return float16_from_floats_f16c(halves, floats, n);
#endif
  float16_from_floats_scalar(halves, floats, n);
}

void floats_from_float16(float* floats, const Float16* halves, int64_t n) {
#if defined(__x86_64__)
  if (float16_uses_f16c()) return floats_from_float16_f16c(floats, halves, n);
#endif
  floats_from_float16_scalar(floats, halves, n);
}

void float16_add(Float16* sums, const Float16* a, const Float16* b, int64_t n) {
#if defined(__x86_64__)
  if (float16_uses_f16c()) return float16_add_f16c(sums, a, b, n);
#endif
  float16_add_scalar(sums, a, b, n);
}

}  // namespace nanoddp
