// The op harness's CUDA column: every kernel of kernels/kernel_list.inc on CUDA against the
// CPU kernel on the same random inputs. Sizes straddle block and tile edges (255, 256, 257,
// 1025, 65537) and one exceeds 2^24, so grid-stride tails show up; one case runs the
// elementwise, reduction and argmax kernels on 2^31 + 7 elements, where int32 index math
// would overflow.
// Outputs are poisoned (NaN) before each run: an element a kernel forgets fails.
// To add a kernel: add a TEST_CASE below that runs it on both devices over kSizes/kShapes.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/device_memory.h"
#include "kernels/kernels.h"
#include "tests/test_gpu_util.h"

#if NANODDP_WITH_CUDA

namespace nanoddp {
// Declared where clip_grad_value_ and clip_grad_norm_ use them (nn/clip_grad.cpp).
NANODDP_DECLARE_KERNEL(clamp_in_place, float* x, float lo, float hi, int64_t n)
NANODDP_DECLARE_KERNEL(grad_norm_accumulate, double* totals, const float* g, int64_t n, double norm_type,
                       double rescale_by)
}  // namespace nanoddp

namespace {

using namespace nanoddp;
using namespace nanoddp::testing;
using kernels::BinaryOp;
using kernels::Reduction;
using kernels::ScalarOp;
using kernels::AdamConfig;
using kernels::SgdConfig;
namespace cpu = nanoddp::kernels::cpu;
namespace gpu = nanoddp::kernels::cuda;

const int64_t kAbove24Bits = (int64_t(1) << 24) + 3;
const std::vector<int64_t> kSizes = {0, 1, 255, 256, 257, 1025, 65537, kAbove24Bits};
// [N, F] (or [N, C]) shapes: empty either way, single row or column, tile edges, and one
// with more than 2^24 elements.
const std::vector<std::pair<int64_t, int64_t>> kShapes = {
    {0, 3}, {3, 0}, {1, 1}, {1, 255}, {256, 1}, {257, 3}, {5, 1025}, {33, 17}, {65537, 2}, {4099, 4097}};

// float rounding allowance for one or two roundings (an fma on one side, not the other).
constexpr double kElementwiseRtol = 1e-6;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::string label(const char* op, int64_t n) { return std::string(op) + " n=" + std::to_string(n); }
std::string label(const char* op, int64_t N, int64_t F) {
  return std::string(op) + " [" + std::to_string(N) + ", " + std::to_string(F) + "]";
}
const char* name(Reduction r) { return r == Reduction::None ? "none" : r == Reduction::Mean ? "mean" : "sum"; }

TEST_CASE("fill and bytes_to_unit_float match the CPU") {
  for (int64_t n : kSizes) {
    std::vector<float> want(static_cast<size_t>(n), kNaN);
    cpu::fill(want.data(), -2.5f, n);
    DeviceArray<float> out(static_cast<size_t>(n));
    out.poison();
    gpu::fill(out.data(), -2.5f, n);
    expect_close(label("fill", n), out.to_host(), want, 0.0, 0.0);

    std::vector<uint8_t> bytes(static_cast<size_t>(n));
    Generator gen(n);
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(gen.randint(256));
    cpu::bytes_to_unit_float(want.data(), bytes.data(), n);
    DeviceArray<uint8_t> in(bytes);
    out.poison();
    gpu::bytes_to_unit_float(out.data(), in.data(), n);
    expect_close(label("bytes_to_unit_float", n), out.to_host(), want, kElementwiseRtol, 0.0);
  }
}

TEST_CASE("float_to_16bit and float_from_16bit match the CPU bit for bit, for both formats") {
  // Normals over many binades, then the values where rounding decides: ties to even, the
  // largest half (65504) and what overflows it, subnormals of both formats, zeros of both signs,
  // infinities and NaN.
  const float tiny = std::numeric_limits<float>::denorm_min();
  const std::vector<float> edges = {0.0f, -0.0f, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, 65504.0f, 65519.0f,
                                    65520.0f, 1e5f, -1e5f, 5.96e-8f, 2.98e-8f, 1e-40f, tiny, -tiny, 3.0e38f,
                                    std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                                    kNaN};
  for (DType format : {DType::Float16, DType::BFloat16}) {
    for (float divisor : {1.0f, 3.0f}) {
      for (int64_t n : {int64_t(0), int64_t(1), int64_t(257), int64_t(65537)}) {
        std::vector<float> in = normals(n, static_cast<uint64_t>(n) + 7, 100.0f);
        for (size_t i = 0; i < in.size() && i < edges.size(); ++i) in[i] = edges[i];
        const std::string what = std::string(format == DType::Float16 ? "float16" : "bfloat16") + " divisor " +
                                 std::to_string(divisor) + " n=" + std::to_string(n);
        std::vector<uint16_t> want(static_cast<size_t>(n));
        cpu::float_to_16bit(want.data(), in.data(), format, divisor, n);
        DeviceArray<float> in_gpu(in);
        DeviceArray<uint16_t> bits(static_cast<size_t>(n));
        bits.poison();
        gpu::float_to_16bit(bits.data(), in_gpu.data(), format, divisor, n);
        const std::vector<uint16_t> got = bits.to_host();
        CHECK_MESSAGE(got == want, what, ": 16-bit values differ");

        std::vector<float> back(static_cast<size_t>(n));
        cpu::float_from_16bit(back.data(), want.data(), format, n);
        DeviceArray<float> back_gpu(static_cast<size_t>(n));
        back_gpu.poison();
        gpu::float_from_16bit(back_gpu.data(), bits.data(), format, n);
        expect_close(what + " back to float32", back_gpu.to_host(), back, 0.0, 0.0);
      }
    }
  }
}

TEST_CASE("binary_forward matches the CPU, plain and with a broadcast row") {
  const BinaryOp ops[] = {BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul};
  const char* op_names[] = {"add", "sub", "mul"};
  for (int64_t n : kSizes) {
    const auto a = normals(n, 1), b = normals(n, 2);
    DeviceArray<float> db(b), out(a.size());
    for (int k = 0; k < 3; ++k) {
      std::vector<float> want(a.size());
      cpu::binary_forward(want.data(), a.data(), b.data(), ops[k], 1, n, false);
      DeviceArray<float> da(a);
      out.poison();
      gpu::binary_forward(out.data(), da.data(), db.data(), ops[k], 1, n, false);
      expect_close(label(op_names[k], n), out.to_host(), want, kElementwiseRtol, 0.0);
      // out aliasing a, as the in-place update of a gradient does
      gpu::binary_forward(da.data(), da.data(), db.data(), ops[k], 1, n, false);
      expect_close(label(op_names[k], n) + " in place", da.to_host(), want, kElementwiseRtol, 0.0);
    }
  }
  for (auto [N, F] : kShapes) {
    const auto a = normals(N * F, 3), b = normals(F, 4);
    DeviceArray<float> da(a), db(b), out(a.size());
    for (int k = 0; k < 3; ++k) {
      std::vector<float> want(a.size());
      cpu::binary_forward(want.data(), a.data(), b.data(), ops[k], N, F, true);
      out.poison();
      gpu::binary_forward(out.data(), da.data(), db.data(), ops[k], N, F, true);
      expect_close(label(op_names[k], N, F) + " broadcast", out.to_host(), want, kElementwiseRtol, 0.0);
    }
  }
}

TEST_CASE("clamp_in_place matches the CPU bit for bit, a NaN kept and infinities at the bounds") {
  for (int64_t n : kSizes) {
    std::vector<float> a = normals(n, 9);
    const float specials[] = {
        kNaN, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), 0.25f, -0.25f,
        -0.0f};
    for (size_t i = 0; i < a.size() && i < 6 * 7; i += 7) a[i] = specials[i / 7];
    std::vector<float> want = a;
    cpu::clamp_in_place(want.data(), -0.25f, 0.25f, n);
    DeviceArray<float> x(a);
    gpu::clamp_in_place(x.data(), -0.25f, 0.25f, n);
    const std::vector<float> got = x.to_host();
    // Bits: the sign of -0.0 counts, and NaN equals NaN.
    CHECK_MESSAGE(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0,
                  label("clamp_in_place", n));
  }
}

