// Running one test body on N ranks, on Gloo or on MPI, from one test file.
//
//   std::string failures = on_ranks(4, [&](int rank) { auto pg = join(rank, 4, port); ... });
//   CHECK_MESSAGE(failures.empty(), failures);
//   // and one case that reruns the file: mpirun_self(4, "--test-case-exclude=*mpirun*")
//
// Outside mpirun, on_ranks forks world ranks that meet on Gloo (tests/multiprocess.h). Under
// `mpirun -np N`, each MPI process runs the body once as its own rank, and cases written for
// another world size than N do nothing. So every case runs on both CPU backends.
#pragma once

#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include "dist/init.h"
#include "tests/multiprocess.h"
#include "tests/subprocess.h"

namespace nanoddp::testing {

inline bool under_mpirun() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr; }

inline std::string on_ranks(int world, const std::function<void(int rank)>& fn,
                            std::chrono::seconds timeout = std::chrono::seconds(60)) {
  if (!under_mpirun())
    return run_ranks(
        world,
        [&fn](int rank) {
          fn(rank);
          // A forked rank _exit()s: without this, rank 0 would take the store it serves with it
          // while a peer's last store call (shm's buffer registration barrier) is still in
          // flight. Destroying the group drains the store first (Note [Store drain]), as a
          // program's exit does.
          dist::destroy_process_group();
        },
        timeout);
  if (std::atoi(std::getenv("OMPI_COMM_WORLD_SIZE")) != world) return "";
  const int rank = std::atoi(std::getenv("OMPI_COMM_WORLD_RANK"));
  try {
    fn(rank);
  } catch (const std::exception& e) {
    return "rank " + std::to_string(rank) + ": " + e.what();
  }
  return "";
}

// This rank's default group, made fresh: Gloo on a forked rank (or NANODDP_TEST_BACKEND's
// backend, e.g. shm), MPI under mpirun (a new communicator each time; MPI itself is
// initialised once per process).
inline std::shared_ptr<dist::ProcessGroup> join(int rank, int world, int port,
                                                std::chrono::milliseconds timeout = std::chrono::seconds(30),
                                                bool check_collectives = true) {
  dist::InitOptions options;
  options.timeout = timeout;
  options.check_collectives = check_collectives;
  if (under_mpirun()) {
    options.backend = dist::Backend::Mpi;
    return dist::init_process_group(options);
  }
  options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  options.rank = rank;
  options.world_size = world;
  const char* backend = std::getenv("NANODDP_TEST_BACKEND");  // a file's shm rerun sets it
  options.backend = backend != nullptr ? dist::parse_backend(backend) : dist::Backend::Gloo;
  return dist::init_process_group(options);
}

// Ends the group made by join, so the next case (under mpirun: in the same process) can join.
inline void leave() { dist::destroy_process_group(); }

// After a collective mismatch the group refuses every later collective, at once and on every
// rank (Note [Out of step] in dist/process_group_checked.cpp): an all_reduce fails within a
// second with a DistError that names the mismatch `mismatched` (e.g. "#5 (rank 0: ...").
inline void expect_out_of_step(dist::ProcessGroup& pg, int rank, const std::string& mismatched) {
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    Tensor t = Tensor::full({3}, static_cast<float>(rank + 1));
    pg.all_reduce(t)->wait();
  } catch (const DistError& e) {
    message = e.what();
  }
  const auto took = std::chrono::steady_clock::now() - start;
  expect(message.find("this group takes no more collectives since the ranks called different ones as " +
                      mismatched) != std::string::npos,
         "rank ", rank, ": an all_reduce after the mismatch did not fail as out of step: '", message, "'");
  expect(took < std::chrono::seconds(1), "rank ", rank, ": the refusal took ",
         std::chrono::duration_cast<std::chrono::milliseconds>(took).count(), " ms");
}

// A gradient hook on param that throws std::runtime_error("user hook failed") the next time
// param's gradient is accumulated after *armed was set, and clears *armed: a backward that
// ends by an exception, on the ranks that arm it (Note [Interrupted backward]).
inline void throw_when_armed(Tensor param, bool* armed) {
  param.register_post_accumulate_grad_hook([armed](Tensor&) {
    if (!*armed) return;
    *armed = false;
    throw std::runtime_error("user hook failed");
  });
}

inline bool have_mpirun() { return run({"/bin/sh", "-c", "command -v mpirun"}).code() == 0; }

// Runs program (relative to the build folder) under `mpirun -np np` with doctest arguments.
inline RunResult mpirun_self(const std::string& program, int np, const std::string& doctest_args,
                             std::chrono::seconds timeout = std::chrono::seconds(180)) {
  ::setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  ::setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  ::setenv("OMPI_MCA_btl", "self,vader,tcp", 1);  // shared memory on one host, no fabric probe
  return run(
      {"/bin/sh", "-c",
       "exec mpirun -np " + std::to_string(np) + " --oversubscribe --bind-to none \"$0\" " + doctest_args,
       built(program)},
      timeout);
}

// Runs program (relative to the build folder) again with NANODDP_TEST_BACKEND=backend, so that
// every case of a file written for Gloo runs on that backend too (join() reads it).
inline RunResult rerun_with_backend(const std::string& program, const std::string& backend,
                                    const std::string& doctest_args,
                                    std::chrono::seconds timeout = std::chrono::seconds(180)) {
  return run({"/bin/sh", "-c", "NANODDP_TEST_BACKEND=" + backend + " exec \"$0\" " + doctest_args, built(program)},
             timeout);
}

}  // namespace nanoddp::testing
