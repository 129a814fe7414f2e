// Autocast (Note [Autocast] in core/autocast.h): one case per rule, gradients through the
// casts against central differences, autocast off bit for bit float32, nesting, the 16-bit
// GEMM against a float64 reference, and Fashion-MNIST trained in bfloat16 and float16.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <vector>

#include "core/autograd.h"
#include "core/half.h"
#include "core/memory.h"
#include "core/ops.h"
#include "core/random.h"
#include "data/fashion_mnist.h"
#include "dist/grad_scaler.h"
#include "kernels/kernels.h"
#include "nn/activation_checkpoint.h"
#include "nn/activations.h"
#include "nn/autocast.h"
#include "nn/batch_norm.h"
#include "nn/conv.h"
#include "nn/dropout.h"
#include "nn/layers.h"
#include "nn/normalization.h"
#include "nn/optim.h"
#include "tests/address_sanitizer.h"
#include "tests/batches.h"

using namespace nanoddp;

namespace {

std::vector<float> values(const Tensor& t) { return t.detach().to(DType::Float32).to_vector(); }

float bf16(float x) { return BFloat16::from_float(x).to_float(); }

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::shared_ptr<nn::Sequential> make_mlp(uint64_t seed, int64_t in, int64_t hidden, int64_t out) {
  Generator gen(seed);
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Linear(in, hidden, gen));
  model->add(nn::ReLU());
  model->add(nn::Linear(hidden, out, gen));
  return model;
}

}  // namespace

TEST_CASE("to(dtype) rounds to nearest even, widens exactly, and casts the gradient back") {
  Tensor x = Tensor::from_vector({1.0f, 1.0f / 3.0f, 65520.0f, -0.1f}).set_requires_grad(true);
  const Tensor b = x.to(DType::BFloat16);
  CHECK(b.dtype() == DType::BFloat16);
  CHECK(values(b) == std::vector<float>{1.0f, 0.333984375f, 65536.0f, -0.10009765625f});
  const Tensor h = x.to(DType::Float16);
  CHECK(values(h)[1] == 0.333251953125f);
  CHECK(std::isinf(values(h)[2]));  // past 65504 is infinity in float16
  CHECK(values(h.to(DType::BFloat16))[0] == 1.0f);
  CHECK(x.to(DType::Float32).is_same(x));
  CHECK(b.detach().to_vector() ==
        std::vector<float>{1.0f, 0.333984375f, 65536.0f, -0.10009765625f});  // tolist
  CHECK(h.detach().at({1}) == 0.333251953125f);
  CHECK(b.detach().at({3}) == -0.10009765625f);
  sum(mul(b, 3.0f)).backward();
  REQUIRE(x.grad().defined());
  CHECK(x.grad().dtype() == DType::Float32);
  CHECK(x.grad().to_vector() == std::vector<float>{3.0f, 3.0f, 3.0f, 3.0f});
  CHECK_THROWS_AS(x.to(DType::Int64), ValueError);
  CHECK_THROWS_AS(Tensor::from_vector(std::vector<int64_t>{1, 2}).to(DType::BFloat16), ValueError);
}

