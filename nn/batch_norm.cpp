// BatchNorm: forward, then backward right below, then the Module.
#include "nn/batch_norm.h"

#include <cmath>
#include <vector>

#include "core/autograd.h"
#include "core/op_helpers.h"
#include "kernels/kernels.h"

namespace nanoddp {

// Kernels of this file (kernels/{cpu,cuda}/batch_norm.*). in, out, dout, din: [N, C, L]
// (L = 1 for a 2-d input); every other array is per channel, [C], unless said otherwise.
// mean[c] and the biased var[c] over the N * L values of channel c, two passes in double. WRITES.
NANODDP_DECLARE_KERNEL(batch_norm_stats, float* mean, float* var, const float* in, int64_t N, int64_t C, int64_t L)
// invstd = 1 / sqrt(var + eps), or 0 where var and eps are both 0 and zero_for_no_spread is set
// (batch statistics of a constant channel: torch's batch_norm gives such a channel the bias
// and no gradient, where 1 / 0 would make them NaN). WRITES.
NANODDP_DECLARE_KERNEL(batch_norm_invstd, float* invstd, const float* var, int64_t C, float eps,
                       bool zero_for_no_spread)
// running_mean = (1 - momentum) running_mean + momentum mean; running_var the same with
// var * unbiased_scale. UPDATES in place.
NANODDP_DECLARE_KERNEL(batch_norm_update_running, float* running_mean, float* running_var, const float* mean,
                       const float* var, int64_t C, float momentum, double unbiased_scale)
// out = (in - mean) invstd weight + bias, per channel; weight and bias may be null. WRITES.
NANODDP_DECLARE_KERNEL(batch_norm_forward, float* out, const float* in, const float* mean, const float* invstd,
                       const float* weight, const float* bias, int64_t N, int64_t C, int64_t L)
// sums [2 C]: sums[c] = sum of dout, sums[C + c] = sum of dout xhat, xhat = (in - mean)
// invstd, in double. WRITES.
NANODDP_DECLARE_KERNEL(batch_norm_backward_reduce, float* sums, const float* dout, const float* in,
                       const float* mean, const float* invstd, int64_t N, int64_t C, int64_t L)
// din = weight invstd (dout - total_sums[c] / count - xhat total_sums[C + c] / count): the
// gradient through batch statistics of count values, whose sums (every process's) are
// total_sums; count == 0: the statistics were constants (running ones), din = weight invstd
// dout. dweight = local_sums[C + c], dbias = local_sums[c] (this process's share). weight may
// be null (1); WRITES each non-null output.
NANODDP_DECLARE_KERNEL(batch_norm_backward, float* din, float* dweight, float* dbias, const float* dout,
                       const float* in, const float* mean, const float* invstd, const float* weight,
                       const float* local_sums, const float* total_sums, double count, int64_t N, int64_t C,
                       int64_t L)
// count[0] += 1: num_batches_tracked, counted where it lives, so that a CUDA step does not wait
// for the device to read it. UPDATES in place.
NANODDP_DECLARE_KERNEL(batch_norm_count_batch, int64_t* count)

namespace {
float* ptr_or_null(const Tensor& t) { return t.defined() ? ptr(t) : nullptr; }

// Note [SyncBatchNorm statistics]: every process's batch together. Each process takes its own
// mean and biased variance (batch_norm_stats: two passes in double), and two all-reduces of
// sums merge them (Chan, Golub and LeVeque's parallel variance):
//   1. [M_r mean_r (C values), M_r]             -> M, and mean = sum of M_r mean_r / M;
//   2. [M_r var_r + M_r (mean_r - mean)^2 (C)]  -> M2, and var = M2 / M.
// Every term of step 2 is >= 0, so nothing cancels: sum x^2 / M - mean^2 from float32 sums
// would lose every digit of the variance once |mean| / std passes ~3000 (PyTorch merges each rank's
// mean and invstd in the same spirit, after one all_gather). A process with no values sends
// zeros. Returns M; mean and var are written on the input's device.
double synced_batch_stats(const Tensor& input, int64_t N, int64_t C, int64_t L, BatchStatsAllReduce& all_reduce,
                          Tensor& mean, Tensor& var) {
  const Device device = input.device();
  const double local_count = static_cast<double>(N * L);
  std::vector<float> local_mean(static_cast<size_t>(C), 0.0f), local_var(static_cast<size_t>(C), 0.0f);
  if (local_count > 0) {
    NANODDP_DISPATCH(device, batch_norm_stats, ptr(mean), ptr(var), ptr(input), N, C, L);
    local_mean = mean.to_vector();
    local_var = var.to_vector();
  }
  std::vector<float> first(static_cast<size_t>(C) + 1);
  for (int64_t c = 0; c < C; ++c) first[c] = static_cast<float>(local_count * local_mean[c]);
  first[C] = static_cast<float>(local_count);
  Tensor sums = Tensor::from_vector(first).to(device);
  all_reduce.all_reduce_sum(sums);
  const std::vector<float> totals = sums.to_vector();
  const double count = totals[C];
  std::vector<double> global_mean(static_cast<size_t>(C));
  std::vector<float> second(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) {
    global_mean[c] = count > 0 ? totals[c] / count : NAN;
    const double apart = local_mean[c] - global_mean[c];
    second[c] = static_cast<float>(local_count * local_var[c] + (local_count > 0 ? local_count * apart * apart : 0.0));
  }
  Tensor squares = Tensor::from_vector(second).to(device);
  all_reduce.all_reduce_sum(squares);
  const std::vector<float> m2 = squares.to_vector();
  std::vector<float> mean_values(static_cast<size_t>(C)), var_values(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) {
    mean_values[c] = static_cast<float>(global_mean[c]);
    var_values[c] = static_cast<float>(count > 0 ? m2[c] / count : NAN);
  }
  mean = Tensor::from_vector(mean_values).to(device);
  var = Tensor::from_vector(var_values).to(device);
  return count;
}

void check_channels(const Tensor& input, const Tensor& t, const char* what, int64_t C) {
  if (!t.defined()) return;
  check_float("batch_norm", t, what);
  check_same_device("batch_norm", input, t);
  NANODDP_CHECK(t.shape() == Shape{C}, ShapeError, "batch_norm: ", what, " is ", t.shape(), " but input ",
                input.shape(), " has ", C, " channels");
}
}  // namespace

Tensor batch_norm(const Tensor& input_in, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, float momentum, float eps,
                  std::shared_ptr<BatchStatsAllReduce> all_reduce) {
  ForwardSpan span("batch_norm", {&input_in, &weight, &bias});
  const Tensor input = as_float32(input_in);  // Note [Autocast], group 2: statistics in float32
  check_float("batch_norm", input, "input");
  NANODDP_CHECK(input.dim() == 2 || input.dim() == 3, ShapeError,
                "batch_norm: expected a 2-d [N, C] or 3-d [N, C, L] input, got ", input.shape());
  NANODDP_CHECK(eps >= 0.0f, ValueError, "batch_norm: eps must be >= 0, got ", eps);
  const int64_t N = input.size(0), C = input.size(1), L = input.dim() == 3 ? input.size(2) : 1;
  check_channels(input, running_mean, "running_mean", C);
  check_channels(input, running_var, "running_var", C);
  check_channels(input, weight, "weight", C);
  check_channels(input, bias, "bias", C);
  NANODDP_CHECK(running_mean.defined() == running_var.defined(), ValueError,
                "batch_norm: running_mean and running_var must be both defined or both undefined");
  const Device device = input.device();

  Tensor mean, var;
  double count = 0;  // values per channel behind the batch statistics; 0 = running statistics
  if (training) {
    mean = Tensor::empty({C}, DType::Float32, device);
    var = Tensor::empty({C}, DType::Float32, device);
    if (all_reduce) {
      count = synced_batch_stats(input, N, C, L, *all_reduce, mean, var);
    } else {
      count = static_cast<double>(N * L);
      NANODDP_DISPATCH(device, batch_norm_stats, ptr(mean), ptr(var), ptr(input), N, C, L);
    }
    // An empty batch normalises nothing and leaves the running statistics as they are, as
    // torch.batch_norm does for an input of no elements; one value has no variance to take.
    NANODDP_CHECK(count != 1, ValueError, "batch_norm: expected more than 1 value per channel when training, got input ",
                  input.shape(), all_reduce ? " (all processes together: " : "",
                  all_reduce ? std::to_string(static_cast<int64_t>(count)) + " values)" : "");
    if (count == 0) {  // no statistics (0/0): finite stand-ins keep backward's empty sums at 0
      mean = Tensor::zeros({C}, DType::Float32, device);
      var = Tensor::ones({C}, DType::Float32, device);
    }
    if (running_mean.defined() && count > 0 && !is_recomputing())  // a checkpoint's rerun counts no second batch
      NANODDP_DISPATCH(device, batch_norm_update_running, ptr(running_mean), ptr(running_var), ptr(mean), ptr(var),
                       C, momentum, count / (count - 1));
  } else {
    NANODDP_CHECK(running_mean.defined(), ValueError,
                  "batch_norm: evaluation (training = false) needs running_mean and running_var");
    mean = running_mean.detach();
    var = running_var.detach();
  }
  Tensor invstd = Tensor::empty({C}, DType::Float32, device);
  NANODDP_DISPATCH(device, batch_norm_invstd, ptr(invstd), ptr(var), C, eps, training);
  Tensor out = empty_like(input);
  NANODDP_DISPATCH(device, batch_norm_forward, ptr(out), ptr(input), ptr(mean), ptr(invstd), ptr_or_null(weight),
                   ptr_or_null(bias), N, C, L);

  // mean is saved as a copy in eval: the running buffers change under the graph otherwise.
  // The eval node is named apart: its backward takes the statistics as constants, and a
  // checkpoint's rerun in the other mode must be refused, not mix one mode's formula with the
  // other's statistics.
  if (!training) mean = mean.clone();
  const char* node_name = training ? "BatchNormBackward" : "BatchNormEvalBackward";
  return record(node_name, out, {input, weight, bias}, {input, weight, mean, invstd},
                [N, C, L, count, all_reduce](const Node& node, const Tensor& dout) {
    const Tensor& x = node.saved(0);
    const Tensor& w = node.saved(1);
    const Tensor& mean = node.saved(2);
    const Tensor& invstd = node.saved(3);
    Tensor dx = node.needs_input_grad(0) ? empty_like(x) : Tensor();
    Tensor dw = node.needs_input_grad(1) ? empty_like(node.inputs[1]) : Tensor();
    Tensor db = node.needs_input_grad(2) ? empty_like(node.inputs[2]) : Tensor();
    Tensor local = Tensor::empty({2 * C}, DType::Float32, x.device());
    NANODDP_DISPATCH(x.device(), batch_norm_backward_reduce, ptr(local), ptr(dout), ptr(x), ptr(mean), ptr(invstd), N,
                     C, L);
    Tensor total = local;
    if (all_reduce && count > 0) {  // every process calls this once per backward, dx wanted or not
      total = local.clone();
      all_reduce->all_reduce_sum(total);
    }
    NANODDP_DISPATCH(x.device(), batch_norm_backward, ptr_or_null(dx), ptr_or_null(dw), ptr_or_null(db), ptr(dout),
                     ptr(x), ptr(mean), ptr(invstd), ptr_or_null(w), ptr(local), ptr(total), count, N, C, L);
    return std::vector<Tensor>{dx, dw, db};
  });
}

namespace nn {

std::vector<Tensor> BatchNorm1d::zero_if_missing() {
  if (!track_running_stats_) return {};
  return {num_batches_tracked};
}

BatchNorm1d::BatchNorm1d(int64_t num_features, float eps, std::optional<float> momentum, bool affine,
                         bool track_running_stats)
    : num_features_(num_features), eps_(eps), momentum_(momentum), track_running_stats_(track_running_stats) {
  NANODDP_CHECK(num_features >= 1, ValueError, "BatchNorm1d: num_features must be >= 1, got ", num_features);
  NANODDP_CHECK(eps >= 0.0f, ValueError, "BatchNorm1d: eps must be >= 0, got ", eps);
  if (affine) {
    weight = register_parameter("weight", Tensor::ones({num_features}));
    bias = register_parameter("bias", Tensor::zeros({num_features}));
  }
  if (track_running_stats) {
    running_mean = register_buffer("running_mean", Tensor::zeros({num_features}));
    running_var = register_buffer("running_var", Tensor::ones({num_features}));
    num_batches_tracked = register_buffer("num_batches_tracked", Tensor::zeros(Shape{}, DType::Int64));
  }
}

Tensor BatchNorm1d::forward(const Tensor& input) {
  // As torch's _BatchNorm.forward: check the input's rank (_check_input_dim), so that a
  // refused input counts no batch; then count the batch and pick the averaging factor.
  NANODDP_CHECK(input.dim() == 2 || input.dim() == 3, ShapeError,
                "BatchNorm1d: expected a 2-d [N, C] or 3-d [N, C, L] input, got ", input.shape());
  float factor = momentum_.value_or(0.0f);
  if (is_training() && track_running_stats_ && !is_recomputing()) {  // a checkpoint's rerun counts no batch
    NANODDP_DISPATCH(num_batches_tracked.device(), batch_norm_count_batch,
                     num_batches_tracked.data<int64_t>());
    // momentum=None needs the count on the host (torch reads it too: 1.0 / float(count)); with
    // a momentum the count stays where it is, and a CUDA step does not wait for it.
    if (!momentum_)
      factor = 1.0f / static_cast<float>(num_batches_tracked.to(Device::cpu()).data<int64_t>()[0]);
  }
  // Statistics cross processes in training only: in eval without running stats each process
  // normalises its own batch (SyncBatchNorm's need_sync in PyTorch).
  const bool batch_statistics = is_training() || !track_running_stats_;
  return batch_norm(input, running_mean, running_var, weight, bias, batch_statistics, factor, eps_,
                    is_training() ? all_reduce_ : nullptr);
}

}  // namespace nn
}  // namespace nanoddp
