// MPI collectives: this test launches itself under `mpirun -np N` (N = 1..4) and each MPI
// rank runs the same exact-result cases as the Gloo test (tests/collectives_cases.h).
// The parent case re-runs this executable with NANODDP_MPI_CHILD=1 and a doctest filter, so
// inside mpirun only the child case runs. Skipped (with a message) without MPI or mpirun.
#include <doctest/doctest.h>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "core/error.h"
#include "dist/init.h"
#include "dist/ring.h"
#include "tests/collectives_cases.h"

extern char** environ;

using namespace nanoddp;
using namespace nanoddp::dist;
using namespace std::chrono_literals;

namespace {

bool is_child() { return std::getenv("NANODDP_MPI_CHILD") != nullptr; }

// Runs argv with posix_spawnp; returns its exit status, or -1 when it ran past timeout (it is
// then killed, with its process group, so no rank is left behind).
int run_with_timeout(std::vector<std::string> args, std::chrono::seconds timeout) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);  // own group: killable as a whole
  posix_spawnattr_setpgroup(&attr, 0);
  pid_t pid = 0;
  int rc = posix_spawnp(&pid, argv[0], nullptr, &attr, argv.data(), environ);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) return 127;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      return -1;
    }
    std::this_thread::sleep_for(10ms);
  }
}

bool have_mpirun() { return run_with_timeout({"sh", "-c", "command -v mpirun >/dev/null"}, 10s) == 0; }

}  // namespace

TEST_CASE("mpi child: collectives inside one mpirun rank") {
  if (!is_child()) return;  // only meaningful under mpirun, started by the case below
  InitOptions o;
  o.timeout = 60000ms;
  auto pg = init_process_group(o);  // Auto: launched by mpirun, so MPI
  REQUIRE(pg->backend_name() == "mpi");
  int world_size = pg->size();
  int rank = pg->rank();
  REQUIRE(world_size == std::atoi(std::getenv("OMPI_COMM_WORLD_SIZE")));
  testing::check_collectives(*pg, {1, 7, 1000, 65537});
  if (world_size > 1) {
    testing::check_large_collectives(*pg);
    // send/recv, through the textbook ring built on them (tests/test_ring.cpp counts its bytes).
    Tensor t = testing::make_tensor(DType::Float32, 100003, [&](int64_t i) { return (rank + 1) * testing::pattern(i); });
    ring_all_reduce(*pg, t);
    const double s = world_size * (world_size + 1) / 2.0;
    testing::expect_values(t, [&](int64_t i) { return s * testing::pattern(i); }, "mpi ring_all_reduce");
    // A recv whose tensor does not fit the send, smaller (a large send, which crashed Open
    // MPI's single-copy path) or larger: a DistError naming both sizes, the message dropped,
    // and the next exchange right (Note [MPI probed recv]).
    if (rank < 2) {
      const std::vector<std::pair<int64_t, int64_t>> sent_and_taken = {{300000, 200000}, {3, 5}, {4, 4}};
      for (auto sizes : sent_and_taken) {
        const int64_t sent = sizes.first, taken = sizes.second;
        if (rank == 0) {
          pg->send(Tensor::full({sent}, 7.0f), 1)->wait();
          continue;
        }
        Tensor into = Tensor::zeros({taken});
        std::string error;
        try {
          pg->recv(into, 0)->wait();
        } catch (const DistError& e) {
          error = e.what();
        }
        if (sent == taken) {
          CHECK(error.empty());
          CHECK(into.to_vector() == std::vector<float>(4, 7.0f));
        } else {
          CHECK_MESSAGE(error.find("rank 0 sent " + std::to_string(4 * sent) +
                                   " bytes with tag 0, but this recv's tensor has " +
                                   std::to_string(4 * taken)) != std::string::npos,
                        error);
        }
      }
    }
    pg->barrier()->wait();
  }
  // A collective nobody else joins: the wait times out instead of hanging.
  if (world_size == 2) {
    if (rank == 0) {
      Tensor t = Tensor::ones({4});
      auto work = pg->all_reduce(t);
      bool timed_out = false;
      std::string first;
      try {
        work->wait(200ms);
      } catch (const TimeoutError& e) {
        first = e.what();
        timed_out = first.find("mpi all_reduce(sum) of [4]") != std::string::npos;
        MESSAGE(first);
      }
      CHECK(timed_out);
      // Work::wait: a second wait throws the same error at once (it had waited again).
      const auto again = std::chrono::steady_clock::now();
      CHECK_THROWS_WITH_AS(work->wait(10000ms), first.c_str(), TimeoutError);
      CHECK(std::chrono::steady_clock::now() - again < 100ms);
      // Rank 1 joins late, so the request still completes (in the barrier's progress below):
      // MPI can then finalise cleanly.
    } else {
      std::this_thread::sleep_for(500ms);
      Tensor t = Tensor::ones({4});
      pg->all_reduce(t)->wait();
    }
    pg->barrier()->wait();  // rank 0 completes its late all_reduce in MPI's progress here
  }
  // A recv no message comes for, dropped: the group's end fails it, and MPI still finalises
  // (mpirun fails a rank that exits without MPI_Finalize).
  if (rank == 0 && world_size > 1) {
    Tensor never = Tensor::zeros({1});
    pg->recv(never, 1, 7);
  }
  pg.reset();
  destroy_process_group();
}

TEST_CASE("mpi: collectives are exact under mpirun -np 1 to 4") {
  if (is_child()) return;
#if !NANODDP_WITH_MPI
  MESSAGE("skipped: nanoddp was built without MPI");
  return;
#endif
  if (!have_mpirun()) {
    MESSAGE("skipped: mpirun not found");
    return;
  }
  ::setenv("NANODDP_MPI_CHILD", "1", 1);
  ::setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  ::setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  // Keep the test's ranks off an InfiniBand or other fabric probe: shared memory on one host.
  ::setenv("OMPI_MCA_btl", "self,vader,tcp", 1);
  char self[4096] = {};
  REQUIRE(::readlink("/proc/self/exe", self, sizeof(self) - 1) > 0);
  for (int np = 1; np <= 4; ++np) {
    CAPTURE(np);
    int status = run_with_timeout({"mpirun", "-np", std::to_string(np), "--oversubscribe",
                                   "--bind-to", "none", self,
                                   "--test-case=mpi child: collectives inside one mpirun rank"},
                                  120s);
    CHECK_MESSAGE(status == 0, "mpirun -np ", np, " exited with ", status,
                  " (-1: killed after 120 s); the ranks' output is above");
  }
  ::unsetenv("NANODDP_MPI_CHILD");
}
