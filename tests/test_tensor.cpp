#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/half_convert.h"
#include "core/memory.h"
#include "core/ops.h"
#include "core/random.h"
#include "core/tensor.h"
#include "kernels/device_memory.h"

using namespace nanoddp;

TEST_CASE("an error's message, location and what(); message_of leaves the location out, except for a bug") {
  const auto thrown = [](auto raise) -> std::string {
    try {
      raise();
    } catch (const std::exception& e) {
      return std::string(e.what()) + "|" + message_of(e);
    }
    return "nothing thrown";
  };
  const int line = __LINE__ + 1;
  const auto shape = [] { NANODDP_THROW(ShapeError, "mse_loss: input ", Shape({2, 3}), " and target ", 4); };
  CHECK(thrown(shape) == "mse_loss: input [2, 3] and target 4 (" + std::string(__FILE__) + ":" + std::to_string(line) +
                             ")|mse_loss: input [2, 3] and target 4");
  // An error that wraps another carries one location: its own.
  const auto wrapped = [] {
    try {
      NANODDP_THROW(IOError, "checkpoint a.ckpt: truncated at byte 12");
    } catch (const Error& e) {
      NANODDP_THROW(IOError, "cannot resume: ", message_of(e));
    }
  };
  const std::string wrapped_text = thrown(wrapped);
  CHECK(wrapped_text.find("cannot resume: checkpoint a.ckpt: truncated at byte 12 (") == 0);
  CHECK(wrapped_text.find(".cpp:", wrapped_text.find(".cpp:") + 1) == std::string::npos);
  CHECK(wrapped_text.substr(wrapped_text.find('|')) == "|cannot resume: checkpoint a.ckpt: truncated at byte 12");
  // A broken invariant is a bug: its location stays in what the user sees.
  const std::string bug = thrown([] { NANODDP_ASSERT(1 + 1 == 3); });
  CHECK(bug.find("internal assertion failed: 1 + 1 == 3 (") == 0);
  CHECK(bug.substr(bug.find('|')).find(".cpp:") != std::string::npos);
  // Made without a location, what() is the message alone; other exceptions keep their what().
  CHECK(thrown([] { throw ValueError("no location"); }) == "no location|no location");
  CHECK(thrown([] { throw std::runtime_error("plain"); }) == "plain|plain");
}

TEST_CASE("factories give the values they promise") {
  CHECK(Tensor::zeros({2, 3}).to_vector() == std::vector<float>(6, 0.0f));
  CHECK(Tensor::ones({4}).to_vector() == std::vector<float>(4, 1.0f));
  CHECK(Tensor::full({2}, 2.5f).to_vector() == std::vector<float>{2.5f, 2.5f});
  CHECK(Tensor::arange(4).to_vector() == std::vector<float>{0, 1, 2, 3});
  CHECK(Tensor::zeros({3}, DType::Int64).to_int_vector() == std::vector<int64_t>{0, 0, 0});
  const Tensor v = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  CHECK(v.shape() == Shape{2, 3});
  CHECK(v.at({1, 2}) == 6.0f);
  CHECK(v.at({0, 1}) == 2.0f);
  CHECK(Tensor::from_vector({7.0f}).shape() == Shape{1});
  CHECK(Tensor::scalar(7.0f).shape() == Shape{});
  CHECK(Tensor::scalar(7.0f).item() == 7.0f);
  CHECK_THROWS_AS(Tensor::from_vector({1, 2, 3}, {2, 2}), ShapeError);
}

TEST_CASE("rand and randn are reproducible from the seed and have the right moments") {
  Generator g1(7), g2(7), g3(8);
  const Tensor a = Tensor::randn({1000}, g1);
  CHECK(a.to_vector() == Tensor::randn({1000}, g2).to_vector());
  CHECK(a.to_vector() != Tensor::randn({1000}, g3).to_vector());
  double mean = 0, var = 0;
  for (float x : a.to_vector()) mean += x / 1000.0;
  for (float x : a.to_vector()) var += (x - mean) * (x - mean) / 1000.0;
  CHECK(std::abs(mean) < 0.1);  // 3 standard errors of 1/sqrt(1000)
  CHECK(std::abs(var - 1.0) < 0.15);
  Generator g4(1);
  for (float u : Tensor::rand({1000}, g4).to_vector()) {
    CHECK(u >= 0.0f);
    CHECK(u < 1.0f);
  }
}

