// A rank for the launcher tests (test_launch.cpp): a real nanoddp program, small enough that
// what it does under nanoddp-run is plain.
//
//   nanoddp-run --nproc-per-node 2 launch_probe report            # prints rank, backend, sum
//   nanoddp-run --nproc-per-node 4 launch_probe fail 3 7          # rank 3 exits 7, peers lose it
//   nanoddp-run --backend mpi --nproc-per-node 2 launch_probe exit 1 3   # rank 1 calls exit(3)
//   nanoddp-run --nproc-per-node 2 launch_probe sleep DIR         # writes DIR/pid.RANK, sleeps, silent
//   nanoddp-run --nproc-per-node 3 launch_probe die 0 5           # rank 0 SIGKILLs itself mid-job
//   nanoddp-run --nproc-per-node 2 launch_probe stop 1 5          # rank 1 SIGSTOPs itself mid-job
//   nanoddp-run --max-restarts 2 --nproc-per-node 2 launch_probe restart 1 2   # dies in 2 rounds
//
// report [--backend B] [--hold-ms N]: init_process_group (backend B, default auto), all_reduce
//         of rank + 1, "rank R of W backend B sum S" on stdout (S = W(W+1)/2), N ms of doing
//         nothing (rank 0 keeps serving the store meanwhile), then a barrier. --first-leaves MS:
//         the launcher's rank 0 exits 0 at once, the others join a world without it (rank and
//         world size given to init_process_group), the last one MS ms late.
// catch-init MS: init_process_group with an MS ms timeout; its error caught, the rank goes on
//         for 3 s without a group and exits 0, as a program that falls back to local work.
// fail:   after a barrier, rank R fails as a program whose error unwinds its process group
//         does: after 200 ms it destroys its group (its connections close), takes 300 ms more
//         to exit (a log flushed, a checkpoint written) and exits with CODE. The others wait on
//         an all_reduce that R never joins, so they fail by losing R, before R has exited. They
//         ignore SIGTERM (as a rank deep in a collective may not stop at once), so each always
//         fails by its own error: the launcher must tell the first failure from those it caused.
// exit:   after a barrier, rank R calls std::exit(CODE) with its group alive, as a program
//         whose main catches an error and returns does; the others wait on an all_reduce R
//         never joins (its timeout, 30 s, is far past what the test allows).
// die:    every rank runs all_reduces back to back; rank R sends itself SIGKILL after its Nth
//         (kill -9 in the middle of a job). The others ignore SIGTERM and fail by losing R, by
//         their own error, at once: the launcher must still name R and return 137.
// stop:   as die, but rank R stops itself (SIGSTOP: alive, silent) and the others' all_reduce
//         times out after 2 s: they fail by losing R, which never ends by itself.
// restart: under --max-restarts. Every rank prints "rank R of W round K sum S" (K =
//         NANODDP_RESTART_COUNT, S from an all_reduce of rank + 1) and "rank R round K first
//         step at T" (T: CLOCK_REALTIME in ms); then rank R SIGKILLs itself after a barrier
//         in every round below ROUNDS ("rank R round K killed at T" first) while the others
//         wait in an all_reduce and fail by losing it. Round ROUNDS ends cleanly.
// sleep:  after init, writes its pid and sleeps 60 s without a word (a --quiet training run).
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "dist/init.h"

using namespace nanoddp;

