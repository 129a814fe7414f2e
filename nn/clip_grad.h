// Gradient clipping by total norm or by value: torch.nn.utils.clip_grad_norm_ and
// clip_grad_value_ (PyTorch 1.13).
//
//   loss.backward();
//   const float total = nn::clip_grad_norm_(model.parameters(), /*max_norm=*/1.0);
//   optimizer.step();
//
// Call it after backward (with DDP: after the all-reduce, so every rank clips the same
// averaged gradients by the same factor) and before step.
#pragma once

#include <vector>

#include "core/tensor.h"

namespace nanoddp::nn {

// Scales the .grad of every parameter in params (float32 tensors of any shape, any device) in
// place so that their joint norm is at most max_norm, and returns that norm as it was before
// scaling. Parameters whose .grad is undefined are skipped; with none left it returns 0.
//   total = (sum over all gradient elements of |g|^norm_type)^(1 / norm_type)
//           (norm_type = infinity: the largest |g|), summed in double precision, then
//           rounded to float32, the gradients' dtype, as PyTorch's norm is: a norm past
//           float's range (gradients [3e38, 3e38]) is inf. PyTorch 1.13 sums in float32, so
//           its sum of squares can overflow or underflow where the norm would not: gradients
//           [1.5e19, 1.5e19] give 2.12e19 here and inf there, [1e-25, 2e-25] 2.24e-25 and 0.
//           Where |g|^norm_type leaves double's range (norm_type 250 and |g| = 40, or 200
//           and 1e-3), the sum is taken over (|g| / max |g|)^norm_type instead, so finite
//           gradients keep a finite, non-zero norm (torch 1.13 returns inf or 0 there);
//   every gradient is multiplied by min(max_norm / (total + 1e-6), 1), computed in float32 as
//   PyTorch does (1 / (total + 1e-6), then times max_norm): the 1e-6 keeps the division
//   finite, so a clipped norm lands just under max_norm.
// A non-finite total (a NaN or infinite gradient, or a norm past float's range) throws
// ValueError when error_if_nonfinite is true, before any gradient changes; otherwise the
// gradients are scaled by the resulting factor (0 for an infinite total, NaN for a NaN one)
// exactly as PyTorch 1.13 does. The norm checked, clipped by and returned is the one float.
// Throws ValueError for max_norm < 0 or NaN, and for norm_type <= 0 or NaN (PyTorch accepts
// norm_type 0, a count of non-zero per-parameter norms, which nobody clips by).
// On CUDA the sums run on the device and the host reads their two totals: one wait for the
// device per call (two where the sum over |g| / max |g| runs), not one per gradient.
float clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0,
                      bool error_if_nonfinite = false);

// Clamps every element of every defined .grad in params (float32, any shape, any device) into
// [-clip_value, clip_value] in place (torch.nn.utils.clip_grad_value_): a NaN stays NaN, an
// infinity becomes the bound. The bound is float32(clip_value), as torch's clamp_ on a
// float32 gradient takes it. Throws ValueError for clip_value < 0 or NaN (torch clamps
// everything to the negative value) and for a gradient that is not float32.
void clip_grad_value_(const std::vector<Tensor>& params, double clip_value);

}  // namespace nanoddp::nn