TEST_CASE("reshape shares storage and checks the element count") {
  Tensor a = Tensor::arange(6);
  Tensor b = a.reshape({2, 3});
  CHECK(b.shape() == Shape{2, 3});
  CHECK(a.reshape({-1, 2}).shape() == Shape{3, 2});
  b.fill_(1.0f);
  CHECK(a.to_vector() == std::vector<float>(6, 1.0f));
  CHECK_THROWS_AS(a.reshape({4, 2}), ShapeError);
  CHECK_THROWS_AS(a.reshape({-1, -1}), ShapeError);
  // The known sizes multiply past int64 (2^62 * 4 wraps to 0); -1 must not be inferred from that.
  CHECK_THROWS_AS(a.reshape({int64_t{1} << 62, 4, -1}), ShapeError);
  CHECK_THROWS_AS(a.reshape({-1, -2}), ShapeError);
}

TEST_CASE("slice_view: a range of another tensor's memory, at its offset for ops, copies and backward") {
  Tensor flat = Tensor::arange(12);
  Tensor v = flat.slice_view(2, {2, 3});  // elements 2..7
  CHECK(v.shape() == Shape{2, 3});
  CHECK(v.to_vector() == std::vector<float>{2, 3, 4, 5, 6, 7});
  CHECK(v.at({1, 0}) == 5.0f);
  CHECK(v.storage_offset() == 2);
  CHECK(v.reshape({6}).storage_offset() == 2);
  CHECK(flat.storage_offset() == 0);
  CHECK(v.is_alias_of(flat));
  CHECK(flat.is_alias_of(v));
  CHECK_FALSE(v.is_alias_of(Tensor::arange(12)));
  CHECK_FALSE(v.clone().is_alias_of(flat));
  CHECK_FALSE(v.requires_grad());
  // A view of a view counts from the allocation.
  Tensor w = v.slice_view(3, {2});  // elements 5, 6
  CHECK(w.storage_offset() == 5);
  CHECK(w.to_vector() == std::vector<float>{5, 6});
  CHECK(w.is_alias_of(flat));
  // Writes go both ways, and only into the range.
  w.fill_(-1.0f);
  CHECK(flat.to_vector() == std::vector<float>{0, 1, 2, 3, 4, -1, -1, 7, 8, 9, 10, 11});
  v.copy_(Tensor::full({2, 3}, 9.0f));
  CHECK(flat.to_vector() == std::vector<float>{0, 1, 9, 9, 9, 9, 9, 9, 8, 9, 10, 11});
  flat.copy_(Tensor::arange(12));
  CHECK(v.to_vector() == std::vector<float>{2, 3, 4, 5, 6, 7});
  // Kernels read from the view's first element: rows (2, 3, 4) and (5, 6, 7).
  CHECK(matmul(v, Tensor::ones({3, 1})).to_vector() == std::vector<float>{9, 18});
  CHECK(sum(w).item() == 11.0f);
  CHECK((v + v).to_vector() == std::vector<float>{4, 6, 8, 10, 12, 14});
  // The view keeps the memory alive after the tensor it was cut from is gone.
  Tensor survivor = Tensor::arange(4).slice_view(1, {2});
  CHECK(survivor.to_vector() == std::vector<float>{1, 2});
  CHECK_THROWS_AS(flat.slice_view(10, {3}), IndexError);
  CHECK_THROWS_AS(flat.slice_view(-1, {2}), IndexError);
  CHECK_THROWS_AS(flat.slice_view(0, {13}), IndexError);
}

