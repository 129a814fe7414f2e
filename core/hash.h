// FNV-1a, 64 bits: a small, fixed, portable hash of bytes. Used where two programs (or two
// ranks) must agree on a digest: checkpoint checksums, DDP's parameter signatures. Not for
// security.
//
//   uint64_t h = fnv1a("0.weight");
#pragma once

#include <cstdint>
#include <string_view>

namespace nanoddp {

inline uint64_t fnv1a(std::string_view bytes) {
  constexpr uint64_t kOffsetBasis = 1469598103934665603ull;
  constexpr uint64_t kPrime = 1099511628211ull;
  uint64_t hash = kOffsetBasis;
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= kPrime;
  }
  return hash;
}

}  // namespace nanoddp