TEST_CASE("backward from a 16-bit output casts its gradient to the output's dtype, as torch's engine") {
  for (DType dtype : {DType::BFloat16, DType::Float16}) {
    CAPTURE(dtype);
    // y = 3 * bf16(x): x.grad is 3 whichever float dtype the given gradient has.
    for (DType grad_dtype : {DType::Float32, DType::BFloat16, DType::Float16}) {
      Tensor x = Tensor::from_vector({1, 2, 3, 4, 5, 6, 7, 8}).set_requires_grad(true);
      const Tensor y = mul(x.to(dtype), 3.0f);
      y.backward(Tensor::ones({8}).to(grad_dtype));
      REQUIRE(x.grad().defined());
      CHECK(x.grad().dtype() == DType::Float32);
      CHECK(x.grad().to_vector() == std::vector<float>(8, 3.0f));
    }
    // A one-element 16-bit output seeds with 1; linear's backward reads a 16-bit gradient.
    Tensor x = Tensor::from_vector({1, 2, 3}, {1, 3}).set_requires_grad(true);
    Tensor w = Tensor::from_vector({0.5f, -1, 2}, {1, 3}).set_requires_grad(true);
    sum(linear(x.to(dtype), w.to(dtype), Tensor())).to(dtype).backward();
    CHECK(w.grad().to_vector() == std::vector<float>{1, 2, 3});
    CHECK(x.grad().to_vector() == std::vector<float>{0.5f, -1, 2});
    Tensor z = linear(x.to(dtype), w.to(dtype), Tensor());
    z.backward(Tensor::from_vector({2.0f}, {1, 1}));
    CHECK(w.grad().to_vector() == std::vector<float>{3, 6, 9});
  }
  Tensor x = Tensor::from_vector({1, 2}).set_requires_grad(true);
  CHECK_THROWS_WITH_AS(mul(x, 2.0f).backward(Tensor::from_vector(std::vector<int64_t>{1, 1})),
                       doctest::Contains("gradient must be float32, float16 or bfloat16, got int64"),
                       ValueError);
}

TEST_CASE("autocast: linear and matmul cast float32 operands by recorded ops and return the 16-bit dtype") {
  for (const DType dtype : {DType::BFloat16, DType::Float16}) {
    CAPTURE(dtype);
    Tensor x = Tensor::from_vector({1, 2, 3}, {1, 3}).set_requires_grad(true);
    Tensor w = Tensor::from_vector({1, 1, 1, 0.5f, 0.25f, 2}, {2, 3}).set_requires_grad(true);
    Tensor b = Tensor::from_vector({0.1f, 1}).set_requires_grad(true);
    Tensor y, z;
    {
      nn::autocast guard(dtype);
      y = linear(x, w, b);
      z = matmul(x, w.reshape({3, 2}));
    }
    CHECK(y.dtype() == dtype);
    CHECK(z.dtype() == dtype);
    // Row products 6 and 7 are exact; the bias is rounded, then the sum is rounded once more.
    const float b0 = dtype == DType::BFloat16 ? bf16(0.1f) : Float16::from_float(0.1f).to_float();
    const float y0 = dtype == DType::BFloat16 ? bf16(6.0f + b0) : Float16::from_float(6.0f + b0).to_float();
    CHECK(values(y) == std::vector<float>{y0, 8.0f});
    REQUIRE(z.grad_fn());
    CHECK(std::string(z.grad_fn()->name()) == "MatmulBackward");
    for (const Tensor& operand : z.grad_fn()->inputs) {
      CHECK(operand.dtype() == dtype);
      REQUIRE(operand.grad_fn());
      CHECK(std::string(operand.grad_fn()->name()) == "ToDTypeBackward");
    }
    sum(y).backward();
    // Parameters stay float32 and get float32 gradients (exact: small integers and halves).
    CHECK(w.dtype() == DType::Float32);
    CHECK(w.grad().dtype() == DType::Float32);
    CHECK(w.grad().to_vector() == std::vector<float>{1, 2, 3, 1, 2, 3});
    CHECK(b.grad().to_vector() == std::vector<float>{1, 1});
    CHECK(x.grad().dtype() == DType::Float32);
    CHECK(x.grad().to_vector() == std::vector<float>{1.5f, 1.25f, 3.0f});
  }
}

TEST_CASE("autocast: conv2d runs in the 16-bit dtype with float32 weight gradients") {
  Tensor input = Tensor::ones({1, 1, 3, 3});
  Tensor weight = Tensor::from_vector({1, 2, 3, 4}, {1, 1, 2, 2}).set_requires_grad(true);
  Tensor bias = Tensor::from_vector({0.5f}).set_requires_grad(true);
  Tensor out;
  {
    nn::autocast guard(DType::BFloat16);
    out = conv2d(input, weight, bias);
  }
  CHECK(out.dtype() == DType::BFloat16);
  CHECK(values(out) == std::vector<float>{10.5f, 10.5f, 10.5f, 10.5f});
  sum(out).backward();
  CHECK(weight.grad().dtype() == DType::Float32);
  CHECK(weight.grad().to_vector() == std::vector<float>{4, 4, 4, 4});
  CHECK(bias.grad().to_vector() == std::vector<float>{4});
}

