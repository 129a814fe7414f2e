#include "core/random.h"

#include <cmath>

#include "core/error.h"

namespace nanoddp {

float Generator::normal() {
  if (has_spare_normal_) {
    has_spare_normal_ = false;
    return static_cast<float>(spare_normal_);
  }
  // u1 in (0, 1] so log(u1) is finite.
  constexpr uint64_t kLow53 = (uint64_t{1} << 53) - 1;
  const double u1 = (static_cast<double>(random64() & kLow53) + 1.0) * (1.0 / 9007199254740992.0);
  const double u2 = static_cast<double>(random64() & kLow53) * (1.0 / 9007199254740992.0);
  const double radius = std::sqrt(-2.0 * std::log(u1));
  const double angle = 2.0 * M_PI * u2;
  spare_normal_ = radius * std::sin(angle);
  has_spare_normal_ = true;
  return static_cast<float>(radius * std::cos(angle));
}

uint64_t Generator::randint(uint64_t n) {
  NANODDP_CHECK(n > 0, ValueError, "randint(n) needs n > 0");
  return n < (uint64_t{1} << 32) ? random() % n : random64() % n;
}

Generator& default_generator() {
  static Generator generator(0);
  return generator;
}

void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

}  // namespace nanoddp
