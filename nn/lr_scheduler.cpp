// The schedules must equal PyTorch's doubles bit for bit, and Python rounds every product:
// keep the compiler from fusing a * b + c into one FMA here (-mfma builds would).
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "nn/lr_scheduler.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace nanoddp::nn {

namespace {
// A double kept bit-exactly in an int64 scalar tensor (tensors have no float64).
static_assert(sizeof(double) == sizeof(int64_t), "double bits must fit an int64");
Tensor double_bits(double value) {
  int64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return Tensor::from_vector(std::vector<int64_t>{bits});
}

int64_t int64_entry(const StateDict& state, const std::string& key, const std::string& scheduler) {
  const auto it = state.find(key);
  NANODDP_CHECK(it != state.end(), ValueError, scheduler, ".load_state_dict: no '", key, "' entry");
  const Tensor& t = it->second;
  NANODDP_CHECK(t.defined() && t.dtype() == DType::Int64 && t.numel() == 1, ValueError, scheduler,
                ".load_state_dict: '", key, "' must be one int64");
  return t.to(Device::cpu()).to_int_vector()[0];
}

double finite_entry(const StateDict& state, const std::string& key, const std::string& scheduler) {
  const int64_t bits = int64_entry(state, key, scheduler);
  double value = 0.0;
  std::memcpy(&value, &bits, sizeof value);
  NANODDP_CHECK(std::isfinite(value), ValueError, scheduler, ".load_state_dict: '", key, "' is ", value);
  return value;
}

double double_entry(const StateDict& state, const std::string& key, const std::string& scheduler) {
  const double value = finite_entry(state, key, scheduler);
  NANODDP_CHECK(value >= 0.0, ValueError, scheduler, ".load_state_dict: '", key, "' is ", value,
                ", not a learning rate");
  return value;
}

// A count the state keeps as a double (step_size, T_max, total_iters): a whole number.
int64_t saved_count(double value, const char* name) {
  NANODDP_CHECK(value == std::floor(value) && std::abs(value) < 0x1p62, ValueError, "'", name, "' is ", value,
                ", not a whole number");
  return static_cast<int64_t>(value);
}

void check_step_lr(int64_t step_size) {
  NANODDP_CHECK(step_size >= 1, ValueError, "StepLR: step_size must be >= 1, got ", step_size);
}

void check_cosine_annealing_lr(int64_t T_max) {
  NANODDP_CHECK(T_max >= 1, ValueError, "CosineAnnealingLR: T_max must be >= 1, got ", T_max);
}

void check_linear_lr(double start_factor, double end_factor, int64_t total_iters) {
  NANODDP_CHECK(start_factor > 0.0 && start_factor <= 1.0, ValueError,
                "LinearLR: start_factor must be in (0, 1], got ", start_factor);
  NANODDP_CHECK(end_factor >= 0.0 && end_factor <= 1.0, ValueError,
                "LinearLR: end_factor must be in [0, 1], got ", end_factor);
  NANODDP_CHECK(total_iters >= 1, ValueError, "LinearLR: total_iters must be >= 1, got ", total_iters);
}

// Which scheduler's state has each hyper-parameter, to name it when one turns up in another's.
const char* scheduler_with(const std::string& key) {
  if (key == "step_size" || key == "gamma") return "StepLR";
  if (key == "T_max" || key == "eta_min") return "CosineAnnealingLR";
  if (key == "start_factor" || key == "end_factor" || key == "total_iters") return "LinearLR";
  if (key == "lr_lambdas") return "LambdaLR";
  return nullptr;
}

// Python's a % b for b > 0: never negative.
int64_t floor_mod(int64_t a, int64_t b) { return ((a % b) + b) % b; }
}  // namespace

LRScheduler::LRScheduler(Optimizer& optimizer, std::string name)
    : optimizer_(optimizer), name_(std::move(name)), last_lr_(optimizer.lr()) {}

void LRScheduler::initial_step() {
  // torch's group.setdefault('initial_lr', group['lr']): the first scheduler on the optimizer
  // records its rate, and every scheduler, chained after it or not, starts from that.
  if (!optimizer_.initial_lr()) optimizer_.set_initial_lr(optimizer_.lr());
  base_lr_ = *optimizer_.initial_lr();
  step();
}

