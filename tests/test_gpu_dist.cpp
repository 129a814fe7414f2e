// Collectives and DDP on CUDA tensors. On one GPU: NCCL at world size 1, and two ranks
// sharing the GPU over Gloo (which stages CUDA tensors through host memory), started as fresh
// processes by nanoddp-run running cases of this file again (a forked child cannot use CUDA
// once its parent has). With two GPUs or more: NCCL at world size 2, where collectives take
// NCCL's non-blocking in-progress path, send/recv run beside them (Note [NCCL point-to-point]),
// and kernels run on a GPU that is not the current one.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <thread>

#include "core/half.h"
#include "core/memory.h"
#include "core/ops.h"
#include "dist/comm_hooks.h"
#include "dist/ddp.h"
#include "dist/detail.h"
#include "dist/fsdp.h"
#include "dist/host_collectives.h"
#include "dist/init.h"
#include "dist/store.h"
#include "dist/sync_batch_norm.h"
#include "dist/zero_redundancy_optimizer.h"
#include "kernels/device_memory.h"
#include "nn/adam.h"
#include "nn/batch_norm.h"
#include "nn/clip_grad.h"
#include "nn/conv.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "tests/staging_cases.h"
#include "tests/subprocess.h"
#include "tests/test_gpu_util.h"

using namespace nanoddp;
using namespace std::chrono_literals;

namespace {

// Set in the ranks that run_ranks_of_this_file starts; a case meant for them does nothing
// elsewhere.
bool in_launched_rank() { return std::getenv("NANODDP_GPU_TEST_RANKS") != nullptr; }

// Runs the test cases matching `cases` of this executable as 2 ranks under nanoddp-run with
// `backend`, each rank's ranks and master address in its environment. Fails with their output.
void run_ranks_of_this_file(const std::string& cases, const std::string& backend) {
  ::setenv("NANODDP_GPU_TEST_RANKS", "1", 1);
  const testing::RunResult r = testing::run({testing::launcher_path(), "--nproc-per-node", "2", "--backend", backend,
                                             testing::built("tests/test_gpu_dist"), "-tc=" + cases},
                                            240s);
  ::unsetenv("NANODDP_GPU_TEST_RANKS");
  CHECK_MESSAGE(r.code() == 0, "the ranks failed:\n", r.out, r.err);
}

// This launched rank's group: env:// from nanoddp-run, the given backend and device.
std::shared_ptr<dist::ProcessGroup> join_launched(dist::Backend backend, Device device) {
  dist::InitOptions options;
  options.backend = backend;
  options.device = device;
  options.timeout = 60s;
  return dist::init_process_group(options);
}

std::shared_ptr<dist::ProcessGroup> nccl_group() {
  if (dist::is_initialized()) return dist::default_process_group();
  dist::InitOptions options;
  options.backend = dist::Backend::Nccl;
  options.device = Device::cuda(0);
  options.world_size = 1;
  options.rank = 0;
  options.timeout = std::chrono::seconds(60);
  return dist::init_process_group(options);
}

std::shared_ptr<nn::Sequential> mlp() {
  Generator gen(3);
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Linear(6, 16, gen));
  model->add(nn::ReLU());
  model->add(nn::Linear(16, 4, gen));
  return model;
}

// Conv(1->2, 3, padding 1), ReLU, MaxPool(2), Flatten, Linear(18, 8), BatchNorm1d(8), ReLU,
// Linear(8, 4): [N, 1, 6, 6] -> [N, 4].
std::shared_ptr<nn::Sequential> cnn_with_batch_norm() {
  Generator gen(4);
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Conv2d(1, 2, 3, gen, /*stride=*/1, /*padding=*/1));
  model->add(nn::ReLU());
  model->add(nn::MaxPool2d(2));
  model->add(nn::Flatten());
  model->add(nn::Linear(18, 8, gen));
  model->add(nn::BatchNorm1d(8));
  model->add(nn::ReLU());
  model->add(nn::Linear(8, 4, gen));
  return model;
}

// 32 samples of 6 features (standard normal) and their labels in [0, 4), drawn from gen.
std::pair<Tensor, Tensor> random_batch(Generator& gen) {
  Tensor x = Tensor::randn({32, 6}, gen);
  std::vector<int64_t> labels;
  for (int i = 0; i < 32; ++i) labels.push_back(static_cast<int64_t>(gen.randint(4)));
  return {x, Tensor::from_vector(labels)};
}

// The host's waits for the device (Note [Host syncs]) in each of four DDP steps of the MLP with
// SGD on pg, the loss never read. The first step builds the buckets, and at world size 2 the
// second re-plans them (Note [Bucket rebuild]: rank 0's order goes through the host).
std::vector<uint64_t> host_syncs_per_ddp_step(const std::shared_ptr<dist::ProcessGroup>& pg, Device device,
                                              uint64_t seed) {
  auto model = mlp();
  model->to(device);
  dist::DistributedDataParallel ddp(model, pg);
  nn::SGD opt(model->parameters(), nn::SGDOptions{/*lr=*/0.1});
  Generator gen(seed);
  std::vector<uint64_t> per_step;
  for (int step = 0; step < 4; ++step) {
    const auto [x, y] = random_batch(gen);
    const Tensor xg = x.to(device), yg = y.to(device);
    const uint64_t start = kernels::cuda::host_syncs();
    opt.zero_grad();
    cross_entropy(ddp(xg), yg).backward();
    opt.step();
    per_step.push_back(kernels::cuda::host_syncs() - start);
  }
  return per_step;
}

