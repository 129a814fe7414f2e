// The launcher's option handling: checks the options, picks the port, builds each rank's
// environment (or the mpirun command line) and hands the ranks to a ChildGroup
// (child_group.cpp). See Note [Launch contract] in dist/launch.h.
#include "dist/launch.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <netinet/in.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <dirent.h>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "core/error.h"
#include "dist/deadline.h"
#include "dist/detail.h"
#include "dist/launcher_link.h"
#include "dist/launch_detail.h"

namespace nanoddp::dist {

using namespace launch_detail;

// ---- ExitStatus ---------------------------------------------------------------------------------

ExitStatus ExitStatus::from_wait_status(int status) {
  ExitStatus s;
  if (WIFEXITED(status)) {
    s.exited = true;
    s.code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    s.signal = WTERMSIG(status);
  }
  return s;
}

std::string ExitStatus::describe() const {
  if (exited) return "exit code " + std::to_string(code);
  return "killed by signal " + signal_name(signal);
}

std::string signal_name(int signal) {
  switch (signal) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGCHLD: return "SIGCHLD";
    case SIGCONT:
      return "SIGCONT";
    case SIGTSTP:
      return "SIGTSTP";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGSYS: return "SIGSYS";
    default: return "signal " + std::to_string(signal);
  }
}

// ---- ports, environment, command lines ---------------------------------------------------------

int pick_free_port(const std::string& addr) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(addr.c_str(), "0", &hints, &found);
  NANODDP_CHECK(rc == 0, DistError, "the master address '", addr, "' (--master-addr, MASTER_ADDR) does not resolve: ",
                gai_strerror(rc));
  std::string last_error = "no address";
  int port = -1;
  for (addrinfo* a = found; a != nullptr && port < 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
      port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    } else {
      last_error = std::strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(found);
  NANODDP_CHECK(port > 0, DistError, "pick_free_port: cannot bind a port on '", addr, "' (", last_error,
                "); the master address must belong to this machine, or pass --master-port");
  return port;
}

std::vector<std::pair<std::string, std::string>> rank_env(const LaunchOptions& options, int local_rank,
                                                          int master_port, int restart_count) {
  const int rank = options.node_rank * options.nproc_per_node + local_rank;
  const std::string world_size = std::to_string(options.nnodes * options.nproc_per_node);
  std::vector<std::pair<std::string, std::string>> env = {
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"WORLD_SIZE", world_size},
      {"LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node)},
      {"GROUP_RANK", std::to_string(options.node_rank)},
      {"MASTER_ADDR", options.master_addr},
      {"MASTER_PORT", std::to_string(master_port)},
  };
  if (!options.backend.empty()) env.emplace_back("NANODDP_BACKEND", options.backend);
  if (!options.job_id.empty()) env.emplace_back("NANODDP_JOB_ID", options.job_id);
  if (!options.store_token.empty()) env.emplace_back("NANODDP_STORE_TOKEN", options.store_token);
  env.emplace_back("NANODDP_RESTART_COUNT", std::to_string(restart_count));
  // What torchrun also tells its workers, for programs written against it: one role
  // ("default") that holds every rank, and the restart counters under their names.
  const std::vector<std::pair<std::string, std::string>> torchrun = {
      {"GROUP_WORLD_SIZE", std::to_string(options.nnodes)},
      {"ROLE_NAME", "default"},
      {"ROLE_RANK", std::to_string(rank)},
      {"ROLE_WORLD_SIZE", world_size},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(options.max_restarts)},
      {"TORCHELASTIC_RUN_ID", options.job_id.empty() ? "none" : options.job_id},
  };
  env.insert(env.end(), torchrun.begin(), torchrun.end());
  return env;
}

