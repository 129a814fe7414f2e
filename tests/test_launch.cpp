// The launcher (nanoddp-run, dist::launch) and dist::spawn, run for real: 2-4 ranks of `sh -c`
// commands, their output and env, early exits, signal deaths, Ctrl-C, the mpirun path, and a
// check that no process of any rank is left afterwards.
#include <dirent.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/trace.h"
#include "dist/init.h"
#include "dist/launch.h"
#include "dist/launcher_link.h"
#include "dist/spawn.h"
#include "kernels/device_memory.h"
#include "kernels/kernels.h"
#include "tests/subprocess.h"

namespace dist = nanoddp::dist;
namespace trace = nanoddp::trace;
using nanoddp::testing::launcher_path;
using nanoddp::testing::lines_of;
using nanoddp::testing::read_file;
using nanoddp::testing::run;
using nanoddp::testing::RunResult;
using nanoddp::testing::TempDir;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

// Waits (up to 5 s) until ranks 0..n-1 have written their pid files into dir.
void wait_for_ranks(const std::string& dir, int n) {
  for (int i = 0; i < 2500; ++i) {
    int up = 0;
    for (int rank = 0; rank < n; ++rank) up += !read_file(dir + "/pid." + std::to_string(rank)).empty();
    if (up == n) return;
    std::this_thread::sleep_for(2ms);
  }
}

// The state letter of /proc/PID/stat ('R', 'S', 'T' for stopped, ...); 0 when it is gone.
char process_state(int pid) {
  const std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? 0 : stat[paren + 2];
}

