// A CPU group takes tensors of another device by staging them through host memory
// (dist/host_staging.h): forked Gloo ranks on the host stand-in device cpu:1, so the path that
// lets several ranks share one GPU runs without one (the gpu suite runs it on cuda:0).
#include <doctest/doctest.h>

#include <future>
#include <thread>

#include "core/autograd.h"
#include "dist/host_staging.h"
#include "dist/init.h"
#include "dist/store.h"
#include "tests/dist_ranks.h"
#include "tests/staging_cases.h"

using namespace nanoddp;
using namespace std::chrono_literals;

namespace {

const Device kStandIn{Device::Type::CPU, 1};

std::shared_ptr<dist::ProcessGroup> join(int port, int rank, int world_size,
                                         dist::Backend backend = dist::Backend::Gloo) {
  dist::InitOptions options;
  options.backend = backend;
  options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  options.rank = rank;
  options.world_size = world_size;
  options.timeout = 30000ms;
  return dist::init_process_group(options);
}

}  // namespace

#if NANODDP_WITH_GLOO

TEST_CASE("gloo: every collective on stand-in device tensors is exact and stays on that device") {
  for (int world_size : {1, 2, 3}) {
    CAPTURE(world_size);
    const int port = testing::free_port();
    const std::string failures = testing::run_ranks(world_size, [&](int rank) {
      auto pg = join(port, rank, world_size);
      testing::expect(pg->device() == Device::cpu(), "a Gloo group's device is ", pg->device());
      testing::check_staged_collectives(*pg, kStandIn);
      dist::destroy_process_group();
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("gloo: 2-rank DDP on stand-in device tensors equals 1-rank training") {
  const int port = testing::free_port();
  const std::string failures = testing::run_ranks(2, [&](int rank) {
    auto pg = join(port, rank, 2);
    testing::check_ddp_matches_one_rank(pg, kStandIn);
    dist::destroy_process_group();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("gloo: mixed devices in one collective are refused by the backend, naming them") {
  const int port = testing::free_port();
  const std::string failures = testing::run_ranks(1, [&](int rank) {
    auto pg = join(port, rank, 1);
    std::vector<Tensor> outputs{Tensor::zeros({3})};
    bool refused = false;
    try {
      pg->all_gather(outputs, Tensor::ones({3}, DType::Float32, kStandIn));
    } catch (const Error& e) {
      refused = std::string(e.what()).find("cpu:1") != std::string::npos;
    }
    testing::expect(refused, "an all_gather from cpu:1 into cpu was not refused with the devices named");
    dist::destroy_process_group();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

#endif

namespace {

// One rank whose all_reduce doubles its tensor (as a sum over two equal ranks would) and
// records every tensor it was handed. A test that holds the first all_reduce at
// first_call_gate (up to 10 s) knows the group's thread is busy for every call it makes
// meanwhile, however the machine schedules the threads.
class RecordingGroup : public dist::ProcessGroup {
 public:
  explicit RecordingGroup(Device device, std::shared_future<void> first_call_gate = {})
      : ProcessGroup(0, 1), device_(device), first_call_gate_(std::move(first_call_gate)) {}
  std::string backend_name() const override { return "recording"; }
  Device device() const override { return device_; }
  std::vector<Tensor> seen;
  std::vector<std::string> calls;  // "all_reduce", "barrier", in the order they came
  std::vector<std::thread::id> threads;  // the thread that made each of calls
  std::shared_ptr<dist::Work> all_reduce(Tensor& tensor, dist::ReduceOp) override {
    if (seen.empty() && first_call_gate_.valid()) first_call_gate_.wait_for(10s);
    calls.push_back("all_reduce of " + std::to_string(tensor.numel()));
    threads.push_back(std::this_thread::get_id());
    seen.push_back(tensor);
    float* p = tensor.data<float>();
    for (int64_t i = 0; i < tensor.numel(); ++i) p[i] *= 2;
    return std::make_shared<dist::CompletedWork>();
  }
  std::shared_ptr<dist::Work> broadcast(Tensor&, int) override { NANODDP_THROW(DistError, "unused"); }
  std::shared_ptr<dist::Work> all_gather(std::vector<Tensor>&, const Tensor&) override {
    NANODDP_THROW(DistError, "unused");
  }
  std::shared_ptr<dist::Work> reduce_scatter(Tensor&, const std::vector<Tensor>&, dist::ReduceOp) override {
    NANODDP_THROW(DistError, "unused");
  }
  std::shared_ptr<dist::Work> barrier() override {
    calls.push_back("barrier");
    threads.push_back(std::this_thread::get_id());
    return std::make_shared<dist::CompletedWork>();
  }

 private:
  Device device_;
  std::shared_future<void> first_call_gate_;
};

}  // namespace

TEST_CASE("staging hands the backend a host copy and writes the result back at wait()") {
  auto inner = std::make_shared<RecordingGroup>(Device::cpu());
  auto pg = dist::stage_device_tensors(inner);
  REQUIRE(pg != inner);
  CHECK(dist::stage_device_tensors(pg) == pg);  // staged once only
  CHECK(pg->backend_name() == "recording");
  CHECK(pg->device() == Device::cpu());

  Tensor t = Tensor::from_vector({1.0f, 2.0f, 3.0f}, {}, kStandIn);
  auto work = pg->all_reduce(t, dist::ReduceOp::Sum);
  work->wait(5000ms);  // the group's thread issued it (Note [Staging without a host wait])
  REQUIRE(inner->seen.size() == 1);
  CHECK(inner->seen[0].device() == Device::cpu());
  CHECK(t.device() == kStandIn);
  CHECK(t.to_vector() == std::vector<float>{2, 4, 6});

  Tensor host = Tensor::from_vector({5.0f});
  pg->all_reduce(host, dist::ReduceOp::Sum)->wait(5000ms);
  REQUIRE(inner->seen.size() == 2);
  CHECK(inner->seen[1].is_same(host));  // a CPU tensor passes straight through
  CHECK(host.to_vector() == std::vector<float>{10});

  // A tensor that requires grad (a parameter, a loss reduced for a log line), in grad mode: the
  // staging copies are not autograd ops, as on a CPU or NCCL group.
  Tensor param = Tensor::from_vector({1.5f}, {}, kStandIn).set_requires_grad(true);
  REQUIRE(is_grad_enabled());
  pg->all_reduce(param, dist::ReduceOp::Sum)->wait(5000ms);
  CHECK(param.to_vector() == std::vector<float>{3});
}

TEST_CASE("stage_device_tensors leaves a group alone whose device is not the CPU") {
  auto device_group = std::make_shared<RecordingGroup>(kStandIn);
  CHECK(dist::stage_device_tensors(device_group) == device_group);
  CHECK(dist::stage_device_tensors(nullptr) == nullptr);
}

TEST_CASE("staging: calls reach the backend in the order they were made, staged or not") {
  // The staged all_reduce is still with the group's thread (the backend holds it at a gate)
  // when the CPU tensor's all_reduce and the barrier are called: they go behind it, not around.
  std::promise<void> release;
  auto inner = std::make_shared<RecordingGroup>(Device::cpu(), release.get_future().share());
  auto pg = dist::stage_device_tensors(inner);
  Tensor staged = Tensor::from_vector({1.0f, 2.0f, 3.0f}, {}, kStandIn);
  Tensor host = Tensor::from_vector({5.0f});
  auto first = pg->all_reduce(staged, dist::ReduceOp::Sum);
  auto second = pg->all_reduce(host, dist::ReduceOp::Sum);
  auto third = pg->barrier();
  release.set_value();
  third->wait(5000ms);
  second->wait(5000ms);
  first->wait(5000ms);
  CHECK(inner->calls == std::vector<std::string>{"all_reduce of 3", "all_reduce of 1", "barrier"});
  CHECK(staged.to_vector() == std::vector<float>{2, 4, 6});
  CHECK(host.to_vector() == std::vector<float>{10});

  CHECK(inner->threads[1] != std::this_thread::get_id());  // issued by the group's thread

  // Once the thread is idle again, a CPU tensor goes straight through, on the caller's thread.
  Tensor later = Tensor::from_vector({7.0f});
  pg->all_reduce(later, dist::ReduceOp::Sum)->wait(5000ms);
  CHECK(inner->seen.back().is_same(later));
  CHECK(inner->threads.back() == std::this_thread::get_id());
  CHECK(later.to_vector() == std::vector<float>{14});

  // wait(0) is the group's timeout, for a call queued behind the thread as for any other.
  Tensor slow = Tensor::from_vector({1.0f}, {}, kStandIn);
  std::promise<void> release_busy;
  auto busy = dist::stage_device_tensors(
      std::make_shared<RecordingGroup>(Device::cpu(), release_busy.get_future().share()));
  auto staged_first = busy->all_reduce(slow, dist::ReduceOp::Sum);
  auto queued_barrier = busy->barrier();
  release_busy.set_value();
  queued_barrier->wait(0ms);
  staged_first->wait(0ms);
  CHECK(slow.to_vector() == std::vector<float>{2});
}

TEST_CASE("staging: a group destroyed with calls queued issues them first, as the backend would") {
  // The backend's own end deals with every call made before it (Gloo runs its queue): the
  // calls the group's thread still holds reach it before it goes.
  std::promise<void> release;
  auto inner = std::make_shared<RecordingGroup>(Device::cpu(), release.get_future().share());
  auto pg = dist::stage_device_tensors(inner);
  Tensor a = Tensor::from_vector({1.0f}, {}, kStandIn);
  Tensor b = Tensor::from_vector({1.0f, 2.0f}, {}, kStandIn);
  Tensor c = Tensor::from_vector({3.0f});
  auto first = pg->all_reduce(a, dist::ReduceOp::Sum);
  auto second = pg->all_reduce(b, dist::ReduceOp::Sum);
  auto third = pg->all_reduce(c, dist::ReduceOp::Sum);
  release.set_value();  // the end issues the two calls still queued, then joins the thread
  pg.reset();
  CHECK(inner->calls == std::vector<std::string>{"all_reduce of 1", "all_reduce of 2", "all_reduce of 1"});
  first->wait(5000ms);
  second->wait(5000ms);
  third->wait(5000ms);
  CHECK(a.to_vector() == std::vector<float>{2});
  CHECK(b.to_vector() == std::vector<float>{2, 4});
  CHECK(c.to_vector() == std::vector<float>{6});
}

TEST_CASE("shm: a recv, then a staged send, then a wait on the recv does not deadlock") {
  // shm runs its calls in the waiting thread: a wait must not hold the engine while a call made
  // before it still waits in the group's thread to be issued.
  const int port = testing::free_port();
  const std::string failures = testing::run_ranks(2, [&](int rank) {
    auto pg = join(port, rank, 2, dist::Backend::Shm);
    const int peer = 1 - rank;
    Tensor in = Tensor::zeros({4}, DType::Float32, kStandIn);
    Tensor out = Tensor::full({4}, static_cast<float>(rank + 1), kStandIn);
    auto received = pg->recv(in, peer);
    auto sent = pg->send(out, peer);
    received->wait(10000ms);
    sent->wait(10000ms);
    testing::expect(in.to_vector() == std::vector<float>(4, static_cast<float>(peer + 1)), "rank ", rank,
                    ": received ", in.to_vector()[0]);
    dist::destroy_process_group();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

#if NANODDP_WITH_GLOO
TEST_CASE(
    "gloo: the collective check catches a mismatch between staged calls and refuses the calls after it") {
  const int port = testing::free_port();
  const std::string failures = testing::run_ranks(2, [&](int rank) {
    // The stack init_process_group builds for Gloo, with the staging group at hand.
    dist::TCPStoreOptions store_options;
    store_options.port = port;
    store_options.is_server = rank == 0;
    store_options.world_size = 2;
    store_options.rank = rank;
    store_options.timeout = 20s;
    auto store = std::make_shared<dist::TCPStore>(store_options);
    dist::GlooOptions gloo;
    gloo.rank = rank;
    gloo.world_size = 2;
    gloo.master_port = port;
    gloo.timeout = 20s;
    auto staging = dist::stage_device_tensors(dist::make_gloo_process_group(store, gloo), 20s);
    auto pg = dist::make_checked_process_group(staging, 20s);

    Tensor t = Tensor::ones({rank == 0 ? 3 : 4}, DType::Float32, kStandIn);
    bool caught = false;
    try {
      pg->all_reduce(t)->wait(10000ms);
    } catch (const DistError& e) {
      const std::string message = e.what();
      caught = message.find("3 float32") != std::string::npos && message.find("4 float32") != std::string::npos;
      if (!caught) testing::expect(false, "rank ", rank, ": not the check's error: ", message);
    }
    testing::expect(caught, "rank ", rank, ": a mismatched staged all_reduce returned without an error");
    testing::expect(t.to_vector() == std::vector<float>(static_cast<size_t>(rank == 0 ? 3 : 4), 1.0f),
                    "rank ", rank, ": the mismatched tensor changed");
    // The group refuses what follows (Note [Out of step]); the backend, which started nothing,
    // is in step: a checked group made anew over it reduces.
    testing::expect_out_of_step(*pg, rank, "#1 (rank 0: all_reduce(sum) #1, 3 float32");
    Tensor same = Tensor::full({2}, static_cast<float>(rank + 1), kStandIn);
    dist::make_checked_process_group(staging, 20s)->all_reduce(same)->wait(10000ms);
    testing::expect(same.to_vector() == std::vector<float>{3, 3}, "rank ", rank,
                    ": the next all_reduce is not 1 + 2");
    // The fingerprints went with the calls to Gloo's worker (Note [Fused collective check]),
    // not through all_gathers of the check's own, which the backend would have counted.
    const int64_t all_gathers = staging->count(dist::Collective::AllGather).calls;
    testing::expect(all_gathers == 0, "rank ", rank, ": the check all-gathered its fingerprints through the "
                    "backend ", all_gathers, " times: the guard did not go with the staged call");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}
#endif
