// The main job: an MLP (784-256-128-10, ReLU) trained on Fashion-MNIST with DDP; run as
// fashion_mnist_cnn (examples/fashion_mnist_main.cpp), the same job on a CNN:
// Conv(1->32, 3)-ReLU-MaxPool(2)-Conv(32->64, 3)-ReLU-MaxPool(2)-Flatten-Linear(1600, 128)-
// ReLU-Dropout(0.1)-Linear(128, 10), with --batch-norm a BatchNorm2d after each Conv
// (--sync-batch-norm: a SyncBatchNorm, docs/batch-norm.md). Everything else (flags, JSON line)
// is shared, but for --hidden (the MLP's widths), which the CNN refuses.
//
//   nanoddp-run --nproc-per-node 2 --backend mpi build/examples/fashion_mnist --epochs 10
//   nanoddp-run --nproc-per-node 2 --backend mpi build/examples/fashion_mnist_cnn --epochs 5
//   nanoddp-run --nproc-per-node 2 build/examples/fashion_mnist --explain --trace run.json
//       --hidden 1024,1024,512 --bucket-cap-mb 4      # several buckets, overlapping backward
//   nanoddp-run --nproc-per-node 2 build/examples/fashion_mnist --comm-hook bf16   # half the bytes
//   nanoddp-run --nproc-per-node 2 build/examples/fashion_mnist --precision bf16   # nn::autocast
//   nanoddp-run --nproc-per-node 2 build/examples/fashion_mnist --gradient-as-bucket-view
//   nanoddp-run --nproc-per-node 2 build/examples/fashion_mnist --find-unused-parameters --explain
//   nanoddp-run --nproc-per-node 2 build/examples/fashion_mnist_cnn --sync-batch-norm --explain
//
// Each epoch: every rank trains on its DistributedSampler share (batch_size per rank, so the
// global batch is batch_size * world_size); the mean training loss is averaged over ranks;
// the test set is split with the evaluation sampler (every image counted exactly once) and
// the correct counts are summed with all_reduce; rank 0 prints the epoch and saves a
// checkpoint atomically. --resume continues from that checkpoint so that the result equals
// an uninterrupted run: the weights, the optimizer's state (momentum buffers, or Adam's
// moments and step counts), the schedulers and the epoch are restored, and the data order
// depends only on seed and epoch; on another number of ranks or another batch size the
// schedule is replayed over the new steps (Note [Resuming elsewhere]). --checkpoint-every N
// also saves during the epoch, every N steps, with the position in the epoch; a group that
// `nanoddp-run --max-restarts` starts again resumes from it by itself (Note [Resuming
// mid-epoch]). --checkpoint-format sharded (zero1, zero2, fsdp) saves a set instead: each rank
// writes its part, rank 0 a manifest as FILE; either kind resumes at any world size and
// strategy (Note [Sharded checkpoint sets]). --optimizer picks SGD, Adam or AdamW; the learning rate
// follows --warmup-epochs of linear warm-up (LinearLR, stepped per batch), then the
// --schedule (CosineAnnealingLR per batch over the remaining steps, or constant), as
// torch.optim.lr_scheduler.SequentialLR would chain them. --stop-after N ends a run
// early as a time-limited job would. --export FILE.safetensors writes the trained weights
// for PyTorch (benchmarks/torch_reference/load_safetensors.py). Rank 0 ends with one JSON
// line (see README).
#include "data/fashion_mnist.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/autograd.h"
#include "core/file_io.h"
#include "core/hash.h"
#include "core/memory.h"
#include "data/dataloader.h"
#include "dist/ddp.h"
#include "dist/explain.h"
#include "dist/grad_scaler.h"
#include "dist/gradient_accumulation.h"
#include "dist/host_collectives.h"
#include "dist/init.h"
#include "dist/sharded_checkpoint.h"
#include "dist/sync_batch_norm.h"
#include "examples/checkpoint_files.h"
#include "examples/example_utils.h"
#include "examples/fashion_mnist.h"
#include "examples/fault_injection.h"
#include "examples/metrics.h"
#include "examples/parallel_strategy.h"
#include "nn/adam.h"
#include "nn/autocast.h"
#include "nn/batch_norm.h"
#include "nn/checkpoint.h"
#include "nn/conv.h"
#include "nn/dropout.h"
#include "nn/layers.h"
#include "nn/lr_scheduler.h"
#include "nn/optim.h"
#include "nn/safetensors.h"
#include "tools/usage_error.h"

using namespace nanoddp;

namespace {

using Config = examples::FashionMnistConfig;

// DDP's bucket caps are given in MiB, as torch's bucket_cap_mb is (bytes = mb * 1024 * 1024).
size_t mib_to_bytes(double mb) { return static_cast<size_t>(mb * 1024.0 * 1024.0); }

// What --export's metadata says the weights are for (PyTorch's names for the same model).
constexpr const char* kCnnDescription =
    "torch.nn.Sequential(NormalizedImages(), Conv2d(1, 32, 3), ReLU(), MaxPool2d(2), Conv2d(32, 64, 3), ReLU(), "
    "MaxPool2d(2), Flatten(), Linear(1600, 128), ReLU(), Dropout(0.1), Linear(128, 10)) on pixels / 255, "
    "NormalizedImages = ((x - 0.2860) / 0.3530).reshape(N, 1, 28, 28)";

// The loader's rows of 784 pixels in [0, 1] as normalised [N, 1, 28, 28] images, (x - mean) /
// std with the training set's pixel mean and std, as torchvision's Normalize((0.2860,),
// (0.3530,)) does in PyTorch's Fashion-MNIST recipes: inputs centred at 0 with unit spread
// keep the first convolution's updates in scale with the others'.
class NormalizedImages : public nn::Module {
 public:
  static constexpr float kMean = 0.2860f, kStd = 0.3530f;
  Tensor forward(const Tensor& input) override {
    if (!shift_.defined() || shift_.device() != input.device())
      shift_ = Tensor::full({data::FashionMNIST::kFeatures}, -kMean / kStd, input.device());
    return (input * (1.0f / kStd) + shift_).reshape({input.size(0), 1, 28, 28});
  }