TEST_CASE("autocast: reductions, losses and normalisations compute in float32 and return float32") {
  nn::autocast guard(DType::BFloat16);
  Tensor x = Tensor::from_vector({1, 2, 3, 4}, {2, 2}).set_requires_grad(true);
  const Tensor x16 = x.to(DType::BFloat16);
  const Tensor s = sum(x16), m = mean(x16);
  CHECK(s.dtype() == DType::Float32);
  CHECK(s.item() == 10.0f);
  CHECK(m.dtype() == DType::Float32);
  CHECK(m.item() == 2.5f);
  const Tensor mse = mse_loss(x16, Tensor::ones({2, 2}));
  CHECK(mse.dtype() == DType::Float32);
  CHECK(mse.item() == 3.5f);  // (0 + 1 + 4 + 9) / 4
  const Tensor ce = cross_entropy(x16, Tensor::from_vector(std::vector<int64_t>{1, 1}));
  CHECK(ce.dtype() == DType::Float32);
  CHECK(ce.item() == doctest::Approx(std::log1p(std::exp(-1.0))).epsilon(1e-6));
  const Tensor ln = layer_norm(x16, {2}, Tensor(), Tensor(), 0.0f);
  CHECK(ln.dtype() == DType::Float32);
  CHECK(ln.to_vector() == std::vector<float>{-1, 1, -1, 1});
  nn::BatchNorm1d bn(2, 0.0f);
  const Tensor bnorm = bn(x16);
  CHECK(bnorm.dtype() == DType::Float32);
  CHECK(bnorm.to_vector() == std::vector<float>{-1, -1, 1, 1});
  // The cast up is recorded: x's gradient flows through it.
  s.backward();
  CHECK(x.grad().to_vector() == std::vector<float>{1, 1, 1, 1});
}

TEST_CASE("16-bit elementwise ops keep the input's dtype; binary ops promote mixed dtypes to float32") {
  Tensor a = Tensor::from_vector({-1.5f, 2.0f, 0.3f, -0.25f}, {2, 2}).set_requires_grad(true);
  const Tensor a16 = a.to(DType::BFloat16);
  const Tensor one16 = Tensor::ones({2, 2}).to(DType::BFloat16);
  CHECK(relu(a16).dtype() == DType::BFloat16);
  CHECK(values(relu(a16)) == std::vector<float>{0, 2, bf16(0.3f), 0});
  CHECK(add(a16, one16).dtype() == DType::BFloat16);
  CHECK(values(add(a16, one16)) == std::vector<float>{-0.5f, 3.0f, bf16(1.0f + bf16(0.3f)), 0.75f});
  CHECK(add(a16, Tensor::ones({2, 2})).dtype() == DType::Float32);
  CHECK(add(a16, Tensor::ones({2, 2}).to(DType::Float16)).dtype() == DType::Float32);
  CHECK(mul(a16, 2.0f).dtype() == DType::BFloat16);
  CHECK(tanh(a16).dtype() == DType::BFloat16);
  Generator gen(3);
  CHECK(dropout(a16, 0.5f, true, gen).dtype() == DType::BFloat16);
  CHECK(max_pool2d(a16.reshape({1, 1, 2, 2}), 2, 2).dtype() == DType::BFloat16);
  CHECK(values(max_pool2d(a16.reshape({1, 1, 2, 2}), 2, 2)) == std::vector<float>{2.0f});
  sum(relu(a16)).backward();
  CHECK(a.grad().dtype() == DType::Float32);
  CHECK(a.grad().to_vector() == std::vector<float>{0, 1, 1, 0});
}

