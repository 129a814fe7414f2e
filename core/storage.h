// Storage: one allocation of bytes on one device, shared by every Tensor that views it.
//
//   auto s = Storage::allocate(1024, Device::cpu());   // 64-byte aligned, uninitialised
//   s->data();  s->nbytes();
//
// CPU memory is 64-byte aligned (Eigen and AVX-512 friendly). CUDA memory comes from the
// caching allocator in kernels/cuda (see kernels/device_memory.h); in a build without CUDA,
// asking for it throws DeviceError.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "core/device.h"

namespace nanoddp {

class Storage {
 public:
  using Deleter = std::function<void(void*)>;

  // Allocates nbytes on device. nbytes == 0 gives a valid storage with data() == nullptr.
  static std::shared_ptr<Storage> allocate(size_t nbytes, Device device);
  // Wraps memory owned elsewhere; deleter runs when the last Tensor lets go.
  Storage(void* data, size_t nbytes, Device device, Deleter deleter);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

 private:
  void* data_;
  size_t nbytes_;
  Device device_;
  Deleter deleter_;
};

// Copies nbytes between any two devices (host<->host, host<->device, device<->device).
// Copies that touch a GPU are ordered on the compute stream and complete before return.
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes);

}  // namespace nanoddp
