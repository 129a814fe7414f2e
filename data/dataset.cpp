#include "data/dataset.h"

#include <cstring>

#include "core/error.h"

namespace nanoddp::data {

namespace detail {

Shape row_shape(const Shape& shape) {
  NANODDP_ASSERT(shape.dim() >= 1);
  std::vector<int64_t> sizes = shape.sizes();
  sizes.erase(sizes.begin());
  return Shape(sizes);
}

Shape stacked_shape(int64_t B, const Shape& row) {
  NANODDP_CHECK(row.dim() + 1 <= Shape::kMaxDims, ShapeError, "cannot stack examples of shape ", row,
                " into a batch: a tensor has at most ", Shape::kMaxDims, " dimensions");
  std::vector<int64_t> sizes = row.sizes();
  sizes.insert(sizes.begin(), B);
  return Shape(sizes);
}

Tensor gather_rows(const Tensor& rows, const std::vector<int64_t>& indices, const char* what) {
  const int64_t N = rows.shape()[0];
  const auto B = static_cast<int64_t>(indices.size());
  Tensor out = Tensor::empty(stacked_shape(B, row_shape(rows.shape())), rows.dtype());
  const size_t row_nbytes = N == 0 ? 0 : rows.nbytes() / static_cast<size_t>(N);
  const auto* src = static_cast<const uint8_t*>(rows.impl()->storage->data());
  auto* dst = static_cast<uint8_t*>(out.impl()->storage->data());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t i = indices[b];
    NANODDP_CHECK(i >= 0 && i < N, IndexError, what, ": index ", i, " is out of range for ", N, " examples");
    if (row_nbytes > 0) std::memcpy(dst + b * row_nbytes, src + i * row_nbytes, row_nbytes);
  }
  return out;
}

}  // namespace detail

Batch Dataset::get_batch(const std::vector<int64_t>& indices) const {
  NANODDP_CHECK(!indices.empty(), ValueError, "get_batch: no indices");
  const auto B = static_cast<int64_t>(indices.size());
  Batch batch;
  Example first;
  for (int64_t b = 0; b < B; ++b) {
    Example e = get(indices[b]);
    NANODDP_CHECK(e.input.defined() && e.target.defined(), ValueError, "get_batch: example ", indices[b],
                  " has an undefined ", e.input.defined() ? "target" : "input",
                  ": the dataset's get() must return defined tensors");
    if (b == 0) {
      first = e;
      batch.input = Tensor::empty(detail::stacked_shape(B, e.input.shape()), e.input.dtype());
      batch.target = Tensor::empty(detail::stacked_shape(B, e.target.shape()), e.target.dtype());
    }
    NANODDP_CHECK(e.input.shape() == first.input.shape() && e.input.dtype() == first.input.dtype() &&
                      e.target.shape() == first.target.shape() && e.target.dtype() == first.target.dtype(),
                  ShapeError, "get_batch: example ", indices[b], " has input ", e.input.shape(), " ",
                  e.input.dtype(), " and target ", e.target.shape(), " ", e.target.dtype(), ", but example ",
                  indices[0], " has input ", first.input.shape(), " ", first.input.dtype(), " and target ",
                  first.target.shape(), " ", first.target.dtype());
    // Examples may come from anywhere (a user's get()); bring them to the host first.
    const Tensor input = e.input.to(Device::cpu());
    const Tensor target = e.target.to(Device::cpu());
    std::memcpy(static_cast<uint8_t*>(batch.input.impl()->storage->data()) + b * input.nbytes(),
                input.impl()->storage->data(), input.nbytes());
    std::memcpy(static_cast<uint8_t*>(batch.target.impl()->storage->data()) + b * target.nbytes(),
                target.impl()->storage->data(), target.nbytes());
  }
  return batch;
}

TensorDataset::TensorDataset(Tensor inputs, Tensor targets)
    : inputs_(std::move(inputs)), targets_(std::move(targets)) {
  NANODDP_CHECK(inputs_.defined() && targets_.defined(), ValueError,
                "TensorDataset: inputs and targets must be defined tensors");
  NANODDP_CHECK(inputs_.dim() >= 1 && targets_.dim() >= 1, ShapeError, "TensorDataset: inputs ",
                inputs_.shape(), " and targets ", targets_.shape(),
                " need a first dimension (the example index)");
  NANODDP_CHECK(inputs_.shape()[0] == targets_.shape()[0], ShapeError, "TensorDataset: inputs ",
                inputs_.shape(), " and targets ", targets_.shape(), " differ in their first dimension");
  NANODDP_CHECK(inputs_.device().is_cpu() && targets_.device().is_cpu(), DeviceError,
                "TensorDataset: inputs on ", inputs_.device(), " and targets on ", targets_.device(),
                ": datasets live on the CPU (the DataLoader moves batches to the device)");
  size_ = inputs_.shape()[0];
}

Example TensorDataset::get(int64_t index) const {
  NANODDP_CHECK(index >= 0 && index < size_, IndexError, "TensorDataset: index ", index,
                " is out of range for ", size_, " examples");
  auto row = [index](const Tensor& rows) {
    Tensor out = Tensor::empty(detail::row_shape(rows.shape()), rows.dtype());
    const size_t row_nbytes = out.nbytes();
    if (row_nbytes > 0)
      std::memcpy(out.impl()->storage->data(),
                  static_cast<const uint8_t*>(rows.impl()->storage->data()) + index * row_nbytes, row_nbytes);
    return out;
  };
  return {row(inputs_), row(targets_)};
}

Batch TensorDataset::get_batch(const std::vector<int64_t>& indices) const {
  NANODDP_CHECK(!indices.empty(), ValueError, "TensorDataset::get_batch: no indices");
  return {detail::gather_rows(inputs_, indices, "TensorDataset"),
          detail::gather_rows(targets_, indices, "TensorDataset")};
}

}  // namespace nanoddp::data