// clip_grad_norm_'s sums: the device's totals (a fixed tree) equal the CPU's (in order) to
// double rounding (the CPU sums 16M terms one by one), the largest |g| exactly; the totals add to what they
// held; a NaN wins the largest; an infinite order sums nothing.
TEST_CASE("grad_norm_accumulate matches the CPU for every order, rescaled or not, NaN and inf included") {
  for (int64_t n : kSizes) {
    std::vector<float> g = normals(n, 11, 3.0f);
    for (const double norm_type : {2.0, 1.0, 3.0, 0.5, static_cast<double>(INFINITY)}) {
      for (const double rescale_by : {0.0, 7.5}) {
        const std::string what = label("grad_norm_accumulate", n) + " order " + std::to_string(norm_type) +
                                 " rescaled by " + std::to_string(rescale_by);
        double want[2] = {1.25, 0.5};  // earlier gradients' totals
        cpu::grad_norm_accumulate(want, g.data(), n, norm_type, rescale_by);
        DeviceArray<double> totals(std::vector<double>{1.25, 0.5});
        DeviceArray<float> dg(g);
        gpu::grad_norm_accumulate(totals.data(), dg.data(), n, norm_type, rescale_by);
        const std::vector<double> got = totals.to_host();
        CHECK_MESSAGE(got[0] == doctest::Approx(want[0]).epsilon(1e-10), what);  // 16M terms in order
        CHECK_MESSAGE(got[1] == want[1], what);
        if (std::isinf(norm_type)) CHECK_MESSAGE(got[0] == 1.25, what);
      }
    }
    // An earlier gradient's largest |g| above every |g| here is kept, not overwritten.
    {
      DeviceArray<double> totals(std::vector<double>{0.0, 1e30});
      DeviceArray<float> dg(g);
      gpu::grad_norm_accumulate(totals.data(), dg.data(), n, 2.0, 0.0);
      CHECK_MESSAGE(totals.to_host()[1] == 1e30, label("grad_norm_accumulate keeps the largest", n));
    }
    if (n < 3) continue;
    g[n / 2] = std::numeric_limits<float>::infinity();
    g[n - 1] = kNaN;
    DeviceArray<double> totals(std::vector<double>{0.0, 0.0});
    DeviceArray<float> dg(g);
    gpu::grad_norm_accumulate(totals.data(), dg.data(), n, 2.0, 0.0);
    const std::vector<double> got = totals.to_host();
    CHECK_MESSAGE(std::isnan(got[0]), label("grad_norm_accumulate NaN sum", n));
    CHECK_MESSAGE(std::isnan(got[1]), label("grad_norm_accumulate NaN largest", n));
  }
}

TEST_CASE("scalar_forward and accumulate match the CPU") {
  for (int64_t n : kSizes) {
    const auto a = normals(n, 5);
    DeviceArray<float> da(a), out(a.size());
    for (auto [op, s] : {std::pair{ScalarOp::Mul, 0.37f}, std::pair{ScalarOp::Div, -3.0f}}) {
      std::vector<float> want(a.size());
      cpu::scalar_forward(want.data(), a.data(), op, s, n);
      out.poison();
      gpu::scalar_forward(out.data(), da.data(), op, s, n);
      expect_close(label(op == ScalarOp::Mul ? "scalar mul" : "scalar div", n), out.to_host(), want, kElementwiseRtol,
                   0.0);
    }
    // accumulate adds into what is there: start both from the same values.
    auto want = normals(n, 6);
    out.upload(want);
    cpu::accumulate(want.data(), a.data(), 0.5f, n);
    gpu::accumulate(out.data(), da.data(), 0.5f, n);
    // An fma on one device and not the other: one rounding of a term of size ~1 apart.
    expect_close(label("accumulate", n), out.to_host(), want, kElementwiseRtol, 1e-6);
  }
}

TEST_CASE("column_sum matches the CPU exactly on small integers") {
  for (auto [N, F] : kShapes) {
    const auto d = small_ints(N * F, 7, -3, 3);
    std::vector<float> want(static_cast<size_t>(F));
    cpu::column_sum(want.data(), d.data(), N, F);
    DeviceArray<float> dd(d), out(static_cast<size_t>(F));
    out.poison();
    gpu::column_sum(out.data(), dd.data(), N, F);
    expect_close(label("column_sum", N, F), out.to_host(), want, 0.0, 0.0);
  }
  // Random floats: the two devices add in different orders, so allow float rounding.
  for (auto [N, F] : kShapes) {
    const auto d = normals(N * F, 8);
    std::vector<float> want(static_cast<size_t>(F));
    cpu::column_sum(want.data(), d.data(), N, F);
    DeviceArray<float> dd(d), out(static_cast<size_t>(F));
    out.poison();
    gpu::column_sum(out.data(), dd.data(), N, F);
    // Recursive float summation's error grows with N (Higham's bound is about N eps sum|d|).
    expect_close(label("column_sum (normal)", N, F), out.to_host(), want, 1e-5, 1e-6 * double(N) + 1e-6);
  }
}

