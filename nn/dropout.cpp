// Dropout as a composite: a mask tensor times x, so its gradient is mul's.
#include "nn/dropout.h"

#include <vector>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/op_helpers.h"

namespace nanoddp {

namespace {
void check_probability(const char* op, float p) {
  NANODDP_CHECK(p >= 0.0f && p <= 1.0f, ValueError, op, ": p must be in [0, 1], got ", p);
}
}  // namespace

Tensor dropout(const Tensor& x, float p, bool training, Generator& gen) {
  ForwardSpan span("dropout", {&x});  // the mask drawn on the host, then mul
  check_float("dropout", x, "input");
  check_probability("dropout", p);
  if (!training || p == 0.0f) return x;
  const float keep_scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  std::vector<float> mask(static_cast<size_t>(x.numel()));
  Generator& draw = checkpoint_generator(gen);  // a checkpoint's rerun draws the same mask
  for (float& m : mask) m = draw.uniform() >= p ? keep_scale : 0.0f;
  return x * Tensor::from_vector(mask, Shape{x.numel()}, x.device()).reshape(x.shape());
}

namespace nn {

Dropout::Dropout(float p, Generator& gen) : p_(p), gen_(&gen) { check_probability("Dropout", p); }

}  // namespace nn
}  // namespace nanoddp
