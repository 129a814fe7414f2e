#include "examples/process_group_flags.h"

#include <CLI/CLI.hpp>

#include "tools/cli_checks.h"

namespace nanoddp::examples {

void ProcessGroupFlags::add_to(CLI::App& app) {
  app.add_option(
         "--backend", backend,
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

}  // namespace nanoddp::examples
