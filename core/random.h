// Generator: a seeded random stream, PyTorch's CPU generator (torch.Generator, manual_seed).
//
//   Generator gen(42);   float u = gen.uniform();   float z = gen.normal();
//
// Note [Torch's draws]
// torch's CPU generator is a 32-bit Mersenne Twister (std::mt19937) seeded with the seed's low
// 32 bits; its kernels turn each 32-bit draw into a value in a fixed way, and so does this
// class: for the same seed, uniform() gives torch.rand's float32 values, uniform(low, high)
// Tensor.uniform_(low, high)'s, randint(n) torch.randint(0, n)'s, so nn::Linear and nn::Conv2d
// start from torch's weights (nn/init.h). normal() does not give torch.randn's: torch fills 16
// values at a time with vectorised log and cos, which no scalar formula reproduces bit for bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>

namespace nanoddp {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : engine_(static_cast<uint32_t>(seed)) {}
  void manual_seed(uint64_t seed) {
    engine_.seed(static_cast<uint32_t>(seed));
    has_spare_normal_ = false;
  }

  // One 32-bit draw (torch's generator->random()).
  uint32_t random() { return static_cast<uint32_t>(engine_()); }
  // Two draws, the first the high word (torch's generator->random64()).
  uint64_t random64() {
    const uint64_t high = random();
    return (high << 32) | random();
  }
  // Uniform in [0, 1): the low 24 bits of one draw times 2^-24, every value exact in float32.
  float uniform() { return static_cast<float>(random() & 0xFFFFFFu) * (1.0f / 16777216.0f); }
  // Uniform in [low, high): uniform() * (high - low) + low with one rounding, as torch's
  // uniform_ computes it in the AVX2 and AVX-512 kernels it picks on any CPU that has them.
  // Its default kernel (a CPU without AVX2, or ATEN_CPU_CAPABILITY=default) rounds twice:
  // about 4 values in 10 then differ by one ulp.
  float uniform(float low, float high) { return std::fma(uniform(), high - low, low); }
  // Integer in [0, n), n > 0 (ValueError otherwise): one draw modulo n, or two (random64) for
  // n >= 2^32, as torch.randint. The modulo favours small residues by at most n / 2^32.
  uint64_t randint(uint64_t n);
  // Standard normal: Box-Muller in double on two 53-bit uniforms, the second value kept for
  // the next call. Not torch.randn's values (Note [Torch's draws]).
  float normal();

 private:
  std::mt19937 engine_;
  bool has_spare_normal_ = false;
  double spare_normal_ = 0.0;
};

// The process-wide default generator (torch.manual_seed seeds it), seeded with 0 at start
// (torch's starts from another fixed seed). Not thread-safe.
Generator& default_generator();
void manual_seed(uint64_t seed);

}  // namespace nanoddp
