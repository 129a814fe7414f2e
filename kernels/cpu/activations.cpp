// CPU kernels of the pointwise activations in nn/activations.h (declared there), as Eigen
// array expressions: vectorised, including tanh, exp and erf.
//
// Note [Vectorised exp's range]
// Two things about Eigen 3.4 shape these kernels. Its vectorised exp agrees with std::exp only
// inside about [-87, 88]: past that it clamps the argument or flushes to 0, by instruction set
// (AVX2 builds give a tiny positive number for exp(-100) and exp(-inf), where std::exp gives a
// subnormal or 0; an AVX-512 build gives 0 for exp(-88), where std::exp does not), so a product
// with a large x reads as a real value. And a select() anywhere in an expression makes the
// whole expression scalar (Eigen 3.4's Select has no packet path): erf and exp then run element
// by element, 8 to 10 times slower. So the formula runs vectorised over every element, and the
// few elements outside [-80, 80] (or past a threshold) are redone by a scalar loop with
// std::exp, after one vectorised min/max pass says whether there are any.
#include <algorithm>
#include <cmath>
#include <limits>
#include <unsupported/Eigen/SpecialFunctions>

#include "kernels/activation_constants.h"
#include "kernels/cpu/eigen_maps.h"  // first of the Eigen headers: its GCC pragma must come first

