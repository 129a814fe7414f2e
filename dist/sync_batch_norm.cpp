#include "dist/sync_batch_norm.h"

namespace nanoddp::dist {

SyncBatchNorm::SyncBatchNorm(int64_t num_features, std::shared_ptr<ProcessGroup> pg, float eps,
                             std::optional<float> momentum, bool affine, bool track_running_stats)
    : nn::BatchNorm1d(num_features, eps, momentum, affine, track_running_stats) {
  NANODDP_CHECK(pg != nullptr, ValueError, "SyncBatchNorm needs a process group");
  set_stats_all_reduce(std::make_shared<ProcessGroupStatsAllReduce>(std::move(pg)));
}

std::shared_ptr<nn::Module> convert_sync_batchnorm(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> pg) {
  NANODDP_CHECK(module != nullptr && pg != nullptr, ValueError, "convert_sync_batchnorm needs a module and a process group");
  auto all_reduce = std::make_shared<ProcessGroupStatsAllReduce>(std::move(pg));
  for (auto& [name, m] : module->named_modules())
    if (auto* norm = dynamic_cast<nn::BatchNorm1d*>(m)) norm->set_stats_all_reduce(all_reduce);
  return module;
}

}  // namespace nanoddp::dist
