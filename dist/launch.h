// The launcher as a library: what `nanoddp-run` (our torchrun) does, callable from C++.
//
//   dist::LaunchOptions options;  options.nproc_per_node = 4;
//   int code = dist::launch(options, {"./train", "--epochs", "3"});   // 0 when every rank exits 0
//   // each rank sees RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; its lines read "[rank N] ..."
//
// Contract (Note [Launch contract]), shared by launch() and spawn() (dist/spawn.h):
//   1. Every rank is a child in its own process group (pgid = its pid), so killing the group
//      also reaches what the rank started itself (`sh -c` forks its commands).
//   2. Its stdout and stderr go through pipes; complete lines come out on our stdout and stderr
//      (kept apart) prefixed "[rank N] ". A last line without '\n' is still printed at exit.
//      A program writing to a pipe block-buffers its stdio: flush, or print with '\n' and
//      setvbuf/line buffering, to see lines as they happen. A line over 64 KiB comes out in
//      pieces of 64 KiB, each a line of its own. A reader that stops reading our stdout or
//      stderr never stops the supervision below (Note [Output relay] in output_relay.h). A
//      job that ends by itself waits for the reader to take all its output (`| less`); one
//      stopped by a signal or --timeout drops what a reader has not taken after a grace period
//      of taking nothing, and the launcher exits.
//   3. Fail fast: the first failure is named on stderr ("rank 1 (pid 4242) failed: exit code
//      3" / "... killed by signal SIGKILL"); every other rank gets SIGTERM, then SIGKILL after
//      `grace_period`. The first failure in time is not the first child we happen to reap: a
//      rank that failed because it lost a peer says so (Note [Launcher link] in
//      dist/launcher_link.h), and the launcher names the lost rank instead when that one failed
//      too, following the chain; a lost rank still running gets up to `grace_period` to end by
//      itself (its connections close before it exits) before the job is stopped; one still
//      running then is said to be stuck after the rank named, with its state from /proc
//      ("stopped: SIGSTOP or Ctrl-Z", "not stopped: hung or looping?"). A rank that meanwhile
//      exits non-zero on its own is named too
//      ("rank 0 (pid 4241) also failed: exit code 1 (it lost rank 1)"); one that exits 128 + n
//      after the signal n the launcher sent it (bash's and Python's way to end by a signal
//      they handle) did as asked and is not.
//   4. SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to the launcher are forwarded to every rank's
//      group (ranks do not sit in the terminal's foreground group, so Ctrl-C and Ctrl-\ reach
//      them only this way), then the same grace period applies; the launcher exits 128 + the
//      signal. SIGTSTP (Ctrl-Z) is sent on to every rank's group, then the launcher stops
//      itself; when the shell continues it (fg, bg), it continues the ranks. A signal the
//      launcher was started ignoring (nohup; SIGINT and SIGQUIT of a job a non-interactive
//      shell put in the background with &) stays ignored, here and in the ranks.
//   5. No process is left behind: when the job ends every rank's group gets SIGKILL before the
//      rank itself is reaped (an exited rank stays a zombie until then, which keeps its pgid from
//      being reused by an unrelated process). When the launcher itself dies, SIGKILL included,
//      every rank ends too (PR_SET_PDEATHSIG, and the pipe of Note [Launcher link]), but not
//      what a rank that is a script started (a wrapper's own child is reparented, as under
//      torchrun, whose ranks themselves outlive it): nobody is left to kill its group. Under
//      --backend mpi the ranks are mpirun's children, in process groups of their own: the
//      launcher returns only once they have ended too (Note [mpirun's ranks] in launch.cpp).
//      For that the calling process is a child subreaper while mpirun runs: any process
//      orphaned below it meanwhile is taken for one of the job's, and ended with them.
//   6. The innermost launcher wins: a child starts without the variables by which an outer
//      launcher (mpirun, srun, torchrun) names a rank (Note [Innermost launcher wins] in
//      launch.cpp), then gets this launcher's own.
// The ranks' stdin is /dev/null: they run outside the terminal's foreground group, where a read
// from the terminal would stop them (SIGTTIN).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace nanoddp::dist {

// Default time between SIGTERM and SIGKILL when ranks are terminated.
inline constexpr std::chrono::milliseconds kDefaultGracePeriod{5000};

