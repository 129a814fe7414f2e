// LayerNorm (torch.nn.LayerNorm): normalises each sample over its last dimensions.
//
//   nn::LayerNorm norm({256});                    // x: [N, 256] -> [N, 256]
//   Tensor y = layer_norm(x, {256}, weight, bias);
//
// Cost, for R rows of D = numel(normalized_shape) elements: forward ~8 R D FLOPs and two
// passes over x, backward ~12 R D FLOPs; keeps x and the per-row mean and 1/std (2 R floats).
#pragma once

#include <vector>

#include "core/tensor.h"
#include "nn/module.h"

namespace nanoddp {

// input: [..., *normalized_shape], weight and bias: normalized_shape or undefined
// -> input's shape: y = (x - mean) / sqrt(var + eps) * weight + bias, with the mean and the
// biased variance over the last normalized_shape.size() dimensions (torch.nn.functional.
// layer_norm). NaN or inf in a row makes that row NaN. ShapeError when input does not end
// in normalized_shape or weight/bias are another shape; ValueError for an empty
// normalized_shape or eps < 0.
Tensor layer_norm(const Tensor& input, const std::vector<int64_t>& normalized_shape, const Tensor& weight,
                  const Tensor& bias, float eps = 1e-5f);

namespace nn {

// layer_norm with learnable weight (ones) and bias (zeros) when elementwise_affine, as torch.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(std::vector<int64_t> normalized_shape, float eps = 1e-5f, bool elementwise_affine = true);
  Tensor forward(const Tensor& input) override { return layer_norm(input, normalized_shape_, weight, bias, eps_); }
  Tensor weight;  // undefined without elementwise_affine
  Tensor bias;

 private:
  std::vector<int64_t> normalized_shape_;
  float eps_;
};

}  // namespace nn
}  // namespace nanoddp