// Note [NCCL point-to-point], at world size 2: send/recv beside collectives, a send whose Work
// is dropped, and the Works of one NCCL group waited on from two threads.
void check_point_to_point_beside_collectives(dist::ProcessGroup& pg, Device gpu) {
  const int rank = pg.rank(), peer = 1 - rank;
  // Rank 0 sends, then all-reduces; rank 1 all-reduces (and waits), then receives. 64 MB is far
  // beyond NCCL's point-to-point buffers: were the send on the collectives' stream, it would wait
  // for a recv that waits for an all-reduce queued behind the send.
  const int64_t huge = int64_t(16) << 20;  // float32 elements: 64 MB
  Tensor message = rank == 0 ? Tensor::full({huge}, 5.0f, gpu) : Tensor::zeros({huge}, DType::Float32, gpu);
  Tensor token = Tensor::full({1}, static_cast<float>(rank + 1), gpu);
  if (rank == 0) {
    auto sent = pg.send(message, 1);
    pg.all_reduce(token)->wait(30s);
    sent->wait(30s);
  } else {
    pg.all_reduce(token)->wait(30s);
    pg.recv(message, 0)->wait(30s);
    const std::vector<float> got = message.to_vector();
    CHECK(got.front() == 5.0f);
    CHECK(got.back() == 5.0f);
  }
  CHECK(token.to_vector() == std::vector<float>{3.0f});

  // Fire and forget (torch.distributed.isend without wait): rank 0 drops the send's Work, and only
  // a barrier through the store follows, which rank 1 passes once it has received.
  Tensor note = rank == 0 ? Tensor::full({1 << 20}, 9.0f, gpu) : Tensor::zeros({1 << 20}, DType::Float32, gpu);
  if (rank == 0) {
    pg.send(note, 1);
    pg.store().wait({"test_gpu_dist/note_received"}, 30s);
  } else {
    pg.recv(note, 0)->wait(30s);
    const std::vector<float> got = note.to_vector();
    CHECK(got.front() == 9.0f);
    CHECK(got.back() == 9.0f);
    pg.store().set("test_gpu_dist/note_received", std::string("1"));
  }

  // The send and the recv of one exchange share one NCCL group and its Work; one thread waits on
  // each, many times over.
  for (int round = 0; round < 20; ++round) {
    CAPTURE(round);
    Tensor out = Tensor::full({1 << 18}, static_cast<float>(100 * rank + round), gpu);
    Tensor in = Tensor::zeros({1 << 18}, DType::Float32, gpu);
    auto sent = pg.send(out, peer);
    auto received = pg.recv(in, peer);
    std::string send_error, recv_error;
    std::thread sender([&] {
      try {
        sent->wait(30s);
      } catch (const std::exception& e) {
        send_error = e.what();
      }
    });
    std::thread receiver([&] {
      try {
        received->wait(30s);
      } catch (const std::exception& e) {
        recv_error = e.what();
      }
    });
    sender.join();
    receiver.join();
    REQUIRE_MESSAGE(send_error.empty(), send_error);
    REQUIRE_MESSAGE(recv_error.empty(), recv_error);
    const std::vector<float> got = in.to_vector();
    CHECK(got.front() == static_cast<float>(100 * peer + round));
    CHECK(got.back() == static_cast<float>(100 * peer + round));
  }
}

// Note [NCCL point-to-point], module loading and memory, in a fresh process: rank 0's send
// waits for rank 1's recv, which comes after three collectives. Rank 0 runs them meanwhile: Max
// and Min launch the NaN-ordered key kernels for the first time, all_gather and reduce_scatter
// allocate their temporaries from an emptied cache (cudaMalloc). A first launch that loaded a
// module, or an allocation, that waited for the device would wait for the send: a deadlock.
void check_collectives_beside_a_pending_send(dist::ProcessGroup& pg, Device gpu) {
  const int rank = pg.rank();
  const int64_t huge = int64_t(16) << 20;  // float32 elements: 64 MB, beyond NCCL's buffers
  Tensor message = rank == 0 ? Tensor::full({huge}, 4.0f, gpu) : Tensor::zeros({huge}, DType::Float32, gpu);
  Tensor values = Tensor::full({3}, static_cast<float>(rank + 1), gpu);
  std::vector<Tensor> gathered{Tensor::zeros({3}, DType::Float32, gpu), Tensor::zeros({3}, DType::Float32, gpu)};
  Tensor part = Tensor::zeros({2}, DType::Float32, gpu);
  std::vector<Tensor> parts{Tensor::full({2}, static_cast<float>(rank + 1), gpu),
                            Tensor::full({2}, static_cast<float>(10 * (rank + 1)), gpu)};
  kernels::cuda::empty_cache();  // before any send: the temporaries below come from cudaMalloc
  std::shared_ptr<dist::Work> sent;
  if (rank == 0) sent = pg.send(message, 1);
  pg.all_reduce(values, dist::ReduceOp::Max)->wait(30s);  // {2, 2, 2} on both ranks
  pg.all_gather(gathered, values)->wait(30s);
  pg.reduce_scatter(part, parts, dist::ReduceOp::Min)->wait(30s);
  if (rank == 0) {
    sent->wait(30s);
  } else {
    pg.recv(message, 0)->wait(30s);
    const std::vector<float> got = message.to_vector();
    CHECK(got.front() == 4.0f);
    CHECK(got.back() == 4.0f);
  }
  CHECK(values.to_vector() == std::vector<float>{2, 2, 2});
  CHECK(gathered[0].to_vector() == std::vector<float>{2, 2, 2});
  CHECK(gathered[1].to_vector() == std::vector<float>{2, 2, 2});
  // Part r is the minimum over the ranks of their parts[r]: min(1, 2) and min(10, 20).
  CHECK(part.to_vector() == std::vector<float>(2, rank == 0 ? 1.0f : 10.0f));
}

// steps of the same batches (seed 11) through a CPU model and a wrapped CUDA one.
void train_side_by_side(nn::Module& cpu_model, nn::Optimizer& cpu_opt, nn::Module& gpu_model, nn::Optimizer& gpu_opt,
                        int steps) {
  Generator gen(11);
  for (int step = 0; step < steps; ++step) {
    const auto [x, y] = random_batch(gen);
    cpu_opt.zero_grad();
    cross_entropy(cpu_model(x), y).backward();
    cpu_opt.step();
    gpu_opt.zero_grad();
    cross_entropy(gpu_model(x.to(Device::cuda(0))), y.to(Device::cuda(0))).backward();
    gpu_opt.step();
  }
}

// Largest |a - b| of each entry of want, printed per entry when a check fails.
void check_state_close(const nn::StateDict& got, const nn::StateDict& want, float tolerance) {
  for (const auto& entry : want) {
    const std::string& name = entry.first;  // a structured binding cannot be captured (clang)
    CAPTURE(name);
    const std::vector<float> a = entry.second.to_vector(), b = got.at(name).to_vector();
    float worst = 0;
    for (size_t j = 0; j < a.size(); ++j) worst = std::max(worst, std::abs(a[j] - b[j]));
    CHECK(worst < tolerance);
  }
}

}  // namespace

