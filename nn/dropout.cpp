// Dropout as a composite: a mask tensor times x, so its gradient is mul's.
#include "nn/dropout.h"

#include <cstdint>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/op_helpers.h"
#include "kernels/kernels.h"

namespace nanoddp {

// mask[i] = keep_scale where kernels::dropout_uniform(key, i) >= p, else 0; n floats. WRITES.
// The same mask on both devices for one key (kernels/dropout_mask.h).
NANODDP_DECLARE_KERNEL(dropout_mask, float* mask, uint64_t key, float p, float keep_scale, int64_t n)

namespace {
void check_probability(const char* op, double p) {
  NANODDP_CHECK(p >= 0.0 && p <= 1.0, ValueError, op, ": p must be in [0, 1], got ", p);
}
}  // namespace

uint64_t dropout_key(Generator& gen) { return gen.random64(); }

Tensor dropout(const Tensor& x, double p, bool training, Generator& gen) {
  if (x.defined() && is_16bit_float(x.dtype()))  // Note [16-bit elementwise ops]
    return computed_in_float32(x, [&](const Tensor& wide) { return dropout(wide, p, training, gen); });
  ForwardSpan span("dropout", {&x});  // the mask drawn on x's device, then mul
  check_float("dropout", x, "input");
  check_probability("dropout", p);
  if (!training || p == 0.0) return x;
  // torch divides its 0/1 noise by the scalar 1 - p, which a float32 tensor's division takes
  // as a float32.
  const float keep_scale = p < 1.0 ? 1.0f / static_cast<float>(1.0 - p) : 0.0f;
  const uint64_t key = dropout_key(checkpoint_generator(gen));  // a checkpoint's rerun draws the same mask
  Tensor mask = Tensor::empty(x.shape(), DType::Float32, x.device());
  NANODDP_DISPATCH(x.device(), dropout_mask, ptr(mask), key, static_cast<float>(p), keep_scale, x.numel());
  return x * mask;
}

namespace nn {

Dropout::Dropout(double p, Generator& gen) : p_(p), gen_(&gen) { check_probability("Dropout", p); }

}  // namespace nn
}  // namespace nanoddp
