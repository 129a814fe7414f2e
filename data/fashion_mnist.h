// Fashion-MNIST (Zalando's 28x28 grey clothing images, 10 classes) as a Dataset.
//
//   auto train = std::make_shared<FashionMNIST>();                 // 60000 examples
//   auto test = std::make_shared<FashionMNIST>(FashionMNIST::kDefaultRoot, /*train=*/false);
//   Batch b = train->get_batch({0, 1});   // b.input: [2, 784] float32 in [0, 1], b.target: [2] int64
//
// The files are the four IDX files of the original distribution, gzipped or not; by default
// those of Debian's package dataset-fashion-mnist. Images stay in memory as uint8 (47 MB for
// the training set instead of 188 MB as float) and become float32 pixel / 255 per batch, the
// same values as torchvision's ToTensor(). Inputs come flattened to 784 features, ready for an
// MLP (torchvision gives [1, 28, 28]; flatten(1) of that is the same row).
#pragma once

#include <string>

#include "data/dataset.h"

namespace nanoddp::data {

class FashionMNIST : public Dataset {
 public:
  static constexpr const char* kDefaultRoot = "/usr/share/datasets/fashion-mnist";
  static constexpr int64_t kRows = 28;
  static constexpr int64_t kCols = 28;
  static constexpr int64_t kFeatures = kRows * kCols;  // 784
  static constexpr int64_t kClasses = 10;

  // Reads root/{train,t10k}-images-idx3-ubyte[.gz] and root/{train,t10k}-labels-idx1-ubyte[.gz]
  // (the .gz name first). Throws IOError naming the path when a file is missing (with the
  // hint `apt-get install dataset-fashion-mnist`) or corrupt (see read_idx); IOError when
  // the images are not 28x28, the two files count different examples, or a label is outside
  // [0, 10).
  explicit FashionMNIST(const std::string& root = kDefaultRoot, bool train = true);

  int64_t size() const override { return images_.size(0); }
  // -> input [784] float32 (pixel / 255), target [] int64 in [0, 10). IndexError out of range.
  Example get(int64_t index) const override;
  // indices: B -> input [B, 784] float32, target [B] int64. Gathers the B uint8 rows, then
  // converts all B * 784 bytes in one call of kernels::cpu::bytes_to_unit_float.
  Batch get_batch(const std::vector<int64_t>& indices) const override;

  const Tensor& images() const { return images_; }  // uint8 [N, 28, 28], as in the file
  const Tensor& labels() const { return labels_; }  // int64 [N]

 private:
  Tensor images_;
  Tensor labels_;
};

}  // namespace nanoddp::data