namespace {

std::string random_hex(size_t nbytes) {
  std::vector<unsigned char> bytes(nbytes);
  size_t done = 0;
  while (done < nbytes) {
    const ssize_t n = getrandom(bytes.data() + done, nbytes - done, 0);
    if (n < 0 && errno == EINTR) continue;
    NANODDP_CHECK(n > 0, DistError, "launch: getrandom failed: ", std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  static const char kDigits[] = "0123456789abcdef";
  std::string text;
  for (unsigned char b : bytes) text += {kDigits[b >> 4], kDigits[b & 15]};
  return text;
}

}  // namespace

void give_job_identity(LaunchOptions& options) {
  // Inside a rank of another launcher (Note [Launcher link]) the variables are that job's, not
  // a choice made for this one: a one-node job then makes its own.
  const bool nested = std::getenv(kLauncherFdEnv) != nullptr && options.nnodes == 1;
  const char* job_id = nested ? nullptr : std::getenv("NANODDP_JOB_ID");
  const char* token = nested ? nullptr : std::getenv("NANODDP_STORE_TOKEN");
  options.job_id = job_id != nullptr && *job_id != '\0' ? job_id : options.nnodes == 1 ? random_hex(8) : "";
  options.store_token = token != nullptr && *token != '\0' ? token : options.nnodes == 1 ? random_hex(32) : "";
}

namespace {

// Physical cores (distinct package/core pairs), which is what Open MPI counts as slots.
int physical_cores() {
  std::set<std::pair<std::string, std::string>> cores;
  if (DIR* dir = opendir("/sys/devices/system/cpu")) {
    while (dirent* e = readdir(dir)) {
      const std::string name = e->d_name;
      if (name.size() < 4 || name.compare(0, 3, "cpu") != 0 ||
          name.find_first_not_of("0123456789", 3) != std::string::npos)
        continue;
      const std::string topo = "/sys/devices/system/cpu/" + name + "/topology/";
      std::ifstream package(topo + "physical_package_id"), core(topo + "core_id");
      std::string p, c;
      if (package >> p && core >> c) cores.emplace(p, c);
    }
    closedir(dir);
  }
  if (!cores.empty()) return static_cast<int>(cores.size());
  return std::max(1u, std::thread::hardware_concurrency());
}

void check_options(const LaunchOptions& o, const std::vector<std::string>& program) {
  NANODDP_CHECK(!program.empty(), ValueError, "launch: no program given");
  NANODDP_CHECK(o.nproc_per_node >= 1 && o.nproc_per_node <= kMaxProcPerNode, ValueError,
                "launch: --nproc-per-node must be between 1 and ", kMaxProcPerNode, " (one rank per GPU or core), got ",
                o.nproc_per_node);
  NANODDP_CHECK(o.nnodes >= 1, ValueError, "launch: --nnodes must be >= 1, got ", o.nnodes);
  NANODDP_CHECK(o.nnodes <= INT_MAX / o.nproc_per_node, ValueError, "launch: --nnodes ", o.nnodes, " times ",
                "--nproc-per-node ", o.nproc_per_node, " ranks does not fit a world size");
  NANODDP_CHECK(o.node_rank >= 0 && o.node_rank < o.nnodes, ValueError, "launch: --node-rank ", o.node_rank,
                " is not below --nnodes ", o.nnodes, " (nodes are numbered from 0)");
  NANODDP_CHECK(o.master_port >= 0 && o.master_port <= 65535, ValueError, "launch: --master-port ",
                o.master_port, " is not a TCP port");
  NANODDP_CHECK(o.backend.empty() || o.backend == "auto" || o.backend == "gloo" || o.backend == "mpi" ||
                    o.backend == "nccl" || o.backend == "shm" || o.backend == "shm+gloo",
                ValueError, "launch: --backend must be auto, shm, shm+gloo, gloo, mpi or nccl, got '", o.backend,
                "'");
  NANODDP_CHECK(o.grace_period.count() >= 0, ValueError, "launch: negative grace period");
  NANODDP_CHECK(o.max_restarts >= 0, ValueError, "launch: --max-restarts must be >= 0, got ", o.max_restarts);
  // Each node's launcher would pick a different free port: they must be told one.
  NANODDP_CHECK(o.master_port != 0 || o.nnodes == 1, ValueError,
                "launch: with --nnodes ", o.nnodes, " every node must use the same port: pass --master-port");
}

// Note [Innermost launcher wins]
// A launcher started inside another (nanoddp-run in an `srun` or `mpirun -np 1` allocation,
// mpirun started by nanoddp-run --backend mpi from a rank of an outer job) hands its children
// the outer launcher's variables as well as its own. Those say who the *launcher* process was
// in the outer job, never who a child is, and init_process_group would read them (MPI would
// even try to join the outer job). So before setting its own, the launcher removes every
// variable by which a launcher tells a process its rank: torchrun's (RANK ...), Open MPI's
// (OMPI_COMM_WORLD_*, its runtime's OMPI_MCA_orte_* and OMPI_MCA_ess*), PMIx/PMI's, and
// Slurm's per-task ones, and an outer nanoddp-run's NANODDP_BACKEND (this launcher exports its
// own --backend, and without one its ranks pick theirs: a stale value left in a shell would
// otherwise choose for them, MPI without mpirun included). User settings such as
// OMPI_MCA_btl and the rest of SLURM_* stay.
bool is_outer_launcher_variable(const std::string& name) {
  static const char* const kPrefixes[] = {"OMPI_COMM_WORLD_", "OMPI_MCA_orte_", "OMPI_MCA_ess", "PMIX_", "PMI_"};
  static const std::set<std::string> kNames = {
      "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
      "GROUP_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
      "TORCHELASTIC_RUN_ID",
      "OMPI_UNIVERSE_SIZE", "OMPI_FIRST_RANKS", "OMPI_APP_CTX_NUM_PROCS", "OMPI_NUM_APP_CTX", "OMPI_COMMAND",
      "OMPI_ARGV", "OMPI_FILE_LOCATION", "OMPI_MCA_pmix", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
      "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS",
      "SLURM_STEP_TASKS_PER_NODE", "SLURM_GTIDS", "NANODDP_BACKEND"};
  for (const char* prefix : kPrefixes)
    if (name.rfind(prefix, 0) == 0) return true;
  return kNames.count(name) > 0;
}

}  // namespace

namespace launch_detail {

void clear_outer_launcher_env() {
  std::vector<std::string> names;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text = *entry;
    const std::string name = text.substr(0, text.find('='));
    if (is_outer_launcher_variable(name)) names.push_back(name);
  }
  for (const std::string& name : names) unsetenv(name.c_str());
}

}  // namespace launch_detail

namespace {

std::vector<char*> to_argv(std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  return argv;
}

// The shell's exit code for a program that cannot be run: 127 "command not found", 126 found
// but not executable (EACCES: no x permission, a folder; ENOEXEC).
int exec_failure_code(int error) { return error == ENOENT || error == ENOTDIR ? 127 : 126; }

// Runs in the child: replaces it with argv, or reports why not and exits with
// exec_failure_code.
[[noreturn]] void exec_or_die(const std::vector<char*>& argv, const std::string& reporter) {
  execvp(argv[0], argv.data());
  const int error = errno;
  const std::string message =
      reporter + ": cannot execute '" + argv[0] + "': " + std::strerror(error) + "\n";
  write_all(2, message);
  _exit(exec_failure_code(error));
}

// 0 when execvp(program) would find an executable regular file, else why not (ENOENT, EACCES;
// EISDIR for a folder, which execve calls EACCES),
// by execvp's search: a name with '/' as is, else each folder of PATH in turn (an empty entry
// is the current folder), an executable one winning over a non-executable one found earlier.
int program_unrunnable(const std::string& program, std::string* found_at) {
  const auto check = [found_at](const std::string& path) {
    struct stat info {};
    if (::stat(path.c_str(), &info) != 0) return errno == ENOTDIR ? ENOENT : errno;
    if (S_ISDIR(info.st_mode)) return EISDIR;
    if (!S_ISREG(info.st_mode) || ::access(path.c_str(), X_OK) != 0) return EACCES;
    *found_at = path;
    return 0;
  };
  if (program.find('/') != std::string::npos) return check(program);
  const char* path_env = std::getenv("PATH");
  const std::string path = path_env != nullptr ? path_env : "/bin:/usr/bin";  // glibc's default
  int error = ENOENT;
  size_t begin = 0;
  while (true) {
    const size_t end = std::min(path.find(':', begin), path.size());
    const std::string folder = path.substr(begin, end - begin);
    const int found = check((folder.empty() ? "." : folder) + "/" + program);
    if (found == 0) return 0;
    if (found == EACCES || (found == EISDIR && error == ENOENT)) error = found;
    if (end == path.size()) return error;
    begin = end + 1;
  }
}

// What to say after "cannot execute 'P': <error>" for a file that is there: one in this
// folder named without ./ (a shell needs ./ too), or one that is not executable, such as a
// Python script: torchrun runs PROGRAM with python unless --no-python; nanoddp-run runs it as
// it is.
std::string unrunnable_hint(const std::string& program, int error) {
  std::error_code ignored;
  const bool bare = program.find('/') == std::string::npos;
  if (!std::filesystem::is_regular_file(program, ignored) || (error == ENOENT && !bare)) return "";
  if (access(program.c_str(), X_OK) == 0)
    return bare ? "; to run ./" + program + " from this folder, write ./" + program : "";
  return "; " + program +
         " is not executable: nanoddp-run starts PROGRAM as it is (torchrun --no-python), so "
         "start a script with its interpreter (nanoddp-run ... python3 " +
         program + ")";
}

// Whether path is a Python script (named *.py) without a #! line: execvp would hand it to
// /bin/sh, which runs its `import` as a command (ImageMagick's). A shell script without #!
// runs under /bin/sh as it always has.
bool is_python_without_shebang(const std::string& path) {
  if (path.size() < 3 || path.compare(path.size() - 3, 3, ".py") != 0) return false;
  std::ifstream in(path, std::ios::binary);
  char head[2] = {0, 0};
  in.read(head, 2);
  return !(head[0] == '#' && head[1] == '!');
}

// The interpreter a script's "#!" line names, when it cannot run (missing, or not
// executable); "" for a script whose interpreter can, and for a binary. execve fails with
// ENOENT for such a script, which would read as the script itself missing.
std::string unrunnable_interpreter(const std::string& script) {
  std::ifstream in(script, std::ios::binary);
  std::string line;
  if (!std::getline(in, line) || line.rfind("#!", 0) != 0) return "";
  const size_t begin = line.find_first_not_of(" \t", 2);
  if (begin == std::string::npos) return "";
  const std::string interpreter = line.substr(begin, line.find_first_of(" \t\r", begin) - begin);
  return ::access(interpreter.c_str(), X_OK) == 0 ? "" : interpreter;
}

}  // namespace

std::vector<std::string> mpirun_command(const LaunchOptions& options, const std::vector<std::string>& program,
                                        int master_port) {
  NANODDP_CHECK(options.nnodes == 1, ValueError, "launch: --backend mpi with --nnodes ", options.nnodes,
                ": across machines, call mpirun with a hostfile directly (mpirun --hostfile HOSTS -np N "
                "PROGRAM); the MPI process group reads OMPI_COMM_WORLD_* itself");
  std::vector<std::string> cmd = {"mpirun", "-np", std::to_string(options.nproc_per_node), "--bind-to", "none"};
  if (options.nproc_per_node > physical_cores()) cmd.push_back("--oversubscribe");
  cmd.push_back("--tag-output");
  for (const std::string& kv : {std::string("NANODDP_BACKEND=mpi"), "MASTER_ADDR=" + options.master_addr,
                               "MASTER_PORT=" + std::to_string(master_port)}) {
    cmd.push_back("-x");
    cmd.push_back(kv);
  }
  cmd.insert(cmd.end(), program.begin(), program.end());
  return cmd;
}

// Note [Restart rounds]
// With --max-restarts N (torchrun's flag and meaning) a failed group is stopped as after any
// failure, then started again, whole, with the same ranks and world size, up to N times. Each
// start is a round: its ranks see NANODDP_RESTART_COUNT = the round (torchrun's
// TORCHELASTIC_RESTART_COUNT), and rank 0's store admits only ranks of its own round
// (TCPStoreOptions::round). A rank left from an older start is refused at once; a rank of a
// newer start that reaches the old group's server (still going on another node) connects again
// until the new server is up. Nodes restart together because a failure ends every node's
// group: a rank that loses a peer on another node fails too, and its own launcher restarts. A
// node that does not restart (out of restarts, its launcher gone) leaves the new round short,
// and the store's timeout names the ranks that never came. Only a failed rank restarts the
// group: a signal to the launcher, its --timeout and a failed start end the job, as in
// torchrun. The program resumes from its own checkpoint; the launcher keeps no state. Under
// --backend mpi mpirun is the one child, and a restart starts mpirun again.
namespace {

// Note [mpirun's ranks]
// Open MPI puts each rank in a process group of its own, so the kill of a child's process
// group that ends a rank's leftovers does not reach mpirun's ranks, and mpirun can exit before
// they have ended. Without a wait for them the launcher would return while ranks still ran,
// and a restart could start the next round beside them. So while mpirun runs the launcher is
// a child subreaper (prctl PR_SET_CHILD_SUBREAPER): the ranks mpirun leaves behind, and any
// process a rank left in a session of its own, become its children, and it returns once they
// have ended, by themselves within the grace period or by SIGKILL (to each one's process group
// and to itself) after it.
class MpirunRanks {
 public:
  MpirunRanks() : before_(children()) {
    int previous = 0;
    if (prctl(PR_GET_CHILD_SUBREAPER, &previous) == 0) was_subreaper_ = previous != 0;
    prctl(PR_SET_CHILD_SUBREAPER, 1);
  }
  ~MpirunRanks() { prctl(PR_SET_CHILD_SUBREAPER, was_subreaper_ ? 1 : 0); }
  MpirunRanks(const MpirunRanks&) = delete;
  MpirunRanks& operator=(const MpirunRanks&) = delete;

