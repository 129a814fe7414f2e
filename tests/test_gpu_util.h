// Helpers of the GPU tests: an RAII device array and host-side comparisons.
//
//   DeviceArray<float> x(host_values);  x.poison();  x.to_host();
//   expect_close("relu_forward n=257", cuda_result, cpu_result, 1e-6, 0.0);
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/random.h"
#include "kernels/device_memory.h"

namespace nanoddp::testing {

// A case this build cannot run (it has no NCCL, or no Gloo). tools/gpu-check sets
// NANODDP_GPU_CHECK_STRICT=1 because its build is meant to have both: there such a case fails,
// so a run cannot report "no failures" for a path that never ran.
inline void not_in_this_build(const char* what) {
  const char* strict = std::getenv("NANODDP_GPU_CHECK_STRICT");
  if (strict != nullptr && std::string(strict) == "1")
    FAIL_CHECK("this build has no ", what, ", so this case checked nothing (tools/gpu-check's build should have it)");
  else
    MESSAGE("skipped: this build has no ", what);
}

// count elements of T on cuda:0, from the caching allocator; freed at scope end.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t count) : count_(count), data_(static_cast<T*>(kernels::cuda::allocate(count * sizeof(T), 0))) {}
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { upload(host); }
  ~DeviceArray() { kernels::cuda::deallocate(data_, 0); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* data() const { return data_; }
  size_t size() const { return count_; }

  void upload(const std::vector<T>& host) {
    REQUIRE(host.size() == count_);
    kernels::cuda::copy(data_, host.data(), count_ * sizeof(T), kernels::cuda::CopyKind::HostToDevice);
  }
  std::vector<T> to_host() const {
    std::vector<T> host(count_);
    kernels::cuda::copy(host.data(), data_, count_ * sizeof(T), kernels::cuda::CopyKind::DeviceToHost);
    return host;
  }
  // Sets every byte to 0xFF (a NaN for float, -1 for int64), through a copy rather than a
  // kernel under test, so an element a kernel forgets to write fails the comparison.
  void poison() {
    std::vector<T> host(count_);
    if (count_ > 0) std::memset(host.data(), 0xFF, count_ * sizeof(T));
    upload(host);
  }

 private:
  size_t count_;
  T* data_;
};

inline std::vector<float> normals(int64_t n, uint64_t seed, float scale = 1.0f) {
  Generator gen(seed);
  std::vector<float> values(static_cast<size_t>(n));
  for (float& v : values) v = scale * gen.normal();
  return values;
}

// Integers in [low, high]: sums of them are exact in float32 while below 2^24.
inline std::vector<float> small_ints(int64_t n, uint64_t seed, int low, int high) {
  Generator gen(seed);
  std::vector<float> values(static_cast<size_t>(n));
  for (float& v : values) v = static_cast<float>(low + static_cast<int>(gen.randint(uint64_t(high - low + 1))));
  return values;
}

// got (CUDA) against want (CPU): equal, or |got - want| <= atol + rtol |want|, everywhere (an
// infinity matches only itself), NaN only where want is NaN. Reports how many differ and the
// first one.
inline void expect_close(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
                         double rtol, double atol) {
  REQUIRE_MESSAGE(got.size() == want.size(), what);
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    const bool ok = std::isnan(w)                    ? std::isnan(g)
                    : std::isinf(w) || std::isinf(g) ? g == w
                                                     : std::fabs(g - w) <= atol + rtol * std::fabs(w);
    if (!ok && bad++ == 0) first = i;
  }
  CHECK_MESSAGE(bad == 0, what << ": " << bad << " of " << got.size() << " elements differ; first at " << first
                               << ": cuda " << (bad ? got[first] : 0.0f) << ", cpu " << (bad ? want[first] : 0.0f));
}

// Same, with a per-element bound (for matmul: a multiple of sum_k |a_ik b_kj|).
inline void expect_within(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
                          const std::vector<float>& bound) {
  REQUIRE_MESSAGE((got.size() == want.size() && bound.size() == want.size()), what);
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool ok = std::fabs(double(got[i]) - double(want[i])) <= double(bound[i]);
    if (!ok && bad++ == 0) first = i;
  }
  CHECK_MESSAGE(bad == 0, what << ": " << bad << " of " << got.size() << " elements differ; first at " << first
                               << ": cuda " << (bad ? got[first] : 0.0f) << ", cpu " << (bad ? want[first] : 0.0f)
                               << ", bound " << (bad ? bound[first] : 0.0f));
}

}  // namespace nanoddp::testing