TEST_CASE("a .grad that is a slice_view accumulates in place; a view is never taken over as a first .grad") {
  Tensor buffer = Tensor::full({8}, 100.0f);
  Tensor x = Tensor::from_vector({1, 2, 3}).set_requires_grad(true);
  x.set_grad(buffer.slice_view(4, {3}));
  sum(x * x).backward();  // d/dx = 2x, added to the 100s already there
  CHECK(x.grad().is_alias_of(buffer));
  CHECK(buffer.to_vector() == std::vector<float>{100, 100, 100, 100, 102, 104, 106, 100});
  // A gradient handed over as a view of someone's memory is copied into a .grad of its own.
  Tensor y = Tensor::from_vector({1, 2}).set_requires_grad(true);
  y.backward(buffer.slice_view(0, {2}));
  CHECK(y.grad().to_vector() == std::vector<float>{100, 100});
  CHECK_FALSE(y.grad().is_alias_of(buffer));
}

TEST_CASE("element counts and byte sizes never wrap around") {
  // 2^32 x 2^32 = 2^64 wraps to 0: unchecked, a tensor would claim 2^64 elements in 0 bytes.
  CHECK_THROWS_AS(Tensor::zeros({int64_t{1} << 32, int64_t{1} << 32}), ShapeError);
  // 2^62 x 3 wraps to a negative product.
  CHECK_THROWS_AS(Shape({int64_t{1} << 62, 3}), ShapeError);
  // A zero size makes the product 0, but the other sizes must still multiply within int64.
  CHECK_THROWS_AS(Shape({0, int64_t{1} << 32, int64_t{1} << 32}), ShapeError);
  try {
    Shape({int64_t{1} << 40, int64_t{1} << 40});
    FAIL("expected ShapeError");
  } catch (const ShapeError& e) {
    CHECK(std::string(e.what()).find("[1099511627776, 1099511627776]") != std::string::npos);
  }
  // The largest products that fit are exact.
  CHECK(Shape({int64_t{1} << 31, int64_t{1} << 31}).numel() == int64_t{1} << 62);
  CHECK(Shape({0, int64_t{1} << 31, int64_t{1} << 31}).numel() == 0);
  CHECK(Shape({3, 5, 7, 11}).numel() == 1155);
  // Elements fit but bytes do not: 2^61 int64 elements are 2^64 bytes.
  CHECK_THROWS_AS(Tensor::empty({int64_t{1} << 61}, DType::Int64), ShapeError);
  CHECK(checked_mul(int64_t{1} << 31, int64_t{1} << 31, "test") == int64_t{1} << 62);
  CHECK_THROWS_AS(checked_mul(int64_t{1} << 32, int64_t{1} << 31, "test"), ShapeError);
}

TEST_CASE("element access is checked") {
  const Tensor a = Tensor::zeros({2, 2});
  CHECK_THROWS_AS(a.at({2, 0}), IndexError);
  CHECK_THROWS_AS(a.at({0}), IndexError);
  CHECK_THROWS_AS(a.item(), ValueError);
  // item() is a float; item_int() keeps an integer past 2^24 exact (torch's item() gives an int).
  const Tensor big = Tensor::from_vector(std::vector<int64_t>{16777217});
  CHECK(big.item() == 16777216.0f);
  CHECK(big.item_int() == 16777217);
  CHECK_THROWS_AS(Tensor::scalar(1.0f).item_int(), ValueError);
  CHECK_THROWS_AS(Tensor::zeros({2}, DType::Int64).item_int(), ValueError);
  CHECK_THROWS_AS(a.data<int64_t>(), ValueError);
  CHECK_THROWS_AS(Tensor().shape(), ValueError);
  CHECK_THROWS_AS(a.size(2), IndexError);
  CHECK(a.size(-1) == 2);
}

