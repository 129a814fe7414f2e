// Surviving a lost rank: the store's restart rounds (Note [Restart rounds] in dist/launch.cpp)
// and `nanoddp-run --max-restarts`, with a rank killed by SIGKILL at a chosen point.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "dist/launch.h"
#include "dist/store.h"
#include "tests/subprocess.h"

using namespace nanoddp;
using namespace nanoddp::dist;
using nanoddp::testing::launcher_path;
using nanoddp::testing::lines_of;
using nanoddp::testing::run;
using nanoddp::testing::RunResult;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

TCPStoreOptions store_options(int port, bool is_server, int rank, int round, std::chrono::milliseconds timeout) {
  TCPStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.is_server = is_server;
  o.rank = rank;
  o.world_size = 2;
  o.round = round;
  o.timeout = timeout;
  return o;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string probe_path() { return nanoddp::testing::built("tests/launch_probe"); }

// "rank R of W round K sum S" lines of launch_probe restart, without the "[rank N] " prefix.
std::multiset<std::string> round_reports(const std::string& out) {
  std::multiset<std::string> reports;
  for (const std::string& line : lines_of(out)) {
    const size_t at = line.find("] rank ");
    if (at != std::string::npos && contains(line, " sum ")) reports.insert(line.substr(at + 2));
  }
  return reports;
}

// The number after `key` in the first line of `out` that contains `key`; -1 when none does.
long long number_after(const std::string& out, const std::string& key) {
  const size_t at = out.find(key);
  if (at == std::string::npos) return -1;
  return std::atoll(out.c_str() + at + key.size());
}

}  // namespace

TEST_CASE("store rounds: a rank of an earlier start is refused at once, a later one waits for its round") {
  TCPStore server(store_options(0, true, 0, 1, 5000ms));
  const int port = server.port();

  // Round 0 reaching round 1's store: a stale rank, refused without waiting.
  std::string why;
  const auto t0 = Clock::now();
  try {
    TCPStore stale(store_options(port, false, 1, 0, 5000ms));
  } catch (const TimeoutError& e) {
    why = std::string("TimeoutError: ") + e.what();
  } catch (const DistError& e) {
    why = e.what();
  }
  CHECK(Clock::now() - t0 < 2s);
  CHECK_MESSAGE(contains(why, "refused: this rank is of restart round 0 (NANODDP_RESTART_COUNT), but the group was "
                              "restarted and the store serves round 1"),
                why);

  // Round 2 reaching round 1's store that never goes: it retries, then names both rounds.
  why.clear();
  try {
    TCPStore early(store_options(port, false, 1, 2, 300ms));
  } catch (const TimeoutError& e) {
    why = e.what();
  }
  CHECK_MESSAGE(contains(why, "this rank is of restart round 2 (NANODDP_RESTART_COUNT), but the store still serves "
                              "round 1 after 300 ms"),
                why);

  // Its own round gets in and sees the store's keys.
  server.set("k", std::string("v1"));
  TCPStore member(store_options(port, false, 1, 1, 5000ms));
  CHECK(member.get_string("k") == "v1");

  std::string negative;
  try {
    TCPStore bad(store_options(port, false, 1, -1, 5000ms));
  } catch (const ValueError& e) {
    negative = e.what();
  }
  CHECK_MESSAGE(contains(negative, "store round -1 is negative"), negative);
}

