// The flags by which every example meets the other ranks: --backend, --device and --timeout,
// declared once so that each example takes them with the same names, checks, help and
// defaults, and turns them into dist::InitOptions the same way.
//
//   examples::ProcessGroupFlags group;
//   group.add_to(app);                                       // before cli::parse
//   auto pg = dist::init_process_group(group.init_options());
#pragma once

#include <chrono>
#include <string>

#include "dist/init.h"
#include "examples/example_utils.h"

// add_to is defined in examples/process_group_flags.cpp, the one source of it that compiles
// CLI11, so that a program's training code can hold these values without it.
namespace CLI {
class App;
}

namespace nanoddp::examples {

struct ProcessGroupFlags {
  std::string backend = "auto";  // a name dist::parse_backend takes
  std::string device = "cpu";    // cpu, cuda (this rank's GPU, rank_device) or cuda:N
  // Store waits and every collective (InitOptions::timeout; torch's init_process_group timeout).
  int timeout_s =
      static_cast<int>(std::chrono::duration_cast<std::chrono::seconds>(dist::kDefaultTimeout).count());

  // Declares the three flags on app, with their defaults shown in --help.
  void add_to(CLI::App& app);

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
