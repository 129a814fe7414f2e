// The link between a rank and the launcher that started it (nanoddp-run or spawn): two pipes
// whose ends every rank inherits, named in its environment.
//
//   dist::watch_launcher(rank);              // init_process_group does this: no orphans
//   dist::report_lost_peer(rank, 3);         // a process group that lost rank 3 says so
//   // launcher side: ChildGroup (dist/launch.h) creates both pipes and reads the reports
//
// Note [Launcher link]
//   1. Liveness: the launcher keeps the only write end of a pipe; its ranks inherit the read end
//      (NANODDP_LAUNCHER_FD). Nothing is ever written, so the read end sees EOF exactly when the
//      launcher has died, however it died (SIGKILL included). A rank watches it on a thread of
//      its own and then ends its process group, as the launcher would have (Note [Launch
//      contract], item 5). PR_SET_PDEATHSIG, set by the launcher in each child, covers the
//      child itself even before it runs any of our code; the pipe also covers what the child
//      started (`sh -c prog`), whose parent did not die.
//   2. Lost peers: ranks share the write end of a second pipe (NANODDP_FAILURE_FD). A process
//      group that loses a peer (Gloo or the store: its connection closed; shm: its process
//      ended, or another rank aborted the group for that) writes "<rank> lost <peer>\n" before
//      it throws (one write under PIPE_BUF bytes: atomic, never interleaved). The line is in the
//      pipe before the rank can exit, so when the launcher reaps a failed rank it already
//      knows whether that rank failed by its own error or because it lost another, and names
//      the rank at the root of the chain (Note [Launch contract], item 3).
//   3. Rendezvous: on the same pipe, init_process_group writes "<rank> joining <world size>"
//      before it waits for its peers and "<rank> joined" once its group is up, when the group
//      is the launcher's world (its RANK and WORLD_SIZE; a group given other ranks or another
//      size says nothing). A rank that exits with status 0 without having joined, while another
//      waits to join, can never be waited for to the end: the launcher fails the job at once
//      instead of leaving the others in the rendezvous until their timeout (minutes). A rank
//      that joined once counts as joined, also after destroy_process_group; one whose
//      init_process_group threw writes "<rank> left" and waits for nobody any more.
//   Each variable holds "<fd>:<inode of the pipe>"; a rank uses the descriptor only when it is
//   still that pipe, so a variable inherited by a process that has reused the number (a
//   program started from a rank with its descriptors closed) is ignored, never written to.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace nanoddp::dist {

inline constexpr const char* kLauncherFdEnv = "NANODDP_LAUNCHER_FD";
inline constexpr const char* kFailureFdEnv = "NANODDP_FAILURE_FD";

// Starts, once per process, a thread that ends this process's group with SIGKILL when the
// launcher named by NANODDP_LAUNCHER_FD dies. Does nothing outside a launcher. Never throws.
void watch_launcher(int rank);

// Tells the launcher (NANODDP_FAILURE_FD) that `rank` failed because it lost `lost_rank`.
// Does nothing outside a launcher. Never throws.
void report_lost_peer(int rank, int lost_rank);

// Where `rank` is in init_process_group's rendezvous for the launcher's world (item 3).
enum class RendezvousStage { Joining, Joined, Left };
// Tells the launcher: `rank` waits for the other ranks of a world of `world_size` (Joining),
// its group is up (Joined), or its init_process_group threw (Left). Does nothing outside a
// launcher. Never throws.
void report_rendezvous(int rank, int world_size, RendezvousStage stage);

// What ranks wrote on the failure pipe (Note [Launcher link], items 2 and 3), from the complete
// lines of a text; malformed lines are skipped.
struct LauncherReports {
  std::vector<std::pair<int, int>> lost;  // (rank, the rank it lost)
  // In the order written: a rank that left and tries again reports left, then joining.
  struct Rendezvous {
    int rank;
    RendezvousStage stage;
    int world_size;  // Joining only
    bool operator==(const Rendezvous& other) const {
      return rank == other.rank && stage == other.stage && world_size == other.world_size;
    }
  };
  std::vector<Rendezvous> rendezvous;
};
LauncherReports parse_launcher_reports(const std::string& text);

// "<fd>:<inode>" for a pipe end, as the variables above hold it.
std::string describe_pipe_end(int fd);

}  // namespace nanoddp::dist
