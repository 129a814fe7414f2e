// The launcher: child processes, their output, their failures. See Note [Launch contract] in
// dist/launch.h.
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
#include <fstream>
#include <set>
#include <thread>

#include "core/error.h"
#include "dist/launcher_link.h"

namespace nanoddp::dist {

namespace {

using Clock = std::chrono::steady_clock;

// The signals a supervising ChildGroup handles, and what it does with them: SIGCHLD wakes the
// loop; SIGINT/SIGTERM/SIGHUP are forwarded; SIGPIPE is ignored so that a closed stdout (say,
// `nanoddp-run ... | head`) cannot kill the launcher and orphan the ranks.
constexpr int kHandledSignals[] = {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGPIPE};
constexpr size_t kNumHandled = sizeof(kHandledSignals) / sizeof(kHandledSignals[0]);

// Self-pipe: the handler writes the signal number, the poll loop reads it. -1 when no
// ChildGroup is alive.
int g_signal_pipe[2] = {-1, -1};
struct sigaction g_saved_actions[kNumHandled];

bool is_forwarded(int signal) { return signal == SIGINT || signal == SIGTERM || signal == SIGHUP; }

void on_signal(int signal) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(signal);
  ssize_t ignored = write(g_signal_pipe[1], &byte, 1);  // full pipe: a wake-up is pending anyway
  (void)ignored;
  errno = saved_errno;
}

// Writes all of `data` to `fd`; gives up quietly when the reader is gone (EPIPE) or the fd is
// broken, because losing output must never stop supervision.
void write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, 100);
    } else {
      return;
    }
  }
}

void close_fd(int& fd) {
  if (fd >= 0) close(fd);
  fd = -1;
}

// Largest amount of a line kept while waiting for its '\n'; beyond it the text is printed as
// a line of its own so a child that never writes '\n' cannot grow our memory without bound.
constexpr size_t kMaxPendingLine = 64 * 1024;
constexpr size_t kMaxMessage = 64 * 1024;
// After the last child has exited, how long to keep reading pipes still held open by
// processes that escaped their rank's group (setsid).
constexpr std::chrono::milliseconds kDrainTimeout{1000};

struct Stream {
  int fd = -1;       // read end of the child's pipe; -1 once at EOF
  int dst = -1;      // 1 or 2: where its lines go; -1: kept as the child's message
  std::string pending;
};

std::string format_ms(std::chrono::milliseconds ms) {
  if (ms.count() % 1000 == 0) return std::to_string(ms.count() / 1000) + " s";
  return std::to_string(ms.count()) + " ms";
}

}  // namespace

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
  NANODDP_CHECK(rc == 0, DistError, "pick_free_port: cannot resolve master address '", addr,
                "': ", gai_strerror(rc));
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
                                                          int master_port) {
  const int rank = options.node_rank * options.nproc_per_node + local_rank;
  std::vector<std::pair<std::string, std::string>> env = {
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"WORLD_SIZE", std::to_string(options.nnodes * options.nproc_per_node)},
      {"LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node)},
      {"GROUP_RANK", std::to_string(options.node_rank)},
      {"MASTER_ADDR", options.master_addr},
      {"MASTER_PORT", std::to_string(master_port)},
  };
  if (!options.backend.empty()) env.emplace_back("NANODDP_BACKEND", options.backend);
  if (!options.job_id.empty()) env.emplace_back("NANODDP_JOB_ID", options.job_id);
  if (!options.store_token.empty()) env.emplace_back("NANODDP_STORE_TOKEN", options.store_token);
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
                " is outside 0..", o.nnodes - 1);
  NANODDP_CHECK(o.master_port >= 0 && o.master_port <= 65535, ValueError, "launch: --master-port ",
                o.master_port, " is not a TCP port");
  NANODDP_CHECK(o.backend.empty() || o.backend == "auto" || o.backend == "gloo" || o.backend == "mpi" ||
                    o.backend == "nccl" || o.backend == "shm" || o.backend == "shm+gloo",
                ValueError, "launch: --backend must be auto, shm, shm+gloo, gloo, mpi or nccl, got '", o.backend,
                "'");
  NANODDP_CHECK(o.grace_period.count() >= 0, ValueError, "launch: negative grace period");
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
      "OMPI_UNIVERSE_SIZE", "OMPI_FIRST_RANKS", "OMPI_APP_CTX_NUM_PROCS", "OMPI_NUM_APP_CTX", "OMPI_COMMAND",
      "OMPI_ARGV", "OMPI_FILE_LOCATION", "OMPI_MCA_pmix", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
      "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS",
      "SLURM_STEP_TASKS_PER_NODE", "SLURM_GTIDS", "NANODDP_BACKEND"};
  for (const char* prefix : kPrefixes)
    if (name.rfind(prefix, 0) == 0) return true;
  return kNames.count(name) > 0;
}

