// NANODDP_HOST_DEVICE marks an inline function that the CPU kernels and the CUDA kernels both
// call, so the two devices compute one expression written once (kernels/adam_update.h,
// kernels/pool_window.h).
#pragma once

#ifdef __CUDACC__
#define NANODDP_HOST_DEVICE __host__ __device__
#else
#define NANODDP_HOST_DEVICE
#endif
