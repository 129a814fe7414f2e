// spawn: run a function on N ranks, each in its own forked process (torch.multiprocessing.spawn).
//
//   dist::spawn([](int rank) { dist::init_process_group({dist::Backend::Gloo}); train(rank); }, 4);
//   // returns when all 4 ranks returned; throws DistError naming the first rank that failed
//   // (exception text included), after the others were terminated
//
// Fork safety: spawn() forks the calling process, and after fork() only the calling thread
// exists in the child. Call it before anything starts threads (a CUDA context, a process group,
// a thread pool): a lock held by another thread at fork time stays locked forever in the child,
// and CUDA cannot be used in a child forked after the parent initialised it. spawn() therefore
// refuses to run when the process has more than one thread (see SpawnOptions::allow_threads).
// Each child runs `fn` and leaves with _exit(): the parent's atexit handlers and static
// destructors must not run twice. A child that records a trace (NANODDP_TRACE) writes it
// before leaving: rank r's file is run.rank<r>.json once init_process_group named its rank
// (core/trace.h, "Files").
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "dist/launch.h"

namespace nanoddp::dist {

// Default limit on a whole spawn() job.
inline constexpr std::chrono::milliseconds kDefaultSpawnTimeout = std::chrono::minutes(30);

struct SpawnOptions {
  std::string master_addr = "127.0.0.1";
  int master_port = 0;   // 0 = pick a free port on master_addr
  std::string backend;   // when given, exported as NANODDP_BACKEND
  std::chrono::milliseconds timeout = kDefaultSpawnTimeout;          // whole job; 0 = no limit
  std::chrono::milliseconds grace_period = kDefaultGracePeriod;      // SIGTERM -> SIGKILL
  bool allow_threads = false;  // true: fork even with other threads alive (at your own risk)
  bool prefix_output = true;   // false: the ranks' lines go out unprefixed, as torch's spawn does
};

// Forks `nprocs` children; child r gets RANK=r, LOCAL_RANK=r, WORLD_SIZE=nprocs,
// LOCAL_WORLD_SIZE=nprocs, GROUP_RANK=0, MASTER_ADDR, MASTER_PORT (one free port for all) and
// NANODDP_BACKEND (when options.backend is given) and this call's fresh NANODDP_JOB_ID and
// NANODDP_STORE_TOKEN (give_job_identity) in its environment, then calls fn(r). A rank
// whose fn returns exits 0; one whose fn throws prints "exception: <message_of(e)>" on its stderr and
// exits 1. Output lines read "[rank r] ..." (unless options.prefix_output is false), and the
// rest is as under nanoddp-run (Note [Launch contract] in dist/launch.h: own process groups,
// SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGTSTP at their defaults in the ranks, fail fast, SIGTERM
// then SIGKILL, forwarded signals (a SIGQUIT to the caller ends the ranks and spawn() throws),
// nothing left behind).
// Throws ValueError for nprocs outside 1..kMaxProcPerNode, DistError when other threads exist
// (unless allowed), when a rank fails ("spawn: rank 1 (pid 4242) failed: exit code 1: <message>"),
// when a rank cannot be started ("spawn: could not start rank 7 of 8: fork failed: ...") or when
// a signal interrupted the job, TimeoutError when options.timeout ran out. A failure, signal or
// timeout while ranks are still being forked stops the forking at once.
// Follows torch.multiprocessing.spawn(fn, nprocs=...) with join=True; unlike it, fn gets the
// rank only (capture other arguments in the lambda) and the env is set for env:// rendezvous.
void spawn(const std::function<void(int rank)>& fn, int nprocs, const SpawnOptions& options = {});

}  // namespace nanoddp::dist