 private:
  Tensor shift_;  // [784] of -mean / std, added to every row
};

// torch.nn.BatchNorm2d(C) for --batch-norm: [N, C, H, W] normalised per channel over N, H and
// W, which is BatchNorm1d over [N, C, H * W]. Its "norm" is a BatchNorm1d, so
// dist::convert_sync_batchnorm turns it into a SyncBatchNorm for --sync-batch-norm.
class BatchNorm2d : public nn::Module {
 public:
  explicit BatchNorm2d(int64_t channels) : norm(register_module("norm", std::make_shared<nn::BatchNorm1d>(channels))) {}
  Tensor forward(const Tensor& input) override {
    const Shape shape = input.shape();
    return (*norm)(input.reshape({shape[0], shape[1], -1})).reshape(shape);
  }
  std::shared_ptr<nn::BatchNorm1d> norm;
};

// Dropout draws from its own generator (seeded per rank by the caller), not the weights'.
// batch_norm: a BatchNorm2d after each Conv2d (the convolutions keep their biases, as in
// PyTorch's module when nobody turns them off).
std::shared_ptr<nn::Sequential> make_cnn(uint64_t seed, Generator& dropout_gen, bool batch_norm) {
  Generator gen(seed);
  auto model = std::make_shared<nn::Sequential>();
  model->add(NormalizedImages());
  model->add(nn::Conv2d(1, 32, 3, gen));   // [N, 32, 26, 26]
  if (batch_norm) model->add(std::make_shared<BatchNorm2d>(32));
  model->add(nn::ReLU());
  model->add(nn::MaxPool2d(2));            // [N, 32, 13, 13]
  model->add(nn::Conv2d(32, 64, 3, gen));  // [N, 64, 11, 11]
  if (batch_norm) model->add(std::make_shared<BatchNorm2d>(64));
  model->add(nn::ReLU());
  model->add(nn::MaxPool2d(2));            // [N, 64, 5, 5]
  model->add(nn::Flatten());               // [N, 1600]
  model->add(nn::Linear(1600, 128, gen));
  model->add(nn::ReLU());
  // 0.1, not 0.25: in 5 epochs this model still underfits (train loss falling every epoch),
  // and with 0.25 the eight recipes tried (SGD lr, batch, weight decay; Adam) ended at 0.898 to
  // 0.910 test accuracy on 2 ranks.
  model->add(nn::Dropout(0.1f, dropout_gen));
  model->add(nn::Linear(128, data::FashionMNIST::kClasses, gen));
  return model;
}
constexpr const char* kMlpDescription =
    "torch.nn.Sequential(Linear(784, hidden[0]), ReLU(), ..., Linear(hidden[-1], 10)) on pixels / 255";

// 784 -> hidden[0] -> ... -> 10, a ReLU after every hidden layer.
std::shared_ptr<nn::Sequential> make_mlp(uint64_t seed, const std::vector<int64_t>& hidden) {
  Generator gen(seed);
  auto model = std::make_shared<nn::Sequential>();
  int64_t in = data::FashionMNIST::kFeatures;
  for (int64_t width : hidden) {
    model->add(nn::Linear(in, width, gen));
    model->add(nn::ReLU());
    in = width;
  }
  model->add(nn::Linear(in, data::FashionMNIST::kClasses, gen));
  return model;
}

// Loss checks read the device's running sum this often (a sync on a GPU).
constexpr int64_t kCheckEverySteps = 50;

// Training that has blown up stops with the epoch and step, as toy_ddp does.
void check_finite(float mean_loss, const Config& config, int rank, int epoch, int64_t step) {
  NANODDP_CHECK(std::isfinite(mean_loss), ValueError, "rank ", rank, ": the mean training loss became ",
                mean_loss, " in epoch ", epoch + 1, " by step ", step,
                config.optimizer == "sgd" ? "; lower --lr or --momentum" : "; lower --lr");
}

double default_lr(const Config& config) { return config.optimizer == "sgd" ? 0.05 : 1e-3; }

std::unique_ptr<nn::Optimizer> make_optimizer(const Config& config, std::vector<Tensor> params) {
  const double lr = config.lr.value_or(default_lr(config));
  if (config.optimizer == "adam") {
    nn::AdamOptions options;
    options.lr = lr;
    options.weight_decay = config.weight_decay.value_or(options.weight_decay);
    return std::make_unique<nn::Adam>(std::move(params), options);
  }
  if (config.optimizer == "adamw") {
    nn::AdamWOptions options;
    options.lr = lr;
    options.weight_decay = config.weight_decay.value_or(options.weight_decay);
    return std::make_unique<nn::AdamW>(std::move(params), options);
  }
  nn::SGDOptions options;
  options.lr = lr;
  options.momentum = config.momentum.value_or(0.9f);
  options.weight_decay = static_cast<float>(config.weight_decay.value_or(0.0));
  return std::make_unique<nn::SGD>(std::move(params), options);
}

// The learning rate per batch: warm-up over the first warmup_steps, then the schedule.
// Both schedulers are built at the start and take the configured lr (the optimizer's
// initial_lr) as base_lr; the cosine first, so that the warm-up's first rate is the one set.
// At the switch the cosine's lr at its epoch 0 applies, as
// torch.optim.lr_scheduler.SequentialLR restarts the next scheduler there.
class Schedule {
 public:
  Schedule(nn::Optimizer& optimizer, const Config& config, int64_t steps_per_epoch)
      : optimizer_(optimizer),
        warmup_steps_(config.warmup_epochs * steps_per_epoch),
        total_steps_(config.epochs * steps_per_epoch) {
    if (config.schedule == "cosine")
      cosine_.emplace(optimizer, /*T_max=*/std::max<int64_t>(total_steps_ - warmup_steps_, 1));
    if (warmup_steps_ > 0) warmup_.emplace(optimizer, 1.0 / 3, 1.0, warmup_steps_);
  }
  // After optimizer.step() of global step t (0-based): the lr for step t + 1.
  void step(int64_t t) {
    if (t + 1 < warmup_steps_) {
      warmup_->step();
    } else if (t + 1 == warmup_steps_) {
      optimizer_.set_lr(cosine_ ? cosine_->get_last_lr() : warmup_->base_lr());
    } else if (cosine_) {
      cosine_->step();
    }
  }
  // Steps a schedule that has not stepped yet through global steps 0..t-1, as an uninterrupted
  // run would have: where a checkpoint comes from a run with other steps per epoch (another
  // world size or batch size), its schedulers' state belongs to another curve, and the
  // cosine's recursive step continued from there would run away (Note [Resuming elsewhere]).
  void replay(int64_t t) {
    for (int64_t step_index = 0; step_index < t; ++step_index) step(step_index);
  }
  int64_t total_steps() const { return total_steps_; }
  int64_t warmup_steps() const { return warmup_steps_; }
  bool cosine() const { return cosine_.has_value(); }
  nn::StateDict state_dict() const {
    nn::StateDict state;
    state["total_steps"] = Tensor::from_vector(std::vector<int64_t>{total_steps_});
    state["warmup_steps"] = Tensor::from_vector(std::vector<int64_t>{warmup_steps_});
    if (warmup_) nn::merge_prefixed(state, "warmup.", warmup_->state_dict());
    if (cosine_) nn::merge_prefixed(state, "cosine.", cosine_->state_dict());
    return state;
  }
  // Restores both schedulers, then the lr of the one in charge at global step t.
  void load_state_dict(const nn::StateDict& state, int64_t t) {
    if (warmup_) warmup_->load_state_dict(nn::strip_prefix(state, "warmup."));
    if (cosine_) cosine_->load_state_dict(nn::strip_prefix(state, "cosine."));
    if (t < warmup_steps_)
      optimizer_.set_lr(warmup_->get_last_lr());
    else if (warmup_)
      optimizer_.set_lr(cosine_ ? cosine_->get_last_lr() : warmup_->base_lr());
  }

