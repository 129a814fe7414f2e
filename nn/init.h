// The initial values of Linear's and Conv2d's parameters, drawn as torch's reset_parameters
// draws them (torch.nn.init): with a Generator seeded as torch.manual_seed was, the same
// weights, bit for bit (Note [Torch's draws] in core/random.h).
//
//   Tensor w = nn::init::uniform({out, in}, nn::init::kaiming_uniform_bound(in), gen);
#pragma once

#include <cstdint>

#include "core/random.h"
#include "core/tensor.h"

namespace nanoddp::nn::init {

// A float32 CPU tensor of shape filled with gen.uniform(-bound, bound) in row-major order
// (torch.nn.init.uniform_(t, -bound, bound)). bound is rounded to float32 first, as torch
// casts uniform_'s limits to the tensor's dtype. Throws ValueError for bound < 0.
Tensor uniform(const Shape& shape, double bound, Generator& gen);

// The bound of torch.nn.init.kaiming_uniform_(w, a=sqrt(5)), the weight init of torch's
// Linear and Conv2d: sqrt(3) * gain / sqrt(fan_in) with gain = sqrt(2 / (1 + a^2)), in double
// as torch's Python computes it (1 / sqrt(fan_in) up to rounding). fan_in: inputs per output
// (in_features; in_channels * kernel height * kernel width). 0 for fan_in 0 (no weights).
double kaiming_uniform_bound(int64_t fan_in);

// The bias bound of torch's Linear and Conv2d: 1 / sqrt(fan_in), 0 for fan_in 0.
double bias_bound(int64_t fan_in);

}  // namespace nanoddp::nn::init
