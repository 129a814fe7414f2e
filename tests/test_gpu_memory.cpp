// GPU memory and tensors on CUDA: the caching allocator's reuse and stats, copies both ways
// (pageable and pinned), errors for a missing device or an impossible allocation, Tensor::to,
// and a zero-size batch through linear leaving no CUDA error behind.
#include "tests/test_gpu_util.h"

#include <cstdint>
#include <string>
#include <vector>

#include "core/ops.h"
#include "core/random.h"
#include "core/tensor.h"
#include "kernels/device_memory.h"
#include "kernels/kernels.h"

#if NANODDP_WITH_CUDA

namespace {

using namespace nanoddp;
using namespace nanoddp::testing;
namespace gpu = nanoddp::kernels::cuda;

TEST_CASE("the caching allocator reuses freed blocks of the same size and keeps stats") {
  gpu::synchronize();
  gpu::empty_cache();
  const gpu::AllocatorStats before = gpu::allocator_stats(0);

  void* p = gpu::allocate(1000, 0);  // rounded up to a 1024-byte block
  REQUIRE(p != nullptr);
  gpu::AllocatorStats s = gpu::allocator_stats(0);
  CHECK(s.allocated_bytes == before.allocated_bytes + 1024);
  CHECK(s.reserved_bytes == before.reserved_bytes + 1024);
  CHECK(s.peak_allocated_bytes >= s.allocated_bytes);

  gpu::deallocate(p, 0);
  s = gpu::allocator_stats(0);
  CHECK(s.allocated_bytes == before.allocated_bytes);
  CHECK(s.reserved_bytes == before.reserved_bytes + 1024);  // kept for reuse, not freed

  void* q = gpu::allocate(1024, 0);  // the same rounded size: the same block
  CHECK(q == p);
  CHECK(gpu::allocator_stats(0).reserved_bytes == before.reserved_bytes + 1024);

  void* r = gpu::allocate(3 << 20, 0);  // a large block next to the small one
  s = gpu::allocator_stats(0);
  CHECK(s.allocated_bytes == before.allocated_bytes + 1024 + (3 << 20));
  CHECK(s.peak_allocated_bytes >= before.allocated_bytes + 1024 + (3 << 20));
  gpu::deallocate(q, 0);
  gpu::deallocate(r, 0);

  gpu::empty_cache();
  s = gpu::allocator_stats(0);
  CHECK(s.allocated_bytes == before.allocated_bytes);
  CHECK(s.reserved_bytes == before.reserved_bytes);  // cached blocks went back to CUDA

  CHECK(gpu::allocate(0, 0) == nullptr);
  gpu::deallocate(nullptr, 0);  // a no-op
}

TEST_CASE("the caching allocator releases its cached blocks and retries when cudaMalloc runs out") {
  gpu::synchronize();
  gpu::empty_cache();
  const gpu::AllocatorStats before = gpu::allocator_stats(0);
  // Fill the device with 1 GiB blocks until cudaMalloc fails, then give them all back to the
  // cache: the device stays full, the blocks held by nanoddp.
  const size_t block = size_t(1) << 30;
  std::vector<void*> blocks;
  std::string error;
  try {
    while (blocks.size() < 4096) blocks.push_back(gpu::allocate(block, 0));
  } catch (const DeviceError& e) {
    error = e.what();
  }
  CHECK(error.find("out of memory") != std::string::npos);
  REQUIRE(blocks.size() >= 2);
  for (void* p : blocks) gpu::deallocate(p, 0);
  const size_t reserved_full = gpu::allocator_stats(0).reserved_bytes;
  CHECK(reserved_full == before.reserved_bytes + blocks.size() * block);
  // A size no cached block has: cudaMalloc fails, the cache is released, and the retry succeeds.
  const size_t larger = block + block / 2;
  void* p = gpu::allocate(larger, 0);
  CHECK(p != nullptr);
  const gpu::AllocatorStats after = gpu::allocator_stats(0);
  CHECK(after.reserved_bytes == before.reserved_bytes + larger);
  CHECK(after.allocated_bytes == before.allocated_bytes + larger);
  gpu::deallocate(p, 0);
  gpu::empty_cache();
  CHECK(gpu::allocator_stats(0).reserved_bytes == before.reserved_bytes);
}

TEST_CASE("device errors are DeviceError with a message, never a crash") {
  CHECK_THROWS_AS(gpu::set_device(gpu::device_count()), DeviceError);
  CHECK_THROWS_AS(gpu::allocate(16, -1), DeviceError);
  try {
    gpu::allocate(size_t(1) << 52, 0);  // 4 PiB: no GPU has it
    FAIL("allocating 4 PiB did not throw");
  } catch (const DeviceError& e) {
    const std::string what = e.what();
    CHECK(what.find("out of memory") != std::string::npos);
    CHECK(what.find("device_memory.cpp") != std::string::npos);  // file:line
  }
  // The failed allocation left nothing sticky behind.
  CHECK_NOTHROW(gpu::synchronize());
  DeviceArray<float> ok(16);
  ok.upload(std::vector<float>(16, 1.0f));
  CHECK(ok.to_host() == std::vector<float>(16, 1.0f));
  // A failed call is reported once, by its own DeviceError: the next kernel's launch check
  // (cudaGetLastError) does not report it again as the kernel's.
  std::vector<float> host(4, 2.0f);
  CHECK_THROWS_AS(gpu::copy(nullptr, host.data(), 4 * sizeof(float), gpu::CopyKind::HostToDevice), DeviceError);
  const Tensor doubled = Tensor::full({4}, 2.0f, Device::cuda(0)) * 2.0f;
  CHECK(doubled.to_vector() == std::vector<float>(4, 4.0f));
}

TEST_CASE("copies both ways, through pageable and pinned host memory") {
  const int64_t n = 65537;
  const auto values = normals(n, 30);
  DeviceArray<float> a(values), b(static_cast<size_t>(n));
  gpu::copy(b.data(), a.data(), n * sizeof(float), gpu::CopyKind::DeviceToDevice);
  CHECK(b.to_host() == values);

  float* pinned = static_cast<float*>(gpu::allocate_pinned(n * sizeof(float)));
  REQUIRE(pinned != nullptr);
  for (int64_t i = 0; i < n; ++i) pinned[i] = float(i);
  gpu::copy_async(a.data(), pinned, n * sizeof(float), gpu::CopyKind::HostToDevice);
  gpu::synchronize();  // the copy is done before pinned is reused
  for (int64_t i = 0; i < n; ++i) pinned[i] = -1.0f;
  gpu::copy_async(pinned, a.data(), n * sizeof(float), gpu::CopyKind::DeviceToHost);
  gpu::synchronize();
  bool all_equal = true;
  for (int64_t i = 0; i < n; ++i) all_equal = all_equal && pinned[i] == float(i);
  CHECK(all_equal);
  gpu::free_pinned(pinned);
  CHECK(gpu::compute_stream() != nullptr);
}

// Note [Compute-stream events]
TEST_CASE("an event passes once the compute stream has run what was queued before it") {
  const int64_t n = int64_t(1) << 24;
  float* pinned = static_cast<float*>(gpu::allocate_pinned(n * sizeof(float)));
  REQUIRE(pinned != nullptr);
  for (int64_t i = 0; i < n; ++i) pinned[i] = float(i % 1000);
  DeviceArray<float> a(static_cast<size_t>(n));
  void* copied = gpu::create_event();
  const uint64_t before = gpu::host_syncs();
  gpu::copy_async(a.data(), pinned, n * sizeof(float), gpu::CopyKind::HostToDevice);
  gpu::record_event(copied);
  (void)gpu::event_passed(copied);  // a look, not a wait
  CHECK(gpu::host_syncs() == before);
  gpu::wait_for_event(copied);
  CHECK(gpu::host_syncs() == before + 1);
  CHECK(gpu::event_passed(copied));
  for (int64_t i = 0; i < n; ++i) pinned[i] = -1.0f;  // the copy has read it: free to reuse
  const std::vector<float> back = a.to_host();
  CHECK(back[999] == 999.0f);
  CHECK(back[n - 1] == float((n - 1) % 1000));
  gpu::destroy_event(copied);
  gpu::free_pinned(pinned);
}

TEST_CASE("Tensor::to moves values to the GPU and back") {
  Generator gen(31);
  const Tensor x = Tensor::randn({257, 3}, gen);
  const Tensor on_gpu = x.to(Device::cuda(0));
  CHECK(on_gpu.device() == Device::cuda(0));
  CHECK(on_gpu.shape() == x.shape());
  CHECK(on_gpu.to(Device::cpu()).to_vector() == x.to_vector());
}

TEST_CASE("a zero-size batch through linear forward and backward leaves no CUDA error") {
  Generator gen(32);
  const Device cuda = Device::cuda(0);
  const Tensor x = Tensor::zeros({0, 4}, DType::Float32, cuda);
  const Tensor w = Tensor::randn({3, 4}, gen).to(cuda).set_requires_grad(true);
  const Tensor b = Tensor::randn({3}, gen).to(cuda).set_requires_grad(true);
  const Tensor y = linear(x, w, b);
  CHECK(y.shape() == Shape({0, 3}));
  sum(y).backward();
  CHECK_NOTHROW(gpu::synchronize());
  // No rows contribute: both gradients are exactly zero.
  CHECK(w.grad().to_vector() == std::vector<float>(12, 0.0f));
  CHECK(b.grad().to_vector() == std::vector<float>(3, 0.0f));
}

TEST_CASE("a small linear + cross_entropy step on CUDA matches the CPU") {
  Generator gen(33);
  const Tensor x = Tensor::randn({33, 17}, gen), w = Tensor::randn({5, 17}, gen), b = Tensor::randn({5}, gen);
  const Tensor target = Tensor::from_vector(std::vector<int64_t>(33, 2));
  std::vector<std::vector<float>> results[2];
  for (int k = 0; k < 2; ++k) {
    const Device device = k == 0 ? Device::cpu() : Device::cuda(0);
    const Tensor wd = w.to(device).detach().set_requires_grad(true);
    const Tensor bd = b.to(device).detach().set_requires_grad(true);
    const Tensor loss = cross_entropy(relu(linear(x.to(device), wd, bd)), target.to(device));
    loss.backward();
    results[k] = {loss.to(Device::cpu()).to_vector(), wd.grad().to_vector(), bd.grad().to_vector()};
  }
  const char* names[] = {"loss", "dweight", "dbias"};
  for (int i = 0; i < 3; ++i) expect_close(names[i], results[1][i], results[0][i], 1e-5, 1e-6);
}

}  // namespace

#endif  // NANODDP_WITH_CUDA
