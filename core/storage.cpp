#include "core/storage.h"

#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "kernels/device_memory.h"

namespace nanoddp {

namespace {
constexpr size_t kCpuAlignmentBytes = 64;  // a cache line; what AVX-512 loads want
}

std::shared_ptr<Storage> Storage::allocate(size_t nbytes, Device device) {
  if (nbytes == 0) return std::make_shared<Storage>(nullptr, 0, device, [](void*) {});
  if (device.is_cuda()) {
    void* data = kernels::cuda::allocate(nbytes, device.index);
    const int index = device.index;
    return std::make_shared<Storage>(data, nbytes, device,
                                     [index](void* p) { kernels::cuda::deallocate(p, index); });
  }
  const size_t rounded = (nbytes + kCpuAlignmentBytes - 1) / kCpuAlignmentBytes * kCpuAlignmentBytes;
  void* data = std::aligned_alloc(kCpuAlignmentBytes, rounded);
  NANODDP_CHECK(data != nullptr, ValueError, "out of host memory allocating ", nbytes, " bytes");
  return std::make_shared<Storage>(data, nbytes, device, [](void* p) { std::free(p); });
}

Storage::Storage(void* data, size_t nbytes, Device device, Deleter deleter)
    : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)) {}

Storage::~Storage() {
  if (data_ != nullptr && deleter_) deleter_(data_);
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
    kernels::cuda::copy(dst, src, nbytes, CopyKind::DeviceToDevice);
  }
}

}  // namespace nanoddp
