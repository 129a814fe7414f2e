// Differentiable ops. Each one's forward, backward and kernels live together in
// core/ops.cpp and kernels/{cpu,cuda}; its kernel names are listed in kernels/kernel_list.inc.
//
//   Tensor h = relu(linear(x, w1, b1));                // x: [N, 784] -> [N, 256]
//   Tensor loss = cross_entropy(linear(h, w2, b2), y);  // y: [N] int64 -> []
//   loss.backward();
//
// Float inputs are float32, float16 or bfloat16 (ValueError for other dtypes), all on one
// device (DeviceError otherwise). Which dtype each op computes in and returns, inside and
// outside nn::autocast, is Note [Autocast] in core/autocast.h: matmul and linear return their
// operands' 16-bit dtype; sum, mean and the losses return float32; the elementwise ops keep
// their input's dtype. Shape errors are ShapeError with every shape in the message. NaN and
// Inf propagate as in PyTorch.
#pragma once

#include "core/tensor.h"
#include "kernels/kernels.h"

namespace nanoddp {

using kernels::Reduction;

// a: [M, K], b: [K, N] -> [M, N] (torch.matmul of two matrices). a and b share one dtype
// (ValueError otherwise, as torch); under nn::autocast both are first cast to its dtype. In 16
// bits the products are summed in float32 and the output rounded once, as torch's linear; torch
// 1.13's CPU matmul of two bfloat16 matrices stored row by row instead adds the products one
// by one in bfloat16, a few units in the last place from the exact sum.
Tensor matmul(const Tensor& a, const Tensor& b);

// input: [N, in], weight: [out, in], bias: [out] or undefined -> [N, out]
// = input · weight^T + bias (torch.nn.functional.linear). Backward skips the input gradient
// when input does not require grad (a first layer). Operands share one dtype (ValueError
// otherwise); under nn::autocast each float32 one, weight and bias included, is cast to the
// autocast dtype by a recorded Tensor::to, so their gradients come back float32.
Tensor linear(const Tensor& input, const Tensor& weight, const Tensor& bias);

// Elementwise a (op) b. Shapes equal, or b: [F] broadcast over the rows of a: [..., F]
// (the bias broadcast). Anything else throws ShapeError (we broadcast nothing else).
// dtypes: one 16-bit dtype stays; mixed float dtypes give float32 (torch's promotion; Note
// [16-bit elementwise ops] in core/op_helpers.h).
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
// a * s and a / s for a float s (torch.mul / torch.div with a Python number). On a 16-bit
// tensor the product is computed in float32 with s as given and rounded once; torch 1.13's CPU
// kernel rounds s to the tensor's dtype first (float16 1000 * 1e-7: 1.0e-4 here, 1.19e-4 there).
Tensor mul(const Tensor& a, float s);
Tensor div(const Tensor& a, float s);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, float s);
Tensor operator*(float s, const Tensor& a);
Tensor operator/(const Tensor& a, float s);

// All elements -> [] float32 (torch.sum / torch.mean with no dim); a 16-bit input is summed in
// float32, as autocast's float32 list. mean of no elements is NaN.
Tensor sum(const Tensor& a);
Tensor mean(const Tensor& a);

// max(a, 0) elementwise; relu(NaN) = NaN and relu(-0.0) = -0.0 (torch.relu).
Tensor relu(const Tensor& a);

// input, target: same shape exactly (no broadcasting: ShapeError otherwise) -> [] for
// Mean/Sum, input's shape for None (torch.nn.functional.mse_loss). float32 out; 16-bit
// operands are cast up first (autocast's float32 list).
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean);

// logits: [N, C] float32 (16-bit logits are cast up first: the softmax runs in float32),
// target: [N] int64 class indices in [0, C) or ignore_index -> [] float32 for Mean/Sum, [N]
// for None (torch.nn.functional.cross_entropy). A row whose target is ignore_index (torch's
// default -100, the padding label) adds nothing and gets a zero gradient (NaN where its
// logits make the softmax NaN, as torch's): 0 in None, left out of the Sum, and Mean averages
// over the other rows only (NaN when there are none, as torch). label_smoothing s mixes the
// one-hot target with the uniform distribution (torch's label_smoothing): a counted row's loss is
// (1 - s) * -log p[target] + s / C * sum_c -log p[c]. weight, when defined, is [C] float32 on
// logits' device (torch's weight, for unbalanced classes): row r's terms are scaled by
// weight[target[r]] (and each -log p[c] by weight[c]), and Mean divides by the counted rows'
// weight[target] instead of their number (a 16-bit weight is cast up, as the logits are);
// counted weights that are all 0 make that Mean NaN and the counted rows' gradients NaN, with
// label smoothing too (torch's 0 / 0). No gradient flows to weight (torch has none).
// IndexError names the first other target outside [0, C); ValueError a label_smoothing outside
// [0, 1] or a weight that is not float; ShapeError a weight that is not [C]; DeviceError a
// weight or target on another device than logits.
constexpr int64_t kDefaultIgnoreIndex = -100;
Tensor cross_entropy(const Tensor& logits, const Tensor& target, Reduction reduction = Reduction::Mean,
                     int64_t ignore_index = kDefaultIgnoreIndex, double label_smoothing = 0.0,
                     const Tensor& weight = Tensor());

// a: [N, C] -> [N, C] float32, log(softmax(a)) over each row (torch.log_softmax(a, dim) with
// dim 1 or -1, the class dimension; 16-bit input is cast up first). Stable for huge logits;
// a row holding NaN or +inf, or only -inf, is NaN (as torch's). ShapeError unless a is 2-d,
// ValueError for another dim.
Tensor log_softmax(const Tensor& a, int64_t dim);

// log_probs: [N, C] float32 (16-bit cast up), target: [N] int64 -> [] for Mean/Sum, [N] for
// None (torch.nn.functional.nll_loss): row r's loss is -weight[t] * log_probs[r, t], t =
// target[r] (weight 1 when undefined); a row whose target is ignore_index counts for nothing,
// and Mean divides by the counted rows' weight[t] (NaN when none). nll_loss(log_softmax(x, 1),
// y) is cross_entropy(x, y). Errors as cross_entropy's.
Tensor nll_loss(const Tensor& log_probs, const Tensor& target, Reduction reduction = Reduction::Mean,
                int64_t ignore_index = kDefaultIgnoreIndex, const Tensor& weight = Tensor());

// a: [N, C] -> [N] int64, index of each row's maximum (torch.argmax(a, dim=1)). Not
// differentiable. ShapeError unless a is 2-d with C >= 1 (N may be 0).
Tensor argmax(const Tensor& a);

}  // namespace nanoddp
