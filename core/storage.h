// Storage: one allocation of bytes on one device, shared by every Tensor that views it, or a
// view of a byte range of another storage.
//
//   auto s = Storage::allocate(1024, Device::cpu());   // 64-byte aligned, uninitialised
//   auto part = Storage::view(s, 256, 128);            // bytes [256, 384) of s; keeps s alive
//   part->data() == static_cast<char*>(s->data()) + 256;
//
// CPU memory is 64-byte aligned (Eigen and AVX-512 friendly). CUDA memory comes from the
// caching allocator in kernels/cuda (see kernels/device_memory.h); in a build without CUDA,
// asking for it throws DeviceError.
//
// Note [Storage views]
// A tensor that lives inside another one's memory (a DDP gradient inside its bucket, with
// gradient_as_bucket_view) is a Tensor whose Storage is a view: data() points at the view's
// first byte, and the view holds the storage it was cut from. Every kernel launch, collective,
// copy and file write reaches a tensor's bytes through Storage::data() (Tensor::data<T>() calls
// it too), so the offset is applied once, here, and no call site can forget it: kernels,
// backends and CUDA paths work on views unchanged. A view of a view is a view of the
// allocation itself (base() is never a view), so base() tells whether two tensors can alias.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "core/device.h"
#include "core/memory.h"

namespace nanoddp {

class Storage {
 public:
  using Deleter = std::function<void(void*)>;

  // Allocates nbytes on device. nbytes == 0 gives a valid storage with data() == nullptr.
  static std::shared_ptr<Storage> allocate(size_t nbytes, Device device);
  // nbytes of of's memory starting at offset_bytes (Note [Storage views]); of stays alive as
  // long as the view. Throws IndexError when the range does not fit in of.
  static std::shared_ptr<Storage> view(const std::shared_ptr<Storage>& of, size_t offset_bytes, size_t nbytes);
  // Wraps memory owned elsewhere; deleter runs when the last Tensor lets go.
  Storage(void* data, size_t nbytes, Device device, Deleter deleter);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  // A view reads its base's pointer each time, so it follows free_memory and reallocate.
  // nullptr while the allocation is freed.
  void* data() const {
    if (base_ == nullptr) return data_;
    return base_->data_ == nullptr ? nullptr : static_cast<char*>(base_->data_) + offset_bytes_;
  }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  // The allocation this storage views (null when it is one itself), and where in it this
  // storage starts.
  const std::shared_ptr<Storage>& base() const { return base_; }
  size_t offset_bytes() const { return offset_bytes_; }

  // Note [Freeing a storage in place]
  // FSDP keeps a unit's full parameters only while the unit computes (dist/fsdp.h). The
  // module's parameters and the tensors autograd saved for backward all view one allocation,
  // so instead of replacing their storages it frees that allocation's memory and later
  // allocates it again in the same Storage object: every view sees the new memory (torch's
  // FSDP does the same with storage().resize_(0) and resize_(n)). While freed, data() is
  // nullptr and is_freed() true; nbytes() keeps the size. An allocation only (not a view);
  // free_memory on a freed one and reallocate on a live one do nothing. reallocate's memory
  // is uninitialised. Throws ValueError on a view.
  void free_memory();
  void reallocate();
  bool is_freed() const { return data() == nullptr && nbytes_ > 0; }

  // What this allocation is counted as (Note [Memory categories]); views report their base's.
  MemoryCategory category() const { return base_ != nullptr ? base_->category_ : category_; }
  void set_category(MemoryCategory category);
  // Whether this allocation's bytes are in the memory counters (false for wrapped memory
  // until it is said to be model state).
  bool counted() const { return base_ != nullptr ? base_->counted_ : counted_; }

  // Note [Version counter]
  // How many in-place changes a user made to this allocation's values (torch's _version,
  // shared by every view of the allocation as torch's is by views). Tensor::copy_ and fill_
  // add one, and so does a backward that adds into a .grad in place (as torch's AccumulateGrad:
  // a .grad that a forward saved, set_grad'ed to a tensor the graph reads, must not change
  // under it); autograd records it when it saves a tensor and refuses a backward that would read
  // changed values (Node::saved). Writes the library makes as part of its own protocols do
  // not count: a collective filling its output, FSDP gathering a unit's parameters back into
  // the memory its saved tensors view, an optimizer step (PyTorch's counts that one; here a
  // step between a forward and its backward goes unnoticed).
  uint64_t version() const { return base_ != nullptr ? base_->version_.load() : version_.load(); }
  void bump_version() { ++(base_ != nullptr ? base_->version_ : version_); }

 private:
  void* data_;
  size_t nbytes_;
  Device device_;
  Deleter deleter_;
  std::shared_ptr<Storage> base_;
  size_t offset_bytes_ = 0;
  MemoryCategory category_ = MemoryCategory::Other;
  bool counted_ = false;  // an allocation whose bytes are in the memory counters
  std::atomic<uint64_t> version_{0};
};

// Copies nbytes between any two devices (host<->host, host<->device, device<->device).
// Copies that touch a GPU are ordered on the compute stream. One between host and device
// completes before return (the host side may be pageable memory); one within a GPU is only
// queued, with no host sync (Note [Host syncs]): whatever reads or frees either buffer later
// runs on that stream, or waits for it, as every kernel and collective does (Note [Scratch on
// one stream]).
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes);

}  // namespace nanoddp