namespace nanoddp::kernels::cpu {

// Arguments of the vectorised exp that give std::exp's value (Note [Vectorised exp's range]),
// with a margin; and the |x| up to which GELU's exp(-x^2 / 2) stays inside them.
constexpr float kExpExactAbs = 80.0f;
constexpr float kGeluExpExactAbs = 12.6f;
static_assert(kGeluExpExactAbs * kGeluExpExactAbs / 2 <= kExpExactAbs, "exp(-x^2 / 2) must stay in range");

namespace {

// Calls redo(i) for every i with x[i] outside [low, high], NaN included (it stays NaN). Each
// block of 64 elements is first tested in one vectorised pass (comparisons ORed, no branch),
// and only a block with such an element is looked at one element at a time: GELU's lower tail
// starts at x = -3, which 0.1% of a normal batch is below, spread over most of its blocks.
template <typename Redo>
void redo_outside(const float* x, int64_t n, float low, float high, Redo redo) {
  constexpr int64_t kBlock = 64;
  for (int64_t first = 0; first < n; first += kBlock) {
    const int64_t last = std::min(n, first + kBlock);
    int outside = 0;
    for (int64_t i = first; i < last; ++i) outside |= (x[i] < low) | (x[i] > high) | (x[i] != x[i]);
    if (outside == 0) continue;
    for (int64_t i = first; i < last; ++i)
      if (!(x[i] >= low && x[i] <= high)) redo(i);
  }
}

// The same for |x[i]| > limit.
template <typename Redo>
void redo_outside(const float* x, int64_t n, float limit, Redo redo) {
  redo_outside(x, n, -limit, limit, redo);
}

}  // namespace

// ---- sigmoid ------------------------------------------------------------------------------

void sigmoid_forward(float* y, const float* x, int64_t n) {
  // 1 / (1 + e^-x): e^-x overflows to inf for x < -88 and the quotient is then exactly 0.
  vec(y, n).array() = (1.0f + (-vec(x, n).array()).exp()).inverse();
}

void sigmoid_backward(float* dx, const float* dy, const float* y, int64_t n) {
  const auto s = vec(y, n).array();
  vec(dx, n).array() = vec(dy, n).array() * s * (1.0f - s);
}

// ---- tanh ---------------------------------------------------------------------------------

// Eigen's vectorised tanh gives exactly +-1 from |x| = 8, where float32's tanh is still 4 units
// below 1 up to |x| = 9.01: the gradient 1 - y^2 read from it would be 0 instead of 4.8e-7
// (torch's). Past |x| = 7.5 the scalar std::tanh redoes those few elements.
constexpr float kTanhVectorisedAbs = 7.5f;

void tanh_forward(float* y, const float* x, int64_t n) {
  vec(y, n).array() = vec(x, n).array().tanh();
  redo_outside(x, n, kTanhVectorisedAbs, [&](int64_t i) { y[i] = std::tanh(x[i]); });
}

void tanh_backward(float* dx, const float* dy, const float* y, int64_t n) {
  vec(dx, n).array() = vec(dy, n).array() * (1.0f - vec(y, n).array().square());
}

// ---- gelu ---------------------------------------------------------------------------------

// Note [GELU's lower tail]
// The exact GELU is x Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2. Below x = -3, 1 + erf is 1
// minus nearly 1: Eigen's vectorised erf is off by a unit or two of float32 near -1, which gives
// values like +3.4e-7 at x = -5.62 (float64's is -5.3e-8; torch's erf rounds to -1 there and
// gives 0). There Phi(x) = erfc(-x / sqrt 2) / 2, in which nothing cancels, keeps its digits:
// std::erfc (Eigen has no vectorised erfc) for those elements only.
constexpr float kGeluErfExactLow = -3.0f;
constexpr float kInf = std::numeric_limits<float>::infinity();

inline float gelu_normal_cdf(float x) { return 0.5f * std::erfc(-x * kSqrt1_2); }

// Note [GELU's tanh form]
// x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), is x s(2u) with s the logistic
// function: x / (1 + e^(-2u)). Written so, nothing cancels: below x = -3, where 1 + tanh(u)
// is 1 minus nearly 1, the quotient keeps every digit, and the gradient
// s + 2 x u' e s^2 (e = e^(-2u)) does too, where the tanh form gives 0 below x = -4.8
// (the float64 value at -4.875 is -3.4e-6). torch computes the tanh form, so it differs from
// this in the last digits, and in the tails by its own rounding noise. |2u| <= 80 holds for
// |x| <= 9.6: inside the vectorised exp's exact range, and e^(-2u) stays finite. Past it the
// scalar loop runs kernels::gelu_tanh_value and gelu_tanh_slope (kernels/activation_constants.h),
// the CUDA kernels' form, which never overflows. The float32 rounding of u itself is amplified
// by the exp: the result's relative error grows like |2u| roundings, as any float32 form's.
constexpr float kGeluTanhExpExactAbs = 9.6f;
static_assert(2.0f * kSqrt2OverPi *
                      (kGeluTanhExpExactAbs +
                       kGeluCubic * kGeluTanhExpExactAbs * kGeluTanhExpExactAbs * kGeluTanhExpExactAbs) <=
                  kExpExactAbs,
              "e^(-2u) must stay in the vectorised exp's exact range");

void gelu_forward(float* y, const float* x, bool tanh_approximation, int64_t n) {
  const auto v = vec(x, n).array();
  if (tanh_approximation) {
    vec(y, n).array() = v / (1.0f + (-2.0f * kSqrt2OverPi * (v + kGeluCubic * v.cube())).exp());
    redo_outside(x, n, kGeluTanhExpExactAbs, [&](int64_t i) { y[i] = gelu_tanh_value(x[i]); });
  } else {
    vec(y, n).array() = 0.5f * v * (1.0f + (v * kSqrt1_2).erf());
    redo_outside(x, n, kGeluErfExactLow, kInf, [&](int64_t i) { y[i] = x[i] * gelu_normal_cdf(x[i]); });
  }
}

void gelu_backward(float* dx, const float* dy, const float* x, bool tanh_approximation, int64_t n) {
  const auto v = vec(x, n).array();
  const auto g = vec(dy, n).array();
  if (tanh_approximation) {
    // d/dx [x s(2u)] = s + 2 x u' e s^2, e = e^(-2u), s = 1 / (1 + e), u' = sqrt(2/pi)(1 + 3c x^2)
    // (Note [GELU's tanh form]).
    const Eigen::ArrayXf e = (-2.0f * kSqrt2OverPi * (v + kGeluCubic * v.cube())).exp();
    const auto s = (1.0f + e).inverse();
    vec(dx, n).array() = g * (s + 2.0f * v * kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * v.square()) *
                                      (e * s) * s);  // s^2 underflows
    redo_outside(x, n, kGeluTanhExpExactAbs, [&](int64_t i) { dx[i] = dy[i] * gelu_tanh_slope(x[i]); });
  } else {
    // d/dx [x Phi(x)] = Phi(x) + x phi(x). Below x = -3 Phi comes from erfc (Note [GELU's
    // lower tail]); past |x| = 12.6, phi's exp(-x^2 / 2) is outside the vectorised exp's exact
    // range (Note [Vectorised exp's range]). Both run the scalar formula: at x = +-inf,
    // x phi(x) is inf * 0 = NaN, as torch's (and the CUDA kernel's).
    vec(dx, n).array() =
        g * (0.5f * (1.0f + (v * kSqrt1_2).erf()) + v * kInvSqrt2Pi * (-0.5f * v.square()).exp());
    redo_outside(x, n, kGeluErfExactLow, kGeluExpExactAbs, [&](int64_t i) {
      dx[i] = dy[i] * (gelu_normal_cdf(x[i]) + x[i] * kInvSqrt2Pi * std::exp(-0.5f * x[i] * x[i]));
    });
  }
}

