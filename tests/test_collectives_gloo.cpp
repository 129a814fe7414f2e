// Gloo collectives between forked ranks on this host: every op, world sizes 1-4, sizes up to
// 2^20 + 3, exact results (tests/collectives_cases.h), timeouts and error messages.
#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "dist/init.h"
#include "tests/collectives_cases.h"

using namespace nanoddp;
using namespace nanoddp::dist;
using namespace std::chrono_literals;

namespace {

std::shared_ptr<ProcessGroup> join(int port, int rank, int world_size,
                                   std::chrono::milliseconds timeout = 30000ms) {
  InitOptions o;
  o.backend = Backend::Gloo;
  o.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  o.rank = rank;
  o.world_size = world_size;
  o.timeout = timeout;
  return init_process_group(o);
}

}  // namespace

#if NANODDP_WITH_GLOO

TEST_CASE("gloo: every collective is exact for world sizes 1 to 4") {
  for (int world_size = 1; world_size <= 4; ++world_size) {
    CAPTURE(world_size);
    int port = testing::free_port();
    std::string failures = testing::run_ranks(world_size, [&](int rank) {
      auto pg = join(port, rank, world_size);
      testing::expect(pg->backend_name() == "gloo", "backend is ", pg->backend_name());
      testing::expect(get_rank() == rank && get_world_size() == world_size, "get_rank/size wrong");
      testing::check_collectives(*pg, {1, 7, 1000, 65537});
      destroy_process_group();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE(
    "gloo: a peer that dies fails the collective with an error, never with SIGPIPE (ignored, as Python "
    "does)") {
  int port = testing::free_port();
  std::string failures = testing::run_ranks(2, [&](int rank) {
    // A handler of the program's own stays; only the default is replaced (Note [Gloo and SIGPIPE]).
    struct sigaction before {};
    sigaction(SIGPIPE, nullptr, &before);
    testing::expect(before.sa_handler == SIG_DFL, "rank ", rank,
                    ": SIGPIPE is not at its default to begin with");
    auto pg = join(port, rank, 2, 5000ms);
    struct sigaction after {};
    sigaction(SIGPIPE, nullptr, &after);
    testing::expect(after.sa_handler == SIG_IGN, "rank ", rank,
                    ": SIGPIPE is not ignored after the Gloo group");
    pg->barrier()->wait();
    if (rank == 1) _exit(0);  // its sockets close under rank 0's writes
    Tensor big = Tensor::ones({1 << 20});
    bool threw = false;
    try {
      for (int i = 0; i < 20; ++i) pg->all_reduce(big)->wait();
    } catch (const Error&) {
      threw = true;
    }
    testing::expect(threw, "rank 0: all_reduces with a dead peer did not fail");
  });
  CHECK_MESSAGE(failures.empty(), failures);
  int handler_port = testing::free_port();
  failures = testing::run_ranks(1, [&](int) {
    struct sigaction own {};
    sigemptyset(&own.sa_mask);
    own.sa_handler = [](int) {};
    sigaction(SIGPIPE, &own, nullptr);
    auto pg = join(handler_port, 0, 1);
    struct sigaction after {};
    sigaction(SIGPIPE, nullptr, &after);
    testing::expect(after.sa_handler == own.sa_handler, "the program's SIGPIPE handler was replaced");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("gloo: all_reduce and broadcast of 2^20 + 3 elements") {
  for (int world_size : {2, 3, 4}) {
    CAPTURE(world_size);
    int port = testing::free_port();
    std::string failures = testing::run_ranks(world_size, [&](int rank) {
      auto pg = join(port, rank, world_size);
      testing::check_large_collectives(*pg);
      destroy_process_group();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("gloo: env:// reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT") {
  int port = testing::free_port();
  std::string failures = testing::run_ranks(2, [&](int rank) {
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("WORLD_SIZE", "2", 1);
    ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    InitOptions o;
    o.timeout = 30000ms;
    auto pg = init_process_group(o);  // Auto: not under mpirun, so Gloo
    testing::expect(pg->backend_name() == "gloo", "auto picked ", pg->backend_name());
    testing::expect(get_rank() == rank && get_world_size() == 2 && get_local_rank() == rank,
                    "env ranks wrong");
    Tensor t = testing::make_tensor(DType::Float32, 3, [&](int64_t) { return rank + 1.0; });
    pg->all_reduce(t)->wait();
    testing::expect_values(t, [](int64_t) { return 3.0; }, "env all_reduce");
    bool threw = false;
    try {
      init_process_group(o);
    } catch (const DistError&) {
      threw = true;
    }
    testing::expect(threw, "a second init_process_group was accepted");
    destroy_process_group();
    testing::expect(!is_initialized(), "still initialised after destroy");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("gloo: a rank that never joins the collective gives a TimeoutError that names it") {
  int port = testing::free_port();
  std::string failures = testing::run_ranks(2, [&](int rank) {
    auto pg = join(port, rank, 2, 20000ms);
    if (rank == 1) {
      std::this_thread::sleep_for(1500ms);  // alive, but never calls all_reduce
      return;
    }
    Tensor t = Tensor::ones({4});
    auto work = pg->all_reduce(t);
    auto start = std::chrono::steady_clock::now();
    try {
      work->wait(300ms);
      testing::expect(false, "wait returned without the peer");
    } catch (const TimeoutError& e) {
      std::string what = e.what();
      for (const char* part : {"rank 0/2", "gloo", "all_reduce(sum)", "[4]", "float32"})
        testing::expect(what.find(part) != std::string::npos, "message lacks '", part, "': ", what);
    }
    auto elapsed = std::chrono::steady_clock::now() - start;
    testing::expect(elapsed >= 290ms && elapsed < 3000ms, "timeout took ",
                    std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count(), " ms");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("gloo: a busy MASTER_PORT fails fast on rank 0 and names the port; a 1-rank job does not use it") {
  int port = testing::free_port();
  InitOptions o;
  o.backend = Backend::Gloo;
  o.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  o.rank = 0;
  o.world_size = 2;
  // Hold the port with a store of our own, as another job would.
  TCPStoreOptions holder;
  holder.port = port;
  holder.is_server = true;
  TCPStore busy(holder);
  auto start = std::chrono::steady_clock::now();
  try {
    init_process_group(o);
    FAIL("init_process_group bound a busy port");
  } catch (const DistError& e) {
    CHECK(std::string(e.what()).find("MASTER_PORT " + std::to_string(port)) != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < 1000ms);
  CHECK_FALSE(is_initialized());

  // MASTER_* left over from that other job do not concern a 1-rank job: it needs no rendezvous.
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  for (bool plain : {true, false}) {
    CAPTURE(plain);
    if (!plain) ::setenv("RANK", "0", 1), ::setenv("WORLD_SIZE", "1", 1);
    InitOptions single;
    single.backend = Backend::Gloo;
    auto group = init_process_group(single);
    Tensor t = Tensor::full({2}, 3.0f);
    group->all_reduce(t)->wait();
    CHECK(t.to_vector() == std::vector<float>{3, 3});
    CHECK(get_world_size() == 1);
    destroy_process_group();
  }
  // MASTER_PORT=0 at world size 2 is set, but names no port the other ranks could use.
  ::setenv("MASTER_PORT", "0", 1);
  InitOptions two;
  two.backend = Backend::Gloo;
  two.rank = 1;
  two.world_size = 2;
  CHECK_THROWS_WITH_AS(init_process_group(two), doctest::Contains("MASTER_PORT=0 names no port"), ValueError);
  for (const bool empty : {true, false}) {
    if (empty)
      ::setenv("MASTER_PORT", "", 1);
    else
      ::unsetenv("MASTER_PORT");
    CHECK_THROWS_WITH_AS(init_process_group(two), doctest::Contains("MASTER_PORT is not set"), ValueError);
  }
  for (const char* name : {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"}) ::unsetenv(name);
}

#endif

TEST_CASE("init: malformed environment and arguments are named") {
  ::setenv("RANK", "one", 1);
  try {
    read_launch_env();
    FAIL("accepted RANK=one");
  } catch (const ValueError& e) {
    CHECK(std::string(e.what()).find("RANK='one'") != std::string::npos);
  }
  ::unsetenv("RANK");
  ::setenv("OMPI_COMM_WORLD_RANK", "3", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  ::setenv("SLURM_LOCALID", "1", 1);
  LaunchEnv env = read_launch_env();
  CHECK(env.rank == 3);
  CHECK(env.world_size == 4);
  CHECK(env.local_rank == 1);
  ::unsetenv("OMPI_COMM_WORLD_RANK");
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  ::unsetenv("SLURM_LOCALID");

  // Leftovers of another job: each pair that cannot describe one process is named, both sides.
  auto env_error = [](const std::vector<std::pair<const char*, const char*>>& vars) {
    for (auto& [name, value] : vars) ::setenv(name, value, 1);
    std::string message;
    try {
      get_local_rank();
    } catch (const ValueError& e) {
      message = e.what();
    }
    for (auto& [name, value] : vars) ::unsetenv(name);
    return message;
  };
  CHECK_MESSAGE(env_error({{"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"}})
                        .find("LOCAL_RANK=3 is not below "
                              "LOCAL_WORLD_SIZE=2") != std::string::npos,
                env_error({{"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"}}));
  CHECK(env_error({{"OMPI_COMM_WORLD_LOCAL_RANK", "2"}, {"SLURM_NTASKS_PER_NODE", "2"}})
            .find("OMPI_COMM_WORLD_LOCAL_RANK=2 is not below SLURM_NTASKS_PER_NODE=2") != std::string::npos);
  CHECK(env_error({{"LOCAL_WORLD_SIZE", "4"}, {"WORLD_SIZE", "2"}})
            .find("LOCAL_WORLD_SIZE=4 is more than WORLD_SIZE=2") != std::string::npos);
  CHECK(env_error({{"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}, {"WORLD_SIZE", "2"}}).empty());
  // With no local world size, the job's size bounds the local rank; a process with no
  // WORLD_SIZE is a single process, local rank 0 (a leaked LOCAL_RANK=3 would pick cuda:3).
  CHECK(env_error({{"LOCAL_RANK", "3"}}).find("LOCAL_RANK=3 is not below the world size 1 of a process without "
                                              "WORLD_SIZE") != std::string::npos);
  CHECK(env_error({{"LOCAL_RANK", "3"}, {"WORLD_SIZE", "1"}, {"RANK", "0"}})
            .find("LOCAL_RANK=3 is not below WORLD_SIZE=1") != std::string::npos);
  CHECK(env_error({{"LOCAL_RANK", "0"}}).empty());
  ::setenv("LOCAL_RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  CHECK(get_local_rank() == 1);
  ::unsetenv("LOCAL_RANK");
  ::unsetenv("WORLD_SIZE");
  for (const char* name : {"NANODDP_STORE_LISTEN_ALL", "NANODDP_CHECK_COLLECTIVES"}) {
    ::setenv(name, "ture", 1);  // misspelt: refused, not read as the default
    std::string message;
    try {
      InitOptions single;
      single.backend = Backend::Gloo;
      init_process_group(single);
    } catch (const ValueError& e) {
      message = e.what();
    }
    CHECK_MESSAGE(message.find(std::string(name) + "='ture' is neither 1") != std::string::npos, message);
    CHECK_FALSE(is_initialized());
    ::setenv(name, "Off", 1);
    InitOptions single;
    single.backend = Backend::Gloo;
    init_process_group(single);
    destroy_process_group();
    ::unsetenv(name);
  }
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  {
    InitOptions from_env;
    from_env.backend = Backend::Gloo;
    std::string message;
    try {
      init_process_group(from_env);
    } catch (const ValueError& e) {
      message = e.what();
    }
    CHECK_MESSAGE(message.find("RANK=1 is not below WORLD_SIZE=1") != std::string::npos, message);
    from_env.world_size = 1;  // an explicit value is named as such
    message.clear();
    try {
      init_process_group(from_env);
    } catch (const ValueError& e) {
      message = e.what();
    }
    CHECK_MESSAGE(message.find("RANK=1 is not below InitOptions::world_size = 1") != std::string::npos,
                  message);
  }
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");

  InitOptions o;
  o.backend = Backend::Gloo;
  o.rank = 2;
  o.world_size = 2;
  o.init_method = "tcp://127.0.0.1:1";
  CHECK_THROWS_AS(init_process_group(o), ValueError);  // rank out of range
  o.rank = 0;
  o.init_method = "tcp://127.0.0.1";
  CHECK_THROWS_AS(init_process_group(o), ValueError);  // no port
  o.init_method = "file:///tmp/x";
  CHECK_THROWS_AS(init_process_group(o), ValueError);
  CHECK_THROWS_AS(default_process_group(), DistError);
  CHECK_THROWS_AS(get_rank(), DistError);
  CHECK(parse_backend("NCCL") == Backend::Nccl);
  CHECK_THROWS_AS(parse_backend("tcp"), ValueError);
}
