#include "nn/clip_grad.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <utility>
#include <vector>

#include "core/autograd.h"
#include "kernels/grad_norm_term.h"
#include "kernels/kernels.h"

namespace nanoddp {

// x[i] = min(max(x[i], lo), hi) for n floats, a NaN kept (torch.clamp_). WRITES x.
NANODDP_DECLARE_KERNEL(clamp_in_place, float* x, float lo, float hi, int64_t n)
// totals[0] += the sum over g's n floats of |g|^norm_type (nothing for an infinite norm_type),
// as a square for 2, |g| for 1, else pow; with rescale_by > 0, of pow(|g| / rescale_by,
// norm_type) instead. totals[1] = the largest of totals[1] and every |g|, NaN when one is.
// totals: two doubles on g's device. UPDATES.
NANODDP_DECLARE_KERNEL(grad_norm_accumulate, double* totals, const float* g, int64_t n, double norm_type,
                       double rescale_by)

namespace nn {

float clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type, bool error_if_nonfinite) {
  NANODDP_CHECK(max_norm >= 0.0, ValueError, "clip_grad_norm_: max_norm must be >= 0, got ", max_norm);
  NANODDP_CHECK(norm_type > 0.0, ValueError, "clip_grad_norm_: norm_type must be > 0 (or infinity), got ", norm_type);
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (const Tensor& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return 0.0f;

  const bool inf_norm = std::isinf(norm_type);
  for (const Tensor& g : grads)
    NANODDP_CHECK(g.dtype() == DType::Float32, ValueError, "clip_grad_norm_: gradients must be float32, got ",
                  dtype_name(g.dtype()));
  // The sums run where the gradients are, into two doubles per device (in an int64 tensor's
  // bytes: there is no float64 dtype), read once: one wait for a CUDA device per call, not one
  // per gradient. Per device the gradients are summed in order; the devices' totals are added
  // in the order of their first gradient.
  const auto totals_of = [&grads, norm_type](double rescale_by) {
    std::vector<std::pair<Device, Tensor>> per_device;
    for (const Tensor& g : grads) {
      auto it =
          std::find_if(per_device.begin(), per_device.end(),
                       [&g](const std::pair<Device, Tensor>& entry) { return entry.first == g.device(); });
      if (it == per_device.end()) {
        per_device.emplace_back(g.device(), Tensor::zeros({2}, DType::Int64, g.device()));  // 0 bits: 0.0
        it = std::prev(per_device.end());
      }
      NANODDP_DISPATCH(g.device(), grad_norm_accumulate,
                       reinterpret_cast<double*>(it->second.data<int64_t>()), g.data<float>(), g.numel(),
                       norm_type, rescale_by);
    }
    double sum = 0.0, largest = 0.0;
    for (const auto& entry : per_device) {
      double device_totals[2];
      std::memcpy(device_totals, entry.second.to(Device::cpu()).data<int64_t>(), sizeof device_totals);
      sum += device_totals[0];
      largest = kernels::nan_max(largest, device_totals[1]);
    }
    return std::make_pair(sum, largest);
  };
  const auto [accumulated, largest] = totals_of(0.0);  // the sum of |g|^norm_type; the largest |g|
  double norm = inf_norm ? largest : std::pow(accumulated, 1.0 / norm_type);
  // A high order can take |g|^norm_type past double's range (40^250) or below it
  // ((1e-3)^200), an infinite or zero sum for finite gradients (torch 1.13's is then inf or
  // 0): the sum is then taken over (|g| / largest)^norm_type, all in (0, 1].
  if (!inf_norm && std::isfinite(largest) && largest > 0.0 &&
      (std::isinf(accumulated) || accumulated < std::numeric_limits<double>::min()))
    norm = largest * std::pow(totals_of(largest).first, 1.0 / norm_type);
  // The norm is a float32, the gradients' dtype, as torch's is: a sum past float's range is an
  // infinite norm. One value is checked, clipped by and returned, so a norm returned as inf
  // never passes the check.
  const auto total = static_cast<float>(norm);
  NANODDP_CHECK(!error_if_nonfinite || std::isfinite(total), ValueError, "clip_grad_norm_: the total norm of order ",
                norm_type, " for gradients from `parameters` is non-finite, so it cannot be clipped. To disable "
                "this error and scale the gradients by the non-finite norm anyway, set error_if_nonfinite=false");
  // In float32, as torch's max_norm / (total_norm + 1e-6) on its float32 norm tensor, which is
  // Tensor.__rtruediv__ (a Python float on the left): the reciprocal, then a product. A
  // division, or the factor in double, differs in the last bit in about 1 case of 10.
  // PyTorch clamps with torch.clamp(max=1.0), which passes a NaN through: so does this.
  const float coef = (1.0f / (total + 1e-6f)) * static_cast<float>(max_norm);
  const float scale = coef > 1.0f ? 1.0f : coef;
  if (scale != 1.0f)
    for (Tensor& g : grads)
      NANODDP_DISPATCH(g.device(), scalar_forward, g.data<float>(), g.data<float>(), kernels::ScalarOp::Mul, scale,
                       g.numel());
  return total;
}

void clip_grad_value_(const std::vector<Tensor>& params, double clip_value) {
  NANODDP_CHECK(clip_value >= 0.0, ValueError, "clip_grad_value_: clip_value must be >= 0, got ", clip_value);
  // torch clamps with float(clip_value), which the float32 gradient's clamp_ takes as a float32.
  const float bound = static_cast<float>(clip_value);
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    NANODDP_CHECK(g.dtype() == DType::Float32, ValueError,
                  "clip_grad_value_: gradients must be float32, got ", dtype_name(g.dtype()));
    NANODDP_DISPATCH(g.device(), clamp_in_place, g.data<float>(), -bound, bound, g.numel());
  }
}

}  // namespace nn
}  // namespace nanoddp