// Waits (up to 10 s) until process pid is in state `state`; true when it got there.
bool reaches_state(int pid, char state) {
  for (int i = 0; i < 1000; ++i) {
    if (process_state(pid) == state) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

// Live (not zombie) processes whose process group is one of `pgids`, or whose pid is.
std::vector<int> survivors(const std::set<int>& ids) {
  std::vector<int> alive;
  DIR* proc = opendir("/proc");
  REQUIRE(proc != nullptr);
  while (dirent* e = readdir(proc)) {
    const int pid = std::atoi(e->d_name);
    if (pid <= 0) continue;
    const std::string stat = read_file("/proc/" + std::string(e->d_name) + "/stat");
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream fields(stat.substr(paren + 2));
    char state = 0;
    int ppid = 0, pgrp = 0;
    fields >> state >> ppid >> pgrp;
    if (state == 'Z' || state == 'X') continue;
    if (ids.count(pid) || ids.count(pgrp)) alive.push_back(pid);
  }
  closedir(proc);
  return alive;
}

// The pids the ranks wrote into dir (files pid.*); each rank's shell leads its own group, so
// these are also the pgids to look for. A file the shell created but never wrote (its rank
// was killed in between) holds no pid.
std::set<int> written_pids(const std::string& dir) {
  std::set<int> pids;
  DIR* d = opendir(dir.c_str());
  REQUIRE(d != nullptr);
  while (dirent* e = readdir(d))
    if (std::string(e->d_name).rfind("pid.", 0) == 0) {
      const int pid = std::atoi(read_file(dir + "/" + e->d_name).c_str());
      if (pid > 0) pids.insert(pid);
    }
  closedir(d);
  return pids;
}

std::set<int> recorded_pids(const std::string& dir, size_t expected) {
  std::set<int> pids = written_pids(dir);
  CHECK(pids.size() == expected);
  return pids;
}

void check_nothing_left(const std::set<int>& pids) {
  // Reparented leftovers die from SIGKILL asynchronously; give the kernel a moment.
  std::vector<int> alive = survivors(pids);
  for (int i = 0; i < 100 && !alive.empty(); ++i) {
    std::this_thread::sleep_for(20ms);
    alive = survivors(pids);
  }
  CHECK_MESSAGE(alive.empty(), alive.size(), " process(es) of the ranks are still alive, first pid ",
                alive.empty() ? 0 : alive[0]);
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
bool ends_with(const std::string& text, const std::string& tail) {
  return text.size() >= tail.size() && text.compare(text.size() - tail.size(), tail.size(), tail) == 0;
}

bool on_path(const std::string& program) {
  return std::system(("command -v " + program + " > /dev/null 2>&1").c_str()) == 0;
}

std::string probe_path() { return nanoddp::testing::built("tests/launch_probe"); }

}  // namespace

TEST_CASE("nanoddp-run: every rank gets its env, output is prefixed per stream") {
  for (int world : {2, 4}) {
    CAPTURE(world);
    const RunResult r = run({launcher_path(), "--nproc-per-node", std::to_string(world), "--backend", "gloo", "sh",
                             "-c",
                             "echo out $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR "
                             "$MASTER_PORT $NANODDP_BACKEND; echo err $RANK >&2; printf 'tail %s' $RANK"});
    REQUIRE(r.code() == 0);
    std::map<int, std::vector<std::string>> by_rank;  // rank -> the words of its "out" line
    std::set<std::string> ports, tails, errs;
    for (const std::string& line : lines_of(r.out)) {
      std::istringstream words(line);
      std::string tag, rank_word, kind;
      words >> tag >> rank_word >> kind;
      REQUIRE_MESSAGE(tag == "[rank", "unprefixed stdout line: ", line);
      const int rank = std::stoi(rank_word);  // "1]" -> 1
      REQUIRE(rank_word == std::to_string(rank) + "]");
      if (kind == "tail") {  // the last line had no '\n' and still came out, once
        std::string n;
        words >> n;
        CHECK(n == std::to_string(rank));
        tails.insert(n);
        continue;
      }
      REQUIRE(kind == "out");
      std::vector<std::string> values;
      for (std::string v; words >> v;) values.push_back(v);
      REQUIRE(values.size() == 8);
      by_rank[rank] = values;
    }
    REQUIRE(by_rank.size() == static_cast<size_t>(world));
    CHECK(tails.size() == static_cast<size_t>(world));
    for (const auto& [rank, v] : by_rank) {
      CHECK(v[0] == std::to_string(rank));   // RANK matches the prefix
      CHECK(v[1] == std::to_string(world));  // WORLD_SIZE
      CHECK(v[2] == std::to_string(rank));   // LOCAL_RANK (one node)
      CHECK(v[3] == std::to_string(world));  // LOCAL_WORLD_SIZE
      CHECK(v[4] == "0");                    // GROUP_RANK
      CHECK(v[5] == "127.0.0.1");
      CHECK(v[7] == "gloo");
      ports.insert(v[6]);
    }
    REQUIRE(ports.size() == 1);  // one port for everybody, picked free (not 0)
    const int port = std::stoi(*ports.begin());
    CHECK(port > 0);
    CHECK(port < 65536);
    // stderr kept apart: exactly one "err" line per rank there, none on stdout.
    for (const std::string& line : lines_of(r.err)) errs.insert(line);
    for (int rank = 0; rank < world; ++rank) CHECK(errs.count("[rank " + std::to_string(rank) + "] err " + std::to_string(rank)) == 1);
    CHECK_FALSE(contains(r.out, "err"));
  }
}

TEST_CASE("nanoddp-run: OMP_NUM_THREADS is 1 in each of several ranks unless set, as torchrun sets it") {
  const std::string launcher = launcher_path();
  const RunResult unset = run({"/usr/bin/env", "-u", "OMP_NUM_THREADS", launcher, "--nproc-per-node", "2",
                               "sh", "-c", "echo threads=$OMP_NUM_THREADS"});
  REQUIRE(unset.code() == 0);
  CHECK(contains(unset.out, "[rank 0] threads=1"));
  CHECK(contains(unset.out, "[rank 1] threads=1"));
  const RunResult own = run({"/usr/bin/env", "OMP_NUM_THREADS=3", launcher, "--nproc-per-node", "2", "sh",
                             "-c", "echo threads=$OMP_NUM_THREADS"});
  CHECK(contains(own.out, "[rank 0] threads=3"));
  CHECK(contains(own.out, "[rank 1] threads=3"));
  const RunResult one = run({"/usr/bin/env", "-u", "OMP_NUM_THREADS", launcher, "--nproc-per-node", "1", "sh",
                             "-c", "echo threads=$OMP_NUM_THREADS"});
  CHECK(contains(one.out, "[rank 0] threads=\n"));  // one rank keeps every core
}

TEST_CASE("nanoddp-run: flags after PROGRAM belong to PROGRAM; a fixed port and node rank are used") {
  const RunResult r = run({launcher_path(), "--nproc-per-node", "2", "--nnodes", "3", "--node-rank", "2",
                           "--master-port", "29517", "sh", "-c", "echo $RANK $WORLD_SIZE $MASTER_PORT $1",
                           "sh", "--nproc-per-node"});
  REQUIRE(r.code() == 0);
  std::set<std::string> lines;
  for (const std::string& line : lines_of(r.out)) lines.insert(line);
  // node 2 of 3 with 2 ranks each holds global ranks 4 and 5
  CHECK(lines == std::set<std::string>{"[rank 4] 4 6 29517 --nproc-per-node", "[rank 5] 5 6 29517 --nproc-per-node"});
}

TEST_CASE("nanoddp-run: a rank that exits early stops the job, is named, and nothing is left") {
  TempDir dir;
  const RunResult r = run({launcher_path(), "--nproc-per-node", "4", "--grace-period", "2", "sh", "-c",
                           "echo $$ > " + dir.path + "/pid.$RANK; sleep 0.3; if [ $RANK = 1 ]; then exit 3; fi; sleep 60"});
  CHECK(r.seconds < 30);
  CHECK(r.code() == 3);
  CHECK_MESSAGE(contains(r.err, "rank 1 (pid "), r.err);
  CHECK_MESSAGE(contains(r.err, "failed: exit code 3"), r.err);
  check_nothing_left(recorded_pids(dir.path, 4));
}

TEST_CASE("nanoddp-run: a rank that ended with status 0 while the others ran is named beside the failure") {
  // Rank 1 ends at once with status 0 (a success, as torchrun counts it); rank 0, as if it had
  // waited for it in a rendezvous, fails later: the failure names rank 1's early end too.
  const RunResult r = run({launcher_path(), "--nproc-per-node", "2", "sh", "-c",
                           "if [ $RANK = 1 ]; then exit 0; fi; sleep 0.5; exit 4"});
  CHECK(r.code() == 4);
  CHECK_MESSAGE(contains(r.err, "rank 0 (pid "), r.err);
  CHECK_MESSAGE(contains(r.err, "failed: exit code 4; rank 1 (pid "), r.err);
  CHECK_MESSAGE(contains(r.err, ") had already exited with status 0, and the others may have waited for it"),
                r.err);
}

TEST_CASE(
    "nanoddp-run: a rank that returns 0 before init_process_group, while another waits there, fails the "
    "job") {
  // Rank 1 (2 on the 3-rank job) exits 0 at once; the others wait for it in the rendezvous,
  // which would last until their store timeout (minutes). The launcher stops the job at once,
  // names the rank that left, and exits 1 (not 0: the job did not succeed), on every backend.
  for (const char* backend : {"shm", "gloo"})
    for (int world : {2, 3}) {
      CAPTURE(backend);
      CAPTURE(world);
      const std::string leaver = std::to_string(world - 1);
      const RunResult r =
          run({launcher_path(), "--nproc-per-node", std::to_string(world), "--backend", backend, "sh", "-c",
               "if [ $RANK = " + leaver + " ]; then exit 0; fi; exec '" + probe_path() + "' report"});
      CHECK(r.code() == 1);
      CHECK_MESSAGE(contains(r.err, "rank " + leaver + " (pid "), r.err);
      CHECK_MESSAGE(contains(r.err, ") exited with status 0 before it joined the process group, while rank "),
                    r.err);
      CHECK(r.seconds < 20);
    }
  // Not a failure: ranks that join a world of their own making (explicit rank and world size)
  // while the launcher's rank 0 has left, the last of them late.
  const RunResult own_world = run({launcher_path(), "--nproc-per-node", "3", "--backend", "gloo",
                                   probe_path(), "report", "--first-leaves", "1500"});
  CHECK_MESSAGE(own_world.code() == 0, own_world.err);
  CHECK_MESSAGE(contains(own_world.out, "[rank 1] rank 0 of 2 backend gloo sum 3"), own_world.out);
  CHECK_MESSAGE(contains(own_world.out, "[rank 2] rank 1 of 2 backend gloo sum 3"), own_world.out);
  // Nor a rank whose init_process_group failed (timed out waiting for rank 1), that caught the
  // error and went on: when rank 1 then exits 0, nobody waits for it any more.
  const RunResult caught =
      run({launcher_path(), "--nproc-per-node", "2", "--backend", "gloo", "sh", "-c",
           "if [ $RANK = 1 ]; then sleep 2; exit 0; fi; exec '" + probe_path() + "' catch-init 500"});
  CHECK_MESSAGE(caught.code() == 0, caught.err);
  CHECK_MESSAGE(contains(caught.out, "[rank 0] init failed; going on without a group"), caught.out);
}

TEST_CASE("nanoddp-run: a rank that fails by itself while the job is stopping is named too") {
  // Rank 1 fails first; rank 0 ignores SIGTERM and then exits 5 on its own (as a rank whose
  // own error came second would): both are named, the first one decides the exit code.
  const RunResult r = run({launcher_path(), "--nproc-per-node", "2", "--grace-period", "5", "sh", "-c",
                           "if [ $RANK = 1 ]; then sleep 0.2; exit 3; fi; trap '' TERM; sleep 0.6; exit 5"});
  CHECK(r.code() == 3);
  CHECK_MESSAGE(contains(r.err, "failed: exit code 3"), r.err);
  CHECK_MESSAGE(contains(r.err, "rank 0 (pid "), r.err);
  CHECK_MESSAGE(contains(r.err, "also failed: exit code 5"), r.err);
}

TEST_CASE("nanoddp-run: a rank that handles the stopping SIGTERM and exits 143 is not said to have failed") {
  // Rank 1 fails first; rank 0 traps SIGTERM and exits 128 + 15, as asked: only rank 1 is named.
  const RunResult r = run({launcher_path(), "--nproc-per-node", "2", "--grace-period", "5", "sh", "-c",
                           "if [ $RANK = 1 ]; then sleep 0.2; exit 3; fi; trap 'exit 143' TERM; "
                           "while true; do sleep 0.05; done"});
  CHECK(r.code() == 3);
  CHECK_MESSAGE(contains(r.err, "rank 1 (pid "), r.err);
  CHECK_MESSAGE(contains(r.err, "failed: exit code 3"), r.err);
  CHECK_MESSAGE(!contains(r.err, "also failed"), r.err);
}

TEST_CASE("nanoddp-run: a rank killed by a signal is named by the signal; SIGKILL follows an ignored SIGTERM") {
  TempDir dir;
  // Rank 0 ignores SIGTERM (its sleep inherits that), so only the SIGKILL after the 1 s grace
  // period ends it.
  const RunResult r = run({launcher_path(), "--nproc-per-node", "2", "--grace-period", "1", "sh", "-c",
                           "trap '' TERM; echo $$ > " + dir.path + "/pid.$RANK; sleep 0.3; "
                           "if [ $RANK = 1 ]; then kill -KILL $$; fi; sleep 60"});
  CHECK(r.code() == 128 + SIGKILL);
  CHECK_MESSAGE(contains(r.err, "rank 1 (pid "), r.err);
  CHECK_MESSAGE(contains(r.err, "killed by signal SIGKILL"), r.err);
  CHECK(r.seconds >= 0.9);  // the grace period was honoured
  CHECK(r.seconds < 10);
  check_nothing_left(recorded_pids(dir.path, 2));
}

TEST_CASE(
    "nanoddp-run: SIGINT (Ctrl-C) and SIGQUIT (Ctrl-\\) are forwarded to every rank; exit 128 + the signal") {
  // The ranks are in process groups of their own, out of the terminal's reach: a signal the
  // launcher left at its default ended the launcher alone (SIGQUIT did) and left the ranks
  // running. ulimit -c 0: no core file from SIGQUIT.
  for (int signal : {SIGINT, SIGQUIT}) {
    CAPTURE(signal);
    TempDir dir;
    const RunResult r = run({launcher_path(), "--nproc-per-node", "3", "sh", "-c",
                             "ulimit -c 0; echo $$ > " + dir.path + "/pid.$RANK; sleep 60"},
                            30s, [&](pid_t launcher) {
                              wait_for_ranks(dir.path, 3);  // all up, then press the keys
                              kill(launcher, signal);
                            });
    CHECK(r.code() == 128 + signal);
    CHECK_MESSAGE(contains(r.err, "received " + std::string(signal == SIGINT ? "SIGINT" : "SIGQUIT")), r.err);
    CHECK(r.seconds < 10);
    check_nothing_left(recorded_pids(dir.path, 3));
  }
}

TEST_CASE(
    "nanoddp-run: SIGUSR1 and SIGUSR2 reach every rank and the job goes on (Slurm's preemption warning)") {
  // At its default action either signal would end the launcher alone, and its ranks with it.
  // Each rank traps both (the trap is set before its pid file is written) and finishes once it
  // got both.
  TempDir dir;
  const RunResult r =
      run({launcher_path(), "--nproc-per-node", "2", "sh", "-c",
           "u1=0; u2=0; trap u1=1 USR1; trap u2=1 USR2; echo $$ > " + dir.path +
               "/pid.$RANK; while [ $u1 = 0 ] || [ $u2 = 0 ]; do sleep 0.05; done; echo got both"},
          30s, [&](pid_t launcher) {
            wait_for_ranks(dir.path, 2);
            kill(launcher, SIGUSR1);
            std::this_thread::sleep_for(200ms);
            kill(launcher, SIGUSR2);
          });
  CHECK_MESSAGE(r.code() == 0, r.err);
  const std::vector<std::string> printed = lines_of(r.out);
  CHECK(std::set<std::string>(printed.begin(), printed.end()) ==
        std::set<std::string>{"[rank 0] got both", "[rank 1] got both"});
  CHECK_MESSAGE(!contains(r.err, "received"), r.err);
  CHECK(r.seconds < 10);
}

TEST_CASE("nanoddp-run: SIGTSTP (Ctrl-Z) stops every rank, then the launcher; SIGCONT continues them all") {
  // Each rank sleeps 3 s, then writes its done file and prints. Stopped for longer than that,
  // no rank may have got there (a rank's shell may be in 'D' rather than 'T' when the stop
  // caught it starting sleep: progress, not the state letter, is what is checked); continued,
  // the job ends as it would have, exit 0.
  // The launcher runs as a shell's job does: in a process group of its own (in the test's
  // group, which a test runner may start orphaned, the kernel would drop its stop, and the
  // ranks are then continued at once, which is right but not this case), with SIGTSTP at its
  // default (a runner may start tests ignoring it, and an ignored Ctrl-Z stays ignored).
  const std::string as_a_job =
      "import os, signal, sys; os.setpgid(0, 0); "
      "signal.signal(signal.SIGTSTP, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])";
  TempDir dir;
  const RunResult r =
      run({"/usr/bin/python3", "-c", as_a_job, launcher_path(), "--nproc-per-node", "2", "sh", "-c",
           "echo $$ > " + dir.path + "/pid.$RANK; sleep 3; echo > " + dir.path + "/done.$RANK; echo done"},
          60s, [&](pid_t launcher) {
            wait_for_ranks(dir.path, 2);
            kill(launcher, SIGTSTP);
            CHECK(reaches_state(launcher, 'T'));
            std::this_thread::sleep_for(3500ms);
            for (int rank = 0; rank < 2; ++rank)
              CHECK_MESSAGE(!std::filesystem::exists(dir.path + "/done." + std::to_string(rank)), "rank ",
                            rank, " went on while the launcher was stopped");
            kill(launcher, SIGCONT);
          });
  CHECK_MESSAGE(r.code() == 0, r.err);
  CHECK(lines_of(r.out).size() == 2);
  CHECK(contains(r.out, "[rank 0] done"));
  CHECK(contains(r.out, "[rank 1] done"));
}

TEST_CASE("nanoddp-run: SIGTERM while ranks are still being started ends the job at once") {
  TempDir dir;
  // 64 ranks: the first one is up long before the last is forked, so the signal lands while
  // the launcher is still starting ranks; it must stop forking and end every rank it started.
  const RunResult r = run({launcher_path(), "--nproc-per-node", "64", "sh", "-c",
                           "echo $$ > " + dir.path + "/pid.$RANK; exec sleep 30"},
                          30s, [&](pid_t launcher) {
                            wait_for_ranks(dir.path, 1);
                            kill(launcher, SIGTERM);
                          });
  CHECK(r.code() == 128 + SIGTERM);
  CHECK_MESSAGE(contains(r.err, "received SIGTERM"), r.err);
  CHECK(r.seconds < 5);
  std::set<int> pids;
  DIR* d = opendir(dir.path.c_str());
  REQUIRE(d != nullptr);
  while (dirent* e = readdir(d))
    if (std::string(e->d_name).rfind("pid.", 0) == 0) pids.insert(std::atoi(read_file(dir.path + "/" + e->d_name).c_str()));
  closedir(d);
  pids.erase(0);  // a rank stopped between creating its pid file and writing it
  CHECK(!pids.empty());
  check_nothing_left(pids);
}

TEST_CASE("nanoddp-run: a rank that cannot be started (no descriptors left) ends the job, naming it") {
  TempDir dir;
  // 16 descriptors more than the shell inherited hold the launcher's own (its signal pipe and
  // the two pipes of Note [Launcher link]) and about two ranks' pipes: a later pipe2 fails with
  // EMFILE, and the ranks already started are terminated.
  const RunResult r = run({"/bin/sh", "-c", "ulimit -n $(( $(ls /proc/$$/fd | wc -l) + 16 )) && exec \"$0\" \"$@\"",
                           launcher_path(),
                           "--nproc-per-node", "8", "sh", "-c", "echo $$ > " + dir.path + "/pid.$RANK; exec sleep 30"});
  CHECK(r.code() == 1);
  CHECK_MESSAGE(contains(r.err, "nanoddp-run: could not start rank "), r.err);
  CHECK_MESSAGE(contains(r.err, "Too many open files"), r.err);
  CHECK(r.seconds < 10);
  const std::set<int> pids = written_pids(dir.path);
  CHECK(pids.size() < 8);
  check_nothing_left(pids);
}

TEST_CASE("ChildGroup: a pending signal, a failed child or the timeout stop further starts") {
  std::set<int> pids;
  auto sleeper = [](int) {
    execlp("sleep", "sleep", "30", static_cast<char*>(nullptr));
    _exit(127);
  };
  dist::ChildGroup::Options options;
  options.report = false;
  options.grace_period = 2s;
  const auto started = Clock::now();
  SUBCASE("signal") {
    dist::ChildGroup group(options);
    REQUIRE(group.start(0, "rank 0", "", sleeper));
    raise(SIGTERM);  // what `timeout` or `kill` sends the launcher while it forks
    CHECK_FALSE(group.start(1, "rank 1", "", sleeper));
    const dist::Outcome outcome = group.wait();
    CHECK(outcome.kind == dist::Outcome::Kind::Interrupted);
    CHECK(outcome.signal == SIGTERM);
    REQUIRE(outcome.statuses.size() == 1);  // rank 1 was never started
    CHECK(outcome.statuses[0].signal == SIGTERM);
  }
  SUBCASE("signal, then a second one: the ranks are killed at once, not after the grace period") {
    dist::ChildGroup group(options);
    REQUIRE(group.start(0, "rank 0", "", [](int) {
      signal(SIGTERM, SIG_IGN);  // only SIGKILL ends it
      execlp("sleep", "sleep", "30", static_cast<char*>(nullptr));
      _exit(127);
    }));
    std::this_thread::sleep_for(200ms);  // until it ignores SIGTERM
    raise(SIGTERM);
    CHECK_FALSE(group.start(1, "rank 1", "", sleeper));
    std::thread second([] {
      std::this_thread::sleep_for(300ms);
      kill(getpid(), SIGTERM);
    });
    const dist::Outcome outcome = group.wait();
    second.join();
    CHECK(outcome.kind == dist::Outcome::Kind::Interrupted);
    REQUIRE(outcome.statuses.size() == 1);
    CHECK(outcome.statuses[0].signal == SIGKILL);
    CHECK(Clock::now() - started < 1500ms);  // the grace period is 2 s
  }
  SUBCASE("failed child") {
    dist::ChildGroup group(options);
    REQUIRE(group.start(0, "rank 0", "", [](int) { _exit(3); }));
    std::this_thread::sleep_for(200ms);
    CHECK_FALSE(group.start(1, "rank 1", "", sleeper));
    const dist::Outcome outcome = group.wait();
    CHECK(outcome.kind == dist::Outcome::Kind::ChildFailed);
    CHECK(outcome.failed_rank == 0);
    CHECK(outcome.failed_status.code == 3);
    CHECK(outcome.statuses.size() == 1);
  }
  SUBCASE("timeout") {
    options.timeout = 100ms;
    dist::ChildGroup group(options);
    REQUIRE(group.start(0, "rank 0", "", sleeper));
    std::this_thread::sleep_for(150ms);
    CHECK_FALSE(group.start(1, "rank 1", "", sleeper));
    const dist::Outcome outcome = group.wait();
    CHECK(outcome.kind == dist::Outcome::Kind::TimedOut);
    CHECK(outcome.statuses.size() == 1);
  }
  CHECK(Clock::now() - started < 5s);
}

TEST_CASE("nanoddp-run --backend mpi: mpirun runs the ranks; an early exit fails the job with its code, a SIGKILL with 137") {
  if (!on_path("mpirun")) {
    MESSAGE("skipped: no mpirun on PATH (Debian: openmpi-bin)");
    return;
  }
  // n ranks of `sh -c`, each writing its pid into dir, then running body.
  auto run_ranks = [](int n, const std::string& dir, const std::string& body) {
    return run({launcher_path(), "--nproc-per-node", std::to_string(n), "--backend", "mpi", "sh", "-c",
                "echo $$ > " + dir + "/pid.$OMPI_COMM_WORLD_RANK; " + body});
  };
  TempDir dir;
  const RunResult r = run_ranks(3, dir.path,
                                "echo size $OMPI_COMM_WORLD_SIZE $NANODDP_BACKEND; sleep 0.3; "
                                "if [ $OMPI_COMM_WORLD_RANK = 1 ]; then exit 3; fi; sleep 60");
  CHECK(r.seconds < 30);
  CHECK(r.code() == 3);
  // mpirun's --tag-output prefix "[jobid,rank]<stdout>:" and its own report of the failed rank
  CHECK_MESSAGE(contains(r.out, ",0]<stdout>:size 3 mpi"), r.out);
  CHECK_MESSAGE(contains(r.err + r.out, ",1]"), r.err);
  CHECK_MESSAGE(contains(r.err + r.out, "Exit code:    3"), r.err);
  CHECK_MESSAGE(contains(r.err, "mpirun (pid "), r.err);
  CHECK_MESSAGE(contains(r.err, "failed: exit code 3"), r.err);
  check_nothing_left(recorded_pids(dir.path, 3));

  // A rank killed by SIGKILL: mpirun passes on 137, which the launcher explains.
  TempDir killed_dir;
  const RunResult killed =
      run_ranks(2, killed_dir.path, "sleep 0.3; if [ $OMPI_COMM_WORLD_RANK = 1 ]; then kill -9 $$; fi; sleep 60");
  CHECK(killed.seconds < 30);
  CHECK(killed.code() == 137);
  CHECK_MESSAGE(contains(killed.err + killed.out, "rank 1"), killed.err);  // mpirun's own report
  CHECK_MESSAGE(contains(killed.err, "137 is 128 + 9, a rank killed by SIGKILL; mpirun's message above names the rank"),
                killed.err);
  check_nothing_left(recorded_pids(killed_dir.path, 2));

  // A rank of a real MPI group that exits with an error between collectives: it does not wait
  // in MPI_Finalize for peers that wait in their all_reduce for it (Note [MPI exit]), so
  // mpirun names it and returns its code at once, not after the 30 s collective timeout.
  const RunResult left =
      run({launcher_path(), "--nproc-per-node", "2", "--backend", "mpi", probe_path(), "exit", "1", "3"});
  CHECK(left.seconds < 20);
  CHECK(left.code() == 3);
  CHECK_MESSAGE(contains(left.err + left.out, "Exit code:    3"), left.err);
  CHECK_MESSAGE(contains(left.err + left.out, ",1]"), left.err);
}

TEST_CASE("nanoddp-run with its standard streams closed runs the job; no rank's line is read as a signal") {
  // Closed, the launcher's signal pipe took descriptors 1 and 2: a rank's "[" came back as
  // signal 91, and the job was stopped with 219.
  for (const char* closed : {">&- 2>&-", "<&- >&- 2>&-"}) {
    CAPTURE(closed);
    const RunResult r =
        run({"/bin/sh", "-c",
             "'" + launcher_path() +
                 "' --nproc-per-node 2 sh -c 'for i in 1 2 3; do echo [out; echo [err >&2; done' " + closed +
                 "; echo rc=$?"});
    CHECK_MESSAGE(contains(r.out, "rc=0"), (r.out + r.err));
  }
}

namespace {

// Runs `job` (shell words; the launcher quoted first) with its stdout into a reader that
// sleeps 8 s before reading; returns the job's exit status and how long it took, in ms, as the
// shell saw them (rc=... ms=... in the result's out), and the launcher's stderr.
RunResult run_with_paused_reader(const std::string& job) {
  return run({"/bin/sh", "-c",
              "exec 3>&1; start=$(date +%s%N); ( " + job +
                  "; echo \"rc=$? ms=$(( ($(date +%s%N) - start) / 1000000 ))\" >&3 ) | "
                  "{ sleep 8; cat > /dev/null; }"});
}

// The ms=... of a run_with_paused_reader result.
long paused_reader_ms(const RunResult& r) {
  const size_t at = r.out.find("ms=");
  REQUIRE_MESSAGE(at != std::string::npos, r.out);
  return std::stol(r.out.substr(at + 3));
}

}  // namespace

TEST_CASE("nanoddp-run whose stdout nobody reads still acts on --timeout and exits (Note [Output relay])") {
  // Ranks print without end into a pipe whose reader sleeps 8 s. The supervision loop does not
  // wait for that reader: the timeout ends the job at 2 s, and the launcher exits once the
  // reader has taken nothing for the grace period, counted from its last byte (at the start):
  // at about 3 s, not a grace period after the timeout (5 s).
  const RunResult r =
      run_with_paused_reader("'" + launcher_path() + "' --grace-period 3 --timeout 2 --nproc-per-node 2 yes");
  CHECK_MESSAGE(contains(r.out, "rc=124 "), r.out);
  CHECK_MESSAGE(paused_reader_ms(r) < 4500, r.out);
  CHECK_MESSAGE(contains(r.err, "timed out: the job's --timeout of 2 s"), r.err);
}

TEST_CASE(
    "nanoddp-run | head -1: the reader gone ends the job, 128 + SIGPIPE, as a program writing there would") {
  // Ranks print a line every 10 ms for up to 60 s; head takes one line and exits. The next
  // write of the launcher fails (EPIPE): the ranks get SIGTERM and the launcher exits 141 at
  // once, saying why, instead of running the job to its end with the output dropped.
  for (const std::string streams : {"", " 2>&1"}) {
    CAPTURE(streams);
    const RunResult r =
        run({"/bin/bash", "-c",
             "start=$(date +%s%N); '" + launcher_path() +
                 "' --nproc-per-node 2 /bin/sh -c 'for i in $(seq 6000); do echo line $i; sleep 0.01; done'" +
                 streams +
                 " | head -1 > /dev/null; echo \"rc=${PIPESTATUS[0]} ms=$(( ($(date +%s%N) - start) / "
                 "1000000 ))\""},
            60s);
    CHECK_MESSAGE(contains(r.out, "rc=141 "), r.out, r.err);
    CHECK_MESSAGE(paused_reader_ms(r) < 10000, r.out);
    if (streams.empty())
      CHECK_MESSAGE(contains(r.err,
                             "the reader of its output is gone (stdout or stderr closed, as by | head); "
                             "sending SIGTERM to the 2 remaining process(es)"),
                    r.err);
  }
}

TEST_CASE("nanoddp-run: a reader gone after a rank failed: the failure's status, and no restart") {
  // The rank prints 2 MB and exits 3 at once; the reader sleeps 1 s, takes one byte and goes.
  // The failure is known before the launcher's next write fails: its status is the job's, and
  // --max-restarts does not start a round whose output nobody would read. With 2>&1 the
  // launcher's own report goes to the dead reader too, and must not end it by SIGPIPE.
  for (const std::string streams : {"", " 2>&1"}) {
    CAPTURE(streams);
    const RunResult r = run({"/bin/bash", "-c",
                             "'" + launcher_path() +
                                 "' --max-restarts 2 --nproc-per-node 1 /bin/sh -c 'yes $(printf %0100d 0) | "
                                 "head -n 20000; exit 3'" +
                                 streams + " | { sleep 1; head -c 1 > /dev/null; }; echo \"rc=${PIPESTATUS[0]}\""},
                            60s);
    CHECK_MESSAGE(contains(r.out, "rc=3"), r.out, r.err);
    if (streams.empty()) {
      CHECK_MESSAGE(contains(r.err, "nanoddp-run: the reader of its output is gone: no restart"), r.err);
      CHECK_MESSAGE(!contains(r.err, "restarting every rank"), r.err);
    }
  }
  // A rank that failed because it lost another waits for that one's blame: a reader gone
  // meanwhile leaves the failure the outcome (rank 1's 5), not SIGPIPE.
  const RunResult blamed =
      run({"/bin/bash", "-c",
           "'" + launcher_path() +
               "' --grace-period 10 --nproc-per-node 2 /bin/bash -c 'fd=${NANODDP_FAILURE_FD%%:*}; "
               "if [ \"$RANK\" = 1 ]; then sleep 0.3; echo \"1 lost 0\" >&$fd; exit 5; fi; "
               "for i in $(seq 50); do echo line $i; sleep 0.1; done' | { sleep 1; head -c 1 > /dev/null; }; "
               "echo \"rc=${PIPESTATUS[0]}\""},
          60s);
  CHECK_MESSAGE(contains(blamed.out, "rc=5"), blamed.out, blamed.err);
}

TEST_CASE(
    "nanoddp-run | tee, then Ctrl-C: the reader going with the signal stops the ranks politely, exit 130") {
  // Ctrl-C reaches tee and the launcher together; whichever the launcher sees first, the
  // ranks' handlers (1 s to save) run to their end, never cut by a SIGKILL, and the job ends
  // by the user's signal. Both orders: the signal first, and the reader's going noticed (the
  // ranks already stopping) 0.3 s before the signal comes.
  for (const std::string pause : {"0", "0.3"}) {
    CAPTURE(pause);
    const TempDir dir;  // the fifo's, removed at the end
    const RunResult r =
        run({"/bin/bash", "-c",
             "set -m; cd '" + dir.path + "' && mkfifo out && { cat out > /dev/null & } && reader=$! && "
             "{ '" +
                 launcher_path() +
                 "' --grace-period 20 --nproc-per-node 2 /bin/sh -c "
                 "'trap \"sleep 1; echo saved >&2; exit 0\" INT TERM; while :; do echo x; sleep 0.01; done' "
                 "> out & } && "
                 "launcher=$! && sleep 1 && kill -TERM $reader && sleep " +
                 pause + " && kill -INT $launcher; wait $launcher; echo \"rc=$?\""},
            60s);
    CHECK_MESSAGE(contains(r.out, "rc=130"), r.out, r.err);
    CHECK_MESSAGE(contains(r.err, "[rank 0] saved"), r.err);
    CHECK_MESSAGE(contains(r.err, "[rank 1] saved"), r.err);
  }
}

TEST_CASE(
    "nanoddp-run whose job has ended but whose stdout nobody reads exits on SIGTERM (Note [Output relay])") {
  // The rank prints 2 MB in 20,000 lines and exits; the launcher waits for the reader, which sleeps 8 s,
  // until SIGTERM at 2 s: then a stall of the grace period ends the wait, and the exit is 128 + 15.
  const std::string prints = " sh -c 'yes $(printf %0100d 0) | head -n 20000";
  const std::string then_term = " & pid=$!; sleep 2; kill -TERM $pid; wait $pid";
  const RunResult r = run_with_paused_reader("'" + launcher_path() + "' --grace-period 1 --nproc-per-node 1" +
                                             prints + "'" + then_term);
  CHECK_MESSAGE(contains(r.out, "rc=143 "), r.out);
  CHECK_MESSAGE(paused_reader_ms(r) < 6000, r.out);
  // The same after a rank failed, with restarts left: the signal ends the job, no round follows.
  const RunResult failed = run_with_paused_reader("'" + launcher_path() +
                                                  "' --grace-period 1 --max-restarts 2 --nproc-per-node 1" +
                                                  prints + "; exit 3'" + then_term);
  CHECK_MESSAGE(contains(failed.out, "rc=143"), failed.out);
  CHECK_MESSAGE(!contains(failed.err, "restarting every rank"), failed.err);
}

TEST_CASE(
    "nanoddp-run prints a line of over 64 KiB in pieces of 64 KiB, and no empty line after one of exactly 64 "
    "KiB") {
  const RunResult r =
      run({launcher_path(), "--nproc-per-node", "1", "/bin/sh", "-c",
           "head -c 65536 /dev/zero | tr '\\0' x; echo; head -c 65537 /dev/zero | tr '\\0' y; "
           "echo; echo end"});
  std::vector<size_t> lengths;
  for (size_t begin = 0, nl; (nl = r.out.find('\n', begin)) != std::string::npos; begin = nl + 1)
    lengths.push_back(nl - begin);
  const size_t prefix = std::string("[rank 0] ").size();
  CHECK(lengths == std::vector<size_t>{prefix + 65536, prefix + 65536, prefix + 1, prefix + 3});
}

TEST_CASE("nanoddp-run: usage errors exit 2 and start nothing") {
  CHECK(run({launcher_path()}).code() == 2);                                              // no PROGRAM
  CHECK(run({launcher_path(), "--backend", "tcp", "true"}).code() == 2);                  // unknown backend
  CHECK(run({launcher_path(), "--nnodes", "2", "true"}).code() == 2);                     // port 0 on 2 nodes
  const RunResult mpi = run({launcher_path(), "--nnodes", "2", "--master-port", "29500", "--backend", "mpi", "true"});
  CHECK(mpi.code() == 2);
  CHECK_MESSAGE(contains(mpi.err, "hostfile"), mpi.err);
  const RunResult huge = run({launcher_path(), "--nproc-per-node", "100000", "true"});  // a typo, not a job
  CHECK(huge.code() == 2);
  CHECK_MESSAGE(
      contains(huge.err,
               "--nproc-per-node: must be an integer between 1 and 1024 (or cpu, gpu, auto), got '100000'"),
      huge.err);
  // Every numeric flag names itself, its bounds and the value (CLI11's Range printed 300 digits).
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"--nproc-per-node", "0"},
       "--nproc-per-node: must be an integer between 1 and 1024 (or cpu, gpu, auto), got '0'"},
      {{"--nnodes", "x"}, "--nnodes: must be an integer >= 1, got 'x'"},
      {{"--node-rank", "-1"}, "--node-rank: must be an integer >= 0, got '-1'"},
      {{"--master-port", "70000"}, "--master-port: must be an integer between 0 and 65535, got '70000'"},
      {{"--grace-period", "-1"}, "--grace-period: must be a finite number between 0 and 1e+09, got '-1'"},
      {{"--timeout", "1e99"}, "--timeout: must be a finite number between 0 and 1e+09, got '1e99'"},
      {{"--backend", "tcp"}, "--backend: must be one of auto, shm, shm+gloo, gloo, mpi or nccl, got 'tcp'"},
      {{"--master-addr", ""}, "--master-addr: must name a host, got ''"},
      // `--flag=` with nothing after '=' would take the program as its value.
      {{"--backend="}, "nanoddp-run: --backend= has no value after '='"},
      {{"--nproc-per-node", "2", "--master-port="}, "nanoddp-run: --master-port= has no value after '='"},
      {{"--nnodes", "0"}, "nanoddp-run: --nnodes: must be an integer >= 1, got '0'"},
      {{"--node-rank", "1"},
       "nanoddp-run: launch: --node-rank 1 is not below --nnodes 1 (nodes are numbered from 0)"},
  };
  for (const auto& [flags, message] : bad) {
    std::vector<std::string> args = {launcher_path()};
    args.insert(args.end(), flags.begin(), flags.end());
    args.push_back("true");
    const RunResult r = run(args);
    CHECK(r.code() == 2);
    CHECK_MESSAGE(contains(r.err, message), r.err);
    CHECK(r.err.size() < 300);
  }
  // A flag given last, with no value.
  const RunResult no_value = run({launcher_path(), "--nproc-per-node"});
  CHECK(no_value.code() == 2);
  CHECK_MESSAGE(
      contains(no_value.err,
               "nanoddp-run: --nproc-per-node needs a value (N:1..1024, cpu, gpu or auto) after it"),
      no_value.err);
  // Help that cannot be written is not a success.
  const RunResult unwritten =
      run({"/bin/sh", "-c", "'" + launcher_path() + "' --help > /dev/full; echo rc=$?"});
  CHECK_MESSAGE(contains(unwritten.out, "rc=1"), unwritten.out);
  CHECK_MESSAGE(contains(unwritten.err, "nanoddp-run: could not write --help to stdout"), unwritten.err);
  const RunResult help = run({launcher_path(), "--help"});
  CHECK(help.code() == 0);
  CHECK_MESSAGE(contains(help.out, "124 when --timeout"), help.out);
  CHECK_MESSAGE(help.out.find("Usage:") == help.out.rfind("Usage:"), help.out);  // once
  CHECK_MESSAGE(contains(help.out, "Usage: nanoddp-run [OPTIONS] PROGRAM [ARGS...]\n"), help.out);
  const RunResult missing = run({launcher_path(), "--nproc-per-node", "2", "/nonexistent/program"});
  CHECK(missing.code() == 127);
  CHECK(contains(missing.err, "cannot execute '/nonexistent/program'"));
}