// Runs in a child before it sets its own variables (Note [Innermost launcher wins]).
void clear_outer_launcher_env() {
  std::vector<std::string> names;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text = *entry;
    const std::string name = text.substr(0, text.find('='));
    if (is_outer_launcher_variable(name)) names.push_back(name);
  }
  for (const std::string& name : names) unsetenv(name.c_str());
}

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

// 0 when execvp(program) would find an executable regular file, else why not (ENOENT, EACCES),
// by execvp's search: a name with '/' as is, else each folder of PATH in turn (an empty entry
// is the current folder), an executable one winning over a non-executable one found earlier.
int program_unrunnable(const std::string& program, std::string* found_at) {
  const auto check = [found_at](const std::string& path) {
    struct stat info {};
    if (::stat(path.c_str(), &info) != 0) return errno == ENOTDIR ? ENOENT : errno;
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
    if (found == EACCES) error = EACCES;
    if (end == path.size()) return error;
    begin = end + 1;
  }
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
                     (program[0].find('/') == std::string::npos ? " (searched PATH)" : "") + "; no rank was started\n");
    return exec_failure_code(error);
  }
  if (const std::string interpreter = unrunnable_interpreter(found_at); !interpreter.empty()) {
    write_all(2, "nanoddp-run: cannot execute '" + program[0] + "': its #! line names " + interpreter +
                     ", which does not exist or cannot run; no rank was started\n");
    return exec_failure_code(ENOENT);  // the shell's 127 for a missing interpreter
  }
  const int port = options.master_port != 0 ? options.master_port : pick_free_port(options.master_addr);

  ChildGroup::Options group_options;
  group_options.grace_period = options.grace_period;
  group_options.timeout = options.timeout;
  ChildGroup group(group_options);

  if (use_mpi) {
    std::vector<std::string> cmd = mpirun_command(options, program, port);
    const std::vector<char*> argv = to_argv(cmd);
    const bool as_root = geteuid() == 0;
    // false: the start failed or a signal came first; wait() reports it
    (void)group.start(0, "mpirun", "", [&](int) {
      // SIGTERM, not SIGKILL, when we die: mpirun then stops the ranks it started itself.
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (as_root) {
        setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
        setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
      }
      exec_or_die(argv, "nanoddp-run");
    });
  } else {
    std::vector<std::string> args = program;
    const std::vector<char*> argv = to_argv(args);
    for (int local = 0; local < options.nproc_per_node; ++local) {
      const auto env = rank_env(options, local, port);
      const int rank = options.node_rank * options.nproc_per_node + local;
      const std::string name = "rank " + std::to_string(rank);
      const bool started = group.start(rank, name, "[" + name + "] ", [&](int) {
        for (const auto& [key, value] : env) setenv(key.c_str(), value.c_str(), 1);
        exec_or_die(argv, "nanoddp-run");
      });
      if (!started) break;  // wait() terminates the ranks already started and says why
    }
  }

  const Outcome outcome = group.wait();
  switch (outcome.kind) {
    case Outcome::Kind::AllSucceeded: return 0;
    case Outcome::Kind::ChildFailed: return outcome.failed_status.shell_code();
    case Outcome::Kind::StartFailed: return 1;
    case Outcome::Kind::TimedOut: return 124;
    case Outcome::Kind::Interrupted: return 128 + outcome.signal;
  }
  return 1;
}

