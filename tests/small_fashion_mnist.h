// A Fashion-MNIST-shaped data set small enough for tests, so they do not need the package.
//
//   TempDir dir;  write_small_fashion_mnist(dir.path, 640, 200);
//   run({built("examples/fashion_mnist"), "--data-dir", dir.path, ...});
#pragma once

#include <string>

#include "core/random.h"
#include "core/tensor.h"
#include "data/idx.h"

namespace nanoddp::testing {

// Writes n_train / n_test random 28x28 images with labels in [0, 10) into dir, as the four
// gzipped IDX files FashionMNIST reads.
inline void write_small_fashion_mnist(const std::string& dir, int64_t n_train, int64_t n_test) {
  Generator gen(5);
  auto write = [&](const std::string& prefix, int64_t n) {
    Tensor images = Tensor::empty({n, 28, 28}, DType::UInt8);
    Tensor labels = Tensor::empty({n}, DType::UInt8);
    for (int64_t i = 0; i < images.numel(); ++i) images.data<uint8_t>()[i] = static_cast<uint8_t>(gen.randint(256));
    for (int64_t i = 0; i < n; ++i) labels.data<uint8_t>()[i] = static_cast<uint8_t>(gen.randint(10));
    data::write_idx(dir + "/" + prefix + "-images-idx3-ubyte.gz", images, true);
    data::write_idx(dir + "/" + prefix + "-labels-idx1-ubyte.gz", labels, true);
  };
  write("train", n_train);
  write("t10k", n_test);
}

}  // namespace nanoddp::testing