TEST_CASE("nanoddp-run: a program that cannot be run is named once, with the shell's code, and no rank starts") {
  TempDir dir;
  const std::string plain = dir.path + "/not-executable";
  std::ofstream(plain) << "#!/bin/sh\nexit 0\n";
  ::chmod(plain.c_str(), 0644);
  const std::string orphan = dir.path + "/orphan.sh";  // its interpreter is missing
  std::ofstream(orphan) << "#!/nonexistent/interpreter -e\necho hi\n";
  ::chmod(orphan.c_str(), 0755);
  // Executable text without #!: execvp would hand it to /bin/sh, whose `import` is another
  // program (ImageMagick's).
  const std::string no_shebang = dir.path + "/train.py";
  std::ofstream(no_shebang) << "import sys\nprint(sys.argv)\n";
  ::chmod(no_shebang.c_str(), 0755);
  struct Case {
    std::string program, message;
    int code;
  };
  // A program that cannot run is one report, not one per rank that got to exec before the
  // others were stopped: no "rank N failed" lines, and 126 (not 127) for no permission.
  const std::vector<Case> cases = {
      {"/nonexistent/program", "cannot execute '/nonexistent/program': No such file or directory; no rank",
       127},
      {"nanoddp-no-such-program",
       "cannot execute 'nanoddp-no-such-program': No such file or directory "
       "(searched PATH); no rank was started",
       127},
      {plain,
       "cannot execute '" + plain + "': Permission denied; " + plain +
           " is not executable: nanoddp-run starts PROGRAM as it is (torchrun --no-python), so start a "
           "script "
           "with its interpreter (nanoddp-run ... python3 " +
           plain + "); no rank was started",
       126},
      {no_shebang,
       "cannot execute '" + no_shebang +
           "': a Python script without a #! line would run under /bin/sh (torchrun --no-python fails on it "
           "too: Exec format error); start it with its interpreter (python3 " +
           no_shebang + ") or give it a #!/usr/bin/env python3 line; no rank was started",
       126},
      {dir.path, "cannot execute '" + dir.path + "': Is a directory; no rank was started", 126},
      {orphan,
       "cannot execute '" + orphan +
           "': its #! line names /nonexistent/interpreter, which does not exist "
           "or cannot run; no rank was started",
       127},
  };
  for (const Case& c : cases) {
    CAPTURE(c.program);
    const RunResult r = run({launcher_path(), "--nproc-per-node", "4", c.program, "--flag"});
    CHECK(r.code() == c.code);
    CHECK_MESSAGE(contains(r.err, c.message), r.err);
    CHECK_MESSAGE(r.err.find("cannot execute") == r.err.rfind("cannot execute"), r.err);  // once
    CHECK_MESSAGE(!contains(r.err, "[rank"), r.err);
    CHECK(r.out.empty());
  }
  // A program in the current folder named without ./ is not on PATH: the message says how.
  const RunResult here = run({"/bin/sh", "-c", "cd " + dir.path + " && exec " + launcher_path() + " orphan.sh"});
  CHECK(here.code() == 127);
  CHECK_MESSAGE(contains(here.err, "(searched PATH); to run ./orphan.sh from this folder, write ./orphan.sh; no rank"),
                here.err);
  // torchrun's --no-python is what nanoddp-run always does: accepted, in both spellings.
  for (const char* flag : {"--no-python", "--no_python"}) {
    const RunResult r = run({launcher_path(), "--nproc-per-node", "2", flag, "sh", "-c", "echo ran"});
    CHECK_MESSAGE(r.code() == 0, r.err);
    CHECK(lines_of(r.out).size() == 2);
  }
}

