// The ladder's checks, shared by tests/test_ladder.cpp and the exercise grader
// (exercises/grader.cpp): each runs on one rank of a group and returns "" or what went wrong,
// naming the rank, the parameter and the values expected and found.
//
//   const std::string problem = ladder_checks::equals_one_process("flat", pg);   // "" when right
//
// The property (Note [Ladder exactness]): every rung on W ranks, each rank on its 1/W of the
// global batch, leaves every parameter equal to one process's on the whole batch, within
// kLadderTolerance; and a step issues exactly the all_reduces its header says.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/ops.h"
#include "dist/ddp.h"
#include "dist/fsdp.h"
#include "dist/gradient_accumulation.h"
#include "dist/zero_redundancy_optimizer.h"
#include "examples/ladder/flat.h"
#include "examples/ladder/naive.h"
#include "examples/ladder/overlap.h"
#include "nn/conv.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "tests/forwarding_group.h"

namespace nanoddp::ladder_checks {

// Float sums in another order over 4 SGD steps (lr 0.1, momentum 0.9) on small models: the
// rungs differ from one process by ~1e-7; a rung that forgets to divide is off by ~1e-2.
constexpr float kLadderTolerance = 2e-5f;
constexpr int64_t kGlobalBatch = 12;  // splits evenly over 1, 2, 3, 4 ranks
constexpr int kSteps = 4;

// 5 -> 6 -> 3: 4 parameters, 30 + 6 + 18 + 3 = 57 elements, 228 bytes.
inline std::shared_ptr<nn::Module> make_mlp(uint64_t seed) {
  Generator gen(seed);
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Linear(5, 6, gen));
  model->add(nn::ReLU());
  model->add(nn::Linear(6, 3, gen));
  return model;
}
constexpr int64_t kMlpParameters = 4;
constexpr int64_t kMlpGradientBytes = 57 * 4;

// Rows of 36 pixels -> [N, 1, 6, 6] images.
class Images6x6 : public nn::Module {
 public:
  Tensor forward(const Tensor& input) override { return input.reshape({input.size(0), 1, 6, 6}); }
};

// Images6x6, Conv(1->2, 3), ReLU, MaxPool(2), Flatten, Linear(8, 3).
inline std::shared_ptr<nn::Module> make_cnn(uint64_t seed) {
  Generator gen(seed);
  auto model = std::make_shared<nn::Sequential>();
  model->add(Images6x6());
  model->add(nn::Conv2d(1, 2, 3, gen));
  model->add(nn::ReLU());
  model->add(nn::MaxPool2d(2));
  model->add(nn::Flatten());
  model->add(nn::Linear(8, 3, gen));
  return model;
}

struct Model {
  const char* name;
  int64_t features;
  std::shared_ptr<nn::Module> (*make)(uint64_t);
};
inline std::vector<Model> models() { return {{"MLP", 5, make_mlp}, {"CNN", 36, make_cnn}}; }

struct Batch {
  Tensor x, y;
};
inline Batch global_batch(int step, int64_t features) {
  Generator gen(500 + step);
  Tensor x = Tensor::randn({kGlobalBatch, features}, gen);
  std::vector<int64_t> labels;
  for (int i = 0; i < kGlobalBatch; ++i) labels.push_back(static_cast<int64_t>(gen.randint(3)));
  return {x, Tensor::from_vector(labels)};
}
inline Batch rows(const Batch& b, int64_t begin, int64_t end) {
  const int64_t F = b.x.size(1);
  std::vector<float> xs = b.x.to_vector();
  std::vector<int64_t> ys = b.y.to_int_vector();
  return {
      Tensor::from_vector(std::vector<float>(xs.begin() + begin * F, xs.begin() + end * F), {end - begin, F}),
      Tensor::from_vector(std::vector<int64_t>(ys.begin() + begin, ys.begin() + end))};
}
inline Batch share(const Batch& b, int rank, int world) {
  const int64_t per_rank = kGlobalBatch / world;
  return rows(b, rank * per_rank, (rank + 1) * per_rank);
}

inline std::unique_ptr<nn::Optimizer> make_sgd(std::vector<Tensor> params) {
  return std::make_unique<nn::SGD>(std::move(params), nn::SGDOptions{/*lr=*/0.1f, /*momentum=*/0.9f});
}

