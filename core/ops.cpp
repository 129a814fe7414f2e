// Differentiable ops: each forward, then its Node with the backward formula right below.
#include "core/ops.h"

#include <cmath>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/op_helpers.h"

namespace nanoddp {

using kernels::BinaryOp;
using kernels::ScalarOp;

namespace {

// Rows of an [..., F] tensor: the product of all sizes but the last.
int64_t leading_rows(const Tensor& t) {
  int64_t rows = 1;
  for (int d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return rows;
}

// out = a (op) b over [rows, F]; b is [F] when broadcast.
Tensor binary(const Tensor& a, const Tensor& b, BinaryOp op, bool broadcast) {
  Tensor out = empty_like(a);
  const int64_t F = broadcast ? b.numel() : a.numel();
  const int64_t rows = F == 0 ? 0 : a.numel() / F;
  NANODDP_DISPATCH(a.device(), binary_forward, ptr(out), ptr(a), ptr(b), op, rows, F, broadcast);
  return out;
}

Tensor scaled(const Tensor& a, ScalarOp op, float s) {
  Tensor out = empty_like(a);
  NANODDP_DISPATCH(a.device(), scalar_forward, ptr(out), ptr(a), op, s, a.numel());
  return out;
}

// d: [rows, F] -> [F]
Tensor column_sum(const Tensor& d, int64_t F) {
  Tensor out = Tensor::empty({F}, DType::Float32, d.device());
  const int64_t rows = F == 0 ? 0 : d.numel() / F;
  NANODDP_DISPATCH(d.device(), column_sum, ptr(out), ptr(d), rows, F);
  return out;
}

// Whether b broadcasts over a's rows; throws ShapeError for anything but equal shapes or
// b: [F] against a: [..., F].
bool broadcast_of(const char* op, const Tensor& a, const Tensor& b) {
  check_float(op, a, "a");
  check_float(op, b, "b");
  check_same_device(op, a, b);
  if (a.shape() == b.shape()) return false;
  const bool row = b.dim() == 1 && a.dim() >= 1 && a.size(-1) == b.size(0);
  NANODDP_CHECK(row, ShapeError, op, ": shapes ", a.shape(), " and ", b.shape(),
                " must be equal, or the second must be [F] with F the first's last size");
  return true;
}

// out = op(a) · op(b) in out's dtype, which a and b share: float32 (beta as kernels::matmul) or
// 16-bit (beta 0; summed in float32 with row_bias when given, rounded once:
// kernels::matmul_16bit). A float32 row_bias is the caller's to add.
void gemm(const Tensor& out, const Tensor& a, const Tensor& b, int64_t M, int64_t K, int64_t N, bool trans_a,
          bool trans_b, float beta, const Tensor& row_bias = Tensor()) {
  if (out.dtype() == DType::Float32) {
    NANODDP_ASSERT(!row_bias.defined());
    NANODDP_DISPATCH(a.device(), matmul, ptr(out), ptr(a), ptr(b), M, K, N, trans_a, trans_b, beta);
  } else {
    NANODDP_ASSERT(beta == 0.0f);
    NANODDP_DISPATCH(a.device(), matmul_16bit, bits16(out), bits16(a), bits16(b),
                     row_bias.defined() ? bits16(row_bias) : nullptr, out.dtype(), M, K, N, trans_a, trans_b);
  }
}

// The dtype of a binary op's output (Note [16-bit elementwise ops]): one dtype stays; mixed
// float dtypes promote to float32.
DType promoted(const Tensor& a, const Tensor& b) { return a.dtype() == b.dtype() ? a.dtype() : DType::Float32; }

}  // namespace

// ---- matmul -------------------------------------------------------------------------------

namespace {
// What a product's backward reads, for save_for_backward: b's gradient reads a, and a's reads
// b, so each is saved only when the other needs a gradient (undefined otherwise).
std::vector<Tensor> product_operands(const Tensor& a, const Tensor& b) {
  return {b.requires_grad() ? a : Tensor(), a.requires_grad() ? b : Tensor()};
}

struct MatmulBackward : Node {
  // inputs: a [M, K], b [K, N]; saved: a when b needs a gradient, b when a does
  std::vector<Tensor> apply(const Tensor& dout) override {
    const Tensor& a = inputs[0];
    const Tensor& b = inputs[1];
    const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
    Tensor da, db;
    if (a.requires_grad()) {  // da = dout · b^T
      da = empty_same(a);
      gemm(da, dout, saved(1), M, N, K, false, true, 0.0f);
    }
    if (b.requires_grad()) {  // db = a^T · dout
      db = empty_same(b);
      gemm(db, saved(0), dout, K, M, N, true, false, 0.0f);
    }
    return {da, db};
  }
  const char* name() const override { return "MatmulBackward"; }
};
}  // namespace

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  ForwardSpan span("matmul", {&a_in, &b_in});
  const Tensor a = autocast_operand(a_in), b = autocast_operand(b_in);  // Note [Autocast]
  check_floating("matmul", a, "a");
  check_floating("matmul", b, "b");
  check_same_dtype("matmul", a, b);
  check_same_device("matmul", a, b);
  NANODDP_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), ShapeError, "matmul: a ", a.shape(),
                " and b ", b.shape(), " do not chain ([M, K] · [K, N])");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  Tensor out = Tensor::empty({M, N}, a.dtype(), a.device());
  gemm(out, a, b, M, K, N, false, false, 0.0f);
  auto node = std::make_shared<MatmulBackward>();
  node->inputs = {a, b};
  node->save_for_backward(product_operands(a, b));
  return make_result(out, node);
}