// Most ranks one launcher (or spawn) starts. A node runs one rank per GPU or per core, so real
// jobs stay far below; a larger count is a typo (100000 instead of 1000) that would fork until
// the OOM killer strikes. Each rank also holds 3 pipes (3 descriptors) in the launcher.
inline constexpr int kMaxProcPerNode = 1024;

// What nanoddp-run's flags hold; see tools/nanoddp_run.cpp for the flag names.
struct LaunchOptions {
  int nproc_per_node = 1;                 // ranks started on this node, 1..kMaxProcPerNode
  int nnodes = 1;                         // nodes in the job (one launcher per node)
  int node_rank = 0;                      // this node's index, 0..nnodes-1 (GROUP_RANK)
  std::string master_addr = "127.0.0.1";  // where rank 0 serves the Store
  int master_port = 0;                    // 0 = pick a free port (single node only)
  std::string backend;                    // "" (not given), "auto", "shm", "shm+gloo", "gloo", "mpi", "nccl"
  std::string job_id;                     // NANODDP_JOB_ID for the ranks ("": none); see
  std::string store_token;                // NANODDP_STORE_TOKEN     give_job_identity()
  std::chrono::milliseconds grace_period = kDefaultGracePeriod;
  std::chrono::milliseconds timeout{0};   // whole job, restarts included; 0 = no limit (a
                                          // training run's length is the user's; failures and
                                          // Ctrl-C still end it)
  int max_restarts = 0;                   // torchrun's --max-restarts: how many times a failed
                                          // group is started again (Note [Restart rounds] in
                                          // launch.cpp); 0 = a failure ends the job
};

// How one child process ended, from its wait status.
struct ExitStatus {
  bool exited = false;  // true: exited with `code`; false: killed by `signal`
  int code = 0;
  int signal = 0;

  static ExitStatus from_wait_status(int status);
  bool ok() const { return exited && code == 0; }
  // Shell convention: the exit code, or 128 + the signal number.
  int shell_code() const { return exited ? code : 128 + signal; }
  // "exit code 3" or "killed by signal SIGKILL".
  std::string describe() const;
};

// "SIGKILL" for 9; "signal 42" for numbers without a name.
std::string signal_name(int signal);

// Binds a TCP socket to port 0 on `addr` (a numeric address or a host name), reads the port
// the kernel chose and closes the socket. There is a small race: another process can take the
// port before rank 0 binds it; the Store then fails fast naming the port, and a rerun picks
// another one. Throws DistError when `addr` cannot be resolved or bound (it must be an address
// of this machine).
int pick_free_port(const std::string& addr);

// Sets options.job_id and options.store_token, which the ranks' store checks (Note [Store wire
// format] in dist/store_wire.cpp): each from NANODDP_JOB_ID / NANODDP_STORE_TOKEN when the launcher's
// own environment has it (every node of a multi-node job must be given the same) and was not
// inherited from an outer launcher, else, for a one-node job, a fresh random one (64 and 256 bits from getrandom). A multi-node job without
// them runs unchecked, and rank 0 warns. Throws DistError when getrandom fails.
void give_job_identity(LaunchOptions& options);

// The environment of one rank, in the order it is set: RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT and, when options.backend is given,
// NANODDP_BACKEND, then NANODDP_JOB_ID and NANODDP_STORE_TOKEN when set, then
// NANODDP_RESTART_COUNT (0 on the first start), then torchrun's names for its workers:
// GROUP_WORLD_SIZE (nnodes), ROLE_NAME ("default"), ROLE_RANK (= RANK), ROLE_WORLD_SIZE (=
// WORLD_SIZE), TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID
// (the job id, or "none"). launch() also sets OMP_NUM_THREADS=1 in each rank when
// nproc_per_node > 1 and the variable is unset, as torchrun does.
// RANK = node_rank * nproc_per_node + local_rank, as torchrun numbers ranks.
// `master_port` is the resolved port (never 0).
std::vector<std::pair<std::string, std::string>> rank_env(const LaunchOptions& options, int local_rank,
                                                          int master_port, int restart_count = 0);

