// nanoddp-run: start the ranks of a distributed job on this node (our torchrun).
//
//   nanoddp-run --nproc-per-node 4 ./fashion_mnist --epochs 3
//   nanoddp-run --nproc-per-node 2 sh -c 'echo $RANK of $WORLD_SIZE'
//   nanoddp-run --nproc-per-node 2 --backend mpi ./fashion_mnist     # delegates to mpirun
//
// Everything from PROGRAM on is passed through untouched. The work is done by dist::launch()
// (dist/launch.h: the env each rank gets, output prefixes, fail-fast and signal handling).
#include <dirent.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/trace.h"
#include "dist/launch.h"
#include "dist/launch_detail.h"
#include "kernels/device_memory.h"
#include "tools/cli_checks.h"

namespace {

// Seconds; the upper bound keeps the conversion to milliseconds far from overflow.
constexpr double kMaxSeconds = 1e9;

// CLI11 derives "Usage: nanoddp-run [OPTIONS]" from the declared options; PROGRAM is not one
// of them (prefix_command), so the line is written here.
class UsageFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override {
    return "Usage: nanoddp-run [OPTIONS] PROGRAM [ARGS...]\n";
  }
};

// " (did you mean --nproc-per-node?)" for the option `given` most likely meant
// (nanoddp::cli::closest_long_option), else "".
std::string closest_option(const CLI::App& app, const std::string& given) {
  const std::string known = nanoddp::cli::closest_long_option(app, given);
  return known.empty() ? "" : " (did you mean " + known + "?)";
}

// The folder where ranks that record a trace (--trace FILE or NANODDP_TRACE) leave their parts
// (core/trace.h); merged into FILE when the job ends, then removed. Only its name is made
// here: the first rank that writes a part creates it, so a job that records no trace leaves
// nothing in $TMPDIR, even when the launcher is killed with SIGKILL.
class TraceParts {
 public:
  TraceParts() {
    const char* tmp = std::getenv("TMPDIR");
    std::random_device random;
    char suffix[32];
    std::snprintf(suffix, sizeof(suffix), "%d-%08x%08x", static_cast<int>(::getpid()), random(), random());
    dir_ = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/nanoddp-trace-" + suffix;
    ::setenv("NANODDP_TRACE_PARTS", dir_.c_str(), 1);
  }
  ~TraceParts() {
    if (dir_.empty()) return;
    if (DIR* dir = ::opendir(dir_.c_str())) {
      while (dirent* entry = ::readdir(dir)) {
        const std::string name = entry->d_name;
        if (name != "." && name != "..") ::unlink((dir_ + "/" + name).c_str());
      }
      ::closedir(dir);
    }
    ::rmdir(dir_.c_str());
  }
  TraceParts(const TraceParts&) = delete;
  TraceParts& operator=(const TraceParts&) = delete;

  // Merges what the ranks left, reporting on stderr; false when that failed. Never throws.
  bool merge() const {
    if (dir_.empty()) return true;
    try {
      const std::string path = nanoddp::trace::merge_parts(dir_);
      // Through write_all: after the job its output may have been dropped (Note [Output relay]).
      if (!path.empty())
        nanoddp::dist::launch_detail::write_all(
            2, "nanoddp-run: trace of this node's ranks written to " + path + "\n");
      return true;
    } catch (const std::exception& e) {
      nanoddp::dist::launch_detail::write_all(
          2, "nanoddp-run: the ranks' traces were not merged: " + nanoddp::message_of(e) + "\n");
      return false;
    }
  }

 private:
  std::string dir_;
};

// The ranks --nproc-per-node asks for (its value checked by then): a number, or torchrun's
// cpu, gpu and auto, capped at kMaxProcPerNode. Empty for gpu on a machine without one.
std::optional<int> ranks_per_node(const std::string& text) {
  const int gpus = text == "gpu" || text == "auto" ? nanoddp::kernels::cuda::device_count() : 0;
  const int cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (text == "gpu" && gpus == 0) return std::nullopt;
  const int n = text == "cpu"    ? cpus
                : text == "gpu"  ? gpus
                : text == "auto" ? (gpus > 0 ? gpus : cpus)
                                 : std::stoi(text);
  return std::min(n, nanoddp::dist::kMaxProcPerNode);
}

}  // namespace

