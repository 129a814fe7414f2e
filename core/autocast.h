// Autocast state: whether, on this thread, matrix products compute in a 16-bit dtype
// (torch.autocast). nn::autocast (nn/autocast.h) is the guard that sets it; the ops read it.
//
//   { nn::autocast guard(DType::BFloat16);  y = linear(x, w, b); }   // y: bfloat16
//   autocast_state().enabled == false                                  // after the scope
//
// Note [Autocast]
// Under autocast, ops fall in three groups, after torch's autocast lists:
//   1. low precision: matmul, linear, conv2d. Each float32 operand (an activation or a
//      float32 master parameter) is cast to the autocast dtype by a recorded Tensor::to, so
//      backward casts its gradient back to float32 and a parameter's .grad stays float32.
//      The product sums in float32, with linear's bias, and rounds its output once: the
//      output is 16-bit (for a 1-D input too, where torch rounds the product, then the sum).
//      There is no cast cache: a weight used twice in one region is cast twice, and the two
//      uses' gradients add in float32, where torch's cache casts once and adds them in 16 bits.
//   2. float32: sum, mean, mse_loss, cross_entropy (its softmax), log_softmax, nll_loss,
//      batch_norm, layer_norm.
//      A 16-bit operand is cast up to float32 (recorded) and the output is float32. They do
//      so outside autocast too: no op here computes a reduction in 16 bits. torch's CUDA list
//      has sum, mse_loss, cross_entropy, log_softmax, nll_loss and layer_norm in float32, and
//      its batch_norm keeps the input's dtype; torch 1.13's CPU autocast returns bfloat16 from
//      sum, mean, log_softmax, layer_norm and batch_norm (so its nll_loss(log_softmax(x)) of
//      bfloat16 logits differs from cross_entropy(x) in the third digit). Here one rule holds
//      on every device.
//   3. everything else (relu, add, mul, dropout, max_pool2d, the activations) keeps its
//      input's dtype: Note [16-bit elementwise ops] in core/op_helpers.h. torch's CUDA list
//      runs softplus in float32; here it rounds its output to the input's dtype as the other
//      activations do.
// The optimizer sees float32 parameters and float32 gradients only.
#pragma once

#include "core/tensor.h"

namespace nanoddp {

struct AutocastState {
  bool enabled = false;
  DType dtype = DType::BFloat16;  // Float16 or BFloat16
};

// This thread's state (torch.is_autocast_enabled, torch.get_autocast_dtype). New threads
// start disabled, as in torch.
AutocastState autocast_state();
// Sets this thread's state; nn::autocast calls it. Throws ValueError for a dtype other than
// Float16 or BFloat16.
void set_autocast_state(AutocastState state);

// An operand of a low-precision op (Note [Autocast], group 1): t cast to the autocast dtype
// (recorded) when autocast is on and t is a float tensor of another dtype; t itself
// otherwise (undefined, int64 labels, autocast off).
Tensor autocast_operand(const Tensor& t);

}  // namespace nanoddp
