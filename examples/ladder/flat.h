// Rung 2, flat: after backward, copy every gradient into one flat buffer, one all_reduce of
// it, copy the means back.
//
// Fixes (from naive.h): one collective per step instead of one per parameter, so a step pays
// one latency, and the ring moves one large message at full bandwidth instead of many small
// ones (a 40-byte bias costs about what a megabyte does).
// Still gets wrong: it starts only when backward has ended, so none of the communication is
// hidden behind computation; and the buffer is a second copy of every gradient (4 bytes per
// parameter), plus two copies per step.
// Next rung (overlap.h): start each gradient's all_reduce as soon as backward has produced it.
//
// Per step: 1 all_reduce call of 4 bytes per parameter element.
#pragma once

#include <cstdint>

#include "core/memory.h"
#include "core/ops.h"
#include "examples/ladder/rung.h"

namespace nanoddp::ladder {

class FlatDataParallel : public Rung {
 public:
  FlatDataParallel(std::shared_ptr<nn::Module> model, std::shared_ptr<dist::ProcessGroup> pg,
                   std::chrono::milliseconds timeout = dist::kDefaultTimeout)
      : Rung(std::move(model), std::move(pg), timeout) {
    int64_t numel = 0;
    for (auto& [name, param] : params_) numel += param.numel();
    // Made once: a buffer per step would cost an allocation as large as the model.
    flat_ = Tensor::zeros({numel}, DType::Float32, params_.front().second.device());
    set_memory_category(flat_, MemoryCategory::CommBuffers);  // counted as DDP's buckets are
  }

  void finish_gradient_sync() override {
    NoGradGuard no_grad;
    int64_t offset = 0;
    for (auto& [name, param] : params_) {
      flat_.slice_view(offset, param.shape()).copy_(grad_of(name, param));
      offset += param.numel();
    }
    const double begin_us = trace_now();
    pg_->all_reduce(flat_, dist::ReduceOp::Sum)->wait(timeout_);
    trace_all_reduce(0, "of every gradient", begin_us);
    flat_.copy_(flat_ * (1.0f / static_cast<float>(pg_->size())));
    offset = 0;
    for (auto& [name, param] : params_) {
      param.grad().copy_(flat_.slice_view(offset, param.shape()));
      offset += param.numel();
    }
  }

 private:
  Tensor flat_;  // [sum of the parameters' numel] float32
};

}  // namespace nanoddp::ladder