namespace {

long long realtime_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: launch_probe report [--backend B] [--hold-ms N] [--first-leaves MS] | fail RANK "
                 "CODE | die RANK N | "
                 "stop RANK N | "
                 "restart RANK ROUNDS | sleep DIR\n");
    return 2;
  }
  const std::string mode = argv[1];
  try {
    dist::InitOptions init;
    if (mode == "catch-init" && argc == 3) {
      init.timeout = std::chrono::milliseconds(std::atoi(argv[2]));
      try {
        dist::init_process_group(init);
        std::printf("joined\n");
      } catch (const std::exception& e) {
        std::printf("init failed; going on without a group\n");
      }
      std::fflush(stdout);
      std::this_thread::sleep_for(std::chrono::seconds(3));
      return 0;
    }
    init.timeout = std::chrono::seconds(30);
    int hold_ms = 0, first_leaves_ms = -1;
    for (int i = 2; mode == "report" && i + 1 < argc; i += 2) {
      if (std::string(argv[i]) == "--backend") init.backend = dist::parse_backend(argv[i + 1]);
      if (std::string(argv[i]) == "--hold-ms") hold_ms = std::atoi(argv[i + 1]);
      if (std::string(argv[i]) == "--first-leaves") first_leaves_ms = std::atoi(argv[i + 1]);
    }
    if (first_leaves_ms >= 0) {  // a world of the launcher's ranks 1.. only, given explicitly
      const int launcher_rank = std::atoi(std::getenv("RANK")),
                launcher_world = std::atoi(std::getenv("WORLD_SIZE"));
      if (launcher_rank == 0) return 0;
      if (launcher_rank == launcher_world - 1)
        std::this_thread::sleep_for(std::chrono::milliseconds(first_leaves_ms));
      init.rank = launcher_rank - 1;
      init.world_size = launcher_world - 1;
    }
    auto pg = dist::init_process_group(init);
    const int rank = pg->rank(), world_size = pg->size();
    if (mode == "report") {
      Tensor t = Tensor::from_vector({static_cast<float>(rank + 1)}, {1});
      pg->all_reduce(t)->wait();
      std::printf("rank %d of %d backend %s sum %g\n", rank, world_size, pg->backend_name().c_str(), t.item());
      std::fflush(stdout);
      std::this_thread::sleep_for(std::chrono::milliseconds(hold_ms));
      pg->barrier()->wait();
    } else if (mode == "fail" && argc == 4) {
      const int culprit = std::atoi(argv[2]), code = std::atoi(argv[3]);
      if (rank != culprit) std::signal(SIGTERM, SIG_IGN);
      pg->barrier()->wait();
      if (rank == culprit) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        std::fprintf(stderr, "rank %d fails on its own with exit code %d\n", rank, code);
        std::fflush(stderr);
        pg.reset();
        dist::destroy_process_group();
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        _exit(code);
      }
      Tensor t = Tensor::from_vector({1.0f}, {1});
      pg->all_reduce(t)->wait();
      std::fprintf(stderr, "rank %d: the all_reduce without rank %d completed\n", rank, culprit);
      return 3;
    } else if (mode == "exit" && argc == 4) {
      const int culprit = std::atoi(argv[2]), code = std::atoi(argv[3]);
      pg->barrier()->wait();
      if (rank == culprit) std::exit(code);
      Tensor t = Tensor::from_vector({1.0f}, {1});
      pg->all_reduce(t)->wait();
      return 3;
    } else if ((mode == "die" || mode == "stop") && argc == 4) {
      const int victim = std::atoi(argv[2]), reductions = std::atoi(argv[3]);
      const bool die = mode == "die";
      if (die && rank != victim) std::signal(SIGTERM, SIG_IGN);
      Tensor t = Tensor::from_vector({1.0f}, {1});
      // Bounded: a group that never notices the loss ends here, not at the test's timeout.
      for (int i = 0; i < 100000; ++i) {
        if (rank == victim && i == reductions) ::kill(::getpid(), die ? SIGKILL : SIGSTOP);
        pg->all_reduce(t)->wait(std::chrono::seconds(die ? 20 : 2));
      }
      std::fprintf(stderr, "rank %d: 100000 all_reduces completed without rank %d\n", rank, victim);
      return 3;
    } else if (mode == "restart" && argc == 4) {
      const int victim = std::atoi(argv[2]), rounds = std::atoi(argv[3]);
      const char* count = std::getenv("NANODDP_RESTART_COUNT");
      const int round = count != nullptr ? std::atoi(count) : -1;
      Tensor t = Tensor::from_vector({static_cast<float>(rank + 1)}, {1});
      pg->all_reduce(t)->wait(std::chrono::seconds(20));
      std::printf("rank %d of %d round %d sum %g\n", rank, world_size, round, t.item());
      std::printf("rank %d round %d first step at %lld\n", rank, round, realtime_ms());
      std::fflush(stdout);
      if (round < rounds && rank != victim) std::signal(SIGTERM, SIG_IGN);
      pg->barrier()->wait(std::chrono::seconds(20));
      if (round < rounds) {
        if (rank == victim) {
          std::printf("rank %d round %d killed at %lld\n", rank, round, realtime_ms());
          std::fflush(stdout);
          ::kill(::getpid(), SIGKILL);
        }
        pg->all_reduce(t)->wait(std::chrono::seconds(20));
        std::fprintf(stderr, "rank %d: an all_reduce without rank %d completed\n", rank, victim);
        return 3;
      }
    } else if (mode == "sleep" && argc == 3) {
      std::ofstream(std::string(argv[2]) + "/pid." + std::to_string(rank)) << ::getpid() << "\n";
      std::this_thread::sleep_for(std::chrono::seconds(60));
    } else {
      std::fprintf(stderr, "launch_probe: bad arguments for mode '%s'\n", mode.c_str());
      return 2;
    }
    dist::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "launch_probe: %s\n", message_of(e).c_str());
    std::fflush(stderr);
    // Without exit handlers: the launcher's SIGTERM reaches a failed rank while it exits, and
    // under AddressSanitizer the exit-time leak check (ptrace stopping every thread) can hang
    // on that signal until the SIGKILL after the grace period, which hides the rank's exit code.
    std::_Exit(1);
  }
  return 0;
}