TEST_CASE("sum_forward and broadcast_scalar_backward match the CPU") {
  for (int64_t n : kSizes) {
    const auto exact = small_ints(n, 9, -3, 3);  // partial sums stay far below 2^24: exact
    float want = kNaN;
    cpu::sum_forward(&want, exact.data(), n);
    DeviceArray<float> in(exact), out(1);
    out.poison();
    gpu::sum_forward(out.data(), in.data(), n);
    expect_close(label("sum_forward", n), out.to_host(), {want}, 0.0, 0.0);

    const auto values = normals(n, 10);
    double abs_sum = 0.0;
    for (float v : values) abs_sum += std::fabs(v);
    cpu::sum_forward(&want, values.data(), n);
    in.upload(values);
    out.poison();
    gpu::sum_forward(out.data(), in.data(), n);
    // float rounding of two different summation orders, bounded by the mass summed
    expect_close(label("sum_forward (normal)", n), out.to_host(), {want}, 0.0, 1e-5 * abs_sum + 1e-6);

    // Deterministic: the same input gives the same bits.
    const float first = out.to_host()[0];
    gpu::sum_forward(out.data(), in.data(), n);
    CHECK(std::memcmp(&first, out.to_host().data(), sizeof(float)) == 0);

    const float dout = 1.75f;
    std::vector<float> want_din(static_cast<size_t>(n));
    cpu::broadcast_scalar_backward(want_din.data(), &dout, 0.25f, n);
    DeviceArray<float> ddout(std::vector<float>{dout}), din(static_cast<size_t>(n));
    din.poison();
    gpu::broadcast_scalar_backward(din.data(), ddout.data(), 0.25f, n);
    expect_close(label("broadcast_scalar_backward", n), din.to_host(), want_din, 0.0, 0.0);
  }
}

TEST_CASE("argmax_forward matches the CPU, ties and NaN included") {
  for (auto [N, C] : kShapes) {
    // Few distinct values: many ties, which the first index must win.
    auto in = small_ints(N * C, 11, 0, 4);
    if (N * C > 40) in[37] = kNaN;  // a NaN is the largest (torch.argmax)
    std::vector<int64_t> want(static_cast<size_t>(N), -7);
    cpu::argmax_forward(want.data(), in.data(), N, C);
    DeviceArray<float> din(in);
    DeviceArray<int64_t> out(static_cast<size_t>(N));
    out.poison();
    gpu::argmax_forward(out.data(), din.data(), N, C);
    const auto got = out.to_host();
    size_t bad = 0;
    for (size_t r = 0; r < got.size(); ++r) bad += got[r] != want[r];
    CHECK_MESSAGE(bad == 0, label("argmax_forward", N, C) << ": " << bad << " rows differ");
  }
}

TEST_CASE("relu forward and backward match the CPU, NaN included") {
  for (int64_t n : kSizes) {
    auto in = normals(n, 12);
    if (n > 3) {
      in[1] = kNaN;
      in[2] = 0.0f;
      in[3] = -0.0f;
    }
    const auto dout = normals(n, 13);
    std::vector<float> want(in.size()), want_din(in.size());
    cpu::relu_forward(want.data(), in.data(), n);
    cpu::relu_backward(want_din.data(), dout.data(), in.data(), n);
    DeviceArray<float> din_(in), ddout(dout), out(in.size()), din(in.size());
    out.poison();
    din.poison();
    gpu::relu_forward(out.data(), din_.data(), n);
    gpu::relu_backward(din.data(), ddout.data(), din_.data(), n);
    expect_close(label("relu_forward", n), out.to_host(), want, 0.0, 0.0);
    expect_close(label("relu_backward", n), din.to_host(), want_din, 0.0, 0.0);
  }
}

TEST_CASE("matmul matches the CPU for shapes off every tile, all transposes, beta 0 and 1") {
  struct Dims { int64_t M, K, N; };
  const std::vector<Dims> dims = {{33, 17, 5}, {1, 1, 1},    {5, 17, 33},  {0, 3, 4},   {3, 0, 4},
                                  {3, 4, 0},   {257, 255, 129}, {64, 784, 256}, {1025, 33, 7}, {4097, 8, 4097}};
  for (const Dims& d : dims) {
    // Stored shapes change with the transposes, element counts do not.
    const auto a = normals(d.M * d.K, 14), b = normals(d.K * d.N, 15), c0 = normals(d.M * d.N, 16);
    for (bool trans_a : {false, true}) {
      for (bool trans_b : {false, true}) {
        for (float beta : {0.0f, 1.0f}) {
          std::vector<float> want = c0;
          cpu::matmul(want.data(), a.data(), b.data(), d.M, d.K, d.N, trans_a, trans_b, beta);
          // The rounding bound: 1e-5 * (|a| . |b|), computed by the CPU kernel itself.
          std::vector<float> abs_a(a), abs_b(b), bound(c0.size());
          for (float& v : abs_a) v = std::fabs(v);
          for (float& v : abs_b) v = std::fabs(v);
          cpu::matmul(bound.data(), abs_a.data(), abs_b.data(), d.M, d.K, d.N, trans_a, trans_b, 0.0f);
          for (size_t i = 0; i < bound.size(); ++i) bound[i] = 1e-5f * bound[i] + (beta != 0.0f ? 1e-6f * std::fabs(c0[i]) : 0.0f);

          DeviceArray<float> da(a), db(b), out(c0.size());
          if (beta == 0.0f)
            out.poison();  // beta 0 must overwrite, NaN included
          else
            out.upload(c0);
          gpu::matmul(out.data(), da.data(), db.data(), d.M, d.K, d.N, trans_a, trans_b, beta);
          expect_within("matmul [" + std::to_string(d.M) + "x" + std::to_string(d.K) + "] . [" + std::to_string(d.K) +
                            "x" + std::to_string(d.N) + "] trans_a=" + std::to_string(trans_a) +
                            " trans_b=" + std::to_string(trans_b) + " beta=" + std::to_string(int(beta)),
                        out.to_host(), want, bound);
        }
      }
    }
  }
}

