// CUDA tensors on a CPU process group (Gloo, MPI, or any backend whose device() is the CPU):
// each collective copies its GPU tensors into pinned host buffers, runs on those, and copies
// the results back at wait(). Several ranks can so share one GPU, which NCCL refuses.
//
//   auto pg = dist::init_process_group(options);             // Gloo: staged already
//   Tensor grad = Tensor::ones({n}, DType::Float32, Device::cuda(0));
//   pg->all_reduce(grad)->wait();                            // reduced, still on cuda:0
//
// init_process_group wraps every group whose device() is the CPU, so a new CPU backend gets
// this by being created there; wrap a group from a make_*_process_group factory yourself.
// Follows c10d's Gloo backend, which also stages CUDA tensors through pinned memory.
//
// Contract, on top of ProcessGroup's:
//  - a tensor not on the CPU (cuda:N; tests use the host stand-in cpu:1) is copied to host
//    memory after every kernel queued before the call, without a host wait: the copy is
//    queued on the compute stream, and the group's own thread issues the collective on the
//    backend once the copy has run (Note [Staging without a host wait] in
//    dist/host_staging.cpp; on shm the copy waits on the host, at the call);
//  - calls reach the backend in the order they were made, staged or not, and the group's end
//    issues those its thread still holds. A call queued so is checked by the backend when
//    issued: a refusal (a dtype, a list) reaches its wait(), and the backend counts it then
//    (a call issued at once is refused at the call: which one depends on the thread's queue);
//  - once a copy to host memory has failed on the group's thread (DeviceError: the device's
//    error, or the copy had not run within the group's timeout from its call), every later
//    call is refused with DistError: issued, it would pair with the other ranks' earlier
//    calls. A copy that cannot be queued throws at the call, and the group goes on;
//  - wait() queues the copy of its result back on the compute stream, without waiting
//    (Note [Compute-stream events] keeps the pinned block until that copy has run), so every
//    later kernel and copy sees it: read it only after wait() (is_completed() says when the
//    host side has finished);
//  - tensors on the CPU pass straight through; nothing is copied, and no thread is started
//    while nothing has been staged;
//  - the pinned blocks are cached by size, up to 1 GiB; past that a block given back is
//    freed (cudaFreeHost, which waits for the device) by the next call that stages;
//  - one caller at a time, as for any group.
#pragma once

#include <chrono>
#include <memory>

#include "dist/process_group.h"

namespace nanoddp::dist {

// Returns group with CUDA-tensor staging in front of it (group itself if it is not a CPU
// group, or is wrapped already). Every ProcessGroup call is forwarded to group.
// timeout: the group's (InitOptions::timeout), for a wait(0) and for how long a call waits
// for its copy to host memory.
std::shared_ptr<ProcessGroup> stage_device_tensors(std::shared_ptr<ProcessGroup> group,
                                                  std::chrono::milliseconds timeout = kDefaultTimeout);

}  // namespace nanoddp::dist