  // After mpirun has been reaped: waits for the processes it left to this launcher.
  void wait_for_leftovers(std::chrono::milliseconds grace_period) {
    const auto kill_at = detail::deadline_after(grace_period);
    // A process stuck in the kernel (uninterruptible I/O) outlives even SIGKILL for a while:
    // the launcher waits that long again, then returns and says so.
    const auto give_up_at = detail::deadline_after(std::max(grace_period, std::chrono::milliseconds(1000)), kill_at);
    bool said = false;
    while (true) {
      std::set<pid_t> left;  // those still running: the rest are reaped here
      for (pid_t pid : leftovers()) {
        int status = 0;
        if (waitpid(pid, &status, WNOHANG) == 0) left.insert(pid);
      }
      if (left.empty()) return;
      const auto now = std::chrono::steady_clock::now();
      if (now >= give_up_at) {
        write_all(2, "nanoddp-run: " + std::to_string(left.size()) +
                         " process(es) that mpirun started did not end after SIGKILL (first pid " +
                         std::to_string(*left.begin()) + "); not waiting for them\n");
        return;
      }
      if (now >= kill_at) {
        if (!said)
          write_all(2, "nanoddp-run: " + std::to_string(left.size()) +
                           " process(es) that mpirun started were still running " + format_ms(grace_period) +
                           " after it ended; sending SIGKILL\n");
        said = true;
        // Every round: a killed process's own children are adopted in turn.
        for (pid_t pid : left) {
          kill(-pid, SIGKILL);
          kill(pid, SIGKILL);
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

 private:
  // This process's children, every thread's.
  static std::set<pid_t> children() {
    const std::vector<int> pids = detail::child_pids(getpid());
    return std::set<pid_t>(pids.begin(), pids.end());
  }
  // Children (zombies included) that were not ours before mpirun started.
  std::set<pid_t> leftovers() const {
    std::set<pid_t> pids;
    for (pid_t pid : children())
      if (before_.count(pid) == 0) pids.insert(pid);
    return pids;
  }
  const std::set<pid_t> before_;
  bool was_subreaper_ = false;
};

// In a rank, before its exec: OMP_NUM_THREADS=1 when the job runs several ranks on this node
// and the user set none, as torchrun does, so that N ranks of an OpenMP program (NumPy's BLAS,
// torch on the CPU) do not each start a thread per core. nanoddp itself uses no OpenMP.
void default_omp_threads(const LaunchOptions& options) {
  if (options.nproc_per_node > 1) setenv("OMP_NUM_THREADS", "1", /*overwrite=*/0);
}

// Starts one round of the group and supervises it until it ends.
Outcome run_round(const LaunchOptions& options, const std::vector<std::string>& program, int port, int round,
                  std::chrono::milliseconds timeout) {
  ChildGroup::Options group_options;
  group_options.grace_period = options.grace_period;
  group_options.children_relay_signals = options.backend == "mpi";
  group_options.children_end_with_their_own = options.backend == "mpi";
  group_options.pass_on_user_signals = true;
  group_options.timeout = timeout;
  if (timeout.count() > 0)
    group_options.timeout_description = "the job's --timeout of " + format_ms(options.timeout) +
                                        (round > 0 ? " (every round counts)" : "");
  ChildGroup group(group_options);

  if (options.backend == "mpi") {
    std::vector<std::string> cmd = mpirun_command(options, program, port);
    // The job and the round, as rank_env gives them (a program resumes only its own job's
    // checkpoint, and reads the round under either name).
    std::vector<std::string> exported = {"-x", "NANODDP_RESTART_COUNT=" + std::to_string(round), "-x",
                                         "TORCHELASTIC_RESTART_COUNT=" + std::to_string(round)};
    if (!options.job_id.empty()) exported.insert(exported.end(), {"-x", "NANODDP_JOB_ID=" + options.job_id});
    cmd.insert(cmd.begin() + 1, exported.begin(), exported.end());
    const std::vector<char*> argv = to_argv(cmd);
    const bool as_root = geteuid() == 0;
    MpirunRanks ranks;
    // false: the start failed or a signal came first; wait() reports it
    (void)group.start(0, "mpirun", "", [&](int) {
      // SIGTERM, not SIGKILL, when we die: mpirun then stops the ranks it started itself.
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      default_omp_threads(options);  // mpirun's ranks inherit its environment
      if (as_root) {
        setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
        setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
      }
      exec_or_die(argv, "nanoddp-run");
    });
    const Outcome outcome = group.wait();
    ranks.wait_for_leftovers(options.grace_period);
    // mpirun's status is its first failed rank's, a signal as 128 + its number, and mpirun's
    // own message above names that rank; this launcher cannot see the ranks themselves.
    const ExitStatus& status = outcome.failed_status;
    const bool signalled = status.exited && status.code > 128 && status.code <= 128 + SIGRTMAX;
    if (outcome.kind == Outcome::Kind::ChildFailed && signalled)
      write_all(2, "nanoddp-run: mpirun passes on its first failed rank's status: " + std::to_string(status.code) +
                       " is 128 + " + std::to_string(status.code - 128) + ", a rank killed by " +
                       signal_name(status.code - 128) + "; mpirun's message above names the rank\n");
    return outcome;
  } else {
    std::vector<std::string> args = program;
    const std::vector<char*> argv = to_argv(args);
    for (int local = 0; local < options.nproc_per_node; ++local) {
      const auto env = rank_env(options, local, port, round);
      const int rank = options.node_rank * options.nproc_per_node + local;
      const std::string name = "rank " + std::to_string(rank);
      const bool started = group.start(rank, name, "[" + name + "] ", [&](int) {
        for (const auto& [key, value] : env) setenv(key.c_str(), value.c_str(), 1);
        default_omp_threads(options);
        exec_or_die(argv, "nanoddp-run");
      });
      if (!started) break;  // wait() terminates the ranks already started and says why
    }
  }
  return group.wait();
}

}  // namespace

int launch(const LaunchOptions& given, const std::vector<std::string>& program) {
  check_options(given, program);
  LaunchOptions options = given;
  give_job_identity(options);
  const bool use_mpi = options.backend == "mpi";
  if (use_mpi) mpirun_command(options, program, 1);  // validates before anything starts
  // Every rank would fail the same way, some before the first failure stops the others and
  // some not: say it once, and start nothing.
  std::string found_at;
  if (const int error = program_unrunnable(program[0], &found_at); error != 0) {
    write_all(2, "nanoddp-run: cannot execute '" + program[0] + "': " + std::strerror(error) +
                     (program[0].find('/') == std::string::npos ? " (searched PATH)" : "") +
                     unrunnable_hint(program[0], error) + "; no rank was started\n");
    return exec_failure_code(error);
  }
  if (is_python_without_shebang(found_at)) {
    write_all(2,
              "nanoddp-run: cannot execute '" + program[0] +
                  "': a Python script without a #! line would run under /bin/sh (torchrun --no-python fails "
                  "on it too: Exec format error); start it with its interpreter (python3 " +
                  program[0] + ") or give it a #!/usr/bin/env python3 line; no rank was started\n");
    return exec_failure_code(ENOEXEC);
  }
  if (const std::string interpreter = unrunnable_interpreter(found_at); !interpreter.empty()) {
    write_all(2, "nanoddp-run: cannot execute '" + program[0] + "': its #! line names " + interpreter +
                     ", which does not exist or cannot run; no rank was started\n");
    return exec_failure_code(ENOENT);  // the shell's 127 for a missing interpreter
  }

  // The job's --timeout spans every round (Note [Restart rounds]).
  const auto started = Clock::now();
  for (int round = 0;; ++round) {
    std::chrono::milliseconds timeout{0};
    if (options.timeout.count() > 0) {
      timeout = options.timeout - std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started);
      if (timeout.count() <= 0) {
        write_all(2, "nanoddp-run: the job's timeout of " + format_ms(options.timeout) +
                         " passed before restart " + std::to_string(round) + "\n");
        return 124;
      }
    }
    // A fresh port for each round of a one-node job: the old rank 0's port may still be held.
    const int port = options.master_port != 0 ? options.master_port : pick_free_port(options.master_addr);
    const Outcome outcome = run_round(options, program, port, round, timeout);
    switch (outcome.kind) {
      case Outcome::Kind::AllSucceeded: return 0;
      case Outcome::Kind::ChildFailed:
        if (outcome.late_signal != 0) {  // a user's signal during the stop ends the job
          write_all(2, "nanoddp-run: received " + signal_name(outcome.late_signal) +
                           " after the failure: no restart\n");
          return 128 + outcome.late_signal;
        }
        if (outcome.reader_gone) {  // `| head`: no one would read a restart
          write_all(2, "nanoddp-run: the reader of its output is gone: no restart\n");
        } else if (round < options.max_restarts) {
          write_all(2, "nanoddp-run: restarting every rank (restart " + std::to_string(round + 1) + " of " +
                           std::to_string(options.max_restarts) + ", NANODDP_RESTART_COUNT=" +
                           std::to_string(round + 1) + ")\n");
          continue;
        } else if (options.max_restarts > 0) {
          write_all(2, "nanoddp-run: no restart left (--max-restarts " + std::to_string(options.max_restarts) +
                           "): the job fails\n");
        }
        // A rank that exited 0 without joining the others (Note [Launcher link], item 3) failed
        // the job all the same.
        return outcome.failed_status.ok() ? 1 : outcome.failed_status.shell_code();
      // A user's signal while the ranks were being stopped is what the job ends by (docs/launching.md).
      case Outcome::Kind::StartFailed:
        return outcome.late_signal != 0 ? 128 + outcome.late_signal : 1;
      case Outcome::Kind::TimedOut:
        return outcome.late_signal != 0 ? 128 + outcome.late_signal : 124;
      case Outcome::Kind::Interrupted: return 128 + outcome.signal;
    }
    return 1;
  }
}

}  // namespace nanoddp::dist
