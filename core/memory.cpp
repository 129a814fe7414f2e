#include "core/memory.h"

#include <atomic>

#include "core/storage.h"
#include "core/tensor.h"
#include "kernels/device_memory.h"
#include "kernels/kernels.h"

namespace nanoddp {

namespace {

// One device type's counters. Peaks are raised with a compare-and-swap loop, so concurrent
// allocations (Gloo's worker thread, the data loader's) never lower one.
struct Counters {
  std::array<std::atomic<int64_t>, kNumMemoryCategories> live{};
  std::array<std::atomic<int64_t>, kNumMemoryCategories> peak{};
  std::atomic<int64_t> live_model_state{0}, peak_model_state{0};
  std::atomic<int64_t> live_total{0}, peak_total{0};
};

Counters& counters(Device device) {
  static Counters cpu, cuda;
  return device.is_cuda() ? cuda : cpu;
}

void raise_peak(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

thread_local MemoryCategory scope_category = MemoryCategory::Other;

}  // namespace

const char* memory_category_name(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::Other: return "other";
    case MemoryCategory::Parameters: return "parameters";
    case MemoryCategory::Gradients: return "gradients";
    case MemoryCategory::OptimizerState: return "optimizer_state";
    case MemoryCategory::CommBuffers: return "comm_buffers";
    case MemoryCategory::Activations: return "activations";
  }
  return "?";
}

bool is_model_state(MemoryCategory category) {
  return category != MemoryCategory::Other && category != MemoryCategory::Activations;
}

MemoryStats memory_stats(Device device) {
  const Counters& c = counters(device);
  MemoryStats stats;
  for (int i = 0; i < kNumMemoryCategories; ++i) {
    stats.live[i] = c.live[i].load(std::memory_order_relaxed);
    stats.peak[i] = c.peak[i].load(std::memory_order_relaxed);
  }
  stats.live_model_state = c.live_model_state.load(std::memory_order_relaxed);
  stats.peak_model_state = c.peak_model_state.load(std::memory_order_relaxed);
  stats.live_total = c.live_total.load(std::memory_order_relaxed);
  stats.peak_total = c.peak_total.load(std::memory_order_relaxed);
  if (!device.is_cuda()) {
    stats.cached = detail::host_cached_bytes();
  } else if (kernels::cuda_built() && kernels::cuda::device_count() > 0) {
    const auto allocator = kernels::cuda::allocator_stats(device.index);
    stats.cached = static_cast<int64_t>(allocator.reserved_bytes - allocator.allocated_bytes);
  }
  return stats;
}

void empty_cache(Device device) {
  if (!device.is_cuda()) {
    detail::empty_host_cache();
  } else if (kernels::cuda_built() && kernels::cuda::device_count() > 0) {
    kernels::cuda::empty_cache();
  }
}

void reset_peak_memory() {
  for (Device device : {Device::cpu(), Device::cuda(0)}) {
    Counters& c = counters(device);
    for (int i = 0; i < kNumMemoryCategories; ++i) c.peak[i].store(c.live[i].load());
    c.peak_model_state.store(c.live_model_state.load());
    c.peak_total.store(c.live_total.load());
  }
}

MemoryCategoryScope::MemoryCategoryScope(MemoryCategory category) : previous_(scope_category) {
  scope_category = category;
}
MemoryCategoryScope::~MemoryCategoryScope() { scope_category = previous_; }
MemoryCategory current_memory_category() { return scope_category; }

void set_memory_category(const Tensor& tensor, MemoryCategory category, bool force) {
  if (!tensor.defined() || tensor.impl()->storage == nullptr) return;
  Storage* storage = tensor.impl()->storage.get();
  if (storage->base() != nullptr) storage = storage->base().get();
  if (storage->category() == category || (!force && storage->category() != MemoryCategory::Other)) return;
  // Memory wrapped from elsewhere (a batch in shared memory) is no activation of this rank's.
  if (category == MemoryCategory::Activations && !storage->counted()) return;
  storage->set_category(category);
}

namespace detail {

void count_allocation(Device device, MemoryCategory category, int64_t nbytes) {
  Counters& c = counters(device);
  const int i = static_cast<int>(category);
  raise_peak(c.peak[i], c.live[i].fetch_add(nbytes, std::memory_order_relaxed) + nbytes);
  raise_peak(c.peak_total, c.live_total.fetch_add(nbytes, std::memory_order_relaxed) + nbytes);
  if (is_model_state(category))
    raise_peak(c.peak_model_state, c.live_model_state.fetch_add(nbytes, std::memory_order_relaxed) + nbytes);
}

}  // namespace detail

}  // namespace nanoddp
