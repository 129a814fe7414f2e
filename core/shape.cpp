#include "core/shape.h"

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
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int d = 0; d < dim_; ++d) n *= sizes_[d];
  return n;
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
