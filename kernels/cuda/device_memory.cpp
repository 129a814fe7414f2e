// GPU memory, streams and the cuBLAS handle: the definitions behind kernels/device_memory.h
// and kernels/cuda/context.h.
//
// Note [Leaked on exit]
// The per-device state (pools, streams, handles) is created with new and never destroyed.
// Static destructors run after the CUDA runtime may have shut down, where cudaFree and
// cublasDestroy fail or crash; the driver releases everything when the process ends.

#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/context.h"
#include "kernels/device_memory.h"
#include "kernels/kernels.h"

namespace nanoddp::kernels {

bool cuda_built() { return true; }

}  // namespace nanoddp::kernels

namespace nanoddp::kernels::cuda {
namespace {

struct Availability {
  int count = 0;
  std::string reason;  // empty when count > 0
};

// Asked once per process. cudaGetDeviceCount leaves its argument unwritten on failure (CUDA
// 13 without a driver returns cudaErrorInsufficientDriver, 35), hence the initialised count.
const Availability& availability() {
  static const Availability result = [] {
    Availability a;
    int count = 0;
    const cudaError_t error = cudaGetDeviceCount(&count);
    if (error != cudaSuccess) {
      cudaGetLastError();  // clear the sticky error so later calls do not report it again
      if (error == cudaErrorInsufficientDriver)
        a.reason = "CUDA driver not found, or older than this build's CUDA runtime (cudaErrorInsufficientDriver)";
      else if (error == cudaErrorNoDevice)
        a.reason = "no CUDA device found (cudaErrorNoDevice; check CUDA_VISIBLE_DEVICES)";
      else
        a.reason = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(error) + " (" +
                   cudaGetErrorString(error) + ")";
    } else if (count <= 0) {
      a.reason = "no CUDA device found";
    } else {
      a.count = count;
    }
    return a;
  }();
  return result;
}

void check_device(int device) {
  const Availability& a = availability();
  NANODDP_CHECK(a.count > 0, DeviceError, "cuda:", device, " requested but no GPU is usable: ", a.reason);
  NANODDP_CHECK(device >= 0 && device < a.count, DeviceError, "cuda:", device, " does not exist (", a.count,
                " GPU", a.count == 1 ? "" : "s", " visible)");
}

// Note [Current device]
// cudaSetDevice is not free: it initialises the device's primary context (cuda_runtime_api.h),
// hundreds of MiB on the GPU, and in EXCLUSIVE_PROCESS mode it fails once another process owns
// the device. So nothing here switches to a device this process has not used, not even to
// restore the "previous" one: on a thread that never set one, cudaGetDevice reports 0, and a
// restoring guard would open a context on GPU 0 in every rank (a job on gloo/mpi/shm with
// --device cuda sets no device before its first allocation). The allocator makes the block's
// device current and leaves it so, as NANODDP_DISPATCH does for a kernel's device.

// Blocks are rounded so that the few sizes a training loop asks for map to few cache keys:
// to 512 bytes up to 1 MiB (cudaMalloc's own alignment is 256), to 1 MiB above.
constexpr size_t kSmallRound = 512;
constexpr size_t kLargeRound = size_t(1) << 20;

size_t round_block(size_t nbytes) {
  const size_t unit = nbytes <= kLargeRound ? kSmallRound : kLargeRound;
  return (nbytes + unit - 1) / unit * unit;
}

// One device's caching allocator. Free blocks are kept by exact (rounded) size and handed
// out again for that size; cudaFree runs only in empty_cache() or when cudaMalloc fails.
struct Pool {
  std::mutex mutex;
  std::multimap<size_t, void*> free_blocks;   // block size -> pointer
  std::unordered_map<void*, size_t> live;     // pointer -> block size
  AllocatorStats stats;

