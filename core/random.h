// Generator: a seeded random stream (torch.Generator with manual_seed).
//
//   Generator gen(42);   float u = gen.uniform();   float z = gen.normal();
//
// mt19937_64 underneath, with our own float conversions (std:: distributions differ between
// standard libraries): the same seed gives the same numbers everywhere.
#pragma once

#include <cstdint>
#include <random>

namespace nanoddp {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : engine_(seed) {}
  void manual_seed(uint64_t seed) { engine_.seed(seed); has_spare_normal_ = false; }

  uint64_t next_u64() { return engine_(); }
  // Uniform in [0, 1), 24 random bits (every value exactly representable in float32).
  float uniform() { return static_cast<float>(engine_() >> 40) * (1.0f / 16777216.0f); }
  // Uniform in [low, high).
  float uniform(float low, float high) { return low + (high - low) * uniform(); }
  // Standard normal (Box-Muller in double).
  float normal();
  // Uniform integer in [0, n), unbiased. n must be > 0.
  uint64_t randint(uint64_t n);

 private:
  std::mt19937_64 engine_;
  bool has_spare_normal_ = false;
  double spare_normal_ = 0.0;
};

// The process-wide default generator (torch.manual_seed seeds it). Not thread-safe.
Generator& default_generator();
void manual_seed(uint64_t seed);

}  // namespace nanoddp
