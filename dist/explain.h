// Explain: what DDP does in a run, in numbers a learner can check (--explain on the examples,
// NANODDP_EXPLAIN=1): the bucket plan before training, and per step of each epoch the
// all-reduces issued, the bytes they moved, and how much communication backward hid.
//
//   std::printf("%s", dist::explain_plan(ddp).c_str());        // before training
//   dist::ExplainWindow window(*pg);   ... one epoch of steps ...
//   std::printf("%s", window.report("epoch 1", steps).c_str()); // before any other collective
//
// Where the numbers come from (so that they can be checked):
//  - calls and bytes: the process group's counters (ProcessGroup::count), the difference
//    between the window's start and report();
//  - bytes sent per rank: the all-reduce algorithm's formula, ring: 2(N-1)/N * S for S bytes
//    on N ranks (each rank sends S/N bytes N-1 times to reduce, N-1 times to share); beside
//    it, where the backend measures it (shm: Note [Bytes moved]), the bytes this rank really
//    moved and the algorithm each all-reduce ran;
//  - the window covers the training steps only: the epoch's loss and accuracy reductions
//    come after report() and are not counted;
//  - times: the trace's events (core/trace.h), recorded in memory when no trace file is asked
//    for: compute = the time some forward op or backward node runs, communication = the time
//    some bucket's all-reduce is in flight (launch to completion; from DDP's first wait on
//    backends that run collectives in wait(), shm and shm+gloo), exposed = communication
//    time during which no compute runs. Exposed / communication is the share of communication
//    that computation did not hide; with one bucket it is all of it, since the bucket is
//    complete only when backward's last node is done.
#pragma once

#include <cstdint>
#include <string>

#include "core/memory.h"
#include "dist/ddp.h"
#include "dist/fsdp.h"
#include "nn/optimizer.h"

namespace nanoddp::dist {

// Bytes one rank sends in a ring all-reduce of `bytes` over `world_size` ranks:
// 2 (N - 1) / N * S (reduce-scatter, then all-gather, each N - 1 chunks of S / N); 0 for N = 1.
double ring_bytes_sent_per_rank(double bytes, int world_size);

// NANODDP_EXPLAIN as a yes/no: 1/true/yes/on or 0/false/no/off (any case), unset or "" is no;
// any other value is a ValueError naming the variable, so that no value is taken for yes by guess.
bool explain_from_environment();

// The bucket plan, one block per bucket: its index, its parameters by name and shape in plan
// order, its bytes, and why it closed (it reached the first-bucket cap, the bucket cap, or
// the parameters ran out); the header says whether it is the first plan or the one rebuilt
// after the first step (Reducer::rebuild_buckets). Lines end in '\n'.
std::string explain_plan(DistributedDataParallel& ddp);

// Counters and trace events from construction to report(). Construct it when an epoch starts;
// call report() when its last step has ended and before the epoch's own collectives (loss
// averaging, evaluation), which are not steps. Starts recording trace events in memory if
// nothing records them yet.
class ExplainWindow {
 public:
  explicit ExplainWindow(const ProcessGroup& pg);
  // Per step over `steps` steps (> 0): all-reduce calls, bytes reduced, bytes sent per rank,
  // and compute / communication / exposed times in ms with exposed as a percentage; then
  // FSDP's all_gathers and reduce_scatters, and ZeRO-1's broadcasts, when the window had
  // any. Lines "explain: <what>: ...".
  std::string report(const std::string& what, int64_t steps) const;

 private:
  const ProcessGroup& pg_;
  CollectiveCount start_count_, start_gather_, start_scatter_, start_broadcast_;
  MovedBytes start_moved_;
  double start_us_;
};

// ---- memory (Note [Memory categories], docs/ddp/12-sharding.md) ---------------------------

// Elements of all the tensors.
int64_t numel_of(const std::vector<Tensor>& tensors);
// k: bytes of state per parameter element: SGD 4 with momentum (0 without), Adam and AdamW 8
// (12 with amsgrad); a ZeroRedundancyOptimizer's local optimizer's.
int optimizer_state_bytes_per_element(const nn::Optimizer& optimizer);
// The elements of each FSDP unit, in unit order; and of each Linear and Conv2d of a model,
// depth-first (the units --strategy zero2 and fsdp would make).
std::vector<int64_t> unit_numels(const FullyShardedDataParallel& fsdp);
std::vector<int64_t> layer_numels(nn::Module& model);

// What the prediction needs to know of a run.
struct ModelStateShape {
  int64_t numel = 0;  // Ψ
  int world_size = 1;
  int optimizer_state_bytes_per_element = 0;  // k
  std::vector<int64_t> unit_numels;           // FSDP's units, in forward order
  bool gradient_as_bucket_view = false;
  int accumulate = 1;  // micro-batches per step (no_sync between them)
  // The model's parameters' element counts, in parameter order, and the rank predicted for:
  // ZeRO-1 partitions whole parameters (partition_parameters), so a rank's optimizer state is
  // k times its share, which is Ψ/W only for parameters of similar sizes. Empty: kΨ/W.
  std::vector<int64_t> parameter_numels;
  int rank = 0;  // the rank predicted for; -1: the one with the largest share (the most any rank holds)
};

// A table: per stage (ddp, zero1, zero2, fsdp) the parameters, gradients, optimizer state and
// communication buffers one rank holds at the peak of a step, predicted from shape (float32):
//   ddp    4Ψ + 4Ψ + kΨ + 4Ψ of buckets (gradients 0 with gradient_as_bucket_view)
//   zero1  4Ψ + 4Ψ + kΨ/W + 4Ψ (k times this rank's share of the partition, when known)
//   zero2  FSDP's schedule with SHARD_GRAD_OP: shards (4 + k)Ψ/W, every unit's full
//          parameters gathered at the start of backward, full gradients of two units at most
//   fsdp   FULL_SHARD: shards, the unit computing and the one prefetched, two full gradients
//   (zero2 and fsdp walk the units as if each were freed after its forward and reduced in
//   reverse order. A root that holds parameters no unit claimed stays gathered through
//   forward and keeps its full gradient until its last parameter's gradient arrives, which
//   the walk does not know: with such a root, the prediction is short by up to its full
//   parameters and gradient, 8 bytes per root element.)
// and, when strategy is a rung of the ladder (docs/ladder.md), its own row: naive and overlap
// as ddp without buckets (each .grad is all-reduced in place), flat as ddp (one flat buffer);
// then the measured peak of this run (the allocator's model-state peak and each category's),
// and what the measured peak holds that no row does: with gradient_as_bucket_view, the first
// step's (a parameter's first gradient before it becomes a view, the re-planned buckets beside
// the first ones); with accumulate > 1 under zero2 or fsdp, no_sync's full gradient sums.
// The row of `strategy` is marked. Lines end in '\n'.
std::string explain_memory(const ModelStateShape& shape, const std::string& strategy, const MemoryStats& measured);
// The total of one stage's row: bytes of model state one rank holds at the peak of a step.
// ValueError for a stage other than ddp, zero1, zero2, fsdp, naive, flat, overlap.
int64_t predicted_peak_model_state(const ModelStateShape& shape, const std::string& stage);

// FSDP's units: name, parameters, elements, shard size and padding per rank.
std::string explain_units(const FullyShardedDataParallel& fsdp);

}  // namespace nanoddp::dist
