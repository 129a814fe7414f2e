// Note [NCCL shutdown]: a default group that the program never destroyed is destroyed by an
// exit handler that init_process_group registers once the group is up. Exit handlers run in
// reverse order of registration, so it runs before any handler registered earlier: the CUDA
// runtime's teardown, which registers when CUDA starts (before an NCCL group can exist). A
// Gloo group shows the order without a GPU: a handler registered before init_process_group
// must find the group gone.
#include <doctest/doctest.h>

#include <cstdlib>

#include "dist/init.h"
#include "tests/multiprocess.h"

using namespace nanoddp;
using namespace std::chrono_literals;

namespace {

constexpr int kStillInitialized = 3;

void expect_destroyed_at_exit() {
  if (dist::is_initialized()) ::_exit(kStillInitialized);
}

}  // namespace

#if NANODDP_WITH_GLOO

TEST_CASE("a default group left alive is destroyed at exit, before earlier exit handlers run") {
  const int port = testing::free_port();
  const std::string failures = testing::run_ranks(2, [&](int rank) {
    std::atexit(expect_destroyed_at_exit);  // stands for the CUDA runtime's teardown
    dist::InitOptions options;
    options.backend = dist::Backend::Gloo;
    options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
    options.rank = rank;
    options.world_size = 2;
    options.timeout = 30000ms;
    auto pg = dist::init_process_group(options);
    pg->barrier()->wait();
    pg.reset();
    std::exit(0);  // no destroy_process_group(): the exit handler must do it
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

#endif
