// Learning-rate schedulers: torch.optim.lr_scheduler's StepLR, CosineAnnealingLR, LinearLR
// and LambdaLR (PyTorch 1.13), for any nn::Optimizer.
//
//   nn::CosineAnnealingLR schedule(optimizer, /*T_max=*/epochs);   // sets optimizer.lr() now
//   for (epoch ...) { train_one_epoch(optimizer); schedule.step(); }
//   state["scheduler.*"] = schedule.state_dict();                  // resumes exactly
//
// As in PyTorch: the constructor takes the optimizer's initial_lr as base_lr (the lr when the
// first scheduler was built on it, recorded then: torch's group['initial_lr']) and applies
// step 0 (last_epoch becomes 0; LinearLR already multiplies by start_factor); each step()
// adds one to last_epoch and sets the optimizer's lr. Call step() after optimizer.step().
// A step is whatever the caller counts: an epoch, or a batch for warm-up. Not here: the
// constructors' last_epoch argument (resume through load_state_dict, which restores
// last_epoch and the rates exactly) and torch's warning for a step() before the optimizer's.
//
// Values are computed in double precision by PyTorch's own recursive formulas (get_lr(),
// which multiply the previous lr), so they equal PyTorch's to the last bit, including
// CosineAnnealingLR's rise back after T_max. The previous lr is the optimizer's lr (a double,
// torch's group['lr']), so a step builds on a rate set by hand between steps or by another
// scheduler on the same optimizer, as PyTorch's does, and schedulers chain (torch's
// ChainedScheduler order: step them one after the other).
//
// state_dict(): "last_epoch" (int64) and "base_lr", "last_lr", "optimizer_lr" (the
// optimizer's lr at the save) (the doubles' bits in int64 scalars: tensors here have no
// float64, and a rounded lr would not resume bit-exactly), and
// the hyper-parameters under PyTorch's names, as doubles' bits too ("step_size", "gamma";
// "T_max", "eta_min"; "start_factor", "end_factor", "total_iters"; LambdaLR: "lr_lambdas",
// the number of lambdas, 1, as torch keeps an entry per lambda but not the function).
// load_state_dict() refuses another scheduler's state by those names (Note [Scheduler state
// kind]; a state without those names loads and keeps the constructor's values) and takes the
// saved values, as PyTorch's (which updates the scheduler's __dict__): a loaded scheduler
// follows the schedule its state describes. The
// recursion builds on the saved rate, so no other curve can be joined midway: to change the
// schedule, build one and step it from the start (as examples/fashion_mnist.cpp's Note
// [Resuming elsewhere] replays). It also sets the optimizer's lr to
// optimizer_lr (last_lr in a state saved without it) and its initial_lr to base_lr, which PyTorch leaves to
// the optimizer's own state_dict (its param_groups; ours keeps only per-parameter state). So schedulers
// chained on one optimizer restore its rate loaded in any order, as torch's do.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "nn/module.h"
#include "nn/optimizer.h"

namespace nanoddp::nn {

class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  // last_epoch += 1, then the optimizer's lr = the schedule's value there. Throws what the
  // optimizer's set_lr throws (ValueError for a negative rate) or the LambdaLR's lambda
  // throws; the scheduler and the optimizer are then as they were before the call.
  void step();
  // The lr the last step() (or the constructor) set (torch's get_last_lr()[0]).
  double get_last_lr() const { return last_lr_; }
  int64_t last_epoch() const { return last_epoch_; }
  double base_lr() const { return base_lr_; }
  const std::string& name() const { return name_; }

  StateDict state_dict() const;
  // Throws ValueError naming the entry when one is missing, malformed or another scheduler's
  // (a StepLR's "step_size" in a CosineAnnealingLR's load, naming StepLR), or when a saved
  // hyper-parameter is one the constructor refuses; nothing changes.
  void load_state_dict(const StateDict& state);

