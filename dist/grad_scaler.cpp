#include "dist/grad_scaler.h"

#include <cmath>
#include <string>
#include <vector>

#include "core/autograd.h"
#include "core/op_helpers.h"
#include "core/ops.h"
#include "dist/host_collectives.h"

namespace nanoddp::dist {

namespace {

void check_options(const GradScalerOptions& options) {
  NANODDP_CHECK(options.init_scale > 0.0f && std::isfinite(options.init_scale), ValueError,
                "GradScaler: init_scale must be a positive finite number, got ", options.init_scale);
  NANODDP_CHECK(options.growth_factor > 1.0, ValueError, "GradScaler: growth_factor should be > 1, got ",
                options.growth_factor);
  NANODDP_CHECK(options.backoff_factor > 0.0 && options.backoff_factor < 1.0, ValueError,
                "GradScaler: backoff_factor should be in (0, 1), got ", options.backoff_factor);
  NANODDP_CHECK(options.growth_interval >= 1, ValueError, "GradScaler: growth_interval should be >= 1, got ",
                options.growth_interval);
}

bool any_non_finite(const Tensor& t) {
  for (float v : t.to_vector())
    if (!std::isfinite(v)) return true;
  return false;
}

const Tensor& entry(const nn::StateDict& state, const char* key, DType dtype) {
  const auto it = state.find(key);
  NANODDP_CHECK(it != state.end(), ValueError, "GradScaler::load_state_dict: no \"", key, "\" in the state");
  NANODDP_CHECK(it->second.dtype() == dtype && it->second.numel() == 1, ValueError,
                "GradScaler::load_state_dict: \"", key, "\" must be one ", dtype, " value, got ", it->second.dtype(),
                " ", it->second.shape());
  return it->second;
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options, std::shared_ptr<ProcessGroup> pg, std::chrono::milliseconds timeout)
    : options_(options), pg_(std::move(pg)), timeout_(timeout), scale_(options.init_scale) {
  if (options_.enabled) check_options(options_);
}

Tensor GradScaler::scale(const Tensor& loss) const {
  if (!options_.enabled) return loss;
  check_floating("GradScaler::scale", loss, "the loss");
  // A 16-bit loss is widened first: 65536 times a float16 loss above 1 would be inf in
  // float16 (torch widens a 0-dim loss only, by promotion with its float32 scale tensor).
  return (is_16bit_float(loss.dtype()) ? loss.to(DType::Float32) : loss) * scale_;
}

void GradScaler::unscale_(nn::Optimizer& optimizer) {
  if (!options_.enabled) return;
  OptimizerState& state = optimizers_[&optimizer];
  NANODDP_CHECK(state.stage != Stage::Unscaled, ValueError,
                "GradScaler::unscale_() has already been called on this optimizer since the last update()");
  NANODDP_CHECK(state.stage != Stage::Stepped, ValueError, "GradScaler::unscale_() is being called after step()");
  // 1 / scale in double, rounded once to float32: exact for a power of two (torch computes
  // the reciprocal in float64 too).
  const float inv_scale = static_cast<float>(1.0 / static_cast<double>(scale_));
  // A scale below 2^-128 has no finite float32 inverse: every unscaled gradient would be inf
  // or NaN (torch writes them into the weights), and from 0 no scale grows back. Said, on
  // every rank.
  NANODDP_CHECK(
      std::isfinite(inv_scale), ValueError, "GradScaler::unscale_: the scale is ", scale_,
      ", so small that 1/scale is not finite in float32; backoff takes 65536 there after some 145 "
      "steps in a row with inf or NaN gradients: the model has diverged (lower the learning rate, or "
      "resume from an earlier checkpoint), unless such a scale was set or loaded");
  bool found = false, has_grad = false;
  {
    NoGradGuard no_grad;
    for (const Tensor& param : optimizer.params()) {
      Tensor grad = param.grad();
      if (!grad.defined()) continue;
      has_grad = true;
      found = found || any_non_finite(grad);
      grad.copy_(grad * inv_scale);
    }
  }
  // One value per rank, MAX-reduced: 2 when this rank had no gradient to check, else 1 for an
  // inf or NaN, else 0. So every rank learns both, and all raise step()'s error together.
  int64_t verdict = !has_grad ? 2 : found ? 1 : 0;
  if (pg_ != nullptr) {
    // Every rank reaches here once per optimizer per iteration: the same collective order.
    const CollectivePurpose purpose(CollectivePurpose::Kind::GradScalerUnscale, 0);
    verdict = all_reduce_host(*pg_, std::vector<int64_t>{verdict}, ReduceOp::Max, timeout_)[0];
  }
  state.found_inf = verdict == 1;
  state.checked_nothing = verdict == 2;
  state.stage = Stage::Unscaled;
}

bool GradScaler::step(nn::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  NANODDP_CHECK(optimizers_[&optimizer].stage != Stage::Stepped, ValueError,
                "GradScaler::step() has already been called since the last update()");
  if (optimizers_[&optimizer].stage == Stage::Ready) unscale_(optimizer);
  OptimizerState& state = optimizers_[&optimizer];
  // Checked before the stage moves: a second step() says the same, and update() does not
  // count this optimizer as checked (torch's found_inf_per_device stays empty).
  NANODDP_CHECK(!state.checked_nothing, ValueError,
                "GradScaler::step(): no inf checks were recorded for this optimizer: none of its parameters has "
                "a .grad", pg_ != nullptr ? " on at least one rank" : "", " (call backward() on the scaled loss "
                "first)");
  state.stage = Stage::Stepped;
  if (state.found_inf) return false;  // every rank found the same flag: every rank skips
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  bool found = false, unscaled = false;
  for (const auto& [optimizer, state] : optimizers_) {
    found = found || state.found_inf;
    unscaled = unscaled || (state.stage != Stage::Ready && !state.checked_nothing);
  }
  NANODDP_CHECK(unscaled, ValueError, "GradScaler::update(): no inf checks were recorded prior to update()");
  if (found) {
    scale_ = static_cast<float>(scale_ * options_.backoff_factor);
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval) {
    // Never grown past float32's range to inf, which no backoff could bring back (torch's
    // _amp_update_scale_ keeps the old scale then too).
    const float grown = static_cast<float>(scale_ * options_.growth_factor);
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  }
  optimizers_.clear();
}

void GradScaler::update(float new_scale) {
  if (!options_.enabled) return;
  NANODDP_CHECK(new_scale > 0.0f && std::isfinite(new_scale), ValueError,
                "GradScaler::update: new_scale must be a positive finite number, got ", new_scale);
  scale_ = new_scale;
  optimizers_.clear();
}

bool GradScaler::found_inf(const nn::Optimizer& optimizer) const {
  const auto it = optimizers_.find(&optimizer);
  return it != optimizers_.end() && it->second.found_inf;
}

nn::StateDict GradScaler::state_dict() const {
  if (!options_.enabled) return {};
  auto scalar = [](int64_t v) { return Tensor::from_vector(std::vector<int64_t>{v}, Shape{}); };
  return {{"scale", Tensor::from_vector({scale_}, Shape{})},
          {"growth_factor", Tensor::from_vector({static_cast<float>(options_.growth_factor)}, Shape{})},
          {"backoff_factor", Tensor::from_vector({static_cast<float>(options_.backoff_factor)}, Shape{})},
          {"growth_interval", scalar(options_.growth_interval)},
          {"_growth_tracker", scalar(growth_tracker_)}};
}

void GradScaler::load_state_dict(const nn::StateDict& state) {
  if (!options_.enabled) return;  // torch's disabled scaler ignores the state, as it saves none
  NANODDP_CHECK(!state.empty(), ValueError, "GradScaler::load_state_dict: the state is empty (saved disabled?)");
  GradScalerOptions options = options_;
  // A scale that 166 backoffs in a row took to 0 (torch's too) is still a state this scaler
  // saved: it loads, where the constructor refuses init_scale 0.
  const float scale = entry(state, "scale", DType::Float32).to_vector()[0];
  NANODDP_CHECK(scale >= 0.0f && std::isfinite(scale), ValueError,
                "GradScaler::load_state_dict: \"scale\" must be a finite number >= 0, got ", scale);
  // The state holds the factors as float32; a factor whose float32 is the saved one stays the
  // double it is (0.1, not 0.1f), so a resumed run scales as an uninterrupted one.
  const auto factor = [&](const char* key, double current) {
    const float saved = entry(state, key, DType::Float32).to_vector()[0];
    return static_cast<float>(current) == saved ? current : static_cast<double>(saved);
  };
  options.growth_factor = factor("growth_factor", options_.growth_factor);
  options.backoff_factor = factor("backoff_factor", options_.backoff_factor);
  options.growth_interval = entry(state, "growth_interval", DType::Int64).to_int_vector()[0];
  const int64_t tracker = entry(state, "_growth_tracker", DType::Int64).to_int_vector()[0];
  check_options(options);
  NANODDP_CHECK(tracker >= 0 && tracker < options.growth_interval, ValueError,
                "GradScaler::load_state_dict: _growth_tracker ", tracker, " is outside [0, growth_interval ",
                options.growth_interval, ")");
  options_ = options;
  scale_ = scale;
  growth_tracker_ = tracker;
}

}  // namespace nanoddp::dist