int main(int argc, char** argv) {
  namespace dist = nanoddp::dist;
  dist::LaunchOptions options;
  double grace_s = options.grace_period.count() / 1000.0;
  double timeout_s = 0;

  CLI::App app{"Start the ranks of a distributed nanoddp job on this node (like torchrun).", "nanoddp-run"};
  app.formatter(std::make_shared<UsageFormatter>());
  app.footer(
      "Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,\n"
      "torchrun's other worker variables (GROUP_WORLD_SIZE, ROLE_*, TORCHELASTIC_*), NANODDP_BACKEND with\n"
      "--backend, and NANODDP_JOB_ID and NANODDP_STORE_TOKEN, which admit it to\n"
      "rank 0's store (made fresh for a one-node job; across nodes, export the same on every node).\n"
      "Its output lines are prefixed \"[rank N] \" (mpirun's \"[1,N]<stdout>:\" with --backend mpi); a\n"
      "line longer than 64 KiB comes out in pieces of 64 KiB, each a line. When a rank fails the others\n"
      "get SIGTERM, then SIGKILL after the grace period, and a rank that failed because it lost another\n"
      "is not the one named. With --max-restarts N the group is then started again, whole, up to N\n"
      "times (the program resumes from its checkpoint). Exit status: 0 when every rank exits 0; else\n"
      "the failed rank's code (128 + signal for a signal); 2 for a usage error; 124 when --timeout\n"
      "stops the job; 126 or 127 when PROGRAM cannot be run (not executable, not found: the shell's\n"
      "codes); 128 + n when nanoddp-run gets signal n; 141 (128 + SIGPIPE) when the reader of its output\n"
      "goes (| head), which stops the ranks as a signal does; 1 when nanoddp-run itself fails.\n"
      "Ctrl-C and Ctrl-\\ are forwarded to every rank, and Ctrl-Z stops them with nanoddp-run (fg continues\n"
      "all); SIGUSR1 and SIGUSR2 are passed on to every rank and the job goes on (a warning, as Slurm's\n"
      "--signal=USR1@120, that a rank may act on); if nanoddp-run dies, so do the ranks (what a rank\n"
      "that is a script started may outlive a kill -9 of nanoddp-run). Options end at PROGRAM (or at\n"
      "--); an unknown option is an error. An outer launcher's rank variables (OMPI_*, PMIX_*, SLURM_*)\n"
      "never reach the ranks.");
  // Options end at PROGRAM: everything after it belongs to PROGRAM, even what looks like a flag.
  app.prefix_command();
  // Each flag also answers to torchrun's underscore spelling (--nproc_per_node), so a torchrun
  // command line carries over by changing the program's name.
  // torchrun's words are taken too: cpu (one rank per CPU, os.cpu_count()), gpu (one per GPU;
  // an error without one), auto (gpu where there is one, else cpu).
  std::string nproc_text = "1";
  const CLI::Validator count = nanoddp::cli::integer_in(1, dist::kMaxProcPerNode);
  app.add_option(
         "--nproc-per-node,--nproc_per_node", nproc_text,
         "ranks to start on this node, or torchrun's cpu (one per CPU), gpu (one per GPU) or auto (gpu on a "
         "machine with a GPU, else cpu)")
      ->check(CLI::Validator(
          [count](std::string& text) -> std::string {
            if (text == "cpu" || text == "gpu" || text == "auto") return "";
            std::string message = count(text);
            const size_t got = message.rfind(", got ");
            if (!message.empty() && got != std::string::npos) message.insert(got, " (or cpu, gpu, auto)");
            return message;
          },
          "1.." + std::to_string(dist::kMaxProcPerNode) + ", cpu, gpu or auto"))
      ->type_name("N")
      ->capture_default_str();
  app.add_option("--nnodes", options.nnodes, "nodes in the job (one nanoddp-run per node)")
      ->check(nanoddp::cli::integer_in(1))
      ->capture_default_str();
  app.add_option("--node-rank,--node_rank", options.node_rank, "this node's index, 0..nnodes-1")
      ->check(nanoddp::cli::integer_in(0))
      ->capture_default_str();
  app.add_option("--master-addr,--master_addr", options.master_addr, "address of rank 0's node (its Store)")
      ->check(nanoddp::cli::non_empty("a host", "HOST"))
      ->capture_default_str();
  app.add_option("--master-port,--master_port", options.master_port, "rank 0's Store port; 0 = pick a free one (one node)")
      ->check(nanoddp::cli::integer_in(0, 65535))
      ->capture_default_str();
  app.add_option("--backend", options.backend,
                 "exported as NANODDP_BACKEND; mpi starts the ranks through mpirun (default: none exported, each "
                 "program picks its own)")
      ->check(nanoddp::cli::backend());
  app.add_option("--grace-period", grace_s, "seconds between SIGTERM and SIGKILL when ranks are stopped")
      ->check(nanoddp::cli::number_in(0, kMaxSeconds))
      ->capture_default_str();
  app.add_option("--max-restarts,--max_restarts", options.max_restarts,
                 "when a rank fails, stop every rank and start the group again, up to this many times "
                 "(NANODDP_RESTART_COUNT tells the ranks which start this is)")
      ->check(nanoddp::cli::integer_in(0))
      ->capture_default_str();
  app.add_option("--timeout", timeout_s, "stop the job after this many seconds (restarts included); 0 = no limit")
      ->check(nanoddp::cli::number_in(0, kMaxSeconds))
      ->capture_default_str();
  bool standalone = false;
  app.add_flag("--standalone", standalone,
               "torchrun's one-node rendezvous: one node, on a free local port unless --master-port gives one, "
               "which is what nanoddp-run does anyway, so it is accepted and changes nothing (refused with --nnodes "
               "above 1)");
  bool no_python = false;
  app.add_flag(
      "--no-python,--no_python", no_python,
      "torchrun's flag to run PROGRAM as it is instead of with python, which is what nanoddp-run always "
      "does: accepted, changes nothing (for a script without #!, give its interpreter: python3 train.py)");

  // `--backend= PROGRAM` would take PROGRAM as the value: refuse an empty `--flag=` among our
  // own arguments. They end at PROGRAM, the first argument that is neither an option nor the
  // value of one (every option of ours but the flags takes a value).
  int own_end = 1;
  while (own_end < argc && argv[own_end][0] == '-' && std::string(argv[own_end]) != "--") {
    const std::string arg = argv[own_end];
    const CLI::Option* option = app.get_option_no_throw(arg);
    const bool flag = option != nullptr && option->get_expected_max() == 0;
    own_end += arg.find('=') != std::string::npos || flag ? 1 : 2;
  }
  if (auto code = nanoddp::cli::parse(app, argc, argv, "nanoddp-run", own_end)) return *code;
  std::vector<std::string> program = app.remaining();
  // prefix_command() stops at the first argument that is not one of our options, which would
  // make a misspelt option (--nproc 2) the program to execute. An argument that looks like an
  // option is refused; "--" ends our options for a program whose name starts with '-'.
  if (!program.empty() && program.front() == "--") {
    program.erase(program.begin());
  } else if (!program.empty() && program.front().size() > 1 && program.front()[0] == '-') {
    return nanoddp::cli::usage_error(
        "nanoddp-run",
        "unknown option '" + program.front() + "'" + closest_option(app, program.front()) +
            "; --help lists the options nanoddp-run takes (not torchrun's -m, --rdzv-*, --log-dir, "
            "--redirects, --tee or --monitor-interval: it watches its ranks all the time); use -- "
            "before a PROGRAM whose name starts with '-'");
  }
  if (program.empty()) {
    std::cerr << "nanoddp-run: no PROGRAM given\n" << app.help();
    return nanoddp::cli::kUsageErrorExit;
  }
  if (const auto resolved = ranks_per_node(nproc_text)) {
    options.nproc_per_node = *resolved;
    if (*resolved == dist::kMaxProcPerNode && nproc_text != std::to_string(*resolved))
      std::cerr << "nanoddp-run: --nproc-per-node " << nproc_text << ": " << dist::kMaxProcPerNode
                << " ranks, the most one node takes\n";
  } else {
    return nanoddp::cli::usage_error("nanoddp-run", "--nproc-per-node gpu: this machine has no usable GPU (" +
                                                        nanoddp::kernels::cuda::unavailable_reason() + ")");
  }
  if (standalone && options.nnodes > 1)
    return nanoddp::cli::usage_error("nanoddp-run", "--standalone is torchrun's one-node rendezvous; it cannot go with "
                                                    "--nnodes " + std::to_string(options.nnodes));
  // To the nearest millisecond (4.03 s is 4030 ms, whatever its binary rounding), and at least
  // 1: a --timeout under a millisecond is a limit, not 0 (no limit).
  const auto milliseconds = [](double seconds) {
    return std::chrono::milliseconds(seconds > 0 ? std::max(1LL, std::llround(seconds * 1000)) : 0LL);
  };
  options.grace_period = milliseconds(grace_s);
  options.timeout = milliseconds(timeout_s);

  // The launcher runs no training: if NANODDP_TRACE is set, only its ranks record. A file the
  // trace may not replace stops the job here, once, instead of in every rank.
  if (!nanoddp::trace::environment_error().empty()) {
    std::cerr << "nanoddp-run: NANODDP_TRACE is refused (above); no rank was started\n";
    return 1;
  }
  nanoddp::trace::stop();
  try {
    const TraceParts trace_parts;
    const int code = dist::launch(options, program);
    // A trace that was asked for and not written fails a job that succeeded otherwise, as a
    // rank's failed trace write does.
    return trace_parts.merge() ? code : (code == 0 ? 1 : code);
  } catch (const nanoddp::ValueError& e) {  // a combination of flags that cannot run
    return nanoddp::cli::usage_error("nanoddp-run", nanoddp::message_of(e));
  } catch (const std::exception& e) {
    std::cerr << "nanoddp-run: " << nanoddp::message_of(e) << "\n";
    return 1;
  }
}