TEST_CASE("a 16-bit relu, max_pool2d and conv2d keep their 16-bit operands only, with the float32 path's bits") {
  // Note [16-bit elementwise ops]: the graph holds the 16-bit tensors (2 bytes per element)
  // and max_pool2d's int32 indices, no float32 copy; values and gradients are those of the
  // recorded casts around the float32 ops, bit for bit.
  const auto activations = [] { return memory_stats(Device::cpu())[MemoryCategory::Activations]; };
  for (DType dtype : {DType::BFloat16, DType::Float16}) {
    const std::string name = dtype_name(dtype);
    CAPTURE(name);
    Generator gen(7);
    Tensor x = Tensor::randn({2, 3, 10, 10}, gen).set_requires_grad(true);
    Tensor w = Tensor::randn({4, 3, 3, 3}, gen).set_requires_grad(true);
    x.data<float>()[5] = NAN;  // a NaN goes through relu and wins its pooling window
    const Tensor h = x.to(dtype), w16 = w.to(dtype);
    int64_t before = activations();
    const Tensor y = relu(h);
    CHECK(activations() - before == static_cast<int64_t>(y.nbytes()));  // y: relu saves its output
    before = activations();
    const Tensor z = max_pool2d(y, 2, 2);
    CHECK(activations() - before == z.numel() * 4);  // int32 indices; its input y is an edge only
    before = activations();
    const Tensor c = conv2d(z, w16, Tensor(), 1, 1);
    CHECK(activations() - before == static_cast<int64_t>(z.nbytes() + w16.nbytes()));  // both saved
    CHECK((y.dtype() == dtype && z.dtype() == dtype && c.dtype() == dtype));
    // The same ops on float32 copies, with the casts recorded.
    Tensor x2 = x.detach().clone().set_requires_grad(true), w2 = w.detach().clone().set_requires_grad(true);
    const Tensor wide = relu(x2.to(dtype).to(DType::Float32)).to(dtype).to(DType::Float32);
    const Tensor pooled = max_pool2d(wide, 2, 2).to(dtype).to(DType::Float32);
    const Tensor reference = conv2d(pooled, w2.to(dtype).to(DType::Float32), Tensor(), 1, 1).to(dtype);
    CHECK(same_bits(values(c), values(reference)));
    sum(c).backward();
    sum(reference).backward();
    CHECK(same_bits(x.grad().to_vector(), x2.grad().to_vector()));
    CHECK(same_bits(w.grad().to_vector(), w2.grad().to_vector()));
  }
}

TEST_CASE("outside autocast, matmul of mixed dtypes is a ValueError; inside it casts both") {
  const Tensor a = Tensor::ones({2, 2}), b = Tensor::ones({2, 2}).to(DType::BFloat16);
  CHECK_THROWS_AS(matmul(a, b), ValueError);
  CHECK_THROWS_AS(linear(a, b, Tensor()), ValueError);
  // conv2d too, whichever operand is the 16-bit one.
  const Tensor image = Tensor::ones({1, 1, 3, 3}), kernel = Tensor::ones({1, 1, 2, 2});
  const Tensor bias = Tensor::ones({1});
  CHECK_THROWS_AS(conv2d(image, kernel.to(DType::BFloat16), Tensor()), ValueError);
  CHECK_THROWS_AS(conv2d(image, kernel, bias.to(DType::Float16)), ValueError);
  CHECK_THROWS_AS(conv2d(image.to(DType::BFloat16), kernel, Tensor()), ValueError);
  nn::autocast guard(DType::BFloat16);
  CHECK(values(matmul(a, b)) == std::vector<float>{2, 2, 2, 2});
  CHECK(values(conv2d(image, kernel.to(DType::Float16), Tensor())) == std::vector<float>{4, 4, 4, 4});
}