TEST_CASE("nanoddp-run: the timeout message names the job's --timeout, and a stopped rank ends at once, not at SIGKILL") {
  // Rank 1 fails in round 0 only; round 1 then runs into the 2 s that the job's --timeout
  // leaves, and the message names the 2 s, not what was left of them.
  const RunResult timed = run({launcher_path(), "--nproc-per-node", "2", "--timeout", "2", "--max-restarts", "1", "sh",
                               "-c", "[ $RANK = 1 ] && [ $NANODDP_RESTART_COUNT = 0 ] && exit 4; sleep 30"},
                              60s);
  CHECK(timed.code() == 124);
  CHECK_MESSAGE(contains(timed.err, "timed out: the job's --timeout of 2 s (every round counts)"), timed.err);
  // A timeout under a millisecond is one, not "no limit" (0).
  const RunResult tiny = run({launcher_path(), "--timeout", "0.0001", "sleep", "30"}, 60s);
  CHECK(tiny.code() == 124);
  CHECK_MESSAGE(contains(tiny.err, "timed out: the job's --timeout of 1 ms"), tiny.err);
  // Rank 1 stops itself (SIGSTOP); rank 0 fails. The SIGTERM reaches the stopped rank with a
  // SIGCONT, so the job ends long before the 30 s grace period's SIGKILL.
  const auto start = Clock::now();
  const RunResult stopped = run({launcher_path(), "--nproc-per-node", "2", "--grace-period", "30", "sh", "-c",
                                 "[ $RANK = 1 ] && kill -STOP $$; sleep 1; exit 3"},
                                60s);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  CHECK_MESSAGE(stopped.code() == 3, stopped.err);
  CHECK_MESSAGE(seconds < 15, "the job took ", seconds, " s");
}

TEST_CASE("core_round_trip: a round trip between two CPUs, and a clear refusal with one") {
  using nanoddp::testing::built;
  const std::string probe = built("benchmarks/core_round_trip");
  if (::access(probe.c_str(), X_OK) != 0) {  // -Dbenchmarks=false (the sanitizer build)
    MESSAGE("benchmarks/core_round_trip is not built here: not checked");
    return;
  }
  const RunResult one_cpu = run({"/bin/sh", "-c", "exec taskset -c 0 \"$0\"", probe});  // util-linux's taskset
  CHECK(one_cpu.code() == 1);
  CHECK_MESSAGE(contains(one_cpu.err, "core_round_trip: this process may use 1 CPU; it needs two"), one_cpu.err);
  if (std::thread::hardware_concurrency() < 2) {
    MESSAGE("one CPU here: the round trip itself is not measured");
    return;
  }
  const RunResult measured = run({probe});
  CHECK_MESSAGE(measured.code() == 0, measured.err);
  const std::string key = "\"round_trip_ns\":";
  const size_t at = measured.out.find(key);
  REQUIRE_MESSAGE(at != std::string::npos, measured.out);
  CHECK(contains(measured.out, "{\"example\":\"core_round_trip\",\"cpus\":["));
  // A cache line cannot cross between cores in under a nanosecond, nor take a millisecond.
  const double ns = std::stod(measured.out.substr(at + key.size()));
  CHECK(ns > 1.0);
  CHECK(ns < 1e6);
}