TEST_CASE("to(cpu) on a CPU tensor is the same tensor; clone is a copy; copy_ copies") {
  Tensor a = Tensor::ones({3});
  CHECK(a.to(Device::cpu()).is_same(a));
  Tensor c = a.clone();
  c.fill_(2.0f);
  CHECK(a.to_vector() == std::vector<float>(3, 1.0f));
  a.copy_(c);
  CHECK(a.to_vector() == std::vector<float>(3, 2.0f));
  CHECK_THROWS_AS(a.copy_(Tensor::zeros({4})), ShapeError);
  // Views of one allocation: disjoint ones copy, the same elements are left, a partial overlap
  // is refused as torch's t[2:8].copy_(t[0:6]) is (memcpy over overlapping bytes is undefined).
  Tensor t = Tensor::from_vector({0, 1, 2, 3, 4, 5, 6, 7});
  t.slice_view(4, {4}).copy_(t.slice_view(0, {4}));
  CHECK(t.to_vector() == std::vector<float>{0, 1, 2, 3, 0, 1, 2, 3});
  t.slice_view(2, {3}).copy_(t.slice_view(2, {3}));
  CHECK(t.to_vector() == std::vector<float>{0, 1, 2, 3, 0, 1, 2, 3});
  CHECK_THROWS_WITH_AS(
      t.slice_view(2, {6}).copy_(t.slice_view(0, {6})),
      doctest::Contains("elements [2, 8)) and the source (elements [0, 6)) of one allocation overlap"),
      ValueError);
  CHECK(t.to_vector() == std::vector<float>{0, 1, 2, 3, 0, 1, 2, 3});
  // A range past the end is named by its start and size, whatever they are.
  CHECK_THROWS_WITH_AS(t.slice_view(INT64_MAX, {1}),
                       doctest::Contains("slice_view of 1 elements from element 9223372036854775807"),
                       IndexError);
  // An undefined operand is named as such, whatever the other's dtype.
  CHECK_THROWS_WITH_AS(add(Tensor::ones({2}).to(DType::Float16), Tensor()),
                       doctest::Contains("add: b is undefined"), ValueError);
}

TEST_CASE("printing shows shape, dtype, device and values") {
  const std::string s = Tensor::from_vector({1.5f, 2}, {1, 2}).str();
  CHECK(s == "Tensor(shape=[1, 2], dtype=float32, device=cpu, values=[1.5, 2])");
  const std::string big = Tensor::zeros({20}).str();
  CHECK(big.find("... (20 in all)") != std::string::npos);
  // NaN prints as torch prints it, whatever its sign bit (0/0 sets it on x86): the mean of
  // an empty batch reads "nan", not "-nan".
  const float negative_nan = -std::numeric_limits<float>::quiet_NaN();
  REQUIRE(std::signbit(negative_nan));
  CHECK(Tensor::from_vector({negative_nan, std::numeric_limits<float>::quiet_NaN(), -INFINITY}, {3}).str() ==
        "Tensor(shape=[3], dtype=float32, device=cpu, values=[nan, nan, -inf])");
  CHECK(mean(Tensor::zeros({0, 3})).str() == "Tensor(shape=[], dtype=float32, device=cpu, values=[nan])");
}

TEST_CASE("devices parse and print as torch.device does") {
  CHECK(Device::parse("cpu") == Device::cpu());
  CHECK(Device::parse("cuda") == Device::cuda(0));
  CHECK(Device::parse("cuda:3") == Device::cuda(3));
  CHECK(Device::cuda(1).str() == "cuda:1");
  CHECK_THROWS_AS(Device::parse("gpu"), ValueError);
  CHECK_THROWS_AS(Device::parse("cuda:x"), ValueError);
}

TEST_CASE("a CUDA tensor in a build or machine without a GPU gives a clear DeviceError") {
  if (kernels::cuda::device_count() > 0) return;  // this machine has a GPU: nothing to check
  try {
    Tensor::zeros({2}, DType::Float32, Device::cuda(0));
    FAIL("expected DeviceError");
  } catch (const DeviceError& e) {
    CHECK(std::string(e.what()).size() > 10);
  }
}