// ---- ChildGroup -------------------------------------------------------------------------------

struct ChildGroup::Child {
  int rank = 0;
  std::string name;
  std::string prefix;
  pid_t pid = -1;
  Stream out, err, msg;
  bool exited = false;  // seen by waitid(WNOWAIT): a zombie, not yet reaped
  bool reaped = false;
  bool failed = false;  // exited by a failure of its own (see poll_exit in wait())
  bool named = false;   // its failure has been reported
  ExitStatus status;
};

ChildGroup::ChildGroup(Options options) : options_(std::move(options)), created_(Clock::now()) {
  NANODDP_CHECK(g_signal_pipe[0] < 0, DistError,
                "launch: another launch or spawn is already supervising children in this process");
  NANODDP_CHECK(pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) == 0, DistError, "launch: pipe2 failed: ",
                std::strerror(errno));
  // Note [Launcher link] in dist/launcher_link.h. Both pipes are close-on-exec here; a child
  // clears the flag on the ends it inherits.
  if (pipe2(alive_pipe_, O_CLOEXEC) != 0 || pipe2(failure_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) {
    const int err = errno;
    for (int* fd : {&alive_pipe_[0], &alive_pipe_[1], &failure_pipe_[0], &failure_pipe_[1], &g_signal_pipe[0],
                    &g_signal_pipe[1]})
      close_fd(*fd);
    NANODDP_THROW(DistError, "launch: pipe2 failed: ", std::strerror(err));
  }
  for (size_t i = 0; i < kNumHandled; ++i) {
    struct sigaction action {};
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    action.sa_handler = kHandledSignals[i] == SIGPIPE ? SIG_IGN : on_signal;
    if (kHandledSignals[i] == SIGCHLD) action.sa_flags |= SA_NOCLDSTOP;
    sigaction(kHandledSignals[i], nullptr, &g_saved_actions[i]);
    // An ignored SIGINT/SIGTERM/SIGHUP (nohup, a background job) stays ignored: we must not
    // turn a hang-up the user asked to ignore into the end of the job.
    if (is_forwarded(kHandledSignals[i]) && g_saved_actions[i].sa_handler == SIG_IGN) continue;
    sigaction(kHandledSignals[i], &action, nullptr);
  }
}