TEST_CASE("allreduce_bench: one rank, empty size ranges, bad numbers and jobs --nproc cannot make are refused") {
  using nanoddp::testing::built;
  const std::string bench = built("benchmarks/allreduce_bench");
  // The benchmarks without flags refuse any, rather than run with it ignored.
  for (const char* flagless : {"benchmarks/trace_bench", "benchmarks/zero_bench", "benchmarks/core_round_trip"}) {
    if (::access(built(flagless).c_str(), X_OK) != 0) {  // -Dbenchmarks=false (the sanitizer build)
      MESSAGE(flagless, " is not built here: not checked");
      continue;
    }
    const RunResult refused = run({built(flagless), "--bogus", "x"});
    CHECK(refused.code() == 2);
    CHECK_MESSAGE(contains(refused.err, "takes no arguments, got '--bogus'"), refused.err);
  }
  const RunResult alone = run({bench});  // no launcher: a world of one
  CHECK(alone.code() == 2);
  CHECK_MESSAGE(contains(alone.err, "world size 1"), alone.err);
  CHECK_MESSAGE(contains(alone.err, "--nproc 2"), alone.err);
  CHECK(alone.out.empty());  // no table of meaningless figures
  // MPI's ranks come from mpirun: its hint is not --nproc, which that backend refuses.
  const RunResult alone_mpi = run({bench, "--backend", "mpi"});
  CHECK(alone_mpi.code() == 2);
  CHECK_MESSAGE(contains(alone_mpi.err, "nanoddp-run --nproc-per-node 2 --backend mpi allreduce_bench --backend mpi"),
                alone_mpi.err);
  CHECK_MESSAGE(!contains(alone_mpi.err, "allreduce_bench --nproc 2"), alone_mpi.err);
  // Another backend asked for is kept in the hints: without it they would measure shm.
  const RunResult alone_gloo = run({bench, "--backend", "gloo"});
  CHECK(alone_gloo.code() == 2);
  CHECK_MESSAGE(contains(alone_gloo.err, "allreduce_bench --nproc 2 --backend gloo (forks them here), nanoddp-run "
                                         "--nproc-per-node 2 allreduce_bench --backend gloo"),
                alone_gloo.err);
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"--min-bytes", "1024", "--max-bytes", "16"}, "--min-bytes 1024 is larger than --max-bytes 16"},
      {{"--max-bytes", "16"}, "--min-bytes 4096 is larger than --max-bytes 16"},
      {{"--min-bytes", "6"}, "--min-bytes: must be a positive multiple of 4"},
      {{"--warmup", "-1"}, "--warmup: must be an integer between 0 and 1000000, got '-1'"},
      {{"--nproc", "1"}, "--nproc: must be 0 or an integer between 2 and 64, got '1'"},
      {{"--seconds-per-size", "0"}, "--seconds-per-size must be a number of seconds"},
      {{"--seconds-per-size", ""}, "--seconds-per-size: must be a finite number between 0 and 3600, got ''"},
      {{"--seconds-per-size", "1e9"}, "--seconds-per-size: must be a finite number between 0 and 3600, got '1e9'"},
      {{"--backend", "bogus"}, "--backend: must be one of auto, shm, shm+gloo, gloo, mpi or nccl, got 'bogus'"},
      {{"--backend", ""}, "--backend: must be one of auto, shm, shm+gloo, gloo, mpi or nccl, got ''"},
      {{"--ring="}, "--ring= has no value after '='"},
      {{"--backend="}, "--backend= has no value after '='"},
      {{"--bogus"}, "allreduce_bench: The following argument was not expected: --bogus"},
      // Refused before a rank is forked: MPI's ranks come from mpirun, and NCCL takes one GPU
      // per rank (rank r on cuda:r; no machine has 64).
      {{"--nproc", "2", "--backend", "mpi"}, "--nproc forks ranks itself, but --backend mpi needs its ranks started "
                                             "by mpirun: mpirun -np 2 allreduce_bench --backend mpi"},
      {{"--nproc", "64", "--backend", "nccl"},
       nanoddp::dist::backend_unavailable(nanoddp::dist::Backend::Nccl).empty()
           ? "--nproc 64 --backend nccl puts rank r on cuda:r and needs 64 GPUs"
           : "--backend: nccl is not available: nanoddp was built without NCCL"},
      {{"--nproc", "2", "--backend", "shm+gloo"}, "--backend shm+gloo needs the node layout a launcher gives"},
      // The textbook ring sends CPU tensors; an NCCL group takes only its GPU's.
      {{"--ring", "--backend", "nccl"},
       nanoddp::dist::backend_unavailable(nanoddp::dist::Backend::Nccl).empty()
           ? "--ring times dist::ring_all_reduce, which takes CPU tensors; --backend nccl works on GPUs"
           : "--backend: nccl is not available: nanoddp was built without NCCL"},
  };
  for (const auto& [flags, message] : bad) {
    std::vector<std::string> args = {bench};
    args.insert(args.end(), flags.begin(), flags.end());
    const RunResult r = run(args);
    CHECK(r.code() == 2);
    CHECK_MESSAGE(contains(r.err, message), r.err);
    CHECK(r.out.empty());
  }
  // Under a launcher (RANK and WORLD_SIZE set) --nproc would start a second job per rank.
  const RunResult nested = run({"/usr/bin/env", "RANK=1", "WORLD_SIZE=2", bench, "--nproc", "2"});
  CHECK(nested.code() == 2);
  CHECK_MESSAGE(contains(nested.err, "--nproc 2 forks ranks itself, but this process is already rank 1 of 2"),
                nested.err);
  CHECK(nested.out.empty());
}

TEST_CASE("allreduce_bench --csv: a header and one row per size, busbw = algbw * 2(n-1)/n = size / time") {
  using nanoddp::testing::built;
  const RunResult r = run({built("benchmarks/allreduce_bench"), "--nproc", "2", "--backend", "gloo", "--csv",
                           "--min-bytes", "4096", "--max-bytes", "16384", "--seconds-per-size", "0.01"},
                          60s);
  REQUIRE_MESSAGE(r.code() == 0, r.err);
  // The store is the bench's own: it admits only its ranks (a token, as nanoddp-run makes).
  CHECK_MESSAGE(!contains(r.err, "NANODDP_STORE_TOKEN is not set"), r.err);
  const std::vector<std::string> lines = lines_of(r.out);
  REQUIRE(lines.size() == 4);
  CHECK(lines[0] == "backend,world_size,device,bytes,count,iters,time_us,algbw_gbps,busbw_gbps,algorithm");
  for (int i = 1; i <= 3; ++i) {
    CAPTURE(lines[i]);
    std::vector<std::string> cells;
    std::stringstream row(lines[i]);
    for (std::string cell; std::getline(row, cell, ',');) cells.push_back(cell);
    REQUIRE(cells.size() == 10);
    const long long bytes = 4096LL << (i - 1);
    CHECK(cells[0] == "gloo");
    CHECK(cells[1] == "2");
    CHECK(cells[2] == "cpu");
    CHECK(std::stoll(cells[3]) == bytes);
    CHECK(std::stoll(cells[4]) == bytes / 4);
    const double time_us = std::stod(cells[6]), algbw = std::stod(cells[7]), busbw = std::stod(cells[8]);
    CHECK(algbw == doctest::Approx(bytes / (time_us * 1e-6) / 1e9).epsilon(1e-3));
    CHECK(busbw == algbw);  // 2(n-1)/n = 1 for n = 2
    CHECK(cells[9] == "all_reduce");
  }
}

TEST_CASE("allreduce_bench --nproc with backend auto runs on shm, as auto does for a one-machine job") {
  using nanoddp::testing::built;
  const RunResult r = run({built("benchmarks/allreduce_bench"), "--nproc", "2", "--csv", "--min-bytes", "4096",
                           "--max-bytes", "4096", "--seconds-per-size", "0.01"},
                          60s);
  REQUIRE_MESSAGE(r.code() == 0, r.err);
  const std::vector<std::string> lines = lines_of(r.out);
  REQUIRE(lines.size() == 2);
  CHECK_MESSAGE(lines[1].rfind("shm,2,cpu,4096,", 0) == 0, lines[1]);
  CHECK_MESSAGE(ends_with(lines[1], ",all_reduce"), lines[1]);
}

TEST_CASE("allreduce_bench --csv names the algorithm: --ring and --collective-buffer rows stay apart") {
  using nanoddp::testing::built;
  for (const auto& case_ : {std::pair<std::vector<std::string>, std::string>{{"--ring"}, "ring_all_reduce"},
                            {{"--collective-buffer"}, "all_reduce_collective_buffer"},
                            {{"--ring", "--collective-buffer"}, "ring_all_reduce_collective_buffer"}}) {
    // Named copies: doctest's CAPTURE is a lambda, which cannot capture a structured binding.
    const std::vector<std::string>& flags = case_.first;
    const std::string algorithm = case_.second;
    CAPTURE(algorithm);
    std::vector<std::string> args = {built("benchmarks/allreduce_bench"), "--nproc", "2", "--backend", "shm", "--csv",
                                     "--min-bytes", "4096", "--max-bytes", "4096", "--seconds-per-size", "0.01"};
    args.insert(args.end(), flags.begin(), flags.end());
    const RunResult r = run(args, 60s);
    REQUIRE_MESSAGE(r.code() == 0, r.err);
    const std::vector<std::string> lines = lines_of(r.out);
    REQUIRE(lines.size() == 2);
    CHECK_MESSAGE(ends_with(lines[1], "," + algorithm), lines[1]);
  }
}

TEST_CASE("allreduce_bench --nproc under NANODDP_TRACE: each rank writes its all-reduces, the parent no empty file") {
  using nanoddp::testing::built;
  TempDir dir;
  const std::string trace = dir.path + "/ar.json";
  const RunResult r = run({"/usr/bin/env", "NANODDP_TRACE=" + trace, built("benchmarks/allreduce_bench"), "--nproc",
                           "2", "--min-bytes", "4096", "--max-bytes", "8192", "--seconds-per-size", "0.01"},
                          60s);
  REQUIRE_MESSAGE(r.code() == 0, r.err);
  CHECK(::access(trace.c_str(), F_OK) != 0);  // no world-of-one trace from the parent
  for (int rank = 0; rank < 2; ++rank) {
    const std::string part = read_file(dir.path + "/ar.rank" + std::to_string(rank) + ".json");
    CHECK_MESSAGE(contains(part, "\"name\":\"all_reduce 4096 B\""), part.substr(0, 2000));
    CHECK_MESSAGE(contains(part, "\"name\":\"all_reduce 8192 B\""), part.substr(0, 2000));
    CHECK_MESSAGE(contains(part, "\"bytes\":8192,\"backend\":\"shm\""), part.substr(0, 2000));
  }

  // A rank's own file that cannot be a trace stops the job before the table, naming it.
  REQUIRE(::mkdir((dir.path + "/bad.rank1.json").c_str(), 0700) == 0);
  const RunResult bad = run({"/usr/bin/env", "NANODDP_TRACE=" + dir.path + "/bad.json",
                             built("benchmarks/allreduce_bench"), "--nproc", "2", "--max-bytes", "4096"},
                            60s);
  CHECK(bad.code() == 1);
  CHECK_MESSAGE(contains(bad.err, "trace file " + dir.path + "/bad.rank1.json exists but is a folder"), bad.err);
  CHECK_MESSAGE(!contains(bad.out, "size(B)"), bad.out);
}

TEST_CASE("launch helpers: rank_env numbering, mpirun command line, signal names, free ports") {
  dist::LaunchOptions o;
  o.nproc_per_node = 4;
  o.nnodes = 2;
  o.node_rank = 1;
  o.master_addr = "10.0.0.1";
  const auto env = dist::rank_env(o, 3, 29500);
  const std::map<std::string, std::string> m(env.begin(), env.end());
  CHECK(m.at("RANK") == "7");
  CHECK(m.at("LOCAL_RANK") == "3");
  CHECK(m.at("WORLD_SIZE") == "8");
  CHECK(m.at("LOCAL_WORLD_SIZE") == "4");
  CHECK(m.at("GROUP_RANK") == "1");
  CHECK(m.at("MASTER_ADDR") == "10.0.0.1");
  CHECK(m.at("MASTER_PORT") == "29500");
  CHECK(m.count("NANODDP_BACKEND") == 0);
  // torchrun's other worker variables: one role holding every rank.
  CHECK(m.at("GROUP_WORLD_SIZE") == "2");
  CHECK(m.at("ROLE_NAME") == "default");
  CHECK(m.at("ROLE_RANK") == "7");
  CHECK(m.at("ROLE_WORLD_SIZE") == "8");
  CHECK(m.at("TORCHELASTIC_RUN_ID") == "none");
  o.job_id = "5eed";
  const auto with_job = dist::rank_env(o, 3, 29500);
  CHECK(std::map<std::string, std::string>(with_job.begin(), with_job.end()).at("TORCHELASTIC_RUN_ID") == "5eed");

  dist::LaunchOptions one;
  one.nproc_per_node = 2;
  const auto cmd = dist::mpirun_command(one, {"./train", "-x"}, 1234);
  REQUIRE(cmd.size() >= 8);
  CHECK(std::vector<std::string>(cmd.begin(), cmd.begin() + 5) ==
        std::vector<std::string>{"mpirun", "-np", "2", "--bind-to", "none"});
  CHECK(std::vector<std::string>(cmd.end() - 2, cmd.end()) == std::vector<std::string>{"./train", "-x"});
  const std::string joined = [&] {
    std::string s;
    for (const auto& a : cmd) s += a + " ";
    return s;
  }();
  CHECK(contains(joined, "-x MASTER_PORT=1234 "));
  CHECK(contains(joined, "-x NANODDP_BACKEND=mpi "));
  CHECK_THROWS_AS(dist::mpirun_command(o, {"./train"}, 1), nanoddp::ValueError);

  CHECK(dist::signal_name(SIGKILL) == "SIGKILL");
  CHECK(dist::signal_name(SIGSEGV) == "SIGSEGV");
  CHECK(dist::ExitStatus{false, 0, SIGTERM}.describe() == "killed by signal SIGTERM");
  CHECK(dist::ExitStatus{true, 3, 0}.describe() == "exit code 3");

  const int port = dist::pick_free_port("127.0.0.1");
  CHECK(port > 0);
  CHECK(port < 65536);
  CHECK_THROWS_AS(dist::pick_free_port("203.0.113.7"), nanoddp::DistError);  // not this machine's

  // Note [Launcher link]: reports are "<rank> lost <peer>", "<rank> joining <world size>" and
  // "<rank> joined" lines; anything else is skipped.
  const dist::LauncherReports reports = dist::parse_launcher_reports(
      "0 lost 3\njunk\n2 lost 1\n1 lost\n4 lost 2 more\n-1 lost 0\n5 lost 0\n1 joining 4\n2 joining 0\n"
      "3 joining\n0 joined\n1 joined now\n-2 joined\n4 left\n5 left early\n4 joining 2\n");
  CHECK(reports.lost == std::vector<std::pair<int, int>>{{0, 3}, {2, 1}, {5, 0}});
  using Stage = dist::RendezvousStage;
  CHECK(reports.rendezvous ==
        std::vector<dist::LauncherReports::Rendezvous>{{1, Stage::Joining, 4},
                                                       {0, Stage::Joined, 0},
                                                       {4, Stage::Left, 0},
                                                       {4, Stage::Joining, 2}});  // in the order written
  dist::LaunchOptions identity;
  dist::give_job_identity(identity);
  dist::LaunchOptions again;
  dist::give_job_identity(again);
  CHECK(identity.job_id.size() == 16);
  CHECK(identity.store_token.size() == 64);
  CHECK(identity.job_id != again.job_id);          // random per job
  CHECK(identity.store_token != again.store_token);
  const auto with_identity = dist::rank_env(identity, 0, 29500);
  const std::map<std::string, std::string> e(with_identity.begin(), with_identity.end());
  CHECK(e.at("NANODDP_JOB_ID") == identity.job_id);
  CHECK(e.at("NANODDP_STORE_TOKEN") == identity.store_token);
}

