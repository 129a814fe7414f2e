// Sums of float data accumulated in double, fast: kLanes independent accumulators, lane j
// adding every kLanes-th value in index order. One running double sum is a chain of
// dependent adds (4 cycles each); eight lanes let the compiler keep them in two AVX
// registers and convert and add eight floats at a time. The order is fixed by the code, not
// by the vector width, so the result is the same on every machine and every run.
#pragma once

#include <cstdint>

namespace nanoddp::kernels::cpu {

constexpr int64_t kSumLanes = 8;

// sum over i in [0, n) of value(i), value returning double.
template <class Value>
double lane_sum(int64_t n, Value value) {
  double lanes[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes)
    for (int64_t j = 0; j < kSumLanes; ++j) lanes[j] += value(i + j);
  for (int64_t j = 0; i < n; ++i, ++j) lanes[j] += value(i);
  double total = 0.0;
  for (double lane : lanes) total += lane;
  return total;
}

}  // namespace nanoddp::kernels::cpu