 private:
  nn::Optimizer& optimizer_;
  int64_t warmup_steps_, total_steps_;
  std::optional<nn::CosineAnnealingLR> cosine_;
  std::optional<nn::LinearLR> warmup_;
};

// Test accuracy over the whole test set, each image counted once across ranks.
// Every rank runs as many forwards as the rank with the most test batches, rank 0 (the
// evaluation sampler gives the first N mod W ranks one image more, and a rank may have none):
// under FSDP and ZeRO-2 a forward is a collective (its units' all-gathers), and DDP's first
// forward after training broadcasts BatchNorm's buffers. A rank that has run out forwards one
// test image again and drops the output.
double evaluate(nn::Module& model, data::DataLoader& loader, dist::ProcessGroup& pg, const std::string& precision) {
  NoGradGuard no_grad;
  nn::autocast autocast(precision == "fp16" ? DType::Float16 : DType::BFloat16, precision != "fp32");
  model.eval();
  const data::DistributedSampler& sampler = loader.sampler();
  const int64_t rank0_images =
      data::DistributedSampler::for_evaluation(sampler.size(), sampler.num_replicas(), 0).num_samples();
  const int64_t forwards = (rank0_images + loader.batch_size() - 1) / loader.batch_size();
  int64_t correct = 0, seen = 0, forwarded = 0;
  for (const data::Batch& batch : loader) {
    const std::vector<int64_t> predicted = argmax(model(batch.input)).to_int_vector();
    const std::vector<int64_t> labels = batch.target.to_int_vector();
    for (size_t i = 0; i < labels.size(); ++i) correct += predicted[i] == labels[i];
    seen += static_cast<int64_t>(labels.size());
    ++forwarded;
  }
  if (forwarded < forwards) {
    const Tensor filler = loader.dataset().get_batch({0}).input.to(loader.options().device);
    for (; forwarded < forwards; ++forwarded) model(filler);
  }
  model.train();
  const std::vector<int64_t> totals = dist::all_reduce_host(pg, std::vector<int64_t>{correct, seen}, dist::ReduceOp::Sum);
  return static_cast<double>(totals[0]) / static_cast<double>(totals[1]);
}

// The optimizer's settings besides the learning rate (which the schedule owns), by flag:
// "momentum" is --momentum. A checkpoint keeps them; a resume with others is refused, where
// torch's load_state_dict would quietly restore the saved ones over what the run asked for.
nn::StateDict optimizer_settings(const Config& config) {
  nn::StateDict settings;
  if (config.optimizer == "sgd") settings["momentum"] = Tensor::scalar(config.momentum.value_or(0.9f));
  const double default_decay = config.optimizer == "adamw" ? nn::AdamWOptions{}.weight_decay : 0.0;
  settings["weight_decay"] = Tensor::scalar(static_cast<float>(config.weight_decay.value_or(default_decay)));
  return settings;
}

// The checkpoint's run's --lr: its schedulers' base_lr (saved as a double's bits); none from a
// checkpoint without one.
std::optional<double> saved_base_lr(const nn::StateDict& state) {
  for (const char* key : {"scheduler.cosine.base_lr", "scheduler.warmup.base_lr"}) {
    const auto it = state.find(key);
    if (it == state.end() || it->second.dtype() != DType::Int64 || it->second.numel() != 1) continue;
    const int64_t bits = it->second.to_int_vector()[0];
    double lr = 0;
    std::memcpy(&lr, &bits, sizeof lr);
    return lr;
  }
  return std::nullopt;
}

int64_t optimizer_kind(const std::string& name) {
  const std::vector<std::string>& names = examples::optimizer_names();
  return std::find(names.begin(), names.end(), name) - names.begin();
}

// Where a run is within an epoch: steps done and, per rank, its running loss sum and samples,
// so that a run resumed there reports the epoch's loss as an uninterrupted one does.
struct EpochProgress {
  int64_t steps = 0;                // 0: at the epoch's start
  int64_t steps_taken = 0;          // the metrics log's step at the checkpoint (its runs' steps in all)
  std::vector<float> loss_sums;     // one per rank (steps > 0)
  std::vector<int64_t> samples;     // one per rank (steps > 0)
  std::vector<int64_t> bucket_order;  // DDP's re-planned bucket order, when the checkpoint has one
};

// This job as its checkpoints name it: a digest of NANODDP_JOB_ID, which nanoddp-run gives every
// round of one job alike (through mpirun too); none when the variable is unset (a bare mpirun,
// or nodes that were not given one).
std::optional<int64_t> job_digest() {
  const char* id = std::getenv(dist::kJobIdEnv);
  if (id == nullptr || *id == '\0') return std::nullopt;
  return static_cast<int64_t>(fnv1a(id));
}

// A collective (the sharded strategies gather the state; during an epoch, steps_in_epoch > 0,
// the ranks' loss sums and samples are gathered too); rank 0 writes, or with sharded every
// rank writes its part of a set and rank 0 its manifest. loss_sum and samples are this rank's.
void save(const std::string& path, bool sharded, int epochs_done, int64_t steps_per_epoch, int64_t batch_size,
          examples::ParallelModel& parallel, nn::Optimizer& optimizer, const std::string& optimizer_name,
          const nn::StateDict& settings, uint64_t seed, const Schedule& schedule,
          const dist::GradScaler& scaler, int64_t metrics_step, int rank, dist::ProcessGroup& pg,
          std::chrono::milliseconds timeout, int64_t steps_in_epoch = 0, float loss_sum = 0,
          int64_t samples = 0) {
  // Sharded, nothing is gathered: each rank keeps its pieces.
  nn::StateDict model_state, optimizer_state;
  if (!sharded) {
    model_state = parallel.model_state_dict();
    optimizer_state = parallel.optimizer_state_dict(optimizer);
  }
  std::vector<float> loss_sums;
  std::vector<int64_t> all_samples;
  if (steps_in_epoch > 0) {
    // Each rank fills its own slot: a sum with zeros elsewhere is exact.
    loss_sums.assign(static_cast<size_t>(pg.size()), 0.0f);
    loss_sums[static_cast<size_t>(rank)] = loss_sum;
    loss_sums = dist::all_reduce_host(pg, loss_sums, dist::ReduceOp::Sum);
    for (const auto& one : dist::all_gather_host(pg, std::vector<int64_t>{samples})) all_samples.push_back(one[0]);
  }
  if (rank != 0 && !sharded) return;
  nn::StateDict state;
  nn::merge_prefixed(state, "model.", model_state);
  nn::merge_prefixed(state, "optimizer.", optimizer_state);
  nn::merge_prefixed(state, "scheduler.", schedule.state_dict());
  // fp16's loss scale and growth tracker: a resumed run scales as an uninterrupted one would.
  if (scaler.is_enabled()) nn::merge_prefixed(state, "scaler.", scaler.state_dict());
  state["epochs_done"] = Tensor::from_vector(std::vector<int64_t>{epochs_done});
  state["steps_per_epoch"] = Tensor::from_vector(std::vector<int64_t>{steps_per_epoch});
  state["batch_size"] = Tensor::from_vector(std::vector<int64_t>{batch_size});
  // The metrics log's step at this point: runs resumed at other world sizes count on from it.
  state["metrics_step"] = Tensor::from_vector(std::vector<int64_t>{metrics_step});
  state["optimizer_kind"] = Tensor::from_vector(std::vector<int64_t>{optimizer_kind(optimizer_name)});
  nn::merge_prefixed(state, "optimizer_settings.", settings);
  state["seed"] = Tensor::from_vector(std::vector<int64_t>{static_cast<int64_t>(seed)});
  if (const std::optional<int64_t> job = job_digest()) state["job"] = Tensor::from_vector(std::vector<int64_t>{*job});
  // DDP's re-planned buckets (Note [Bucket rebuild]): the resumed run reduces in the same
  // buckets, so its sums run in the same order as this run's.
  if (parallel.ddp() != nullptr && parallel.ddp()->reducer().buckets_rebuilt())
    state["ddp.bucket_order"] = Tensor::from_vector(parallel.ddp()->reducer().bucket_order());
  if (steps_in_epoch > 0) {
    state["epoch_progress.steps"] = Tensor::from_vector(std::vector<int64_t>{steps_in_epoch});
    state["epoch_progress.loss_sums"] = Tensor::from_vector(loss_sums);
    state["epoch_progress.samples"] = Tensor::from_vector(all_samples);
  }
  if (sharded) {
    dist::ShardedStateDict mine = parallel.sharded_state_dict(optimizer);
    // What every rank holds alike (gathered above, where it differs by rank), every rank
    // saves: a reader takes it from a file it opens anyway.
    for (const auto& [name, tensor] : state) mine[name] = dist::whole_entry(tensor);
    dist::save_sharded_checkpoint(path, mine, pg, timeout);
    return;
  }
  examples::save_keeping_previous(path, state);
  dist::remove_unused_shard_files(path);  // the sets of an earlier sharded run that this file replaced
}

// A checkpoint read for resuming, whichever its kind: a full checkpoint's entries, or a set's
// (Note [Sharded checkpoint sets] in dist/sharded_checkpoint.h) with the model and optimizer
// state as this rank loads it.
struct ReadCheckpoint {
  nn::StateDict state;  // every entry; from a set, every entry but the model's and the optimizer's
  std::optional<examples::ParallelModel::LocalState> local;  // from a set: this rank's part
  bool other_job = false;  // read_checkpoint's only_job differs from the file's: nothing else was read
};

// Whether a checkpoint whose "job" entry is `job` (none: an unset optional) is another job's
// than only_job; never without only_job.
bool other_job(std::optional<int64_t> only_job, std::optional<int64_t> job) { return only_job && job != only_job; }

// The value of checkpoint entry `key`, which must be one int64.
int64_t int64_value(const std::string& key, const Tensor& entry) {
  NANODDP_CHECK(entry.dtype() == DType::Int64 && entry.numel() == 1, IOError, "no '", key, "' entry of one int64");
  return entry.to_int_vector()[0];
}

// One int64 entry of a checkpoint, or `missing` when it has none (an older checkpoint).
int64_t int64_entry(const nn::StateDict& state, const std::string& key, std::optional<int64_t> missing) {
  const auto it = state.find(key);
  if (it == state.end() && missing) return *missing;
  NANODDP_CHECK(it != state.end(), IOError, "no '", key, "' entry of one int64");
  return int64_value(key, it->second);
}

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

// Reads path (or path's previous checkpoint when path is damaged) and sets used_path to the
// file read. A set is read by every rank, each its own part; when a rank cannot read its part
// (a missing or damaged shard file), every rank goes to the previous checkpoint together,
// warning on stderr, or fails: ranks that resumed from different sets would part ways.
// With only_job, a checkpoint of another job (Note [Restart rounds] in dist/launch.cpp) is
// only opened: other_job is set and nothing more is read. A collective for a set.
ReadCheckpoint read_checkpoint(const std::string& path, const examples::ParallelModel& parallel,
                               const nn::Optimizer& optimizer, dist::ProcessGroup& pg, std::string& used_path,
                               std::optional<int64_t> only_job) {
  nn::StateDict state;
  std::tie(state, used_path) = examples::load_newest_readable(path);
  while (true) {
    if (!dist::is_sharded_manifest(state)) {
      const auto job = state.find("job");
      ReadCheckpoint read;
      read.other_job =
          other_job(only_job, job == state.end() ? std::nullopt : std::optional(int64_value("job", job->second)));
      if (!read.other_job) read.state = std::move(state);
      return read;
    }
    ReadCheckpoint read;
    std::string error;
    try {
      dist::ShardedCheckpointReader reader(used_path, state);
      reader.set_reading_rank(pg.rank(), pg.size());  // the job id from a file this rank reads anyway
      const std::vector<std::string> names = reader.names();
      const bool has_job = std::find(names.begin(), names.end(), "job") != names.end();
      read.other_job =
          other_job(only_job, has_job ? std::optional(int64_value("job", reader.read("job"))) : std::nullopt);
      if (read.other_job) return read;  // every rank reads the same entry: no rank goes on
      // This rank's part first: the rest is then read from the files it opened.
      read.local = parallel.read_sharded(reader, optimizer);
      for (const std::string& name : reader.names())
        if (!starts_with(name, "model.") && !starts_with(name, "optimizer."))
          read.state[name] = reader.read(name);
    } catch (const Error& e) {
      error = message_of(e);
    }
    const std::vector<std::vector<int64_t>> failed = dist::all_gather_host(pg, {error.empty() ? 0 : 1});
    std::string failed_ranks;
    for (size_t r = 0; r < failed.size(); ++r)
      if (failed[r][0] != 0) failed_ranks += (failed_ranks.empty() ? "" : ", ") + std::to_string(r);
    if (failed_ranks.empty()) return read;
    const std::string previous = examples::previous_checkpoint(path);
    const std::string why = error.empty() ? "rank(s) " + failed_ranks + " could not read their part of it" : error;
    NANODDP_CHECK(used_path == path && std::filesystem::exists(previous), IOError, why);
    if (!error.empty()) {
      std::fprintf(stderr, "warning: rank %d: checkpoint %s cannot be loaded (%s); using the previous one, %s\n",
                   pg.rank(), path.c_str(), error.c_str(), previous.c_str());
      std::fflush(stderr);
    }
    state = nn::load_checkpoint(previous);
    used_path = previous;
  }
}

// Note [Resuming elsewhere]
// A checkpoint is written at the end of an epoch, so a run resumes at an epoch boundary,
// which means the same thing at any world size or batch size: the data order of every epoch
// depends only on the seed and the epoch (DistributedSampler.set_epoch), and the weights and
// the optimizer's state do not depend on how a step was split across ranks. The learning
// rate does: it follows global steps, and there are fewer of them per epoch on more ranks.
// With the checkpoint's steps per epoch and schedule length, its schedulers are loaded and go
// on exactly; with others (another world size or batch size, or another --epochs or
// --warmup-epochs), the schedule is replayed over this run's steps, so that it ends at
// --epochs as an uninterrupted run of this shape would (the checkpoint's own step counters
// would leave the cosine off its curve and its recursive step diverging; a finished cosine
// resumed for more epochs would stay at lr 0).
//
// Note [Resuming mid-epoch]
// A checkpoint saved during an epoch (--checkpoint-every) also holds the steps done in it and
// each rank's running loss sum and samples. The resumed run sets the sampler's epoch, passes
// over the batches already taken (the order depends only on seed and epoch, so they are the
// same batches), and goes on from the next one; Dropout's generator is reseeded per rank and
// step, so its masks need no saved state. Positions within an epoch mean something only for
// the same world size and --batch-size (two batch sizes can make as many steps, and the steps
// done would skip other examples): such a checkpoint resumes only there.
//
// Returns how many epochs the checkpoint had completed, and where it is in the next one; sets
// used_path to the file it came from (path, or path's previous one when path is damaged:
// examples/checkpoint_files.h). With only_job, a checkpoint that another job wrote (its "job"
// entry differs, or it has none) is not loaded: the epoch returned is -1. Errors name the file.
std::pair<int, EpochProgress> restore(const std::string& path, int epochs, int64_t steps_per_epoch,
                                      int64_t batch_size, int world_size, examples::ParallelModel& parallel,
                                      nn::Optimizer& optimizer, const std::string& optimizer_name,
                                      const nn::StateDict& settings, uint64_t seed, Schedule& schedule,
                                      dist::GradScaler& scaler, bool chatty, dist::ProcessGroup& pg,
                                      std::string& used_path, std::optional<int64_t> only_job) {
  try {
    ReadCheckpoint read = read_checkpoint(path, parallel, optimizer, pg, used_path, only_job);
    if (read.other_job) return {-1, {}};
    const nn::StateDict& state = read.state;
    const int64_t done = int64_entry(state, "epochs_done", std::nullopt);
    NANODDP_CHECK(done >= 0, IOError, "'epochs_done' is ", done);
    NANODDP_CHECK(done <= epochs, ValueError, "it has ", done, " epochs done, more than --epochs ", epochs);
    const int64_t saved_steps_per_epoch = int64_entry(state, "steps_per_epoch", /*missing=*/steps_per_epoch);
    // Other batch sizes can have as many steps per epoch (200 and 201 at 2 ranks): the steps
    // done would then skip other examples.
    const int64_t saved_batch_size = int64_entry(state, "batch_size", /*missing=*/batch_size);
    EpochProgress progress;
    progress.steps = int64_entry(state, "epoch_progress.steps", /*missing=*/0);
    if (progress.steps > 0) {
      progress.loss_sums = state.at("epoch_progress.loss_sums").to_vector();
      progress.samples = state.at("epoch_progress.samples").to_int_vector();
      NANODDP_CHECK(
          progress.loss_sums.size() == static_cast<size_t>(world_size) &&
              progress.samples.size() == static_cast<size_t>(world_size) &&
              saved_steps_per_epoch == steps_per_epoch && saved_batch_size == batch_size,
          ValueError, "it was saved during epoch ", done + 1, ", after step ", progress.steps, " of ",
          saved_steps_per_epoch, ", by ", progress.samples.size(),
          progress.samples.size() == 1 ? " rank" : " ranks", " with --batch-size ", saved_batch_size,
          "; a checkpoint from the middle of an epoch resumes only at the same world size and "
          "--batch-size",
          progress.samples.size() == static_cast<size_t>(world_size) && saved_batch_size == batch_size
              ? " on the same data (this run has both, but its training set makes another number of "
                "steps per epoch: "
              : " (this run: ",
          world_size, world_size == 1 ? " rank, " : " ranks, ", "--batch-size ", batch_size, ", ",
          steps_per_epoch, " steps per epoch)");
      NANODDP_CHECK(progress.steps < steps_per_epoch, IOError, "'epoch_progress.steps' is ", progress.steps);
      // The steps done are the first of the epoch's order, which the seed sets: another seed
      // would skip other batches, and see some examples twice and others never.
      const int64_t saved_seed = int64_entry(state, "seed", /*missing=*/static_cast<int64_t>(seed));
      NANODDP_CHECK(saved_seed == static_cast<int64_t>(seed), ValueError, "it was saved during epoch ",
                    done + 1, ", after step ", progress.steps, ", by a run with --seed ", saved_seed,
                    ", whose data order that epoch is not this run's (--seed ", seed,
                    "): resume with --seed ", saved_seed);
    }
    const int64_t saved_total_steps = int64_entry(state, "scheduler.total_steps", schedule.total_steps());
    const int64_t saved_warmup_steps = int64_entry(state, "scheduler.warmup_steps", schedule.warmup_steps());
    // Loaded once every rank agrees where to start: shm makes the new buckets collectively.
    if (state.count("ddp.bucket_order") != 0) progress.bucket_order = state.at("ddp.bucket_order").to_int_vector();
    try {
      if (read.local)
        parallel.load_local_model(*read.local);
      else
        parallel.load_model_state_dict(nn::strip_prefix(state, "model."));
    } catch (const Error& e) {
      throw ValueError(
          message_of(e) +
          "; the checkpoint holds another model than this run builds: was it "
          "saved by the other Fashion-MNIST example, or (fashion_mnist) with other --hidden sizes?");
    }
    // Another optimizer's state has other entries: name both optimizers, not an entry.
    const int64_t saved_kind = int64_entry(state, "optimizer_kind", /*missing=*/-1);
    const std::vector<std::string>& optimizers = examples::optimizer_names();
    if (saved_kind >= 0 && saved_kind < static_cast<int64_t>(optimizers.size()))
      NANODDP_CHECK(saved_kind == optimizer_kind(optimizer_name), ValueError, "its run used --optimizer ",
                    optimizers[static_cast<size_t>(saved_kind)], " and this one --optimizer ", optimizer_name,
                    ": resume with --optimizer ", optimizers[static_cast<size_t>(saved_kind)]);
    for (const auto& [name, value] : settings) {
      const auto saved = state.find("optimizer_settings." + name);
      if (saved == state.end()) continue;  // a checkpoint older than the entry
      std::string flag = "--" + name;
      std::replace(flag.begin(), flag.end(), '_', '-');
      const float was = saved->second.item(), now = value.item();
      // The short form when it reads back as the same float, else every digit (two settings
      // that differ must not print alike).
      const auto exact = [](float v) {
        std::ostringstream shortest, full;
        shortest << v;
        full << std::setprecision(std::numeric_limits<float>::max_digits10) << v;
        return std::stof(shortest.str()) == v ? shortest.str() : full.str();
      };
      NANODDP_CHECK(was == now, ValueError, "its run used ", flag, " ", exact(was), " and this one ", flag,
                    " ", exact(now), ": resume with ", flag, " ", exact(was),
                    ", or start a new run (another --checkpoint file)");
    }
    try {
      if (read.local)
        parallel.load_local_optimizer(optimizer, *read.local);
      else
        parallel.load_optimizer_state_dict(optimizer, nn::strip_prefix(state, "optimizer."));
    } catch (const Error& e) {
      throw ValueError(message_of(e) + "; the checkpoint holds another optimizer's state than --optimizer " +
                       optimizer_name + "'s: was it saved with another --optimizer?");
    }
    // A checkpoint of an fp16 run has its scaler's state; one of an fp32 or bf16 run (or an
    // fp16 one resumed in fp32) has none to load, and a disabled scaler ignores it.
    const nn::StateDict scaler_state = nn::strip_prefix(state, "scaler.");
    if (!scaler_state.empty()) scaler.load_state_dict(scaler_state);
    // Another schedule would move the learning rate at once (a cosine at 0.025 resumed as a
    // constant 0.05): name both, as for the optimizer.
    const bool saved_cosine = std::any_of(state.begin(), state.end(), [](const auto& entry) {
      return starts_with(entry.first, "scheduler.cosine.");
    });
    NANODDP_CHECK(saved_cosine == schedule.cosine(), ValueError, "its run used --schedule ",
                  saved_cosine ? "cosine" : "constant", " and this one --schedule ",
                  schedule.cosine() ? "cosine" : "constant", ": resume with --schedule ",
                  saved_cosine ? "cosine" : "constant");
    // Why this run's schedule differs from the checkpoint's, or "" when it is the same.
    std::ostringstream other_schedule;
    if (saved_steps_per_epoch != steps_per_epoch)
      other_schedule << "the checkpoint's run had " << saved_steps_per_epoch << " steps per epoch and this one has "
                     << steps_per_epoch << " (another world size or batch size)";
    else if (saved_total_steps != schedule.total_steps() || saved_warmup_steps != schedule.warmup_steps())
      other_schedule << "the checkpoint's run scheduled the learning rate over " << saved_total_steps << " steps ("
                     << saved_warmup_steps << " of warm-up) and this one over " << schedule.total_steps() << " ("
                     << schedule.warmup_steps() << ") (another --epochs or --warmup-epochs)";
    const int64_t steps_done = done * steps_per_epoch + progress.steps;
    progress.steps_taken =
        int64_entry(state, "metrics_step", /*missing=*/done * saved_steps_per_epoch + progress.steps);
    if (other_schedule.str().empty()) {
      // The schedule goes on from the checkpoint's learning rate, as a loaded torch optimizer's
      // param_groups keep theirs: a --lr of this run's own is said to be unused.
      const std::optional<double> configured = optimizer.initial_lr();
      schedule.load_state_dict(nn::strip_prefix(state, "scheduler."), steps_done);
      const std::optional<double> restored = optimizer.initial_lr();
      if (pg.rank() == 0 && configured && restored && *configured != *restored) {  // under --quiet too
        std::fprintf(stderr,
                     "warning: --lr %.9g is not used: the checkpoint's learning-rate schedule (from --lr "
                     "%.9g) goes on; "
                     "to train with another rate, start a new run (another --checkpoint file)\n",
                     *configured, *restored);
        std::fflush(stderr);
      }
    } else {
      schedule.replay(steps_done);
      // This run's --lr drives the replayed schedule: said when the checkpoint's run had another
      // (under --quiet too), as the warning above says when the checkpoint's goes on.
      const std::optional<double> configured = optimizer.initial_lr(), saved = saved_base_lr(state);
      if (pg.rank() == 0 && configured && saved && *configured != *saved) {
        std::fprintf(
            stderr,
            "warning: --lr %.9g is used, where the checkpoint's run had --lr %.9g: the learning-rate "
            "schedule is replayed over this run's steps (%s)\n",
            *configured, *saved, other_schedule.str().c_str());
        std::fflush(stderr);
      }
      if (chatty)
        std::printf("%s: the learning-rate schedule is replayed over this run's steps\n", other_schedule.str().c_str());
    }
    return {static_cast<int>(done), progress};
  } catch (const Error& e) {
    // The file read, which is the previous one when path was damaged.
    const std::string read_from = used_path.empty() ? path : used_path;
    throw IOError("cannot resume from checkpoint " + read_from + ": " + message_of(e));
  }
}

// Every rank must resume from the same epoch: a rank that found no checkpoint (a disk of its
// own) would start over while the others go on, and the ranks would part ways a whole epoch
// later, in the middle of a collective.
void check_same_start(dist::ProcessGroup& pg, const std::string& checkpoint, int first_epoch, int64_t first_step) {
  const std::vector<std::vector<int64_t>> starts = dist::all_gather_host(pg, {first_epoch, first_step});
  if (std::all_of(starts.begin(), starts.end(), [&](const auto& start) { return start == starts[0]; })) return;
  std::ostringstream ranks;
  for (size_t r = 0; r < starts.size(); ++r)
    ranks << (r ? ", " : "") << "rank " << r
          << (starts[r][0] == 0 && starts[r][1] == 0 ? " starts at epoch 1"
                                                     : " resumes after epoch " + std::to_string(starts[r][0]) +
                                                           (starts[r][1] > 0 ? " and " + std::to_string(starts[r][1]) +
                                                                                   " steps of the next"
                                                                             : ""));
  NANODDP_THROW(ValueError, "--resume: the ranks do not agree where to start (", ranks.str(), "): ", checkpoint,
                " must be one file that every rank reads (a filesystem they share), as rank 0 writes it for all");
}

// The files the run writes, by flag: two with one name would overwrite each other, and one
// among the data files would overwrite the data (a checkpoint written over train-labels...).
std::string outputs_problem(const Config& config) {
  namespace fs = std::filesystem;
  const auto resolved = [](const std::string& path) {
    std::string target = path;  // a link followed, also to a file not written yet
    try {
      target = save_target(path, "output");
    } catch (const Error&) {  // refused later, by the output's own check
    }
    std::error_code ignored;
    const fs::path full = fs::weakly_canonical(fs::absolute(target, ignored), ignored);
    return full.empty() ? fs::path(path).lexically_normal() : full;
  };
  const std::vector<std::pair<std::string, std::string>> outputs = {
      {"--checkpoint", config.checkpoint}, {"--export", config.export_path}, {"--metrics", config.metrics},
      {"--trace", config.trace}};
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].second.empty()) continue;
    const fs::path file = resolved(outputs[i].second);
    for (size_t j = i + 1; j < outputs.size(); ++j)
      if (!outputs[j].second.empty() && file == resolved(outputs[j].second))
        return outputs[i].first + " and " + outputs[j].first + " name the same file (" + outputs[i].second +
               "): each needs its own, or one overwrites the other";
    // The checkpoint's other files: its previous one (and where that is staged) and, for a
    // sharded set, the shard files.
    if (i > 0 && !config.checkpoint.empty()) {
      for (const char* kept : {".prev", ".prev.tmp"})
        if (file == resolved(config.checkpoint + kept))
          return outputs[i].first + " " + outputs[i].second + " is where --checkpoint " + config.checkpoint +
                 " keeps its previous checkpoint: name another file";
      if (dist::is_shard_file_name(resolved(config.checkpoint).string(), file.string()))
        return outputs[i].first + " " + outputs[i].second + " has the name of a shard file of --checkpoint " +
               config.checkpoint + ": name another file";
    }
    for (const char* set : {"train", "t10k"})
      for (const char* kind : {"-images-idx3-ubyte", "-labels-idx1-ubyte"})
        for (const char* suffix : {"", ".gz"}) {
          const std::string data = config.data_dir + "/" + set + kind + suffix;
          if (file == resolved(data))
            return outputs[i].first + " " + outputs[i].second + " is one of the data files in --data-dir " +
                   config.data_dir + ": writing it would overwrite the data";
        }
  }
  return "";
}

}  // namespace

