// Winograd F(2x2, 3x3) convolution on the CPU (declared in winograd.h).
//
// Note [Winograd F(2x2, 3x3)]
// A 2 x 2 block of a 3 x 3 convolution's outputs (a tile) reads a 4 x 4 patch d of its input
// channel. With the 3 x 3 filter g:
//   y = A^T [ (G g G^T) * (B^T d B) ] A          (* elementwise, over 4 x 4 positions)
//   B^T = [1  0 -1  0]   G = [1    0    0 ]   A^T = [1  1  1  0]
//         [0  1  1  0]       [1/2  1/2  1/2]         [0  1 -1 -1]
//         [0 -1  1  0]       [1/2 -1/2  1/2]
//         [0  1  0 -1]       [0    0    1 ]
// The sum over input channels moves inside the brackets, so per position xi (16 of them) the
// convolution is one GEMM: M[xi] [tiles, OC] = V[xi] [tiles, C] · U[xi] [C, OC], with V the
// transformed patches and U the transformed filters (channels last, so that the transforms
// run over contiguous channels in vectors). That is 16 multiply-adds per tile and
// channel pair where im2col + GEMM does 36; the transforms are only additions (and halvings
// of the filter, done once per call). In fashion_mnist_cnn's second convolution ([64, 32, 13,
// 13] -> [64, 64, 11, 11]) the tiles cover 12 x 12 outputs for 11 x 11, so the GEMMs are 1.9
// times smaller, and the input gradient, a convolution at padding 2, needs no col2im.
//
// Rounding differs from im2col + GEMM (a sum of transformed terms, not of products of inputs
// and weights): tests/test_ops.cpp compares both with a float64 reference. Each output sees
// exactly the inputs and weights its 3 x 3 window sees (the zeros of B^T and A^T leave the
// others out rather than multiply them by 0), so a NaN reaches the same outputs as in conv2d.
// An inf does not (inf - inf): the caller computes a result with any NaN or inf in it again
// by im2col + GEMM (winograd.h's all_finite).
//
// The images are worked in chunks of about kChunkColumns tiles, so that V and M (16 x (C +
// OC) x columns floats) stay in the core's cache between the transforms and the GEMMs.
#include "kernels/cpu/winograd.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace nanoddp::kernels::cpu {

