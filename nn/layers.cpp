#include "nn/layers.h"

#include <cmath>

namespace nanoddp::nn {

Linear::Linear(int64_t in_features, int64_t out_features, Generator& gen, bool with_bias) {
  NANODDP_CHECK(in_features >= 0 && out_features >= 0, ValueError, "Linear(", in_features, ", ", out_features,
                "): sizes must be >= 0");
  const float bound = in_features > 0 ? 1.0f / std::sqrt(static_cast<float>(in_features)) : 0.0f;
  auto uniform = [&](const Shape& shape) {
    Tensor t = Tensor::empty(shape);
    float* p = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = gen.uniform(-bound, bound);
    return t;
  };
  weight = register_parameter("weight", uniform({out_features, in_features}));
  if (with_bias) bias = register_parameter("bias", uniform({out_features}));
}

Tensor Linear::forward(const Tensor& input) { return linear(input, weight, bias); }

Sequential& Sequential::add(std::shared_ptr<Module> module) {
  layers_.push_back(register_module(std::to_string(layers_.size()), std::move(module)));
  return *this;
}

Tensor Sequential::forward(const Tensor& input) {
  Tensor x = input;
  for (auto& layer : layers_) x = layer->forward(x);
  return x;
}

}  // namespace nanoddp::nn
