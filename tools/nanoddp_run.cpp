// nanoddp-run: start the ranks of a distributed job on this node (our torchrun).
//
//   nanoddp-run --nproc-per-node 4 ./fashion_mnist --epochs 3
//   nanoddp-run --nproc-per-node 2 sh -c 'echo $RANK of $WORLD_SIZE'
//   nanoddp-run --nproc-per-node 2 --backend mpi ./fashion_mnist     # delegates to mpirun
//
// Everything from PROGRAM on is passed through untouched. The work is done by dist::launch()
// (dist/launch.h: the env each rank gets, output prefixes, fail-fast and signal handling).
#include <CLI/CLI.hpp>

#include <climits>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/launch.h"
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

}  // namespace

int main(int argc, char** argv) {
  namespace dist = nanoddp::dist;
  dist::LaunchOptions options;
  double grace_s = options.grace_period.count() / 1000.0;
  double timeout_s = 0;

  CLI::App app{"Start the ranks of a distributed nanoddp job on this node (like torchrun).", "nanoddp-run"};
  app.formatter(std::make_shared<UsageFormatter>());
  app.footer(
      "Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT\n"
      "(and NANODDP_BACKEND with --backend). Its output lines are prefixed \"[rank N] \". When a rank\n"
      "fails the others get SIGTERM, then SIGKILL after the grace period; the exit code is the failed\n"
      "rank's (128 + signal for a signal). Ctrl-C is forwarded to every rank.");
  // Options end at PROGRAM: everything after it belongs to PROGRAM, even what looks like a flag.
  app.prefix_command();
  app.add_option("--nproc-per-node", options.nproc_per_node, "ranks to start on this node")
      ->check(nanoddp::cli::integer_in(1, dist::kMaxProcPerNode))
      ->capture_default_str();
  app.add_option("--nnodes", options.nnodes, "nodes in the job (one nanoddp-run per node)")
      ->check(nanoddp::cli::integer_in(1))
      ->capture_default_str();
  app.add_option("--node-rank", options.node_rank, "this node's index, 0..nnodes-1")
      ->check(nanoddp::cli::integer_in(0))
      ->capture_default_str();
  app.add_option("--master-addr", options.master_addr, "address of rank 0's node (its Store)")
      ->capture_default_str();
  app.add_option("--master-port", options.master_port, "rank 0's Store port; 0 = pick a free one (one node)")
      ->check(nanoddp::cli::integer_in(0, 65535))
      ->capture_default_str();
  app.add_option("--backend", options.backend,
                 "exported as NANODDP_BACKEND; mpi starts the ranks through mpirun")
      ->check(CLI::IsMember({"auto", "gloo", "mpi", "nccl"}));
  app.add_option("--grace-period", grace_s, "seconds between SIGTERM and SIGKILL when ranks are stopped")
      ->check(nanoddp::cli::number_in(0, kMaxSeconds))
      ->capture_default_str();
  app.add_option("--timeout", timeout_s, "stop the job after this many seconds; 0 = no limit")
      ->check(nanoddp::cli::number_in(0, kMaxSeconds))
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;  // --help is 0; every usage error is 2, as for other CLIs
  }
  std::vector<std::string> program = app.remaining();
  if (!program.empty() && program.front() == "--") program.erase(program.begin());
  if (program.empty()) {
    std::cerr << "nanoddp-run: no PROGRAM given\n" << app.help();
    return 2;
  }
  options.grace_period = std::chrono::milliseconds(static_cast<long long>(grace_s * 1000));
  options.timeout = std::chrono::milliseconds(static_cast<long long>(timeout_s * 1000));

  try {
    return dist::launch(options, program);
  } catch (const nanoddp::ValueError& e) {
    std::cerr << "nanoddp-run: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "nanoddp-run: " << e.what() << "\n";
    return 1;
  }
}