 protected:
  LRScheduler(Optimizer& optimizer, std::string name);
  // Records the optimizer's initial_lr if no scheduler has, takes it as base_lr, then steps to
  // epoch 0 (PyTorch's __init__ tail and _initial_step()): derived constructors call it once
  // their fields are set and checked.
  void initial_step();
  // PyTorch's get_lr() at last_epoch_, from the optimizer's lr (its group['lr']) and base_lr_.
  virtual double get_lr() const = 0;
  // The constructor's arguments by PyTorch's names, in state_dict() (Note [Scheduler state kind]).
  virtual std::vector<std::pair<std::string, double>> hyper_parameters() const = 0;
  // Takes saved values, in hyper_parameters()' order; throws ValueError as the constructor
  // would, before changing anything.
  virtual void set_hyper_parameters(const std::vector<double>& values) = 0;

  Optimizer& optimizer_;
  std::string name_;
  double base_lr_ = 0.0;
  double last_lr_ = 0.0;
  int64_t last_epoch_ = -1;
};

// lr = base_lr * gamma^(last_epoch / step_size), integer division (torch.optim.lr_scheduler.StepLR).
// Throws ValueError for step_size < 1.
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& optimizer, int64_t step_size, double gamma = 0.1);

 protected:
  double get_lr() const override;
  std::vector<std::pair<std::string, double>> hyper_parameters() const override;
  void set_hyper_parameters(const std::vector<double>& values) override;

 private:
  int64_t step_size_;
  double gamma_;
};

// lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * last_epoch / T_max)) / 2 for
// last_epoch <= T_max, reached at T_max; after it PyTorch's recursion continues the cosine
// back up (period 2 T_max), and so does this (torch.optim.lr_scheduler.CosineAnnealingLR).
// Throws ValueError for T_max < 1.
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& optimizer, int64_t T_max, double eta_min = 0.0);

 protected:
  double get_lr() const override;
  std::vector<std::pair<std::string, double>> hyper_parameters() const override;
  void set_hyper_parameters(const std::vector<double>& values) override;

 private:
  int64_t T_max_;
  double eta_min_;
};

// Linear warm-up: lr = base_lr * (start_factor + (end_factor - start_factor) *
// min(last_epoch, total_iters) / total_iters) (torch.optim.lr_scheduler.LinearLR, defaults
// 1/3, 1, 5), by torch's recursion, so the rates have its bits; where that recursion's last
// step to end_factor 0 rounds to a rate just below 0 (torch 1.13 goes on with -1.9e-18), the
// rate is 0. Throws ValueError for start_factor outside (0, 1] (PyTorch 1.13 admits 0 and
// then divides by zero), end_factor outside [0, 1], total_iters < 1 (torch admits 0 and keeps
// start_factor).
class LinearLR : public LRScheduler {
 public:
  LinearLR(Optimizer& optimizer, double start_factor = 1.0 / 3, double end_factor = 1.0, int64_t total_iters = 5);

 protected:
  double get_lr() const override;
  std::vector<std::pair<std::string, double>> hyper_parameters() const override;
  void set_hyper_parameters(const std::vector<double>& values) override;

 private:
  double start_factor_, end_factor_;
  int64_t total_iters_;
};

// lr = base_lr * lr_lambda(last_epoch) (torch.optim.lr_scheduler.LambdaLR). Throws
// ValueError for an empty lr_lambda.
class LambdaLR : public LRScheduler {
 public:
  LambdaLR(Optimizer& optimizer, std::function<double(int64_t epoch)> lr_lambda);

 protected:
  double get_lr() const override;
  std::vector<std::pair<std::string, double>> hyper_parameters() const override { return {{"lr_lambdas", 1.0}}; }
  void set_hyper_parameters(const std::vector<double>&) override {}  // the function is not saved

 private:
  std::function<double(int64_t)> lr_lambda_;
};

}  // namespace nanoddp::nn
