#include "core/autocast.h"

#include "core/error.h"

namespace nanoddp {

namespace {
thread_local AutocastState current_state;
}  // namespace

AutocastState autocast_state() { return current_state; }

void set_autocast_state(AutocastState state) {
  NANODDP_CHECK(is_16bit_float(state.dtype), ValueError, "autocast: dtype must be float16 or bfloat16, got ",
                state.dtype);
  current_state = state;
}

Tensor autocast_operand(const Tensor& t) {
  if (!current_state.enabled || !t.defined() || t.dtype() == current_state.dtype) return t;
  if (t.dtype() != DType::Float32 && !is_16bit_float(t.dtype())) return t;
  return t.to(current_state.dtype);
}

}  // namespace nanoddp
