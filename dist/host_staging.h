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
//    memory when the collective is issued, after every kernel queued before it (the copy
//    waits for the device's compute stream: one host sync per tensor copied in, so one per
//    collective but reduce_scatter, which copies each input); wait() queues the
//    copy of its result back on the compute stream, without waiting (Note [Compute-stream
//    events] keeps the pinned block until that copy has run), so every later kernel and copy
//    sees it: read it only after wait() (is_completed() says when the host side has finished);
//  - tensors on the CPU pass straight through; nothing is copied.
#pragma once

#include <memory>

#include "dist/process_group.h"

namespace nanoddp::dist {

// Returns group with CUDA-tensor staging in front of it (group itself if it is not a CPU
// group, or is wrapped already). Every ProcessGroup call is forwarded to group.
std::shared_ptr<ProcessGroup> stage_device_tensors(std::shared_ptr<ProcessGroup> group);

}  // namespace nanoddp::dist
