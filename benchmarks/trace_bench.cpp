// What one instrumented place costs (Note [Trace cost] in core/trace.h): a trace::Span with
// recording off, which is what every training run without --trace pays at each forward op,
// backward node, hook, data batch and optimizer step, and the same span with recording on
// (in memory, as --explain records). benchmarks/run multiplies the off cost by the events
// of one training step and divides by the step's time.
//
//   build/benchmarks/trace_bench            # one JSON line: ns per span, off and on
#include <chrono>
#include <cstdio>

#include "benchmarks/no_arguments.h"
#include "core/trace.h"

using namespace nanoddp;

namespace {

// Nanoseconds per span over `count` spans.
double ns_per_span(long count) {
  const auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < count; ++i) {
    trace::Span span(trace::Lane::Compute, "bench");
  }
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / count;
}

}  // namespace

int main(int argc, char** argv) {
  if (const int status = benchmarks::refuse_arguments(
          argc, argv, "trace_bench prints one JSON line: the ns per span with tracing off and on");
      status >= 0)
    return status;
  trace::stop();  // off, even under NANODDP_TRACE
  const double off = ns_per_span(200'000'000);
  trace::start("");  // in memory
  const double on = ns_per_span(1'000'000);
  trace::stop();
  std::printf("{\"example\":\"trace_bench\",\"off_ns_per_span\":%.3f,\"on_ns_per_span\":%.1f}\n", off, on);
  return 0;
}
