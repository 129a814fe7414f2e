#include "core/storage.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "kernels/device_memory.h"

namespace nanoddp {

namespace {

constexpr size_t kCpuAlignmentBytes = 64;  // a cache line; what AVX-512 loads want

// Note [Host block cache]
// A training step frees and re-allocates the same large buffers (activations, gradients)
// every iteration. glibc serves blocks above its mmap threshold with fresh mmap'd pages and
// returns them with munmap, so every step would pay a page fault per 4 KiB of every large
// buffer. Large host blocks are therefore kept, by exact rounded size, and reused; the cache
// holds at most kMaxCachedBytes, beyond which blocks are freed as usual. What it holds is
// memory of the process (its RSS) that no tensor uses: memory_stats().cached says how much,
// and empty_cache() gives it back.
constexpr size_t kMinCachedBytes = 64 << 10;
constexpr size_t kMaxCachedBytes = 256 << 20;

class HostBlockCache {
 public:
  void* take(size_t rounded) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(rounded);
    if (it == free_.end() || it->second.empty()) return nullptr;
    void* block = it->second.back();
    it->second.pop_back();
    cached_bytes_ -= rounded;
    return block;
  }
  void give(void* block, size_t rounded) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (cached_bytes_ + rounded <= kMaxCachedBytes) {
        free_[rounded].push_back(block);
        cached_bytes_ += rounded;
        return;
      }
    }
    std::free(block);
  }
  size_t cached_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return cached_bytes_;
  }
  void release_all() {
    std::unordered_map<size_t, std::vector<void*>> blocks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks.swap(free_);
      cached_bytes_ = 0;
    }
    for (auto& [size, list] : blocks)
      for (void* block : list) std::free(block);
  }

 private:
  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  size_t cached_bytes_ = 0;
};

// Never destroyed: tensors held in static objects may be freed after it would be.
HostBlockCache& host_block_cache() {
  static HostBlockCache* cache = new HostBlockCache();
  return *cache;
}

}  // namespace

int64_t detail::host_cached_bytes() { return static_cast<int64_t>(host_block_cache().cached_bytes()); }
void detail::empty_host_cache() { host_block_cache().release_all(); }

namespace {

// The memory and the deleter of one allocation of nbytes (> 0) on device.
std::pair<void*, Storage::Deleter> allocate_memory(size_t nbytes, Device device) {
  if (device.is_cuda()) {
    void* data = kernels::cuda::allocate(nbytes, device.index);
    const int index = device.index;
    return {data, [index](void* p) { kernels::cuda::deallocate(p, index); }};
  }
  NANODDP_CHECK(nbytes <= SIZE_MAX - kCpuAlignmentBytes, ValueError, "out of host memory allocating ", nbytes,
                " bytes");
  const size_t rounded = (nbytes + kCpuAlignmentBytes - 1) / kCpuAlignmentBytes * kCpuAlignmentBytes;
  const bool cached = rounded >= kMinCachedBytes;
  void* data = cached ? host_block_cache().take(rounded) : nullptr;
  if (data == nullptr) data = std::aligned_alloc(kCpuAlignmentBytes, rounded);
  NANODDP_CHECK(data != nullptr, ValueError, "out of host memory allocating ", nbytes, " bytes");
  if (!cached) return {data, [](void* p) { std::free(p); }};
  return {data, [rounded](void* p) { host_block_cache().give(p, rounded); }};
}

}  // namespace

std::shared_ptr<Storage> Storage::allocate(size_t nbytes, Device device) {
  if (nbytes == 0) return std::make_shared<Storage>(nullptr, 0, device, [](void*) {});
  auto [data, deleter] = allocate_memory(nbytes, device);
  auto storage = std::make_shared<Storage>(data, nbytes, device, std::move(deleter));
  storage->category_ = current_memory_category();
  storage->counted_ = true;
  detail::count_allocation(device, storage->category_, static_cast<int64_t>(nbytes));
  return storage;
}

std::shared_ptr<Storage> Storage::view(const std::shared_ptr<Storage>& of, size_t offset_bytes, size_t nbytes) {
  NANODDP_CHECK(of != nullptr, ValueError, "Storage::view of no storage");
  NANODDP_CHECK(offset_bytes <= of->nbytes() && nbytes <= of->nbytes() - offset_bytes, IndexError,
                "Storage::view of ", nbytes, " bytes at offset ", offset_bytes, " of a storage of ", of->nbytes(),
                " bytes");
  // A view's data() is computed from its base (data_ stays null), so it follows the base
  // through free_memory and reallocate.
  auto view = std::make_shared<Storage>(nullptr, nbytes, of->device(), Deleter());
  view->base_ = of->base_ != nullptr ? of->base_ : of;
  view->offset_bytes_ = of->offset_bytes_ + offset_bytes;
  return view;
}

Storage::Storage(void* data, size_t nbytes, Device device, Deleter deleter)
    : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)) {}

Storage::~Storage() {
  if (data_ != nullptr && deleter_) deleter_(data_);
  if (counted_ && data_ != nullptr) detail::count_allocation(device_, category_, -static_cast<int64_t>(nbytes_));
}

void Storage::free_memory() {
  NANODDP_CHECK(base_ == nullptr, ValueError, "free_memory on a view of ", nbytes_, " bytes: free its base");
  if (data_ == nullptr) return;
  if (deleter_) deleter_(data_);
  data_ = nullptr;
  if (counted_) detail::count_allocation(device_, category_, -static_cast<int64_t>(nbytes_));
}

void Storage::reallocate() {
  NANODDP_CHECK(base_ == nullptr, ValueError, "reallocate on a view of ", nbytes_, " bytes: reallocate its base");
  if (data_ != nullptr || nbytes_ == 0) return;
  auto [data, deleter] = allocate_memory(nbytes_, device_);
  data_ = data;
  deleter_ = std::move(deleter);
  counted_ = true;
  detail::count_allocation(device_, category_, static_cast<int64_t>(nbytes_));
}

void Storage::set_category(MemoryCategory category) {
  NANODDP_CHECK(base_ == nullptr, ValueError, "set_category on a view: set its base's");
  // Memory wrapped from elsewhere (a shared-memory bucket) is counted from the moment it is
  // said to be model state: it is this rank's memory as much as an allocation is.
  if (data_ != nullptr) {
    if (counted_) detail::count_allocation(device_, category_, -static_cast<int64_t>(nbytes_));
    detail::count_allocation(device_, category, static_cast<int64_t>(nbytes_));
    counted_ = true;
  }
  category_ = category;
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes) {
  if (nbytes == 0) return;
  using kernels::cuda::CopyKind;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, nbytes);
  } else if (dst_device.is_cuda() && src_device.is_cpu()) {
    kernels::cuda::set_device(dst_device.index);
    kernels::cuda::copy(dst, src, nbytes, CopyKind::HostToDevice);
  } else if (dst_device.is_cpu() && src_device.is_cuda()) {
    kernels::cuda::set_device(src_device.index);
    kernels::cuda::copy(dst, src, nbytes, CopyKind::DeviceToHost);
  } else {
    NANODDP_CHECK(dst_device == src_device, DeviceError, "copy between ", src_device, " and ", dst_device,
                  " is not supported; go through the CPU");
    kernels::cuda::set_device(dst_device.index);
    kernels::cuda::copy_async(dst, src, nbytes, CopyKind::DeviceToDevice);
  }
}

}  // namespace nanoddp