// ---- linear -------------------------------------------------------------------------------

namespace {
struct LinearBackward : Node {
  // inputs: input [N, in], weight [out, in], bias [out] (may be undefined); saved: input
  // when weight needs a gradient, weight when input does
  std::vector<Tensor> apply(const Tensor& dout) override {
    const Tensor& input = inputs[0];
    const Tensor& weight = inputs[1];
    const Tensor& bias = inputs[2];
    const int64_t out_features = weight.size(0), in_features = weight.size(1);
    const int64_t N = leading_rows(input);
    Tensor dinput, dweight, dbias;
    if (input.requires_grad()) {  // dinput = dout · weight
      dinput = empty_same(input);
      gemm(dinput, dout, saved(1), N, out_features, in_features, false, false, 0.0f);
    }
    // A 16-bit bias's gradient is summed in float32 and rounded once, as add's would be
    // (Note [16-bit elementwise ops]).
    if (bias.defined() && bias.requires_grad())
      dbias = rounded_to(column_sum(widened(dout), out_features), dout.dtype());
    if (weight.requires_grad()) {  // dweight = dout^T · input, added into .grad when offered, last
      const Tensor& into = accumulation_target(1);  // Note [Accumulating into .grad]
      dweight = into.defined() ? into : empty_same(weight);
      std::unique_lock<std::mutex> lock;
      if (into.defined()) lock = lock_grads();
      gemm(dweight, dout, saved(0), out_features, N, in_features, true, false, into.defined() ? 1.0f : 0.0f);
    }
    return {dinput, dweight, dbias};
  }
  const char* name() const override { return "LinearBackward"; }
};
}  // namespace

Tensor linear(const Tensor& input_in, const Tensor& weight_in, const Tensor& bias_in) {
  ForwardSpan span("linear", {&input_in, &weight_in, &bias_in});
  // Note [Autocast]: float32 operands, master weights included, cast to the autocast dtype.
  const Tensor input = autocast_operand(input_in), weight = autocast_operand(weight_in),
               bias = autocast_operand(bias_in);
  check_floating("linear", input, "input");
  check_floating("linear", weight, "weight");
  check_same_dtype("linear", input, weight);
  check_same_device("linear", input, weight);
  NANODDP_CHECK(
      weight.dim() == 2, ShapeError, "linear: weight ", weight.shape(),
      " must be [out_features, in_features] (torch.nn.functional.linear also takes a 1-D weight; here "
      "reshape it to [1, in_features])");
  NANODDP_CHECK(input.dim() >= 1 && input.size(-1) == weight.size(1), ShapeError, "linear: input ",
                input.shape(), " does not fit weight ", weight.shape(),
                " (expected input [N, in_features] with in_features = ", weight.size(1), ")");
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  if (bias.defined()) {
    check_floating("linear", bias, "bias");
    check_same_dtype("linear", input, bias);
    check_same_device("linear", input, bias);
    NANODDP_CHECK(bias.dim() == 1 && bias.size(0) == out_features, ShapeError, "linear: bias ", bias.shape(),
                  " does not fit weight ", weight.shape(), " (expected [", out_features, "])");
  }
  const int64_t N = leading_rows(input);
  std::vector<int64_t> out_sizes = input.shape().sizes();
  out_sizes.back() = out_features;
  Tensor out = Tensor::empty(Shape(out_sizes), input.dtype(), input.device());
  // In 16 bits the bias joins the GEMM's float32 sum, and product and bias are rounded once,
  // as torch's linear (addmm) does; in float32 it is added after.
  const bool fused_bias = input.dtype() != DType::Float32;
  gemm(out, input, weight, N, in_features, out_features, false, true, 0.0f, fused_bias ? bias : Tensor());
  if (bias.defined() && !fused_bias)
    NANODDP_DISPATCH(input.device(), binary_forward, ptr(out), ptr(out), ptr(bias), BinaryOp::Add, N,
                     out_features, true);
  auto node = std::make_shared<LinearBackward>();
  node->inputs = {input, weight, bias};
  node->save_for_backward(product_operands(input, weight));
  return make_result(out, node);
}