// The command line that delegates a launch to Open MPI (--backend mpi):
//   mpirun -np N --bind-to none [--oversubscribe] --tag-output -x NANODDP_BACKEND=mpi
//          -x MASTER_ADDR=... -x MASTER_PORT=... PROGRAM ARGS...
// Ranks learn RANK/WORLD_SIZE from Open MPI's OMPI_COMM_WORLD_* (the process group reads them),
// so nothing is mapped here. The "[rank N]" prefix comes from mpirun's --tag-output instead
// ("[jobid,rank]<stdout>: ..."), and mpirun names a failed rank itself ("Process name:
// [[jobid,1],N]  Exit code: 3") and exits with that rank's code. --oversubscribe is added when N
// exceeds the physical cores (Open MPI counts one slot per core). Throws ValueError for
// nnodes > 1: across machines, call mpirun with a hostfile directly.
std::vector<std::string> mpirun_command(const LaunchOptions& options, const std::vector<std::string>& program,
                                        int master_port);

// Starts options.nproc_per_node ranks of `program` (argv, passed untouched; program[0] is
// looked up in PATH) and supervises them as Note [Launch contract] says. A program that execvp
// would not find, or not be allowed to run, or a script whose #! interpreter is missing, is
// reported once and nothing is started: the code is the shell's, 127 (not found, no
// interpreter) or 126 (not executable, a folder). With backend "mpi"
// it runs mpirun_command() as the one child instead (as root it sets OMPI_ALLOW_RUN_AS_ROOT=1
// and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 for it). Returns the launcher's exit code: 0 when every
// rank exited 0, else the first failure's shell_code() (128 + signal for a forwarded
// SIGINT/SIGTERM, 124 on timeout). With options.max_restarts > 0, a failed rank stops the
// group and starts it again, whole, on a fresh store round, up to max_restarts times (Note
// [Restart rounds] in launch.cpp): "nanoddp-run: restarting every rank (restart 1 of 2, ...)"
// on stderr; the code is then the last round's. Progress and failures are reported on stderr, prefixed
// "nanoddp-run: ". When starting a rank fails (fork or pipe: EAGAIN, ENOMEM, EMFILE), or a
// signal, a failed rank or the timeout arrives while ranks are still being started, no more are
// started, the started ones are terminated as after any failure, and the code is 1 for a failed
// start (else as above). Throws ValueError on bad options (nproc_per_node outside
// 1..kMaxProcPerNode, ...), DistError when no port can be picked.
// Follows torchrun (torch.distributed.run) for the flags and the env it sets.
int launch(const LaunchOptions& options, const std::vector<std::string>& program);

// ---- the building block launch() and spawn() share -------------------------------------------

// Why supervision ended.
struct Outcome {
  enum class Kind { AllSucceeded, ChildFailed, StartFailed, TimedOut, Interrupted };
  Kind kind = Kind::AllSucceeded;
  std::string failed_name;    // e.g. "rank 1" (ChildFailed, StartFailed)
  int failed_rank = -1;       // its rank (ChildFailed)
  pid_t failed_pid = -1;
  ExitStatus failed_status;   // how it ended (ChildFailed)
  // failed_status is a success (exit code 0) only for a rank that exited without joining a
  // process group another rank waits in (Note [Launcher link], item 3).
  std::string failed_message; // what the child reported through its message pipe (spawn), or
                              // why it could not be started (StartFailed: "fork failed: ...")
  int signal = 0;             // the forwarded signal (Interrupted)
  // A user's signal that came while the ranks were being stopped after a failure or the timeout
  // (the first one: a second SIGKILLs them), or while the output was written after every child
  // had ended: an outcome that was AllSucceeded is Interrupted by it; a ChildFailed one stays
  // (the failure is what spawn reports), and launch() restarts nothing after it.
  int late_signal = 0;
  // A write to the launcher's stdout or stderr found its reader gone (`| head` has its lines).
  // While the job ran, that ended it as Interrupted by SIGPIPE (the ranks get SIGTERM); a job
  // that then ended by itself is Interrupted by SIGPIPE too; a ChildFailed one stays, and
  // launch() restarts nothing after it (no one would read the next round).
  bool reader_gone = false;
  std::vector<ExitStatus> statuses;  // every child's end, in start order
};

