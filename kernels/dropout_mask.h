// Dropout's random numbers as a counter-based draw, shared by the CPU loop
// (kernels/cpu/elementwise.cpp) and the CUDA kernel (kernels/cuda/elementwise.cu): element i of
// a mask drawn with key gets the uniform dropout_uniform(key, i), computed where it is used, so
// a GPU draws its mask without the host and both devices give the same mask for a seed.
//
//   const uint64_t key = ...;                          // the layer's Generator's random64()
//   float u = kernels::dropout_uniform(key, i);         // in [0, 1), 24 bits
//
// The draw is splitmix64's output for state key + i * 0x9E3779B97F4A7C15 (Steele, Lea and
// Flood, "Fast splittable pseudorandom number generators", 2014): one multiply-xorshift
// finaliser of a Weyl sequence, which passes BigCrush. Its top 24 bits make the float, in
// [0, 1) on the same 2^-24 grid as Generator::uniform's.
#pragma once

#include <cstdint>

#include "kernels/host_device.h"

namespace nanoddp::kernels {

NANODDP_HOST_DEVICE inline float dropout_uniform(uint64_t key, int64_t i) {
  uint64_t z = key + (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}

}  // namespace nanoddp::kernels