std::string nanoddp::examples::fashion_mnist_flags_problem(const Config& config) {
  if (const std::string problem = outputs_problem(config); !problem.empty()) return problem;
  if (config.momentum && config.optimizer != "sgd")
    return "--momentum applies to --optimizer sgd only (Adam's betas play its part)";
  if (config.resume && config.checkpoint.empty()) return "--resume needs --checkpoint FILE";
  if (config.accumulate > config.batch_size)
    return "--accumulate " + std::to_string(config.accumulate) + " is more micro-batches than --batch-size " +
           std::to_string(config.batch_size) + " has examples: each micro-batch needs at least one";
  if (config.checkpoint_every > 0 && config.checkpoint.empty()) return "--checkpoint-every needs --checkpoint FILE";
  if (config.checkpoint_format == "sharded") {
    if (config.checkpoint.empty()) return "--checkpoint-format sharded needs --checkpoint FILE";
    if (config.strategy != "zero1" && config.strategy != "zero2" && config.strategy != "fsdp")
      return "--checkpoint-format sharded applies to --strategy zero1, zero2 and fsdp, whose ranks each hold part of "
             "the state; under " + config.strategy + " rank 0 holds all of it: use full";
    if ((config.batch_norm || config.sync_batch_norm) && config.strategy != "zero1")
      return "--checkpoint-format sharded with --strategy " + config.strategy +
             " holds parameters only, and BatchNorm's running statistics are buffers: use full";
  }
  if ((config.batch_norm || config.sync_batch_norm) && !config.export_path.empty())
    return std::string(config.sync_batch_norm ? "--sync-batch-norm" : "--batch-norm") +
           " adds layers that --export's model description (PyTorch's recipe) does not have";
  if (config.find_unused_parameters && config.strategy != "ddp" && config.strategy != "zero1")
    return "--find-unused-parameters is a DDP option: it applies to --strategy ddp and zero1, not " + config.strategy;
  if (!config.dp.empty() && config.strategy_given && config.strategy != examples::strategy_of_dp(config.dp))
    return examples::is_ladder_rung(config.dp)
               ? "--dp " + config.dp + " is a ladder rung, which --strategy " + config.strategy +
                     " would replace: give one of the two"
               : "--dp " + config.dp + " means --strategy " + examples::strategy_of_dp(config.dp) +
                     ", not --strategy " + config.strategy + ": give one of the two";
  // The first DDP bucket option given, for the runs that have no buckets.
  const std::string bucket_flag = config.comm_hook != "none"       ? "--comm-hook"
                                  : config.gradient_as_bucket_view ? "--gradient-as-bucket-view"
                                  : config.no_overlap              ? "--no-overlap"
                                                                   : config.bucket_cap_flag;
  if (examples::is_ladder_rung(config.strategy) && !bucket_flag.empty())
    return bucket_flag + " is a DDP bucket option: --dp " + config.strategy +
           " is a ladder rung without buckets (use --dp buckets)";
  const bool sharded = config.strategy == "zero2" || config.strategy == "fsdp";
  if (sharded && !bucket_flag.empty())
    return bucket_flag + " is a DDP bucket option: it applies to --strategy ddp and zero1, not " + config.strategy +
           " (FSDP reduces per unit, overlapping backward)";
  if (config.batch_norm && config.sync_batch_norm)
    return "--batch-norm and --sync-batch-norm: give one (--sync-batch-norm is BatchNorm with statistics "
           "over every rank)";
  if (config.warmup_epochs >= config.epochs)
    return "--warmup-epochs " + std::to_string(config.warmup_epochs) + " leaves no epoch after the warm-up of --epochs " +
           std::to_string(config.epochs);
  // A stop past the end is a typo or a mix-up of epochs-done with epochs-to-run, not a
  // request: --epochs is the whole run's length, resumed or not, and the schedule spans it.
  if (config.stop_after > config.epochs)
    return "--stop-after " + std::to_string(config.stop_after) + " is past --epochs " + std::to_string(config.epochs) +
           " (the whole run, resumed epochs included): give an epoch from 1 to " + std::to_string(config.epochs) +
           ", or 0 to train every epoch";
  return "";
}

