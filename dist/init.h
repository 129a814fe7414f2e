// init_process_group: how each rank of a job finds the others and gets its default group.
//
//   dist::init_process_group();                          // env://, backend from the device
//   auto pg = dist::default_process_group();  int r = dist::get_rank();
//   dist::destroy_process_group();
//
// Follows torch.distributed.init_process_group. Where rank, world size and the rendezvous
// address come from (each field separately; an explicit InitOptions value wins):
//   rank        RANK        > OMPI_COMM_WORLD_RANK       > SLURM_PROCID
//   world_size  WORLD_SIZE  > OMPI_COMM_WORLD_SIZE       > SLURM_NTASKS
//   local rank  LOCAL_RANK  > OMPI_COMM_WORLD_LOCAL_RANK > SLURM_LOCALID
//   local size  LOCAL_WORLD_SIZE > OMPI_COMM_WORLD_LOCAL_SIZE > SLURM_NTASKS_PER_NODE
//   store       init_method "env://" reads MASTER_ADDR and MASTER_PORT;
//               "tcp://host:port" names them (IPv6 as tcp://[::1]:29500).
//   backend     InitOptions::backend; when Auto, NANODDP_BACKEND (nanoddp-run --backend X);
//               two different explicit choices are a ValueError naming both.
// The innermost launcher wins: nanoddp-run and spawn remove an outer launcher's OMPI_*, PMIX_*,
// PMI_* and SLURM_* rank variables from their ranks (Note [Innermost launcher wins] in
// dist/launch.cpp), and Auto picks MPI only when no torchrun-style RANK is set.
// So nanoddp-run, torchrun-style launchers, mpirun and srun can all start a job. The MPI
// backend ignores the store: mpirun already wired the ranks, and rank/size come from MPI
// (checked against the variables when both are set). A 1-rank env:// job ignores MASTER_ADDR
// and MASTER_PORT (its store is its own, on a free loopback port), so a port still held by the
// job that exported them does not stop it; torch binds MASTER_PORT even at world size 1.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "core/device.h"
#include "dist/process_group.h"

namespace nanoddp::dist {

// The launcher's backend choice (nanoddp-run --backend, spawn's SpawnOptions::backend).
inline constexpr const char* kLauncherBackendEnv = "NANODDP_BACKEND";
// Who may use rank 0's store (TCPStoreOptions::job_id / token): nanoddp-run and spawn make both
// per job; under mpirun or srun export them yourself (the same on every rank). Without a token
// rank 0 warns that any client reaching the port is admitted.
inline constexpr const char* kJobIdEnv = "NANODDP_JOB_ID";
inline constexpr const char* kStoreTokenEnv = "NANODDP_STORE_TOKEN";
// How many times the launcher restarted the group (nanoddp-run --max-restarts; torchrun's
// TORCHELASTIC_RESTART_COUNT); the store's round (Note [Restart rounds] in dist/launch.cpp).
inline constexpr const char* kRestartCountEnv = "NANODDP_RESTART_COUNT";
// "1": the store listens on every interface instead of MASTER_ADDR only (behind NAT).
// This and NANODDP_CHECK_COLLECTIVES take 1/true/yes/on or 0/false/no/off; any other value
// is a ValueError from init_process_group naming the variable.
inline constexpr const char* kStoreListenAllEnv = "NANODDP_STORE_LISTEN_ALL";

struct InitOptions {
  Backend backend = Backend::Auto;     // see Backend for what Auto picks
  std::string init_method = "env://";  // or "tcp://host:port"
  int world_size = -1;                 // -1: from the environment
  int rank = -1;                       // -1: from the environment
  std::chrono::milliseconds timeout = kDefaultTimeout;  // store waits and every collective
  Device device = Device::cpu();       // CUDA: NCCL on that GPU (one GPU per rank)
  // Check before every collective that all ranks call the same one (process_group.h): a
  // DistError instead of a hang, an abort or corrupt data, for one small all-gather per
  // collective (on NCCL through a CPU group beside it, so that it never waits for the GPU:
  // Note [Host fingerprints]). NANODDP_CHECK_COLLECTIVES=0 in the environment also turns it off.
  bool check_collectives = true;
};

// Builds the store and the group and makes it the default group
// (torch.distributed.init_process_group). A CPU group (Gloo, MPI) also takes CUDA tensors,
// staged through pinned host memory (dist/host_staging.h), so several ranks can share a GPU.
// Under a launcher, also ends this process when the launcher dies (Note [Launcher link] in
// dist/launcher_link.h). A Gloo group (gloo, shm+gloo, and the collective check's fingerprint
// group of an NCCL job across machines) makes the process ignore SIGPIPE
// unless it handles it itself, as Python does for torch (Note [Gloo and SIGPIPE]); programs it
// then starts (system, popen) inherit that: restore SIGPIPE in the child if one needs it. Throws ValueError
// for a missing or malformed variable (named), rank outside [0, world_size) (naming where each came from:
// "RANK=1 is not below WORLD_SIZE=1", or the InitOptions field), the inconsistent local variables
// read_launch_env refuses, or a backend that contradicts the launcher's; DeviceError for a CUDA device in a
// build without CUDA; DistError when already initialised, when MASTER_PORT is in use on rank 0, when the
// backend is not built in, or when the ranks cannot meet within the timeout (TimeoutError).
std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});

// The group made by init_process_group. Throws DistError if there is none.
std::shared_ptr<ProcessGroup> default_process_group();
bool is_initialized();  // torch.distributed.is_initialized

// Drops the default group (torch.distributed.destroy_process_group). Ranks should stop
// issuing collectives together, e.g. after a barrier: rank 0 also serves the store.
// init_process_group may follow, on the same MASTER_PORT, when every rank destroys and
// initialises as often as the others (a call that threw does not count): a rank that gets
// there before rank 0 has destroyed its group waits for rank 0's new store
// (TCPStoreOptions::generation) instead of joining the old one as it goes (torch 1.13 has that
// race). Rank 0's store lives as long as its group: drop every handle on the old group first
// (the pointer init_process_group returned, a DDP), or the port is still taken.
void destroy_process_group();

// This rank and the group's size (torch.distributed.get_rank / get_world_size). Throw
// DistError before init_process_group.
int get_rank();
int get_world_size();
// This process's index among the ranks on its host, from the environment (0 when no variable
// is set); readable before init_process_group, to pick the GPU: Device::cuda(get_local_rank()).
// Throws as read_launch_env.
int get_local_rank();

// What the environment says, for init_process_group and for tests. -1 / "" / 0 when unset.
struct LaunchEnv {
  int rank = -1;
  int world_size = -1;
  int local_rank = -1;
  int local_world_size = -1;
  int node_rank = -1;  // GROUP_RANK (nanoddp-run, torchrun): this node's index
  std::string master_addr;
  int master_port = 0;
};
// Reads the variables above; throws ValueError naming a variable that is not a number in range,
// and naming both variables when local rank >= local world size, local world size > world
// size, or (with no local world size) local rank >= world size, 1 when WORLD_SIZE is unset
// (left over from an outer job, say). torch.distributed checks neither pair: a leaked
// LOCAL_RANK there picks a wrong GPU, or hangs the rendezvous.
LaunchEnv read_launch_env();

}  // namespace nanoddp::dist
