// Numbers the host holds (counts, losses, timings, DDP's parameter signatures), reduced or
// gathered across ranks through any group, including one whose collectives take GPU tensors.
//
//   auto totals = dist::all_reduce_host(*pg, std::vector<int64_t>{correct, seen}, dist::ReduceOp::Sum);
//   auto slowest = dist::all_reduce_host(*pg, std::vector<float>{seconds}, dist::ReduceOp::Max);
//   std::vector<std::vector<int64_t>> per_rank = dist::all_gather_host(*pg, {parameter_count});
//
// Each call builds its tensor on pg.device() (NCCL refuses host tensors), runs the collective,
// waits for it (up to timeout) and copies the result back to the host. Collective: every rank
// calls it in the same order with the same number of values. Throws what the collective
// throws (DistError, TimeoutError; ValueError for an int64 Avg).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "dist/process_group.h"

namespace nanoddp::dist {

// values: n numbers, reduced element-wise over ranks (torch.distributed.all_reduce of a tensor
// built from them); returns the n results.
std::vector<float> all_reduce_host(ProcessGroup& pg, const std::vector<float>& values, ReduceOp op,
                                   std::chrono::milliseconds timeout = kDefaultTimeout);
std::vector<int64_t> all_reduce_host(ProcessGroup& pg, const std::vector<int64_t>& values, ReduceOp op,
                                     std::chrono::milliseconds timeout = kDefaultTimeout);

// values: n numbers on every rank; returns pg.size() vectors, [r] holding rank r's values
// (torch.distributed.all_gather).
std::vector<std::vector<int64_t>> all_gather_host(ProcessGroup& pg, const std::vector<int64_t>& values,
                                                  std::chrono::milliseconds timeout = kDefaultTimeout);

// Every rank says whether a step failed on it; returns the ranks where it did, as "1, 3" (""
// when none). For a step every rank must pass before any acts on it: ZeroRedundancyOptimizer.
// load_state_dict and FullyShardedDataParallel.load_full_state_dict load only when it is "".
std::string ranks_that_failed(ProcessGroup& pg, bool failed_here,
                              std::chrono::milliseconds timeout = kDefaultTimeout);

}  // namespace nanoddp::dist
