// Exercise 2: the flat rung. Grade it: tools/exercise check flat
//
// The same result as naive.h with ONE all_reduce per step: copy every gradient into one flat
// buffer, all_reduce it, divide, copy the means back into each .grad.
//
// Hints:
//  - Make the buffer once, in the constructor: Tensor::zeros({numel}, DType::Float32, device),
//    numel the sum of the parameters' numel, device the parameters' device.
//  - flat_.slice_view(offset, param.shape()) is the slot of one parameter in the buffer: a view
//    of the same memory, so copy_ into it and out of it.
//  - Keep the same order on the way in and the way out (params_'s order).
// The grader expects, per step of its MLP: 1 all_reduce call of 228 bytes.
#pragma once

#include <cstdint>

#include "core/ops.h"
#include "examples/ladder/rung.h"

namespace nanoddp::ladder {

class FlatDataParallel : public Rung {
 public:
  FlatDataParallel(std::shared_ptr<nn::Module> model, std::shared_ptr<dist::ProcessGroup> pg,
                   std::chrono::milliseconds timeout = dist::kDefaultTimeout)
      : Rung(std::move(model), std::move(pg), timeout) {
    // TODO: make flat_.
  }

  void finish_gradient_sync() override {
    NANODDP_CHECK(false, ValueError, "exercises/flat.h: finish_gradient_sync() is not written yet");
  }

 private:
  Tensor flat_;  // [sum of the parameters' numel] float32
};

}  // namespace nanoddp::ladder