TEST_CASE("NCCL collectives on a CUDA tensor, world size 1: exact values") {
  if (in_launched_rank()) return;
#if !NANODDP_WITH_NCCL
  testing::not_in_this_build("NCCL");
  return;
#endif
  auto pg = nccl_group();
  CHECK(pg->backend_name() == "nccl");
  pg->reset_counts();  // the default group may have run other cases' collectives
  const Device gpu = Device::cuda(0);
  for (int64_t n : {1, 257, 65537, (1 << 20) + 3}) {
    CAPTURE(n);
    Tensor t = Tensor::full({n}, 1.0f, gpu);  // rank r contributes r + 1
    pg->all_reduce(t, dist::ReduceOp::Sum)->wait();
    for (float v : t.to_vector()) REQUIRE(v == 1.0f);
    pg->all_reduce(t, dist::ReduceOp::Avg)->wait();
    CHECK(t.to_vector()[static_cast<size_t>(n - 1)] == 1.0f);
  }
  Tensor counts = Tensor::from_vector(std::vector<int64_t>{7, 9}, {}, gpu);
  pg->all_reduce(counts, dist::ReduceOp::Max)->wait();
  CHECK(counts.to_int_vector() == std::vector<int64_t>{7, 9});
  Tensor b = Tensor::arange(5, gpu);
  pg->broadcast(b, 0)->wait();
  CHECK(b.to_vector() == std::vector<float>{0, 1, 2, 3, 4});
  std::vector<Tensor> gathered{Tensor::zeros({3}, DType::Float32, gpu)};
  pg->all_gather(gathered, Tensor::full({3}, 2.0f, gpu))->wait();
  CHECK(gathered[0].to_vector() == std::vector<float>{2, 2, 2});
  pg->barrier()->wait();
  // Max/Min go through ordered integer keys (Note [NCCL NaN]): every float comes back as it was.
  const float nan = std::nanf("");
  const float inf = std::numeric_limits<float>::infinity();
  for (dist::ReduceOp op : {dist::ReduceOp::Max, dist::ReduceOp::Min}) {
    Tensor values = Tensor::from_vector(std::vector<float>{nan, 1.5f, -0.25f, inf, -inf, 0.0f, -3e38f}, {}, gpu);
    pg->all_reduce(values, op)->wait();
    const std::vector<float> v = values.to_vector();
    CHECK(std::isnan(v[0]));
    CHECK(std::vector<float>(v.begin() + 1, v.end()) == std::vector<float>{1.5f, -0.25f, inf, -inf, 0.0f, -3e38f});
  }
  // reduce_scatter of one rank: the output is its one input, also through Max's keys with NaN
  // and for an empty tensor.
  for (dist::ReduceOp op : {dist::ReduceOp::Sum, dist::ReduceOp::Max, dist::ReduceOp::Min}) {
    Tensor part = Tensor::full({4}, -7.0f, gpu);
    std::vector<Tensor> parts{Tensor::from_vector(std::vector<float>{nan, 2.5f, -inf, -0.5f}, {}, gpu)};
    pg->reduce_scatter(part, parts, op)->wait();
    const std::vector<float> got = part.to_vector();
    CHECK(std::isnan(got[0]));
    CHECK(std::vector<float>(got.begin() + 1, got.end()) == std::vector<float>{2.5f, -inf, -0.5f});
    Tensor none = Tensor::zeros({0}, DType::Float32, gpu);
    std::vector<Tensor> no_parts{Tensor::zeros({0}, DType::Float32, gpu)};
    CHECK_NOTHROW(pg->reduce_scatter(none, no_parts, op)->wait());
  }
  // Each call counted once (Note [Collective counters]), the barrier too, though NCCL runs it
  // as an all-reduce of its own. all_reduce: 2 calls for each n (4 n bytes), the int64 pair,
  // Max and Min of 7 floats.
  const int64_t float_elements = 1 + 257 + 65537 + (1 << 20) + 3;
  CHECK(pg->count(dist::Collective::AllReduce).calls == 8 + 1 + 2);
  CHECK(pg->count(dist::Collective::AllReduce).bytes == 2 * 4 * float_elements + 16 + 2 * 28);
  CHECK(pg->count(dist::Collective::Broadcast).calls == 1);
  CHECK(pg->count(dist::Collective::Broadcast).bytes == 20);
  CHECK(pg->count(dist::Collective::AllGather).calls == 1);
  CHECK(pg->count(dist::Collective::AllGather).bytes == 12);
  CHECK(pg->count(dist::Collective::ReduceScatter).calls == 6);
  CHECK(pg->count(dist::Collective::ReduceScatter).bytes == 3 * 16);
  CHECK(pg->count(dist::Collective::Barrier).calls == 1);
  CHECK(pg->count(dist::Collective::Barrier).bytes == 0);
  // Point-to-point needs another rank; a tag NCCL cannot honour is refused, not ignored.
  CHECK_THROWS_AS(pg->send(b, 0), ValueError);
  CHECK_THROWS_AS(pg->recv(b, 0, 0), ValueError);
}

