#include "nn/layers.h"

#include <algorithm>
#include <cmath>

#include "nn/activation_checkpoint.h"
#include "nn/init.h"

namespace nanoddp::nn {

Linear::Linear(int64_t in_features, int64_t out_features, Generator& gen, bool with_bias) {
  NANODDP_CHECK(in_features >= 0 && out_features >= 0, ValueError, "Linear(", in_features, ", ", out_features,
                "): sizes must be >= 0");
  // torch.nn.Linear.reset_parameters: the weight (row-major), then the bias.
  weight = register_parameter(
      "weight", init::uniform({out_features, in_features}, init::kaiming_uniform_bound(in_features), gen));
  if (with_bias)
    bias = register_parameter("bias", init::uniform({out_features}, init::bias_bound(in_features), gen));
}

Tensor Linear::forward(const Tensor& input) { return linear(input, weight, bias); }

Tensor Flatten::forward(const Tensor& input) {
  const int dims = std::max(input.dim(), 1);  // a 0-dim tensor flattens to [1], as in torch
  const int start = start_dim_ < 0 ? start_dim_ + dims : start_dim_;
  const int end = end_dim_ < 0 ? end_dim_ + dims : end_dim_;
  NANODDP_CHECK(start >= 0 && end < dims && start <= end, IndexError, "Flatten(", start_dim_, ", ", end_dim_,
                "): dims out of range (or start after end) for input ", input.shape());
  std::vector<int64_t> sizes;
  int64_t merged = 1;
  for (int d = 0; d < input.dim(); ++d) {
    if (d < start || d > end) {
      sizes.push_back(input.size(d));
      continue;
    }
    merged *= input.size(d);
    if (d == end) sizes.push_back(merged);
  }
  if (input.dim() == 0) sizes = {1};
  return input.reshape(sizes);
}

Sequential& Sequential::add(std::shared_ptr<Module> module) {
  register_module(std::to_string(size()), std::move(module));
  return *this;
}

Sequential& Sequential::checkpoint_blocks(std::vector<size_t> starts) {
  for (size_t k = 0; k < starts.size(); ++k) {
    NANODDP_CHECK(starts[k] < size(), ValueError, "Sequential::checkpoint_blocks: start ", starts[k],
                  " is not a child index (the Sequential has ", size(), " children)");
    NANODDP_CHECK(k == 0 || starts[k] > starts[k - 1], ValueError,
                  "Sequential::checkpoint_blocks: starts must increase, got ", starts[k - 1], " then ", starts[k]);
  }
  checkpoint_starts_ = std::move(starts);
  return *this;
}

Module& Sequential::operator[](int64_t index) {
  const auto& layers = named_children();
  const auto n = static_cast<int64_t>(layers.size());
  NANODDP_CHECK(index >= -n && index < n, IndexError, "Sequential: index ", index, " is out of range (", n,
                n == 1 ? " module)" : " modules)");
  return *layers[static_cast<size_t>(index < 0 ? index + n : index)].second;
}

Tensor Sequential::forward(const Tensor& input) {
  const auto& layers = named_children();
  Tensor x = input;
  const size_t plain = checkpoint_starts_.empty() ? layers.size() : checkpoint_starts_[0];
  for (size_t i = 0; i < plain; ++i) x = (*layers[i].second)(x);
  for (size_t k = 0; k < checkpoint_starts_.size(); ++k) {
    const size_t begin = checkpoint_starts_[k];
    const size_t end = k + 1 < checkpoint_starts_.size() ? checkpoint_starts_[k + 1] : layers.size();
    // The block's layers are held by value: the rerun happens in backward.
    std::vector<std::shared_ptr<Module>> block;
    for (size_t i = begin; i < end; ++i) block.push_back(layers[i].second);
    x = checkpoint(
        [block](const Tensor& h) {
          Tensor y = h;
          for (auto& layer : block) y = (*layer)(y);
          return y;
        },
        x);
  }
  return x;
}

}  // namespace nanoddp::nn
