// What the shared-memory group's waiting is made of (Note [Shm waiting] in shm_wait.h): the
// futex doorbells a rank rings and sleeps on, the abort flag that ends every rank's wait with
// the first rank's reason, and the checks that a peer is still alive.
#include "dist/shm_wait.h"

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>

#include "dist/detail.h"
#include "dist/launcher_link.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace nanoddp::dist::shm {

namespace {

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

}  // namespace

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

bool process_alive(int pid) {
  const char state = detail::process_state(pid);
  if (state == '\0') return ::kill(pid, 0) == 0 || errno == EPERM;
  return state != 'Z' && state != 'X';
}

void ShmSegment::ring(int r, bool always_wake) {
  Doorbell& bell = info(r).bell;
  bell.rings.fetch_add(1);
  if (always_wake || bell.sleepers.load() > 0) futex(&bell.rings, FUTEX_WAKE, INT32_MAX, nullptr);
}

void ShmSegment::doze(uint32_t since, int peer, Clock::time_point deadline, const std::string& what) {
  wait_until([&] { return info(rank_).bell.rings.load() != since; }, peer, deadline, what);
}

void ShmSegment::mark_aborted(const std::string& why, int lost_rank, bool timed_out) {
  uint32_t expected = 0;
  if (header_->abort_state.compare_exchange_strong(expected, 1)) {
    std::snprintf(header_->abort_message, kAbortMessageBytes, "%s", why.c_str());
    header_->abort_rank = rank_;
    header_->abort_lost_rank = lost_rank;
    header_->abort_timed_out = timed_out ? 1 : 0;
    header_->abort_state.store(2);
    for (int r = 0; r < world_size_; ++r)
      if (r != rank_) ring(r, /*always_wake=*/true);
  }
}

void ShmSegment::abort(const std::string& why, int lost_rank) {
  mark_aborted(why, lost_rank);
  NANODDP_THROW(DistError, why);
}

void ShmSegment::check_abort(const std::string& what) {
  if (header_->abort_state.load(std::memory_order_acquire) == 0) return;
  while (header_->abort_state.load() != 2) cpu_relax();  // the message is being written
  // Said before the throw, as Note [Launcher link] needs: this rank fails by that loss too.
  if (header_->abort_lost_rank >= 0) report_lost_peer(rank_, header_->abort_lost_rank);
  if (header_->abort_timed_out != 0)
    NANODDP_THROW(TimeoutError, what, ": the group was aborted by rank ", header_->abort_rank, ": ",
                  header_->abort_message);
  NANODDP_THROW(DistError, what, ": the group was aborted by rank ", header_->abort_rank, ": ",
                header_->abort_message);
}

bool ShmSegment::peers_alive(int peer) {
  for (int r = peer < 0 ? 0 : peer; r < (peer < 0 ? world_size_ : peer + 1); ++r)
    if (r != rank_ && watch_pids_ && !process_alive(info(r).pid)) return false;
  return true;
}

void ShmSegment::check_alive(int peer, const std::string& what) {
  for (int r = peer < 0 ? 0 : peer; r < (peer < 0 ? world_size_ : peer + 1); ++r) {
    if (r == rank_ || !watch_pids_ || process_alive(info(r).pid)) continue;
    report_lost_peer(rank_, r);  // before the throw: Note [Launcher link]
    // Worded as the Gloo group words a lost peer: whom, and where.
    abort(what + ": lost rank " + std::to_string(r) + " (pid " + std::to_string(info(r).pid) + " on " +
              detail::host_name() + "): it exited in the middle of the job",
          r);
  }
}

void ShmSegment::begin_collective(uint64_t seq) {
  info(rank_).collectives_begun.store(seq + 1, std::memory_order_release);
  in_collective_ = true;
}

std::string ShmSegment::behind_note(int peer) {
  if (!in_collective_) return "";
  const uint64_t mine = info(rank_).collectives_begun.load(std::memory_order_relaxed);
  std::vector<int> behind;
  for (int r = 0; r < world_size_; ++r)
    if (info(r).collectives_begun.load(std::memory_order_acquire) < mine) behind.push_back(r);
  if (behind.empty() || behind == std::vector<int>{peer}) return "";  // nothing the wait did not say
  std::string names;
  for (size_t i = 0; i < behind.size(); ++i)
    names += (i == 0 ? "" : i + 1 == behind.size() ? " and " : ", ") + std::to_string(behind[i]);
  return std::string("; ") + (behind.size() == 1 ? "rank " : "ranks ") + names +
         (behind.size() == 1 ? " has" : " have") + " not begun it";
}

}  // namespace nanoddp::dist::shm