TEST_CASE("spawn: every rank runs fn with its env and returns") {
  TempDir dir;
  dist::spawn(
      [&](int rank) {
        std::ofstream(dir.path + "/rank." + std::to_string(rank))
            << rank << " " << std::getenv("RANK") << " " << std::getenv("WORLD_SIZE") << " "
            << std::getenv("LOCAL_RANK") << " " << std::getenv("MASTER_PORT") << " " << getpid();
      },
      3);
  std::set<std::string> ports;
  std::set<int> pids;
  for (int rank = 0; rank < 3; ++rank) {
    std::istringstream in(read_file(dir.path + "/rank." + std::to_string(rank)));
    int fn_rank = -1, env_rank = -1, world = -1, local = -1, pid = -1;
    std::string port;
    in >> fn_rank >> env_rank >> world >> local >> port >> pid;
    CHECK(fn_rank == rank);
    CHECK(env_rank == rank);
    CHECK(world == 3);
    CHECK(local == rank);
    CHECK(pid != getpid());  // ran in a child
    ports.insert(port);
    pids.insert(pid);
  }
  CHECK(pids.size() == 3);
  REQUIRE(ports.size() == 1);
  CHECK(std::stoi(*ports.begin()) > 0);
  check_nothing_left(pids);
}

TEST_CASE("spawn: a rank that records a trace writes it before it leaves with _exit") {
  TempDir dir;
  trace::start(dir.path + "/run.json");
  dist::spawn(
      [](int rank) {
        trace::set_rank(rank, 2);  // what init_process_group does
        trace::complete(trace::Lane::Compute, "work of rank " + std::to_string(rank), 1.0, 2.0);
      },
      2);
  CHECK_FALSE(trace::enabled());  // this process recorded nothing: it writes no empty trace at exit
  for (int rank = 0; rank < 2; ++rank) {
    const std::string part = read_file(dir.path + "/run.rank" + std::to_string(rank) + ".json");
    CHECK_MESSAGE(contains(part, "\"name\":\"work of rank " + std::to_string(rank) + "\""), part);
    CHECK_MESSAGE(!contains(part, "work of rank " + std::to_string(1 - rank)), part);
  }
  // One rank is a world of one: its file is run.json itself, and stays its own.
  trace::start(dir.path + "/one.json");
  dist::spawn([](int) { trace::complete(trace::Lane::Compute, "work of the only rank", 1.0, 2.0); }, 1);
  CHECK_FALSE(trace::enabled());
  CHECK(contains(read_file(dir.path + "/one.json"), "work of the only rank"));
  // A rank that fails before init_process_group names it still writes its own file, not the
  // world-of-one run.json.
  trace::start(dir.path + "/failed.json");
  CHECK_THROWS_AS(dist::spawn(
                      [](int rank) {
                        if (rank == 1) throw std::runtime_error("failed early");
                      },
                      2),
                  nanoddp::DistError);
  CHECK_FALSE(trace::enabled());
  CHECK(::access((dir.path + "/failed.json").c_str(), F_OK) != 0);
  CHECK(contains(read_file(dir.path + "/failed.rank1.json"), "{\"otherData\":{\"rank\":1,\"world_size\":2"));
}

TEST_CASE("spawn: a signal while the ranks are stopped after a failure is named with the failure") {
  // Rank 0 ignores SIGTERM, then writes a file; rank 1 throws once it sees the file. SIGINT 0.5
  // s later comes while the launcher waits out rank 0's grace period (the group is alive from
  // before the first fork to that end, so the signal is always its): the failure is still the
  // error, and says so.
  TempDir dir;
  const std::string ready = dir.path + "/ready";
  auto wait_for = [](const std::string& path) {
    for (int i = 0; i < 400 && ::access(path.c_str(), F_OK) != 0; ++i) std::this_thread::sleep_for(50ms);
  };
  dist::SpawnOptions options;
  options.grace_period = 3s;
  options.allow_threads = true;  // the signalling thread below
  std::thread signaller([&] {
    wait_for(ready);
    std::this_thread::sleep_for(500ms);
    kill(getpid(), SIGINT);
  });
  std::string message;
  try {
    dist::spawn(
        [&](int rank) {
          if (rank == 1) {
            wait_for(ready);
            throw std::runtime_error("rank 1 broke");
          }
          signal(SIGTERM, SIG_IGN);
          std::ofstream(ready) << "ready\n";
          std::this_thread::sleep_for(30s);
        },
        2, options);
  } catch (const nanoddp::DistError& e) {
    message = e.what();
  }
  signaller.join();
  CHECK_MESSAGE(contains(message, "rank 1 broke"), message);
  CHECK_MESSAGE(contains(message, "SIGINT came while they were stopping"), message);
}