// The ladder's own rungs by name: naive, flat, overlap. Throws ValueError for another name.
inline std::unique_ptr<ladder::Rung> make_rung(const std::string& name, std::shared_ptr<nn::Module> model,
                                               std::shared_ptr<dist::ProcessGroup> pg) {
  if (name == "naive") return std::make_unique<ladder::NaiveDataParallel>(std::move(model), std::move(pg));
  if (name == "flat") return std::make_unique<ladder::FlatDataParallel>(std::move(model), std::move(pg));
  if (name == "overlap")
    return std::make_unique<ladder::OverlapDataParallel>(std::move(model), std::move(pg));
  NANODDP_CHECK(false, ValueError, "no ladder rung named ", name, " (naive, flat, overlap)");
  return nullptr;
}

// One process on the global batch: the reference.
inline nn::StateDict train_one_process(const Model& kind) {
  auto model = kind.make(7);
  auto opt = make_sgd(model->parameters());
  for (int s = 0; s < kSteps; ++s) {
    const Batch b = global_batch(s, kind.features);
    opt->zero_grad();
    cross_entropy((*model)(b.x), b.y).backward();
    opt->step();
  }
  return model->state_dict();
}

// "" when every entry of got is within tolerance of want; otherwise the worst entry of each
// parameter that is not, with both values.
inline std::string differences(const nn::StateDict& got, const nn::StateDict& want, float tolerance) {
  std::ostringstream report;
  for (const auto& [key, w] : want) {
    const auto it = got.find(key);
    if (it == got.end()) {
      report << "  " << key << ": missing\n";
      continue;
    }
    const std::vector<float> a = it->second.to_vector(), b = w.to_vector();
    if (a.size() != b.size()) {
      report << "  " << key << ": " << a.size() << " elements, expected " << b.size() << "\n";
      continue;
    }
    size_t worst = 0;
    for (size_t j = 0; j < a.size(); ++j)
      if (!(std::abs(a[j] - b[j]) <= std::abs(a[worst] - b[worst]))) worst = j;
    if (!(std::abs(a[worst] - b[worst]) <= tolerance))
      report << "  " << key << "[" << worst << "] = " << a[worst] << ", expected " << b[worst] << " (|diff| "
             << std::abs(a[worst] - b[worst]) << " > " << tolerance << ")\n";
  }
  return report.str();
}

// Runs one forward and a backward that a hook on the model's first parameter (the last
// gradient backward computes, after the others were handed to the wrapper) ends by an
// exception, on every rank; true when that exception came out of backward.
inline bool interrupted_backward(nn::Module& wrapped, nn::Module& model, const Batch& b) {
  Tensor first = model.parameters().front();
  const int hook = first.register_post_accumulate_grad_hook(
      [](Tensor&) { throw std::runtime_error("injected: backward interrupted"); });
  bool thrown = false;
  try {
    cross_entropy(wrapped(b.x), b.y).backward();
  } catch (const std::runtime_error& e) {
    thrown = std::string(e.what()) == "injected: backward interrupted";
  }
  first.remove_hook(hook);
  return thrown;
}