TEST_CASE("a 16-bit tensor used twice sums its two 16-bit gradients") {
  Tensor w = Tensor::from_vector({1, 2}, {1, 2}).set_requires_grad(true);
  const Tensor x = Tensor::from_vector({3, 4}, {1, 2});
  Tensor h;
  {
    nn::autocast guard(DType::BFloat16);
    h = linear(x, w, Tensor());  // [1, 1] = 11
  }
  const Tensor twice = add(h, h);
  CHECK(twice.dtype() == DType::BFloat16);
  CHECK(values(twice) == std::vector<float>{22});
  sum(twice).backward();
  CHECK(w.grad().to_vector() == std::vector<float>{6, 8});
}

TEST_CASE("autocast guards nest, restore the state they found, and refuse non-16-bit dtypes") {
  CHECK_FALSE(autocast_state().enabled);
  const Tensor x = Tensor::ones({1, 2}), w = Tensor::ones({2, 2});
  {
    nn::autocast outer(DType::BFloat16);
    CHECK(linear(x, w, Tensor()).dtype() == DType::BFloat16);
    {
      nn::autocast inner(DType::Float16);
      CHECK(linear(x, w, Tensor()).dtype() == DType::Float16);
      {
        nn::autocast off(DType::BFloat16, false);
        CHECK_FALSE(autocast_state().enabled);
        CHECK(linear(x, w, Tensor()).dtype() == DType::Float32);
      }
      CHECK(autocast_state().dtype == DType::Float16);
    }
    CHECK(autocast_state().enabled);
    CHECK(autocast_state().dtype == DType::BFloat16);
  }
  CHECK_FALSE(autocast_state().enabled);
  CHECK(linear(x, w, Tensor()).dtype() == DType::Float32);
  CHECK_THROWS_AS(static_cast<void>(nn::autocast(DType::Float32)), ValueError);
  CHECK_FALSE(autocast_state().enabled);
}

TEST_CASE("autocast disabled is float32 bit for bit: outputs and gradients") {
  auto model = make_mlp(4, 12, 16, 5);
  Generator gen(9);
  const Tensor x = Tensor::randn({7, 12}, gen);
  const Tensor y = Tensor::from_vector(std::vector<int64_t>{0, 1, 2, 3, 4, 0, 1});
  auto run = [&](bool guarded) {
    for (Tensor& p : model->parameters()) p.set_grad(Tensor());
    Tensor loss;
    if (guarded) {
      nn::autocast off(DType::BFloat16, false);
      loss = cross_entropy((*model)(x), y);
    } else {
      loss = cross_entropy((*model)(x), y);
    }
    loss.backward();
    std::vector<float> all = loss.to_vector();
    for (const Tensor& p : model->parameters()) {
      const std::vector<float> g = p.grad().to_vector();
      all.insert(all.end(), g.begin(), g.end());
    }
    return all;
  };
  CHECK(same_bits(run(false), run(true)));
}

TEST_CASE("gradients through the casts match central differences of the float32 function") {
  auto model = make_mlp(11, 6, 8, 3);
  Generator gen(2);
  const Tensor x = Tensor::randn({5, 6}, gen);
  const Tensor target = Tensor::randn({5, 3}, gen);
  auto loss_of = [&]() { return mse_loss((*model)(x), target, Reduction::Sum); };
  {
    nn::autocast guard(DType::BFloat16);
    loss_of().backward();
  }
  for (Tensor& p : model->parameters()) {
    const std::vector<float> analytic = p.grad().to_vector();
    CHECK(p.grad().dtype() == DType::Float32);
    float largest = 0.0f;
    for (float g : analytic) largest = std::max(largest, std::fabs(g));
    REQUIRE(largest > 0.0f);
    float* data = p.data<float>();
    for (int64_t i = 0; i < p.numel(); ++i) {
      NoGradGuard no_grad;
      // Small enough that no ReLU input crosses 0 (a step of 1e-2 crosses one here: 0.72 for a
      // derivative of 0.65), large enough that the float32 loss's rounding stays far below the
      // tolerance.
      const float kept = data[i], eps = 1e-3f;
      data[i] = kept + eps;
      const double up = loss_of().item();
      data[i] = kept - eps;
      const double down = loss_of().item();
      data[i] = kept;
      const double numeric = (up - down) / (2.0 * eps);
      // bfloat16 keeps 8 significant bits: a few roundings of 0.4% each along the way.
      CHECK(std::fabs(analytic[i] - numeric) <= 0.03 * largest);
    }
  }
}

