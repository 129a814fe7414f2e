// Fault injection for the fault tests: NANODDP_FAULT_KILL_AT=RANK:STEP makes rank RANK send
// itself SIGKILL (kill -9, no cleanup) when it is about to take global optimizer step STEP
// (0-based: after STEP steps are done), in the group's first start only (NANODDP_RESTART_COUNT
// unset or 0), so that a group restarted by `nanoddp-run --max-restarts` runs past it.
// NANODDP_FAULT_STOP_AT=RANK:STEP sends SIGSTOP instead: the rank stays alive and never comes
// back, a straggler its peers must name (Note [Naming the straggler] in
// dist/process_group_checked.cpp).
//
//   NANODDP_FAULT_KILL_AT=1:13 nanoddp-run --max-restarts 1 --nproc-per-node 2
//       build/examples/fashion_mnist --checkpoint run.ckpt --checkpoint-every 5   (one line)
#pragma once

#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "dist/init.h"

namespace nanoddp::examples {

inline constexpr const char* kFaultKillAtEnv = "NANODDP_FAULT_KILL_AT";
inline constexpr const char* kFaultStopAtEnv = "NANODDP_FAULT_STOP_AT";

// Which start of the group this is: NANODDP_RESTART_COUNT, 0 when unset. Throws ValueError
// naming the variable when it is not a non-negative integer.
inline int restart_count() {
  const char* text = std::getenv(dist::kRestartCountEnv);
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  NANODDP_CHECK(*end == '\0' && value >= 0 && value < (1L << 30), ValueError, dist::kRestartCountEnv, "='", text,
                "' is not a restart count (0, 1, ...)");
  return static_cast<int>(value);
}

// The step at which `rank` of `world_size` must act on `variable` (one of the two above), or
// -1. Throws ValueError naming the variable when it is not RANK:STEP, or names a rank the job
// does not have or a step past its `total_steps`: a fault that could never fire would let a
// fault test pass without one.
inline int64_t fault_step(const char* variable, int rank, int world_size, int64_t total_steps) {
  const char* text = std::getenv(variable);
  if (text == nullptr || *text == '\0' || restart_count() > 0) return -1;
  char* end = nullptr;
  const long victim = std::strtol(text, &end, 10);
  NANODDP_CHECK(*end == ':', ValueError, variable, "='", text, "' is not RANK:STEP");
  const char* step_text = end + 1;
  const long long step = std::strtoll(step_text, &end, 10);
  NANODDP_CHECK(*end == '\0' && end != step_text && victim >= 0 && step >= 0, ValueError, variable, "='",
                text, "' is not RANK:STEP (two non-negative integers)");
  NANODDP_CHECK(victim < world_size && step < total_steps, ValueError, variable, "='", text, "' names ",
                victim < world_size ? "step " + std::to_string(step) : "rank " + std::to_string(victim),
                ", but this run has ",
                victim < world_size ? "steps 0.." + std::to_string(total_steps - 1)
                                    : "ranks 0.." + std::to_string(world_size - 1),
                ": the fault would never happen");
  return victim == rank ? static_cast<int64_t>(step) : -1;
}

inline int64_t fault_kill_step(int rank, int world_size, int64_t total_steps) {
  return fault_step(kFaultKillAtEnv, rank, world_size, total_steps);
}
inline int64_t fault_stop_step(int rank, int world_size, int64_t total_steps) {
  return fault_step(kFaultStopAtEnv, rank, world_size, total_steps);
}

// Called before each step: dies as NANODDP_FAULT_KILL_AT asks (kill_step from fault_kill_step).
inline void kill_if_fault_injected(int64_t kill_step, int rank, int64_t step) {
  if (kill_step < 0 || step != kill_step) return;
  std::fprintf(stderr, "rank %d: %s: SIGKILL before step %lld\n", rank, kFaultKillAtEnv, static_cast<long long>(step));
  std::fflush(stderr);
  ::kill(::getpid(), SIGKILL);
}

// Called before each step: stops as NANODDP_FAULT_STOP_AT asks (stop_step from fault_stop_step).
inline void stop_if_fault_injected(int64_t stop_step, int rank, int64_t step) {
  if (stop_step < 0 || step != stop_step) return;
  std::fprintf(stderr, "rank %d: %s: SIGSTOP before step %lld\n", rank, kFaultStopAtEnv, static_cast<long long>(step));
  std::fflush(stderr);
  ::kill(::getpid(), SIGSTOP);
}

}  // namespace nanoddp::examples
