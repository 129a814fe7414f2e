// CPU kernels of Conv2d and MaxPool2d (declared in nn/conv.cpp): im2col / col2im around
// Eigen's GEMM, the per-channel bias, and max pooling. Loops run in memory order.
//
// im2col and col2im come twice: the *_reference loops test every element's bounds and take
// any window; for stride_w == 1 (the usual convolution) im2col / col2im have no bounds to test:
// a row of the window is one contiguous run of a zero-bordered copy of the plane (Note [Padded
// planes]), copied or added at once. The same values and, per pixel, the same order of
// additions: tests/test_ops.cpp checks both paths are equal bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/eigen_maps.h"
#include "kernels/cpu/conv.h"
#include "kernels/cpu/double_sums.h"
#include "kernels/kernels.h"
#include "kernels/pool_window.h"

namespace nanoddp::kernels::cpu {

void im2col_reference(float* cols, const float* images, int64_t N, Window2d g) {
  const int64_t OHW = g.out_h * g.out_w, image = g.channels * g.height * g.width;
  for (int64_t c = 0; c < g.channels; ++c)
    for (int64_t i = 0; i < g.kernel_h; ++i)
      for (int64_t j = 0; j < g.kernel_w; ++j) {
        float* row = cols + ((c * g.kernel_h + i) * g.kernel_w + j) * N * OHW;
        for (int64_t n = 0; n < N; ++n) {
          const float* plane = images + n * image + c * g.height * g.width;
          for (int64_t oh = 0; oh < g.out_h; ++oh) {
            const int64_t h = oh * g.stride_h - g.pad_h + i * g.dilation_h;
            float* out = row + n * OHW + oh * g.out_w;
            if (h < 0 || h >= g.height) {
              std::fill(out, out + g.out_w, 0.0f);
              continue;
            }
            for (int64_t ow = 0; ow < g.out_w; ++ow) {
              const int64_t w = ow * g.stride_w - g.pad_w + j * g.dilation_w;
              out[ow] = w >= 0 && w < g.width ? plane[h * g.width + w] : 0.0f;
            }
          }
        }
      }
}

void col2im_reference(float* dimages, const float* dcols, int64_t N, Window2d g) {
  const int64_t OHW = g.out_h * g.out_w, image = g.channels * g.height * g.width;
  std::fill(dimages, dimages + N * image, 0.0f);
  for (int64_t c = 0; c < g.channels; ++c)
    for (int64_t i = 0; i < g.kernel_h; ++i)
      for (int64_t j = 0; j < g.kernel_w; ++j) {
        const float* row = dcols + ((c * g.kernel_h + i) * g.kernel_w + j) * N * OHW;
        for (int64_t n = 0; n < N; ++n) {
          float* plane = dimages + n * image + c * g.height * g.width;
          for (int64_t oh = 0; oh < g.out_h; ++oh) {
            const int64_t h = oh * g.stride_h - g.pad_h + i * g.dilation_h;
            if (h < 0 || h >= g.height) continue;
            const float* in = row + n * OHW + oh * g.out_w;
            for (int64_t ow = 0; ow < g.out_w; ++ow) {
              const int64_t w = ow * g.stride_w - g.pad_w + j * g.dilation_w;
              if (w >= 0 && w < g.width) plane[h * g.width + w] += in[ow];
            }
          }
        }
      }
}

namespace {

// 8 floats (GCC's and Clang's vector extensions: one AVX register with -mavx2, two SSE ones
// without).
using Floats8 = float __attribute__((vector_size(32)));
using Ints8 = int32_t __attribute__((vector_size(32)));

// The runs are short (11 floats in the example's second convolution, 3168 of them per image;
// 8 in an 8 x 8 image with padding 1): std::copy called memmove for each, and a plain loop is
// versioned for aliasing or turned into that call, all costing more than the run. Here a run
// moves as fixed-size pieces that the compiler keeps in registers: 8 floats at a time as one
// unaligned vector, the last piece overlapping the one before (the same values written
// twice); under 8 floats, two overlapping pieces of 4, 2 or 1.
inline void copy_run(float* __restrict out, const float* __restrict in, int64_t n) {
  if (n >= 8) {
    for (int64_t k = 0; k + 8 <= n; k += 8) std::memcpy(out + k, in + k, sizeof(Floats8));
    std::memcpy(out + n - 8, in + n - 8, sizeof(Floats8));
  } else if (n >= 4) {
    std::memcpy(out, in, 4 * sizeof(float));
    std::memcpy(out + n - 4, in + n - 4, 4 * sizeof(float));
  } else if (n >= 2) {
    std::memcpy(out, in, 2 * sizeof(float));
    std::memcpy(out + n - 2, in + n - 2, 2 * sizeof(float));
  } else if (n == 1) {
    out[0] = in[0];
  }
}

inline void add_run(float* __restrict out, const float* __restrict in, int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    Floats8 sum, addend;
    std::memcpy(&sum, out + k, sizeof sum);
    std::memcpy(&addend, in + k, sizeof addend);
    sum += addend;
    std::memcpy(out + k, &sum, sizeof sum);
  }
  for (; k < n; ++k) out[k] += in[k];
}

}  // namespace