TEST_CASE("matmul_16bit with a row bias adds it inside the float32 sum: one rounding, as torch's addmm") {
  // x = [1, 1], W^T = [[1], [0.75 u]], bias = [0.5 u], u the spacing at 1: the exact 1 + 1.25 u
  // rounds to 1 + u (rounding the product first, then the sum, would give the tie's even 1 + 2 u).
  // Then K = 0: the bias alone.
  for (const DType format : {DType::BFloat16, DType::Float16}) {
    const float u = format == DType::BFloat16 ? 0x1p-7f : 0x1p-10f;
    const std::vector<float> x = {1, 1}, w = {1, 0.75f * u}, bias = {0.5f * u};
    std::vector<uint16_t> x16(2), w16(2), bias16(1);
    cpu::float_to_16bit(x16.data(), x.data(), format, 1.0f, 2);
    cpu::float_to_16bit(w16.data(), w.data(), format, 1.0f, 2);
    cpu::float_to_16bit(bias16.data(), bias.data(), format, 1.0f, 1);
    DeviceArray<uint16_t> dx(x16), dw(w16), dbias(bias16), out(size_t{1});
    out.poison();
    gpu::matmul_16bit(out.data(), dx.data(), dw.data(), dbias.data(), format, 1, 2, 1, false, true);
    std::vector<uint16_t> got16 = out.to_host();
    float got = 0;
    cpu::float_from_16bit(&got, got16.data(), format, 1);
    CAPTURE(format);
    CHECK(got == 1 + u);
    DeviceArray<uint16_t> rows(size_t{3});
    rows.poison();
    gpu::matmul_16bit(rows.data(), dx.data(), dw.data(), dbias.data(), format, 3, 0, 1, false, true);
    got16 = rows.to_host();
    CHECK(got16 == std::vector<uint16_t>(3, bias16[0]));  // K = 0: every row is the bias
    // [3, 2] zeros times [2, 5]: every row of the product is the bias, element for element,
    // so a bias laid along the wrong dimension shows.
    const std::vector<float> wide_bias = {0.5f, -1.25f, 3.0f, 0.0f, 7.5f};
    std::vector<uint16_t> zeros16(6, 0), b16(10), row16(5);
    cpu::float_to_16bit(b16.data(), normals(10, 26).data(), format, 1.0f, 10);
    cpu::float_to_16bit(row16.data(), wide_bias.data(), format, 1.0f, 5);
    DeviceArray<uint16_t> dzeros(zeros16), db(b16), drow(row16), grid(size_t{15});
    grid.poison();
    gpu::matmul_16bit(grid.data(), dzeros.data(), db.data(), drow.data(), format, 3, 2, 5, false, false);
    std::vector<uint16_t> want_grid;
    for (int r = 0; r < 3; ++r) want_grid.insert(want_grid.end(), row16.begin(), row16.end());
    CHECK(grid.to_host() == want_grid);
  }
}

TEST_CASE("matmul_16bit (cublasGemmEx, float32 sums) is the product of the rounded operands within a 16-bit rounding") {
  struct Dims { int64_t M, K, N; };
  const std::vector<Dims> dims = {{33, 17, 5}, {1, 1, 1}, {0, 3, 4}, {3, 0, 4}, {257, 255, 129}, {64, 784, 256}};
  for (const DType format : {DType::BFloat16, DType::Float16}) {
    // bfloat16 keeps 8 significant bits, float16 11: one rounding of the output is half a unit.
    const float rounding = format == DType::BFloat16 ? 1.0f / 256 : 1.0f / 2048;
    for (const Dims& d : dims) {
      const auto a = normals(d.M * d.K, 24), b = normals(d.K * d.N, 25);
      std::vector<uint16_t> a16(a.size()), b16(b.size());
      cpu::float_to_16bit(a16.data(), a.data(), format, 1.0f, d.M * d.K);
      cpu::float_to_16bit(b16.data(), b.data(), format, 1.0f, d.K * d.N);
      std::vector<float> a_rounded(a.size()), b_rounded(b.size());
      cpu::float_from_16bit(a_rounded.data(), a16.data(), format, d.M * d.K);
      cpu::float_from_16bit(b_rounded.data(), b16.data(), format, d.K * d.N);
      for (bool trans_a : {false, true}) {
        for (bool trans_b : {false, true}) {
          // The reference: float32 GEMM of the rounded operands; the bound: one output rounding
          // plus float32 reordering, both relative to |a| . |b|.
          std::vector<float> want(static_cast<size_t>(d.M * d.N)), bound(want.size());
          cpu::matmul(want.data(), a_rounded.data(), b_rounded.data(), d.M, d.K, d.N, trans_a, trans_b, 0.0f);
          std::vector<float> abs_a(a_rounded), abs_b(b_rounded);
          for (float& v : abs_a) v = std::fabs(v);
          for (float& v : abs_b) v = std::fabs(v);
          cpu::matmul(bound.data(), abs_a.data(), abs_b.data(), d.M, d.K, d.N, trans_a, trans_b, 0.0f);
          for (size_t i = 0; i < bound.size(); ++i) bound[i] = rounding * std::fabs(want[i]) + 1e-5f * bound[i];
          DeviceArray<uint16_t> da(a16), db(b16), out(want.size());
          out.poison();
          gpu::matmul_16bit(out.data(), da.data(), db.data(), nullptr, format, d.M, d.K, d.N, trans_a, trans_b);
          const std::vector<uint16_t> got16 = out.to_host();
          std::vector<float> got(got16.size());
          cpu::float_from_16bit(got.data(), got16.data(), format, static_cast<int64_t>(got.size()));
          expect_within(std::string(format == DType::BFloat16 ? "bf16" : "fp16") + " matmul_16bit [" +
                            std::to_string(d.M) + "x" + std::to_string(d.K) + "] . [" + std::to_string(d.K) + "x" +
                            std::to_string(d.N) + "] trans_a=" + std::to_string(trans_a) +
                            " trans_b=" + std::to_string(trans_b),
                        got, want, bound);
        }
      }
    }
  }
}

TEST_CASE("mse forward and backward match the CPU for every reduction") {
  for (int64_t n : kSizes) {
    // 0/1 values: squared differences are 0 or 1 and their sum is exact in float32.
    const auto input = small_ints(n, 17, 0, 1), target = small_ints(n, 18, 0, 1);
    const auto dout_none = normals(n, 19);
    DeviceArray<float> din_(input), dtarget(target);
    for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
      const size_t out_size = r == Reduction::None ? input.size() : 1;
      std::vector<float> want(out_size, kNaN);
      cpu::mse_forward(want.data(), input.data(), target.data(), n, r);
      DeviceArray<float> out(out_size);
      out.poison();
      gpu::mse_forward(out.data(), din_.data(), dtarget.data(), n, r);
      expect_close(label("mse_forward", n) + " " + name(r), out.to_host(), want, kElementwiseRtol, 0.0);

      const std::vector<float> dout = r == Reduction::None ? dout_none : std::vector<float>{1.5f};
      std::vector<float> want_din(input.size());
      cpu::mse_backward(want_din.data(), dout.data(), input.data(), target.data(), n, r);
      DeviceArray<float> ddout(dout), dinput(input.size());
      dinput.poison();
      gpu::mse_backward(dinput.data(), ddout.data(), din_.data(), dtarget.data(), n, r);
      expect_close(label("mse_backward", n) + " " + name(r), dinput.to_host(), want_din, kElementwiseRtol, 0.0);
    }
  }
}