namespace {

constexpr int64_t kPositions = 16;  // 4 x 4 per tile
constexpr int64_t kChunkColumns = 256;
// Below this many channels (in, or out: the input gradient's GEMMs sum over those) the
// transforms cost more than the multiplications they save: fashion_mnist_cnn's first
// convolution, one input channel, took 4 times as long.
constexpr int64_t kMinChannels = 8;

// U [16, inputs, outputs]: G g G^T of the 3 x 3 filter tap(o, i, r, s) for each pair.
template <class Tap>
std::vector<float> transform_filters(int64_t outputs, int64_t inputs, Tap tap) {
  std::vector<float> U(kPositions * inputs * outputs);
  for (int64_t o = 0; o < outputs; ++o)
    for (int64_t i = 0; i < inputs; ++i) {
      float gg[4][3];  // G g
      for (int64_t s = 0; s < 3; ++s) {
        const float g0 = tap(o, i, 0, s), g1 = tap(o, i, 1, s), g2 = tap(o, i, 2, s);
        gg[0][s] = g0;
        gg[1][s] = 0.5f * (g0 + g1 + g2);
        gg[2][s] = 0.5f * (g0 - g1 + g2);
        gg[3][s] = g2;
      }
      for (int64_t a = 0; a < 4; ++a) {
        const float u[4] = {gg[a][0], 0.5f * (gg[a][0] + gg[a][1] + gg[a][2]),
                            0.5f * (gg[a][0] - gg[a][1] + gg[a][2]), gg[a][2]};
        for (int64_t b = 0; b < 4; ++b) U[((a * 4 + b) * inputs + i) * outputs + o] = u[b];
      }
    }
  return U;
}

// The geometry of one call: in [N, inputs, H, W] padded by (pad_h, pad_w) -> out [N, outputs,
// OH, OW] in tiles_h x tiles_w tiles. Each image is first copied channels-last into a
// zero-bordered [padded_h, padded_w, inputs] block (as conv.cpp's Note [Padded planes], all
// channels of a pixel side by side): every tile's 4 x 4 patch lies inside it, the last ones of
// an odd-sized output partly on zeros. The transforms then run over the channels, which are
// contiguous, in vectors.
struct Tiling {
  int64_t inputs, outputs, height, width, pad_h, pad_w;
  int64_t out_h = height + 2 * pad_h - 2, out_w = width + 2 * pad_w - 2;
  int64_t tiles_h = (out_h + 1) / 2, tiles_w = (out_w + 1) / 2, tiles = tiles_h * tiles_w;
  int64_t padded_h = 2 * tiles_h + 2, padded_w = 2 * tiles_w + 2;
};

// 8 channels at a time (GCC's and Clang's vector extensions: one AVX register with -mavx2),
// the last C % 8 one by one: the same arithmetic on a Floats8 or a float.
using Floats8 = float __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline void load(float& v, const float* p) { v = *p; }
inline void load(Floats8& v, const float* p) { std::memcpy(&v, p, sizeof v); }
inline void store(float* p, float v) { *p = v; }
inline void store(float* p, const Floats8& v) { std::memcpy(p, &v, sizeof v); }

// v[xi * position_step] = (B^T d B)[xi] for the 4 x 4 patch d at p (pixel (i, j) at p + i row +
// j pixel), for one Vec of channels.
template <class Vec>
inline void transform_patch(float* __restrict v, int64_t position_step, const float* __restrict p,
                            int64_t row, int64_t pixel) {
  Vec d[4][4], bd[4][4];
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 4; ++j) load(d[i][j], p + i * row + j * pixel);
  for (int64_t j = 0; j < 4; ++j) {  // B^T d
    bd[0][j] = d[0][j] - d[2][j];
    bd[1][j] = d[1][j] + d[2][j];
    bd[2][j] = d[2][j] - d[1][j];
    bd[3][j] = d[1][j] - d[3][j];
  }
  for (int64_t i = 0; i < 4; ++i) {  // (B^T d) B
    store(v + (i * 4 + 0) * position_step, bd[i][0] - bd[i][2]);
    store(v + (i * 4 + 1) * position_step, bd[i][1] + bd[i][2]);
    store(v + (i * 4 + 2) * position_step, bd[i][2] - bd[i][1]);
    store(v + (i * 4 + 3) * position_step, bd[i][1] - bd[i][3]);
  }
}

// y (2 x 2 pixels at y + i row + j pixel) = A^T m A for m[xi] at m + xi position_step, for
// one Vec of channels.
template <class Vec>
inline void transform_tile(float* __restrict y, int64_t row, int64_t pixel, const float* __restrict m,
                           int64_t position_step) {
  Vec am[2][4];  // A^T m
  for (int64_t j = 0; j < 4; ++j) {
    Vec m0, m1, m2, m3;
    load(m0, m + j * position_step);
    load(m1, m + (4 + j) * position_step);
    load(m2, m + (8 + j) * position_step);
    load(m3, m + (12 + j) * position_step);
    am[0][j] = m0 + m1 + m2;
    am[1][j] = m1 - m2 - m3;
  }
  for (int64_t i = 0; i < 2; ++i) {  // (A^T m) A
    store(y + i * row, am[i][0] + am[i][1] + am[i][2]);
    store(y + i * row + pixel, am[i][1] - am[i][2] - am[i][3]);
  }
}

// Note [Channel transposes]
// The transforms work channels last and the tensors are channels first, so every image goes
// through a transpose on the way in and out. Element by element, each move is a load and a
// store to another plane (8 planes apart in cache lines per pixel), and the two transposes
// are then a third of the non-GEMM time of fashion_mnist_cnn's second convolution. Here an 8 x 8
// block (8 pixels of a row, 8 channels) moves as 8 vector loads, 24 shuffles in registers and
// 8 vector stores. A row's last block overlaps the one before it when the row is not a
// multiple of 8 pixels (the same values written twice, as conv.cpp's copy_run); rows under 8
// pixels, and the last C % 8 channels, go element by element.
using Ints8 = int32_t __attribute__((vector_size(32)));