// Note [Host syncs] (kernels/device_memory.h): one counter of the host's waits for the device.
TEST_CASE("host syncs: every wait for the device is counted, and a DDP step waits none") {
  if (in_launched_rank()) return;
  namespace gpu = kernels::cuda;
  const Device cuda = Device::cuda(0);
  const Tensor t = Tensor::full({4}, 1.5f, cuda);
  const uint64_t before = gpu::host_syncs();
  const Tensor doubled = t * 2.0f;  // a kernel launch: queued, no wait
  CHECK(gpu::host_syncs() == before);
  gpu::synchronize();
  CHECK(gpu::host_syncs() == before + 1);
  CHECK(doubled.to_vector() == std::vector<float>(4, 3.0f));  // one copy to the host
  CHECK(gpu::host_syncs() == before + 2);
#if !NANODDP_WITH_NCCL
  testing::not_in_this_build("NCCL");
  return;
#endif
  // The MLP with SGD and with AdamW, and a CNN with BatchNorm1d (momentum 0.1) with SGD, under
  // DDP (NCCL, world size 1), the loss never read: after the first step (which builds buckets
  // and optimizer state) a step never waits for the device (issue 31, item 7): every kernel,
  // cuBLAS call and bucket copy is queued, the optimizer's step factors are computed on the
  // host, BatchNorm counts its batch on the device, and zero_grad sets .grad to none.
  auto pg = nccl_group();
  struct Case {
    const char* name;
    bool cnn, adamw;
  };
  for (const Case& c :
       {Case{"MLP, SGD", false, false}, Case{"MLP, AdamW", false, true}, Case{"CNN, SGD", true, false}}) {
    CAPTURE(c.name);
    std::shared_ptr<nn::Sequential> model = c.cnn ? cnn_with_batch_norm() : mlp();
    model->to(cuda);
    dist::DistributedDataParallel ddp(model, pg);
    std::unique_ptr<nn::Optimizer> opt;
    if (c.adamw)
      opt = std::make_unique<nn::AdamW>(model->parameters(), nn::AdamWOptions{});
    else
      opt = std::make_unique<nn::SGD>(model->parameters(), nn::SGDOptions{/*lr=*/0.1});
    Generator gen(5);
    std::vector<uint64_t> per_step;
    for (int step = 0; step < 4; ++step) {
      const auto [x, y] = random_batch(gen);
      // The input's copies are not the step's.
      const Tensor xg = (c.cnn ? Tensor::randn({32, 1, 6, 6}, gen) : x).to(cuda);
      const Tensor yg = y.to(cuda);
      const uint64_t start = gpu::host_syncs();
      opt->zero_grad();
      cross_entropy(ddp(xg), yg).backward();
      opt->step();
      per_step.push_back(gpu::host_syncs() - start);
    }
    MESSAGE("host syncs per DDP step (", c.name, "): ", per_step[1], ", ", per_step[2], ", ", per_step[3]);
    CHECK(per_step[1] == 0);
    CHECK(per_step[2] == 0);
    CHECK(per_step[3] == 0);
  }
  // An NCCL Work's wait() orders the compute stream and returns (Note [NCCL stream-ordered
  // wait]): the next kernel sees the result without the host waiting; a barrier waits on the
  // host. Max turns the buffer into integer keys and back on NCCL's stream (Note [NCCL NaN]):
  // a kernel that ran before that stream had finished would read keys, not 3.0.
  {
    Tensor summed = Tensor::full({1 << 22}, 3.0f, cuda);
    const uint64_t start = gpu::host_syncs();
    pg->all_reduce(summed, dist::ReduceOp::Max)->wait();
    const Tensor doubled = summed * 2.0f;
    CHECK(gpu::host_syncs() - start == 0);
    const std::vector<float> values = doubled.to_vector();
    CHECK(std::all_of(values.begin(), values.end(), [](float v) { return v == 6.0f; }));
    const uint64_t before_barrier = gpu::host_syncs();
    pg->barrier()->wait();
    CHECK(gpu::host_syncs() - before_barrier == 1);
  }
  // clip_grad_norm_ reads its two totals once, however many gradients it sums.
  {
    auto model = cnn_with_batch_norm();
    model->to(cuda);
    Generator gen(6);
    cross_entropy((*model)(Tensor::randn({32, 1, 6, 6}, gen).to(cuda)), random_batch(gen).second.to(cuda))
        .backward();
    const uint64_t start = gpu::host_syncs();
    nn::clip_grad_norm_(model->parameters(), 0.01);
    CHECK(gpu::host_syncs() - start == 1);
  }
  // momentum=None reads the batch count on the host, as torch does: one wait per forward.
  nn::BatchNorm1d cumulative(4, 1e-5f, std::nullopt);
  cumulative.to(cuda);
  const Tensor input = Tensor::full({8, 4}, 2.0f, cuda);
  const uint64_t start = gpu::host_syncs();
  cumulative(input);
  CHECK(gpu::host_syncs() - start == 1);
  CHECK(cumulative.num_batches_tracked.to(Device::cpu()).to_int_vector() == std::vector<int64_t>{1});
}

// What the NCCL watchdog does after it aborts a collective (Note [NCCL stream-ordered wait]):
// every later host wait for the device throws its reason. Run in a process of its own, since
// the failure lasts as long as the process.
TEST_CASE("after the watchdog's failure every host wait for the device throws its reason") {
  if (std::getenv("NANODDP_GPU_TEST_FAILED_SYNCS") == nullptr) {
    if (in_launched_rank()) return;
    ::setenv("NANODDP_GPU_TEST_FAILED_SYNCS", "1", 1);
    const testing::RunResult r =
        testing::run({testing::built("tests/test_gpu_dist"), "-tc=*after the watchdog's failure*"}, 120s);
    ::unsetenv("NANODDP_GPU_TEST_FAILED_SYNCS");
    CHECK_MESSAGE(r.code() == 0, "the child failed:\n", r.out, r.err);
    return;
  }
  namespace gpu = kernels::cuda;
  const Device cuda = Device::cuda(0);
  const Tensor t = Tensor::full({4}, 1.5f, cuda);
  CHECK(t.to_vector() == std::vector<float>(4, 1.5f));  // fine until then
  gpu::fail_host_syncs("all_reduce(sum) #3: did not complete within 10 ms");
  gpu::fail_host_syncs("a second reason");  // the first one stays
  CHECK_THROWS_WITH_AS(gpu::synchronize(), doctest::Contains("all_reduce(sum) #3: did not complete"), DistError);
  CHECK_THROWS_WITH_AS(t.to_vector(), doctest::Contains("all_reduce(sum) #3"), DistError);
  CHECK_THROWS_AS(Tensor::full({4}, 1.0f, Device::cpu()).to(cuda), DistError);
}

