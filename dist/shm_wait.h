// How a rank of the shared-memory group waits for its peers: ShmSegment::wait_until, a spin
// and then a futex sleep on the rank's doorbell (Note [Shm waiting]). A template, so it sits in
// a header for the files that wait; the doorbells, the abort flag and the liveness checks it
// calls are in shm_wait.cpp. Internal: not a public header.
//
//   shm.wait_until([&] { return shm.all_reached(phase); }, /*peer=*/-1, deadline, what);
//
// Note [Shm waiting]
// A rank that waits spins for kSpinTime, then sleeps on a futex in its own Doorbell. The spin
// is long enough to cover how far apart DDP's ranks reach a bucket's all-reduce (a few
// hundred microseconds in a 1 ms step): a rank that fell asleep pays a wake-up on every
// step. Measured side by side on an idle 2-core machine, 2 ranks training the MLP on shm:
// 500 us gave 7-16% more samples/s than 20 us in 4 of 4 pairs. The spin calls
// sched_yield(), not a pause instruction: when the peer it waits for shares its core (more
// ranks than free cores, a busy machine) the peer runs at once instead of after our time
// slice. Measured on a loaded 2-core machine, 2 ranks, 4 KB: ~60 us with yield, ~400 us with
// pause (and ~2 ms when the pause spin lasted 200 us). A rank that changes a counter somebody
// may wait on rings that rank's doorbell: a fetch_add, plus a FUTEX_WAKE only when the rank says it is
// asleep. So 2 ranks on 2 cores never take the core that the other needs for its part of the
// work. Sleeps are cut into kWatchInterval slices to check the deadline, the abort flag and
// whether the awaited peer is still alive (a dead peer is reported within a slice, not after
// the whole timeout). A wait inside a collective that times out names, besides the rank it
// waited on, the ranks that have not begun that collective (RankInfo::collectives_begun): in
// a ring, the neighbour waited on may itself be waiting for the rank that never came.
#pragma once

#include <linux/futex.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "core/error.h"
#include "dist/shm_segment.h"

namespace nanoddp::dist::shm {

// The futex system call on a word of the segment.
long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout);

template <typename Ready>
void ShmSegment::wait_until(Ready&& ready, int peer, Clock::time_point deadline, const std::string& what) {
  const auto spin_end = Clock::now() + kSpinTime;
  for (int i = 0;; ++i) {
    if (ready()) return;
    if ((i & 15) == 15 && Clock::now() > spin_end) break;
    ::sched_yield();
  }
  Doorbell& bell = info(rank_).bell;
  while (true) {
    // First: a peer may have posted its last piece and exited; what it left still counts.
    if (ready()) return;
    check_abort(what);
    auto now = Clock::now();
    if (now >= deadline) {
      // The rank waited on may itself be waiting for one that never came: name that one too.
      const std::string waited = (peer >= 0 ? "rank " + std::to_string(peer) : "a peer") + behind_note(peer);
      mark_aborted(what + ": rank " + std::to_string(rank_) + " timed out waiting for " + waited, -1,
                   /*timed_out=*/true);
      NANODDP_THROW(TimeoutError, what, ": did not complete within ", wait_timeout.count(),
                    " ms (waiting for ", waited, "; a peer may have exited or be out of step)");
    }
    // A peer may also post its last piece and exit between the ready() above and this
    // check, or during it: once it is seen dead, everything it posted is visible, so look
    // again then, and only then call it lost (it posts before it exits).
    if (!peers_alive(peer)) {
      if (ready()) return;
      check_alive(peer, what);
    }
    const uint32_t rings = bell.rings.load();
    bell.sleepers.fetch_add(1);
    if (ready()) {
      bell.sleepers.fetch_sub(1);
      return;
    }
    auto slice = std::min<Clock::duration>(deadline - now, kWatchInterval);
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    // Returns at once if a ring came after `rings` was read: no wake-up is lost.
    futex(&bell.rings, FUTEX_WAIT, rings, &ts);
    bell.sleepers.fetch_sub(1);
    if (ready()) return;
  }
}

}  // namespace nanoddp::dist::shm
