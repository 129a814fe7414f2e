// FNV-1a, 64 bits: a small, fixed, portable hash of bytes. Used where two programs (or two
// ranks) must agree on a digest: checkpoint checksums, DDP's parameter signatures, the job
// digest fashion_mnist saves in its checkpoints. Not for security.
//
//   uint64_t h = fnv1a("0.weight");
#pragma once

#include <cstdint>
#include <string_view>

namespace nanoddp {

// The standard offset basis, 0xcbf29ce484222325: fnv1a("") == 14695981039346656037.
constexpr uint64_t kFnv1aOffsetBasis = 14695981039346656037ull;

inline uint64_t fnv1a(std::string_view bytes, uint64_t offset_basis = kFnv1aOffsetBasis) {
  constexpr uint64_t kPrime = 1099511628211ull;
  uint64_t hash = offset_basis;
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= kPrime;
  }
  return hash;
}

}  // namespace nanoddp