TEST_CASE("a checkpointed region recomputes under the autocast state of its forward") {
  auto model = make_mlp(5, 6, 8, 3);
  Generator gen(1);
  const Tensor x = Tensor::randn({4, 6}, gen);
  auto grads = [&](bool checkpointed) {
    for (Tensor& p : model->parameters()) p.set_grad(Tensor());
    Tensor out;
    {
      nn::autocast guard(DType::BFloat16);
      out = checkpointed ? nn::checkpoint([&](const Tensor& in) { return (*model)(in); }, x) : (*model)(x);
    }
    CHECK(out.dtype() == DType::BFloat16);
    sum(out).backward();  // outside the guard: the rerun must cast as the forward did
    std::vector<float> all;
    for (const Tensor& p : model->parameters()) {
      const std::vector<float> g = p.grad().to_vector();
      all.insert(all.end(), g.begin(), g.end());
    }
    return all;
  };
  CHECK(same_bits(grads(false), grads(true)));
}

TEST_CASE("a checkpointed region whose input is a 16-bit output of an earlier layer: the same gradients, bit for bit") {
  auto first = make_mlp(5, 6, 6, 6), model = make_mlp(7, 6, 8, 3);
  Generator gen(2);
  const Tensor x = Tensor::randn({4, 6}, gen);
  auto grads = [&](bool checkpointed) {
    for (auto* m : {first.get(), model.get()})
      for (Tensor& p : m->parameters()) p.set_grad(Tensor());
    Tensor out;
    {
      nn::autocast guard(DType::BFloat16);
      const Tensor h = (*first)(x);  // bfloat16, requires grad: the region's input
      REQUIRE(h.dtype() == DType::BFloat16);
      REQUIRE(h.requires_grad());
      out = checkpointed ? nn::checkpoint([&](const Tensor& in) { return (*model)(in); }, h) : (*model)(h);
    }
    sum(out).backward();
    std::vector<float> all;
    for (auto* m : {first.get(), model.get()})
      for (const Tensor& p : m->parameters()) {
        const std::vector<float> g = p.grad().to_vector();
        all.insert(all.end(), g.begin(), g.end());
      }
    return all;
  };
  CHECK(same_bits(grads(false), grads(true)));
}

