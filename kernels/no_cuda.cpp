// The CUDA side of a build without CUDA: no devices, and a clear error for any use.
#include "core/error.h"
#include "kernels/device_memory.h"
#include "kernels/kernels.h"

namespace nanoddp::kernels {

bool cuda_built() { return false; }

namespace cuda {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  NANODDP_THROW(DeviceError, what, ": this build has no CUDA (configure with -Dcuda=enabled)");
}
}  // namespace

int device_count() { return 0; }
std::string unavailable_reason() { return "nanoddp was built without CUDA"; }
void set_device(int) { no_cuda("set_device"); }
void* allocate(size_t, int) { no_cuda("allocate"); }
void deallocate(void*, int) {}
void empty_cache() {}
AllocatorStats allocator_stats(int) { return {}; }
void* allocate_pinned(size_t) { no_cuda("allocate_pinned"); }
void free_pinned(void*) {}
void copy(void*, const void*, size_t, CopyKind) { no_cuda("copy"); }
void copy_async(void*, const void*, size_t, CopyKind) { no_cuda("copy_async"); }
void* compute_stream() { no_cuda("compute_stream"); }
void synchronize() {}
void* create_event() { no_cuda("create_event"); }
void destroy_event(void*) {}
void record_event(void*) { no_cuda("record_event"); }
bool event_passed(void*) { no_cuda("event_passed"); }
void wait_for_event(void*) { no_cuda("wait_for_event"); }
void call_after_stream(void (*)(void*), void*) { no_cuda("call_after_stream"); }
void count_host_sync() {}
uint64_t host_syncs() { return 0; }
}  // namespace cuda

}  // namespace nanoddp::kernels