// ---- add / sub / mul ----------------------------------------------------------------------

namespace {
struct BinaryBackward : Node {
  BinaryOp op;
  bool broadcast;
  std::vector<Tensor> apply(const Tensor& dout) override {
    const Tensor& a = inputs[0];
    const Tensor& b = inputs[1];
    Tensor da, db;
    switch (op) {
      case BinaryOp::Add:
      case BinaryOp::Sub: {
        if (a.requires_grad()) da = dout;
        if (b.requires_grad()) {
          db = broadcast ? column_sum(dout, b.numel()) : dout;
          if (op == BinaryOp::Sub) db = scaled(db, ScalarOp::Mul, -1.0f);
        }
        break;
      }
      case BinaryOp::Mul: {  // saved: product_operands(a, b)
        if (a.requires_grad()) da = binary(dout, saved(1), BinaryOp::Mul, broadcast);  // dout * b
        if (b.requires_grad()) {
          Tensor dout_a = binary(dout, saved(0), BinaryOp::Mul, false);                  // dout * a
          db = broadcast ? column_sum(dout_a, b.numel()) : dout_a;
        }
        break;
      }
    }
    return {da, db};
  }
  const char* name() const override {
    return op == BinaryOp::Add ? "AddBackward" : op == BinaryOp::Sub ? "SubBackward" : "MulBackward";
  }
};

Tensor binary_op(const char* name, const Tensor& a, const Tensor& b, BinaryOp op) {
  NANODDP_CHECK(a.defined() && b.defined(), ValueError, name, ": ", a.defined() ? "b" : "a", " is undefined");
  if (is_16bit_float(a.dtype()) || is_16bit_float(b.dtype())) {
    check_floating(name, a, "a");  // Note [16-bit elementwise ops]
    check_floating(name, b, "b");
    return binary_op(name, a.to(DType::Float32), b.to(DType::Float32), op).to(promoted(a, b));
  }
  ForwardSpan span(name, {&a, &b});
  const bool broadcast = broadcast_of(name, a, b);
  Tensor out = binary(a, b, op, broadcast);
  auto node = std::make_shared<BinaryBackward>();
  node->inputs = {a, b};
  if (op == BinaryOp::Mul) node->save_for_backward(product_operands(a, b));
  node->op = op;
  node->broadcast = broadcast;
  return make_result(out, node);
}
}  // namespace

Tensor add(const Tensor& a, const Tensor& b) { return binary_op("add", a, b, BinaryOp::Add); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary_op("sub", a, b, BinaryOp::Sub); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary_op("mul", a, b, BinaryOp::Mul); }

// ---- scalar mul / div ---------------------------------------------------------------------

namespace {
struct ScalarBackward : Node {
  ScalarOp op;
  float s;
  std::vector<Tensor> apply(const Tensor& dout) override { return {scaled(dout, op, s)}; }
  const char* name() const override { return op == ScalarOp::Mul ? "MulScalarBackward" : "DivScalarBackward"; }
};

Tensor scalar_op(const Tensor& a, ScalarOp op, float s) {
  ForwardSpan span(op == ScalarOp::Mul ? "mul" : "div", {&a});
  check_float(op == ScalarOp::Mul ? "mul" : "div", a, "a");
  auto node = std::make_shared<ScalarBackward>();
  node->inputs = {a};
  node->op = op;
  node->s = s;
  return make_result(scaled(a, op, s), node);
}
}  // namespace

// Note [16-bit elementwise ops]
Tensor mul(const Tensor& a, float s) {
  return computed_in_float32(a, [s](const Tensor& x) { return scalar_op(x, ScalarOp::Mul, s); });
}
Tensor div(const Tensor& a, float s) {
  return computed_in_float32(a, [s](const Tensor& x) { return scalar_op(x, ScalarOp::Div, s); });
}

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator*(const Tensor& a, float s) { return mul(a, s); }
Tensor operator*(float s, const Tensor& a) { return mul(a, s); }
Tensor operator/(const Tensor& a, float s) { return div(a, s); }

