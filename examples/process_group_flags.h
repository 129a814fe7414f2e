// The flags by which every example meets the other ranks: --backend, --device and --timeout,
// declared once so that each example takes them with the same names, checks, help and
// defaults, and turns them into dist::InitOptions the same way.
//
//   examples::ProcessGroupFlags group;
//   group.add_to(app);                                       // before cli::parse
//   auto pg = dist::init_process_group(group.init_options());
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <string>

#include "dist/init.h"
#include "examples/example_utils.h"
#include "tools/cli_checks.h"

namespace nanoddp::examples {

struct ProcessGroupFlags {
  std::string backend = "auto";  // a name dist::parse_backend takes
  std::string device = "cpu";    // cpu, cuda (this rank's GPU, rank_device) or cuda:N
  // Store waits and every collective (InitOptions::timeout; torch's init_process_group timeout).
  int timeout_s = static_cast<int>(std::chrono::duration_cast<std::chrono::seconds>(dist::kDefaultTimeout).count());

  // Declares the three flags on app, with their defaults shown in --help.
  void add_to(CLI::App& app) {
    app.add_option("--backend", backend,
                   "auto, shm, shm+gloo, gloo, mpi or nccl (auto: nccl on cuda, else mpi under mpirun, shm on one "
                   "node, shm+gloo across nodes)")
        ->check(cli::backend())
        ->capture_default_str();
    app.add_option("--device", device, "cpu, cuda (rank r uses cuda:LOCAL_RANK) or cuda:N")
        ->check(cli::device())
        ->capture_default_str();
    app.add_option("--timeout", timeout_s, "seconds to wait for other ranks (rendezvous, each collective)")
        ->check(cli::integer_in(1))
        ->capture_default_str();
  }

  // What init_process_group takes for these flags: the parsed backend, this rank's device
  // (rank_device: "cuda" is cuda:LOCAL_RANK), the timeout. Throws ValueError for a backend
  // name that dist::parse_backend refuses (cli::backend() already refused it at parse time).
  dist::InitOptions init_options() const {
    dist::InitOptions init;
    init.backend = dist::parse_backend(backend);
    init.device = rank_device(device);
    init.timeout = std::chrono::seconds(timeout_s);
    return init;
  }
};

}  // namespace nanoddp::examples