// Note [Padded planes]
// For stride_w == 1, im2col copies each input plane once into a plane with a border of zeros,
// (H + 2 ph) x (W + 2 pw) floats that stay in cache, and then takes every row of every window
// as one run of OW floats from it: no bounds, no zeros written between runs. In an 8 x 8 image
// with padding 1 the runs would otherwise be 7 floats between single zeros, and the work per
// run cost more than its data (on Conv2d(16, 16, 3, padding 1) over [64, 16, 8, 8], im2col and
// the memset and memmove calls it made were 41% of forward + backward). col2im adds into such a
// plane and copies its inside out. Without padding the plane is the input (or dimages) itself.
// Each pixel receives its additions in the same (i, j) order as in col2im_reference (for
// stride_w 1 a window row reaches a pixel at most once), so the sums have the same bits.
namespace {

struct PaddedPlane {
  int64_t width = 0;          // W + 2 pw
  std::vector<float> values;  // (H + 2 ph) x width; empty without padding
  explicit PaddedPlane(const Window2d& g) : width(g.width + 2 * g.pad_w) {
    if (g.pad_h > 0 || g.pad_w > 0) values.assign((g.height + 2 * g.pad_h) * width, 0.0f);
  }
  // Whether the plane is worth its memory. Padding far past what a window needs (a 3 x 3
  // kernel dilated by d and padded by d gives a 4 x 4 image a 4 x 4 output for any d) would
  // make it (4 + 2d)^2 floats, 68 GB at d = 65536: the reference loops, which test each
  // position, run instead.
  static bool pays(const Window2d& g) {
    const double area =
        static_cast<double>(g.height + 2 * g.pad_h) * static_cast<double>(g.width + 2 * g.pad_w);
    return area <= std::max(4.0 * static_cast<double>(g.height * g.width), 65536.0);
  }
  bool used() const { return !values.empty(); }
  float* inside(const Window2d& g) { return values.data() + g.pad_h * width + g.pad_w; }
};

}  // namespace

void im2col(float* cols, const float* images, int64_t N, Window2d g) {
  if (g.stride_w != 1 || !PaddedPlane::pays(g)) return im2col_reference(cols, images, N, g);
  const int64_t OHW = g.out_h * g.out_w, plane_size = g.height * g.width, image = g.channels * plane_size;
  PaddedPlane padded(g);  // its border stays zero: only the inside is written
  for (int64_t c = 0; c < g.channels; ++c)
    for (int64_t n = 0; n < N; ++n) {
      const float* plane = images + n * image + c * plane_size;
      const float* source = plane;
      int64_t source_width = g.width;
      if (padded.used()) {
        for (int64_t h = 0; h < g.height; ++h) copy_run(padded.inside(g) + h * padded.width, plane + h * g.width, g.width);
        source = padded.values.data();
        source_width = padded.width;
      }
      for (int64_t i = 0; i < g.kernel_h; ++i)
        for (int64_t j = 0; j < g.kernel_w; ++j) {
          float* out = cols + ((c * g.kernel_h + i) * g.kernel_w + j) * N * OHW + n * OHW;
          const float* in = source + i * g.dilation_h * source_width + j * g.dilation_w;
          for (int64_t oh = 0; oh < g.out_h; ++oh)
            copy_run(out + oh * g.out_w, in + oh * g.stride_h * source_width, g.out_w);
        }
    }
}

