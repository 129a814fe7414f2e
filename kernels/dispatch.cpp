#include "kernels/kernels.h"

namespace nanoddp::kernels {

void throw_no_cuda(const char* kernel) {
  NANODDP_THROW(DeviceError, kernel, ": a CUDA tensor in a build without CUDA; rebuild with -Dcuda=enabled");
}

}  // namespace nanoddp::kernels