TEST_CASE("spawn: a rank that throws fails the job fast, naming it and its exception") {
  TempDir dir;
  dist::SpawnOptions options;
  options.grace_period = 1s;
  const auto started = Clock::now();
  std::string message;
  try {
    dist::spawn(
        [&](int rank) {
          std::ofstream(dir.path + "/pid." + std::to_string(rank)) << getpid();
          if (rank == 1) {
            std::this_thread::sleep_for(200ms);
            throw std::runtime_error("bad batch at rank 1");
          }
          std::this_thread::sleep_for(60s);
        },
        3, options);
  } catch (const nanoddp::DistError& e) {
    message = e.what();
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  CHECK(seconds < 10);
  CHECK_MESSAGE(contains(message, "spawn: rank 1 (pid "), message);
  CHECK_MESSAGE(contains(message, "exit code 1: bad batch at rank 1"), message);
  check_nothing_left(recorded_pids(dir.path, 3));
}

TEST_CASE("spawn: a signal death, a timeout, and live threads are reported") {
  SUBCASE("signal") {
    std::string message;
    try {
      dist::spawn([](int rank) {
        if (rank == 0) kill(getpid(), SIGKILL);
      }, 2);
    } catch (const nanoddp::DistError& e) {
      message = e.what();
    }
    CHECK_MESSAGE(contains(message, "rank 0 (pid "), message);
    CHECK_MESSAGE(contains(message, "killed by signal SIGKILL"), message);
  }
  SUBCASE("timeout") {
    dist::SpawnOptions options;
    options.timeout = 300ms;
    options.grace_period = 200ms;
    const auto started = Clock::now();
    CHECK_THROWS_AS(dist::spawn([](int) { std::this_thread::sleep_for(60s); }, 2, options), nanoddp::TimeoutError);
    CHECK(Clock::now() - started < 5s);
  }
  SUBCASE("threads") {
    std::mutex mutex;
    std::condition_variable cv;
    bool stop = false;
    std::thread worker([&] {
      std::unique_lock<std::mutex> lock(mutex);
      cv.wait(lock, [&] { return stop; });
    });
    CHECK_THROWS_AS(dist::spawn([](int) {}, 2), nanoddp::DistError);
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    cv.notify_all();
    worker.join();
  }
  SUBCASE("bad nprocs") {
    CHECK_THROWS_AS(dist::spawn([](int) {}, 0), nanoddp::ValueError);
    CHECK_THROWS_AS(dist::spawn([](int) {}, dist::kMaxProcPerNode + 1), nanoddp::ValueError);
  }
}

// ---- the right rank named, the innermost launcher, options, orphans, two jobs on one port ----

namespace {

// Sets variables for the life of the object (the launcher under test inherits them).
struct ScopedEnv {
  std::vector<std::string> names;
  explicit ScopedEnv(const std::vector<std::pair<std::string, std::string>>& vars) {
    for (const auto& [name, value] : vars) {
      setenv(name.c_str(), value.c_str(), 1);
      names.push_back(name);
    }
  }
  ~ScopedEnv() {
    for (const auto& name : names) unsetenv(name.c_str());
  }
};

// The "rank R of W backend B sum S" lines of launch_probe report, without their prefixes.
std::set<std::string> probe_reports(const std::string& out) {
  std::set<std::string> reports;
  for (const std::string& line : lines_of(out)) {
    const size_t at = line.find("] rank ");
    if (at != std::string::npos) reports.insert(line.substr(at + 2));
  }
  return reports;
}

std::set<std::string> expected_reports(int world, const std::string& backend) {
  std::set<std::string> reports;
  const int sum = world * (world + 1) / 2;
  for (int rank = 0; rank < world; ++rank)
    reports.insert("rank " + std::to_string(rank) + " of " + std::to_string(world) + " backend " + backend + " sum " +
                   std::to_string(sum));
  return reports;
}

}  // namespace

TEST_CASE("a peer lost during the collective check's exchange: the survivor's error names the collective it called") {
  // On shm the check's fingerprints travel by an all_gather of int64s before the all_reduce;
  // the error of the rank left behind leads with its all_reduce, then says whom it lost.
  const RunResult r = run({launcher_path(), "--nproc-per-node", "2", "--backend", "shm", probe_path(), "fail", "1", "7"},
                          60s);
  CHECK_MESSAGE(r.code() == 7, r.err);
  CHECK_MESSAGE(contains(r.err, "[rank 0] launch_probe: rank 0/2 on "), r.err);
  CHECK_MESSAGE(contains(r.err, ": shm all_reduce(sum) of [1] float32 (4 bytes) on cpu, while comparing it with the "
                                "other ranks' collective #"),
                r.err);
  CHECK_MESSAGE(contains(r.err, "lost rank 1 (pid "), r.err);
}

TEST_CASE("nanoddp-run: the rank that failed first is named and decides the exit code, not a peer that lost it") {
  // Rank `culprit` exits 7 on its own; every other rank then fails too, by losing it. The
  // launcher must name the culprit every time, however the exits are ordered when it wakes.
  for (int world : {2, 4}) {
    for (int trial = 0; trial < 5; ++trial) {
      const int culprit = trial % 2 == 0 ? world - 1 : 1;
      CAPTURE(world);
      CAPTURE(culprit);
      const RunResult r = run({launcher_path(), "--nproc-per-node", std::to_string(world), "--backend", "gloo",
                               probe_path(), "fail", std::to_string(culprit), "7"},
                              60s);
      CHECK_MESSAGE(r.code() == 7, r.err);
      const std::string named = "nanoddp-run: rank " + std::to_string(culprit) + " (pid ";
      CHECK_MESSAGE(contains(r.err, named), r.err);
      const size_t line = r.err.find(named);
      CHECK_MESSAGE(r.err.substr(line, r.err.find('\n', line) - line).find(") failed: exit code 7") != std::string::npos,
                    r.err);
      // A peer's own error names whom it lost: rank, pid and host, not only an address.
      CHECK_MESSAGE(contains(r.err, "lost rank " + std::to_string(culprit) + " (pid "), r.err);
      CHECK_MESSAGE(contains(r.err, "also failed: exit code 1 (it lost rank "), r.err);
      // A Gloo job's errors speak of Gloo's collectives: the collective check's fingerprints
      // travel through a shm group of its own, which is not named as if it were the job's.
      CHECK_MESSAGE(!contains(r.err, "shm all_gather"), r.err);
    }
  }
}

TEST_CASE("nanoddp-run leaves nothing in $TMPDIR: jobs with and without a trace, a launcher killed by SIGKILL") {
  TempDir tmp, out;
  const ScopedEnv env({{"TMPDIR", tmp.path}});
  auto tmp_entries = [&] {
    std::vector<std::string> names;
    if (DIR* dir = ::opendir(tmp.path.c_str())) {
      while (dirent* entry = ::readdir(dir))
        if (std::string(entry->d_name) != "." && std::string(entry->d_name) != "..") names.push_back(entry->d_name);
      ::closedir(dir);
    }
    return names;
  };
  const RunResult plain = run({launcher_path(), "--nproc-per-node", "2", "true"}, 60s);
  CHECK(plain.code() == 0);
  CHECK(tmp_entries().empty());
  // Each rank kills the launcher: nothing of the launcher's own cleanup runs.
  const RunResult killed = run({launcher_path(), "--nproc-per-node", "2", "sh", "-c", "kill -KILL $PPID; sleep 5"}, 60s);
  CHECK(killed.code() == 128 + SIGKILL);
  CHECK(tmp_entries().empty());
  // A traced job: the ranks' parts go through $TMPDIR and are merged into the file; then gone.
  const std::string trace_path = out.path + "/toy.json";
  const RunResult traced =
      run({launcher_path(), "--nproc-per-node", "2", nanoddp::testing::built("examples/toy_ddp"), "--epochs", "1",
           "--trace", trace_path},
          120s);
  CHECK_MESSAGE(traced.code() == 0, traced.err);
  CHECK(::access(trace_path.c_str(), F_OK) == 0);
  CHECK(tmp_entries().empty());
}

TEST_CASE("nanoddp-run: a rank killed with SIGKILL is named and its 137 returned, on every backend, never a peer") {
  // The killed rank's peers fail by their own error at once (they ignore SIGTERM), often
  // before the launcher has seen the killed rank end: only their reports of whom they lost
  // let it name the right rank (Note [Launcher link]). Each rank is killed in turn.
  struct Setup {
    std::string backend;
    int trials;
  };
  for (const Setup& setup : {Setup{"shm", 3}, Setup{"gloo", 1}}) {
    for (int world : {2, 3}) {
      for (int victim = 0; victim < world; ++victim) {
        for (int trial = 0; trial < setup.trials; ++trial) {
          CAPTURE(setup.backend);
          CAPTURE(world);
          CAPTURE(victim);
          const RunResult r = run({launcher_path(), "--nproc-per-node", std::to_string(world), "--backend",
                                   setup.backend, probe_path(), "die", std::to_string(victim), std::to_string(3 + trial)},
                                  60s);
          CHECK_MESSAGE(r.code() == 137, r.err);
          CHECK_MESSAGE(contains(r.err, "nanoddp-run: rank " + std::to_string(victim) + " (pid "), r.err);
          const size_t named = r.err.find("nanoddp-run: rank " + std::to_string(victim) + " (pid ");
          const std::string line = r.err.substr(named, r.err.find('\n', named) - named);
          CHECK_MESSAGE(contains(line, ") failed: killed by signal SIGKILL"), r.err);
          // A peer that failed did so by losing the killed rank, directly or through the group's
          // abort. On shm every peer fails so (the abort reaches all); on Gloo a peer that was not
          // waiting on the killed rank may be ended by the launcher instead, and is not named.
          for (int peer = 0; peer < world; ++peer) {
            if (peer == victim) continue;
            CAPTURE(peer);
            const size_t at = r.err.find("nanoddp-run: rank " + std::to_string(peer) + " (pid ");
            if (setup.backend == "gloo" && at == std::string::npos) continue;
            REQUIRE_MESSAGE(at != std::string::npos, r.err);
            CHECK_MESSAGE(contains(r.err.substr(at, r.err.find('\n', at) - at),
                                   "also failed: exit code 1 (it lost rank " + std::to_string(victim) + ")"),
                          r.err);
          }
        }
      }
    }
  }
}

TEST_CASE("nanoddp-run: an outer launcher's variables never override the launcher's own") {
  // As if nanoddp-run ran inside `mpirun -np 1` or an srun step: Open MPI, PMIx, PMI and
  // Slurm all say "rank 0 of 1" (or 5 of 9) about the launcher process itself.
  ScopedEnv outer({{"OMPI_COMM_WORLD_SIZE", "1"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                   {"PMIX_RANK", "0"}, {"PMI_RANK", "0"}, {"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "9"},
                   {"SLURM_LOCALID", "5"}, {"RANK", "3"}, {"WORLD_SIZE", "9"},
                   // An outer nanoddp-run --backend mpi's, or a stale export in the shell.
                   {"NANODDP_BACKEND", "mpi"}});
  for (const std::string& backend : {std::string("gloo"), std::string("")}) {  // given, and auto
    CAPTURE(backend);
    std::vector<std::string> args = {launcher_path(), "--nproc-per-node", "2"};
    if (!backend.empty()) args.insert(args.end(), {"--backend", backend});
    args.insert(args.end(), {probe_path(), "report"});
    const RunResult r = run(args, 60s);
    CHECK_MESSAGE(r.code() == 0, r.err);
    // auto on one node is shm (every rank on this machine); the outer variables change nothing.
    CHECK(probe_reports(r.out) == expected_reports(2, backend.empty() ? "shm" : backend));
  }
  const RunResult vars = run({launcher_path(), "--nproc-per-node", "1", "sh", "-c",
                              "echo ${PMIX_RANK-unset} ${OMPI_COMM_WORLD_SIZE-unset} ${SLURM_PROCID-unset} $RANK "
                              "${NANODDP_BACKEND-unset}"});
  CHECK(vars.out == "[rank 0] unset unset unset 0 unset\n");
}

TEST_CASE("nanoddp-run under a real mpirun -np 1: the ranks still use the launcher's backend") {
  if (!on_path("mpirun")) {
    MESSAGE("skipped: no mpirun on PATH (Debian: openmpi-bin)");
    return;
  }
  ScopedEnv root({{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}});
  const std::string mpirun = [] {
    const RunResult where = run({"/bin/sh", "-c", "command -v mpirun"});
    return lines_of(where.out).at(0);
  }();
  const RunResult r = run({mpirun, "-np", "1", "--oversubscribe", launcher_path(), "--nproc-per-node", "2",
                           "--backend", "gloo", probe_path(), "report"},
                          90s);
  CHECK_MESSAGE(r.code() == 0, r.err);
  CHECK(probe_reports(r.out) == expected_reports(2, "gloo"));
}

TEST_CASE("nanoddp-run --backend takes effect; a program flag that contradicts it is an error naming both") {
  const RunResult clash = run({launcher_path(), "--nproc-per-node", "2", "--backend", "gloo", probe_path(), "report",
                               "--backend", "mpi"},
                              60s);
  CHECK(clash.code() == 1);
  CHECK_MESSAGE(contains(clash.err, "the program asks for backend mpi but the launcher was given --backend gloo"),
                clash.err);
#if NANODDP_WITH_MPI
  // The program's own --backend mpi under a launcher that starts ranks itself: each MPI sees a
  // world of 1. The advice is docs/backends.md's way to run MPI, the launcher's --backend mpi.
  const RunResult mpi = run({launcher_path(), "--nproc-per-node", "2", probe_path(), "report", "--backend", "mpi"}, 60s);
  CHECK(mpi.code() == 1);
  CHECK_MESSAGE(contains(mpi.err, "launch with nanoddp-run --nproc-per-node 2 --backend mpi (it starts the ranks "
                                  "through mpirun)"),
                mpi.err);
#endif
  // A CPU-only build has no NCCL: --backend nccl must fail saying so, not run Gloo quietly.
  const RunResult nccl = run({launcher_path(), "--nproc-per-node", "2", "--backend", "nccl", probe_path(), "report"},
                             60s);
  CHECK_FALSE(contains(nccl.out, "backend gloo"));
  const bool says_nccl = contains(nccl.err, "NCCL") || contains(nccl.err, "nccl");
  if (nccl.code() != 0) CHECK_MESSAGE(says_nccl, nccl.err);
}

TEST_CASE("--device cuda in a build without CUDA is a usage error; init_process_group says the build has no CUDA") {
  if (nanoddp::kernels::cuda_built()) {
    MESSAGE("skipped: this build has CUDA");
    return;
  }
  for (const char* device : {"cuda", "cuda:99"}) {
    CAPTURE(device);
    const RunResult r = run({nanoddp::testing::built("examples/toy_ddp"), "--device", device, "--epochs", "1"}, 60s);
    CHECK(r.code() == 2);
    CHECK_MESSAGE(contains(r.err, std::string("--device: ") + device +
                                      " needs a CUDA build, and this build of nanoddp has no CUDA"),
                  r.err);
    CHECK_FALSE(contains(r.err, "NCCL"));
  }
  // The library says it too, for a program that asks without a flag: a lone process is rank 0
  // of 1, not an unknown rank.
  nanoddp::dist::InitOptions options;
  options.device = nanoddp::Device::cuda(0);
  std::string message;
  try {
    nanoddp::dist::init_process_group(options);
  } catch (const nanoddp::DeviceError& e) {
    message = e.what();
  }
  CHECK_MESSAGE(contains(message, "this build of nanoddp has no CUDA"), message);
  CHECK_MESSAGE(contains(message, "rank 0/1 on "), message);
  CHECK_FALSE(nanoddp::dist::is_initialized());
}

TEST_CASE("a lone process picks shm, the backend of a one-node job, and is rank 0 of 1") {
  const RunResult r = run({probe_path(), "report"}, 60s);
  CHECK_MESSAGE(r.code() == 0, r.err);
  CHECK(r.out == "rank 0 of 1 backend shm sum 1\n");
}

TEST_CASE("nanoddp-run: unknown options are errors, torchrun's spellings work, -- ends the options") {
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--nproc", "2"}, {"--nproc-per-nodes=2"}, {"-n", "2"}, {"--rdzv-backend"}}) {
    std::vector<std::string> args = {launcher_path()};
    args.insert(args.end(), flags.begin(), flags.end());
    args.insert(args.end(), {"sh", "-c", "echo ran"});
    const RunResult r = run(args);
    CAPTURE(flags[0]);
    CHECK(r.code() == 2);
    CHECK_MESSAGE(contains(r.err, "nanoddp-run: unknown option '" + flags[0] + "'"), r.err);
    CHECK_FALSE(contains(r.out, "ran"));
  }
  CHECK(contains(run({launcher_path(), "--nproc", "2", "true"}).err, "(did you mean --nproc-per-node?)"));
  // --master begins --master-addr and --master-port: no guess between them.
  CHECK_FALSE(contains(run({launcher_path(), "--master", "x", "true"}).err, "did you mean"));
  const RunResult torchrun = run({launcher_path(), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--node_rank",
                                  "0", "sh", "-c", "echo $WORLD_SIZE $MASTER_ADDR"});
  CHECK(torchrun.code() == 0);
  const std::vector<std::string> printed = lines_of(torchrun.out);
  const std::set<std::string> lines(printed.begin(), printed.end());
  CHECK(lines == std::set<std::string>{"[rank 0] 2 127.0.0.1", "[rank 1] 2 127.0.0.1"});
  // torchrun's words for --nproc-per-node: cpu is one rank per CPU, auto the same without a
  // GPU, gpu an error without one.
  const std::string cpus = std::to_string(std::max(1u, std::thread::hardware_concurrency()));
  for (const char* word : {"cpu", "auto"}) {
    if (std::string(word) == "auto" && nanoddp::kernels::cuda::device_count() > 0) continue;
    const RunResult counted =
        run({launcher_path(), "--nproc_per_node", word, "sh", "-c", "echo $WORLD_SIZE"});
    CAPTURE(word);
    CHECK_MESSAGE(counted.code() == 0, counted.err);
    CHECK_MESSAGE(contains(counted.out, "[rank 0] " + cpus + "\n"), counted.out);
    CHECK(lines_of(counted.out).size() == std::stoul(cpus));
  }
  if (nanoddp::kernels::cuda::device_count() == 0) {
    const RunResult no_gpu = run({launcher_path(), "--nproc-per-node", "gpu", "sh", "-c", "echo ran"});
    CHECK(no_gpu.code() == 2);
    CHECK_MESSAGE(contains(no_gpu.err, "--nproc-per-node gpu: this machine has no usable GPU"), no_gpu.err);
    CHECK_FALSE(contains(no_gpu.out, "ran"));
  }
  // torchrun's --standalone is what nanoddp-run does anyway (one node, a free port).
  const RunResult standalone = run({launcher_path(), "--standalone", "--nproc_per_node", "2", "sh", "-c", "echo $RANK"});
  CHECK_MESSAGE(standalone.code() == 0, standalone.err);
  CHECK(lines_of(standalone.out).size() == 2);
  const RunResult two_nodes = run({launcher_path(), "--standalone", "--nnodes", "2", "true"});
  CHECK(two_nodes.code() == 2);
  CHECK_MESSAGE(contains(two_nodes.err, "--standalone is torchrun's one-node rendezvous"), two_nodes.err);
  // After --, a program whose name starts with '-' (a script named -x here) is the PROGRAM.
  TempDir dir;
  const std::string script = dir.path + "/-x";
  std::ofstream(script) << "#!/bin/sh\necho script $RANK\n";
  REQUIRE(chmod(script.c_str(), 0755) == 0);
  const RunResult dashed = run({"/bin/sh", "-c", "cd " + dir.path + " && PATH=.:$PATH exec " + launcher_path() + " -- -x"});
  CHECK_MESSAGE(dashed.out == "[rank 0] script 0\n", dashed.out, dashed.err);
}

TEST_CASE("nanoddp-run: SIGKILL of the launcher ends every rank within 2 s, silent ranks included") {
  // Modes: a rank that is the program itself; a program under `sh -c` (not its parent's
  // direct child); and the mpirun path. The ranks print nothing (a --quiet run), so no write
  // to a closed pipe would end them.
  struct Mode {
    std::string name;
    std::vector<std::string> launcher_flags;
    bool under_shell;
  };
  std::vector<Mode> modes = {{"program", {"--backend", "gloo"}, false}, {"sh -c", {"--backend", "gloo"}, true}};
  if (on_path("mpirun")) modes.push_back({"mpirun", {"--backend", "mpi"}, false});
  for (const Mode& mode : modes) {
    CAPTURE(mode.name);
    TempDir dir;
    std::vector<std::string> args = {launcher_path(), "--nproc-per-node", "2"};
    args.insert(args.end(), mode.launcher_flags.begin(), mode.launcher_flags.end());
    if (mode.under_shell) {
      args.insert(args.end(), {"sh", "-c", probe_path() + " sleep " + dir.path + "; echo never"});
    } else {
      args.insert(args.end(), {probe_path(), "sleep", dir.path});
    }
    std::set<int> pids;
    Clock::time_point killed;
    ScopedEnv root({{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}});
    run(args, 60s, [&](pid_t launcher) {
      for (int i = 0; i < 3000 && !(read_file(dir.path + "/pid.0").size() > 1 && read_file(dir.path + "/pid.1").size() > 1); ++i)
        std::this_thread::sleep_for(5ms);
      for (int rank = 0; rank < 2; ++rank) pids.insert(std::atoi(read_file(dir.path + "/pid." + std::to_string(rank)).c_str()));
      kill(launcher, SIGKILL);
      killed = Clock::now();
    });
    REQUIRE(pids.size() == 2);
    REQUIRE(pids.count(0) == 0);
    std::vector<int> alive;
    do {
      alive.clear();
      for (int pid : pids)
        if (!survivors({pid}).empty()) alive.push_back(pid);
      if (!alive.empty()) std::this_thread::sleep_for(20ms);
    } while (!alive.empty() && Clock::now() - killed < 2s);
    CHECK_MESSAGE(alive.empty(), alive.size(), " rank(s) still running 2 s after the launcher died");
    for (int pid : alive) kill(pid, SIGKILL);
  }
}

TEST_CASE("nanoddp-run: two jobs started together on one --master-port never hang and never mix") {
  // Whichever job's rank 0 binds the port runs (and holds it for a second); the other fails
  // fast, either because its rank 0 finds the port taken or because its other rank reaches the
  // first job's store and is refused by job id. Neither waits for a timeout, and the job that
  // runs sums its own ranks only.
  for (int trial = 0; trial < 3; ++trial) {
    CAPTURE(trial);
    const int port = dist::pick_free_port("127.0.0.1");
    const std::vector<std::string> args = {launcher_path(), "--nproc-per-node", "2", "--master-port",
                                           std::to_string(port), "--backend", "gloo", probe_path(), "report",
                                           "--hold-ms", "1000"};
    RunResult second;
    std::thread other([&] { second = run(args, 60s); });
    const RunResult first = run(args, 60s);
    other.join();
    CHECK(first.seconds < 30);
    CHECK(second.seconds < 30);
    CHECK((first.code() == 0) != (second.code() == 0));
    const RunResult& ran = first.code() == 0 ? first : second;
    const RunResult& refused = first.code() == 0 ? second : first;
    CHECK(probe_reports(ran.out) == expected_reports(2, "gloo"));
    CHECK(probe_reports(refused.out).empty());
    const bool told_why = contains(refused.err, "is already in use") || contains(refused.err, "this store serves job");
    CHECK_MESSAGE(told_why, refused.err);
  }
  // A launcher whose ranks reach another job's store for sure: the second node of a 2-node
  // job (no rank 0 of its own), pointed at the port of a running one-node job.
  const int port = dist::pick_free_port("127.0.0.1");
  RunResult stray;
  const RunResult job = run({launcher_path(), "--nproc-per-node", "2", "--master-port", std::to_string(port), "--backend",
                             "gloo", probe_path(), "report", "--hold-ms", "1500"},
                            60s, [&](pid_t) {
                              std::this_thread::sleep_for(300ms);  // the job's store is up
                              ScopedEnv other({{"NANODDP_JOB_ID", "other-job"}, {"NANODDP_STORE_TOKEN", "not-the-job-token"}});
                              stray = run({launcher_path(), "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2",
                                           "--master-port", std::to_string(port), "--backend", "gloo", probe_path(),
                                           "report"},
                                          60s);
                            });
  CHECK_MESSAGE(job.code() == 0, job.err);
  CHECK(probe_reports(job.out) == expected_reports(2, "gloo"));
  CHECK(stray.code() == 1);
  CHECK(stray.seconds < 10);
  CHECK_MESSAGE(contains(stray.err, "not this rank's job 'other-job' (NANODDP_JOB_ID): two jobs use MASTER_PORT " +
                                        std::to_string(port)),
                stray.err);
}

TEST_CASE("nanoddp-run: a failed rank's last lines come before the launcher's report of its failure") {
  // stderr alone: the rank's lines and the launcher's reports share it, in the order written.
  for (int run_index = 0; run_index < 20; ++run_index) {
    CAPTURE(run_index);
    const RunResult r = run({launcher_path(), "--nproc-per-node", "3", "sh", "-c", "echo \"boom from $RANK\" >&2; exit 3"});
    REQUIRE(r.code() == 3);
    const size_t reported = r.err.find(") failed: exit code 3");
    REQUIRE(reported != std::string::npos);
    const size_t name_at = r.err.rfind("rank ", reported);
    REQUIRE(name_at != std::string::npos);
    const std::string rank = r.err.substr(name_at + 5, r.err.find(' ', name_at + 5) - (name_at + 5));
    const size_t own = r.err.find("[rank " + rank + "] boom from " + rank);
    CHECK_MESSAGE((own != std::string::npos && own < reported), r.err);
  }
}

TEST_CASE("nanoddp-run: two nodes given one --node-rank: the second is refused as such, and the job ends at once") {
  // Three nodes of one rank each; node 2 is never started, node 1 twice. Without the refusal,
  // rank 0 would wait out init's 30 s timeout for rank 2. On shm every wait of the rendezvous
  // is the store's (Gloo's may be a connect to a rank that has already failed and gone).
  const int port = dist::pick_free_port("127.0.0.1");
  auto node = [&](int node_rank) {
    return run({launcher_path(), "--nnodes", "3", "--node-rank", std::to_string(node_rank), "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", std::to_string(port), "--backend", "shm", probe_path(),
                "report"},
               60s);
  };
  RunResult first, one, other;
  std::thread node0([&] { first = node(0); });
  std::thread node1([&] { one = node(1); });
  other = node(1);
  node0.join();
  node1.join();
  // Whichever of the two reached the store second is the one refused.
  const bool other_refused = contains(other.err, "refused: rank 1 is already held by pid ");
  const RunResult& refused = other_refused ? other : one;
  const RunResult& holder = other_refused ? one : other;
  CHECK(refused.code() == 1);
  CHECK_MESSAGE(contains(refused.err, "refused: rank 1 is already held by pid "), refused.err);
  CHECK_MESSAGE(contains(refused.err, "two processes claim one rank (one --node-rank given to two nodes"), refused.err);
  for (const RunResult* r : {static_cast<const RunResult*>(&first), &holder}) {
    CHECK(r->code() == 1);
    CHECK(r->seconds < 20);
    CHECK_MESSAGE(contains(r->err, "the store refused a second rank 1 (pid "), r->err);
  }
}

TEST_CASE("nanoddp-run: a rank that fails by losing a stopped rank is named, and the stopped rank is said to be stuck") {
  // Rank 1 stops itself; rank 0's all_reduce times out and reports it lost rank 1, which is
  // still alive when the blame window (the grace period) ends.
  const RunResult r = run({launcher_path(), "--nproc-per-node", "2", "--grace-period", "1", probe_path(), "stop", "1", "3"},
                          60s);
  CHECK_MESSAGE(r.code() == 1, r.err);
  CHECK_MESSAGE(contains(r.err, ") failed: exit code 1 (it lost rank 1); rank 1 (pid "), r.err);
  CHECK_MESSAGE(contains(r.err, "), which it lost, was still running 1 s later (stopped: SIGSTOP or Ctrl-Z)"), r.err);
}

TEST_CASE(
    "nanoddp-run --backend mpi: Ctrl-C returns only once mpirun's ranks have ended, and mpirun's answer is "
    "no failure") {
  if (!on_path("mpirun")) {
    MESSAGE("skipped: no mpirun on PATH (Debian: openmpi-bin)");
    return;
  }
  TempDir dir;
  // MPI programs: mpirun exits before they have ended (Note [mpirun's ranks]).
  const RunResult r =
      run({launcher_path(), "--nproc-per-node", "2", "--backend", "mpi", probe_path(), "sleep", dir.path},
          30s, [&](pid_t launcher) {
            wait_for_ranks(dir.path, 2);
            kill(launcher, SIGINT);
          });
  CHECK(r.code() == 128 + SIGINT);
  CHECK_MESSAGE(
      contains(r.err, "received SIGINT; sending SIGINT to mpirun (which passes it on), SIGKILL after 5 s"),
      r.err);
  // mpirun exits 1 after passing SIGINT on: its answer, not a failure to name.
  CHECK_MESSAGE(!contains(r.err, "failed"), r.err);
  CHECK(r.seconds < 10);
  // At once, not within check_nothing_left's allowance: the launcher has already waited.
  const std::vector<int> alive = survivors(recorded_pids(dir.path, 2));
  CHECK_MESSAGE(alive.empty(), alive.size(), " rank(s) still running when the launcher returned");
}

TEST_CASE(
    "nanoddp-run --backend mpi: a process a rank left behind in a session of its own ends before the "
    "launcher returns") {
  if (!on_path("mpirun")) {
    MESSAGE("skipped: no mpirun on PATH (Debian: openmpi-bin)");
    return;
  }
  TempDir dir;
  // The rank starts a process out of every process group mpirun or the launcher would signal
  // (setsid), which ignores SIGTERM, and exits 0: mpirun ends at once, and the process would
  // outlive the job but for the launcher's wait (Note [mpirun's ranks]).
  const RunResult r =
      run({launcher_path(), "--nproc-per-node", "1", "--backend", "mpi", "--grace-period", "1", "sh", "-c",
           "setsid sh -c \"trap '' TERM; echo \\$\\$ > " + dir.path +
               "/pid.0; exec sleep 60\" > /dev/null 2>&1 < /dev/null & sleep 0.3; exit 0"},
          30s);
  CHECK_MESSAGE(r.code() == 0, r.err);
  CHECK_MESSAGE(
      contains(r.err,
               "1 process(es) that mpirun started were still running 1 s after it ended; sending SIGKILL"),
      r.err);
  CHECK(r.seconds < 10);
  const std::vector<int> alive = survivors(recorded_pids(dir.path, 1));
  CHECK_MESSAGE(alive.empty(), "the left-behind process (pid ", alive.empty() ? 0 : alive[0],
                ") outlived the launcher");
}

TEST_CASE("nanoddp-run --backend mpi: an mpirun that outlives every rank it started is stopped, and the job fails") {
  // Open MPI 4's mpirun can hang in its own shutdown after a rank exited 0 without finishing
  // MPI. A stand-in on PATH does the same every time: its one rank ends, it sleeps on.
  TempDir dir;
  {
    std::ofstream fake(dir.path + "/mpirun");
    fake << "#!/bin/sh\nsh -c 'sleep 1; exit 0' &\nexec sleep 60\n";
  }
  REQUIRE(chmod((dir.path + "/mpirun").c_str(), 0755) == 0);
  const RunResult r = run({"/bin/sh", "-c",
                           "PATH=" + dir.path + ":$PATH exec " + launcher_path() +
                               " --backend mpi --nproc-per-node 2 --grace-period 1 /bin/true"},
                          30s);
  CHECK_MESSAGE(r.code() == 1, r.err);
  // The grace period, but never under 5 s: mpirun's own shutdown on a loaded machine is no hang.
  CHECK_MESSAGE(contains(r.err, "still running 5 s after every process it started had ended"), r.err);
  CHECK_MESSAGE(contains(r.err, "the job fails; sending SIGTERM to mpirun"), r.err);
  CHECK(r.seconds < 15);
}
