// Float32 values as unsigned integer keys whose integer order is the float order, with NaN at
// one end: an integer max (or min) over the keys is torch.maximum (torch.minimum) over the
// floats, NaN propagating whichever rank holds it. The NCCL process group wraps its Max/Min
// reductions in these, since ncclMax/ncclMin on floats drop a NaN (dist/process_group_nccl.cpp).
//
//   kernels::cuda::floats_to_ordered_keys(data, n, NanAt::Top, stream);     // float32 -> uint32
//   ncclAllReduce(data, data, n, ncclUint32, ncclMax, comm, stream);
//   kernels::cuda::ordered_keys_to_floats(data, n, NanAt::Top, stream);     // uint32 -> float32
//
// The key of a finite or infinite x: its bits with the sign bit set when x >= +0, all bits
// flipped when x is negative (so -inf < ... < -0 < +0 < ... < +inf as unsigned integers).
// Every NaN becomes 0xffffffff (NanAt::Top, for Max) or 0 (NanAt::Bottom, for Min), keys no
// number has, and comes back as the canonical quiet NaN. Both run in place on `n` elements of
// device memory at `data`, queued on `stream` (a cudaStream_t); n == 0 does nothing. Throw
// DeviceError when the launch fails. Internal to kernels/cuda and dist/ (the NCCL group).
#pragma once

#include <cstdint>

namespace nanoddp::kernels::cuda {

enum class NanAt { Top, Bottom };  // Top: for a max; Bottom: for a min

void floats_to_ordered_keys(void* data, int64_t n, NanAt nan_at, void* stream);
void ordered_keys_to_floats(void* data, int64_t n, NanAt nan_at, void* stream);

// Loads both kernels on the current GPU now (cudaFuncGetAttributes), so that their first
// launch does not load a module. With CUDA's lazy loading that load may wait for the whole
// device, including a send kernel spinning for its peer (Note [NCCL point-to-point], module
// loading). Throws DeviceError when CUDA fails.
void preload_ordered_key_kernels();

}  // namespace nanoddp::kernels::cuda
