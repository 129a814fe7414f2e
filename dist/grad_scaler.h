// GradScaler: loss scaling for float16 training (torch.amp.GradScaler), with the found-inf
// flag agreed over a process group so that every rank skips the same steps.
//
//   dist::GradScaler scaler({}, pg);                      // init_scale 65536, as torch
//   scaler.scale(loss).backward();  scaler.step(opt);  scaler.update();
//   scaler.unscale_(opt);  nn::clip_grad_norm_(params, 1.0);   // before step, to clip true grads
//
// Why: float16's smallest normal is 6.1e-5, and small gradients round to zero. Multiplying
// the loss by S multiplies every gradient by S (backward is linear in its seed), lifting
// them into range; unscale_ multiplies them by 1/S before the step. A too large S overflows
// to inf: then the step is skipped and S is halved (backoff_factor); after growth_interval
// steps in a row without inf or NaN, S doubles (growth_factor). bfloat16 has float32's
// exponent range and needs no scaler. Powers of two scale exactly, so with finite gradients
// a scaled float32 step is bit for bit the unscaled one.
//
// Across ranks: each rank checks the gradients it holds (all of them under DDP, its shards
// under ZeRO-2/FSDP), and the flag is all-reduced with MAX (torch's ShardedGradScaler does the
// same for FSDP). So an inf on one rank makes every rank skip and back off: the replicas never
// diverge, and every rank's scale stays the same. With a group, unscale_ (and step, when it
// unscales) is a collective: every rank calls it in the same order.
//
// Under DDP the group is a safeguard, not a need: after DDP's all-reduce every rank holds the
// same gradients and reaches the same verdict (torch's GradScaler, which has no group, relies
// on it). Inside a dist::Join with uneven inputs, leave it out: a rank that has joined shadows
// DDP's collectives, not the scaler's, and its peers' next unscale_ fails with the collective
// check's mismatch error ("... for GradScaler.unscale_'s inf/NaN check" against "... for
// Join's count of ranks still training").
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "dist/process_group.h"
#include "nn/module.h"
#include "nn/optimizer.h"

namespace nanoddp::dist {

// torch.amp.GradScaler's arguments and defaults.
struct GradScalerOptions {
  float init_scale = 65536.0f;   // 2^16
  // Doubles, as torch's: the scale is multiplied in double and rounded once to float32
  // (_amp_update_scale_), so 65536 * 0.1 * 0.1 is 655.359985, not 655.360046.
  double growth_factor = 2.0;      // > 1
  double backoff_factor = 0.5;     // in (0, 1)
  int64_t growth_interval = 2000;  // finite steps in a row before the scale grows; >= 1
  bool enabled = true;           // false: scale() returns the loss, step() steps, nothing else
};

class GradScaler {
 public:
  // pg: the group the found-inf flag is all-reduced over (MAX); null: this process only.
  // Throws ValueError for init_scale <= 0, growth_factor <= 1, backoff_factor outside (0, 1)
  // or growth_interval < 1 (torch asserts only growth_factor > 1 and backoff_factor < 1, and
  // lets the others through to a scale that is 0, negative or never grows); a disabled scaler
  // checks nothing, as torch's.
  explicit GradScaler(GradScalerOptions options = {}, std::shared_ptr<ProcessGroup> pg = nullptr,
                      std::chrono::milliseconds timeout = kDefaultTimeout);

  // loss * scale, recorded in the graph, with loss's shape; float32 for a float32 or 16-bit
  // loss, as torch's product with its float32 scale tensor of shape [1] (which also turns a
  // 0-dim loss into shape [1]; ours keeps the loss's shape). The loss itself when disabled.
  // ValueError for an undefined or integer loss.
  Tensor scale(const Tensor& loss) const;
  // Multiplies every .grad of optimizer's parameters by 1 / scale in place and records whether
  // any is inf or NaN, on this rank or (with a group) on any rank. Throws ValueError for a scale
  // below 2^-128, whose float32 inverse is not finite (backoff takes 65536 there after some 145
  // steps in a row of inf or NaN; torch would step with inf or NaN gradients), and when
  // called twice for one optimizer before update(), or after step() (torch's messages).
  void unscale_(nn::Optimizer& optimizer);
  // unscale_ unless already done (with its ValueErrors); then optimizer.step() unless an inf or
  // NaN was found.
  // Returns whether it stepped. Throws ValueError when called twice before update(), and when
  // none of optimizer's parameters had a .grad to check (on any rank of the group: every rank
  // throws), as torch asserts "No inf checks were recorded for this optimizer".
  bool step(nn::Optimizer& optimizer);
  // After the step(s) of an iteration: backs the scale off if any optimizer found inf or NaN
  // (and restarts the growth count), else counts a finite step and grows the scale every
  // growth_interval of them, unless growing would overflow float32 (the scale stays then, as
  // torch's). Forgets every optimizer's unscale/step state. Throws ValueError when no
  // optimizer checked a gradient since the last update (none unscaled, or none had a .grad),
  // as torch asserts "No inf checks were recorded prior to update".
  void update();
  // Sets the scale (torch's update(new_scale)); the growth count is kept. ValueError for <= 0.
  void update(float new_scale);

  float get_scale() const { return options_.enabled ? scale_ : 1.0f; }
  int64_t growth_tracker() const { return growth_tracker_; }
  bool is_enabled() const { return options_.enabled; }
  // Whether the last unscale_ of optimizer found inf or NaN (on any rank); false when not
  // unscaled since the last update().
  bool found_inf(const nn::Optimizer& optimizer) const;

  // torch's keys: "scale", "growth_factor", "backoff_factor" (float32, shape [1], where torch
  // keeps Python floats: load keeps a factor this scaler was built with when its float32 is
  // the saved one, so 0.1 resumes as 0.1, else it takes the float32),
  // "growth_interval", "_growth_tracker" (int64, shape [1], as an optimizer's step count).
  // load_state_dict takes any one-element entry (0-d too). Empty when disabled, as torch's.
  nn::StateDict state_dict() const;
  // Restores them. ValueError for a missing key, a wrong dtype, or values the constructor
  // refuses; nothing changes then. A disabled scaler ignores the state (torch's returns too).
  void load_state_dict(const nn::StateDict& state);

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct OptimizerState {
    Stage stage = Stage::Ready;
    bool found_inf = false;
    bool checked_nothing = false;  // no parameter had a .grad (on some rank)
  };

  GradScalerOptions options_;
  std::shared_ptr<ProcessGroup> pg_;
  std::chrono::milliseconds timeout_;
  float scale_;
  int64_t growth_tracker_ = 0;
  std::unordered_map<const nn::Optimizer*, OptimizerState> optimizers_;
};

}  // namespace nanoddp::dist