TEST_CASE("cross_entropy forward and backward match the CPU for every reduction") {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{0, 10}, {1, 1},    {255, 10},  {256, 3},   {257, 1025},
                                                           {1025, 10}, {65537, 10}, {1, 65537}, {4099, 4097}};
  for (auto [N, C] : shapes) {
    auto logits = normals(N * C, 20, 3.0f);
    if (N > 2 && C > 1) {  // widely spread and huge logits: the stable log-softmax stays finite
      logits[0] = 80.0f;
      logits[static_cast<size_t>(C)] = 1e30f;
    }
    std::vector<int64_t> target(static_cast<size_t>(N));
    Generator gen(21);
    for (int64_t& t : target) t = static_cast<int64_t>(gen.randint(static_cast<uint64_t>(C)));
    DeviceArray<float> dlogits_in(logits);
    const auto dout_none = normals(N, 22);
    // Then every third row labelled ignore_index (-100): left out of the loss and the mean's
    // count, a zero gradient, the divisor counted on the device.
    for (bool with_ignored : {false, true}) {
      if (with_ignored)
        for (size_t i = 0; i < target.size(); i += 3) target[i] = -100;
      DeviceArray<int64_t> dtarget(target);
      // Then label smoothing and per-class weights (0.5 .. 2), with and without a per-row gradient.
      struct Variant {
        Reduction reduction;
        float smoothing;
        bool weighted;
      };
      std::vector<float> class_weights(static_cast<size_t>(C));
      for (size_t c = 0; c < class_weights.size(); ++c)
        class_weights[c] = 0.5f + 1.5f * static_cast<float>(c % 7) / 6;
      DeviceArray<float> dweight(class_weights);
      for (const Variant& variant :
           {Variant{Reduction::None, 0.0f, false}, Variant{Reduction::Mean, 0.0f, false},
            Variant{Reduction::Sum, 0.0f, false}, Variant{Reduction::None, 0.1f, false},
            Variant{Reduction::Mean, 0.25f, false}, Variant{Reduction::Mean, 0.0f, true},
            Variant{Reduction::None, 0.0f, true}, Variant{Reduction::Mean, 0.1f, true}}) {
        const Reduction r = variant.reduction;
        const float smoothing = variant.smoothing;
        const float* host_weight = variant.weighted ? class_weights.data() : nullptr;
        const float* device_weight = variant.weighted ? dweight.data() : nullptr;
        const size_t out_size = r == Reduction::None ? static_cast<size_t>(N) : 1;
        std::vector<float> want(out_size, kNaN), want_probs(logits.size(), kNaN);
        cpu::cross_entropy_forward(want.data(), want_probs.data(), logits.data(), target.data(), host_weight,
                                   N, C, /*ignore_index=*/-100, smoothing, r);
        DeviceArray<float> out(out_size), probs(logits.size());
        out.poison();
        probs.poison();
        gpu::cross_entropy_forward(out.data(), probs.data(), dlogits_in.data(), dtarget.data(), device_weight,
                                   N, C, /*ignore_index=*/-100, smoothing, r);
        const std::string what = label("cross_entropy", N, C) + " " + name(r) +
                                 (with_ignored ? " ignoring" : "") + " label_smoothing " +
                                 std::to_string(smoothing) + (variant.weighted ? " weighted" : "");
        expect_close(what + " loss", out.to_host(), want, 1e-5, 1e-6);
        expect_close(what + " probs", probs.to_host(), want_probs, 1e-5, 1e-7);

        // Backward from the same probs on both devices: then the arithmetic is the same too.
        const std::vector<float> dout = r == Reduction::None ? dout_none : std::vector<float>{0.75f};
        std::vector<float> want_dlogits(logits.size());
        cpu::cross_entropy_backward(want_dlogits.data(), dout.data(), probs.to_host().data(), target.data(),
                                    host_weight, N, C, /*ignore_index=*/-100, smoothing, r);
        DeviceArray<float> ddout(dout), dlogits(logits.size());
        dlogits.poison();
        gpu::cross_entropy_backward(dlogits.data(), ddout.data(), probs.data(), dtarget.data(), device_weight,
                                    N, C, /*ignore_index=*/-100, smoothing, r);
        expect_close(what + " dlogits", dlogits.to_host(), want_dlogits, 1e-6, 0.0);
      }
    }
  }
}

// Counted targets whose weights sum to 0: the Mean is NaN and so is every counted row's
// gradient, with label smoothing too (torch's 0 / 0); the ignored row's gradient stays 0.
TEST_CASE(
    "cross_entropy on CUDA with counted weights summing to 0: a NaN Mean and NaN gradients, as the CPU") {
  const int64_t N = 5, C = 4;
  const auto logits = normals(N * C, 41, 2.0f);
  const std::vector<int64_t> target = {0, 0, -100, 0, 0};
  const std::vector<float> class_weights = {0.0f, 1.0f, 1.0f, 2.0f};
  DeviceArray<float> dlogits_in(logits), dweight(class_weights);
  DeviceArray<int64_t> dtarget(target);
  for (const float smoothing : {0.0f, 0.2f}) {
    CAPTURE(smoothing);
    std::vector<float> want(1, 7.0f), want_probs(logits.size(), 7.0f);
    cpu::cross_entropy_forward(want.data(), want_probs.data(), logits.data(), target.data(),
                               class_weights.data(), N, C, -100, smoothing, Reduction::Mean);
    REQUIRE(std::isnan(want[0]));
    DeviceArray<float> out(std::vector<float>{7.0f}), probs(std::vector<float>(logits.size(), 7.0f));
    gpu::cross_entropy_forward(out.data(), probs.data(), dlogits_in.data(), dtarget.data(), dweight.data(), N,
                               C, -100, smoothing, Reduction::Mean);
    CHECK(std::isnan(out.to_host()[0]));
    const std::vector<float> dout = {1.0f};
    std::vector<float> want_dlogits(logits.size(), 7.0f);
    cpu::cross_entropy_backward(want_dlogits.data(), dout.data(), probs.to_host().data(), target.data(),
                                class_weights.data(), N, C, -100, smoothing, Reduction::Mean);
    DeviceArray<float> ddout(dout), dlogits(std::vector<float>(logits.size(), 7.0f));
    gpu::cross_entropy_backward(dlogits.data(), ddout.data(), probs.data(), dtarget.data(), dweight.data(), N,
                                C, -100, smoothing, Reduction::Mean);
    const std::vector<float> got = dlogits.to_host();
    for (int64_t i = 0; i < N * C; ++i) {
      CAPTURE(i);
      const bool ignored = i / C == 2;
      CHECK(ignored ? want_dlogits[i] == 0.0f : std::isnan(want_dlogits[i]));
      CHECK(ignored ? got[i] == 0.0f : std::isnan(got[i]));
    }
  }
}

