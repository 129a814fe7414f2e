// DistributedSampler: every rank's index list, built in one process, against hand-written
// lists, against a literal transcription of torch.utils.data.DistributedSampler.__iter__,
// and (when /usr/bin/python3 has torch) against torch itself.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "data/sampler.h"

using nanoddp::ValueError;
using nanoddp::data::DistributedSampler;
using nanoddp::data::randperm;
using Indices = std::vector<int64_t>;

namespace {

// torch/utils/data/distributed.py, transcribed step by step in its own terms (list slicing
// and repetition), starting from a given order of 0..N-1. Deliberately not the modular
// arithmetic the sampler uses.
Indices torch_rule(Indices order, int W, int rank, bool drop_last) {
  const auto N = static_cast<int64_t>(order.size());
  int64_t num_samples;
  if (drop_last && N % W != 0) {
    // math.ceil((N - W) / W) with true division; N - W may be negative.
    const double q = static_cast<double>(N - W) / W;
    num_samples = static_cast<int64_t>(std::ceil(q));
    if (num_samples < 0) num_samples = 0;  // never happens: ceil(q) > -1
  } else {
    num_samples = (N + W - 1) / W;
  }
  const int64_t total_size = num_samples * W;
  if (!drop_last) {
    const int64_t padding_size = total_size - N;
    if (padding_size <= N) {
      order.insert(order.end(), order.begin(), order.begin() + padding_size);
    } else {
      const int64_t repeats = (padding_size + N - 1) / N;  // math.ceil(padding_size / N)
      Indices repeated;
      for (int64_t r = 0; r < repeats; ++r) repeated.insert(repeated.end(), order.begin(), order.end());
      order.insert(order.end(), repeated.begin(), repeated.begin() + padding_size);
    }
  } else {
    order.resize(total_size);
  }
  REQUIRE(static_cast<int64_t>(order.size()) == total_size);
  Indices mine;
  for (int64_t k = rank; k < total_size; k += W) mine.push_back(order[k]);  // [rank:total:W]
  REQUIRE(static_cast<int64_t>(mine.size()) == num_samples);
  return mine;
}

Indices iota(int64_t n) {
  Indices v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

std::vector<Indices> all_ranks(int64_t N, int W, bool shuffle, uint64_t seed, bool drop_last, int64_t epoch) {
  std::vector<Indices> lists;
  for (int r = 0; r < W; ++r) {
    DistributedSampler s(N, W, r, shuffle, seed, drop_last);
    s.set_epoch(epoch);
    lists.push_back(s.indices());
  }
  return lists;
}

}  // namespace

TEST_CASE("hand-written lists: N not divisible by W, N < W, drop_last") {
  struct Row {
    int64_t N;
    int W;
    bool drop_last;
    std::vector<Indices> expected;  // per rank
  };
  const std::vector<Row> rows = {
      // 10 over 3: padded to 12 with 0, 1
      {10, 3, false, {{0, 3, 6, 9}, {1, 4, 7, 0}, {2, 5, 8, 1}}},
      // 10 over 3 with drop_last: cut to 9, index 9 skipped
      {10, 3, true, {{0, 3, 6}, {1, 4, 7}, {2, 5, 8}}},
      // divisible: drop_last changes nothing
      {8, 4, false, {{0, 4}, {1, 5}, {2, 6}, {3, 7}}},
      {8, 4, true, {{0, 4}, {1, 5}, {2, 6}, {3, 7}}},
      // N < W: the list repeats from its start (0 1 0 1 0)
      {2, 5, false, {{0}, {1}, {0}, {1}, {0}}},
      // N < W, repeated more than once over: 0 1 2 0 1 2 0 1
      {3, 8, false, {{0}, {1}, {2}, {0}, {1}, {2}, {0}, {1}}},
      // N < W with drop_last: nothing at all
      {3, 4, true, {{}, {}, {}, {}}},
      {0, 2, false, {{}, {}}},
      {7, 1, false, {{0, 1, 2, 3, 4, 5, 6}}},
      {7, 2, true, {{0, 2, 4}, {1, 3, 5}}},
  };
  for (const Row& row : rows) {
    CAPTURE(row.N);
    CAPTURE(row.W);
    CAPTURE(row.drop_last);
    for (int r = 0; r < row.W; ++r) {
      CAPTURE(r);
      DistributedSampler s(row.N, row.W, r, /*shuffle=*/false, 0, row.drop_last);
      CHECK(s.indices() == row.expected[r]);
      CHECK(s.num_samples() == static_cast<int64_t>(row.expected[r].size()));
      CHECK(s.total_size() == s.num_samples() * row.W);
    }
  }
}

TEST_CASE("every N, W, drop_last up to 40 x 9 matches the transcribed torch rule") {
  for (int64_t N = 0; N <= 40; ++N) {
    for (int W = 1; W <= 9; ++W) {
      for (bool drop_last : {false, true}) {
        for (int r = 0; r < W; ++r) {
          CAPTURE(N);
          CAPTURE(W);
          CAPTURE(drop_last);
          CAPTURE(r);
          DistributedSampler plain(N, W, r, false, 0, drop_last);
          REQUIRE(plain.indices() == torch_rule(iota(N), W, r, drop_last));
          // Shuffled: the same pad-and-stride structure applied to the epoch's permutation.
          DistributedSampler shuffled(N, W, r, true, 5, drop_last);
          shuffled.set_epoch(3);
          REQUIRE(shuffled.indices() == torch_rule(randperm(N, 5 + 3), W, r, drop_last));
        }
      }
    }
  }
}

TEST_CASE("lengths: ceil(N / W) without drop_last, floor(N / W) with it") {
  CHECK(DistributedSampler(60000, 7, 0, true, 0, false).num_samples() == 8572);  // 60000/7 = 8571.4
  CHECK(DistributedSampler(60000, 7, 6, true, 0, true).num_samples() == 8571);
  CHECK(DistributedSampler(60000, 7, 6, true, 0, false).total_size() == 60004);
  CHECK(DistributedSampler(60000, 7, 6, true, 0, true).total_size() == 59997);
}

TEST_CASE("lengths near 2^63 do not wrap: exact, or a ValueError when the padded total cannot fit") {
  const int64_t max = INT64_MAX;  // 9223372036854775807 = 2 * 4611686018427387903 + 1
  // ceil(N / W) formed as (N + W - 1) / W would wrap negative here.
  CHECK(DistributedSampler(max, 1, 0, false, 0, false).num_samples() == max);
  CHECK(DistributedSampler(max, 2, 1, false, 0, true).num_samples() == 4611686018427387903);
  CHECK(DistributedSampler(max, 2, 1, false, 0, true).total_size() == max - 1);
  CHECK(DistributedSampler::for_evaluation(max, 2, 0).num_samples() == 4611686018427387904);
  // Padding to 2 * 4611686018427387904 = 2^63 does not fit in int64.
  CHECK_THROWS_AS(DistributedSampler(max, 2, 0, false, 0, false), ValueError);
}

TEST_CASE("randperm is a permutation, fixed by its seed") {
  for (int64_t n : {0, 1, 2, 17, 1000}) {
    Indices p = randperm(n, 42);
    CHECK(p == randperm(n, 42));
    Indices sorted = p;
    std::sort(sorted.begin(), sorted.end());
    CHECK(sorted == iota(n));
  }
  CHECK(randperm(1000, 1) != randperm(1000, 2));
  CHECK(randperm(1000, 1) != iota(1000));
}

// Values printed by torch 1.13: g = torch.Generator(); g.manual_seed(seed);
// torch.randperm(n, generator=g).tolist().
TEST_CASE("randperm draws torch.randperm's values for the same seed") {
  CHECK(randperm(10, 0) == Indices{4, 1, 7, 5, 3, 9, 0, 8, 6, 2});
  CHECK(randperm(10, 7) == Indices{5, 0, 3, 4, 1, 7, 9, 6, 8, 2});
  CHECK(randperm(3, 1) == Indices{1, 2, 0});
  CHECK(randperm(2, 0) == Indices{0, 1});
  CHECK(randperm(1, 5) == Indices{0});
  CHECK(randperm(0, 5).empty());
  // torch seeds its 32-bit engine with the seed's low 32 bits (manual_seed(2**64 - 1) and
  // manual_seed(2**32 - 1) give the same permutation, 4294967296 the same as 0).
  CHECK(randperm(10, UINT64_MAX) == Indices{1, 4, 6, 2, 0, 5, 8, 7, 9, 3});
  CHECK(randperm(10, uint64_t{1} << 32) == randperm(10, 0));
  // Fashion-MNIST's size: the ends, and sum(i * p[i]) mod 1000003 over the whole list.
  const Indices p = randperm(60000, 0);
  CHECK(Indices(p.begin(), p.begin() + 5) == Indices{36044, 10678, 57327, 55074, 21567});
  CHECK(Indices(p.end() - 5, p.end()) == Indices{6024, 6465, 31951, 27130, 1544});
  int64_t weighted = 0;
  for (size_t i = 0; i < p.size(); ++i) weighted = (weighted + static_cast<int64_t>(i) * p[i]) % 1000003;
  CHECK(weighted == 597165);
  CHECK_THROWS_AS(randperm(-1, 0), ValueError);
}

// torch 1.13: DistributedSampler(range(N), num_replicas=W, rank=r, shuffle=True, seed=seed,
// drop_last=d), set_epoch(epoch), list(sampler).
TEST_CASE("shuffled lists are torch's DistributedSampler's, value for value") {
  const auto lists = [](int64_t N, int W, uint64_t seed, int64_t epoch, bool drop_last) {
    return all_ranks(N, W, /*shuffle=*/true, seed, drop_last, epoch);
  };
  CHECK(lists(10, 3, 0, 1, false) == std::vector<Indices>{{5, 2, 9, 4}, {6, 0, 3, 5}, {1, 8, 7, 6}});
  CHECK(lists(10, 3, 0, 1, true) == std::vector<Indices>{{5, 2, 9}, {6, 0, 3}, {1, 8, 7}});
  CHECK(lists(7, 2, 42, 0, false) == std::vector<Indices>{{1, 3, 4, 2}, {6, 5, 0, 1}});
  CHECK(lists(5, 4, (uint64_t{1} << 40) + 3, 2, false) ==
        std::vector<Indices>{{1, 2}, {3, 1}, {0, 3}, {4, 0}});
}

TEST_CASE("shuffle: one permutation shared by all ranks, a new one each epoch, all indices covered") {
  const int64_t N = 103;
  const int W = 4;
  std::vector<Indices> previous;
  for (int64_t epoch = 0; epoch < 4; ++epoch) {
    CAPTURE(epoch);
    const std::vector<Indices> lists = all_ranks(N, W, true, 7, false, epoch);
    // Interleaving the ranks back gives the padded permutation: same on every rank.
    const Indices perm = randperm(N, 7 + epoch);
    Indices interleaved;
    for (int64_t k = 0; k < 26; ++k)
      for (int r = 0; r < W; ++r) interleaved.push_back(lists[r][k]);
    for (int64_t k = 0; k < 104; ++k) REQUIRE(interleaved[k] == perm[k % N]);
    // Union covers all; exactly one index (the padding: perm[0]) appears twice.
    std::map<int64_t, int> count;
    for (const Indices& l : lists)
      for (int64_t i : l) ++count[i];
    CHECK(count.size() == static_cast<size_t>(N));
    CHECK(count[perm[0]] == 2);
    // A different epoch gives a different order on every rank.
    if (!previous.empty())
      for (int r = 0; r < W; ++r) CHECK(lists[r] != previous[r]);
    previous = lists;
  }
  // Building the sampler again (another process, same arguments) gives the same lists.
  CHECK(all_ranks(N, W, true, 7, false, 2) == all_ranks(N, W, true, 7, false, 2));
  // A different seed, a different order.
  CHECK(all_ranks(N, W, true, 8, false, 2) != all_ranks(N, W, true, 7, false, 2));
}

TEST_CASE("shuffle with drop_last: ranks disjoint, N mod W indices skipped") {
  const std::vector<Indices> lists = all_ranks(50, 8, true, 0, true, 1);
  std::set<int64_t> seen;
  for (const Indices& l : lists) {
    CHECK(l.size() == 6u);
    for (int64_t i : l) CHECK(seen.insert(i).second);
  }
  CHECK(seen.size() == 48u);
}

TEST_CASE("evaluation sampler: every example exactly once, ranks differ by at most one") {
  for (int64_t N : {0, 1, 2, 9, 10, 11, 10000}) {
    for (int W : {1, 2, 3, 5, 16}) {
      CAPTURE(N);
      CAPTURE(W);
      std::vector<int> count(N, 0);
      int64_t smallest = N, largest = 0;
      for (int r = 0; r < W; ++r) {
        const DistributedSampler s = DistributedSampler::for_evaluation(N, W, r);
        CHECK(s.is_evaluation());
        CHECK(s.total_size() == N);
        const Indices l = s.indices();
        CHECK(static_cast<int64_t>(l.size()) == s.num_samples());
        smallest = std::min<int64_t>(smallest, l.size());
        largest = std::max<int64_t>(largest, l.size());
        for (int64_t i : l) ++count[i];
      }
      CHECK(std::all_of(count.begin(), count.end(), [](int c) { return c == 1; }));
      CHECK(largest - smallest <= 1);
    }
  }
  // Hand-written: 10 over 3, and N < W (ranks past N get nothing).
  CHECK(DistributedSampler::for_evaluation(10, 3, 0).indices() == Indices{0, 3, 6, 9});
  CHECK(DistributedSampler::for_evaluation(10, 3, 1).indices() == Indices{1, 4, 7});
  CHECK(DistributedSampler::for_evaluation(10, 3, 2).indices() == Indices{2, 5, 8});
  CHECK(DistributedSampler::for_evaluation(2, 5, 1).indices() == Indices{1});
  CHECK(DistributedSampler::for_evaluation(2, 5, 4).indices().empty());
}

TEST_CASE("bad rank, world size or size: ValueError that names them") {
  auto message = [](auto&& make) {
    try {
      make();
    } catch (const ValueError& e) {
      return std::string(e.what());
    }
    return std::string("no ValueError");
  };
  CHECK(message([] { DistributedSampler(10, 2, 2); }).find("rank 2 is outside [0, num_replicas) = [0, 2)") !=
        std::string::npos);
  CHECK(message([] { DistributedSampler(10, 2, -1); }).find("rank -1") != std::string::npos);
  CHECK(message([] { DistributedSampler(10, 0, 0); }).find("num_replicas must be >= 1, got 0") !=
        std::string::npos);
  CHECK(message([] { DistributedSampler(-3, 2, 0); }).find("size must be >= 0, got -3") != std::string::npos);
  CHECK(message([] { DistributedSampler::for_evaluation(10, 4, 4); }).find("rank 4") != std::string::npos);
}

TEST_CASE("against torch.utils.data.DistributedSampler itself (skipped without torch)") {
  // (N, W, drop_last) cases; torch prints one line of indices per rank.
  const std::vector<std::tuple<int, int, bool>> cases = {{10, 3, false}, {10, 3, true}, {2, 5, false},
                                                         {3, 8, false},  {3, 4, true},  {13, 4, false},
                                                         {13, 4, true}};
  std::ostringstream script;
  script << "/usr/bin/python3 -c \"\nimport sys\ntry:\n import torch\n"
            " from torch.utils.data import DistributedSampler\nexcept Exception:\n sys.exit(3)\n"
            "for n, w, d in [";
  for (const auto& [N, W, drop_last] : cases)
    script << "(" << N << "," << W << "," << (drop_last ? "True" : "False") << "),";
  script << "]:\n for r in range(w):\n  s = DistributedSampler(range(n), num_replicas=w, rank=r, "
            "shuffle=False, drop_last=d)\n  print(' '.join(map(str, s)) + ' .')\n\" 2>/dev/null";
  FILE* pipe = popen(script.str().c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string out;
  char buffer[4096];
  while (fgets(buffer, sizeof buffer, pipe) != nullptr) out += buffer;
  const int status = pclose(pipe);
  if (status != 0) {
    MESSAGE("skipped: /usr/bin/python3 with torch is not available");
    return;
  }
  std::istringstream lines(out);
  for (const auto& one_case : cases) {
    // Plain variables, not structured bindings: CAPTURE's lambdas cannot capture those (C++17).
    const int N = std::get<0>(one_case), W = std::get<1>(one_case);
    const bool drop_last = std::get<2>(one_case);
    for (int r = 0; r < W; ++r) {
      CAPTURE(N);
      CAPTURE(W);
      CAPTURE(drop_last);
      CAPTURE(r);
      std::string line;
      REQUIRE(std::getline(lines, line));
      std::istringstream words(line);
      Indices expected;
      std::string word;
      while (words >> word && word != ".") expected.push_back(std::stoll(word));
      CHECK(DistributedSampler(N, W, r, false, 0, drop_last).indices() == expected);
    }
  }
}