// rung: naive, flat, overlap, buckets (DDP), zero1 (DDP + ZeroRedundancyOptimizer) or fsdp.
// Trains kSteps steps of every model on this rank's share, rank 1 starting from other weights
// (construction must replace them by rank 0's); "" when the parameters equal one process's.
// interrupt_first: the first step is preceded by a backward that a hook ends by an exception
// on every rank (Note [Interrupted backward] in dist/reducer.cpp); the steps after it must
// not notice.
inline std::string equals_one_process(const std::string& rung, const std::shared_ptr<dist::ProcessGroup>& pg,
                                      bool interrupt_first = false) {
  const int rank = pg->rank(), world = pg->size();
  std::string problems;
  for (const Model& kind : models()) {
    const nn::StateDict want = train_one_process(kind);
    auto model = kind.make(rank == 0 ? 7 : 99);
    std::unique_ptr<ladder::Rung> ladder_rung;
    std::unique_ptr<dist::DistributedDataParallel> ddp;
    std::unique_ptr<dist::FullyShardedDataParallel> fsdp;
    std::unique_ptr<nn::Optimizer> opt;
    nn::Module* wrapped = nullptr;
    if (rung == "buckets" || rung == "zero1") {
      ddp = std::make_unique<dist::DistributedDataParallel>(model, pg);
      wrapped = ddp.get();
      opt = rung == "zero1" ? std::make_unique<dist::ZeroRedundancyOptimizer>(ddp->parameters(), pg, make_sgd)
                            : make_sgd(ddp->parameters());
    } else if (rung == "fsdp") {
      dist::FSDPOptions options;
      options.auto_wrap_policy = dist::module_wrap_policy<nn::Linear, nn::Conv2d>();
      fsdp = std::make_unique<dist::FullyShardedDataParallel>(model, pg, options);
      wrapped = fsdp.get();
      opt = make_sgd(fsdp->parameters());
    } else {
      ladder_rung = make_rung(rung, model, pg);
      wrapped = ladder_rung.get();
      opt = make_sgd(ladder_rung->parameters());
    }
    if (interrupt_first &&
        !interrupted_backward(*wrapped, *model, share(global_batch(kSteps, kind.features), rank, world)))
      problems += "rank " + std::to_string(rank) + " " + rung + ", " + kind.name +
                  ": the hook's exception did not come out of backward\n";
    for (int s = 0; s < kSteps; ++s) {
      const Batch b = share(global_batch(s, kind.features), rank, world);
      opt->zero_grad();
      cross_entropy((*wrapped)(b.x), b.y).backward();
      if (ladder_rung) ladder_rung->finish_gradient_sync();
      opt->step();
    }
    const nn::StateDict got = fsdp ? fsdp->full_state_dict(/*rank0_only=*/false) : model->state_dict();
    const std::string report = differences(got, want, kLadderTolerance);
    if (!report.empty())
      problems += "rank " + std::to_string(rank) + "/" + std::to_string(world) + " " + rung + ", " +
                  kind.name + ": after " + std::to_string(kSteps) +
                  " steps the parameters differ from one process on the global batch (where one step is "
                  "right, look for state kept from step to step: a buffer added into instead of overwritten, "
                  "a list of Works not emptied):\n" +
                  report;
  }
  return problems;
}