TEST_CASE(
    "log_softmax and nll_loss on CUDA match the CPU, special values and ignored or out-of-range targets "
    "included") {
  // Outputs start at 7, not NaN (poison()): an entry the kernel never wrote would pass where NaN
  // is expected. Shapes with one lane pass per row, several, and several blocks.
  for (const std::pair<int64_t, int64_t>& shape :
       std::vector<std::pair<int64_t, int64_t>>{{6, 5}, {9, 33}, {257, 1025}}) {
    const int64_t N = shape.first, C = shape.second;
    CAPTURE(N);
    CAPTURE(C);
    auto logits = normals(N * C, 31, 3.0f);
    logits[1 * C + 2] = -INFINITY;  // row 1: one -inf (its entry -inf, the row finite)
    for (int64_t c = 0; c < C; ++c) logits[2 * C + c] = -INFINITY;  // row 2: NaN
    logits[3 * C + 4] = INFINITY;                                   // row 3: NaN
    logits[4 * C + 0] = kNaN;                                       // row 4: NaN
    const std::vector<float> sevens(logits.size(), 7.0f);
    DeviceArray<float> din(logits), out(sevens);
    std::vector<float> want(logits.size());
    cpu::log_softmax_forward(want.data(), logits.data(), N, C);
    gpu::log_softmax_forward(out.data(), din.data(), N, C);
    expect_close(label("log_softmax_forward", N, C), out.to_host(), want, 1e-6, 1e-6);
    const auto dout = normals(N * C, 32);
    std::vector<float> want_dx(logits.size());
    cpu::log_softmax_backward(want_dx.data(), dout.data(), want.data(), N, C);
    DeviceArray<float> ddout(dout), dy(want), dx(sevens);
    gpu::log_softmax_backward(dx.data(), ddout.data(), dy.data(), N, C);
    expect_close(label("log_softmax_backward", N, C), dx.to_host(), want_dx, 1e-5, 1e-6);

    // nll_loss: a weight, an ignored row (2), every reduction, with and without the weight; then
    // targets out of range, which the CPU refuses and CUDA gives a NaN row and a zero gradient;
    // then every row ignored.
    const auto log_probs = normals(N * C, 33);
    std::vector<float> weight(static_cast<size_t>(C));
    for (int64_t c = 0; c < C; ++c) weight[c] = 0.5f + 0.25f * static_cast<float>(c % 7);
    std::vector<int64_t> target(static_cast<size_t>(N));
    for (int64_t r = 0; r < N; ++r) target[r] = (r * 7) % C;
    target[2] = -100;
    DeviceArray<float> dlog_probs(log_probs), dweight(weight);
    DeviceArray<int64_t> dtarget(target);
    for (bool weighted : {true, false}) {
      const float* host_weight = weighted ? weight.data() : nullptr;
      const float* device_weight = weighted ? dweight.data() : nullptr;
      for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
        const std::string what = label("nll_loss", N, C) + " " + name(r) + (weighted ? " weighted" : "");
        const size_t out_size = r == Reduction::None ? static_cast<size_t>(N) : 1;
        std::vector<float> want_loss(out_size);
        cpu::nll_loss_forward(want_loss.data(), log_probs.data(), target.data(), host_weight, N, C, -100, r);
        DeviceArray<float> loss(std::vector<float>(out_size, 7.0f));
        gpu::nll_loss_forward(loss.data(), dlog_probs.data(), dtarget.data(), device_weight, N, C, -100, r);
        expect_close(what + " forward", loss.to_host(), want_loss, 1e-6, 1e-7);
        const std::vector<float> g = r == Reduction::None ? normals(N, 34) : std::vector<float>{0.75f};
        std::vector<float> want_grad(logits.size());
        cpu::nll_loss_backward(want_grad.data(), g.data(), target.data(), host_weight, N, C, -100, r);
        DeviceArray<float> dg(g), grad(sevens);
        gpu::nll_loss_backward(grad.data(), dg.data(), dtarget.data(), device_weight, N, C, -100, r);
        expect_close(what + " backward", grad.to_host(), want_grad, 1e-6, 0.0);
      }
    }
    std::vector<int64_t> bad = target;
    bad[1] = C;
    bad[2] = -1;
    DeviceArray<int64_t> out_of_range(bad);
    DeviceArray<float> rows(std::vector<float>(static_cast<size_t>(N), 7.0f)),
        ones(std::vector<float>(static_cast<size_t>(N), 1.0f)), grad(sevens);
    gpu::nll_loss_forward(rows.data(), dlog_probs.data(), out_of_range.data(), nullptr, N, C, -100,
                          Reduction::None);
    const auto got_rows = rows.to_host();
    CHECK(std::isnan(got_rows[1]));
    CHECK(std::isnan(got_rows[2]));
    CHECK(got_rows[0] == -log_probs[0]);
    gpu::nll_loss_backward(grad.data(), ones.data(), out_of_range.data(), nullptr, N, C, -100,
                           Reduction::None);
    const auto got_grad = grad.to_host();
    for (int64_t c = 0; c < C; ++c) CHECK((got_grad[1 * C + c] == 0.0f && got_grad[2 * C + c] == 0.0f));
    // Under Mean, weighted or not, the bad rows make the divisor NaN: the Mean is NaN, and so is
    // every counted row's target entry of the gradient; the bad rows' stay 0.
    for (const bool weighted : {false, true}) {
      CAPTURE(weighted);
      const float* device_weight = weighted ? dweight.data() : nullptr;
      DeviceArray<float> mean_loss(std::vector<float>{7.0f}), one(std::vector<float>{1.0f}),
          mean_grad(sevens);
      gpu::nll_loss_forward(mean_loss.data(), dlog_probs.data(), out_of_range.data(), device_weight, N, C,
                            -100, Reduction::Mean);
      CHECK(std::isnan(mean_loss.to_host()[0]));
      gpu::nll_loss_backward(mean_grad.data(), one.data(), out_of_range.data(), device_weight, N, C, -100,
                             Reduction::Mean);
      const auto got = mean_grad.to_host();
      CHECK(std::isnan(got[static_cast<size_t>(bad[0])]));  // row 0 is counted
      for (int64_t c = 0; c < C; ++c) CHECK((got[1 * C + c] == 0.0f && got[2 * C + c] == 0.0f));
    }
    DeviceArray<int64_t> all_ignored(std::vector<int64_t>(static_cast<size_t>(N), -100));
    DeviceArray<float> mean(std::vector<float>{7.0f});
    gpu::nll_loss_forward(mean.data(), dlog_probs.data(), all_ignored.data(), dweight.data(), N, C, -100,
                          Reduction::Mean);
    CHECK(std::isnan(mean.to_host()[0]));
  }
}

