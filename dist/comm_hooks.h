// DDP communication hooks: replace the all-reduce of each gradient bucket by your own
// (torch.distributed.algorithms.ddp_comm_hooks; DistributedDataParallel.register_comm_hook).
//
//   dist::DistributedDataParallel ddp(model, pg);
//   ddp.register_comm_hook(pg, dist::bf16_compress_hook);   // before the first backward
//   loss_fn(ddp(x), y).backward();                          // each bucket goes through the hook
//
// A hook is called once per bucket per synced backward, in plan order (bucket 0 first), when
// the bucket's last gradient is in (or when backward ends, with overlap off). It receives a
// GradBucket whose buffer() holds this rank's gradients, NOT divided by world_size: with a
// hook registered the reducer leaves the averaging to the hook, as PyTorch does. It returns a
// Future of the reduced buffer: a [numel] float32 tensor on the buffer's device (the buffer
// itself, or another tensor of its shape) whose values the reducer then writes into each
// parameter's .grad. Every rank must issue the same collectives in the same order from its
// hook (process_group.h's contract); a hook that issues none is allowed (local SGD, say).
//
// Note [Comm hook futures]
// A Future here is a Work plus an optional continuation, and it completes at wait(): the
// continuation (fp16's decompression, say) runs on the thread that waits, once, after the
// work has completed. That is what the reducer needs: it waits for every bucket in plan
// order when backward ends. torch's Future runs then() callbacks on a completion thread
// instead; nothing in DDP can tell the difference, and ours never runs a callback on a
// thread that the user did not hand to it.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "dist/process_group.h"

namespace nanoddp::dist {

// One bucket handed to a comm hook (torch.distributed.GradBucket).
class GradBucket {
 public:
  GradBucket(size_t index, Tensor buffer, std::vector<Tensor> parameters, std::vector<int64_t> offsets, bool is_last)
      : index_(index), buffer_(std::move(buffer)), parameters_(std::move(parameters)), offsets_(std::move(offsets)),
        is_last_(is_last) {}

  // The bucket's position in the plan (Reducer::bucket_plan()); 0 is reduced first.
  size_t index() const { return index_; }
  // [sum of the parameters' numel] float32 on the parameters' device: their gradients side
  // by side, parameters()[i]'s starting at element offsets()[i]. The hook may overwrite it
  // (the built-in hooks reduce into it).
  Tensor& buffer() { return buffer_; }
  const Tensor& buffer() const { return buffer_; }
  // The bucket's parameters, in bucket order (torch's GradBucket.parameters()).
  const std::vector<Tensor>& parameters() const { return parameters_; }
  const std::vector<int64_t>& offsets() const { return offsets_; }
  // True for the last bucket of the plan: the last hook call of this backward.
  bool is_last() const { return is_last_; }

 private:
  size_t index_;
  Tensor buffer_;
  std::vector<Tensor> parameters_;
  std::vector<int64_t> offsets_;
  bool is_last_;
};

// The result of a comm hook: a tensor that is final once wait() returns (see Note [Comm hook
// futures]). Not thread-safe: one thread waits.
class Future : public std::enable_shared_from_this<Future> {
 public:
  // Final when work is: work is a collective that writes value in place (all_reduce).
  Future(std::shared_ptr<Work> work, Tensor value);
  // Final already (a hook that computed its result synchronously).
  static std::shared_ptr<Future> completed(Tensor value);

  // A future whose value is fn(this future's value), computed in its wait() after this one
  // has completed, once (torch.futures.Future.then).
  std::shared_ptr<Future> then(std::function<Tensor(const Tensor&)> fn);

  // Blocks until the value is final and returns it. Throws what the collective's Work::wait
  // throws (TimeoutError after timeout, DistError on failure) or what a continuation throws.
  Tensor wait(std::chrono::milliseconds timeout = kDefaultTimeout);
  // True once the underlying collective has completed (a continuation may still be pending:
  // wait() runs it); never blocks.
  bool is_completed();

 private:
  Future() = default;

  std::shared_ptr<Work> work_;                 // none for completed() and then()
  std::shared_ptr<Future> parent_;             // then(): the future whose value fn takes
  std::function<Tensor(const Tensor&)> then_;  // then(): the continuation
  Tensor value_;
  bool done_ = false;
};

// What DistributedDataParallel::register_comm_hook stores: the user's hook bound to its state.
using CommHook = std::function<std::shared_ptr<Future>(GradBucket&)>;

// ---- built-in hooks (torch.distributed.algorithms.ddp_comm_hooks.default_hooks) ----------
// Each takes the process group to reduce over as its state (nullptr: the DDP's own group,
// as PyTorch's None means the default group) and computes the mean over that group's ranks.

// Divides the buffer by world_size and all-reduces it (sum) in place: the same values as
// DDP without a hook (default_hooks.allreduce_hook).
std::shared_ptr<Future> allreduce_hook(std::shared_ptr<ProcessGroup>& process_group, GradBucket& bucket);

// Rounds the buffer to float16 (to nearest, ties to even), divides by world_size in float16,
// all-reduces the float16 values (sum: half the bytes), and writes them back into the
// buffer as float32 (default_hooks.fp16_compress_hook). Values beyond +-65504 become +-inf,
// and below 2^-24 zero: suited to gradients of moderate range.
std::shared_ptr<Future> fp16_compress_hook(std::shared_ptr<ProcessGroup>& process_group, GradBucket& bucket);

// As fp16_compress_hook with bfloat16: float32's range, 8 bits of precision
// (default_hooks.bf16_compress_hook).
std::shared_ptr<Future> bf16_compress_hook(std::shared_ptr<ProcessGroup>& process_group, GradBucket& bucket);

}  // namespace nanoddp::dist