void col2im(float* dimages, const float* dcols, int64_t N, Window2d g) {
  if (g.stride_w != 1 || !PaddedPlane::pays(g)) return col2im_reference(dimages, dcols, N, g);
  const int64_t OHW = g.out_h * g.out_w, plane_size = g.height * g.width, image = g.channels * plane_size;
  PaddedPlane padded(g);
  for (int64_t c = 0; c < g.channels; ++c)
    for (int64_t n = 0; n < N; ++n) {
      float* plane = dimages + n * image + c * plane_size;
      float* sums = padded.used() ? padded.values.data() : plane;
      const int64_t sums_width = padded.used() ? padded.width : g.width;
      if (padded.used()) {
        std::fill(padded.values.begin(), padded.values.end(), 0.0f);
      } else {
        std::fill(plane, plane + plane_size, 0.0f);
      }
      for (int64_t i = 0; i < g.kernel_h; ++i)
        for (int64_t j = 0; j < g.kernel_w; ++j) {
          const float* in = dcols + ((c * g.kernel_h + i) * g.kernel_w + j) * N * OHW + n * OHW;
          float* out = sums + i * g.dilation_h * sums_width + j * g.dilation_w;
          for (int64_t oh = 0; oh < g.out_h; ++oh) add_run(out + oh * g.stride_h * sums_width, in + oh * g.out_w, g.out_w);
        }
      if (padded.used())
        for (int64_t h = 0; h < g.height; ++h) copy_run(plane + h * g.width, padded.inside(g) + h * padded.width, g.width);
    }
}

void swap_leading_dims(float* out, const float* in, int64_t A, int64_t B, int64_t C) {
  for (int64_t a = 0; a < A; ++a)
    for (int64_t b = 0; b < B; ++b) std::copy(in + (a * B + b) * C, in + (a * B + b + 1) * C, out + (b * A + a) * C);
}

void channel_bias_forward(float* out, const float* bias, int64_t N, int64_t C, int64_t HW) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) vec(out + (n * C + c) * HW, HW).array() += bias[c];
}

void channel_sum(float* dbias, const float* dout, int64_t N, int64_t C, int64_t HW) {
  for (int64_t c = 0; c < C; ++c) {
    double total = 0.0;  // in double, as every sum here: the result does not depend on N
    for (int64_t n = 0; n < N; ++n) {
      const float* plane = dout + (n * C + c) * HW;
      total += lane_sum(HW, [plane](int64_t i) { return double(plane[i]); });
    }
    dbias[c] = static_cast<float>(total);
  }
}

namespace {

// One output row of max pooling without padding (every window inside the plane), as
// max_pool2d_window scans each window: the same elements in the same order with the same rule
// (a larger value or a NaN replaces the best), so the same value and index. The loops run
// across the row's windows, one window element at a time, and choose with selects instead of
// branches: a branch per element mispredicts on about half of the data (with branches this loop
// took 15% of fashion_mnist_cnn's step), and the selects vectorise. kWithIndices false: values only (at
// is unused), for a forward that keeps no graph.
template <bool kWithIndices>
void max_pool2d_row(float* __restrict best, int32_t* __restrict at, const float* __restrict plane, const Window2d& g,
                    int64_t oh) {
  const int64_t sw = g.stride_w, top = oh * g.stride_h * g.width;
  for (int64_t ow = 0; ow < g.out_w; ++ow) {
    best[ow] = plane[top + ow * sw];
    if constexpr (kWithIndices) at[ow] = static_cast<int32_t>(top + ow * sw);
  }
  for (int64_t i = 0; i < g.kernel_h; ++i)
    for (int64_t j = i == 0 ? 1 : 0; j < g.kernel_w; ++j) {
      const int64_t first = top + i * g.dilation_h * g.width + j * g.dilation_w;
      for (int64_t ow = 0; ow < g.out_w; ++ow) {
        const float v = plane[first + ow * sw];
        const bool take = (v > best[ow]) | (v != v);
        best[ow] = take ? v : best[ow];
        if constexpr (kWithIndices) at[ow] = take ? static_cast<int32_t>(first + ow * sw) : at[ow];
      }
    }
}

// MaxPool2d's usual case, horizontal stride 2 (MaxPool2d(2) in a CNN), in explicit vectors of
// 8 windows (GCC's and Clang's vector extensions: AVX with -mavx2, two SSE halves without).
// The compiler's own vectorisation of max_pool2d_row leaves each row's last windows to a
// remainder loop that branches again, and rows are short (13 and 5 windows in the example).
// Here a row is worked in whole vectors: a vector of element j of 8 windows is the even lanes
// of 16 consecutive floats. Same scan, order and rule as max_pool2d_row, so the same values
// and indices.
//
// A row's last vector reads past the row's end and computes windows that do not exist. Where
// those reads stay inside the input, they are made in place (they see the next row, or the
// next plane), and the made-up windows' results, written past the output row's end, are
// overwritten when the next output row is written. Only the last rows of the batch, whose
// reads or writes would leave the tensors, go through zero-padded scratch rows. Copying every
// row into scratch, and the results out of it, took more time than the pooling (a memmove
// call per input row and two per output row).
constexpr int64_t kPoolLanes = 8;

// v = the even lanes of the 16 floats at p. (An out-parameter: a function that returns a
// 32-byte vector by value has a different ABI with and without AVX, which GCC warns about.)
inline void load_even_lanes(Floats8& v, const float* p) {
  Floats8 low, high;
  std::memcpy(&low, p, sizeof low);
  std::memcpy(&high, p + kPoolLanes, sizeof high);
#if defined(__clang__)
  v = __builtin_shufflevector(low, high, 0, 2, 4, 6, 8, 10, 12, 14);
#else
  v = __builtin_shuffle(low, high, Ints8{0, 2, 4, 6, 8, 10, 12, 14});
#endif
}

// The 8 indices of at, at p.
inline void store_indices(int32_t* p, const Ints8& at) { std::memcpy(p, &at, sizeof at); }

class StrideTwoPoolRows {
 public:
  StrideTwoPoolRows(const Window2d& g, int64_t planes)
      : blocks_((g.out_w + kPoolLanes - 1) / kPoolLanes),
        row_len_(2 * kPoolLanes * blocks_ + (g.kernel_w - 1) * g.dilation_w),
        in_size_(planes * g.height * g.width),
        out_size_(planes * g.out_h * g.out_w),
        rows_(g.kernel_h * row_len_, 0.0f),
        best_(blocks_ * kPoolLanes),
        at_(blocks_ * kPoolLanes) {}