TEST_CASE("cross_entropy on CUDA: an ignored row's gradient is NaN across a row with a NaN logit, +0 across a finite row") {
  const int64_t N = 2, C = 3;
  const std::vector<float> logits = {kNaN, 0, 1, 1, 2, 3};
  const std::vector<int64_t> target = {-100, -100};
  // dlogits starts at 7, not NaN (poison()): a row the kernel never wrote would pass the NaN check.
  DeviceArray<float> dlogits_in(logits), loss(1), probs(N * C), dlogits(std::vector<float>(N * C, 7.0f)),
      dout(std::vector<float>{1.0f});
  DeviceArray<int64_t> dtarget(target);
  gpu::cross_entropy_forward(loss.data(), probs.data(), dlogits_in.data(), dtarget.data(), nullptr, N, C,
                             -100, 0.0f, Reduction::Sum);
  gpu::cross_entropy_backward(dlogits.data(), dout.data(), probs.data(), dtarget.data(), nullptr, N, C, -100,
                              0.0f, Reduction::Sum);
  const std::vector<float> got = dlogits.to_host();
  for (int64_t c = 0; c < C; ++c) {
    CHECK(std::isnan(got[c]));
    CHECK((got[C + c] == 0.0f && !std::signbit(got[C + c])));
  }
}

TEST_CASE(
    "cross_entropy on CUDA: a target out of range gives a NaN row and a zero gradient, and a NaN Mean") {
  const int64_t N = 4, C = 3;
  const auto logits = normals(N * C, 23);
  const std::vector<int64_t> target = {0, -1, 2, 3};  // rows 1 and 3 are out of range
  DeviceArray<float> dlogits_in(logits), loss(N), probs(N * C), dlogits(N * C);
  DeviceArray<int64_t> dtarget(target);
  loss.poison();
  gpu::cross_entropy_forward(loss.data(), probs.data(), dlogits_in.data(), dtarget.data(), nullptr, N, C,
                             /*ignore_index=*/-100, 0.0f, Reduction::None);
  const auto row_loss = loss.to_host();
  // Rows 0 and 2 against the CPU on those rows alone.
  for (int64_t r : {0, 2}) {
    float want = kNaN;
    std::vector<float> want_probs(C);
    cpu::cross_entropy_forward(&want, want_probs.data(), logits.data() + r * C, target.data() + r, nullptr, 1,
                               C,
                               /*ignore_index=*/-100, 0.0f, Reduction::None);
    expect_close("valid row " + std::to_string(r), {row_loss[r]}, {want}, 1e-6, 0.0);
  }
  CHECK(std::isnan(row_loss[1]));
  CHECK(std::isnan(row_loss[3]));

  DeviceArray<float> dout(std::vector<float>{1.0f, 1.0f, 1.0f, 1.0f});
  dlogits.poison();
  gpu::cross_entropy_backward(dlogits.data(), dout.data(), probs.data(), dtarget.data(), nullptr, N, C,
                              /*ignore_index=*/-100, 0.0f, Reduction::None);
  const auto grad = dlogits.to_host();
  for (int64_t c = 0; c < C; ++c) {
    CHECK(grad[1 * C + c] == 0.0f);
    CHECK(grad[3 * C + c] == 0.0f);
    CHECK(!std::isnan(grad[0 * C + c]));
  }

  // Under Mean the bad rows make the divisor NaN, weighted or not: the Mean and every counted
  // row's gradient are NaN, the bad rows' gradients stay 0.
  DeviceArray<float> dweight(std::vector<float>{0.5f, 1.0f, 2.0f}), one(std::vector<float>{1.0f});
  for (const bool weighted : {false, true}) {
    CAPTURE(weighted);
    const float* weight = weighted ? dweight.data() : nullptr;
    DeviceArray<float> mean(std::vector<float>{7.0f}), mean_grad(std::vector<float>(N * C, 7.0f));
    gpu::cross_entropy_forward(mean.data(), probs.data(), dlogits_in.data(), dtarget.data(), weight, N, C,
                               /*ignore_index=*/-100, 0.0f, Reduction::Mean);
    CHECK(std::isnan(mean.to_host()[0]));
    gpu::cross_entropy_backward(mean_grad.data(), one.data(), probs.data(), dtarget.data(), weight, N, C,
                                /*ignore_index=*/-100, 0.0f, Reduction::Mean);
    const auto got = mean_grad.to_host();
    for (int64_t c = 0; c < C; ++c) {
      CHECK(std::isnan(got[0 * C + c]));
      CHECK(std::isnan(got[2 * C + c]));
      CHECK(got[1 * C + c] == 0.0f);
      CHECK(got[3 * C + c] == 0.0f);
    }
  }
}