TEST_CASE("matmul_16bit sums in float32, with the bias, and rounds once: within one 16-bit rounding of float64") {
  Generator gen(6);
  const int64_t M = 5, K = 19, N = 9;
  for (const DType format : {DType::BFloat16, DType::Float16}) {
    for (const bool trans_a : {false, true}) {
      for (const bool trans_b : {false, true}) {
        for (const bool with_bias : {false, true}) {
          CAPTURE(format);
          CAPTURE(trans_a);
          CAPTURE(trans_b);
          CAPTURE(with_bias);
          const Tensor a = Tensor::randn({M * K}, gen).to(format), b = Tensor::randn({K * N}, gen).to(format);
          const Tensor bias = Tensor::randn({N}, gen).to(format);
          Tensor out = Tensor::empty({M * N}, format);
          auto bits = [](const Tensor& t) { return static_cast<uint16_t*>(t.impl()->storage->data()); };
          kernels::cpu::matmul_16bit(bits(out), bits(a), bits(b), with_bias ? bits(bias) : nullptr, format, M, K, N,
                                     trans_a, trans_b);
          const std::vector<float> av = values(a), bv = values(b), ov = values(out), biasv = values(bias);
          for (int64_t m = 0; m < M; ++m) {
            for (int64_t n = 0; n < N; ++n) {
              double ref = with_bias ? double(biasv[n]) : 0.0;
              for (int64_t k = 0; k < K; ++k)
                ref += double(av[trans_a ? k * M + m : m * K + k]) * double(bv[trans_b ? n * K + k : k * N + n]);
              const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(ref), 1e-3)) -
                                                     (format == DType::BFloat16 ? 7 : 10));
              CHECK(std::fabs(ov[m * N + n] - ref) <= ulp);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("a 16-bit linear rounds product and bias together, once, as torch's addmm (bf16: 1.0078125, not 1.015625)") {
  // x = [1, 1], W = [[1, 0.75 u]], b = [0.5 u], u the format's spacing at 1 (2^-7 bf16, 2^-10
  // fp16): the exact 1 + 1.25 u rounds to 1 + u. Rounding the product first gives 1 + u, and
  // then 1 + 1.5 u, a tie, goes to the even 1 + 2 u: torch.nn.functional.linear on bf16 CPU
  // tensors gives 1.0078125, as here.
  for (const DType format : {DType::BFloat16, DType::Float16}) {
    CAPTURE(format);
    const float u = format == DType::BFloat16 ? 0x1p-7f : 0x1p-10f;
    const Tensor x = Tensor::from_vector({1, 1}, {1, 2}), w = Tensor::from_vector({1, 0.75f * u}, {1, 2}),
                 b = Tensor::from_vector({0.5f * u}, {1});
    CHECK(values(linear(x.to(format), w.to(format), b.to(format))) == std::vector<float>{1 + u});
    // Under autocast, float32 operands (master weights) take the same path.
    nn::autocast low(format);
    const Tensor y = linear(x, w, b);
    CHECK(y.dtype() == format);
    CHECK(values(y) == std::vector<float>{1 + u});
  }
}

TEST_CASE("under autocast, linear's bias gradient is the float32 column sum of the 16-bit dout, rounded once") {
  // dL/db = the column sums of dout. Column 0 is [1, u/2, u/2] (u the spacing at 1): summed in
  // float32, 1 + u, which the 16-bit gradient holds exactly; a 16-bit running sum would round
  // 1 + u/2 to 1 (a tie, to even) twice and give 1. Column 1 is [1, 0, 0]. The 16-bit bias the
  // kernel added is a cast of the float32 master bias, which gets the gradient.
  for (const DType format : {DType::BFloat16, DType::Float16}) {
    CAPTURE(format);
    const float u = format == DType::BFloat16 ? 0x1p-7f : 0x1p-10f;
    Tensor b = Tensor::from_vector({0.5f, 0.25f}, {2});
    b.set_requires_grad(true);
    const Tensor x = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {3, 2}), w = Tensor::zeros({2, 2});
    Tensor y;
    {
      nn::autocast low(format);
      y = linear(x, w, b);
    }
    REQUIRE(y.dtype() == format);
    sum(mul(y.to(DType::Float32), Tensor::from_vector({1, 1, u / 2, 0, u / 2, 0}, {3, 2}))).backward();
    REQUIRE(b.grad().defined());
    CHECK(b.grad().dtype() == DType::Float32);
    CHECK(b.grad().to_vector() == std::vector<float>{1 + u, 1});
  }
}

// ---- Fashion-MNIST: bfloat16 autocast trains as well as float32 --------------------------

namespace {

struct TrainResult {
  double accuracy = 0.0;  // percent on the 10,000 test images
  double final_loss = 0.0;
};

// The example's MLP (784-256-128-10), SGD with momentum, batch 64, over the first n_train
// training images for `epochs`, the learning rate falling linearly to 0 (so the last steps
// do not move the weights much and the accuracy is that of a settled model, not of one
// step's noise), then accuracy on the test set, every forward under the given precision
// (Float32: no autocast).
TrainResult train_fashion_mnist(DType precision, int64_t n_train, int epochs) {
  const data::FashionMNIST train, test(data::FashionMNIST::kDefaultRoot, false);
  auto model = testing::make_fashion_mnist_mlp();  // fashion_mnist's default
  nn::SGDOptions sgd;
  sgd.lr = 0.05;
  sgd.momentum = 0.9f;
  nn::SGD opt(model->parameters(), sgd);
  dist::GradScalerOptions scaling;
  scaling.enabled = precision == DType::Float16;  // bfloat16 has float32's range: no scaler
  dist::GradScaler scaler(scaling);
  const bool autocast_on = precision != DType::Float32;
  const DType low = autocast_on ? precision : DType::BFloat16;
  TrainResult result;
  constexpr int64_t kBatch = 64;
  constexpr double kLr = 0.05;
  const int64_t total_steps = epochs * (n_train / kBatch);
  int64_t step = 0;
  std::vector<int64_t> order(static_cast<size_t>(n_train));
  for (int64_t i = 0; i < n_train; ++i) order[i] = i;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    Generator shuffle(100 + epoch);
    for (int64_t i = n_train - 1; i > 0; --i) std::swap(order[i], order[shuffle.randint(i + 1)]);
    for (int64_t start = 0; start + kBatch <= n_train; start += kBatch) {
      const data::Batch batch =
          train.get_batch(std::vector<int64_t>(order.begin() + start, order.begin() + start + kBatch));
      opt.set_lr(kLr * static_cast<double>(total_steps - step++) / static_cast<double>(total_steps));
      opt.zero_grad();
      Tensor logits;
      {
        nn::autocast guard(low, autocast_on);
        logits = (*model)(batch.input);
      }
      const Tensor loss = cross_entropy(logits, batch.target);
      scaler.scale(loss).backward();
      scaler.step(opt);
      scaler.update();
      result.final_loss = loss.item();
    }
  }
  NoGradGuard no_grad;
  int64_t correct = 0;
  for (int64_t start = 0; start < test.size(); start += 1000) {
    std::vector<int64_t> indices;
    for (int64_t i = start; i < std::min(start + 1000, test.size()); ++i) indices.push_back(i);
    const data::Batch batch = test.get_batch(indices);
    Tensor logits;
    {
      nn::autocast guard(low, autocast_on);
      logits = (*model)(batch.input);
    }
    const std::vector<int64_t> predicted = argmax(logits).to_int_vector(), labels = batch.target.to_int_vector();
    for (size_t i = 0; i < labels.size(); ++i) correct += predicted[i] == labels[i];
  }
  result.accuracy = 100.0 * static_cast<double>(correct) / static_cast<double>(test.size());
  return result;
}

// Under AddressSanitizer (tools/sanitize) the three trainings below take minutes, past the
// unit suite's time limit: that build skips the case (kUnderAddressSanitizer), which the
// default build runs.

}  // namespace

TEST_CASE("Fashion-MNIST MLP: bfloat16 autocast, and float16 with GradScaler, within 0.5 points of float32" *
          doctest::skip(kUnderAddressSanitizer)) {
  if (!std::filesystem::exists(std::string(data::FashionMNIST::kDefaultRoot) + "/train-images-idx3-ubyte.gz")) {
    MESSAGE("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist): nothing to train on");
    return;
  }
  const int64_t n_train = 60000;
  const int epochs = 1;
  const TrainResult fp32 = train_fashion_mnist(DType::Float32, n_train, epochs);
  const TrainResult bf16_run = train_fashion_mnist(DType::BFloat16, n_train, epochs);
  const TrainResult fp16_run = train_fashion_mnist(DType::Float16, n_train, epochs);
  MESSAGE("test accuracy: float32 ", fp32.accuracy, "%, bfloat16 ", bf16_run.accuracy, "%, float16 ",
          fp16_run.accuracy, "%");
  CHECK(fp32.accuracy > 80.0);  // the comparison means something only if training worked
  CHECK(std::fabs(bf16_run.accuracy - fp32.accuracy) <= 0.5);
  CHECK(std::fabs(fp16_run.accuracy - fp32.accuracy) <= 0.5);
}
