// How far apart two CPUs are, as shared memory sees it: two processes, pinned to the first two
// CPUs this process may use, pass one cache line back and forth, and the median round trip is
// printed. benchmarks/run measures it around each world-2 run (Note [Core placement] there):
// on a VM whose host sometimes gives its two vCPUs one L3 cache and sometimes two, every
// byte one rank hands the other costs several times more in the second case, and this is
// the number that tells the two apart (~65 ns against ~340 ns on an AMD EPYC host).
//
//   build/benchmarks/core_round_trip        # one JSON line: the CPUs and the round trip in ns
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <vector>

#include "benchmarks/no_arguments.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kStop = 0xffffffffu;
constexpr int kBatches = 9;
constexpr uint32_t kRoundTripsPerBatch = 10'000;
// Far longer than a batch takes even with both processes on one busy CPU; a peer that never
// answers (killed, stopped) ends the run with an error instead of a hang.
constexpr auto kPeerTimeout = std::chrono::seconds(10);

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Spins until *word is `value` (true) or kStop or the timeout (false). `gone`, checked now
// and then, says whether the peer has ended: then there is nothing to wait for (false).
template <typename Gone>
bool wait_for(const std::atomic<uint32_t>& word, uint32_t value, Gone&& gone) {
  const auto deadline = Clock::now() + kPeerTimeout;
  for (uint32_t i = 1;; ++i) {
    const uint32_t seen = word.load(std::memory_order_acquire);
    if (seen == value) return true;
    if (seen == kStop) return false;
    if (i % 4096 == 0 && (Clock::now() > deadline || gone())) return false;
    cpu_relax();
  }
}

bool pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return ::sched_setaffinity(0, sizeof set, &set) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (const int status = nanoddp::benchmarks::refuse_arguments(
          argc, argv,
          "core_round_trip prints one JSON line: the median time for two processes on the first two usable CPUs "
          "to pass a cache line there and back (ns)");
      status >= 0)
    return status;
  cpu_set_t allowed;
  if (::sched_getaffinity(0, sizeof allowed, &allowed) != 0) {
    std::perror("core_round_trip: sched_getaffinity");
    return 1;
  }
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE && cpus.size() < 2; ++cpu)
    if (CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
  if (cpus.size() < 2) {
    std::fprintf(stderr, "core_round_trip: this process may use %zu CPU; it needs two\n", cpus.size());
    return 1;
  }

  // The pinger writes odd counts, the ponger answers with the next even one.
  void* page = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) {
    std::perror("core_round_trip: mmap");
    return 1;
  }
  auto* word = new (page) std::atomic<uint32_t>(0);
  const pid_t parent = ::getpid();
  const pid_t ponger = ::fork();
  if (ponger < 0) {
    std::perror("core_round_trip: fork");
    return 1;
  }
  if (ponger == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a parent stopped by Ctrl-C takes its ponger with it
    if (::getppid() != parent) ::_exit(0);  // the parent ended before prctl
    if (!pin_to(cpus[1])) ::_exit(3);
    for (uint32_t count = 1;; count += 2) {
      if (!wait_for(*word, count, [] { return false; })) ::_exit(0);
      word->store(count + 1, std::memory_order_release);
    }
  }

  const bool pinned = pin_to(cpus[0]);
  bool ok = pinned;
  int status = 0;
  bool reaped = false;  // the ponger ended early (failed to pin, or was killed)
  auto ponger_gone = [&] { return reaped = ::waitpid(ponger, &status, WNOHANG) == ponger; };
  std::vector<double> ns;
  uint32_t count = 1;
  for (int batch = 0; ok && batch < kBatches; ++batch) {
    const auto start = Clock::now();
    for (uint32_t i = 0; ok && i < kRoundTripsPerBatch; ++i, count += 2) {
      word->store(count, std::memory_order_release);
      ok = wait_for(*word, count + 1, ponger_gone);
    }
    ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - start).count() / kRoundTripsPerBatch);
  }
  word->store(kStop, std::memory_order_release);
  // A ponger that did not answer may be stopped or stuck: it could never see kStop.
  if (!reaped) {
    if (!ok) ::kill(ponger, SIGKILL);
    ::waitpid(ponger, &status, 0);
  }
  const bool ponger_pinned = !(reaped && WIFEXITED(status) && WEXITSTATUS(status) == 3);
  if (!pinned || !ponger_pinned) {
    std::fprintf(stderr, "core_round_trip: could not pin a process to CPU %d\n", pinned ? cpus[1] : cpus[0]);
    return 1;
  }
  if (reaped) {
    std::fprintf(stderr, "core_round_trip: the process on CPU %d ended in the middle of the run (%s %d)\n",
                 cpus[1], WIFSIGNALED(status) ? "killed by signal" : "exit status",
                 WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    return 1;
  }
  if (!ok) {
    // Either side may have been held (stopped, or starved of its CPU) for the whole timeout.
    std::fprintf(stderr, "core_round_trip: no round trip between CPUs %d and %d completed within 10 s\n", cpus[0],
                 cpus[1]);
    return 1;
  }
  std::nth_element(ns.begin(), ns.begin() + kBatches / 2, ns.end());
  std::printf("{\"example\":\"core_round_trip\",\"cpus\":[%d,%d],\"round_trip_ns\":%.1f}\n", cpus[0], cpus[1],
              ns[kBatches / 2]);
  return 0;
}
