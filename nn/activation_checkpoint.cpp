// nn::checkpoint: argument checks around the engine's checkpointed regions (core/autograd).
#include "nn/activation_checkpoint.h"

#include "core/autograd.h"

namespace nanoddp::nn {

std::vector<Tensor> checkpoint(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn,
                               const std::vector<Tensor>& inputs) {
  NANODDP_CHECK(static_cast<bool>(fn), ValueError, "checkpoint: fn is empty");
  return run_checkpointed(fn, inputs);
}

Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& input) {
  NANODDP_CHECK(static_cast<bool>(fn), ValueError, "checkpoint: fn is empty");
  const std::vector<Tensor> outputs =
      run_checkpointed([fn](const std::vector<Tensor>& in) { return std::vector<Tensor>{fn(in[0])}; }, {input});
  return outputs[0];
}

}  // namespace nanoddp::nn