// ---- softplus -----------------------------------------------------------------------------

// Past the threshold softplus is x (its gradient dy), as torch's. Elsewhere the vectorised
// formula holds while beta x is inside the exact range of the vectorised exp (Note [Vectorised
// exp's range]); outside it (and for NaN) the scalar formula runs.
namespace {
bool softplus_vectorised_exact(float bx) { return bx >= -kExpExactAbs && bx <= kExpExactAbs; }
// Whether no element needs the scalar loop: every beta x inside the exact range and not past
// the threshold (false for NaN).
bool softplus_all_vectorised(const float* x, float beta, float threshold, int64_t n) {
  if (n == 0) return true;
  const auto bx = vec(x, n).array() * beta;
  return bx.maxCoeff<Eigen::PropagateNaN>() <= std::min(threshold, kExpExactAbs) &&
         bx.minCoeff<Eigen::PropagateNaN>() >= -kExpExactAbs;
}
}  // namespace

void softplus_forward(float* y, const float* x, float beta, float threshold, int64_t n) {
  vec(y, n).array() = (vec(x, n).array() * beta).exp().log1p() / beta;
  if (softplus_all_vectorised(x, beta, threshold, n)) return;
  for (int64_t i = 0; i < n; ++i) {
    const float bx = x[i] * beta;
    if (bx > threshold)
      y[i] = x[i];
    else if (!softplus_vectorised_exact(bx))
      y[i] = std::log1p(std::exp(bx)) / beta;
  }
}

// dy z / (z + 1), z = e^(beta x), as torch's softplus_backward: at beta x past 88.7 (under
// the threshold) z is inf and the gradient NaN, as there.
void softplus_backward(float* dx, const float* dy, const float* x, float beta, float threshold, int64_t n) {
  vec(dx, n).array() = (vec(x, n).array() * beta).exp();  // z, in place: no temporary
  vec(dx, n).array() = vec(dy, n).array() * vec(dx, n).array() / (vec(dx, n).array() + 1.0f);
  if (softplus_all_vectorised(x, beta, threshold, n)) return;
  for (int64_t i = 0; i < n; ++i) {
    const float bx = x[i] * beta;
    if (bx > threshold) {
      dx[i] = dy[i];
    } else if (!softplus_vectorised_exact(bx)) {
      const float e = std::exp(bx);
      dx[i] = dy[i] * e / (e + 1.0f);
    }
  }
}

}  // namespace nanoddp::kernels::cpu