// The all_reduce calls and bytes one step of the MLP issues, read from the group's counters.
struct StepCount {
  int64_t calls = 0;
  int64_t bytes = 0;
  int64_t other_collectives = 0;  // broadcast, all_gather, reduce_scatter, barrier calls
};
// model: the MLP above unless given, taking rows of `features`.
inline StepCount count_one_step(const std::string& rung, const std::shared_ptr<dist::ProcessGroup>& pg,
                                int micro_batches = 1, std::shared_ptr<nn::Module> model = nullptr,
                                int64_t features = 5) {
  if (!model) model = make_mlp(7);
  std::unique_ptr<ladder::Rung> ladder_rung;
  std::unique_ptr<dist::DistributedDataParallel> ddp;
  if (rung == "buckets")
    ddp = std::make_unique<dist::DistributedDataParallel>(model, pg);
  else
    ladder_rung = make_rung(rung, model, pg);
  const Batch b = share(global_batch(0, features), pg->rank(), pg->size());
  pg->reset_counts();
  if (micro_batches == 1) {
    cross_entropy(ddp ? (*ddp)(b.x) : (*ladder_rung)(b.x), b.y).backward();
  } else {
    const auto micro = dist::split_micro_batches(b.x, b.y, micro_batches);
    auto loss = [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
    if (ddp)
      dist::accumulate_gradients(*ddp, micro, loss);
    else
      dist::accumulate_gradients(*ladder_rung, micro, loss);
  }
  if (ladder_rung) ladder_rung->finish_gradient_sync();
  StepCount count;
  count.calls = pg->count(dist::Collective::AllReduce).calls;
  count.bytes = pg->count(dist::Collective::AllReduce).bytes;
  for (auto c : {dist::Collective::Broadcast, dist::Collective::AllGather, dist::Collective::ReduceScatter,
                 dist::Collective::Barrier})
    count.other_collectives += pg->count(c).calls;
  return count;
}

// What each rung's header promises for one step of the MLP (4 parameters, 228 bytes).
inline StepCount expected_step_count(const std::string& rung) {
  if (rung == "flat" || rung == "buckets") return {1, kMlpGradientBytes, 0};  // DDP: one bucket under 1 MiB
  return {kMlpParameters, kMlpGradientBytes, 0};                              // naive, overlap
}

// Forwards to a group, running each all_reduce only when it or a later one is waited for
// (oldest first, as shm does). It records the most calls issued and not yet run, and whether
// a tensor changed between its all_reduce call and the wait that ran it: a divide while the
// all_reduce is in flight is a race that Gloo loses only sometimes, and here always shows.
class DeferringGroup : public testing::ForwardingGroup {
 public:
  using ForwardingGroup::ForwardingGroup;
  std::shared_ptr<dist::Work> all_reduce(Tensor& t, dist::ReduceOp op) override {
    auto call = std::make_shared<Call>(Call{t, op, t.to_vector()});
    // The same memory issued again while an earlier call on it is still in flight (a buffer
    // reused once its call is done is fine).
    for (const auto& queued : queue_)
      if (t.numel() > 0 && queued->tensor.data_ptr() == t.data_ptr()) reduced_twice = true;
    queue_.push_back(call);
    most_in_flight = std::max(most_in_flight, static_cast<int>(queue_.size()));
    return std::make_shared<Deferred>(this, call);
  }
  bool collectives_run_in_wait() const override { return true; }

  int most_in_flight = 0;
  bool changed_in_flight = false;
  bool reduced_twice = false;  // one memory all-reduced by a second call while the first is in flight

 private:
  struct Call {
    Tensor tensor;
    dist::ReduceOp op;
    std::vector<float> at_call;
    bool done = false;
  };
  struct Deferred : dist::Work {
    Deferred(DeferringGroup* group, std::shared_ptr<Call> call) : group(group), call(std::move(call)) {}
    void wait(std::chrono::milliseconds timeout) override { group->run_until(*call, timeout); }
    bool is_completed() override { return call->done; }
    DeferringGroup* group;
    std::shared_ptr<Call> call;
  };
  void run_until(const Call& last, std::chrono::milliseconds timeout) {
    while (!last.done && !queue_.empty()) {
      const std::shared_ptr<Call> call = queue_.front();
      queue_.pop_front();
      if (call->tensor.to_vector() != call->at_call) changed_in_flight = true;
      inner_->all_reduce(call->tensor, call->op)->wait(timeout);
      call->done = true;
    }
  }
  std::deque<std::shared_ptr<Call>> queue_;
};

// One step of the MLP through a DeferringGroup: "" unless a gradient changed while its
// all_reduce was in flight, or (overlap) the all_reduces ran one at a time.
inline std::string in_flight_problems(const std::string& rung,
                                      const std::shared_ptr<dist::ProcessGroup>& pg) {
  auto deferring = std::make_shared<DeferringGroup>(pg);
  auto model = make_mlp(7);
  auto dp = make_rung(rung, model, deferring);
  const Batch b = share(global_batch(0, 5), pg->rank(), pg->size());
  cross_entropy((*dp)(b.x), b.y).backward();
  dp->finish_gradient_sync();
  const std::string who =
      "rank " + std::to_string(pg->rank()) + "/" + std::to_string(pg->size()) + " " + rung + ": ";
  // Reduced twice, the second call's divide changes the tensor while the first is in flight:
  // the double reduction is the mistake to name.
  if (deferring->reduced_twice)
    return who +
           "one tensor was all-reduced again while its first all_reduce was in flight: every parameter is "
           "reduced once (hooks registered twice, or a loop that visits a parameter again?)\n";
  if (deferring->changed_in_flight)
    return who +
           "a tensor changed between its all_reduce call and the wait for it (a divide, say): a tensor "
           "belongs to its collective until wait() returns, and Gloo may be reading or writing it; "
           "change it after the wait\n";
  if (rung == "overlap" && deferring->most_in_flight < 2)
    return who + "the " + std::to_string(kMlpParameters) +
           " all_reduces of a step ran one at a time (at most " + std::to_string(deferring->most_in_flight) +
           " in flight): a hook that waits for its own all_reduce overlaps nothing; wait at the end of "
           "backward "
           "instead\n";
  return "";
}

// A rung made, destroyed and made again on the same model: the first one's hooks must be gone
// with it, or the second step reduces every gradient twice.
inline std::string counts_match_after_rewrap(const std::string& rung,
                                             const std::shared_ptr<dist::ProcessGroup>& pg) {
  auto model = make_mlp(7);
  make_rung(rung, model, pg).reset();
  const std::string second = "rank " + std::to_string(pg->rank()) + "/" + std::to_string(pg->size()) + " " +
                             rung + ": a second " + rung +
                             " on a model an earlier one wrapped (and was destroyed) ";
  const std::string cause =
      ": the earlier one's hooks are still on the parameters (remove them in its destructor)\n";
  StepCount got;
  try {
    got = count_one_step(rung, pg, 1, model);
  } catch (const Error& e) {
    return second + "failed its step (" + message_of(e) + ")" + cause;
  }
  const StepCount want = expected_step_count(rung);
  if (got.calls == want.calls && got.bytes == want.bytes) return "";
  return second + "issued " + std::to_string(got.calls) + " all_reduce calls of " +
         std::to_string(got.bytes) + " bytes for one step; expected " + std::to_string(want.calls) + " of " +
         std::to_string(want.bytes) + cause;
}

inline std::string counts_match(const std::string& rung, const std::shared_ptr<dist::ProcessGroup>& pg,
                                int micro_batches = 1) {
  const StepCount got = count_one_step(rung, pg, micro_batches), want = expected_step_count(rung);
  if (got.calls == want.calls && got.bytes == want.bytes && got.other_collectives == 0) return "";
  std::ostringstream report;
  report << "rank " << pg->rank() << "/" << pg->size() << " " << rung << ": one step of the MLP"
         << (micro_batches > 1 ? " accumulated over " + std::to_string(micro_batches) + " micro-batches" : "")
         << " issued " << got.calls << " all_reduce calls of " << got.bytes << " bytes and "
         << got.other_collectives << " other collectives; expected " << want.calls << " calls of "
         << want.bytes << " bytes and none\n";
  return report.str();
}

// One step of the MLP on this rank's share (over micro_batches under no_sync for all but the
// last, dist::accumulate_gradients), then finish_gradient_sync(): "" when every gradient
// equals one process's on the global batch (within kLadderTolerance). Otherwise names
// the parameter, the element and both values, and the mistake the values look like: W times
// the mean (summed, not divided), 1/W of it (divided twice), this rank's own gradient (never
// reduced, or not copied back), it divided by W (divided, then the all_reduce was not waited
// for), or another parameter's gradient (offsets into a flat buffer).
inline std::string gradient_matches(const std::string& rung, const std::shared_ptr<dist::ProcessGroup>& pg,
                                    int micro_batches = 1) {
  const int rank = pg->rank(), world = pg->size();
  const Batch global = global_batch(0, 5), mine = share(global, rank, world);
  auto reference = make_mlp(7), own = make_mlp(7), model = make_mlp(rank == 0 ? 7 : 99);
  cross_entropy((*reference)(global.x), global.y).backward();
  cross_entropy((*own)(mine.x), mine.y).backward();
  auto dp = make_rung(rung, model, pg);
  if (micro_batches == 1) {
    cross_entropy((*dp)(mine.x), mine.y).backward();
  } else {
    auto loss = [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
    dist::accumulate_gradients(*dp, dist::split_micro_batches(mine.x, mine.y, micro_batches), loss);
  }
  dp->finish_gradient_sync();
  const std::string step = micro_batches == 1
                               ? ""
                               : " (the step accumulated over " + std::to_string(micro_batches) +
                                     " micro-batches, no_sync on all but the last)";
  const auto want = reference->named_parameters(), local = own->named_parameters(),
             got = model->named_parameters();
  std::ostringstream report;
  for (size_t p = 0; p < want.size(); ++p) {
    const Tensor grad = got[p].second.grad();
    if (!grad.defined()) {
      report << "rank " << rank << "/" << world << " " << rung << ": " << got[p].first
             << " has no gradient after finish_gradient_sync()\n";
      continue;
    }
    const std::vector<float> g = grad.to_vector(), w = want[p].second.grad().to_vector(),
                             l = local[p].second.grad().to_vector();
    auto all_near = [&](auto expected) {
      for (size_t j = 0; j < g.size(); ++j)
        if (!(std::abs(g[j] - expected(j)) <= kLadderTolerance)) return false;
      return true;
    };
    if (all_near([&](size_t j) { return w[j]; })) continue;
    size_t worst = 0;
    for (size_t j = 0; j < g.size(); ++j)
      if (std::abs(g[j] - w[j]) > std::abs(g[worst] - w[worst])) worst = j;
    report << "rank " << rank << "/" << world << " " << rung << ": " << got[p].first << ".grad[" << worst
           << "] = " << g[worst] << ", expected " << w[worst] << " (one process on the global batch)" << step;
    // Where in all the expected gradients laid end to end (parameter order) these values sit,
    // when that is somewhere else than this parameter's own place: a flat buffer's offsets.
    std::vector<float> laid_out;
    size_t own_offset = 0;
    for (size_t q = 0; q < want.size(); ++q) {
      if (q == p) own_offset = laid_out.size();
      const std::vector<float> wq = want[q].second.grad().to_vector();
      laid_out.insert(laid_out.end(), wq.begin(), wq.end());
    }
    std::string other;
    for (size_t at = 0; at + g.size() <= laid_out.size() && other.empty(); ++at)
      if (at != own_offset && all_near([&](size_t j) { return laid_out[at + j]; }))
        other = "elements [" + std::to_string(at) + ", " + std::to_string(at + g.size()) +
                ") of all the gradients laid end to end, where its own are [" + std::to_string(own_offset) +
                ", " + std::to_string(own_offset + g.size()) + ")";
    int divided_by = 0;  // summed, then divided by this instead of the world size
    for (int d = 2; d <= 8 && divided_by == 0; ++d)
      if (d != world &&
          all_near([&](size_t j) { return w[j] * static_cast<float>(world) / static_cast<float>(d); }))
        divided_by = d;
    const bool all_zero = std::all_of(g.begin(), g.end(), [](float v) { return v == 0.0f; });
    if (all_zero && std::any_of(w.begin(), w.end(), [](float v) { return std::abs(v) > kLadderTolerance; }))
      report << ": every value is 0: multiplied by 0 (1 / W computed in integers is 0: write 1.0f / W)";
    else if (all_near([&](size_t j) { return w[j] * static_cast<float>(world); }))
      report << ": every value is " << world
             << " times the mean: summed over ranks but not divided by the world size";
    else if (all_near([&](size_t j) { return w[j] / static_cast<float>(world); }))
      report << ": every value is the mean divided by " << world
             << " once more: divided twice (or ReduceOp::Avg and a divide)";
    else if (divided_by != 0)
      report << ": every value is the sum divided by " << divided_by << ", not by the world size " << world;
    else if (!other.empty())
      report << ": these are " << other << ": check the offsets into the flat buffer and their order";
    else if (all_near([&](size_t j) { return l[j]; }))
      report << ": this rank's own gradient: it was never reduced (no all_reduce, one not waited for, or "
                "a flat buffer's result not copied back into .grad)";
    else if (all_near([&](size_t j) { return l[j] / static_cast<float>(world); }))
      report << ": this rank's own gradient divided by " << world
             << ": divided, but the sum never arrived (an all_reduce not waited for, or one of another tensor "
                "than the gradient: the parameter itself, a copy)";
    else if (micro_batches > 1)
      report << ": under no_sync a gradient must be left as backward accumulates it (no divide, no "
                "all_reduce) until the step's last micro-batch";
    else if (rung == "flat")
      report << ": every rank must pack the flat buffer in the same order (the parameters' order), or "
                "the sum adds one rank's elements of a parameter to another rank's of another";
    report << "\n";
  }
  return report.str();
}

// One step of the MLP with its first layer frozen (requires_grad false on every rank, as
// fine-tuning does): "" when the trainable parameters' gradients equal one process's and the
// frozen ones have none. A rung reduces the parameters it was given to train (params_), not
// every parameter of the model.
inline std::string frozen_layer_problems(const std::string& rung,
                                         const std::shared_ptr<dist::ProcessGroup>& pg) {
  const int rank = pg->rank(), world = pg->size();
  const std::string who = "rank " + std::to_string(rank) + "/" + std::to_string(world) + " " + rung +
                          ", the MLP with its first layer frozen: ";
  const Batch global = global_batch(0, 5), mine = share(global, rank, world);
  const auto freeze_first_layer = [](nn::Module& model) {
    for (auto& [name, param] : model.named_parameters())
      if (name.rfind("0.", 0) == 0) param.set_requires_grad(false);
  };
  auto reference = make_mlp(7), model = make_mlp(rank == 0 ? 7 : 99);
  freeze_first_layer(*reference);
  freeze_first_layer(*model);
  cross_entropy((*reference)(global.x), global.y).backward();
  try {
    auto dp = make_rung(rung, model, pg);
    cross_entropy((*dp)(mine.x), mine.y).backward();
    dp->finish_gradient_sync();
  } catch (const std::exception& e) {
    return who + e.what() + " (reduce the parameters that require grad, not every parameter of the model)\n";
  }
  std::string problems;
  const auto want = reference->named_parameters(), got = model->named_parameters();
  for (size_t p = 0; p < got.size(); ++p) {
    const Tensor grad = got[p].second.grad();
    if (!got[p].second.requires_grad()) {
      if (grad.defined()) problems += who + got[p].first + " is frozen but has a .grad after the step\n";
      continue;
    }
    if (!grad.defined()) {
      problems += who + got[p].first + " has no gradient after finish_gradient_sync()\n";
      continue;
    }
    const std::vector<float> g = grad.to_vector(), w = want[p].second.grad().to_vector();
    for (size_t j = 0; j < g.size(); ++j)
      if (!(std::abs(g[j] - w[j]) <= kLadderTolerance)) {
        problems += who + got[p].first + ".grad[" + std::to_string(j) + "] = " + std::to_string(g[j]) +
                    ", expected " + std::to_string(w[j]) + " (one process on the global batch)\n";
        break;
      }
  }
  return problems;
}

// A model with a layer its forward never uses: 5 -> 3, and 3 -> 3 beside it.
class WithUnusedLayer : public nn::Module {
 public:
  explicit WithUnusedLayer(uint64_t seed) {
    Generator gen(seed);
    used_ = register_module("used", std::make_shared<nn::Linear>(5, 3, gen));
    register_module("unused", std::make_shared<nn::Linear>(3, 3, gen));
  }
  Tensor forward(const Tensor& input) override { return (*used_)(input); }

 private:
  std::shared_ptr<nn::Linear> used_;
};

// One step of that model: "" when finish_gradient_sync() throws DistError, as the contract
// says (examples/ladder/rung.h) and torch's DDP does without find_unused_parameters: a rung
// that skips the parameter would step with a gradient the ranks never agreed on.
inline std::string unused_parameter_problems(const std::string& rung,
                                             const std::shared_ptr<dist::ProcessGroup>& pg) {
  const int rank = pg->rank(), world = pg->size();
  const std::string who = "rank " + std::to_string(rank) + "/" + std::to_string(world) + " " + rung + ": ";
  auto dp = make_rung(rung, std::make_shared<WithUnusedLayer>(7), pg);
  const Batch mine = share(global_batch(0, 5), rank, world);
  cross_entropy((*dp)(mine.x), mine.y).backward();
  try {
    dp->finish_gradient_sync();
  } catch (const DistError&) {
    return "";
  } catch (const std::exception& e) {
    return who + "a model whose layer 'unused' gets no gradient: finish_gradient_sync() threw " + e.what() +
           "; the contract is a DistError naming the parameter (check grad.defined())\n";
  }
  return who +
         "a model whose layer 'unused' gets no gradient: finish_gradient_sync() returned; it must throw "
         "DistError naming the parameter (examples/ladder/rung.h), as torch's DDP does without "
         "find_unused_parameters\n";
}

}  // namespace nanoddp::ladder_checks