ChildGroup::~ChildGroup() {
  // Whatever wait() did not finish (an exception, or wait() never called): kill and reap.
  for (Child& c : children_) {
    if (!c.reaped && c.pid > 0) {
      kill(-c.pid, SIGKILL);
      kill(c.pid, SIGKILL);
      int status = 0;
      while (waitpid(c.pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
    close_fd(c.out.fd);
    close_fd(c.err.fd);
    close_fd(c.msg.fd);
  }
  for (size_t i = 0; i < kNumHandled; ++i) sigaction(kHandledSignals[i], &g_saved_actions[i], nullptr);
  close_fd(g_signal_pipe[0]);
  close_fd(g_signal_pipe[1]);
  for (int* fd : {&alive_pipe_[0], &alive_pipe_[1], &failure_pipe_[0], &failure_pipe_[1]}) close_fd(*fd);
}

// Between two starts, whatever would make wait() end the job: a failed start, a forwarded
// signal (read from the self-pipe and kept for wait()), the timeout, or a child that has
// already failed (looked for only after a SIGCHLD; wait() looks at every child anyway, so
// consuming the SIGCHLD bytes here loses nothing).
bool ChildGroup::must_stop_starting() {
  if (!start_error_.empty() || pending_signal_ != 0) return true;
  if (options_.timeout.count() > 0 && Clock::now() >= created_ + options_.timeout) return true;
  bool child_exited = false;
  unsigned char bytes[64];
  ssize_t n;
  while ((n = read(g_signal_pipe[0], bytes, sizeof(bytes))) > 0)
    for (ssize_t i = 0; i < n; ++i) {
      if (bytes[i] == SIGCHLD) {
        child_exited = true;
      } else if (pending_signal_ == 0) {
        pending_signal_ = bytes[i];
      }
    }
  if (pending_signal_ != 0) return true;
  if (!child_exited) return false;
  for (const Child& c : children_) {
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(c.pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == c.pid &&
        !(info.si_code == CLD_EXITED && info.si_status == 0))
      return true;
  }
  return false;
}

bool ChildGroup::start(int rank, std::string name, std::string prefix,
                       const std::function<void(int msg_fd)>& child_main) {
  NANODDP_CHECK(!waited_, DistError, "launch: start() after wait()");
  if (must_stop_starting()) return false;
  auto fail = [&](const std::string& why) {
    start_error_ = why;
    start_error_name_ = name;
    return false;
  };
  int out[2] = {-1, -1}, err[2] = {-1, -1}, msg[2] = {-1, -1};
  for (int* fds : {out, err, msg}) {
    if (pipe2(fds, O_CLOEXEC) == 0) continue;
    const int pipe_errno = errno;
    for (int* opened : {out, err, msg}) {
      close_fd(opened[0]);
      close_fd(opened[1]);
    }
    return fail(std::string("pipe2 failed: ") + std::strerror(pipe_errno) +
                (pipe_errno == EMFILE ? " (each rank holds 3 descriptors in the launcher: raise `ulimit -n`)" : ""));
  }

  // Signals stay blocked across fork so that the child cannot run our handler (and write into
  // our self-pipe) before it has restored the handlers it should have.
  sigset_t all, previous;
  sigfillset(&all);
  sigprocmask(SIG_BLOCK, &all, &previous);
  fflush(nullptr);  // or the child would print the parent's buffered output a second time
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    // No orphans (Note [Launcher link]): SIGKILL when we die. Had we died before the prctl,
    // the child has been reparented already and must not start at all.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(128 + SIGKILL);
    close(alive_pipe_[1]);
    close(failure_pipe_[0]);
    for (int fd : {alive_pipe_[0], failure_pipe_[1]}) fcntl(fd, F_SETFD, 0);
    clear_outer_launcher_env();  // child_main sets this launcher's variables
    setenv(kLauncherFdEnv, describe_pipe_end(alive_pipe_[0]).c_str(), 1);
    setenv(kFailureFdEnv, describe_pipe_end(failure_pipe_[1]).c_str(), 1);
    // A rank starts as a fresh program would: SIGINT/SIGTERM/SIGHUP at their defaults (unless
    // the launcher was told to ignore them), so that our SIGTERM terminates it even when it is
    // a fork of a program with handlers of its own (spawn); SIGCHLD and SIGPIPE as they were.
    for (size_t i = 0; i < kNumHandled; ++i) {
      struct sigaction action = g_saved_actions[i];
      if (is_forwarded(kHandledSignals[i]) && action.sa_handler != SIG_IGN) {
        action = {};
        action.sa_handler = SIG_DFL;
      }
      sigaction(kHandledSignals[i], &action, nullptr);
    }
    close(g_signal_pipe[0]);
    close(g_signal_pipe[1]);
    for (Child& other : children_) {
      close(other.out.fd);
      close(other.err.fd);
      close(other.msg.fd);
    }
    const int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    dup2(out[1], 1);
    dup2(err[1], 2);
    close(out[0]);
    close(err[0]);
    close(msg[0]);
    sigprocmask(SIG_SETMASK, &previous, nullptr);
    child_main(msg[1]);
    _exit(127);
  }
  const int fork_errno = errno;
  if (pid > 0) setpgid(pid, pid);  // also here: kill(-pid) must work as soon as fork returns
  sigprocmask(SIG_SETMASK, &previous, nullptr);
  close(out[1]);
  close(err[1]);
  close(msg[1]);
  if (pid < 0) {
    close(out[0]);
    close(err[0]);
    close(msg[0]);
    return fail(std::string("fork failed: ") + std::strerror(fork_errno));
  }
  Child c;
  c.rank = rank;
  c.name = std::move(name);
  c.prefix = std::move(prefix);
  c.pid = pid;
  c.out = {out[0], 1, {}};
  c.err = {err[0], 2, {}};
  c.msg = {msg[0], -1, {}};
  for (int fd : {out[0], err[0], msg[0]}) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  children_.push_back(std::move(c));
  return true;
}

void ChildGroup::terminate_all(int signal) {
  for (Child& c : children_) {
    if (c.reaped) continue;
    // The whole group: the rank and whatever it started. An exited rank's zombie still holds
    // its pgid, so leftovers of a finished rank are reached too.
    if (kill(-c.pid, signal) != 0 && !c.exited) kill(c.pid, signal);
  }
}

void ChildGroup::read_failure_reports() {
  char buffer[4096];
  ssize_t n;
  while ((n = read(failure_pipe_[0], buffer, sizeof(buffer))) > 0) failure_text_.append(buffer, static_cast<size_t>(n));
  const size_t complete = failure_text_.rfind('\n');
  if (complete == std::string::npos) return;
  // A rank's first report counts: what it lost first is why it failed.
  for (const auto& [rank, lost] : parse_lost_peer_reports(failure_text_.substr(0, complete + 1)))
    lost_peer_.emplace(rank, lost);
  failure_text_.erase(0, complete + 1);
}

Outcome ChildGroup::wait() {
  NANODDP_CHECK(!waited_, DistError, "launch: wait() called twice");
  waited_ = true;
  Outcome outcome;
  const auto never = Clock::time_point::max();
  const auto deadline = options_.timeout.count() > 0 ? created_ + options_.timeout : never;
  auto kill_at = never;
  bool terminating = false, killed = false;

  auto report = [&](const std::string& text) {
    if (options_.report) write_all(2, options_.reporter + ": " + text + "\n");
  };
  auto begin_termination = [&](int signal, const std::string& why) {
    size_t alive = 0;
    for (const Child& c : children_) alive += c.exited ? 0 : 1;
    report(why + (alive > 0 ? "; sending " + signal_name(signal) + " to the " + std::to_string(alive) +
                                  " remaining process(es), SIGKILL after " + format_ms(options_.grace_period)
                            : ""));
    terminating = true;
    terminate_all(signal);
    kill_at = Clock::now() + options_.grace_period;
  };

  // Emits every complete line of `s` (all of it at EOF) with the child's prefix.
  auto emit = [&](Child& c, Stream& s, bool at_eof) {
    if (s.dst < 0) return;
    std::string out;
    size_t begin = 0;
    for (size_t nl; (nl = s.pending.find('\n', begin)) != std::string::npos; begin = nl + 1)
      out += c.prefix + s.pending.substr(begin, nl + 1 - begin);
    s.pending.erase(0, begin);
    if (!s.pending.empty() && (at_eof || s.pending.size() >= kMaxPendingLine)) {
      out += c.prefix + s.pending + "\n";
      s.pending.clear();
    }
    if (!out.empty()) write_all(s.dst, out);
  };
  auto read_stream = [&](Child& c, Stream& s) {
    char buffer[65536];
    while (s.fd >= 0) {
      const ssize_t n = read(s.fd, buffer, sizeof(buffer));
      if (n > 0) {
        if (s.dst < 0) {
          if (s.pending.size() < kMaxMessage) s.pending.append(buffer, static_cast<size_t>(n));
        } else {
          s.pending.append(buffer, static_cast<size_t>(n));
          emit(c, s, false);
        }
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && errno == EAGAIN) {
        return;
      } else {  // EOF or a broken pipe
        close_fd(s.fd);
        emit(c, s, true);
      }
    }
  };
  // One poll round over the self-pipe and every open stream; returns the signals received.
  auto poll_once = [&](std::chrono::milliseconds wait) {
    std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}, {failure_pipe_[0], POLLIN, 0}};
    std::vector<std::pair<Child*, Stream*>> owners{{nullptr, nullptr}, {nullptr, nullptr}};
    for (Child& c : children_)
      for (Stream* s : {&c.out, &c.err, &c.msg})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          owners.emplace_back(&c, s);
        }
    std::vector<int> signals;
    const int ready = poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(0, wait.count())));
    if (ready <= 0) return signals;
    if (fds[1].revents != 0) read_failure_reports();
    for (size_t i = 2; i < fds.size(); ++i)
      if (fds[i].revents != 0) read_stream(*owners[i].first, *owners[i].second);
    if (fds[0].revents != 0) {
      unsigned char bytes[64];
      ssize_t n;
      while ((n = read(g_signal_pipe[0], bytes, sizeof(bytes))) > 0)
        for (ssize_t i = 0; i < n; ++i)
          if (bytes[i] != SIGCHLD) signals.push_back(bytes[i]);
    }
    return signals;
  };

  // 0. What stopped the starts (see must_stop_starting) ends the job like a failure after start.
  if (!start_error_.empty()) {
    outcome.kind = Outcome::Kind::StartFailed;
    outcome.failed_name = start_error_name_;
    outcome.failed_message = start_error_;
    begin_termination(SIGTERM, "could not start " + start_error_name_ + ": " + start_error_);
  } else if (pending_signal_ != 0) {
    outcome.kind = Outcome::Kind::Interrupted;
    outcome.signal = pending_signal_;
    begin_termination(pending_signal_, "received " + signal_name(pending_signal_) + " while starting ranks");
  }

  // Whether c has exited (a zombie now); records how, and whether that is a failure of its own
  // (any failure before we stop the job; a non-zero exit code while we do). WNOWAIT leaves the
  // zombie (and with it the pgid) in place until the end.
  auto poll_exit = [&](Child& c) {
    if (c.exited) return true;
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(c.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid != c.pid)
      return false;
    c.exited = true;
    if (info.si_code == CLD_EXITED) {
      c.status.exited = true;
      c.status.code = info.si_status;
    } else {
      c.status.signal = info.si_status;
    }
    c.failed = !c.status.ok() && (!terminating || c.status.exited);
    return true;
  };
  auto child_of_rank = [&](int rank) -> Child* {
    for (Child& c : children_)
      if (c.rank == rank) return &c;
    return nullptr;
  };
  // The failure that came first (Note [Launcher link], item 2): from a failed rank, follow
  // "lost rank R" to R while R failed too; R's failure caused the others'. *running is set to
  // the lost rank the chain stops at when that one is still running: its own failure may be
  // under way (a rank's sockets close before it has exited, say while it writes a checkpoint).
  auto first_failure = [&](Child* failed, Child** running) {
    read_failure_reports();
    *running = nullptr;
    std::set<int> seen{failed->rank};
    for (auto lost = lost_peer_.find(failed->rank); lost != lost_peer_.end(); lost = lost_peer_.find(failed->rank)) {
      Child* peer = child_of_rank(lost->second);
      if (peer == nullptr || !seen.insert(peer->rank).second) break;
      if (!poll_exit(*peer)) {
        *running = peer;
        break;
      }
      if (!peer->failed) break;
      failed = peer;
    }
    return failed;
  };
  auto describe_failure = [&](const Child& c) {
    std::string text = c.name + " (pid " + std::to_string(c.pid) + ") ";
    text += (c.pid == outcome.failed_pid ? "failed: " : "also failed: ") + c.status.describe();
    const auto lost = lost_peer_.find(c.rank);
    if (lost != lost_peer_.end()) text += " (it lost rank " + std::to_string(lost->second) + ")";
    return text;
  };
  Child* first_seen = nullptr;  // the first failed child we saw, while its blame is pending
  auto blame_until = never;     // until then, wait for the rank it lost to end by itself

  while (true) {
    // 1. Who has exited? The first failure ends the job once we know whose it is: a rank that
    //    failed by losing a rank still running is not blamed before that one has ended too
    //    (for up to a grace period). Every other rank that fails on its own is named after it.
    bool any_failed = false;
    for (Child& c : children_)
      if (!c.exited && poll_exit(c) && c.failed) any_failed = true;
    if (any_failed && !terminating && first_seen == nullptr) {
      for (Child& c : children_)
        if (first_seen == nullptr && c.failed) first_seen = &c;
      blame_until = Clock::now() + options_.grace_period;
    }
    if (first_seen != nullptr && !terminating) {
      Child* running = nullptr;
      Child* first = first_failure(first_seen, &running);
      if (running == nullptr || Clock::now() >= blame_until) {
        outcome.kind = Outcome::Kind::ChildFailed;
        outcome.failed_name = first->name;
        outcome.failed_rank = first->rank;
        outcome.failed_pid = first->pid;
        outcome.failed_status = first->status;
        first->named = true;
        begin_termination(SIGTERM, describe_failure(*first));
      }
    }
    if (terminating) {
      read_failure_reports();
      for (Child& c : children_)
        if (c.exited && c.failed && !c.named) {
          c.named = true;
          report(describe_failure(c));
        }
    }
    if (std::all_of(children_.begin(), children_.end(), [](const Child& c) { return c.exited; })) break;

    // 2. Clocks: the job's timeout, then the grace period.
    const auto now = Clock::now();
    if (!terminating && now >= deadline) {
      outcome.kind = Outcome::Kind::TimedOut;
      begin_termination(SIGTERM, "timed out after " + format_ms(options_.timeout));
    }
    if (terminating && !killed && Clock::now() >= kill_at) {
      terminate_all(SIGKILL);
      killed = true;
    }

    // 3. Output and signals, until the next event or clock.
    auto next = std::min(terminating && !killed ? kill_at : never, terminating ? never : std::min(deadline, blame_until));
    auto wait = std::chrono::milliseconds(1000);  // SIGCHLD wakes us; this is only a backstop
    if (next != never)
      wait = std::min(wait, std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()) +
                                std::chrono::milliseconds(1));
    for (int signal : poll_once(wait)) {
      if (!terminating) {
        outcome.kind = Outcome::Kind::Interrupted;
        outcome.signal = signal;
        begin_termination(signal, "received " + signal_name(signal));
      } else if (!killed) {  // a second Ctrl-C: stop waiting politely
        terminate_all(SIGKILL);
        killed = true;
      }
    }
  }

  // 4. Leftovers in the ranks' groups die now; then read what is still in the pipes.
  terminate_all(SIGKILL);
  const auto drain_until = Clock::now() + kDrainTimeout;
  auto any_open = [&] {
    for (const Child& c : children_)
      if (c.out.fd >= 0 || c.err.fd >= 0 || c.msg.fd >= 0) return true;
    return false;
  };
  while (any_open() && Clock::now() < drain_until)
    poll_once(std::chrono::duration_cast<std::chrono::milliseconds>(drain_until - Clock::now()) +
              std::chrono::milliseconds(1));
  for (Child& c : children_) {
    for (Stream* s : {&c.out, &c.err, &c.msg}) {
      close_fd(s->fd);
      emit(c, *s, true);
    }
    int status = 0;
    while (waitpid(c.pid, &status, 0) < 0 && errno == EINTR) {
    }
    c.reaped = true;
    outcome.statuses.push_back(c.status);
    if (outcome.kind == Outcome::Kind::ChildFailed && c.pid == outcome.failed_pid)
      outcome.failed_message = c.msg.pending;
  }
  return outcome;
}

}  // namespace nanoddp::dist