  // Indices are computed in 32 bits: planes of at most 2^31 elements.
  static bool fits(const Window2d& g) { return g.height * g.width <= INT32_MAX; }

  // Output row oh of plane p; indices null: values only.
  template <bool kWithIndices>
  void pool(float* out, int32_t* indices, const float* in, const Window2d& g, int64_t p, int64_t oh) {
    const int64_t top = (oh * g.stride_h) * g.width;  // the window row's first element in its plane
    const float* plane = in + p * g.height * g.width;
    const int64_t row_at = p * g.out_h * g.out_w + oh * g.out_w;
    const int64_t last_read = p * g.height * g.width + top + (g.kernel_h - 1) * g.dilation_h * g.width + row_len_;
    if (last_read <= in_size_ && row_at + blocks_ * kPoolLanes <= out_size_) {
      pool_from<kWithIndices>(out + row_at, kWithIndices ? indices + row_at : nullptr, plane + top,
                              g.dilation_h * g.width, top, g);
      return;
    }
    for (int64_t i = 0; i < g.kernel_h; ++i) {
      const float* row = plane + top + i * g.dilation_h * g.width;
      std::copy(row, row + std::min(g.width, row_len_), rows_.data() + i * row_len_);
    }
    pool_from<kWithIndices>(best_.data(), kWithIndices ? at_.data() : nullptr, rows_.data(), row_len_, top, g);
    std::copy(best_.begin(), best_.begin() + g.out_w, out + row_at);
    if constexpr (kWithIndices) std::copy(at_.begin(), at_.begin() + g.out_w, indices + row_at);
  }

 private:
  // blocks_ vectors of windows into best and at, from the kernel_h input rows at rows, each
  // kernel_row_step floats after the one before; top: where the first of them starts in its
  // plane (for the indices).
  template <bool kWithIndices>
  void pool_from(float* best_out, int32_t* at_out, const float* rows, int64_t kernel_row_step, int64_t top,
                 const Window2d& g) const {
    // MaxPool2d(2)'s window as constants, so that its four elements' loop unrolls.
    if (g.kernel_h == 2 && g.kernel_w == 2 && g.dilation_w == 1) {
      pool_from<kWithIndices, 2, 2>(best_out, at_out, rows, kernel_row_step, top, g);
    } else {
      pool_from<kWithIndices, 0, 0>(best_out, at_out, rows, kernel_row_step, top, g);
    }
  }