TEST_CASE("bulk float16 conversions and sums equal the scalar ones bit for bit: every half, every rounding edge") {
  const std::string path = float16_uses_f16c() ? "F16C" : "scalar code";
  MESSAGE("bulk float16 conversions run on ", path);
  auto bits = [](float f) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    return x;
  };
  // Every one of the 65,536 halves to float32 (+3: a tail past the 8-wide loop).
  std::vector<Float16> halves(0x10000 + 3);
  for (size_t i = 0; i < halves.size(); ++i) halves[i].bits = static_cast<uint16_t>(i);
  std::vector<float> widened(halves.size());
  floats_from_float16(widened.data(), halves.data(), static_cast<int64_t>(halves.size()));
  int widen_mismatches = 0;
  for (size_t i = 0; i < halves.size(); ++i) {
    const float scalar = halves[i].to_float();
    widen_mismatches += std::isnan(scalar) ? !std::isnan(widened[i]) : bits(widened[i]) != bits(scalar);
  }
  CHECK(widen_mismatches == 0);
  // Back to float16: each finite half's value, its float32 neighbours, the exact midpoint to
  // the next half (a tie) and that midpoint's neighbours; then the ends of the range.
  std::vector<float> floats;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const Float16 half{static_cast<uint16_t>(h)};
    const float f = half.to_float();
    if (!std::isfinite(f)) continue;
    const float next = Float16{static_cast<uint16_t>(h + 1)}.to_float();
    floats.push_back(f);
    floats.push_back(std::nextafter(f, INFINITY));
    floats.push_back(std::nextafter(f, -INFINITY));
    if (std::isfinite(next) && std::abs(next) > std::abs(f)) {
      const float tie = f + (next - f) / 2;  // exact: one more mantissa bit than a half has
      floats.push_back(tie);
      floats.push_back(std::nextafter(tie, INFINITY));
      floats.push_back(std::nextafter(tie, -INFINITY));
    }
  }
  for (float f : {65504.0f, 65519.996f, 65520.0f, 65536.0f, 1e30f, INFINITY, std::ldexp(1.0f, -25),
                  std::ldexp(1.0f, -26), std::ldexp(3.0f, -26), 1e-30f, 0.0f})
    for (float sign : {1.0f, -1.0f}) floats.push_back(sign * f);
  floats.push_back(std::nanf(""));
  std::vector<Float16> rounded(floats.size());
  float16_from_floats(rounded.data(), floats.data(), static_cast<int64_t>(floats.size()));
  int round_mismatches = 0;
  for (size_t i = 0; i < floats.size(); ++i) {
    const Float16 scalar = Float16::from_float(floats[i]);
    round_mismatches += std::isnan(floats[i]) ? !std::isnan(rounded[i].to_float()) : rounded[i].bits != scalar.bits;
  }
  CHECK(floats.size() > 6 * 60000);
  CHECK(round_mismatches == 0);
  // NaNs, quiet and signalling, with payloads: the same bits whether an element falls in an
  // 8-wide block or in the tail (9 copies of each).
  std::vector<float> nans;
  for (uint32_t pattern : {0x7fc00000u, 0x7fc00001u, 0x7fffffffu, 0x7f808000u, 0x7f800001u, 0xffa5a000u})
    for (int copy = 0; copy < 9; ++copy) {
      float f;
      std::memcpy(&f, &pattern, sizeof f);
      nans.push_back(f);
    }
  std::vector<Float16> rounded_nans(nans.size());
  float16_from_floats(rounded_nans.data(), nans.data(), static_cast<int64_t>(nans.size()));
  for (size_t i = 0; i < nans.size(); ++i) {
    CAPTURE(i);
    CHECK(rounded_nans[i].bits == Float16::from_float(nans[i]).bits);
    CHECK((rounded_nans[i].bits & 0x7e00u) == 0x7e00u);  // a quiet NaN
  }
  CHECK(Float16::from_float(nans[27]).bits == 0x7e04u);  // 0x7f808000: the payload's top bits kept
  // Sums of two halves, in place as the backends do them: every finite half plus a spread of others.
  std::vector<Float16> a, b;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if (!std::isfinite(Float16{static_cast<uint16_t>(h)}.to_float())) continue;
    a.push_back(Float16{static_cast<uint16_t>(h)});
    b.push_back(Float16{static_cast<uint16_t>((h * 40503u + 7u) & 0xffffu)});
  }
  std::vector<Float16> expected(a.size());
  for (size_t i = 0; i < a.size(); ++i) expected[i] = Float16::from_float(a[i].to_float() + b[i].to_float());
  float16_add(a.data(), a.data(), b.data(), static_cast<int64_t>(a.size()));
  int sum_mismatches = 0;
  for (size_t i = 0; i < a.size(); ++i)
    sum_mismatches += std::isnan(expected[i].to_float()) ? !std::isnan(a[i].to_float()) : a[i].bits != expected[i].bits;
  CHECK(sum_mismatches == 0);
}

