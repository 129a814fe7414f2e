// Memory accounting: the bytes every live allocation holds, by what it is for, and the peak.
//
//   reset_peak_memory();
//   ... one training step ...
//   MemoryStats stats = memory_stats(Device::cpu());
//   stats.live[MemoryCategory::Parameters];  stats.peak_model_state;   // bytes
//
// Note [Memory categories]
// Every allocation (Storage::allocate, host and device) is counted under one category. It
// starts as the category of the MemoryCategoryScope open on the allocating thread (Other
// when none: activations, temporaries, data) and moves when the code that owns it says what
// it is (set_memory_category): a Module's parameters, a leaf's .grad, an optimizer's state,
// a collective's buffers (DDP's buckets, FSDP's all-gather and reduce-scatter buffers), or a
// tensor autograd saves for backward (Activations: Node::save_for_backward, and the inputs a
// checkpointed region keeps; an allocation wrapped from elsewhere is not counted there). The
// model state is the sum of the four model-state categories: what the ZeRO stages shard, and what
// --explain predicts per stage (docs/ddp/12-sharding.md). Counting is exact in bytes asked
// for (not rounded to the allocator's blocks), per device type, and costs two relaxed
// atomic adds per allocation (torch.cuda.memory_allocated and max_memory_allocated count the
// same way, without categories).
#pragma once

#include <array>
#include <cstdint>
#include <memory>

#include "core/device.h"

namespace nanoddp {

class Storage;
class Tensor;

enum class MemoryCategory : int { Other = 0, Parameters, Gradients, OptimizerState, CommBuffers, Activations };
constexpr int kNumMemoryCategories = 6;
// Parameters, gradients, optimizer state and communication buffers; not Other or Activations.
bool is_model_state(MemoryCategory category);
const char* memory_category_name(MemoryCategory category);  // "other", "parameters", ...

struct MemoryStats {
  // Bytes allocated now and at most since the last reset_peak_memory(), by category.
  std::array<int64_t, kNumMemoryCategories> live{};
  std::array<int64_t, kNumMemoryCategories> peak{};
  // The model-state categories' sum (is_model_state): now, and the largest
  // that sum has been since the last reset (not the sum of the categories' peaks).
  int64_t live_model_state = 0;
  int64_t peak_model_state = 0;
  int64_t live_total = 0;
  int64_t peak_total = 0;
  // Bytes the allocator keeps for reuse, freed by their tensors but not given back: on the
  // CPU the host block cache (Note [Host block cache] in core/storage.cpp: blocks of 64 KiB and
  // more, reused by exact size, up to 256 MiB), on CUDA reserved minus allocated (torch's
  // memory_reserved() - memory_allocated()). Part of the process's resident memory (RSS) but
  // of no category: why RSS stays above the live bytes after, say, FSDP frees a unit.
  int64_t cached = 0;
  int64_t operator[](MemoryCategory category) const { return live[static_cast<int>(category)]; }
};

// The counts of one device type (every CUDA device together, as one process drives one).
MemoryStats memory_stats(Device device);
// Peaks restart from what is live now (torch.cuda.reset_peak_memory_stats), on both device types.
void reset_peak_memory();
// Gives the cached blocks of `device`'s type back to the system (torch.cuda.empty_cache; on
// the CPU the host block cache): memory_stats(device).cached drops to 0, and the next
// allocations of those sizes pay their page faults again. Live tensors are not touched.
void empty_cache(Device device = Device::cpu());

// Allocations made on this thread while the scope lives start in `category`.
class MemoryCategoryScope {
 public:
  explicit MemoryCategoryScope(MemoryCategory category);
  ~MemoryCategoryScope();
  MemoryCategoryScope(const MemoryCategoryScope&) = delete;
  MemoryCategoryScope& operator=(const MemoryCategoryScope&) = delete;

 private:
  MemoryCategory previous_;
};
MemoryCategory current_memory_category();

// Counts the allocation `tensor` lives in (its view's base: the whole allocation) under
// `category` from now on. Only an allocation still under Other moves unless `force`: a .grad
// that is a view of a DDP bucket stays a communication buffer. No-op for an undefined or
// empty tensor.
void set_memory_category(const Tensor& tensor, MemoryCategory category, bool force = false);

namespace detail {
// Storage's hooks: an allocation of nbytes came or went under category.
void count_allocation(Device device, MemoryCategory category, int64_t nbytes);
// The host block cache's bytes, and giving them back (core/storage.cpp).
int64_t host_cached_bytes();
void empty_host_cache();
}  // namespace detail

}  // namespace nanoddp