void LRScheduler::step() {
  // The step counts only once the optimizer took its rate: a rate it refuses (a LambdaLR whose
  // lambda went negative) or a lambda that throws leaves the scheduler and the optimizer as
  // they were, so a state_dict saved after the error still resumes the same schedule.
  ++last_epoch_;
  double lr = 0.0;
  try {
    lr = get_lr();
    optimizer_.set_lr(lr);
  } catch (...) {
    --last_epoch_;
    throw;
  }
  last_lr_ = lr;
}

StateDict LRScheduler::state_dict() const {
  StateDict state = {{"last_epoch", Tensor::from_vector(std::vector<int64_t>{last_epoch_})},
                     {"base_lr", double_bits(base_lr_)},
                     {"last_lr", double_bits(last_lr_)},
                     {"optimizer_lr", double_bits(optimizer_.lr())}};
  for (const auto& [key, value] : hyper_parameters()) state[key] = double_bits(value);
  return state;
}

void LRScheduler::load_state_dict(const StateDict& state) {
  // Note [Scheduler state kind] The hyper-parameters' names tell one scheduler's state from
  // another's: loaded into another scheduler, a StepLR's last_lr would silently start a cosine
  // from the wrong place. Their values are then taken, as PyTorch's load_state_dict takes the
  // scheduler's whole __dict__. A state without any (one saved by a version whose schedulers
  // saved none) loads into every scheduler and keeps the constructor's, so that such a
  // checkpoint still resumes.
  const std::vector<std::pair<std::string, double>> own = hyper_parameters();
  const auto is_own = [&](const std::string& key) {
    for (const auto& [name, value] : own)
      if (name == key) return true;
    return key == "last_epoch" || key == "base_lr" || key == "last_lr" || key == "optimizer_lr";
  };
  for (const auto& [key, t] : state) {
    const char* other = scheduler_with(key);
    NANODDP_CHECK(is_own(key), ValueError, name_, ".load_state_dict: unexpected key '", key, "'",
                  other != nullptr ? std::string(": this is a ") + other + "'s state, not a " + name_ + "'s" : "");
  }
  const int64_t last_epoch = int64_entry(state, "last_epoch", name_);
  NANODDP_CHECK(last_epoch >= 0, ValueError, name_, ".load_state_dict: 'last_epoch' is ", last_epoch);
  const double base_lr = double_entry(state, "base_lr", name_);
  const double last_lr = double_entry(state, "last_lr", name_);
  // The optimizer's lr at the save, which every scheduler chained on it saved alike: loaded in
  // any order they restore the same rate (each one's own last_lr would leave the last loaded
  // one's). A state saved without it gives last_lr, right for a scheduler alone.
  const double optimizer_lr = state.count("optimizer_lr") ? double_entry(state, "optimizer_lr", name_) : last_lr;
  std::vector<double> saved;
  for (const auto& [key, value] : own)
    if (state.count(key) != 0) saved.push_back(finite_entry(state, key, name_));
  if (!saved.empty()) {
    for (const auto& [key, value] : own)
      NANODDP_CHECK(state.count(key) != 0, ValueError, name_, ".load_state_dict: no '", key,
                    "' entry, where the state has the other hyper-parameters");
    try {
      set_hyper_parameters(saved);  // the last step that may throw: nothing has changed yet
    } catch (const ValueError& e) {
      throw ValueError(
          name_ +
          ".load_state_dict: a saved hyper-parameter is not one the constructor takes: " + message_of(e));
    }
  }
  optimizer_.set_lr(optimizer_lr);
  optimizer_.set_initial_lr(base_lr);
  last_epoch_ = last_epoch;
  base_lr_ = base_lr;
  last_lr_ = last_lr;
}

StepLR::StepLR(Optimizer& optimizer, int64_t step_size, double gamma)
    : LRScheduler(optimizer, "StepLR"), step_size_(step_size), gamma_(gamma) {
  check_step_lr(step_size);
  initial_step();
}