  // Takes every cached block out of the pool, for release() once mutex is let go. Caller holds
  // mutex. cudaFree waits for the whole device, so it never runs under the mutex: a thread that
  // frees a tensor meanwhile (the NCCL watchdog, Note [NCCL stream-ordered wait]) would wait
  // for it too, and a collective that hangs ends only by the watchdog's abort.
  std::multimap<size_t, void*> take_cached() {
    std::multimap<size_t, void*> taken;
    taken.swap(free_blocks);
    for (const auto& [size, ptr] : taken) stats.reserved_bytes -= size;
    return taken;
  }
  // Caller has made the device current and holds no mutex.
  static void release(const std::multimap<size_t, void*>& blocks) {
    // A failure is nobody's to report (the block is gone either way): cleared, so that the
    // next launch check does not report it as its kernel's.
    for (const auto& [size, ptr] : blocks)
      if (cudaFree(ptr) != cudaSuccess) (void)cudaGetLastError();
  }
};

// Everything per device, created on first use (Note [Leaked on exit]).
struct DeviceState {
  std::once_flag stream_once;
  cudaStream_t stream = nullptr;
  std::once_flag cublas_once;
  cublasHandle_t cublas = nullptr;
  Pool pool;
};

DeviceState& device_state(int device) {
  static std::vector<DeviceState*>* states = [] {
    auto* s = new std::vector<DeviceState*>();
    for (int i = 0; i < availability().count; ++i) s->push_back(new DeviceState());
    return s;
  }();
  check_device(device);
  return *(*states)[device];
}

cudaMemcpyKind to_cuda(CopyKind kind) {
  switch (kind) {
    case CopyKind::HostToDevice: return cudaMemcpyHostToDevice;
    case CopyKind::DeviceToHost: return cudaMemcpyDeviceToHost;
    case CopyKind::DeviceToDevice: return cudaMemcpyDeviceToDevice;
  }
  return cudaMemcpyDefault;
}

}  // namespace

int device_count() { return availability().count; }

std::string unavailable_reason() { return availability().reason; }

void set_device(int device) {
  check_device(device);
  int current = -1;
  NANODDP_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) NANODDP_CUDA_CHECK(cudaSetDevice(device));
}

int current_device() {
  check_device(0);  // a clear "no GPU" message before cudaGetDevice's
  int device = 0;
  NANODDP_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

void* allocate(size_t nbytes, int device) {
  if (nbytes == 0) return nullptr;
  Pool& pool = device_state(device).pool;
  const size_t size = round_block(nbytes);
  std::unique_lock<std::mutex> lock(pool.mutex);
  void* ptr = nullptr;
  auto cached = pool.free_blocks.find(size);
  if (cached != pool.free_blocks.end()) {
    ptr = cached->second;
    pool.free_blocks.erase(cached);
  } else {
    set_device(device);  // Note [Current device]
    cudaError_t error = cudaMalloc(&ptr, size);
    if (error == cudaErrorMemoryAllocation && !pool.free_blocks.empty()) {
      cudaGetLastError();
      // Cached blocks of other sizes may make room; freed outside the lock (Pool::take_cached).
      const std::multimap<size_t, void*> others = pool.take_cached();
      lock.unlock();
      Pool::release(others);
      lock.lock();
      error = cudaMalloc(&ptr, size);
    }
    if (error != cudaSuccess) {
      cudaGetLastError();
      NANODDP_THROW(DeviceError, "cuda:", device, " out of memory allocating ", nbytes, " bytes (",
                    cudaGetErrorName(error), "); allocated ", pool.stats.allocated_bytes, " bytes, reserved ",
                    pool.stats.reserved_bytes, " bytes by nanoddp");
    }
    pool.stats.reserved_bytes += size;
  }
  pool.live.emplace(ptr, size);
  pool.stats.allocated_bytes += size;
  if (pool.stats.allocated_bytes > pool.stats.peak_allocated_bytes)
    pool.stats.peak_allocated_bytes = pool.stats.allocated_bytes;
  return ptr;
}

void deallocate(void* ptr, int device) {
  if (ptr == nullptr) return;
  // Called from Storage's deleter, i.e. from destructors: report, never throw.
  if (device < 0 || device >= device_count()) {
    std::fprintf(stderr, "nanoddp: deallocate(%p) on cuda:%d, which does not exist; leaked\n", ptr, device);
    return;
  }
  Pool& pool = device_state(device).pool;
  std::lock_guard<std::mutex> lock(pool.mutex);
  auto it = pool.live.find(ptr);
  if (it == pool.live.end()) {
    std::fprintf(stderr, "nanoddp: deallocate(%p) on cuda:%d: not a live block of this device; ignored\n", ptr,
                 device);
    return;
  }
  pool.stats.allocated_bytes -= it->second;
  pool.free_blocks.emplace(it->second, ptr);
  pool.live.erase(it);
}

void empty_cache() {
  const int devices = device_count();
  if (devices == 0) return;
  int current = 0;
  NANODDP_CUDA_CHECK(cudaGetDevice(&current));
  bool current_in_use = false;
  for (int device = 0; device < devices; ++device) {
    DeviceState& state = device_state(device);
    {
      std::lock_guard<std::mutex> lock(state.pool.mutex);
      if (device == current) current_in_use = state.stream != nullptr || !state.pool.live.empty();
      if (state.pool.free_blocks.empty()) continue;  // nothing cached; maybe never used (Note [Current device])
    }
    NANODDP_CUDA_CHECK(cudaSetDevice(device));
    // Queued kernels may still use a cached block (Note [Scratch on one stream]).
    if (state.stream != nullptr) {
      count_host_sync();
      NANODDP_CUDA_CHECK(cudaStreamSynchronize(state.stream));
    }
    std::multimap<size_t, void*> cached;
    {
      std::lock_guard<std::mutex> lock(state.pool.mutex);
      cached = state.pool.take_cached();
    }
    Pool::release(cached);
    if (device == current) current_in_use = true;
  }
  // Back to the caller's device, unless that one was never used here.
  if (current_in_use) NANODDP_CUDA_CHECK(cudaSetDevice(current));
}

AllocatorStats allocator_stats(int device) {
  Pool& pool = device_state(device).pool;
  std::lock_guard<std::mutex> lock(pool.mutex);
  return pool.stats;
}

void* allocate_pinned(size_t nbytes) {
  if (nbytes == 0) return nullptr;
  check_device(0);
  void* ptr = nullptr;
  NANODDP_CUDA_CHECK(cudaMallocHost(&ptr, nbytes));
  return ptr;
}

void free_pinned(void* ptr) {
  if (ptr == nullptr) return;
  const cudaError_t error = cudaFreeHost(ptr);  // from destructors: report, never throw
  if (error != cudaSuccess) {
    cudaGetLastError();
    std::fprintf(stderr, "nanoddp: cudaFreeHost(%p) failed: %s\n", ptr, cudaGetErrorString(error));
  }
}

void copy(void* dst, const void* src, size_t nbytes, CopyKind kind) {
  if (nbytes == 0) return;
  cudaStream_t s = stream();
  NANODDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, to_cuda(kind), s));
  count_host_sync();
  NANODDP_CUDA_CHECK(cudaStreamSynchronize(s));
  check_host_syncs();
}