// ---- sum / mean ---------------------------------------------------------------------------

namespace {
struct SumBackward : Node {
  float scale;  // 1 for sum, 1/n for mean
  bool mean = false;
  std::vector<Tensor> apply(const Tensor& dout) override {
    const Tensor& a = inputs[0];
    Tensor da = empty_like(a);
    NANODDP_DISPATCH(a.device(), broadcast_scalar_backward, ptr(da), ptr(dout), scale, a.numel());
    return {da};
  }
  const char* name() const override { return mean ? "MeanBackward" : "SumBackward"; }
};

Tensor reduce_all(const char* name, const Tensor& a, bool mean) {
  ForwardSpan span(name, {&a});
  check_float(name, a, "input");
  Tensor out = Tensor::empty({}, DType::Float32, a.device());
  NANODDP_DISPATCH(a.device(), sum_forward, ptr(out), ptr(a), a.numel());
  const float n = static_cast<float>(a.numel());
  if (mean) NANODDP_DISPATCH(a.device(), scalar_forward, ptr(out), ptr(out), ScalarOp::Div, n, 1);
  auto node = std::make_shared<SumBackward>();
  node->inputs = {a};
  node->scale = mean ? 1.0f / n : 1.0f;
  node->mean = mean;
  return make_result(out, node);
}
}  // namespace

// Note [Autocast], group 2: a 16-bit input is summed in float32.
Tensor sum(const Tensor& a) { return reduce_all("sum", as_float32(a), false); }
Tensor mean(const Tensor& a) { return reduce_all("mean", as_float32(a), true); }

// ---- relu ---------------------------------------------------------------------------------

Tensor relu(const Tensor& a) {
  ForwardSpan span("relu", {&a});
  check_floating("relu", a, "input");
  const Tensor x = widened(a);  // Note [16-bit elementwise ops]
  Tensor out = empty_like(a);
  NANODDP_DISPATCH(a.device(), relu_forward, ptr(out), ptr(x), a.numel());
  // The output is saved, not the input, as torch's threshold_backward reads the result: y > 0
  // exactly where a > 0 (y is a where a > 0, exact in a's dtype), and a layer after the ReLU
  // saves y too, so the input goes as soon as the forward drops it (Note [Graph edges]).
  const Tensor y = rounded_to(out, a.dtype());
  return record("ReluBackward", y, {a}, {y}, [](const Node& node, const Tensor& dout) {
    const Tensor& y = node.saved(0);  // din = 0 where y <= 0, else dout (a NaN y passes it)
    const Tensor mask = widened(y), dy = widened(dout);
    Tensor da = empty_like(y);
    NANODDP_DISPATCH(y.device(), relu_backward, ptr(da), ptr(dy), ptr(mask), y.numel());
    return std::vector<Tensor>{rounded_to(da, y.dtype())};
  });
}

// ---- mse_loss -----------------------------------------------------------------------------

namespace {
struct MseBackward : Node {
  Reduction reduction;
  // saved: input and target
  std::vector<Tensor> apply(const Tensor& dout) override {
    const Tensor& input = saved(0);
    const Tensor& target = saved(1);
    Tensor dinput = empty_like(input);
    NANODDP_DISPATCH(input.device(), mse_backward, ptr(dinput), ptr(dout), ptr(input), ptr(target), input.numel(),
                     reduction);
    Tensor dtarget;
    if (needs_input_grad(1)) dtarget = scaled(dinput, ScalarOp::Mul, -1.0f);
    if (!needs_input_grad(0)) dinput = Tensor();
    return {dinput, dtarget};
  }
  const char* name() const override { return "MseLossBackward"; }
};
}  // namespace

Tensor mse_loss(const Tensor& input_in, const Tensor& target_in, Reduction reduction) {
  ForwardSpan span("mse_loss", {&input_in, &target_in});
  const Tensor input = as_float32(input_in), target = as_float32(target_in);  // Note [Autocast], group 2
  check_float("mse_loss", input, "input");
  check_float("mse_loss", target, "target");
  check_same_device("mse_loss", input, target);
  NANODDP_CHECK(input.shape() == target.shape(), ShapeError, "mse_loss: input ", input.shape(), " and target ",
                target.shape(), " must have the same shape (nothing is broadcast)");
  Tensor out = reduction == Reduction::None ? empty_like(input) : Tensor::empty({}, DType::Float32, input.device());
  NANODDP_DISPATCH(input.device(), mse_forward, ptr(out), ptr(input), ptr(target), input.numel(), reduction);
  auto node = std::make_shared<MseBackward>();
  node->inputs = {input, target};
  node->save_for_backward({input, target});
  node->reduction = reduction;
  return make_result(out, node);
}

