// All-reduce bandwidth in the nccl-tests form: one row per message size, the time of one
// in-place float32 sum all-reduce, its algorithm bandwidth and its bus bandwidth.
//
//   allreduce_bench --nproc 2 --backend shm           # forks 2 ranks on this host (nccl: rank r on cuda:r)
//   allreduce_bench --nproc 2 --backend shm --ring    # dist::ring_all_reduce on send/recv
//   mpirun -np 2 allreduce_bench                       # MPI (auto under mpirun)
//   nanoddp-run --nproc-per-node 8 allreduce_bench --backend nccl   # GPU = LOCAL_RANK
//
// It needs 2 or more ranks: run alone (a world of one) it says how to start them and exits 2.
// algbw = bytes / time. busbw = algbw * 2(n-1)/n: a ring all-reduce moves 2(n-1)/n of the
// buffer through every rank's link, so busbw is comparable across world sizes and with the
// link's peak (nccl-tests, doc/PERFORMANCE.md). time is the mean over iterations of the
// slowest rank (a max all-reduce of the per-rank means).
//
// Below the table, a fit time = alpha + beta * bytes: alpha is the fixed cost of one
// all-reduce (latency: hand-offs, wake-ups), 1/beta the bandwidth a large one reaches. It is
// a least-squares fit of relative errors (each size weighs the same, so the small sizes set
// alpha and the large ones beta).
//
// With NANODDP_TRACE=run.json (nanoddp-run merges its ranks' into run.json) each all-reduce,
// warm-up included, is a span "all_reduce <bytes> B" on the first all-reduce lane, with its bytes,
// backend and algorithm: recording adds two clock reads, the span's text and an append to
// each call's time.
// With --nproc, rank r writes run.rank<r>.json (dist::spawn).
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "core/trace.h"
#include "dist/init.h"
#include "dist/launch.h"
#include "dist/ring.h"
#include "dist/spawn.h"
#include "tools/cli_checks.h"

#if NANODDP_WITH_MPI
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#endif

#include "kernels/device_memory.h"

using namespace nanoddp;
using Clock = std::chrono::steady_clock;

namespace {

// Largest message: count = bytes / 4 must fit MPI's int count.
constexpr int64_t kMaxMessageBytes = int64_t{1} << 32;

// A job that cannot give a meaningful table (one rank: nothing crosses a link); exits 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Config {
  std::string backend = "auto";
  int nproc = 0;  // > 0: fork this many ranks here, no launcher needed
  int64_t min_bytes = 4 << 10;
  int64_t max_bytes = 64 << 20;
  int warmup = 3;
  double seconds_per_size = 0.25;  // iterations per size: about this much time, 5..1000
  bool compare_blocking_mpi = false;
  bool csv = false;  // one CSV row per size instead of the table (tools/plot allreduce reads it)
  bool check_collectives = false;  // the table is the backend's own bandwidth unless asked
  bool ring = false;  // time dist::ring_all_reduce (send/recv) instead of pg.all_reduce
  bool collective_buffer = false;  // all-reduce a ProcessGroup::new_collective_buffer, as DDP's buckets
};

// alpha, beta of time = alpha + beta * bytes, minimising sum ((alpha + beta b - t) / t)^2.
std::pair<double, double> fit_alpha_beta(const std::vector<double>& bytes,
                                         const std::vector<double>& seconds) {
  double s00 = 0, s01 = 0, s11 = 0, r0 = 0, r1 = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    const double w = 1.0 / (seconds[i] * seconds[i]);
    s00 += w;
    s01 += w * bytes[i];
    s11 += w * bytes[i] * bytes[i];
    r0 += w * seconds[i];
    r1 += w * bytes[i] * seconds[i];
  }
  const double det = s00 * s11 - s01 * s01;
  if (bytes.size() < 2 || det == 0) return {seconds.empty() ? 0 : seconds[0], 0};
  return {(r0 * s11 - r1 * s01) / det, (s00 * r1 - s01 * r0) / det};
}

void synchronize(const Device& device) {
#if NANODDP_WITH_CUDA
  if (device.is_cuda()) kernels::cuda::synchronize();
#else
  (void)device;
#endif
}

