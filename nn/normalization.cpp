// LayerNorm: forward, then backward right below.
#include "nn/normalization.h"

#include "core/autograd.h"
#include "core/op_helpers.h"
#include "kernels/kernels.h"

namespace nanoddp {

// Kernels of this file (kernels/{cpu,cuda}/normalization.*). Rows: in, out [N, D].
// out = (in - mean) * rstd * weight + bias per row; mean[r] and rstd[r] = 1/sqrt(var + eps)
// are written for backward. weight and bias may be null (no affine).
NANODDP_DECLARE_KERNEL(layer_norm_forward, float* out, float* mean, float* rstd, const float* in,
                       const float* weight, const float* bias, int64_t N, int64_t D, float eps)
// din = rstd (g - mean(g) - xhat mean(g xhat)) with g = dout * weight, xhat = (in - mean)
// rstd; dweight = sum over rows of dout xhat, dbias = sum over rows of dout. WRITES each
// non-null output. Deterministic (fixed order per column).
NANODDP_DECLARE_KERNEL(layer_norm_backward, float* din, float* dweight, float* dbias, const float* dout,
                       const float* in, const float* mean, const float* rstd, const float* weight, int64_t N,
                       int64_t D)

namespace {
float* ptr_or_null(const Tensor& t) { return t.defined() ? ptr(t) : nullptr; }
}  // namespace

Tensor layer_norm(const Tensor& input_in, const std::vector<int64_t>& normalized_shape, const Tensor& weight,
                  const Tensor& bias, float eps) {
  ForwardSpan span("layer_norm", {&input_in, &weight, &bias});
  const Tensor input = as_float32(input_in);  // Note [Autocast], group 2: statistics in float32
  check_float("layer_norm", input, "input");
  NANODDP_CHECK(!normalized_shape.empty(), ValueError, "layer_norm: normalized_shape is empty");
  NANODDP_CHECK(eps >= 0.0f, ValueError, "layer_norm: eps must be >= 0, got ", eps);
  const Shape normalized(normalized_shape);
  const int k = normalized.dim();
  bool fits = input.dim() >= k;
  for (int d = 0; fits && d < k; ++d) fits = input.size(input.dim() - k + d) == normalized[d];
  NANODDP_CHECK(fits, ShapeError, "layer_norm: input ", input.shape(), " does not end in normalized_shape ",
                normalized);
  for (const Tensor* affine : {&weight, &bias}) {
    if (!affine->defined()) continue;
    check_float("layer_norm", *affine, affine == &weight ? "weight" : "bias");
    check_same_device("layer_norm", input, *affine);
    NANODDP_CHECK(affine->shape() == normalized, ShapeError, "layer_norm: ", affine == &weight ? "weight " : "bias ",
                  affine->shape(), " must be normalized_shape ", normalized);
  }
  const int64_t D = normalized.numel(), N = D == 0 ? 0 : input.numel() / D;
  const Device device = input.device();
  Tensor out = empty_like(input);
  Tensor mean = Tensor::empty({N}, DType::Float32, device), rstd = Tensor::empty({N}, DType::Float32, device);
  NANODDP_DISPATCH(device, layer_norm_forward, ptr(out), ptr(mean), ptr(rstd), ptr(input), ptr_or_null(weight),
                   ptr_or_null(bias), N, D, eps);

  return record("LayerNormBackward", out, {input, weight, bias}, {input, weight, mean, rstd},
                [N, D](const Node& node, const Tensor& dout) {
    const Tensor& x = node.saved(0);
    const Tensor& w = node.saved(1);
    const Tensor& mean = node.saved(2);
    const Tensor& rstd = node.saved(3);
    Tensor dx = node.needs_input_grad(0) ? empty_like(x) : Tensor();
    Tensor dw = node.needs_input_grad(1) ? empty_like(node.inputs[1]) : Tensor();
    Tensor db = node.needs_input_grad(2) ? empty_like(node.inputs[2]) : Tensor();
    NANODDP_DISPATCH(x.device(), layer_norm_backward, ptr_or_null(dx), ptr_or_null(dw), ptr_or_null(db), ptr(dout),
                     ptr(x), ptr(mean), ptr(rstd), ptr_or_null(w), N, D);
    return std::vector<Tensor>{dx, dw, db};
  });
}

namespace nn {

LayerNorm::LayerNorm(std::vector<int64_t> normalized_shape, float eps, bool elementwise_affine)
    : normalized_shape_(std::move(normalized_shape)), eps_(eps) {
  NANODDP_CHECK(!normalized_shape_.empty(), ValueError, "LayerNorm: normalized_shape is empty");
  // At construction, as BatchNorm1d's: not at the first forward.
  NANODDP_CHECK(eps >= 0.0f, ValueError, "LayerNorm: eps must be >= 0, got ", eps);
  if (!elementwise_affine) return;
  weight = register_parameter("weight", Tensor::ones(Shape(normalized_shape_)));
  bias = register_parameter("bias", Tensor::zeros(Shape(normalized_shape_)));
}

}  // namespace nn
}  // namespace nanoddp
