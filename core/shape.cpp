#include "core/shape.h"

#include <algorithm>

#include "core/error.h"

namespace nanoddp {

Shape::Shape(std::initializer_list<int64_t> sizes) : Shape(std::vector<int64_t>(sizes)) {}

Shape::Shape(const std::vector<int64_t>& sizes) {
  NANODDP_CHECK(sizes.size() <= static_cast<size_t>(kMaxDims), ShapeError, "a shape has at most ",
                kMaxDims, " dimensions, got ", sizes.size());
  for (size_t d = 0; d < sizes.size(); ++d) {
    NANODDP_CHECK(sizes[d] >= 0, ShapeError, "negative size ", sizes[d], " in dimension ", d);
    sizes_[d] = sizes[d];
  }
  dim_ = static_cast<int>(sizes.size());
  // A zero anywhere makes the product 0, but the other sizes must still multiply without
  // wrapping: every partial product (a row, a plane) is an element count some kernel uses.
  int64_t nonzero = 1;
  for (int d = 0; d < dim_; ++d)
    if (sizes_[d] != 0) {
      NANODDP_CHECK(!__builtin_mul_overflow(nonzero, sizes_[d], &nonzero), ShapeError, "shape ", str(),
                    " has more elements than int64 can count");
    }
  numel_ = std::find(sizes.begin(), sizes.end(), 0) != sizes.end() ? 0 : nonzero;
}

int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t product = 0;
  NANODDP_CHECK(a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, &product), ShapeError, what, ": ", a, " x ",
                b, " does not fit in int64");
  return product;
}

std::string Shape::str() const {
  std::string text = "[";
  for (int d = 0; d < dim_; ++d) {
    if (d > 0) text += ", ";
    text += std::to_string(sizes_[d]);
  }
  return text + "]";
}

bool Shape::operator==(const Shape& other) const {
  if (dim_ != other.dim_) return false;
  for (int d = 0; d < dim_; ++d)
    if (sizes_[d] != other.sizes_[d]) return false;
  return true;
}

std::ostream& operator<<(std::ostream& out, const Shape& shape) { return out << shape.str(); }

}  // namespace nanoddp
