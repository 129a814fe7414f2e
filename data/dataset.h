// Datasets: indexed collections of (input, target) examples that a DataLoader batches.
//
//   auto data = std::make_shared<TensorDataset>(inputs /*[N, 1]*/, targets /*[N, 1]*/);
//   Example e = data->get(3);                     // e.input: [1], e.target: [1]
//   Batch b = data->get_batch({0, 5, 7});         // b.input: [3, 1], b.target: [3, 1]
//
// A Dataset follows torch.utils.data.Dataset (__len__ -> size, __getitem__ -> get), plus
// get_batch: the collation that torch's default_collate does after __getitem__. A dataset
// whose rows sit in one array overrides get_batch to copy rows straight into the batch
// (TensorDataset, FashionMNIST); the default stacks get() results.
//
// Datasets live on the CPU. get and get_batch are const and must be safe to call from a
// DataLoader's prefetch thread while the training thread reads other members.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace nanoddp::data {

// One sample: input and target of any shape and dtype (a label is a [] int64 tensor).
struct Example {
  Tensor input;
  Tensor target;
};

// B samples stacked along a new first dimension: input [B, ...], target [B, ...], dense
// and contiguous (torch's default_collate of B Examples).
struct Batch {
  Tensor input;
  Tensor target;
};

class Dataset {
 public:
  virtual ~Dataset() = default;

  // Number of examples (len(dataset)).
  virtual int64_t size() const = 0;
  // Example index, 0 <= index < size(); IndexError otherwise. CPU tensors.
  virtual Example get(int64_t index) const = 0;
  // indices: B >= 1 positions -> Batch with input [B, ...input shape] and target
  // [B, ...target shape], rows in the order of indices (repeats allowed). The default calls
  // get() per index and copies each into the stacked tensors; it throws IndexError for an
  // index out of range, ValueError for an empty list, ShapeError when two examples differ in
  // shape or dtype or a stacked tensor would exceed Shape::kMaxDims dimensions.
  virtual Batch get_batch(const std::vector<int64_t>& indices) const;
};

// Examples are the rows of two tensors (torch.utils.data.TensorDataset with two tensors).
//   inputs: [N, ...], targets: [N, ...] with the same N, any dtype, on the CPU.
//   get(i) = {inputs[i], targets[i]}: shapes without the first dimension (a [N] tensor gives
//   [] rows). get_batch copies whole rows with memcpy.
// Throws ShapeError when a tensor has no dimensions or the first dimensions differ, and
// DeviceError when a tensor is not on the CPU. The tensors are shared, not copied.
class TensorDataset : public Dataset {
 public:
  TensorDataset(Tensor inputs, Tensor targets);

  int64_t size() const override { return size_; }
  Example get(int64_t index) const override;
  Batch get_batch(const std::vector<int64_t>& indices) const override;

  const Tensor& inputs() const { return inputs_; }
  const Tensor& targets() const { return targets_; }

 private:
  Tensor inputs_;
  Tensor targets_;
  int64_t size_;
};

namespace detail {

// Copies rows of a [N, ...] CPU tensor: out[b] = rows[indices[b]] for every b. out is
// [B, ...] with rows' dtype. Checks each index against N (IndexError naming what).
// Shared by the datasets whose examples are rows of one array.
Tensor gather_rows(const Tensor& rows, const std::vector<int64_t>& indices, const char* what);

// Shape of one row of a [N, ...] tensor: [...] (a [N] tensor gives []).
Shape row_shape(const Shape& shape);
// [B, ...row]; ShapeError when that exceeds Shape::kMaxDims dimensions.
Shape stacked_shape(int64_t B, const Shape& row);

}  // namespace detail
}  // namespace nanoddp::data