#if defined(__clang__)
#define NANODDP_SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define NANODDP_SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, Ints8{__VA_ARGS__})
#endif

// r[i][j] <-> r[j][i]: rows of 8 pixels (one channel each) become rows of 8 channels (one
// pixel each), and back.
inline void transpose8(Floats8 (&r)[8]) {
  Floats8 t[8], u[8];
  for (int k = 0; k < 8; k += 2) {  // pairs of rows interleaved
    t[k] = NANODDP_SHUFFLE8(r[k], r[k + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[k + 1] = NANODDP_SHUFFLE8(r[k], r[k + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int k = 0; k < 8; k += 4) {  // then pairs of pairs
    u[k] = NANODDP_SHUFFLE8(t[k], t[k + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    u[k + 1] = NANODDP_SHUFFLE8(t[k], t[k + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    u[k + 2] = NANODDP_SHUFFLE8(t[k + 1], t[k + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    u[k + 3] = NANODDP_SHUFFLE8(t[k + 1], t[k + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int k = 0; k < 4; ++k) {  // then the halves of 4 rows with those of the other 4
    r[k] = NANODDP_SHUFFLE8(u[k], u[k + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[k + 4] = NANODDP_SHUFFLE8(u[k], u[k + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

#undef NANODDP_SHUFFLE8

// The pixel offsets of a row's 8-pixel blocks: 0, 8, ..., and W - 8 for a last partial block.
template <class Block>
inline void for_each_block_of_row(int64_t W, Block block) {
  for (int64_t w = 0; w + kLanes <= W; w += kLanes) block(w);
  if (W % kLanes != 0) block(W - kLanes);
}

// block [.., block_w, C] at row pad_h, column pad_w = image [C, H, W] channels last (Note
// [Channel transposes]). The rest of block is left as it is.
void to_channels_last(float* block, int64_t block_w, const float* image, int64_t C, int64_t H, int64_t W,
                      int64_t pad_h, int64_t pad_w) {
  for (int64_t c0 = 0; c0 < C; c0 += kLanes) {
    const int64_t lanes = std::min(kLanes, C - c0);
    for (int64_t h = 0; h < H; ++h) {
      float* to = block + ((h + pad_h) * block_w + pad_w) * C + c0;
      const float* from = image + (c0 * H + h) * W;
      if (lanes < kLanes || W < kLanes) {
        for (int64_t w = 0; w < W; ++w)
          for (int64_t c = 0; c < lanes; ++c) to[w * C + c] = from[c * H * W + w];
        continue;
      }
      for_each_block_of_row(W, [&](int64_t w) {
        Floats8 r[kLanes];
        for (int64_t c = 0; c < kLanes; ++c) load(r[c], from + c * H * W + w);
        transpose8(r);
        for (int64_t p = 0; p < kLanes; ++p) store(to + (w + p) * C, r[p]);
      });
    }
  }
}

// image [C, H, W] = the first H x W pixels of block [.., block_w, C] (channels last), as
// to_channels_last.
void to_channels_first(float* image, int64_t C, int64_t H, int64_t W, const float* block, int64_t block_w) {
  for (int64_t c0 = 0; c0 < C; c0 += kLanes) {
    const int64_t lanes = std::min(kLanes, C - c0);
    for (int64_t h = 0; h < H; ++h) {
      float* to = image + (c0 * H + h) * W;
      const float* from = block + h * block_w * C + c0;
      if (lanes < kLanes || W < kLanes) {
        for (int64_t w = 0; w < W; ++w)
          for (int64_t c = 0; c < lanes; ++c) to[c * H * W + w] = from[w * C + c];
        continue;
      }
      for_each_block_of_row(W, [&](int64_t w) {
        Floats8 r[kLanes];
        for (int64_t p = 0; p < kLanes; ++p) load(r[p], from + (w + p) * C);
        transpose8(r);
        for (int64_t c = 0; c < kLanes; ++c) store(to + c * H * W + w, r[c]);
      });
    }
  }
}

// dy[xi * position_step] = (A g A^T)[xi] for the 2 x 2 block g of output gradients at y (pixel
// (i, j) at y + i row + j pixel), for one Vec of channels: the gradient of the GEMMs' M for
// that tile, as y = A^T M A.
template <class Vec>
inline void transform_gradient_tile(float* __restrict dm, int64_t position_step, const float* __restrict y,
                                    int64_t row, int64_t pixel) {
  Vec g[2][2], ag[4][2];  // A g
  load(g[0][0], y);
  load(g[0][1], y + pixel);
  load(g[1][0], y + row);
  load(g[1][1], y + row + pixel);
  for (int64_t j = 0; j < 2; ++j) {
    ag[0][j] = g[0][j];
    ag[1][j] = g[0][j] + g[1][j];
    ag[2][j] = g[0][j] - g[1][j];
    ag[3][j] = -g[1][j];
  }
  for (int64_t i = 0; i < 4; ++i) {  // (A g) A^T
    store(dm + (i * 4 + 0) * position_step, ag[i][0]);
    store(dm + (i * 4 + 1) * position_step, ag[i][0] + ag[i][1]);
    store(dm + (i * 4 + 2) * position_step, ag[i][0] - ag[i][1]);
    store(dm + (i * 4 + 3) * position_step, -ag[i][1]);
  }
}

// V[xi, column + t, :] = B^T d B for tile t of the image in padded [padded_h, padded_w, C],
// over the C channels. V: [16, columns, C].
void transform_input(float* V, int64_t columns, int64_t column, const float* padded, const Tiling& t) {
  const int64_t C = t.inputs, row = t.padded_w * C, position_step = columns * C;
  for (int64_t ty = 0; ty < t.tiles_h; ++ty)
    for (int64_t tx = 0; tx < t.tiles_w; ++tx) {
      const float* p = padded + 2 * ty * row + 2 * tx * C;  // the patch's pixel (0, 0)
      float* v = V + (column + ty * t.tiles_w + tx) * C;
      int64_t c = 0;
      for (; c + kLanes <= C; c += kLanes) transform_patch<Floats8>(v + c, position_step, p + c, row, C);
      for (; c < C; ++c) transform_patch<float>(v + c, position_step, p + c, row, C);
    }
}

// The image's outputs, channels last, [2 tiles_h, 2 tiles_w, OC], from M [16, columns, OC]:
// A^T m A per tile, over the OC channels.
void transform_output(float* tiled, const float* M, int64_t columns, int64_t column, const Tiling& t) {
  const int64_t OC = t.outputs, row = 2 * t.tiles_w * OC, position_step = columns * OC;
  for (int64_t ty = 0; ty < t.tiles_h; ++ty)
    for (int64_t tx = 0; tx < t.tiles_w; ++tx) {
      const float* m = M + (column + ty * t.tiles_w + tx) * OC;
      float* y = tiled + 2 * ty * row + 2 * tx * OC;
      int64_t o = 0;
      for (; o + kLanes <= OC; o += kLanes) transform_tile<Floats8>(y + o, row, OC, m + o, position_step);
      for (; o < OC; ++o) transform_tile<float>(y + o, row, OC, m + o, position_step);
    }
}

// Buffers kept by the thread between calls: fresh ones of this size come from mmap, and the
// kernel's zeroing of their pages on first touch cost as much as the transforms.
struct Scratch {
  std::vector<float> V;       // [16, columns, inputs]
  std::vector<float> M;       // [16, columns, outputs] (or its gradient)
  std::vector<float> padded;  // one input image, channels last, zero-bordered
  std::vector<float> tiled;   // one output image (or its gradient), channels last, whole tiles

  // Sized for chunks of images_per_chunk(t) images; padded and tiled all zeros.
  void fit(const Tiling& t) {
    const int64_t chunk_columns = images_per_chunk(t) * t.tiles;
    V.resize(kPositions * chunk_columns * t.inputs);
    M.resize(kPositions * chunk_columns * t.outputs);
    padded.assign(t.padded_h * t.padded_w * t.inputs, 0.0f);
    tiled.assign(4 * t.tiles * t.outputs, 0.0f);
  }

  // V[xi, column + tile, :] for every tile of image [inputs, H, W], through padded, whose
  // border stays 0.
  void transform_image(int64_t columns, int64_t column, const float* image, const Tiling& t) {
    to_channels_last(padded.data(), t.padded_w, image, t.inputs, t.height, t.width, t.pad_h, t.pad_w);
    transform_input(V.data(), columns, column, padded.data(), t);
  }

  static int64_t images_per_chunk(const Tiling& t) { return std::max<int64_t>(1, kChunkColumns / t.tiles); }
};
thread_local Scratch scratch;

// out [N, outputs, OH, OW] = the convolution of in [N, inputs, H, W] with the filters U.
void winograd_conv(float* out, const float* in, const std::vector<float>& U, int64_t N, const Tiling& t) {
  const int64_t C = t.inputs, OC = t.outputs, images_per_chunk = Scratch::images_per_chunk(t);
  scratch.fit(t);
  std::vector<float>&V = scratch.V, &M = scratch.M, &tiled = scratch.tiled;
  const int64_t in_image = C * t.height * t.width, out_plane = t.out_h * t.out_w;
  for (int64_t first = 0; first < N; first += images_per_chunk) {
    const int64_t images = std::min(images_per_chunk, N - first), columns = images * t.tiles;
    for (int64_t k = 0; k < images; ++k)
      scratch.transform_image(columns, k * t.tiles, in + (first + k) * in_image, t);
    for (int64_t xi = 0; xi < kPositions; ++xi)
      matmul(M.data() + xi * columns * OC, V.data() + xi * columns * C, U.data() + xi * C * OC, columns, C,
             OC, false, false, 0.0f);
    for (int64_t k = 0; k < images; ++k) {
      transform_output(tiled.data(), M.data(), columns, k * t.tiles, t);
      to_channels_first(out + (first + k) * OC * out_plane, OC, t.out_h, t.out_w, tiled.data(),
                        2 * t.tiles_w);
    }
  }
}

// dM[xi, column + t, :] = A g A^T for tile t of the image's output gradient in tiled [2
// tiles_h, 2 tiles_w, OC] (0 past OH, OW), over the OC channels.
void transform_gradient(float* dM, int64_t columns, int64_t column, const float* tiled, const Tiling& t) {
  const int64_t OC = t.outputs, row = 2 * t.tiles_w * OC, position_step = columns * OC;
  for (int64_t ty = 0; ty < t.tiles_h; ++ty)
    for (int64_t tx = 0; tx < t.tiles_w; ++tx) {
      float* dm = dM + (column + ty * t.tiles_w + tx) * OC;
      const float* y = tiled + 2 * ty * row + 2 * tx * OC;
      int64_t o = 0;
      for (; o + kLanes <= OC; o += kLanes)
        transform_gradient_tile<Floats8>(dm + o, position_step, y + o, row, OC);
      for (; o < OC; ++o) transform_gradient_tile<float>(dm + o, position_step, y + o, row, OC);
    }
}

}  // namespace

bool winograd_applies(const Window2d& g, int64_t out_channels) {
  return g.channels >= kMinChannels && out_channels >= kMinChannels && g.kernel_h == 3 && g.kernel_w == 3 &&
         g.stride_h == 1 && g.stride_w == 1 && g.dilation_h == 1 && g.dilation_w == 1 && g.pad_h <= 2 &&
         g.pad_w <= 2;
}

bool all_finite(const float* p, int64_t n) {
  // Integer tests on the exponent bits, ORed: the loop vectorises, and has no branch per value.
  constexpr uint32_t kExponent = 0x7f800000u;
  uint32_t non_finite = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, p + i, sizeof bits);
    non_finite |= (bits & kExponent) == kExponent;
  }
  return non_finite == 0;
}

void conv3x3_winograd(float* out, const float* images, const float* weight, int64_t N, int64_t OC,
                      Window2d g) {
  const int64_t C = g.channels;
  const std::vector<float> U = transform_filters(OC, C, [&](int64_t o, int64_t c, int64_t r, int64_t s) {
    return weight[((o * C + c) * 3 + r) * 3 + s];
  });
  winograd_conv(out, images, U, N, Tiling{C, OC, g.height, g.width, g.pad_h, g.pad_w});
}

void conv3x3_winograd_input_grad(float* dimages, const float* dout, const float* weight, int64_t N,
                                 int64_t OC, Window2d g) {
  const int64_t C = g.channels;
  // Filter (c, o) of the gradient is the forward's filter (o, c) turned 180 degrees.
  const std::vector<float> U = transform_filters(C, OC, [&](int64_t c, int64_t o, int64_t r, int64_t s) {
    return weight[((o * C + c) * 3 + 2 - r) * 3 + 2 - s];
  });
  winograd_conv(dimages, dout, U, N, Tiling{OC, C, g.out_h, g.out_w, 2 - g.pad_h, 2 - g.pad_w});
}

void conv3x3_winograd_weight_grad(float* dweight, const float* images, const float* dout, int64_t N,
                                  int64_t OC, Window2d g) {
  // With U = G w G^T and y = A^T (U * V) A per tile: dU = the sum over tiles of V * (A dy A^T)
  // (per position, over channels a GEMM: dU[xi] [C, OC] = V[xi]^T · dM[xi]), and dw = G^T dU G.
  const Tiling t{g.channels, OC, g.height, g.width, g.pad_h, g.pad_w};
  const int64_t C = t.inputs;
  const int64_t images_per_chunk = Scratch::images_per_chunk(t);
  scratch.fit(t);  // tiled stays 0 past OH, OW: outputs that do not exist have no gradient
  std::vector<float>&V = scratch.V, &dM = scratch.M, &tiled = scratch.tiled;
  std::vector<float> dU(kPositions * C * OC);
  const int64_t in_image = C * t.height * t.width, out_image = OC * t.out_h * t.out_w;
  for (int64_t first = 0; first < N; first += images_per_chunk) {
    const int64_t count = std::min(images_per_chunk, N - first), columns = count * t.tiles;
    for (int64_t k = 0; k < count; ++k) {
      scratch.transform_image(columns, k * t.tiles, images + (first + k) * in_image, t);
      to_channels_last(tiled.data(), 2 * t.tiles_w, dout + (first + k) * out_image, OC, t.out_h, t.out_w, 0,
                       0);
      transform_gradient(dM.data(), columns, k * t.tiles, tiled.data(), t);
    }
    for (int64_t xi = 0; xi < kPositions; ++xi)
      matmul(dU.data() + xi * C * OC, V.data() + xi * columns * C, dM.data() + xi * columns * OC, C, columns,
             OC, true, false, first == 0 ? 0.0f : 1.0f);
  }
  for (int64_t o = 0; o < OC; ++o)
    for (int64_t c = 0; c < C; ++c) {
      float gu[3][4];  // G^T dU
      for (int64_t b = 0; b < 4; ++b) {
        const float u0 = dU[(0 * 4 + b) * C * OC + c * OC + o], u1 = dU[(1 * 4 + b) * C * OC + c * OC + o],
                    u2 = dU[(2 * 4 + b) * C * OC + c * OC + o], u3 = dU[(3 * 4 + b) * C * OC + c * OC + o];
        gu[0][b] = u0 + 0.5f * (u1 + u2);
        gu[1][b] = 0.5f * (u1 - u2);
        gu[2][b] = 0.5f * (u1 + u2) + u3;
      }
      float* w = dweight + (o * C + c) * 9;
      for (int64_t r = 0; r < 3; ++r) {  // (G^T dU) G
        w[r * 3 + 0] = gu[r][0] + 0.5f * (gu[r][1] + gu[r][2]);
        w[r * 3 + 1] = 0.5f * (gu[r][1] - gu[r][2]);
        w[r * 3 + 2] = 0.5f * (gu[r][1] + gu[r][2]) + gu[r][3];
      }
    }
}

}  // namespace nanoddp::kernels::cpu