void copy_async(void* dst, const void* src, size_t nbytes, CopyKind kind) {
  if (nbytes == 0) return;
  NANODDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, to_cuda(kind), stream()));
}

// A blocking stream (not cudaStreamNonBlocking): work that some library puts on the legacy
// default stream stays ordered with ours.
void* compute_stream() {
  DeviceState& state = device_state(current_device());
  std::call_once(state.stream_once, [&] { NANODDP_CUDA_CHECK(cudaStreamCreate(&state.stream)); });
  return state.stream;
}

void synchronize() {
  count_host_sync();
  NANODDP_CUDA_CHECK(cudaStreamSynchronize(stream()));
  check_host_syncs();
}

// Note [Compute-stream events]
void* create_event() {
  cudaEvent_t event = nullptr;
  NANODDP_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return event;
}

void destroy_event(void* event) {
  // Nothing to do about a failure here but clear it, so that the next launch check does not
  // report it as its kernel's.
  if (event != nullptr && cudaEventDestroy(static_cast<cudaEvent_t>(event)) != cudaSuccess) (void)cudaGetLastError();
}

void record_event(void* event) { NANODDP_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), stream())); }

bool event_passed(void* event) {
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (status == cudaErrorNotReady) {
    // Not an error, but CUDA records it as this thread's last one: cleared, or the next
    // kernel launch's check would report it (as torch's CUDAEvent::query does).
    (void)cudaGetLastError();
    return false;
  }
  NANODDP_CUDA_CHECK(status);
  return true;
}

void wait_for_event(void* event) {
  count_host_sync();
  NANODDP_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  check_host_syncs();
}

void call_after_stream(void (*fn)(void*), void* arg) { NANODDP_CUDA_CHECK(cudaLaunchHostFunc(stream(), fn, arg)); }

// Note [Host syncs]: one counter for the process.
namespace {
std::atomic<uint64_t> host_sync_count{0};
}  // namespace
void count_host_sync() { host_sync_count.fetch_add(1, std::memory_order_relaxed); }
uint64_t host_syncs() { return host_sync_count.load(std::memory_order_relaxed); }

cublasHandle_t cublas_handle() {
  DeviceState& state = device_state(current_device());
  cudaStream_t s = stream();
  std::call_once(state.cublas_once, [&] {
    NANODDP_CUBLAS_CHECK(cublasCreate(&state.cublas));
    NANODDP_CUBLAS_CHECK(cublasSetStream(state.cublas, s));
#if NANODDP_TF32
    NANODDP_CUBLAS_CHECK(cublasSetMathMode(state.cublas, CUBLAS_TF32_TENSOR_OP_MATH));
#else
    // Plain float32 arithmetic: TF32 (10-bit mantissa inputs) would not match the CPU.
    NANODDP_CUBLAS_CHECK(cublasSetMathMode(state.cublas, CUBLAS_DEFAULT_MATH));
#endif
  });
  return state.cublas;
}

}  // namespace nanoddp::kernels::cuda
