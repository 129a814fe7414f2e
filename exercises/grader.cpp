// The exercises' grader: grader NAME... checks the ladder rungs naive, flat, overlap
// (examples/ladder/NAME.h as compiled in) and the ring (dist::ring_all_reduce as linked in)
// on 2 and 3 ranks (a divide by 2 written as a constant passes at 2 only), on Gloo and on
// shm, each check repeated 5 times to catch races. tools/exercise builds it with a learner's
// file in place of the ladder's. Prints what was expected and what came back (rank,
// parameter, value); exit 0 when all pass. The tests/ headers below include doctest; the
// grader is a program of its own, not a test suite.
#define DOCTEST_CONFIG_DISABLE
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "dist/ring.h"
#include "tests/dist_ranks.h"
#include "tests/forwarding_group.h"
#include "tests/ladder_checks.h"
#include "tests/multiprocess.h"

using namespace nanoddp;

namespace {

constexpr int kRepeats = 5;

// A ring call that left the group unusable: what to report, and no more calls.
struct RingStopped : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// What the ring must give at world ranks: element i of rank r is (r + 1) * (i + 1), 10 of
// them (not a multiple of 3); Sum, Avg, Max and Min, and int64 Sum, Max and Min; a NaN in Max
// and Min; 0, 1 and 2 elements; an int64 past 2^60; int64 Avg refused before anything is sent
// or changed; no collective is used, only send and recv (an all_gather and a local sum gives
// the right numbers without a ring), each rank sending to one neighbour; and each rank sends
// 2(N-1) parts of at most ceil(10 / N) elements, where passing the whole buffer around sends
// N-1 whole buffers (docs/ring-all-reduce.md). Throws RingStopped.
std::string ring_problems_or_stop(const std::shared_ptr<dist::ProcessGroup>& group) {
  const auto pg = std::make_shared<testing::SendCountingGroup>(group);
  const int rank = pg->rank(), world = pg->size();
  const std::string who = "rank " + std::to_string(rank) + "/" + std::to_string(world) + " ";
  // Runs the ring on t, then names what a ring must not do: call a collective of the group,
  // send to more than one rank (rank r sends to r+1 only, or to r-1 only in a ring turned the
  // other way), or send more than 2(N-1) parts of ceil(numel / N) elements.
  const auto run_ring = [&](Tensor& t, dist::ReduceOp op) {
    group->reset_counts();
    pg->sent_bytes = 0;
    pg->destinations.clear();
    const std::string call =
        who + "ring_all_reduce(" + dist::reduce_op_name(op) + ") of " + dtype_name(t.dtype()) + " ";
    try {
      dist::ring_all_reduce(*pg, t, op, std::chrono::seconds(10));  // 10 elements: ms, unless stuck
    } catch (const TimeoutError& e) {
      // The group is of no more use (shm aborts it; on Gloo every later call would wait too).
      throw RingStopped(
          call + "timed out (" + e.what() +
          "): a rank that waits for its send before posting its recv can wait for ever (a send may "
          "wait for its receiver): post the recv, then wait for both\n");
    }
    std::string found;
    const size_t part = static_cast<size_t>((t.numel() + world - 1) / world) * dtype_size(t.dtype());
    const size_t most = 2 * static_cast<size_t>(world - 1) * part;
    if (pg->sent_bytes > most)
      found += call + "sent " + std::to_string(pg->sent_bytes) + " bytes of a " + std::to_string(t.nbytes()) +
               "-byte tensor; a ring sends 2(N-1) parts of about 1/N of it, at most " + std::to_string(most) +
               " bytes here (whole buffers passed around cost N-1 times the tensor)\n";
    const int right = (rank + 1) % world, left = (rank + world - 1) % world;
    if (pg->destinations.size() > 1 || (pg->destinations.size() == 1 && *pg->destinations.begin() != right &&
                                        *pg->destinations.begin() != left)) {
      std::string ranks;
      for (int dst : pg->destinations) ranks += (ranks.empty() ? "" : ", ") + std::to_string(dst);
      found +=
          call + "sent to ranks " + ranks + "; in a ring rank r sends to one neighbour only, r+1 (or " +
          "r-1 in a ring turned the other way), so every part travels around the ring instead of straight " +
          "to its owner\n";
    }
    static_assert(dist::kNumCollectives == static_cast<int>(dist::Collective::Barrier) + 1,
                  "every collective, the barrier included, is one the ring must not call");
    for (int c = 0; c < dist::kNumCollectives; ++c) {
      const auto collective = static_cast<dist::Collective>(c);
      if (group->count(collective).calls != 0)
        found += call + "called the group's " + dist::collective_name(collective) +
                 "; the ring passes chunks to its neighbours with send and recv only\n";
    }
    return found;
  };
  const int64_t rank_sum = world * (world + 1) / 2;
  std::string problems;
  for (const dist::ReduceOp op : {dist::ReduceOp::Sum, dist::ReduceOp::Max, dist::ReduceOp::Min}) {
    std::vector<int64_t> values;
    for (int64_t i = 0; i < 10; ++i) values.push_back((rank + 1) * (i + 1));
    Tensor t = Tensor::from_vector(values);
    problems += run_ring(t, op);
    const std::vector<int64_t> got = t.to_int_vector();
    const int64_t per_rank = op == dist::ReduceOp::Max ? world : op == dist::ReduceOp::Min ? 1 : rank_sum;
    for (int64_t i = 0; i < 10; ++i)
      if (got[static_cast<size_t>(i)] != per_rank * (i + 1)) {
        problems += who + "ring_all_reduce(" + dist::reduce_op_name(op) + ") of int64: element " +
                    std::to_string(i) + " = " + std::to_string(got[static_cast<size_t>(i)]) + ", expected " +
                    std::to_string(per_rank * (i + 1)) + "\n";
        break;
      }
  }
  for (const dist::ReduceOp op :
       {dist::ReduceOp::Sum, dist::ReduceOp::Avg, dist::ReduceOp::Max, dist::ReduceOp::Min}) {
    std::vector<float> values;
    for (int i = 0; i < 10; ++i) values.push_back(static_cast<float>((rank + 1) * (i + 1)));
    Tensor t = Tensor::from_vector(values, {2, 5});
    problems += run_ring(t, op);
    const std::vector<float> got = t.to_vector();
    const float per_rank = op == dist::ReduceOp::Max ? static_cast<float>(world)
                           : op == dist::ReduceOp::Min
                               ? 1.0f
                               : static_cast<float>(rank_sum) / (op == dist::ReduceOp::Avg ? world : 1);
    for (int i = 0; i < 10; ++i) {
      const float want = per_rank * static_cast<float>(i + 1);
      if (got.size() != 10 || std::abs(got[i] - want) > 1e-4f * std::abs(want)) {
        problems += who + "ring_all_reduce(" + dist::reduce_op_name(op) + "): element " + std::to_string(i) +
                    " = " + (got.size() == 10 ? std::to_string(got[i]) : "(shape changed)") + ", expected " +
                    std::to_string(want) + "\n";
        break;
      }
    }
  }
  // NaN wins Max and Min whichever rank holds it, as in pg.all_reduce (torch.maximum):
  // element 0 is NaN on rank 0 only, element 1 on the last rank only.
  for (const dist::ReduceOp op : {dist::ReduceOp::Max, dist::ReduceOp::Min}) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    Tensor t = Tensor::from_vector(
        {rank == 0 ? nan : -2.0f, rank == world - 1 ? nan : 3.0f, static_cast<float>(rank + 1)});
    problems += run_ring(t, op);
    const std::vector<float> got = t.to_vector();
    const float want = op == dist::ReduceOp::Max ? static_cast<float>(world) : 1.0f;
    if (!std::isnan(got[0]) || !std::isnan(got[1]) || got[2] != want)
      problems +=
          who + "ring_all_reduce(" + dist::reduce_op_name(op) + ") of [" + (rank == 0 ? "nan" : "-2") + ", " +
          (rank == world - 1 ? "nan" : "3") + ", " + std::to_string(rank + 1) + "] gave [" +
          std::to_string(got[0]) + ", " + std::to_string(got[1]) + ", " + std::to_string(got[2]) +
          "], expected [nan, nan, " + std::to_string(want) + "]" +
          (got[2] == want ? ": a NaN on any rank wins (std::max(a, b) keeps a when b is NaN; test with "
                            "std::isnan)\n"
                          : "\n");
  }
  // Fewer elements than ranks, and none: some parts are empty.
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{2}}) {
    std::vector<float> values;
    for (int64_t i = 0; i < n; ++i) values.push_back(static_cast<float>((rank + 1) * (i + 1)));
    Tensor t = Tensor::from_vector(values, {n});
    problems += run_ring(t, dist::ReduceOp::Sum);
    const std::vector<float> got = t.to_vector();
    for (int64_t i = 0; i < n; ++i)
      if (got[static_cast<size_t>(i)] != static_cast<float>(rank_sum * (i + 1))) {
        problems +=
            who + "ring_all_reduce(sum) of " + std::to_string(n) + " element(s) on " + std::to_string(world) +
            " ranks: element " + std::to_string(i) + " = " + std::to_string(got[static_cast<size_t>(i)]) +
            ", expected " + std::to_string(rank_sum * (i + 1)) +
            " (with fewer elements than ranks some parts are empty: clamp each part's start and end to "
            "the tensor's size)\n";
        break;
      }
  }
  // int64 sums exactly, past what a float or a double holds; int64 has no Avg (ValueError).
  {
    const int64_t big = (int64_t{1} << 60) + 1;
    Tensor t = Tensor::from_vector(std::vector<int64_t>{big + rank});
    problems += run_ring(t, dist::ReduceOp::Sum);
    const int64_t want = big * world + world * (world - 1) / 2, got = t.to_int_vector()[0];
    if (got != want)
      problems +=
          who + "ring_all_reduce(sum) of int64 " + std::to_string(big + rank) + " gave " +
          std::to_string(got) + ", expected " + std::to_string(want) +
          (got == big + rank ? ": this one element was never reduced (is every element in some part when "
                               "the tensor is shorter than the number of ranks?)\n"
                             : " exactly: add int64 as int64, not through float or double\n");
    Tensor ints = Tensor::from_vector(std::vector<int64_t>{1, 2});
    bool refused = false;
    pg->sent_bytes = 0;
    try {
      dist::ring_all_reduce(*pg, ints, dist::ReduceOp::Avg, std::chrono::seconds(30));
    } catch (const ValueError&) {
      refused = true;
    }
    if (!refused) problems += who + "ring_all_reduce(avg) of int64 did not throw ValueError (dist/ring.h)\n";
    if (refused && (pg->sent_bytes != 0 || ints.to_int_vector() != std::vector<int64_t>{1, 2}))
      problems += who +
                  "ring_all_reduce(avg) of int64 threw ValueError after it had sent or changed the tensor "
                  "(now [" +
                  std::to_string(ints.to_int_vector()[0]) + ", " + std::to_string(ints.to_int_vector()[1]) +
                  "]): refuse it first, before any send, and leave the tensor as it was\n";
  }
  return problems;
}