// Mean seconds of one all-reduce on this rank.
double time_all_reduce(dist::ProcessGroup& pg, Tensor& t, int iters, int warmup, bool ring) {
  auto all_reduce = [&] {
    const double begin_us = trace::enabled() ? trace::now_us() : 0;
    if (ring)
      dist::ring_all_reduce(pg, t);
    else
      pg.all_reduce(t)->wait();
    if (trace::enabled())
      trace::complete(trace::kAllReduceLane, "all_reduce " + std::to_string(t.nbytes()) + " B", begin_us,
                      trace::now_us(),
                      "\"bytes\":" + std::to_string(t.nbytes()) + ",\"backend\":" + trace::json_string(pg.backend_name()) +
                          ",\"algorithm\":" +
                          trace::json_string(ring ? "ring_all_reduce" : pg.all_reduce_algorithm()) +
                          ",\"world_size\":" + std::to_string(pg.size()));
  };
  for (int i = 0; i < warmup; ++i) all_reduce();
  pg.barrier()->wait();
  auto start = Clock::now();
  for (int i = 0; i < iters; ++i) all_reduce();
  synchronize(t.device());
  return std::chrono::duration<double>(Clock::now() - start).count() / iters;
}

#if NANODDP_WITH_MPI
double time_blocking_mpi(Tensor& t, int iters, int warmup) {
  float* data = t.data<float>();
  int count = static_cast<int>(t.numel());
  for (int i = 0; i < warmup; ++i)
    MPI_Allreduce(MPI_IN_PLACE, data, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Barrier(MPI_COMM_WORLD);
  auto start = Clock::now();
  for (int i = 0; i < iters; ++i)
    MPI_Allreduce(MPI_IN_PLACE, data, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  return std::chrono::duration<double>(Clock::now() - start).count() / iters;
}
#endif

// The slowest rank's value, agreed by all.
double max_over_ranks(dist::ProcessGroup& pg, double seconds, Device device) {
  Tensor v = Tensor::from_vector(std::vector<float>{static_cast<float>(seconds)}).to(device);
  pg.all_reduce(v, dist::ReduceOp::Max)->wait();
  return v.to(Device::cpu()).item();
}

// A rank, forked by --nproc (dist::spawn) or started by a launcher: either way its rank, world
// size and LOCAL_RANK are in the environment, and auto picks what it picks for a one-node job.
void run_rank(const Config& c) {
  dist::InitOptions options;
  options.backend = dist::parse_backend(c.backend);
  if (options.backend == dist::Backend::Nccl) options.device = Device::cuda(dist::get_local_rank());
  options.check_collectives = c.check_collectives;
  auto pg = dist::init_process_group(options);
  // The group's device, not the flag's: under nanoddp-run --backend nccl the backend comes
  // from the launcher, and an NCCL group takes only tensors on its own GPU.
  const Device device = pg->device();
  const int n = pg->size();
  if (c.ring && device.is_cuda()) {
    dist::destroy_process_group();
    throw UsageError("--ring times dist::ring_all_reduce, which takes CPU tensors, but the " + pg->backend_name() +
                     " group works on " + device.str() + ": drop --ring, or use a CPU backend (shm, gloo, mpi)");
  }
  if (n < 2) {
    dist::destroy_process_group();
    // The hints keep the backend asked for: without it they would measure another one.
    const std::string flag = c.backend == "auto" ? "" : " --backend " + c.backend;
    const std::string start_ranks =
        options.backend == dist::Backend::Mpi
            ? "nanoddp-run --nproc-per-node 2 --backend mpi allreduce_bench --backend mpi, or mpirun -np 2 "
              "allreduce_bench --backend mpi (MPI starts its ranks itself: --nproc cannot)"
            : "allreduce_bench --nproc 2" + flag + " (forks them here), nanoddp-run --nproc-per-node 2 allreduce_bench" +
                  flag + (flag.empty() ? ", or mpirun -np 2 allreduce_bench" : "");
    throw UsageError("world size " + std::to_string(n) +
                     ": an all-reduce over one rank moves no data, so the table would be meaningless. Start 2 or "
                     "more ranks: " + start_ranks);
  }
  const bool print = pg->rank() == 0;
  bool blocking_mpi = false;
#if NANODDP_WITH_MPI
  blocking_mpi = c.compare_blocking_mpi && pg->backend_name() == "mpi";
#endif
  if (print && c.csv) {
    std::printf("backend,world_size,device,bytes,count,iters,time_us,algbw_gbps,busbw_gbps,algorithm%s\n",
                blocking_mpi ? ",mpi_allreduce_us" : "");
  } else if (print) {
    std::printf("# nanoddp %s: backend %s, %d ranks, float32 sum in place, device %s%s\n",
                c.ring ? "ring_all_reduce (send/recv)" : "all_reduce", pg->backend_name().c_str(), n,
                device.str().c_str(), c.collective_buffer ? ", on collective buffers" : "");
    std::printf("# algbw = size / time;  busbw = algbw * 2(n-1)/n = algbw * %.3f  (n = %d)\n",
                2.0 * (n - 1) / n, n);
    std::printf("# time: mean over iterations of the slowest rank\n");
    std::printf("%14s %12s %7s %12s %12s %12s%s\n", "size(B)", "count(el)", "iters", "time(us)",
                "algbw(GB/s)", "busbw(GB/s)", blocking_mpi ? "  MPI_Allreduce(us)" : "");
  }
  // The CSV's algorithm column, so that runs of one backend with and without --ring or
  // --collective-buffer stay apart when tools/plot draws them together.
  const std::string algorithm =
      std::string(c.ring ? "ring_all_reduce" : "all_reduce") + (c.collective_buffer ? "_collective_buffer" : "");
  std::vector<double> sizes, times;
  for (int64_t bytes = c.min_bytes; bytes <= c.max_bytes; bytes *= 2) {
    const int64_t count = bytes / 4;
    Tensor t = Tensor::ones({count}, DType::Float32, device);
    if (c.collective_buffer) t = pg->new_collective_buffer(count, DType::Float32, device).copy_(t);
    // Every rank must run the same number of iterations: agree on the estimate first.
    double estimate = max_over_ranks(*pg, time_all_reduce(*pg, t, 1, 1, c.ring), device);
    int iters = static_cast<int>(std::clamp(c.seconds_per_size / std::max(estimate, 1e-7), 5.0, 1000.0));
    double seconds = max_over_ranks(*pg, time_all_reduce(*pg, t, iters, c.warmup, c.ring), device);
    sizes.push_back(static_cast<double>(bytes));
    times.push_back(seconds);
    double algbw = static_cast<double>(bytes) / seconds / 1e9;
    double busbw = algbw * 2.0 * (n - 1) / n;
    std::string extra;
    double mpi_seconds_us = 0;
#if NANODDP_WITH_MPI
    if (blocking_mpi) {
      double mpi_seconds = max_over_ranks(*pg, time_blocking_mpi(t, iters, c.warmup), device);
      mpi_seconds_us = mpi_seconds * 1e6;
      char text[32];
      std::snprintf(text, sizeof(text), "  %18.1f", mpi_seconds * 1e6);
      extra = text;
    }
#endif
    if (print && c.csv) {
      std::printf("%s,%d,%s,%lld,%lld,%d,%.3f,%.9g,%.9g,%s%s\n", pg->backend_name().c_str(), n, device.str().c_str(),
                  static_cast<long long>(bytes), static_cast<long long>(count), iters, seconds * 1e6, algbw, busbw,
                  algorithm.c_str(), blocking_mpi ? ("," + std::to_string(mpi_seconds_us)).c_str() : "");
      std::fflush(stdout);
    } else if (print) {
      std::printf("%14lld %12lld %7d %12.1f %12.3f %12.3f%s\n", static_cast<long long>(bytes),
                  static_cast<long long>(count), iters, seconds * 1e6, algbw, busbw,
                  extra.c_str());
      std::fflush(stdout);
    }
  }
  if (print && !c.csv) {  // the CSV stays one row per size
    auto [alpha, beta] = fit_alpha_beta(sizes, times);
    if (sizes.size() < 2) {
      std::printf("# fit: needs two sizes or more (--min-bytes < --max-bytes)\n");
    } else if (alpha <= 0 || beta <= 0) {
      // Time that does not grow with size (or a negative fixed cost) is noise, not a link.
      std::printf("# fit: time = alpha + beta * bytes does not fit these times (alpha = %.1f us, beta = %.4f "
                  "us/KB); the machine was busy, or the sizes are too few or too close: rerun on an idle "
                  "machine over a wider range\n",
                  alpha * 1e6, beta * 1e6 * 1024);
    } else {
      std::printf("# fit: time = alpha + beta * bytes;  alpha = %.1f us, beta = %.4f us/KB "
                  "(1/beta = %.2f GB/s algbw)\n",
                  alpha * 1e6, beta * 1e6 * 1024, 1e-9 / beta);
    }
  }
  pg->barrier()->wait();
  dist::destroy_process_group();
}

// The GPUs this machine shows, counted by a child process: CUDA initialised in this one could
// not be used by the ranks forked after it.
int gpu_count_in_child() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(std::min(kernels::cuda::device_count(), 255));
  int status = 0;
  if (pid < 0 || ::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
  return WEXITSTATUS(status);
}

// --nproc forks the ranks here: refuses, before anything starts, the jobs it cannot make.
// Throws UsageError naming --nproc.
void check_forking(const Config& c) {
  const dist::LaunchEnv env = dist::read_launch_env();
  if (env.world_size > 0 || dist::launched_by_mpi())
    throw UsageError("--nproc " + std::to_string(c.nproc) + " forks ranks itself, but this process is already " +
                     (env.rank >= 0 ? "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size)
                                    : std::string("a rank")) +
                     " started by a launcher (RANK and WORLD_SIZE are set): drop --nproc, the launcher's ranks "
                     "make the job");
  const dist::Backend backend = dist::parse_backend(c.backend);
  if (backend == dist::Backend::Mpi)
    throw UsageError("--nproc forks ranks itself, but --backend mpi needs its ranks started by mpirun: mpirun -np " +
                     std::to_string(c.nproc) + " allreduce_bench --backend mpi (or nanoddp-run --nproc-per-node " +
                     std::to_string(c.nproc) + " --backend mpi allreduce_bench)");
  if (backend == dist::Backend::ShmGloo)
    throw UsageError("--nproc forks ranks itself, but --backend shm+gloo needs the node layout a launcher gives "
                     "(GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE): nanoddp-run --nproc-per-node " +
                     std::to_string(c.nproc) + " --backend shm+gloo allreduce_bench, or --backend shm with --nproc");
  if (backend == dist::Backend::Nccl) {
    const int gpus = gpu_count_in_child();
    if (gpus < c.nproc)
      throw UsageError("--nproc " + std::to_string(c.nproc) + " --backend nccl puts rank r on cuda:r and needs " +
                       std::to_string(c.nproc) + " GPUs (NCCL refuses two ranks on one GPU); this machine has " +
                       std::to_string(gpus));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"All-reduce bandwidth table (nccl-tests style) for the shm, gloo, mpi or nccl backend"};
  cli::set_option_defaults(app);
  app.add_option("--backend", c.backend,
                 "auto, shm, shm+gloo, gloo, mpi or nccl; nccl runs rank r on GPU LOCAL_RANK (nanoddp-run sets "
                 "it; --nproc: GPU r); mpi needs mpirun (or nanoddp-run --backend mpi), not --nproc")
      ->check(cli::backend());
  app.add_flag("--ring", c.ring,
               "time dist::ring_all_reduce, the textbook ring on the backend's send/recv (CPU tensors: shm, gloo "
               "or mpi, not nccl)");
  app.add_flag("--collective-buffer", c.collective_buffer,
               "all-reduce tensors made by ProcessGroup::new_collective_buffer, as DDP's buckets are (shm: the "
               "direct all-reduce, no copies through slots)");
  app.add_option("--nproc", c.nproc, "fork this many ranks on this host (2..64); 0: launched by "
                 "nanoddp-run/mpirun (which refuse --nproc)")
      ->check(cli::integer_where("0 or an integer between 2 and 64", "0 or 2..64", [](long long v) { return v == 0 || (v >= 2 && v <= 64); }))
      ->capture_default_str();
  const std::string message_size = "a positive multiple of 4 up to " + std::to_string(kMaxMessageBytes);
  auto is_message_size = [](long long v) { return v > 0 && v % 4 == 0 && v <= kMaxMessageBytes; };
  app.add_option("--min-bytes", c.min_bytes, "smallest message (bytes, multiple of 4)")
      ->check(cli::integer_where(message_size, "4..2^32, multiple of 4", is_message_size))
      ->capture_default_str();
  app.add_option("--max-bytes", c.max_bytes, "largest message (bytes, >= --min-bytes); sizes double")
      ->check(cli::integer_where(message_size, "4..2^32, multiple of 4", is_message_size))
      ->capture_default_str();
  app.add_option("--warmup", c.warmup, "untimed all-reduces per size")
      ->check(cli::integer_where("an integer between 0 and 1000000", "0..1000000", [](long long v) { return v >= 0 && v <= 1000000; }))
      ->capture_default_str();
  // number_in refuses what is not a number ('') or outside [0, 3600]; 0 is refused after parsing.
  app.add_option("--seconds-per-size", c.seconds_per_size, "about how long to time each size (seconds, in (0, 3600])")
      ->capture_default_str()
      ->check(cli::number_in(0, 3600).description("(0, 3600]"));
  app.add_flag("--compare-blocking-mpi", c.compare_blocking_mpi,
               "with the mpi backend, also time a blocking MPI_Allreduce on MPI_COMM_WORLD");
  app.add_flag("--csv", c.csv,
               "print CSV (backend,world_size,device,bytes,count,iters,time_us,algbw_gbps,busbw_gbps,algorithm) instead of the "
               "table; tools/plot allreduce draws it");
  app.add_flag("--check-collectives", c.check_collectives,
               "time each all-reduce with the check that all ranks call the same collective "
               "(dist/process_group_checked.cpp, on by default in programs); off: the backend alone");
  const Config defaults;
  if (auto code = cli::parse(app, argc, argv, "allreduce_bench")) return *code;
  if (c.min_bytes > c.max_bytes)
    return cli::usage_error("allreduce_bench", "--min-bytes " + std::to_string(c.min_bytes) +
                                                   " is larger than --max-bytes " + std::to_string(c.max_bytes) +
                                                   ": no size to time" +
                                                   (c.min_bytes == defaults.min_bytes
                                                        ? " (--min-bytes defaults to 4096: lower it too)"
                                                        : ""));
  if (c.ring && c.backend == "nccl")
    return cli::usage_error("allreduce_bench", "--ring times dist::ring_all_reduce, which takes CPU tensors; "
                                               "--backend nccl works on GPUs: drop one of the two");
  if (c.seconds_per_size <= 0) {  // number_in refused the rest outside (0, 3600]
    std::ostringstream given;
    given << c.seconds_per_size;
    return cli::usage_error("allreduce_bench",
                            "--seconds-per-size must be a number of seconds in (0, 3600], got " + given.str());
  }
  try {
    if (c.nproc == 0) {
      run_rank(c);
      return 0;
    }
    check_forking(c);
    // spawn gives the ranks a job identity of their own (the store admits only them) and
    // their environment, and stops the others as soon as one fails, naming it.
    dist::SpawnOptions spawn_options;
    // Each size is timed twice (the estimate, then about --seconds-per-size), with
    // MPI_Allreduce a third time: a slow job is not a hung one.
    int sizes = 0;
    for (int64_t bytes = c.min_bytes; bytes <= c.max_bytes; bytes *= 2) ++sizes;
    spawn_options.timeout = std::chrono::minutes(10) +
                            std::chrono::seconds(static_cast<int64_t>(std::ceil(3 * sizes * c.seconds_per_size)));
    spawn_options.prefix_output = false;  // rank 0 prints the table (or the CSV) alone
    dist::spawn([&](int) { run_rank(c); }, c.nproc, spawn_options);
  } catch (const UsageError& e) {
    return cli::usage_error("allreduce_bench", message_of(e));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_bench: %s\n", message_of(e).c_str());
    return 1;
  }
  return 0;
}
