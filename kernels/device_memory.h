// GPU memory and streams, for the few places outside kernels/cuda that need them (Storage,
// the DataLoader's pinned buffers, the NCCL process group). Defined in kernels/cuda; in a
// build without CUDA every function but device_count() throws DeviceError.
//
//   if (kernels::cuda::device_count() == 0) skip();
//   void* p = kernels::cuda::allocate(bytes, 0);  ...  kernels::cuda::deallocate(p, 0);
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace nanoddp::kernels::cuda {

// Number of usable GPUs; 0 when there is no driver or no device (never throws).
int device_count();
// Why device_count() is 0, e.g. "CUDA driver not found (cudaErrorInsufficientDriver)".
std::string unavailable_reason();
// Makes device the current GPU of this thread (no CUDA call when it already is); throws
// DeviceError if it does not exist.
void set_device(int device);

// Caching allocator: blocks are kept per device and reused by size; memory is returned to
// CUDA only by empty_cache(), never on the hot path. Throws DeviceError when out of memory.
void* allocate(size_t nbytes, int device);
void deallocate(void* ptr, int device);
void empty_cache();
struct AllocatorStats {
  size_t allocated_bytes = 0;       // in live blocks handed out
  size_t reserved_bytes = 0;        // obtained from cudaMalloc, live or cached
  size_t peak_allocated_bytes = 0;  // high-water mark of allocated_bytes
};
AllocatorStats allocator_stats(int device);

// Page-locked host memory for fast, asynchronous host-to-device copies.
void* allocate_pinned(size_t nbytes);
void free_pinned(void* ptr);

enum class CopyKind { HostToDevice, DeviceToHost, DeviceToDevice };
// Copies on the compute stream and waits for it (synchronous).
void copy(void* dst, const void* src, size_t nbytes, CopyKind kind);
// Enqueues the copy on the compute stream and returns at once; host memory on either side
// must be pinned, and both buffers must stay alive until the stream has passed the copy
// (device memory from the caching allocator does: Note [Scratch on one stream]).
void copy_async(void* dst, const void* src, size_t nbytes, CopyKind kind);

// Note [Compute-stream events]
// An event marks a point of the current device's compute stream: it has passed once the
// device has run everything queued before it. A pinned buffer that an asynchronous copy reads
// is reused once that copy's event has passed, so the host waits for one copy at most, never
// for the whole stream (the DataLoader's buffers, host staging's copies back). Handles are
// cudaEvent_t as void*, to keep CUDA headers out of C++ code. An event belongs to the device
// that is current at create_event(); record and query it with that device current.
void* create_event();            // throws DeviceError
void destroy_event(void* event);  // never throws; nullptr is ignored
void record_event(void* event);  // on the current device's compute stream
bool event_passed(void* event);  // never waits; throws DeviceError for a device error
// Waits on the host until event has passed (a host sync, Note [Host syncs]); throws as
// synchronize() does.
void wait_for_event(void* event);
// Queues fn(arg) on the current device's compute stream (cudaLaunchHostFunc): CUDA calls it
// on a thread of its own once the stream has run everything queued before it, which tells
// the host without a wait. fn must not call CUDA, must not throw, and should return at once
// (the stream waits for it). Should the stream fail first, or the process end first, fn is
// never called (what arg owns is then leaked). Throws DeviceError, and then fn is not called
// either.
void call_after_stream(void (*fn)(void*), void* arg);

// The one compute stream of this process (a cudaStream_t, as void* to keep CUDA headers out
// of C++ code). Every kernel runs on it.
void* compute_stream();
void synchronize();  // waits for the compute stream

// Note [Host syncs]
// Every place where the host waits for the device (synchronize(), the synchronous copy(),
// wait_for_event(), the stream drain of empty_cache(), an NCCL Work that waits on the host, a
// barrier's, or the collective check's fingerprints' where they must go through the GPU (Note
// [Host fingerprints] in dist/process_group_checked.cpp), which polls its event) calls
// count_host_sync(), and host_syncs() says how many there were in this process, over every
// thread and device. A training step should wait once, where the loss is read: the difference
// of host_syncs() around a step is what tests/test_gpu_dist.cpp and benchmarks/gpu report.
// Without CUDA the count stays 0. (An NCCL collective's wait() is not one: Note [NCCL
// stream-ordered wait] in dist/nccl_protocol.h.)
void count_host_sync();
uint64_t host_syncs();

// Once the NCCL watchdog has aborted a collective that the host did not wait for (Note [NCCL
// stream-ordered wait]), what the device computes may rest on values that were never reduced:
// from then on synchronize(), wait_for_event() and every copy() to or from the device throw
// DistError with the first reason given, once the device has caught up.
// An empty reason, or no memory to keep it, gives a preset one. Never throws.
void fail_host_syncs(const std::string& reason) noexcept;
// Throws that DistError when fail_host_syncs has been called: for host waits that do not go
// through the functions above (an NCCL Work that waits on the host polls its event).
void check_host_syncs();
// The reason host waits fail with (fail_host_syncs), or "" when they do not.
std::string host_syncs_failure();
// Forgets the failure. For tests, which fail host syncs on purpose and go on in the same
// process; a program has no way to know that its device's results are sound again.
void clear_host_syncs_failure();

}  // namespace nanoddp::kernels::cuda