TEST_CASE("store rounds: a rank of the new round that meets the old server joins the new one on the same port") {
  auto old_server = std::make_unique<TCPStore>(store_options(0, true, 0, 0, 5000ms));
  const int port = old_server->port();
  std::string value, error;
  std::thread newcomer([&] {
    try {
      TCPStore client(store_options(port, false, 1, 1, 10000ms));
      value = client.get_string("round");
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(300ms);  // the newcomer is refused by round 0 meanwhile, and retries
  old_server.reset();
  TCPStore new_server(store_options(port, true, 0, 1, 10000ms));
  new_server.set("round", std::string("1"));
  newcomer.join();
  CHECK_MESSAGE(error.empty(), error);
  CHECK(value == "1");
}

TEST_CASE("nanoddp-run --max-restarts: a rank killed with SIGKILL restarts the whole group, same ranks, new round") {
  // Rank `victim` kills itself (kill -9) after a barrier in rounds 0 and 1; round 2 ends cleanly.
  struct Setup {
    std::string backend;
    int world;
    int victim;
  };
  for (const Setup& s : {Setup{"shm", 2, 1}, Setup{"gloo", 2, 0}, Setup{"shm", 4, 2}, Setup{"gloo", 4, 3}}) {
    CAPTURE(s.backend);
    CAPTURE(s.world);
    const RunResult r = run({launcher_path(), "--max-restarts", "2", "--nproc-per-node", std::to_string(s.world),
                             "--backend", s.backend, probe_path(), "restart", std::to_string(s.victim), "2"},
                            90s);
    CHECK_MESSAGE(r.code() == 0, r.err);
    // Every round: every rank, with the same rank numbers and world size, and the all_reduce
    // of rank + 1 over all of them (W(W+1)/2): nobody of an old round joined a new one.
    std::multiset<std::string> expected;
    for (int round = 0; round <= 2; ++round)
      for (int rank = 0; rank < s.world; ++rank)
        expected.insert("rank " + std::to_string(rank) + " of " + std::to_string(s.world) + " round " +
                        std::to_string(round) + " sum " + std::to_string(s.world * (s.world + 1) / 2));
    CHECK_MESSAGE(round_reports(r.out) == expected, r.out);
    const std::string victim = "nanoddp-run: rank " + std::to_string(s.victim) + " (pid ";
    CHECK_MESSAGE(contains(r.err, victim), r.err);
    CHECK_MESSAGE(contains(r.err, "failed: killed by signal SIGKILL"), r.err);
    CHECK_MESSAGE(contains(r.err, "nanoddp-run: restarting every rank (restart 1 of 2, NANODDP_RESTART_COUNT=1)"),
                  r.err);
    CHECK_MESSAGE(contains(r.err, "nanoddp-run: restarting every rank (restart 2 of 2, NANODDP_RESTART_COUNT=2)"),
                  r.err);
    // From the kill to the restarted group's first collective (reported, not asserted: a speed
    // target belongs in benchmarks/, and this machine is shared).
    const std::string killed = "rank " + std::to_string(s.victim) + " round 0 killed at ";
    const long long kill_ms = number_after(r.out, killed);
    const long long first_ms = number_after(r.out, "rank 0 round 1 first step at ");
    REQUIRE(kill_ms > 0);
    REQUIRE(first_ms > kill_ms);
    MESSAGE(s.backend, " W=", s.world, ": kill to the restarted group's first step: ", first_ms - kill_ms, " ms");
  }
}

TEST_CASE("nanoddp-run: without restarts left, a killed rank fails the job as it does with none") {
  // --max-restarts 0 is today's behaviour: the killed rank is named, its 137 returned, no restart.
  const RunResult none = run(
      {launcher_path(), "--nproc-per-node", "2", "--backend", "shm", probe_path(), "restart", "1", "1"}, 60s);
  CHECK_MESSAGE(none.code() == 137, none.err);
  CHECK_MESSAGE(contains(none.err, "nanoddp-run: rank 1 (pid "), none.err);
  CHECK_MESSAGE(!contains(none.err, "restart"), none.err);
  CHECK(round_reports(none.out).size() == 2);

  // One restart, and the rank dies in both rounds: the second death ends the job.
  const RunResult spent = run({launcher_path(), "--max-restarts", "1", "--nproc-per-node", "2", "--backend", "gloo",
                               probe_path(), "restart", "0", "2"},
                              60s);
  CHECK_MESSAGE(spent.code() == 137, spent.err);
  CHECK_MESSAGE(contains(spent.err, "restarting every rank (restart 1 of 1, NANODDP_RESTART_COUNT=1)"), spent.err);
  CHECK_MESSAGE(contains(spent.err, "nanoddp-run: no restart left (--max-restarts 1): the job fails"), spent.err);
  CHECK(round_reports(spent.out).size() == 4);

  // A rank that exits cleanly is never restarted.
  const RunResult clean = run({launcher_path(), "--max-restarts", "3", "--nproc-per-node", "2", "--backend", "shm",
                               probe_path(), "restart", "0", "0"},
                              60s);
  CHECK_MESSAGE(clean.code() == 0, clean.err);
  CHECK_MESSAGE(!contains(clean.err, "restarting"), clean.err);
  CHECK(round_reports(clean.out).size() == 2);

  const RunResult negative = run({launcher_path(), "--max-restarts", "-1", "sh", "-c", "true"});
  CHECK(negative.code() == 2);
  CHECK_MESSAGE(contains(negative.err, "--max-restarts"), negative.err);
}

TEST_CASE("launch helpers: rank_env tells each start's ranks which restart it is") {
  LaunchOptions o;
  o.nproc_per_node = 2;
  for (int restart : {0, 3}) {
    const auto env = rank_env(o, 1, 29500, restart);
    const std::map<std::string, std::string> m(env.begin(), env.end());
    CHECK(m.at("NANODDP_RESTART_COUNT") == std::to_string(restart));
    CHECK(m.at("RANK") == "1");
  }
}
