// Mixed precision for a region of code, as torch.autocast: inside the guard, matmul, linear
// and conv2d compute in 16 bits with float32 sums; reductions, losses and normalisations in
// float32; parameters and their gradients stay float32 (Note [Autocast] in core/autocast.h).
//
//   Tensor logits;
//   { nn::autocast guard(DType::BFloat16);  logits = model(x); }        // logits: bfloat16
//   Tensor loss = cross_entropy(logits, y);  loss.backward();          // loss, .grad: float32
//
// Guards nest: each one sets this thread's state and its destructor restores the state it
// found, so nn::autocast off(DType::BFloat16, false) inside another runs a region in float32
// (torch.autocast(enabled=False)). The state is per thread, as torch's. Backward runs outside
// the guard, as torch recommends; a checkpointed region recomputes under the state its
// forward ran with. float16 overflows past 65504: scale the loss with dist::GradScaler;
// bfloat16 has float32's range and needs no scaler (docs/mixed-precision.md).
#pragma once

#include "core/autocast.h"

namespace nanoddp::nn {

class autocast {
 public:
  // dtype: DType::BFloat16 or DType::Float16 (ValueError otherwise, even when disabled).
  explicit autocast(DType dtype = DType::BFloat16, bool enabled = true);
  ~autocast();
  autocast(const autocast&) = delete;
  autocast& operator=(const autocast&) = delete;

 private:
  AutocastState previous_;
};

}  // namespace nanoddp::nn
