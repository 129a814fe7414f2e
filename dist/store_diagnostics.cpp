// What a store wait that timed out says about the ranks it waited for.
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "dist/store_wire.h"

namespace nanoddp::dist::store_detail {

std::set<int> ranks_in(const std::string& note) {
  std::set<int> ranks;
  size_t begin = 0;
  while (begin < note.size()) {
    const size_t comma = note.find(',', begin);
    const long rank = std::strtol(note.substr(begin, comma - begin).c_str(), nullptr, 10);
    if (rank >= 0 && rank <= INT_MAX) ranks.insert(static_cast<int>(rank));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return ranks;
}

std::string name_ranks(const std::vector<int>& ranks) {
  constexpr size_t kNamed = 8;
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < std::min(ranks.size(), kNamed); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > kNamed) text += " and " + std::to_string(ranks.size() - kNamed) + " more";
  return text;
}

std::string who_is_missing(const std::string& arrived, int world_size) {
  if (world_size <= 0 || arrived.empty()) return "a rank did not arrive or failed before setting it";
  const std::set<int> seen = ranks_in(arrived);
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r)
    if (seen.count(r) == 0) missing.push_back(r);
  if (missing.empty())
    return "all " + std::to_string(world_size) + " ranks reached the store: one failed or is stuck before setting it";
  return name_ranks(missing) + " never reached the store: not started, or started with another MASTER_ADDR/MASTER_PORT";
}

}  // namespace nanoddp::dist::store_detail