// ---- cross_entropy ------------------------------------------------------------------------

namespace {

// The checks cross_entropy and nll_loss share: input [N, C] float32, target [N] int64 class
// indices (host ones checked here), weight undefined or [C] float32, all on one device. Returns
// the weight as the kernels read it: detached (a constant of the loss, no gradient flows to it)
// and, when 16-bit, cast up with the input (autocast's float32 list casts every argument).
Tensor checked_class_weight(const char* op, const char* input_name, const Tensor& input, const Tensor& target,
                            int64_t ignore_index, const Tensor& weight_in) {
  check_float(op, input, input_name);
  NANODDP_CHECK(target.defined() && target.dtype() == DType::Int64, ValueError, op,
                ": target must be int64 class indices");
  check_same_device(op, input, target);
  NANODDP_CHECK(input.dim() == 2 && target.dim() == 1 && target.size(0) == input.size(0), ShapeError, op,
                ": ", input_name, " ", input.shape(), " and target ", target.shape(),
                " must be [N, C] and [N]");
  const int64_t N = input.size(0), C = input.size(1);
  const Tensor weight = weight_in.defined() ? as_float32(weight_in.detach()) : weight_in;
  if (weight.defined()) {
    NANODDP_CHECK(weight.dtype() == DType::Float32, ValueError, op, ": weight must be float32, got ",
                  dtype_name(weight.dtype()));
    check_same_device(op, input, weight);
    NANODDP_CHECK(weight.dim() == 1 && weight.size(0) == C, ShapeError, op, ": weight ", weight.shape(),
                  " must be [C] = [", C, "] for ", input_name, " ", input.shape());
  }
  if (target.device().is_cpu()) {
    const int64_t* t = target.data<int64_t>();
    for (int64_t r = 0; r < N; ++r)
      NANODDP_CHECK(t[r] == ignore_index || (t[r] >= 0 && t[r] < C), IndexError, op, ": target[", r,
                    "] = ", t[r], " is not a class in [0, ", C, ") nor ignore_index ", ignore_index);
  }
  return weight;
}

// Backward of cross_entropy and nll_loss needs the targets and the weight: saved (Note [Saved
// tensors]) after what else it needs, the weight only when there is one.
std::vector<Tensor> with_targets(std::vector<Tensor> saved, const Tensor& target, const Tensor& weight) {
  saved.push_back(target);
  if (weight.defined()) saved.push_back(weight);
  return saved;
}

}  // namespace

Tensor cross_entropy(const Tensor& logits_in, const Tensor& target, Reduction reduction, int64_t ignore_index,
                     double label_smoothing_in, const Tensor& weight_in) {
  ForwardSpan span("cross_entropy", {&logits_in, &target});
  const Tensor logits = as_float32(logits_in);  // Note [Autocast], group 2: softmax in float32
  const Tensor weight =
      checked_class_weight("cross_entropy", "logits", logits, target, ignore_index, weight_in);
  NANODDP_CHECK(label_smoothing_in >= 0.0 && label_smoothing_in <= 1.0, ValueError,
                "cross_entropy: label_smoothing must be between 0.0 and 1.0, got ", label_smoothing_in);
  const auto label_smoothing = static_cast<float>(label_smoothing_in);
  const int64_t N = logits.size(0), C = logits.size(1);
  Tensor out = reduction == Reduction::None ? Tensor::empty({N}, DType::Float32, logits.device())
                                            : Tensor::empty({}, DType::Float32, logits.device());
  Tensor probs = empty_like(logits);
  NANODDP_DISPATCH(logits.device(), cross_entropy_forward, ptr(out), ptr(probs), ptr(logits),
                   target.data<int64_t>(), weight.defined() ? ptr(weight) : nullptr, N, C, ignore_index,
                   label_smoothing, reduction);
  // Backward needs softmax(logits), not the logits.
  return record("CrossEntropyBackward", out, {logits}, with_targets({probs}, target, weight),
                [reduction, ignore_index, label_smoothing, weighted = weight.defined()](const Node& node,
                                                                                        const Tensor& dout) {
                  const Tensor& probs = node.saved(0);
                  const Tensor& target = node.saved(1);
                  const float* weight = weighted ? ptr(node.saved(2)) : nullptr;
                  Tensor dlogits = empty_like(probs);
                  NANODDP_DISPATCH(probs.device(), cross_entropy_backward, ptr(dlogits), ptr(dout),
                                   ptr(probs), target.data<int64_t>(), weight, probs.size(0), probs.size(1),
                                   ignore_index, label_smoothing, reduction);
                  return std::vector<Tensor>{dlogits};
                });
}

