// The names --strategy and --dp take (examples/parallel_strategy.h trains through each), in a
// header of their own so that flag parsing knows them without the layers and wrappers.
#pragma once

#include <string>
#include <vector>

namespace nanoddp::examples {

// --strategy: the library's wrappers (ddp, zero1, zero2, fsdp).
inline const std::vector<std::string>& strategy_names() {
  static const std::vector<std::string> names = {"ddp", "zero1", "zero2", "fsdp"};
  return names;
}

inline const std::vector<std::string>& ladder_rung_names() {
  static const std::vector<std::string> names = {"naive", "flat", "overlap"};
  return names;
}
inline bool is_ladder_rung(const std::string& strategy) {
  for (const std::string& name : ladder_rung_names())
    if (name == strategy) return true;
  return false;
}

// --dp names the ladder's rungs in order: naive, flat, overlap (the ladder's own files), then
// buckets, zero1, fsdp (the library's DDP, DDP + ZeroRedundancyOptimizer, FSDP FULL_SHARD).
inline const std::vector<std::string>& dp_names() {
  static const std::vector<std::string> names = {"naive", "flat", "overlap", "buckets", "zero1", "fsdp"};
  return names;
}
// The strategy a --dp rung trains with: buckets is ddp, the others keep their name.
inline std::string strategy_of_dp(const std::string& dp) { return dp == "buckets" ? "ddp" : dp; }

}  // namespace nanoddp::examples
