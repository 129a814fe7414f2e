// Labelled batches for the multi-rank tests: a global batch drawn from a seed, and the rows
// one rank takes of it, so that N ranks and one process see the same samples.
//
//   const Batch global = random_batch(/*seed=*/1000 + step, /*rows=*/16, /*features=*/5, /*classes=*/3);
//   const Batch mine = rows(global, 8 * rank, 8 * rank + 8);
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/random.h"
#include "core/tensor.h"
#include "nn/layers.h"

namespace nanoddp::testing {

struct Batch {
  Tensor x;  // [rows, features] float32, standard normal
  Tensor y;  // [rows] int64 labels in [0, classes)
};

// The small model of the multi-rank tests: Linear(5, 8), ReLU, Linear(8, 3), drawn from seed.
inline std::shared_ptr<nn::Sequential> make_mlp(uint64_t seed) {
  Generator gen(seed);
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Linear(5, 8, gen));
  model->add(nn::ReLU());
  model->add(nn::Linear(8, 3, gen));
  return model;
}

// fashion_mnist's default MLP: Linear(784, 256), ReLU, Linear(256, 128), ReLU, Linear(128, 10)
// (235,146 parameters, 940,584 bytes), drawn from seed as the example draws it.
inline std::shared_ptr<nn::Sequential> make_fashion_mnist_mlp(uint64_t seed = 0) {
  Generator gen(seed);
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Linear(784, 256, gen));
  model->add(nn::ReLU());
  model->add(nn::Linear(256, 128, gen));
  model->add(nn::ReLU());
  model->add(nn::Linear(128, 10, gen));
  return model;
}

inline Batch random_batch(uint64_t seed, int64_t rows, int64_t features, int classes) {
  Generator gen(seed);
  Tensor x = Tensor::randn({rows, features}, gen);
  std::vector<int64_t> labels;
  for (int64_t i = 0; i < rows; ++i) labels.push_back(static_cast<int64_t>(gen.randint(classes)));
  return {x, Tensor::from_vector(labels)};
}

// Rows [begin, end) of b.
inline Batch rows(const Batch& b, int64_t begin, int64_t end) {
  const int64_t F = b.x.size(1);
  const std::vector<float> xs = b.x.to_vector();
  const std::vector<int64_t> ys = b.y.to_int_vector();
  return {Tensor::from_vector(std::vector<float>(xs.begin() + begin * F, xs.begin() + end * F), {end - begin, F}),
          Tensor::from_vector(std::vector<int64_t>(ys.begin() + begin, ys.begin() + end))};
}

}  // namespace nanoddp::testing