  // kKernelH, kKernelW: the window's size if known here (then dilation_w is 1), else 0.
  template <bool kWithIndices, int64_t kKernelH, int64_t kKernelW>
  void pool_from(float* best_out, int32_t* at_out, const float* rows, int64_t kernel_row_step, int64_t top,
                 const Window2d& g) const {
    const int64_t kernel_h = kKernelH > 0 ? kKernelH : g.kernel_h, kernel_w = kKernelW > 0 ? kKernelW : g.kernel_w;
    const int64_t dilation_w = kKernelW > 0 ? 1 : g.dilation_w;
    const Ints8 lane_offsets{0, 2, 4, 6, 8, 10, 12, 14};
    for (int64_t b = 0; b < blocks_; ++b) {
      Floats8 best{};
      Ints8 at{};
      for (int64_t i = 0; i < kernel_h; ++i)
        for (int64_t j = 0; j < kernel_w; ++j) {
          Floats8 v;
          load_even_lanes(v, rows + i * kernel_row_step + j * dilation_w + 2 * kPoolLanes * b);
          // The window's first element starts the scan; then a larger value or a NaN wins.
          const Ints8 take = i == 0 && j == 0 ? ~Ints8{} : (v > best) | (v != v);
          best = reinterpret_cast<Floats8>((reinterpret_cast<Ints8>(v) & take) |
                                           (reinterpret_cast<Ints8>(best) & ~take));
          if constexpr (kWithIndices) {
            const Ints8 index =
                static_cast<int32_t>(top + i * g.dilation_h * g.width + j * dilation_w + 2 * kPoolLanes * b) +
                lane_offsets;
            at = (index & take) | (at & ~take);
          }
        }
      std::memcpy(best_out + b * kPoolLanes, &best, sizeof best);
      if constexpr (kWithIndices) store_indices(at_out + b * kPoolLanes, at);
    }
  }

  int64_t blocks_, row_len_, in_size_, out_size_;
  std::vector<float> rows_;  // kernel_h input rows of row_len_ floats; the padding stays 0
  std::vector<float> best_;
  std::vector<int32_t> at_;
};

}  // namespace

namespace {

template <bool kWithIndices>
void max_pool2d_planes(float* out, int32_t* indices, const float* in, int64_t planes, const Window2d& g) {
  const int64_t in_plane = g.height * g.width, out_plane = g.out_h * g.out_w;
  // Without padding every window lies inside the plane (out_h and out_w are computed so);
  // MaxPool2d(2) in a CNN is that case.
  const bool inside = g.pad_h == 0 && g.pad_w == 0;
  // The index row of output row oh of plane p (null without indices).
  auto at_row = [&](int64_t p, int64_t oh) { return kWithIndices ? indices + p * out_plane + oh * g.out_w : nullptr; };
  if (inside && g.stride_w == 2 && StrideTwoPoolRows::fits(g)) {
    StrideTwoPoolRows rows(g, planes);
    for (int64_t p = 0; p < planes; ++p)
      for (int64_t oh = 0; oh < g.out_h; ++oh) rows.pool<kWithIndices>(out, indices, in, g, p, oh);
    return;
  }
  for (int64_t p = 0; p < planes; ++p) {
    const float* plane = in + p * in_plane;
    for (int64_t oh = 0; oh < g.out_h; ++oh) {
      float* best = out + p * out_plane + oh * g.out_w;
      int32_t* at = at_row(p, oh);
      if (inside) {
        max_pool2d_row<kWithIndices>(best, at, plane, g, oh);
      } else {
        for (int64_t ow = 0; ow < g.out_w; ++ow) {
          const WindowMax window = max_pool2d_window(plane, g, oh, ow);
          best[ow] = window.value;
          if constexpr (kWithIndices) at[ow] = static_cast<int32_t>(window.index);
        }
      }
    }
  }
}

}  // namespace

void max_pool2d_forward(float* out, int32_t* indices, const float* in, int64_t planes, Window2d g) {
  if (indices != nullptr) {
    max_pool2d_planes<true>(out, indices, in, planes, g);
  } else {
    max_pool2d_planes<false>(out, nullptr, in, planes, g);
  }
}

void max_pool2d_backward(float* din, const float* dout, const int32_t* indices, int64_t planes, Window2d g) {
  const int64_t in_plane = g.height * g.width, out_plane = g.out_h * g.out_w;
  // Windows that do not overlap (stride >= the kernel's extent: MaxPool2d(2)) send their
  // gradients to distinct elements, so each is stored, not added: no load waits for the
  // store before it. 0 + dout keeps the sum's sign rule (+0 for a -0 gradient).
  const bool disjoint = g.stride_h >= g.dilation_h * (g.kernel_h - 1) + 1 &&
                        g.stride_w >= g.dilation_w * (g.kernel_w - 1) + 1;
  // Plane by plane, so the plane just zeroed is still in cache when its maxima land.
  for (int64_t p = 0; p < planes; ++p) {
    float* plane = din + p * in_plane;
    const float* grad = dout + p * out_plane;
    const int32_t* at = indices + p * out_plane;
    std::fill(plane, plane + in_plane, 0.0f);
    if (disjoint) {
      for (int64_t o = 0; o < out_plane; ++o) plane[at[o]] = 0.0f + grad[o];
    } else {
      for (int64_t o = 0; o < out_plane; ++o) plane[at[o]] += grad[o];
    }
  }
}

}  // namespace nanoddp::kernels::cpu
