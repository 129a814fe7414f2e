#include "dist/explain.h"

#include "dist/zero_redundancy_optimizer.h"
#include "nn/adam.h"
#include "nn/conv.h"
#include "nn/layers.h"
#include "nn/optim.h"

#include <algorithm>
#include <cstdlib>
#include <iomanip>
#include <sstream>

#include "core/error.h"
#include "core/trace.h"
#include "dist/detail.h"

namespace nanoddp::dist {

namespace {

struct Interval {
  double begin, end;
};

// The union of intervals, as disjoint intervals in time order.
std::vector<Interval> merged(std::vector<Interval> intervals) {
  std::sort(intervals.begin(), intervals.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  std::vector<Interval> out;
  for (const Interval& i : intervals) {
    if (!out.empty() && i.begin <= out.back().end)
      out.back().end = std::max(out.back().end, i.end);
    else
      out.push_back(i);
  }
  return out;
}

double total(const std::vector<Interval>& intervals) {
  double sum = 0;
  for (const Interval& i : intervals) sum += i.end - i.begin;
  return sum;
}

// Time covered by both of two unions of disjoint intervals.
double overlap(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  double both = 0;
  size_t j = 0;
  for (const Interval& i : a) {
    while (j < b.size() && b[j].end <= i.begin) ++j;
    for (size_t k = j; k < b.size() && b[k].begin < i.end; ++k)
      both += std::min(i.end, b[k].end) - std::max(i.begin, b[k].begin);
  }
  return both;
}

}  // namespace

double ring_bytes_sent_per_rank(double bytes, int world_size) {
  NANODDP_CHECK(world_size >= 1, ValueError, "ring_bytes_sent_per_rank: world size ", world_size, " < 1");
  return 2.0 * (world_size - 1) / world_size * bytes;
}

bool explain_from_environment() { return detail::env_flag("NANODDP_EXPLAIN", false); }

std::string explain_plan(DistributedDataParallel& ddp) {
  const auto named = ddp.module().named_parameters();
  const auto plan = ddp.reducer().bucket_plan();
  const ReducerOptions& options = ddp.reducer().options();
  const ProcessGroup& pg = ddp.process_group();
  std::ostringstream out;
  out << "explain: DDP bucket plan, " << plan.size() << (plan.size() == 1 ? " bucket" : " buckets") << " (world size "
      << pg.size() << ", " << pg.backend_name() << "; first bucket cap " << options.first_bucket_cap_bytes
      << " bytes, bucket cap " << options.bucket_cap_bytes << " bytes; "
      << (ddp.reducer().buckets_rebuilt() ? "rebuilt from the order gradients became ready on rank 0"
                                          : "parameters in reverse order")
      << ")\n";
  for (size_t b = 0; b < plan.size(); ++b) {
    size_t bytes = 0;
    std::ostringstream names;
    for (size_t i = 0; i < plan[b].size(); ++i) {
      const auto& [name, p] = named[plan[b][i]];
      bytes += p.nbytes();
      names << (i ? ", " : "") << name << " " << p.shape();
    }
    const size_t cap = b == 0 ? options.first_bucket_cap_bytes : options.bucket_cap_bytes;
    out << "explain: bucket " << b << ": " << bytes << " bytes, " << plan[b].size()
        << (plan[b].size() == 1 ? " parameter: " : " parameters: ") << names.str() << "; closed: ";
    if (bytes >= cap)
      out << "reached the " << (b == 0 ? "first-bucket" : "bucket") << " cap (" << cap << " bytes)\n";
    else
      out << "no parameters left (under its cap of " << cap << " bytes)\n";
  }
  if (pg.size() == 1 && ddp.reducer().has_comm_hook())
    out << "explain: world size 1: gradients are already the mean, but the comm hook still runs on every bucket "
           "(a compression hook rounds it to 16 bits, as torch's Reducer does)\n";
  else if (pg.size() == 1)
    out << "explain: world size 1: gradients are already the mean; no bucket is all-reduced\n";
  return out.str();
}

ExplainWindow::ExplainWindow(const ProcessGroup& pg)
    : pg_(pg),
      start_count_(pg.count(Collective::AllReduce)),
      start_gather_(pg.count(Collective::AllGather)),
      start_scatter_(pg.count(Collective::ReduceScatter)),
      start_broadcast_(pg.count(Collective::Broadcast)),
      start_moved_(pg.moved_bytes()),
      start_us_(trace::now_us()) {
  if (!trace::enabled())
    trace::start("");
  else
    trace::forget_in_memory_events();  // earlier windows' events: already reported
}

std::string ExplainWindow::report(const std::string& what, int64_t steps) const {
  NANODDP_CHECK(steps > 0, ValueError, "ExplainWindow::report: steps must be > 0, got ", steps);
  const CollectiveCount now = pg_.count(Collective::AllReduce);
  const int64_t calls = now.calls - start_count_.calls, bytes = now.bytes - start_count_.bytes;
  const int N = pg_.size();
  const std::string algorithm = pg_.all_reduce_algorithm();

  std::vector<Interval> compute, communication;
  for (const trace::Event& e : trace::events_since(start_us_)) {
    // "backward" encloses its nodes and DDP's waits: its own time is not compute.
    if (e.lane == static_cast<int>(trace::Lane::Compute) && e.name != "backward")
      compute.push_back({e.begin_us, e.end_us});
    else if (e.lane >= trace::kAllReduceLane)
      communication.push_back({e.begin_us, e.end_us});
  }
  compute = merged(std::move(compute));
  communication = merged(std::move(communication));
  const double compute_us = total(compute), communication_us = total(communication);
  const double exposed_us = communication_us - overlap(communication, compute);

  const double per_step_bytes = static_cast<double>(bytes) / static_cast<double>(steps);
  const double sent = ring_bytes_sent_per_rank(per_step_bytes, N);
  const double s = static_cast<double>(steps);
  std::ostringstream out;
  out << std::fixed;
  out << "explain: " << what << ": " << steps << " steps; per step: " << std::setprecision(2)
      << static_cast<double>(calls) / s << " all_reduce calls, " << std::setprecision(0) << per_step_bytes
      << " bytes reduced, " << sent << " bytes sent per rank (ring formula 2(N-1)/N * S with N = " << N;
  if (algorithm != "ring") out << "; " << algorithm << " picks its own algorithm";
  out << ")\n";
  out << "explain: " << what << ": per step: compute " << std::setprecision(3) << compute_us / s / 1000.0 << " ms, communication "
      << communication_us / s / 1000.0 << " ms, exposed " << exposed_us / s / 1000.0 << " ms";
  if (communication_us > 0)
    out << " (" << std::setprecision(1) << 100.0 * exposed_us / communication_us
        << "% of communication not hidden by compute)\n";
  else
    out << " (no communication)\n";
  out << "explain: " << what << ": counters over these steps: all_reduce " << calls << " calls, " << bytes
      << " bytes (training steps only: the epoch's loss and accuracy reductions come after)\n";
  const MovedBytes moved = pg_.moved_bytes();
  if (moved.measured) {
    out << "explain: " << what << ": measured by " << pg_.backend_name() << ": " << std::setprecision(0)
        << static_cast<double>(moved.bytes - start_moved_.bytes) / s
        << " bytes moved per rank per step (written to peers or read from their buffers, the collective check's "
           "fingerprints included); all_reduce by algorithm:";
    for (const auto& [algorithm, count] : moved.all_reduces_by_algorithm) {
      const auto before = start_moved_.all_reduces_by_algorithm.find(algorithm);
      const int64_t earlier = before == start_moved_.all_reduces_by_algorithm.end() ? 0 : before->second;
      out << " " << algorithm << " " << std::setprecision(2) << static_cast<double>(count - earlier) / s;
    }
    out << " per step\n";
  } else {
    out << "explain: " << what << ": " << pg_.backend_name()
        << " runs its algorithms inside the library: bytes moved are not measured, the formula above is the ring's\n";
  }
  // FSDP's collectives: each all_gather sends this rank's shard to N - 1 ranks, each
  // reduce_scatter sends N - 1 shards of the gradient (the ring's two halves).
  const CollectiveCount gather = pg_.count(Collective::AllGather), scatter = pg_.count(Collective::ReduceScatter);
  const int64_t gather_calls = gather.calls - start_gather_.calls, gather_bytes = gather.bytes - start_gather_.bytes;
  const int64_t scatter_calls = scatter.calls - start_scatter_.calls, scatter_bytes = scatter.bytes - start_scatter_.bytes;
  if (gather_calls > 0 || scatter_calls > 0) {
    const double gathered = static_cast<double>(gather_bytes) / s, scattered = static_cast<double>(scatter_bytes) / s;
    out << "explain: " << what << ": per step: all_gather " << std::setprecision(2)
        << static_cast<double>(gather_calls) / s << " calls of " << std::setprecision(0) << gathered
        << " shard bytes, reduce_scatter " << std::setprecision(2) << static_cast<double>(scatter_calls) / s
        << " calls of " << std::setprecision(0) << scattered << " shard bytes; "
        << (N - 1) * (gathered + scattered) << " bytes sent per rank (ring: N - 1 shards each)\n";
    // Note [Gloo new-style API]: Gloo's reduce_scatter is an all-reduce of the whole unit.
    if (scatter_calls > 0 && pg_.backend_name() == "gloo")
      out << "explain: " << what
          << ": gloo runs reduce_scatter as an all_reduce of the whole unit (Note [Gloo "
          << "new-style API]): about " << 2 * (N - 1) * scattered
          << " bytes sent per rank for it, not the ring's N - 1 shards, and a unit-sized buffer per call in "
             "flight, counted as other memory\n";
  }
  // ZeRO-1's step: each parameter broadcast from the rank that owns it. DDP broadcasts too:
  // its buffers before each forward (broadcast_buffers), its new bucket order once.
  const CollectiveCount broadcast = pg_.count(Collective::Broadcast);
  const int64_t broadcast_calls = broadcast.calls - start_broadcast_.calls;
  if (broadcast_calls > 0)
    out << "explain: " << what << ": per step: broadcast " << std::setprecision(2)
        << static_cast<double>(broadcast_calls) / s << " calls of " << std::setprecision(0)
        << static_cast<double>(broadcast.bytes - start_broadcast_.bytes) / s
        << " bytes (ZeRO-1: each parameter from the rank that owns it; DDP: its buffers, its re-plan)\n";
  return out.str();
}

}  // namespace nanoddp::dist

namespace nanoddp::dist {

int64_t numel_of(const std::vector<Tensor>& tensors) {
  int64_t numel = 0;
  for (const Tensor& t : tensors) numel += t.numel();
  return numel;
}

int optimizer_state_bytes_per_element(const nn::Optimizer& optimizer) {
  const nn::Optimizer* plain = &optimizer;
  if (const auto* zero = dynamic_cast<const ZeroRedundancyOptimizer*>(&optimizer)) plain = &zero->local_optimizer();
  if (const auto* sgd = dynamic_cast<const nn::SGD*>(plain)) return sgd->options().momentum != 0.0f ? 4 : 0;
  if (const auto* adam = dynamic_cast<const nn::Adam*>(plain)) return adam->options().amsgrad ? 12 : 8;
  return 0;
}

std::vector<int64_t> unit_numels(const FullyShardedDataParallel& fsdp) {
  std::vector<int64_t> numels;
  for (const auto& unit : fsdp.units()) numels.push_back(unit.numel);
  return numels;
}

std::vector<int64_t> layer_numels(nn::Module& model) {
  std::vector<int64_t> numels;
  for (auto& [name, m] : model.named_modules()) {
    if (dynamic_cast<nn::Linear*>(m) == nullptr && dynamic_cast<nn::Conv2d*>(m) == nullptr) continue;
    numels.push_back(numel_of(m->parameters()));
  }
  return numels;
}

namespace {

// The model state of one rank at one moment, in bytes.
struct Moment {
  double parameters = 0, gradients = 0, optimizer_state = 0, comm_buffers = 0;
  double total() const { return parameters + gradients + optimizer_state + comm_buffers; }
};

// Walks FSDP's schedule (Note [FSDP units]) over units that each hold `numels` elements and
// returns the moment the model state peaks: a unit in forward order, backward in reverse,
// backward prefetch, at most two units' full gradients alive (this one's and the one being
// reduced), the optimizer's state already made by an earlier step.
Moment fsdp_peak(const ModelStateShape& shape, bool full_shard) {
  const int W = shape.world_size;
  std::vector<double> full, shard;  // bytes per unit
  for (int64_t n : shape.unit_numels) {
    const double s = static_cast<double>((n + W - 1) / W);
    shard.push_back(4.0 * s);
    full.push_back(4.0 * s * W);
  }
  const size_t n = full.size();
  Moment now, peak;
  for (double s : shard) {
    now.parameters += s;
    now.optimizer_state += s / 4.0 * shape.optimizer_state_bytes_per_element;
  }
  const auto see = [&] {
    if (now.total() > peak.total()) peak = now;
  };
  std::vector<bool> gathered(n, false);
  for (size_t u = 0; u < n; ++u) {  // forward
    now.parameters += full[u];
    gathered[u] = true;
    see();
    if (full_shard) {
      now.parameters -= full[u];
      gathered[u] = false;
    }
  }
  double in_flight = 0;  // the full gradient being reduced
  for (size_t i = n; i-- > 0;) {  // backward
    if (!gathered[i]) now.parameters += full[i], gathered[i] = true;
    now.gradients += full[i];  // the unit's full gradient, zeroed
    if (full_shard && i > 0 && !gathered[i - 1]) now.parameters += full[i - 1], gathered[i - 1] = true;
    see();
    now.gradients += shard[i];  // the reduce_scatter's output: this shard's gradient
    see();
    now.parameters -= full[i];  // resharded
    gathered[i] = false;
    now.gradients -= in_flight;  // the previous unit's reduction finished
    in_flight = full[i];
  }
  return peak;
}

// The peak moment of one stage.
Moment predict(const ModelStateShape& shape, const std::string& stage) {
  const double psi = static_cast<double>(shape.numel);
  const double W = shape.world_size;
  const double k = shape.optimizer_state_bytes_per_element;
  if (stage == "zero2") return fsdp_peak(shape, /*full_shard=*/false);
  if (stage == "fsdp") return fsdp_peak(shape, /*full_shard=*/true);
  // The ladder's rungs (docs/ladder.md) keep DDP's parameters, gradients and optimizer state;
  // naive and overlap all-reduce each .grad in place (no communication buffer), flat copies
  // the gradients into one flat buffer as large as DDP's buckets.
  if (stage == "naive" || stage == "overlap" || stage == "flat") {
    Moment m = predict(shape, "ddp");
    if (stage != "flat") m.comm_buffers = 0;
    return m;
  }
  NANODDP_CHECK(stage == "ddp" || stage == "zero1", ValueError, "no memory prediction for stage '", stage,
                "' (ddp, zero1, zero2, fsdp, or the ladder's naive, flat, overlap)");
  Moment m;
  m.parameters = 4 * psi;
  m.gradients = shape.gradient_as_bucket_view ? 0 : 4 * psi;  // views of the buckets
  m.optimizer_state = stage == "ddp" ? k * psi : k * psi / W;
  if (stage == "zero1" && !shape.parameter_numels.empty()) {
    const std::vector<int> owner = partition_parameters(shape.parameter_numels, shape.world_size);
    std::vector<double> shares(static_cast<size_t>(shape.world_size), 0.0);
    for (size_t i = 0; i < owner.size(); ++i)
      shares[static_cast<size_t>(owner[i])] += static_cast<double>(shape.parameter_numels[i]);
    m.optimizer_state = k * (shape.rank < 0 ? *std::max_element(shares.begin(), shares.end())
                                            : shares[static_cast<size_t>(shape.rank)]);
  }
  m.comm_buffers = 4 * psi;  // the buckets
  return m;
}

}  // namespace

int64_t predicted_peak_model_state(const ModelStateShape& shape, const std::string& stage) {
  return static_cast<int64_t>(predict(shape, stage).total());
}

std::string explain_memory(const ModelStateShape& shape, const std::string& strategy, const MemoryStats& measured) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(0);
  out << "explain: memory per rank" << (shape.rank < 0 ? " (the rank that holds most)" : "")
      << ", predicted at the peak of a step (bytes; Ψ = " << shape.numel
      << " parameters, W = " << shape.world_size << ", optimizer state "
      << shape.optimizer_state_bytes_per_element << " bytes per parameter; docs/ddp/12-sharding.md):\n";
  out << "explain:   stage   parameters   gradients  optimizer  comm_buffers       total\n";
  const auto row = [&](const char* stage, const Moment& m) {
    out << "explain:   " << std::left << std::setw(6) << stage << std::right << std::setw(12) << m.parameters
        << std::setw(12) << m.gradients << std::setw(11) << m.optimizer_state << std::setw(14) << m.comm_buffers
        << std::setw(12) << m.total() << (strategy == stage ? "   <- this run" : "") << "\n";
  };
  for (const char* stage : {"ddp", "zero1", "zero2", "fsdp"}) row(stage, predict(shape, stage));
  for (const char* rung : {"naive", "flat", "overlap"})
    if (strategy == rung) row(rung, predict(shape, rung));  // a ladder rung: its own row
  out << "explain:   measured (this run, from the allocator"
      << (shape.rank < 0 ? ", the most of any rank" : "") << "): peak model state "
      << measured.peak_model_state << " bytes; peaks by category: parameters "
      << measured.peak[static_cast<int>(MemoryCategory::Parameters)] << ", gradients "
      << measured.peak[static_cast<int>(MemoryCategory::Gradients)] << ", optimizer "
      << measured.peak[static_cast<int>(MemoryCategory::OptimizerState)] << ", comm_buffers "
      << measured.peak[static_cast<int>(MemoryCategory::CommBuffers)] << "\n";
  const bool replicated = strategy != "zero2" && strategy != "fsdp";
  if (shape.gradient_as_bucket_view && replicated)
    out << "explain:   the measured peak includes the first step's: a parameter's first gradient, made by autograd "
           "before it becomes a bucket view, and the re-planned buckets beside the first ones (torch's reducer "
           "does the same); the rows are a later step's\n";
  if (shape.accumulate > 1 && !replicated)
    out << "explain:   --accumulate " << shape.accumulate
        << ": between micro-batches no_sync keeps each unit's full gradient sum (as torch's FSDP does), which the "
           "rows leave out\n";
  return out.str();
}

std::string explain_units(const FullyShardedDataParallel& fsdp) {
  std::ostringstream out;
  const auto units = fsdp.units();
  const int W = fsdp.process_group().size();
  out << "explain: FSDP " << sharding_strategy_name(fsdp.sharding_strategy()) << ", " << units.size()
      << " units on " << W << " ranks (Note [FSDP units]):\n";
  for (size_t u = 0; u < units.size(); ++u) {
    out << "explain:   unit " << u << " " << (units[u].name.empty() ? "(root)" : "'" + units[u].name + "'") << ": "
        << units[u].numel << " elements";
    for (const std::string& name : units[u].parameter_names) out << " " << name;
    out << "; shard " << units[u].shard_numel << " elements (" << units[u].shard_numel * 4 << " bytes) per rank";
    if (units[u].shard_numel * W > units[u].numel && fsdp.sharding_strategy() != ShardingStrategy::NO_SHARD)
      out << ", " << units[u].shard_numel * W - units[u].numel << " of padding";
    out << "\n";
  }
  return out.str();
}

}  // namespace nanoddp::dist
