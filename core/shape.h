// Shape: the sizes of a dense row-major tensor, up to kMaxDims dimensions.
//
//   Shape s{64, 784};   s.numel() == 50176;   s[1] == 784;   s.str() == "[64, 784]"
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <string>
#include <vector>

namespace nanoddp {

class Shape {
 public:
  static constexpr int kMaxDims = 4;

  Shape() = default;  // zero dimensions: a scalar with numel() == 1
  // Throws ShapeError on more than kMaxDims dimensions, a negative size, or nonzero sizes
  // whose product does not fit in int64: torch.empty refuses such a count too, but accepts it
  // beside a zero size ([0, 2^62, 2^62]), which is refused here, since kernels use the
  // partial products (a row, a plane) as element counts.
  Shape(std::initializer_list<int64_t> sizes);
  explicit Shape(const std::vector<int64_t>& sizes);

  int dim() const { return dim_; }
  int64_t operator[](int d) const { return sizes_[d]; }
  int64_t numel() const { return numel_; }  // the product of the sizes, computed (and checked) once
  std::vector<int64_t> sizes() const { return {sizes_.begin(), sizes_.begin() + dim_}; }
  std::string str() const;  // "[2, 3]"; a scalar prints "[]"

  bool operator==(const Shape& other) const;
  bool operator!=(const Shape& other) const { return !(*this == other); }

 private:
  std::array<int64_t, kMaxDims> sizes_{};
  int dim_ = 0;
  int64_t numel_ = 1;
};

// a * b for element and byte counts (a, b >= 0). Throws ShapeError "<what>: a x b does not
// fit in int64" instead of wrapping around.
int64_t checked_mul(int64_t a, int64_t b, const char* what);

std::ostream& operator<<(std::ostream& out, const Shape& shape);

}  // namespace nanoddp
