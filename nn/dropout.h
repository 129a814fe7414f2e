// Dropout (torch.nn.Dropout): zeroes each element with probability p while training and
// scales the rest by 1 / (1 - p); the identity in eval().
//
//   nn::Dropout drop(0.5, gen);   Tensor y = drop(x);     // model.eval() turns it off
//   Tensor z = dropout(x, 0.5, /*training=*/true, gen);
//
// The mask is drawn from a Generator on the host, one draw per element in row-major order
// (kept when gen.uniform() >= p), then copied to x's device: the same seed gives the same
// mask on every device. Cost: n draws and a host-to-device copy of n floats per call; the
// product is one elementwise multiply whose backward (dx = dy * mask) keeps the mask
// (4 bytes per element).
#pragma once

#include "core/random.h"
#include "core/tensor.h"
#include "nn/module.h"

namespace nanoddp {

// x: float32, any shape -> same shape (torch.nn.functional.dropout). p in [0, 1]
// (ValueError otherwise); p = 1 gives x * 0 (NaN stays NaN, as in torch). When not training,
// or p = 0, returns x itself.
Tensor dropout(const Tensor& x, float p, bool training, Generator& gen = default_generator());

namespace nn {

class Dropout : public Module {
 public:
  // gen must outlive the module. Throws ValueError unless 0 <= p <= 1.
  explicit Dropout(float p = 0.5f, Generator& gen = default_generator());
  Tensor forward(const Tensor& input) override { return dropout(input, p_, is_training(), *gen_); }

 private:
  float p_;
  Generator* gen_;
};

}  // namespace nn
}  // namespace nanoddp
