// fail_host_syncs and check_host_syncs (kernels/device_memory.h): plain host state, the same in
// every build, so that the NCCL protocol's CPU tests see what a GPU build does.
#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/device_memory.h"

namespace nanoddp::kernels::cuda {

namespace {
// The first reason, kept for the life of the process (leaked: a copy may run during exit).
std::atomic<const std::string*> failure{nullptr};
}  // namespace

void check_host_syncs() {
  if (const std::string* reason = failure.load(std::memory_order_acquire)) NANODDP_THROW(DistError, *reason);
}

void fail_host_syncs(const std::string& reason) noexcept {
  // Never destroyed, as a kept reason: a host wait during exit may still read it.
  static const std::string* const preset = new std::string("an NCCL collective was aborted before it was seen to finish");
  const std::string* kept = preset;
  if (!reason.empty()) {
    try {
      kept = new std::string(reason);
    } catch (...) {
    }
  }
  const std::string* expected = nullptr;
  if (!failure.compare_exchange_strong(expected, kept, std::memory_order_acq_rel) && kept != preset) delete kept;
}

std::string host_syncs_failure() {
  const std::string* reason = failure.load(std::memory_order_acquire);
  return reason != nullptr ? *reason : std::string();
}

void clear_host_syncs_failure() {
  // Kept, not freed: another thread may be reading it. Reachable, so not a leak either.
  static std::mutex retired_mutex;
  static auto* retired = new std::vector<const std::string*>();
  if (const std::string* reason = failure.exchange(nullptr, std::memory_order_acq_rel)) {
    std::lock_guard<std::mutex> lock(retired_mutex);
    retired->push_back(reason);
  }
}

}  // namespace nanoddp::kernels::cuda
