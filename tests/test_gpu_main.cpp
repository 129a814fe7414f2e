// main() of the GPU test executables (suite gpu): runs doctest only when a GPU is usable.
// Otherwise it says why and returns 77, which Meson reports as SKIP instead of FAIL. A test
// may leave its process group as the default for the next; it is destroyed once all have run,
// while CUDA is still up (Note [NCCL shutdown]).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "dist/init.h"
#include "kernels/device_memory.h"
#include "kernels/kernels.h"

namespace {
constexpr int kSkipExitCode = 77;  // Meson's (and automake's) "skipped"
}

int main(int argc, char** argv) {
  if (!nanoddp::kernels::cuda_built()) {
    std::printf(
        "SKIP: this build has no CUDA (-Dcuda=disabled, no nvcc, or -Dcuda=auto where no GPU answered "
        "nvidia-smi -L); the GPU tests are compiled in a build with -Dcuda=enabled\n");
    return kSkipExitCode;
  }
  if (nanoddp::kernels::cuda::device_count() == 0) {
    std::printf("SKIP: no usable GPU: %s\n", nanoddp::kernels::cuda::unavailable_reason().c_str());
    return kSkipExitCode;
  }
  doctest::Context context(argc, argv);
  const int result = context.run();
  if (nanoddp::dist::is_initialized()) nanoddp::dist::destroy_process_group();
  return result;
}