TEST_CASE("NCCL refuses NCCL_COMM_BLOCKING=1, which would make its waits untimed") {
  if (in_launched_rank()) return;
#if !NANODDP_WITH_NCCL
  testing::not_in_this_build("NCCL");
  return;
#endif
  dist::TCPStoreOptions store_options;
  store_options.host = "127.0.0.1";
  store_options.port = 0;
  store_options.is_server = true;
  store_options.world_size = 1;
  auto store = std::make_shared<dist::TCPStore>(store_options);
  ::setenv("NCCL_COMM_BLOCKING", "1", 1);
  dist::NcclOptions options;
  options.device = Device::cuda(0);
  std::string message;
  try {
    dist::make_nccl_process_group(store, options);
  } catch (const DistError& e) {
    message = e.what();
  }
  ::unsetenv("NCCL_COMM_BLOCKING");
  CHECK_MESSAGE(message.find("NCCL_COMM_BLOCKING=1 (from the environment)") != std::string::npos, message);

  // The same from NCCL's configuration file, which NCCL reads into its settings at init.
  const std::string conf = "/tmp/nanoddp_blocking_" + std::to_string(::getpid()) + ".conf";
  std::ofstream(conf) << "NCCL_COMM_BLOCKING=1\n";
  ::setenv("NCCL_CONF_FILE", conf.c_str(), 1);
  message.clear();
  try {
    dist::make_nccl_process_group(store, options);
  } catch (const DistError& e) {
    message = e.what();
  }
  ::unsetenv("NCCL_CONF_FILE");
  std::remove(conf.c_str());
  CHECK_MESSAGE(message.find("NCCL_COMM_BLOCKING=1 (from " + conf + ")") != std::string::npos, message);
}