namespace {

// --checkpoint-activations: a block starts at each Conv2d and Linear, except that the last
// layer joins the block before it (alone, its activation is its input, kept anyway). The
// CNN: [Conv ReLU Pool] [Conv ReLU Pool Flatten] [Linear ReLU Dropout Linear]; the MLP:
// [Linear ReLU] ... [Linear ReLU Linear]. docs/checkpointing.md measures the trade.
std::vector<size_t> checkpoint_block_starts(nn::Sequential& model) {
  std::vector<size_t> starts;
  for (size_t i = 0; i + 1 < model.size(); ++i)
    if (dynamic_cast<nn::Conv2d*>(&model[i]) != nullptr || dynamic_cast<nn::Linear*>(&model[i]) != nullptr)
      starts.push_back(i);
  return starts;
}

}  // namespace

int nanoddp::examples::run_fashion_mnist(const Config& config) {
  if (!config.trace.empty()) trace::start(config.trace);
  const bool explain = config.explain || dist::explain_from_environment();
  const dist::InitOptions init = config.group.init_options();
  const Device device = init.device;
  auto pg = dist::init_process_group(init);
  const int rank = pg->rank(), world_size = pg->size();
  const bool chatty = rank == 0 && !config.quiet;
  const bool sharded_checkpoint = config.checkpoint_format == "sharded";
  // Rank 0 saves after every epoch: find out now, not after an epoch of training, if it can,
  // and that each file it would replace is its own earlier output.
  if (rank == 0 && !config.checkpoint.empty()) nn::check_checkpoint_writable(config.checkpoint);
  if (rank == 0 && !config.export_path.empty()) nn::check_safetensors_writable(config.export_path);
  if (rank == 0) examples::check_metrics_replaceable(config.metrics);

  auto train_set = std::make_shared<data::FashionMNIST>(config.data_dir, /*train=*/true);
  auto test_set = std::make_shared<data::FashionMNIST>(config.data_dir, /*train=*/false);
  NANODDP_CHECK(train_set->size() > 0 && test_set->size() > 0, ValueError, "the data in ", config.data_dir,
                " has ", train_set->size(), " training and ", test_set->size(), " test images: nothing to learn from");
  data::DataLoaderOptions loader_options;
  loader_options.device = device;
  loader_options.prefetch = config.prefetch;
  data::DataLoader train_loader(train_set, config.batch_size,
                                data::DistributedSampler(train_set->size(), world_size, rank, /*shuffle=*/true, config.seed),
                                loader_options);
  // Such a batch would be cut to this rank's share of the data without a word: the run would
  // not be the one asked for. Each rank draws num_samples() images, ceil(N / W).
  const int64_t per_rank = train_loader.sampler().num_samples();
  if (config.batch_size > per_rank)
    throw cli::UsageError("--batch-size " + std::to_string(config.batch_size) + " is more than the " +
                          std::to_string(per_rank) + " training images " +
                          (world_size == 1 ? "in " + config.data_dir
                                           : "each of " + std::to_string(world_size) + " ranks gets (of " +
                                                 std::to_string(train_set->size()) + " in " + config.data_dir + ")") +
                          ": give at most " + std::to_string(per_rank));
  data::DataLoader test_loader(test_set, 1000, data::DistributedSampler::for_evaluation(test_set->size(), world_size, rank),
                               loader_options);

  // Reseeded per rank and step (below).
  Generator dropout_gen;
  auto model = config.cnn ? make_cnn(config.seed, dropout_gen, config.batch_norm || config.sync_batch_norm)
                          : make_mlp(config.seed, config.hidden);
  if (config.checkpoint_activations) model->checkpoint_blocks(checkpoint_block_starts(*model));
  model->to(device);
  dist::DDPOptions ddp_options;
  if (config.sync_batch_norm) {
    dist::convert_sync_batchnorm(model, pg);
    ddp_options.broadcast_buffers = false;  // the running statistics are equal on every rank already
  }
  ddp_options.find_unused_parameters = config.find_unused_parameters;
  ddp_options.overlap = !config.no_overlap;
  ddp_options.bucket_cap_bytes = mib_to_bytes(config.bucket_cap_mb);
  ddp_options.first_bucket_cap_bytes = mib_to_bytes(config.first_bucket_cap_mb);
  ddp_options.gradient_as_bucket_view = config.gradient_as_bucket_view;
  ddp_options.timeout = init.timeout;
  const int64_t model_numel = dist::numel_of(model->parameters());
  examples::ParallelModel parallel(model, pg, config.strategy, ddp_options);
  std::unique_ptr<nn::Optimizer> optimizer =
      parallel.make_optimizer([&](std::vector<Tensor> params) { return make_optimizer(config, std::move(params)); });
  Schedule schedule(*optimizer, config, train_loader.size());
  // --precision fp16 scales the loss so that small gradients survive, and every rank skips the
  // same steps (found-inf all-reduced); its state is in the checkpoints.
  dist::GradScalerOptions scaling;
  scaling.enabled = config.precision == "fp16";
  dist::GradScaler scaler(scaling, pg);
  int first_epoch = 0;
  EpochProgress resumed;  // where in first_epoch the run goes on
  // A group that nanoddp-run --max-restarts started again resumes by itself (Note [Restart
  // rounds] in dist/launch.cpp): the launcher gives it the same command line.
  const int restarts = examples::restart_count();
  const bool resume = config.resume || (restarts > 0 && !config.checkpoint.empty());
  // A restart without --resume goes on from this job's own checkpoint only: a FILE that an
  // earlier job left, not yet replaced when this one failed, is not this run's past.
  const std::optional<int64_t> only_job = config.resume ? std::nullopt : job_digest();
  std::string used;  // the file resumed from, or passed over as another job's
  bool loaded = false;
  if (resume && examples::checkpoint_exists(config.checkpoint)) {
    // Every rank reads the file (it must be on a filesystem they share) and loads the same
    // weights and optimizer state (the sharded strategies each take their share of it).
    std::tie(first_epoch, resumed) =
        restore(config.checkpoint, config.epochs, train_loader.size(), config.batch_size, world_size,
                parallel, *optimizer, config.optimizer, optimizer_settings(config), config.seed, schedule,
                scaler, chatty, *pg, used, only_job);
    loaded = first_epoch >= 0;
    first_epoch = std::max(first_epoch, 0);
  }
  if (loaded) {
    // Said even under --quiet when the previous checkpoint stood in: which epoch the run went back to.
    if (rank == 0 && (chatty || restarts > 0 || used != config.checkpoint))
      std::printf("%sresumed from %s after epoch %d%s\n",
                  restarts > 0 ? ("restart " + std::to_string(restarts) + ": ").c_str() : "", used.c_str(),
                  first_epoch, resumed.steps > 0 ? (" and " + std::to_string(resumed.steps) + " steps of the next").c_str() : "");
    std::fflush(stdout);  // before anything said on stderr about the run, as it happened
  } else if (config.resume && restarts == 0 && used.empty() && rank == 0 && chatty) {
    // --resume on a first run is the usual pattern, but a mistyped FILE would retrain from scratch unnoticed.
    std::printf("no checkpoint at %s yet: training starts at epoch 1\n", config.checkpoint.c_str());
    std::fflush(stdout);
  } else if (!resume && !config.checkpoint.empty() && rank == 0 && chatty &&
             examples::checkpoint_exists(config.checkpoint)) {
    // A checkpoint of an earlier run is replaced at the first save: said, since --resume may have been meant.
    std::printf("%s holds a checkpoint of an earlier run: training starts at epoch 1 and replaces it "
                "(--resume continues from it)\n",
                config.checkpoint.c_str());
    std::fflush(stdout);
  } else if (restarts > 0 && rank == 0) {
    // The work before the failure is lost: said, as a resume is.
    const std::string why = config.checkpoint.empty() ? "no --checkpoint was given"
                            : !used.empty()
                                ? "checkpoint " + used + " is another job's (none of this job's could be read)"
                                : "no checkpoint " + config.checkpoint + " was written before the failure";
    std::printf("restart %d: %s: this run starts again from step 0\n", restarts, why.c_str());
    std::fflush(stdout);
  }
  if (resume) check_same_start(*pg, config.checkpoint, first_epoch, resumed.steps);
  if (!resumed.bucket_order.empty() && parallel.ddp() != nullptr) parallel.ddp()->load_bucket_order(resumed.bucket_order);
  const int64_t total_steps = static_cast<int64_t>(config.epochs) * train_loader.size();
  const int64_t kill_step = examples::fault_kill_step(rank, world_size, total_steps);
  const int64_t stop_step = examples::fault_stop_step(rank, world_size, total_steps);
  // Resumed: the log keeps the checkpoint's steps and the steps past them are written again.
  // Resumed at another world size or batch size, this run's steps count on from the
  // checkpoint's, so the log's steps still rise one by one: log_step(epoch, steps) is the log's
  // step after `steps` steps of epoch `epoch` (0-based).
  examples::MetricsLog metrics(rank == 0 ? config.metrics : "", /*steps_kept=*/resumed.steps_taken);
  const int64_t step_offset = resumed.steps_taken - (first_epoch * train_loader.size() + resumed.steps);
  const auto log_step = [&](int epoch, int64_t steps) {
    return epoch * train_loader.size() + steps + step_offset;
  };
  if (dist::DistributedDataParallel* ddp = parallel.ddp()) {
    if (config.comm_hook == "allreduce") ddp->register_comm_hook(pg, dist::allreduce_hook);
    if (config.comm_hook == "fp16") ddp->register_comm_hook(pg, dist::fp16_compress_hook);
    if (config.comm_hook == "bf16") ddp->register_comm_hook(pg, dist::bf16_compress_hook);
    if (explain && rank == 0) std::printf("%s", dist::explain_plan(*ddp).c_str());
  }
  if (explain && rank == 0 && parallel.fsdp()) std::printf("%s", dist::explain_units(*parallel.fsdp()).c_str());
  nn::Module& trained = parallel.forward_module();
  // The model state's peak is measured over training (construction briefly holds the whole
  // model before sharding it, as torch's FSDP does without meta-device initialisation).
  reset_peak_memory();
  nn::CrossEntropyLoss loss_fn;
  // --precision: the forward under autocast (docs/mixed-precision.md), fp16 with the scaler above.
  const bool low_precision = config.precision != "fp32";
  const DType low_dtype = config.precision == "fp16" ? DType::Float16 : DType::BFloat16;

  double train_loss = NAN, accuracy = NAN, samples_per_s = NAN;
  bool warned_not_learning = false;  // said once per run
  // Every training step's wall time on this rank, all epochs: their median is a step's cost
  // that a burst of other work on the machine does not move (benchmarks/run's step ratio).
  // On a GPU, where a step does not wait for its kernels, it is the host's time per step.
  std::vector<double> step_seconds;
  int epochs_done = first_epoch;
  bool rebuilt_plan_explained = false;
  const int last_epoch = config.stop_after > 0 ? config.stop_after : config.epochs;  // stop_after <= epochs
  // Nothing to train (--epochs or --stop-after already reached): the result line still
  // reports the resumed model's accuracy.
  if (first_epoch >= last_epoch) {
    parallel.sync_buffers();
    accuracy = evaluate(trained, test_loader, *pg, config.precision);
  }
  if (rank == 0 && first_epoch >= last_epoch)
    std::fprintf(stderr, "%s: nothing to train: the checkpoint has %d epoch%s done, and this run ends after epoch %d (%s)\n",
                 config.example(), first_epoch, first_epoch == 1 ? "" : "s", last_epoch,
                 config.stop_after > 0 ? "--stop-after" : "--epochs");
  for (int epoch = first_epoch; epoch < last_epoch; ++epoch) {
    train_loader.set_epoch(epoch);
    examples::Progress progress(epoch + 1, config.epochs, train_loader.size(), chatty);
    Tensor loss_sum = Tensor::zeros({}, DType::Float32, device);
    int64_t steps = 0, samples = 0;
    // Resumed mid-epoch (Note [Resuming mid-epoch]): the batches already taken are passed over.
    const int64_t skip = epoch == first_epoch ? resumed.steps : 0;
    if (skip > 0) {
      loss_sum = Tensor::full({}, resumed.loss_sums[static_cast<size_t>(rank)], device);
      samples = resumed.samples[static_cast<size_t>(rank)];
    }
    // The rates count the samples this run trained, over its own time: not the killed run's.
    const int64_t samples_before = samples;
    int64_t passed = 0;
    std::optional<dist::ExplainWindow> explained;
    if (explain) explained.emplace(*pg);
    const auto start = std::chrono::steady_clock::now();
    auto step_start = start;
    double lr = optimizer->lr();
    for (const data::Batch& batch : train_loader) {
      if (passed < skip) {
        ++passed;
        steps = passed;
        continue;
      }
      examples::kill_if_fault_injected(kill_step, rank, epoch * train_loader.size() + steps);
      examples::stop_if_fault_injected(stop_step, rank, epoch * train_loader.size() + steps);
      // Reseeded per rank and step: ranks drop different units, and a run resumed at any step
      // draws the masks an uninterrupted one would.
      dropout_gen.manual_seed(((config.seed * 1000003 + static_cast<uint64_t>(epoch)) * 1024 + static_cast<uint64_t>(rank)) *
                                  1000003 +
                              static_cast<uint64_t>(steps));
      lr = optimizer->lr();
      // With bucket views, zeroing in place (torch 1.13's default) keeps .grad in the buckets;
      // set_to_none would make every backward copy into them again.
      optimizer->zero_grad(/*set_to_none=*/!config.gradient_as_bucket_view);
      Tensor loss;
      if (config.accumulate > 1) {
        // The step's batch in micro-batches, each loss weighted by its share of the samples:
        // the same gradient, 1/K of the activations the layers save (Note [Micro-batch weights]).
        const int64_t micro = std::min<int64_t>(config.accumulate, batch.input.size(0));
        nn::autocast autocast(low_dtype, low_precision);
        loss = dist::accumulate_gradients(parallel, dist::split_micro_batches(batch.input, batch.target, micro), loss_fn,
                                          scaler.get_scale());
      } else {
        Tensor logits;
        {
          nn::autocast autocast(low_dtype, low_precision);
          logits = trained(batch.input);
        }
        loss = loss_fn(logits, batch.target);
        scaler.scale(loss).backward();
      }
      parallel.finish_gradient_sync();
      scaler.step(*optimizer);  // optimizer->step() unless fp16 found an inf
      scaler.update();
      schedule.step(epoch * train_loader.size() + steps);
      {
        NoGradGuard no_grad;
        loss_sum = loss_sum + loss;  // stays on the device: no sync per step
      }
      ++steps;
      samples += batch.input.size(0);
      if (steps % kCheckEverySteps == 0 || steps == train_loader.size()) {
        const float mean_loss = loss_sum.item() / static_cast<float>(steps);
        check_finite(mean_loss, config, rank, epoch, steps);
        if (chatty || metrics.enabled()) {
          // Rank 0's pace times the world size: the ranks step together.
          const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          const double rate = static_cast<double>(samples - samples_before) * world_size / elapsed;
          if (chatty) progress.update(steps, mean_loss, rate);
          examples::MetricsRecord record;
          record.step = log_step(epoch, steps);
          record.epoch = epoch + 1;
          record.loss = mean_loss;
          record.lr = lr;
          record.samples_per_s = rate;
          metrics.write(record);
        }
      }
      // After the step's metrics line: a resume keeps the lines up to the checkpoint's step and
      // writes on from the next, so a line written after the save would be lost to a kill.
      if (config.checkpoint_every > 0 &&
          (epoch * train_loader.size() + steps) % config.checkpoint_every == 0 &&
          steps < train_loader.size()) {
        NoGradGuard no_grad;
        save(config.checkpoint, sharded_checkpoint, epoch, train_loader.size(), config.batch_size, parallel,
             *optimizer, config.optimizer, optimizer_settings(config), config.seed, schedule, scaler,
             log_step(epoch, steps), rank, *pg, init.timeout, steps, loss_sum.item(), samples);
      }
      // From the end of the previous step: the batch's loading and every sync in this one.
      const auto step_end = std::chrono::steady_clock::now();
      step_seconds.push_back(std::chrono::duration<double>(step_end - step_start).count());
      step_start = step_end;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (explained && rank == 0 && steps > 0)
      std::printf("%s", explained->report("epoch " + std::to_string(epoch + 1), steps).c_str());
    if (explain && rank == 0 && parallel.ddp() && parallel.ddp()->reducer().buckets_rebuilt() &&
        !rebuilt_plan_explained) {
      std::printf("%s", dist::explain_plan(*parallel.ddp()).c_str());  // re-planned after the first step
      rebuilt_plan_explained = true;
    }
    if (explain && epoch == first_epoch) {
      // The most any rank holds, as the result line's peak_model_state_bytes: under ZeRO-1 the
      // ranks own different shares of the optimizer state. A collective.
      MemoryStats measured = memory_stats(device);
      std::vector<int64_t> peaks(measured.peak.begin(), measured.peak.end());
      peaks.push_back(measured.peak_model_state);
      peaks = dist::all_reduce_host(*pg, peaks, dist::ReduceOp::Max);
      std::copy(peaks.begin(), peaks.begin() + kNumMemoryCategories, measured.peak.begin());
      measured.peak_model_state = peaks.back();
      dist::ModelStateShape shape;
      shape.numel = model_numel;
      shape.world_size = world_size;
      shape.optimizer_state_bytes_per_element = dist::optimizer_state_bytes_per_element(*optimizer);
      if (parallel.fsdp()) shape.unit_numels = dist::unit_numels(*parallel.fsdp());
      else shape.unit_numels = dist::layer_numels(*model);
      shape.gradient_as_bucket_view = config.gradient_as_bucket_view;
      shape.accumulate = config.accumulate;
      for (const Tensor& p : model->parameters()) shape.parameter_numels.push_back(p.numel());
      shape.rank = -1;
      if (rank == 0) std::printf("%s", dist::explain_memory(shape, config.strategy, measured).c_str());
    }

    // Mean loss over ranks; all ranks' samples over the slowest rank's time.
    const std::vector<float> stats = dist::all_reduce_host(
        *pg,
        std::vector<float>{loss_sum.item() / static_cast<float>(std::max<int64_t>(steps, 1)),
                           static_cast<float>(samples - samples_before)},
        dist::ReduceOp::Sum);
    const std::vector<float> slowest = dist::all_reduce_host(*pg, std::vector<float>{static_cast<float>(seconds)}, dist::ReduceOp::Max);
    train_loss = stats[0] / world_size;
    check_finite(static_cast<float>(train_loss), config, rank, epoch, steps);
    // A loss of ln 10 is what guessing among the 10 classes gives: a run at or above it has
    // learnt nothing (diverged to a constant output, say), which a finite loss does not show.
    if (rank == 0 && train_loss >= std::log(10.0) && !warned_not_learning) {
      // With a learning rate of 0 (--lr 0, or a resumed schedule's) nothing moves the weights:
      // a lower one is no advice.
      const std::string advice = lr == 0.0 ? "the learning rate is 0, so no step changes the weights"
                                       : std::string("try a lower --lr") +
                                             (config.optimizer == "sgd" ? " or --momentum" : "") +
                                             " or a larger --batch-size";
      std::fprintf(stderr,
                   "warning: epoch %d's train loss %.4f is no better than guessing among the 10 classes (ln 10 = "
                   "%.4f): the run is not learning; %s\n",
                   epoch + 1, train_loss, std::log(10.0), advice.c_str());
      std::fflush(stderr);
      warned_not_learning = true;
    }
    samples_per_s = stats[1] / slowest[0];
    parallel.sync_buffers();  // the model evaluated and saved is rank 0's on every rank
    accuracy = evaluate(trained, test_loader, *pg, config.precision);
    if (chatty)
      std::printf("epoch %d/%d: train loss %.4f, test accuracy %.4f, %.0f samples/s\n", epoch + 1, config.epochs,
                  train_loss, accuracy, samples_per_s);
    examples::MetricsRecord record;
    record.step = log_step(epoch + 1, 0);
    record.epoch = epoch + 1;
    record.loss = train_loss;
    record.lr = lr;
    record.samples_per_s = samples_per_s;
    record.test_accuracy = accuracy;
    metrics.write(record);
    if (!config.checkpoint.empty())
      save(config.checkpoint, sharded_checkpoint, epoch + 1, train_loader.size(), config.batch_size, parallel,
           *optimizer, config.optimizer, optimizer_settings(config), config.seed, schedule, scaler,
           log_step(epoch + 1, 0), rank, *pg, init.timeout);
    epochs_done = epoch + 1;
    std::fflush(stdout);
  }

  // The model is the same torch.nn.Sequential in PyTorch (k*Description), so our
  // state_dict names ("0.weight", "2.bias", ...) and shapes are PyTorch's.
  const nn::StateDict exported = config.export_path.empty() ? nn::StateDict() : parallel.model_state_dict();
  if (rank == 0 && !config.export_path.empty())
    nn::save_safetensors(config.export_path, exported,
                         {{"format", "pt"},
                          {"model", config.cnn ? kCnnDescription : kMlpDescription},
                          {"epochs", std::to_string(epochs_done)},
                          {"test_accuracy", examples::json_number(accuracy)}});

  // Peak RSS and median step time: the largest over ranks.
  const std::vector<float> slowest_rank = dist::all_reduce_host(
      *pg, std::vector<float>{static_cast<float>(examples::peak_rss_mb()), static_cast<float>(1e3 * examples::median_of(step_seconds))},
      dist::ReduceOp::Max);
  // Bytes, exactly: int64 on the wire.
  const MemoryStats memory = memory_stats(device);
  const std::vector<int64_t> peak_bytes = dist::all_reduce_host(
      *pg,
      std::vector<int64_t>{memory.peak_model_state, memory.peak[static_cast<int>(MemoryCategory::Activations)]},
      dist::ReduceOp::Max);
  if (rank == 0) {
    std::printf(
        "{\"example\":\"%s\",\"world_size\":%d,\"epochs\":%d,\"test_accuracy\":%s,\"train_loss\":%s,"
        "\"samples_per_s\":%s,\"step_ms_median\":%s,\"peak_rss_mb\":%s,\"backend\":\"%s\",\"device\":\"%s\","
        "\"optimizer\":\"%s\",\"comm_hook\":\"%s\",\"gradient_as_bucket_view\":%s,\"strategy\":\"%s\","
        "\"peak_model_state_bytes\":%lld,\"checkpoint_activations\":%s,\"peak_activation_bytes\":%lld,"
        "\"precision\":\"%s\"}\n",
        config.example(), world_size, epochs_done, examples::json_number(accuracy).c_str(), examples::json_number(train_loss).c_str(),
        examples::json_number(samples_per_s).c_str(), examples::json_number(slowest_rank[1]).c_str(),
        examples::json_number(slowest_rank[0]).c_str(), pg->backend_name().c_str(), device.str().c_str(),
        config.optimizer.c_str(), config.comm_hook.c_str(), config.gradient_as_bucket_view ? "true" : "false",
        config.strategy.c_str(), static_cast<long long>(peak_bytes[0]), config.checkpoint_activations ? "true" : "false",
        static_cast<long long>(peak_bytes[1]), config.precision.c_str());
    std::fflush(stdout);
  }
  pg->barrier()->wait();  // rank 0 serves the store: let every rank finish first
  dist::destroy_process_group();
  examples::finish_trace();
  return 0;
}
