// The ring all-reduce written on send and recv only: the algorithm every fast all-reduce
// builds on, small enough to read in one sitting. For learning and for tests; the process
// groups' own all_reduce is what DDP uses (the shm group runs the same ring over shared
// memory, dist/ring_shm.cpp).
//
//   auto pg = dist::init_process_group();
//   Tensor t = Tensor::ones({1000});
//   dist::ring_all_reduce(*pg, t);          // t == world_size everywhere
//
// N ranks in a ring; rank r sends to r+1 and receives from r-1. The tensor is cut into N
// parts. Reduce-scatter: in N-1 steps each rank passes one part to the right and folds the
// part arriving from the left into its own, until rank r holds part r summed over all ranks.
// All-gather: in N-1 more steps the complete parts travel around once. Each rank sends
// 2(N-1) parts, 2(N-1)/N of the tensor, whatever N is (docs/ring-all-reduce.md).
#pragma once

#include <chrono>

#include "core/tensor.h"
#include "dist/process_group.h"

namespace nanoddp::dist {

// tensor: any shape, float32 or int64, CPU (Avg: float32 only); reduced in place, as
// pg.all_reduce(tensor, op)->wait() would. Collective: every rank calls it with the same
// shape. Every send and receive waits at most timeout. Throws what pg.send/recv throw
// (DistError when the backend has no point-to-point, TimeoutError), ValueError for int64 Avg.
void ring_all_reduce(ProcessGroup& pg, Tensor& tensor, ReduceOp op = ReduceOp::Sum,
                     std::chrono::milliseconds timeout = kDefaultTimeout);

}  // namespace nanoddp::dist