std::string ring_problems(const std::shared_ptr<dist::ProcessGroup>& group) {
  try {
    return ring_problems_or_stop(group);
  } catch (const RingStopped& stopped) {
    return stopped.what();
  }
}

std::string rung_problems(const std::string& rung, const std::shared_ptr<dist::ProcessGroup>& pg) {
  // First the one check a race cannot slip past by chance (its all_reduces run at their waits).
  std::string problems = ladder_checks::in_flight_problems(rung, pg);
  if (problems.empty()) problems = ladder_checks::gradient_matches(rung, pg);
  if (problems.empty()) problems = ladder_checks::counts_match(rung, pg);
  if (problems.empty()) problems = ladder_checks::counts_match(rung, pg, /*micro_batches=*/3);
  if (problems.empty()) problems = ladder_checks::gradient_matches(rung, pg, /*micro_batches=*/3);
  if (problems.empty()) problems = ladder_checks::counts_match_after_rewrap(rung, pg);
  if (problems.empty()) problems = ladder_checks::equals_one_process(rung, pg);
  if (problems.empty()) problems = ladder_checks::frozen_layer_problems(rung, pg);
  if (problems.empty()) problems = ladder_checks::unused_parameter_problems(rung, pg);
  return problems;
}

// "" when NAME passes every check on both backends, every repeat; else the first failure.
std::string grade(const std::string& name) {
  for (const char* backend : {"gloo", "shm"}) {
    ::setenv("NANODDP_TEST_BACKEND", backend, 1);  // read by testing::join in the forked ranks
    for (int repeat = 1; repeat <= kRepeats; ++repeat) {
      // The ring at 1 rank too: nothing to send, the tensor as it is.
      for (const int world : name == "ring" ? std::vector<int>{1, 2, 3} : std::vector<int>{2, 3}) {
        const int port = testing::free_port();
        const std::string failures = testing::on_ranks(
            world,
            [&](int rank) {
              auto pg = testing::join(rank, world, port);
              const std::string problems = name == "ring" ? ring_problems(pg) : rung_problems(name, pg);
              testing::expect(problems.empty(), problems);
            },
            std::chrono::seconds(120));
        if (!failures.empty())
          return std::string(backend) + ", " + std::to_string(world) +
                 (world == 1 ? " rank, run " : " ranks, run ") + std::to_string(repeat) + " of " +
                 std::to_string(kRepeats) + ":\n" + failures;
      }
    }
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s NAME... (naive, flat, overlap, ring)\n", argv[0]);
    return 2;
  }
  // The ranks are forked from this process and share its environment: one secret for the store.
  ::setenv("NANODDP_STORE_TOKEN", "exercise-grader", 0);
  int failed = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    if (name != "naive" && name != "flat" && name != "overlap" && name != "ring") {
      std::fprintf(stderr, "%s: no exercise named %s (naive, flat, overlap, ring)\n", argv[0], name.c_str());
      return 2;
    }
    const std::string problems = grade(name);
    if (problems.empty()) {
      std::printf("%s: passed (gloo and shm, %s ranks, %d runs each)\n", name.c_str(),
                  name == "ring" ? "1, 2 and 3" : "2 and 3", kRepeats);
    } else {
      std::printf("%s: FAILED on %s", name.c_str(), problems.c_str());
      ++failed;
    }
    std::fflush(stdout);
  }
  return failed == 0 ? 0 : 1;
}
