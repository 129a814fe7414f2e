#include "dist/explain.h"

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
    : pg_(pg), start_count_(pg.count(Collective::AllReduce)), start_us_(trace::now_us()) {
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
  out << "explain: " << what << ": counters over these steps: all_reduce " << calls << " calls, " << bytes << " bytes\n";
  return out.str();
}

}  // namespace nanoddp::dist
