// Dropout (torch.nn.Dropout): zeroes each element with probability p while training and
// scales the rest by 1 / (1 - p); the identity in eval().
//
//   nn::Dropout drop(0.5, gen);   Tensor y = drop(x);     // model.eval() turns it off
//   Tensor z = dropout(x, 0.5, /*training=*/true, gen);
//
// Each call takes one key from its Generator (dropout_key: two draws), and element i (row-major)
// is kept when kernels::dropout_uniform(key, i) >= p (kernels/dropout_mask.h, a counter-based
// draw). The mask is computed on x's device: no host work per element and no copy, and the
// same seed gives the same mask on every device. The product is one elementwise multiply
// whose backward (dx = dy * mask) keeps the mask (4 bytes per element).
#pragma once

#include "core/random.h"
#include "core/tensor.h"
#include "nn/module.h"

namespace nanoddp {

// x: float32, float16 or bfloat16 (computed in float32, rounded once), any shape -> same
// shape and dtype (torch.nn.functional.dropout). p in [0, 1]
// (ValueError otherwise); p = 1 gives x * 0 (NaN stays NaN, as in torch). When not training,
// or p = 0, returns x itself. p is a double, as torch's Python float: the kept elements are
// multiplied by 1 / float32(1 - p), divided in float32, torch's CPU value bit for bit (10 for
// p = 0.9, where 1 / (1 - 0.9f) would give 9.99999809).
Tensor dropout(const Tensor& x, double p, bool training, Generator& gen = default_generator());

// The key of one dropout call: gen.random64(), two 32-bit draws, the high word first. The
// mask then comes from the key (kernels/dropout_mask.h), not torch's bernoulli_: the same
// seed drops other elements than torch does.
uint64_t dropout_key(Generator& gen);

namespace nn {

class Dropout : public Module {
 public:
  // gen must outlive the module. Throws ValueError unless 0 <= p <= 1.
  explicit Dropout(double p = 0.5, Generator& gen = default_generator());
  Tensor forward(const Tensor& input) override { return dropout(input, p_, is_training(), *gen_); }

 private:
  double p_;
  Generator* gen_;
};

}  // namespace nn
}  // namespace nanoddp