TEST_CASE("float16 and bfloat16 round to nearest, ties to even, as torch's .to(float16/bfloat16)") {
  // Bit patterns of 0.1 as torch prints them (torch.tensor(0.1).half().view(torch.int16)).
  CHECK(Float16::from_float(0.1f).bits == 0x2e66);
  CHECK(BFloat16::from_float(0.1f).bits == 0x3dcd);
  const float u = std::ldexp(1.0f, -10);  // float16's spacing at 1: 10 mantissa bits
  CHECK(Float16::from_float(1 + u / 2).to_float() == 1.0f);            // tie: stays even
  CHECK(Float16::from_float(1 + 3 * u / 2).to_float() == 1 + 2 * u);   // tie: rounds up to even
  CHECK(Float16::from_float(1 + u / 2 + u / 64).to_float() == 1 + u);  // above the tie
  CHECK(Float16::from_float(65519.0f).to_float() == 65504.0f);         // largest finite
  CHECK(std::isinf(Float16::from_float(65520.0f).to_float()));         // the tie above it
  CHECK(Float16::from_float(std::ldexp(1.0f, -25)).to_float() == 0.0f);                  // half the smallest subnormal
  CHECK(Float16::from_float(std::ldexp(3.0f, -25)).to_float() == std::ldexp(1.0f, -23));  // 1.5 of it: to even
  CHECK(Float16::from_float(-std::ldexp(1.0f, -14)).to_float() == -std::ldexp(1.0f, -14));  // smallest normal
  CHECK(std::isnan(Float16::from_float(std::nanf("")).to_float()));
  const float v = std::ldexp(1.0f, -7);  // bfloat16's spacing at 1: 7 mantissa bits
  CHECK(BFloat16::from_float(1 + v / 2).to_float() == 1.0f);
  CHECK(BFloat16::from_float(1 + 3 * v / 2).to_float() == 1 + 2 * v);
  CHECK(BFloat16::from_float(3.0e38f).to_float() == std::ldexp(1.0f, 127) * 1.765625f);  // float32's range
  CHECK(std::isnan(BFloat16::from_float(std::nanf("")).to_float()));
  // Every float16 survives the round trip through float32.
  int mismatches = 0;
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const Float16 h{static_cast<uint16_t>(bits)};
    const float f = h.to_float();
    if (!std::isnan(f) && Float16::from_float(f).bits != h.bits) ++mismatches;
  }
  CHECK(mismatches == 0);
  CHECK(Tensor::ones({3}, DType::Float16).nbytes() == 6);
  CHECK(Tensor::ones({1}, DType::BFloat16).item() == 1.0f);
}

TEST_CASE(
    "memory_stats().cached: a freed large block is kept for reuse, counted there, and empty_cache gives it "
    "back") {
  empty_cache();
  CHECK(memory_stats(Device::cpu()).cached == 0);
  const int64_t live_before = memory_stats(Device::cpu()).live_total;
  {
    Tensor big = Tensor::zeros({300000});  // 1,200,000 bytes: a cached size (64 KiB and more)
    CHECK(memory_stats(Device::cpu()).live_total == live_before + 1200000);
    CHECK(memory_stats(Device::cpu()).cached == 0);
  }
  // Freed: no longer live, but still the process's memory.
  CHECK(memory_stats(Device::cpu()).live_total == live_before);
  CHECK(memory_stats(Device::cpu()).cached == 1200000);
  {
    Tensor again = Tensor::zeros({300000});  // the same size takes the cached block
    CHECK(memory_stats(Device::cpu()).cached == 0);
  }
  Tensor small = Tensor::zeros({1000});  // 4,000 bytes: below the cache's 64 KiB, never cached
  small = Tensor();
  CHECK(memory_stats(Device::cpu()).cached == 1200000);
  empty_cache();
  CHECK(memory_stats(Device::cpu()).cached == 0);
  CHECK(memory_stats(Device::cpu()).live_total == live_before);
}