std::vector<std::pair<std::string, double>> StepLR::hyper_parameters() const {
  return {{"step_size", static_cast<double>(step_size_)}, {"gamma", gamma_}};
}

void StepLR::set_hyper_parameters(const std::vector<double>& values) {
  const int64_t step_size = saved_count(values[0], "step_size");
  check_step_lr(step_size);
  step_size_ = step_size;
  gamma_ = values[1];
}

double StepLR::get_lr() const {
  const double lr = optimizer_.lr();
  if (last_epoch_ == 0 || last_epoch_ % step_size_ != 0) return lr;
  return lr * gamma_;
}

CosineAnnealingLR::CosineAnnealingLR(Optimizer& optimizer, int64_t T_max, double eta_min)
    : LRScheduler(optimizer, "CosineAnnealingLR"), T_max_(T_max), eta_min_(eta_min) {
  check_cosine_annealing_lr(T_max);
  initial_step();
}

std::vector<std::pair<std::string, double>> CosineAnnealingLR::hyper_parameters() const {
  return {{"T_max", static_cast<double>(T_max_)}, {"eta_min", eta_min_}};
}

void CosineAnnealingLR::set_hyper_parameters(const std::vector<double>& values) {
  const int64_t T_max = saved_count(values[0], "T_max");
  check_cosine_annealing_lr(T_max);
  T_max_ = T_max;
  eta_min_ = values[1];
}

double CosineAnnealingLR::get_lr() const {
  const double T = static_cast<double>(T_max_), e = static_cast<double>(last_epoch_);
  const double lr = optimizer_.lr();
  if (last_epoch_ == 0) return lr;
  // One step past a minimum, where the ratio below would divide by 1 + cos(pi) = 0.
  if (floor_mod(last_epoch_ - 1 - T_max_, 2 * T_max_) == 0)
    return lr + (base_lr_ - eta_min_) * (1.0 - std::cos(M_PI / T)) / 2.0;
  return (1.0 + std::cos(M_PI * e / T)) / (1.0 + std::cos(M_PI * (e - 1.0) / T)) * (lr - eta_min_) + eta_min_;
}

LinearLR::LinearLR(Optimizer& optimizer, double start_factor, double end_factor, int64_t total_iters)
    : LRScheduler(optimizer, "LinearLR"), start_factor_(start_factor), end_factor_(end_factor), total_iters_(total_iters) {
  check_linear_lr(start_factor, end_factor, total_iters);
  initial_step();
}

std::vector<std::pair<std::string, double>> LinearLR::hyper_parameters() const {
  return {{"start_factor", start_factor_}, {"end_factor", end_factor_}, {"total_iters", static_cast<double>(total_iters_)}};
}

void LinearLR::set_hyper_parameters(const std::vector<double>& values) {
  const int64_t total_iters = saved_count(values[2], "total_iters");
  check_linear_lr(values[0], values[1], total_iters);
  start_factor_ = values[0];
  end_factor_ = values[1];
  total_iters_ = total_iters;
}

double LinearLR::get_lr() const {
  const double lr = optimizer_.lr();
  if (last_epoch_ == 0) return lr * start_factor_;
  if (last_epoch_ > total_iters_) return lr;
  const double slope = end_factor_ - start_factor_;
  // The factor is a ratio of two points of the line, both >= 0: it is never negative. At the
  // last step to end_factor 0 the division rounds it to about -2e-16 half the time (start
  // 1/3, total_iters 4), and the rate would be refused; torch carries the negative rate on.
  const double factor = 1.0 + slope / (static_cast<double>(total_iters_) * start_factor_ +
                                       static_cast<double>(last_epoch_ - 1) * slope);
  return lr * std::max(factor, 0.0);
}

LambdaLR::LambdaLR(Optimizer& optimizer, std::function<double(int64_t)> lr_lambda)
    : LRScheduler(optimizer, "LambdaLR"), lr_lambda_(std::move(lr_lambda)) {
  NANODDP_CHECK(static_cast<bool>(lr_lambda_), ValueError, "LambdaLR: lr_lambda is empty");
  initial_step();
}

double LambdaLR::get_lr() const { return base_lr_ * lr_lambda_(last_epoch_); }

}  // namespace nanoddp::nn