TEST_CASE("DDP on a GPU (NCCL, world size 1) trains like the same model on the CPU") {
  if (in_launched_rank()) return;
#if !NANODDP_WITH_NCCL
  testing::not_in_this_build("NCCL");
  return;
#endif
  auto pg = nccl_group();
  auto cpu_model = mlp(), gpu_model = mlp();
  gpu_model->to(Device::cuda(0));
  dist::DistributedDataParallel ddp(gpu_model, pg);
  nn::SGD cpu_opt(cpu_model->parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
  nn::SGD gpu_opt(ddp.parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
  train_side_by_side(*cpu_model, cpu_opt, ddp, gpu_opt, 10);
  check_state_close(gpu_model->state_dict(), cpu_model->state_dict(), 1e-4f);
}

// The compression hooks on CUDA buckets over NCCL: the 16-bit conversion kernels, NCCL's
// Float16/BFloat16 sum and the decompression. At world size 1 the reduced gradient is this
// rank's, rounded to 16 bits: every value must be representable in 16 bits, and within one
// 16-bit step of the same model's float32 gradient on the CPU.
TEST_CASE("DDP compression hooks on a GPU (NCCL, world size 1) round every gradient to 16 bits") {
  if (in_launched_rank()) return;
#if !NANODDP_WITH_NCCL
  testing::not_in_this_build("NCCL");
  return;
#endif
  auto pg = nccl_group();
  for (const bool bf16 : {false, true}) {
    CAPTURE(bf16);
    auto cpu_model = mlp(), gpu_model = mlp();
    gpu_model->to(Device::cuda(0));
    dist::DistributedDataParallel ddp(gpu_model, pg);
    ddp.register_comm_hook(pg, bf16 ? dist::bf16_compress_hook : dist::fp16_compress_hook);
    Generator gen(5);
    const auto [x, y] = random_batch(gen);
    cross_entropy((*cpu_model)(x), y).backward();
    cross_entropy(ddp(x.to(Device::cuda(0))), y.to(Device::cuda(0))).backward();
    const auto cpu_params = cpu_model->named_parameters(), gpu_params = gpu_model->named_parameters();
    for (size_t i = 0; i < cpu_params.size(); ++i) {
      CAPTURE(cpu_params[i].first);
      const std::vector<float> want = cpu_params[i].second.grad().to_vector();
      const std::vector<float> got = gpu_params[i].second.grad().to_vector();
      REQUIRE(got.size() == want.size());
      for (size_t j = 0; j < got.size(); ++j) {
        const float rounded = bf16 ? BFloat16::from_float(got[j]).to_float() : Float16::from_float(got[j]).to_float();
        CHECK_MESSAGE(rounded == got[j], "element ", j, " = ", got[j], " is not a 16-bit value");
        // One step of the 16-bit format at this magnitude: 2^-7 (bf16) or 2^-10 (fp16)
        // relative, plus fp16's smallest subnormal step.
        const float step = std::abs(want[j]) * (bf16 ? 1.0f / 128 : 1.0f / 1024) + (bf16 ? 0.0f : 6e-8f);
        CHECK_MESSAGE(std::abs(got[j] - want[j]) <= step + 1e-6f, "element ", j, ": ", got[j], " vs the CPU's ",
                      want[j]);
      }
    }
  }
}

// ZeRO over Adam, SyncBatchNorm and clip_grad_norm_ on CUDA tensors over NCCL, against the
// same model with BatchNorm1d and a plain Adam on the CPU: 5 steps, then the parameters, the
// running statistics and every step's total norm agree to float32 noise.
TEST_CASE("ZeRO (Adam), SyncBatchNorm and clip_grad_norm_ on a GPU (NCCL, world size 1) train like the CPU") {
  if (in_launched_rank()) return;
#if !NANODDP_WITH_NCCL
  testing::not_in_this_build("NCCL");
  return;
#endif
  auto pg = nccl_group();
  auto with_batch_norm = [] {
    Generator gen(3);
    auto model = std::make_shared<nn::Sequential>();
    // Normalising the input: behind a Linear, BatchNorm would cancel that Linear's bias, whose
    // gradient would then be rounding noise that Adam scales up to whole steps.
    model->add(nn::BatchNorm1d(6));
    model->add(nn::Linear(6, 16, gen));
    model->add(nn::ReLU());
    model->add(nn::Linear(16, 4, gen));
    return model;
  };
  auto cpu_model = with_batch_norm(), gpu_model = with_batch_norm();
  dist::convert_sync_batchnorm(gpu_model, pg);
  gpu_model->to(Device::cuda(0));
  dist::DistributedDataParallel ddp(gpu_model, pg);
  const nn::AdamOptions adam{/*lr=*/0.01};
  nn::Adam cpu_opt(cpu_model->parameters(), adam);
  dist::ZeroRedundancyOptimizer gpu_opt(ddp.parameters(), pg, [&](std::vector<Tensor> params) {
    return std::unique_ptr<nn::Optimizer>(new nn::Adam(std::move(params), adam));
  });
  Generator gen(11);
  for (int step = 0; step < 5; ++step) {
    CAPTURE(step);
    const auto [x, y] = random_batch(gen);
    cpu_opt.zero_grad();
    cross_entropy((*cpu_model)(x), y).backward();
    const float cpu_norm = nn::clip_grad_norm_(cpu_model->parameters(), 0.5);
    cpu_opt.step();
    gpu_opt.zero_grad();
    cross_entropy(ddp(x.to(Device::cuda(0))), y.to(Device::cuda(0))).backward();
    const float gpu_norm = nn::clip_grad_norm_(ddp.parameters(), 0.5);
    gpu_opt.step();
    CHECK(std::abs(gpu_norm - cpu_norm) <= 1e-4f * cpu_norm);
  }
  auto compare = [](const std::vector<std::pair<std::string, Tensor>>& cpu,
                    const std::vector<std::pair<std::string, Tensor>>& gpu) {
    REQUIRE(cpu.size() == gpu.size());
    for (size_t i = 0; i < cpu.size(); ++i) {
      CAPTURE(cpu[i].first);
      CHECK(gpu[i].second.device() == Device::cuda(0));
      const std::vector<float> a = cpu[i].second.to_vector(), b = gpu[i].second.to_vector();
      float worst = 0;
      for (size_t j = 0; j < a.size(); ++j) worst = std::max(worst, std::abs(a[j] - b[j]));
      CHECK(worst < 1e-4f);
    }
  };
  compare(cpu_model->named_parameters(), gpu_model->named_parameters());
  std::vector<std::pair<std::string, Tensor>> cpu_stats, gpu_stats;
  for (const auto& [name, b] : cpu_model->named_buffers())
    if (b.dtype() == DType::Float32) cpu_stats.emplace_back(name, b);
  for (const auto& [name, b] : gpu_model->named_buffers())
    if (b.dtype() == DType::Float32) gpu_stats.emplace_back(name, b);
  compare(cpu_stats, gpu_stats);
}

// FSDP on CUDA tensors over NCCL: the all_gather into the unit's flat vector (freed and
// allocated again by the caching allocator), the reduce_scatter out of the full gradient, and
// the shards an optimizer steps. At world size 1 a shard is the whole unit, so the model must
// train exactly as the same model on the CPU, with only the shards alive between steps.
TEST_CASE("FSDP on a GPU (NCCL, world size 1): FULL_SHARD and SHARD_GRAD_OP train like the CPU, holding only shards between steps") {
  if (in_launched_rank()) return;
#if !NANODDP_WITH_NCCL
  testing::not_in_this_build("NCCL");
  return;
#endif
  auto pg = nccl_group();
  for (const auto strategy : {dist::ShardingStrategy::FULL_SHARD, dist::ShardingStrategy::SHARD_GRAD_OP}) {
    CAPTURE(dist::sharding_strategy_name(strategy));
    auto cpu_model = mlp(), gpu_model = mlp();
    const int64_t params_before = memory_stats(Device::cuda(0)).live[static_cast<int>(MemoryCategory::Parameters)];
    gpu_model->to(Device::cuda(0));
    dist::FSDPOptions options;
    options.sharding_strategy = strategy;
    options.auto_wrap_policy = dist::module_wrap_policy<nn::Linear>();
    options.forward_prefetch = true;
    dist::FullyShardedDataParallel fsdp(gpu_model, pg, options);
    nn::Adam cpu_opt(cpu_model->parameters(), {});
    nn::Adam gpu_opt(fsdp.parameters(), {});
    train_side_by_side(*cpu_model, cpu_opt, fsdp, gpu_opt, 5);
    // Between steps the full vectors are freed: the shards (here whole units) remain.
    const int64_t params_now = memory_stats(Device::cuda(0)).live[static_cast<int>(MemoryCategory::Parameters)];
    int64_t shard_bytes = 0;
    for (const Tensor& shard : fsdp.parameters()) shard_bytes += static_cast<int64_t>(shard.nbytes());
    CHECK(params_now - params_before == shard_bytes);  // the model's own storages are gone too
    check_state_close(fsdp.full_state_dict(), cpu_model->state_dict(), 1e-4f);
  }
}

TEST_CASE("two ranks share one GPU over Gloo: FSDP FULL_SHARD on CUDA tensors equals DDP") {
#if !NANODDP_WITH_GLOO
  testing::not_in_this_build("Gloo (tools/gpu-check carries it when prepare finds libgloo-dev)");
  return;
#endif
  if (!in_launched_rank()) return run_ranks_of_this_file("*share one GPU over Gloo: FSDP*", "gloo");
  auto pg = join_launched(dist::Backend::Gloo, Device::cuda(0));
  auto ddp_model = mlp(), fsdp_model = mlp();
  ddp_model->to(Device::cuda(0));
  fsdp_model->to(Device::cuda(0));
  dist::DistributedDataParallel ddp(ddp_model, pg);
  dist::FSDPOptions options;
  options.auto_wrap_policy = dist::module_wrap_policy<nn::Linear>();
  dist::FullyShardedDataParallel fsdp(fsdp_model, pg, options);
  nn::SGD ddp_opt(ddp.parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
  nn::SGD fsdp_opt(fsdp.parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
  Generator gen(21 + static_cast<uint64_t>(pg->rank()));  // each rank its own batches
  for (int step = 0; step < 5; ++step) {
    const auto [x, y] = random_batch(gen);
    const Tensor xd = x.to(Device::cuda(0)), yd = y.to(Device::cuda(0));
    ddp_opt.zero_grad();
    cross_entropy(ddp(xd), yd).backward();
    ddp_opt.step();
    fsdp_opt.zero_grad();
    cross_entropy(fsdp(xd), yd).backward();
    fsdp_opt.step();
  }
  check_state_close(fsdp.full_state_dict(/*rank0_only=*/false), ddp_model->state_dict(), 1e-5f);
  pg.reset();
  dist::destroy_process_group();
}

TEST_CASE("two ranks share one GPU over Gloo: collectives on CUDA tensors are exact") {
#if !NANODDP_WITH_GLOO
  testing::not_in_this_build("Gloo (tools/gpu-check carries it when prepare finds libgloo-dev)");
  return;
#endif
  if (!in_launched_rank()) return run_ranks_of_this_file("*share one GPU over Gloo: collectives*", "gloo");
  auto pg = join_launched(dist::Backend::Gloo, Device::cuda(0));
  testing::check_staged_collectives(*pg, Device::cuda(0));
  // The staging pool took pinned memory, so CUDA is up: an exit handler registered from then on
  // drops a group still alive at exit before the CUDA runtime's teardown (Note [NCCL shutdown]).
  CHECK(dist::detail::exit_handler_after_cuda_registered());
  // What examples do with their metrics: host numbers through the group's device.
  const auto totals = dist::all_reduce_host(*pg, std::vector<int64_t>{pg->rank() + 1, 10}, dist::ReduceOp::Sum);
  CHECK(totals == std::vector<int64_t>{3, 20});
  dist::destroy_process_group();
}

TEST_CASE("two ranks share one GPU over Gloo: DDP on CUDA tensors equals 1-rank training") {
#if !NANODDP_WITH_GLOO
  testing::not_in_this_build("Gloo (tools/gpu-check carries it when prepare finds libgloo-dev)");
  return;
#endif
  if (!in_launched_rank()) return run_ranks_of_this_file("*share one GPU over Gloo: DDP*", "gloo");
  auto pg = join_launched(dist::Backend::Gloo, Device::cuda(0));
  // Staging never waits for the device: the copy to the host is followed on the compute stream
  // by a host function that lets the group's thread issue the collective, and the copy of the
  // result back is queued there too (Note [Staging without a host wait] in dist/host_staging.cpp).
  Tensor staged = Tensor::full({1000}, static_cast<float>(pg->rank() + 1), Device::cuda(0));
  const uint64_t start = kernels::cuda::host_syncs();
  pg->all_reduce(staged)->wait();
  const Tensor doubled = staged * 2.0f;
  CHECK(kernels::cuda::host_syncs() - start == 0);
  CHECK(doubled.to_vector() == std::vector<float>(1000, 6.0f));
  {
    const std::vector<uint64_t> per_step = host_syncs_per_ddp_step(pg, Device::cuda(0), 7 + pg->rank());
    MESSAGE("host syncs per DDP step, two ranks on one GPU over Gloo: ", per_step[1], ", ", per_step[2], ", ",
            per_step[3]);
    CHECK(per_step[2] == 0);
    CHECK(per_step[3] == 0);
  }
  testing::check_ddp_matches_one_rank(pg, Device::cuda(0), /*tolerance=*/1e-4f);
  pg.reset();
  dist::destroy_process_group();
}

TEST_CASE("NCCL refuses two ranks on one GPU and says to use Gloo") {
#if !NANODDP_WITH_NCCL
  testing::not_in_this_build("NCCL");
  return;
#endif
  if (!in_launched_rank()) return run_ranks_of_this_file("*NCCL refuses two ranks*", "nccl");
  std::string message;
  try {
    join_launched(dist::Backend::Nccl, Device::cuda(0));
  } catch (const DistError& e) {
    message = e.what();
  }
  CHECK_MESSAGE(message.find("duplicate GPU") != std::string::npos, message);
  CHECK_MESSAGE(message.find("--backend gloo") != std::string::npos, message);
}

TEST_CASE("NCCL at world size 2 (two GPUs): collectives, send/recv and DDP") {
#if !NANODDP_WITH_NCCL
  testing::not_in_this_build("NCCL");
  return;
#endif
  if (kernels::cuda::device_count() < 2) {
    MESSAGE("skipped: needs two GPUs (this machine has ", kernels::cuda::device_count(), ")");
    return;
  }
  if (!in_launched_rank()) return run_ranks_of_this_file("*NCCL at world size 2*", "nccl");
  const Device gpu = Device::cuda(dist::get_local_rank());
  auto pg = join_launched(dist::Backend::Nccl, gpu);
  // First, on the fresh group: the first send between the two ranks comes before collectives
  // that the peer waits in. Without the connections made when the group was built, that send
  // would wait on the host for the peer's recv (Note [NCCL point-to-point], connections).
  check_collectives_beside_a_pending_send(*pg, gpu);
  check_point_to_point_beside_collectives(*pg, gpu);
  // Every collective on the group's own device; results must follow the non-blocking calls.
  const int rank = pg->rank();
  for (int64_t n : {int64_t(1), int64_t(65537), (int64_t(1) << 22) + 3}) {
    Tensor t = Tensor::full({n}, static_cast<float>(rank + 1), gpu);
    pg->all_reduce(t, dist::ReduceOp::Sum)->wait();
    const std::vector<float> v = t.to_vector();
    CHECK(v.front() == 3.0f);
    CHECK(v.back() == 3.0f);
  }
  // NaN wins in Max and Min whichever rank holds it (torch.maximum; Note [NCCL NaN]).
  for (dist::ReduceOp op : {dist::ReduceOp::Max, dist::ReduceOp::Min}) {
    const float nan = std::nanf("");
    Tensor values = Tensor::from_vector(rank == 0 ? std::vector<float>{nan, 1.0f, 2.0f, -3.0f}
                                                  : std::vector<float>{1.0f, nan, 1.0f, -4.0f},
                                        {}, gpu);
    pg->all_reduce(values, op)->wait();
    const std::vector<float> v = values.to_vector();
    CHECK(std::isnan(v[0]));
    CHECK(std::isnan(v[1]));
    CHECK(v[2] == (op == dist::ReduceOp::Max ? 2.0f : 1.0f));
    CHECK(v[3] == (op == dist::ReduceOp::Max ? -3.0f : -4.0f));
    Tensor out = Tensor::zeros({2}, DType::Float32, gpu);
    std::vector<Tensor> inputs{Tensor::from_vector(std::vector<float>{rank == 0 ? nan : 5.0f, 6.0f}, {}, gpu),
                               Tensor::from_vector(std::vector<float>{7.0f, rank == 1 ? nan : 8.0f}, {}, gpu)};
    pg->reduce_scatter(out, inputs, op)->wait();
    // Rank 0 gets part 0: (NaN, 6) from rank 0 and (5, 6) from rank 1; rank 1 gets part 1:
    // (7, 8) from rank 0 and (7, NaN) from rank 1.
    const std::vector<float> mine = out.to_vector();
    CHECK(std::isnan(mine[rank == 0 ? 0 : 1]));
    CHECK(mine[rank == 0 ? 1 : 0] == (rank == 0 ? 6.0f : 7.0f));
  }
  // send/recv (Note [NCCL point-to-point]): an exchange larger than NCCL's buffers, each rank
  // sending before it receives, must not deadlock; two messages arrive in the order sent.
  const int peer = 1 - rank;
  const int64_t big = (int64_t(1) << 22) + 3;
  Tensor out_first = Tensor::full({big}, static_cast<float>(10 * (rank + 1)), gpu);
  Tensor out_second = Tensor::full({5}, static_cast<float>(rank + 1), gpu);
  Tensor in_first = Tensor::zeros({big}, DType::Float32, gpu);
  Tensor in_second = Tensor::zeros({5}, DType::Float32, gpu);
  auto sent_first = pg->send(out_first, peer);
  auto sent_second = pg->send(out_second, peer);
  auto got_first = pg->recv(in_first, peer);
  auto got_second = pg->recv(in_second, peer);
  got_second->wait();
  got_first->wait();
  sent_first->wait();
  sent_second->wait();
  const std::vector<float> first = in_first.to_vector();
  CHECK(first.front() == 10.0f * (peer + 1));
  CHECK(first.back() == 10.0f * (peer + 1));
  CHECK(in_second.to_vector() == std::vector<float>(5, static_cast<float>(peer + 1)));
  CHECK_THROWS_AS(pg->send(out_second, peer, 3), ValueError);
  // A collective after a send/recv that nobody waited on issues it first.
  Tensor lone = Tensor::zeros({3}, DType::Float32, gpu);
  auto unwaited = rank == 0 ? pg->send(Tensor::full({3}, 7.0f, gpu), 1) : pg->recv(lone, 0);
  Tensor sum = Tensor::full({1}, 1.0f, gpu);
  pg->all_reduce(sum)->wait();
  CHECK(sum.to_vector() == std::vector<float>{2.0f});
  unwaited->wait();
  if (rank == 1) CHECK(lone.to_vector() == std::vector<float>{7, 7, 7});
  {
    // DDP's waits for its buckets are stream-ordered (Note [NCCL stream-ordered wait]), and the
    // collective check's fingerprints travel through shared memory (Note [Host fingerprints]):
    // a step waits for nothing, checked as below unchecked.
    const std::vector<uint64_t> per_step = host_syncs_per_ddp_step(pg, gpu, 7 + rank);
    MESSAGE("host syncs per DDP step at world size 2, checked: ", per_step[1], ", ", per_step[2], ", ", per_step[3]);
    CHECK(per_step[2] == 0);
    CHECK(per_step[3] == 0);
  }
  testing::check_ddp_matches_one_rank(pg, gpu, /*tolerance=*/1e-4f);
  // Ranks that disagree are told by the collective check, nothing issued, and the group takes
  // no more collectives (Note [Out of step]); send/recv, which it does not check, still go.
  Tensor mismatched = Tensor::zeros({rank == 0 ? 3 : 4}, DType::Float32, gpu);
  CHECK_THROWS_WITH_AS(pg->all_reduce(mismatched)->wait(30s),
                       doctest::Contains("ranks called different collectives"), DistError);
  Tensor refused = Tensor::full({2}, 1.0f, gpu);
  CHECK_THROWS_WITH_AS(pg->all_reduce(refused)->wait(30s), doctest::Contains("takes no more collectives"),
                       DistError);
  CHECK(refused.to_vector() == std::vector<float>{1.0f, 1.0f});
  // A send still queued when the group goes is issued by its end, which finalizes the send/recv
  // communicator (completing the send) although rank 0 still holds the send's Work, unwaited,
  // through destroy_process_group (Note [NCCL shutdown]).
  Tensor last = rank == 0 ? Tensor::full({1 << 20}, 11.0f, gpu) : Tensor::zeros({1 << 20}, DType::Float32, gpu);
  std::shared_ptr<dist::Work> held_through_exit;
  if (rank == 0) held_through_exit = pg->send(last, 1);
  if (rank == 1) pg->recv(last, 0)->wait(30s);
  pg.reset();
  dist::destroy_process_group();
  if (rank == 0) {
    held_through_exit->wait(30s);  // issued and finished by the group's end: returns at once
    CHECK(held_through_exit->is_completed());
  } else {
    const std::vector<float> got = last.to_vector();
    CHECK(got.front() == 11.0f);
    CHECK(got.back() == 11.0f);
  }
  // A group without the collective check: a DDP step at world size 2 never waits for the
  // device (issue 31, item 7).
  dist::InitOptions unchecked_options;
  unchecked_options.backend = dist::Backend::Nccl;
  unchecked_options.device = gpu;
  unchecked_options.timeout = 60s;
  unchecked_options.check_collectives = false;
  auto unchecked = dist::init_process_group(unchecked_options);
  const std::vector<uint64_t> unchecked_syncs = host_syncs_per_ddp_step(unchecked, gpu, 7 + rank);
  MESSAGE("host syncs per DDP step at world size 2, unchecked: ", unchecked_syncs[1], ", ", unchecked_syncs[2], ", ",
          unchecked_syncs[3]);
  CHECK(unchecked_syncs[2] == 0);
  CHECK(unchecked_syncs[3] == 0);
  unchecked.reset();
  dist::destroy_process_group();
}

TEST_CASE("kernels run on their tensors' GPU, not the current one (two GPUs)") {
  if (kernels::cuda::device_count() < 2) {
    MESSAGE("skipped: needs two GPUs (this machine has ", kernels::cuda::device_count(), ")");
    return;
  }
  kernels::cuda::set_device(0);
  const int64_t n = 1 << 20;
  Tensor a = Tensor::full({n}, 1.0f, Device::cuda(1));
  kernels::cuda::set_device(0);
  Tensor b = a * 3.0f + a;
  kernels::cuda::set_device(0);
  CHECK(b.device() == Device::cuda(1));
  const std::vector<float> v = b.to_vector();
  CHECK(v.front() == 4.0f);
  CHECK(v.back() == 4.0f);
  CHECK(sum(b).item() == 4.0f * n);
  CHECK_THROWS_AS(a + Tensor::ones({n}, DType::Float32, Device::cuda(0)), DeviceError);
}

TEST_CASE("backward refuses a CPU gradient for a CUDA output") {
  Tensor w = Tensor::ones({3}, DType::Float32, Device::cuda(0)).set_requires_grad(true);
  Tensor out = w * 2.0f;
  CHECK_THROWS_AS(out.backward(Tensor::ones({3})), DeviceError);
}