// ---- log_softmax and nll_loss --------------------------------------------------------------

Tensor log_softmax(const Tensor& a_in, int64_t dim) {
  ForwardSpan span("log_softmax", {&a_in});
  const Tensor a = as_float32(a_in);  // Note [Autocast], group 2
  check_float("log_softmax", a, "input");
  NANODDP_CHECK(a.dim() == 2, ShapeError, "log_softmax: input ", a.shape(), " must be [N, C]");
  NANODDP_CHECK(dim == 1 || dim == -1, ValueError, "log_softmax: dim ", dim,
                " is not the class dimension of [N, C] (1 or -1): only that one is supported");
  const int64_t N = a.size(0), C = a.size(1);
  Tensor out = empty_like(a);
  NANODDP_DISPATCH(a.device(), log_softmax_forward, ptr(out), ptr(a), N, C);
  // Backward reads only the output (torch saves it too).
  return record("LogSoftmaxBackward", out, {a}, {out}, [](const Node& node, const Tensor& dout) {
    const Tensor& out = node.saved(0);
    Tensor din = empty_like(out);
    NANODDP_DISPATCH(out.device(), log_softmax_backward, ptr(din), ptr(dout), ptr(out), out.size(0),
                     out.size(1));
    return std::vector<Tensor>{din};
  });
}

Tensor nll_loss(const Tensor& log_probs_in, const Tensor& target, Reduction reduction, int64_t ignore_index,
                const Tensor& weight_in) {
  ForwardSpan span("nll_loss", {&log_probs_in, &target});
  const Tensor log_probs = as_float32(log_probs_in);  // Note [Autocast], group 2
  const Tensor weight =
      checked_class_weight("nll_loss", "log_probs", log_probs, target, ignore_index, weight_in);
  const int64_t N = log_probs.size(0), C = log_probs.size(1);
  Tensor out = reduction == Reduction::None ? Tensor::empty({N}, DType::Float32, log_probs.device())
                                            : Tensor::empty({}, DType::Float32, log_probs.device());
  NANODDP_DISPATCH(log_probs.device(), nll_loss_forward, ptr(out), ptr(log_probs), target.data<int64_t>(),
                   weight.defined() ? ptr(weight) : nullptr, N, C, ignore_index, reduction);
  // Backward needs only the shape of log_probs, not its values.
  return record(
      "NllLossBackward", out, {log_probs}, with_targets({}, target, weight),
      [reduction, ignore_index, weighted = weight.defined(), N, C](const Node& node, const Tensor& dout) {
        const Tensor& target = node.saved(0);
        const float* weight = weighted ? ptr(node.saved(1)) : nullptr;
        Tensor din = Tensor::empty({N, C}, DType::Float32, target.device());
        NANODDP_DISPATCH(target.device(), nll_loss_backward, ptr(din), ptr(dout), target.data<int64_t>(),
                         weight, N, C, ignore_index, reduction);
        return std::vector<Tensor>{din};
      });
}

// ---- argmax -------------------------------------------------------------------------------

Tensor argmax(const Tensor& a_in) {
  const Tensor a = a_in.defined() && is_16bit_float(a_in.dtype()) ? a_in.detach().to(DType::Float32) : a_in;
  check_float("argmax", a, "input");
  NANODDP_CHECK(a.dim() == 2, ShapeError, "argmax: input ", a.shape(), " must be [N, C]");
  // As torch.argmax(a, 1): no columns is an error even with no rows.
  NANODDP_CHECK(a.size(1) > 0, ShapeError, "argmax: input ", a.shape(), " has no columns");
  Tensor out = Tensor::empty({a.size(0)}, DType::Int64, a.device());
  NANODDP_DISPATCH(a.device(), argmax_forward, out.data<int64_t>(), ptr(a), a.size(0), a.size(1));
  return out;
}

}  // namespace nanoddp