TEST_CASE("sgd_step matches the CPU for every option, first and later steps") {
  struct Case { const char* name; SgdConfig config; };
  const std::vector<Case> cases = {
      {"plain", {0.1f, 0.0f, 1.0f, 0.0f, false}},
      {"weight decay", {0.05f, 0.0f, 1.0f, 1e-2f, false}},
      {"momentum", {0.1f, 0.9f, 1.0f, 0.0f, false}},
      {"momentum dampening decay", {0.1f, 0.9f, 0.9f, 1e-4f, false}},
      {"nesterov", {0.1f, 0.9f, 1.0f, 1e-4f, true}},
      {"maximize nesterov", {0.1f, 0.9f, 1.0f, 1e-4f, true, /*maximize=*/true}},
  };
  for (int64_t n : kSizes) {
    const auto param0 = normals(n, 24), buffer0 = normals(n, 25), grad = normals(n, 26);
    for (const Case& c : cases) {
      auto param = param0, buffer = buffer0;
      const bool with_buffer = c.config.momentum != 0.0f;
      DeviceArray<float> dparam(param), dbuffer(buffer), dgrad(grad);
      for (bool first_step : {true, false}) {
        cpu::sgd_step(param.data(), with_buffer ? buffer.data() : nullptr, grad.data(), n, c.config, first_step);
        gpu::sgd_step(dparam.data(), with_buffer ? dbuffer.data() : nullptr, dgrad.data(), n, c.config, first_step);
        const std::string what = label("sgd_step", n) + " " + c.name + (first_step ? " first" : " second");
        // Either compiler may fuse a*b + c into an fma: a rounding of a term of size ~1 apart.
        expect_close(what + " param", dparam.to_host(), param, 1e-6, 1e-6);
        if (with_buffer) expect_close(what + " buffer", dbuffer.to_host(), buffer, 1e-6, 1e-6);
      }
    }
  }
}

TEST_CASE("adam_step matches the CPU for Adam, AdamW and amsgrad over three steps") {
  struct Case {
    const char* name;
    float l2, param_scale;
    bool amsgrad, maximize;
  };
  const std::vector<Case> cases = {
      {"adam", 0.0f, 1.0f, false, false},
      {"adam l2 amsgrad", 1e-2f, 1.0f, true, false},
      {"adamw", 0.0f, 1.0f - 1e-3f * 1e-2f, false, false},
      {"adamw maximize", 0.0f, 1.0f - 1e-3f * 1e-2f, false, true},
  };
  for (int64_t n : kSizes) {
    const auto param0 = normals(n, 27);
    for (const Case& c : cases) {
      auto param = param0;
      std::vector<float> m(static_cast<size_t>(n), 0.0f), v = m, vmax = m;
      DeviceArray<float> dparam(param), dm(m), dv(v), dvmax(vmax);
      for (int t = 1; t <= 3; ++t) {
        const auto grad = normals(n, 28 + static_cast<uint64_t>(t), 1.0f / static_cast<float>(t));
        DeviceArray<float> dgrad(grad);
        AdamConfig config;
        config.l2 = c.l2;
        config.param_scale = c.param_scale;
        config.amsgrad = c.amsgrad;
        config.maximize = c.maximize;
        config.step_size = static_cast<float>(1e-3 / (1.0 - std::pow(0.9, t)));
        config.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(0.999, t)));
        cpu::adam_step(param.data(), m.data(), v.data(), c.amsgrad ? vmax.data() : nullptr, grad.data(), n, config);
        gpu::adam_step(dparam.data(), dm.data(), dv.data(), c.amsgrad ? dvmax.data() : nullptr, dgrad.data(), n, config);
        const std::string what = label("adam_step", n) + " " + c.name + " step " + std::to_string(t);
        // fma contraction may differ between the compilers: a rounding or two of each term.
        expect_close(what + " param", dparam.to_host(), param, 1e-6, 1e-6);
        expect_close(what + " exp_avg", dm.to_host(), m, 1e-6, 1e-7);
        expect_close(what + " exp_avg_sq", dv.to_host(), v, 1e-6, 1e-9);
      }
    }
  }
}

TEST_CASE("kernels index past 2^31 elements") {
  const int64_t edge = int64_t(1) << 31;
  const int64_t n = edge + 7;  // 8 GiB of float32
  std::unique_ptr<DeviceArray<float>> array;
  try {
    array = std::make_unique<DeviceArray<float>>(static_cast<size_t>(n));
  } catch (const DeviceError& e) {
    MESSAGE("skipped: this GPU cannot hold 8 GiB: ", e.what());
    return;
  }
  float* a = array->data();
  // Elements [first, first + count) back on the host.
  auto read = [&](int64_t first, int64_t count) {
    std::vector<float> host(static_cast<size_t>(count));
    gpu::copy(host.data(), a + first, host.size() * sizeof(float), gpu::CopyKind::DeviceToHost);
    return host;
  };
  auto write = [&](int64_t index, float value) {
    gpu::copy(a + index, &value, sizeof(float), gpu::CopyKind::HostToDevice);
  };
  const std::vector<int64_t> probes = {0, edge - 1, edge, edge + 1, n - 1};

  gpu::fill(a, 1.5f, n);
  for (int64_t i : probes) CHECK_MESSAGE(read(i, 1)[0] == 1.5f, "fill at ", i);
  gpu::scalar_forward(a, a, ScalarOp::Mul, 2.0f, n);
  for (int64_t i : probes) CHECK_MESSAGE(read(i, 1)[0] == 3.0f, "scalar_forward at ", i);
  gpu::accumulate(a, a, 1.0f, n);  // a += a
  for (int64_t i : probes) CHECK_MESSAGE(read(i, 1)[0] == 6.0f, "accumulate at ", i);
  CHECK(read(edge - 3, 10) == std::vector<float>(10, 6.0f));

  // Zeros but for three ones, two of them past 2^31: the sum is exactly 3.
  gpu::fill(a, 0.0f, n);
  write(5, 1.0f);
  write(edge + 1, 1.0f);
  write(n - 1, 1.0f);
  DeviceArray<float> total(1);
  gpu::sum_forward(total.data(), a, n);
  CHECK(total.to_host()[0] == 3.0f);
  // argmax over rows that end past 2^31: 2^31 + 2 = 812825 rows of 2642 columns, so the last
  // row ends at element edge + 1, which holds a one. Many short rows keep every warp busy (one
  // row of n columns would be one warp walking 8 GiB).
  const int64_t rows = 812825, cols = 2642;
  static_assert(812825LL * 2642 == (1LL << 31) + 2);
  DeviceArray<int64_t> index(static_cast<size_t>(rows));
  gpu::argmax_forward(index.data(), a, rows, cols);
  const std::vector<int64_t> argmax = index.to_host();
  CHECK(argmax[0] == 5);
  CHECK(argmax[static_cast<size_t>(rows / 2)] == 0);
  CHECK(argmax[static_cast<size_t>(rows - 1)] == cols - 1);
  write(n - 1, 2.0f);
  gpu::relu_forward(a, a, n);
  CHECK(read(n - 2, 2) == std::vector<float>{0.0f, 2.0f});
}

}  // namespace

#endif  // NANODDP_WITH_CUDA