// Owns a set of child processes and runs the supervision loop of Note [Launch contract].
// Not copyable; the destructor SIGKILLs and reaps whatever is still there (never throws).
// One ChildGroup may supervise at a time per process (it owns the handlers of
// SIGCHLD/SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGTSTP from construction to destruction, and restores
// the previous ones).
class ChildGroup {
 public:
  struct Options {
    std::chrono::milliseconds grace_period = kDefaultGracePeriod;
    std::chrono::milliseconds timeout{0};  // 0 = no limit
    // What the timeout message names ("the job's --timeout of 3 s", for a round that had
    // what was left of it); "" = "timed out after <timeout>".
    std::string timeout_description;
    std::string reporter = "nanoddp-run";  // prefix of the launcher's own stderr messages
    bool report = true;                    // print failures on stderr
    // The children pass our signals on to processes of their own and answer with an exit
    // code (mpirun exits 1 after a SIGINT): such an exit while the group is being stopped is
    // their answer, not a failure of their own to report.
    bool children_relay_signals = false;
    // The children start the ranks themselves (mpirun) and must end with them: one still
    // running a grace period (at least 5 s) after every process it started has ended is
    // stopped, and the job fails. Open MPI 4's mpirun can hang in its own shutdown after a
    // rank exited without MPI_Finalize; without this the launcher would wait for it forever.
    bool children_end_with_their_own = false;
    // SIGUSR1 and SIGUSR2 sent to this process are passed on to the children (nanoddp-run);
    // without it (spawn) this process's handlers of them stay, and the children inherit them.
    bool pass_on_user_signals = false;
  };
  explicit ChildGroup(Options options);
  ~ChildGroup();
  ChildGroup(const ChildGroup&) = delete;
  ChildGroup& operator=(const ChildGroup&) = delete;

  // Forks one child named `name` (for messages) whose output lines get `prefix` ("" = as is).
  // In the child, after its process group, signals and streams are set up, `child_main(msg_fd)`
  // runs; it must not return (exec or _exit). msg_fd is a pipe whose text the parent keeps in
  // Outcome::failed_message. Returns true when the child was started. Returns false, starting
  // nothing, once the group must stop growing: a SIGINT/SIGTERM/SIGHUP/SIGQUIT is pending (a
  // SIGTSTP stops the children started so far, then this process, and starting goes on), a started
  // child has already failed, the timeout (counted from construction) has passed, or this or
  // an earlier start failed (fork or pipe: EAGAIN, ENOMEM, EMFILE). The caller then stops
  // starting and calls wait(), which terminates the started children and reports why, exactly
  // as for a failure after start (Note [Launch contract]). Throws DistError after wait().
  [[nodiscard]] bool start(int rank, std::string name, std::string prefix,
                           const std::function<void(int msg_fd)>& child_main);

  // Runs until every child has exited (or been killed after a failure, timeout or signal).
  Outcome wait();

 private:
  struct Child;
  void terminate_all(int signal);
  // SIGUSR1 or SIGUSR2 to every rank still running (mpirun: to mpirun, which passes it on).
  void pass_on(int signal);
  // Whether this group installs its handler for `signal` (one of kHandledSignals): every one but
  // SIGUSR1/SIGUSR2 without Options::pass_on_user_signals, which stay the caller's.
  bool takes_over(int signal) const;
  void signal_child(const Child& c, int signal);
  // SIGTSTP to every child's group, then to this process, then, once continued, SIGCONT to
  // the children (contract item 4). Returns how long this process was stopped.
  std::chrono::steady_clock::duration stop_with_children();
  bool must_stop_starting();
  void read_failure_reports();      // from failure_pipe_ into lost_peer_, joining_, joined_
  int alive_pipe_[2] = {-1, -1};    // Note [Launcher link]: ranks see EOF when we die
  int failure_pipe_[2] = {-1, -1};  // ranks write "<rank> lost <peer>" lines here
  std::string failure_text_;        // an incomplete last line
  std::map<int, int> lost_peer_;    // rank -> the rank it lost
  std::map<int, int> joining_;      // rank -> the world size it waits for in init_process_group
  std::set<int> joined_;            // ranks whose init_process_group finished
  Options options_;
  std::vector<Child> children_;
  std::chrono::steady_clock::time_point created_;  // the timeout counts from here
  int pending_signal_ = 0;        // a forwarded signal read while starting, handled by wait()
  std::string start_error_;       // why a start failed; wait() reports it
  std::string start_error_name_;  // whom it failed to start
  bool waited_ = false;
};

}  // namespace nanoddp::dist
