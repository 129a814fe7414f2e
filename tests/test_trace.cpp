// Seeing DDP run: the merged trace of a 2-rank fashion_mnist run (per rank and step: the
// backward nodes, one all-reduce per bucket with its bytes, the optimizer step), overlap on and
// off as the trace shows it, --explain's counts against the counters and the trace, and
// NANODDP_TRACE on a program that has no --trace flag; the recorder's storage itself.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>

#include "core/replace_file.h"
#include "core/trace.h"
#include "tests/small_fashion_mnist.h"
#include "tests/subprocess.h"

using namespace nanoddp;
using namespace nanoddp::testing;
using nlohmann::json;

namespace {

// The names in folder, sorted and joined with ", ".
std::string entries_of(const std::string& folder) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(folder)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  std::string joined;
  for (const std::string& name : names) joined += (joined.empty() ? "" : ", ") + name;
  return joined;
}

// The model of these runs is fashion_mnist's default MLP, 784-256-128-10, with bucket caps that
// give one bucket per layer (reverse order, Note [Bucket order]):
//   bucket 0: 4.bias [10] + 4.weight [10, 128]    =     40 +   5120 =   5160 bytes >= 0.004 MiB
//   bucket 1: 2.bias [128] + 2.weight [128, 256]  =    512 + 131072 = 131584 bytes >= 0.1 MiB
//   bucket 2: 0.bias [256] + 0.weight [256, 784]  =   1024 + 802816 = 803840 bytes (the rest)
// From step 1 on, the plan rebuilt from the order gradients became ready (Note [Bucket
// rebuild]: a layer's weight before its bias), under the same caps:
//   bucket 0: 4.weight                            =   5120 bytes >= 0.004 MiB
//   bucket 1: 4.bias + 2.weight                   =     40 + 131072 = 131112 bytes >= 0.1 MiB
//   bucket 2: 2.bias + 0.weight                   =    512 + 802816 = 803328 bytes >= 0.1 MiB
//   bucket 3: 0.bias                              =   1024 bytes (the rest)
const std::vector<int64_t> kBucketBytes = {5160, 131584, 803840};
const std::vector<int64_t> kRebuiltBucketBytes = {5120, 131112, 803328, 1024};
constexpr int64_t kStepsPerRank = 10;  // 640 images / 2 ranks / batch 32

struct Event {
  int rank = 0, lane = 0;
  std::string name;
  double begin = 0, end = 0;
  json args;
};

std::vector<Event> read_trace(const std::string& path) {
  const std::string text = read_file(path);
  REQUIRE_MESSAGE(!text.empty(), "no trace at ", path);
  const json trace = json::parse(text);
  std::vector<Event> events;
  for (const json& e : trace.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    events.push_back({e.at("pid").get<int>(), e.at("tid").get<int>(), e.at("name").get<std::string>(),
                      e.at("ts").get<double>(), e.at("ts").get<double>() + e.at("dur").get<double>(), e.at("args")});
  }
  std::sort(events.begin(), events.end(), [](const Event& a, const Event& b) { return a.begin < b.begin; });
  return events;
}

bool ends_with(const std::string& text, const std::string& tail) {
  return text.size() >= tail.size() && text.compare(text.size() - tail.size(), tail.size(), tail) == 0;
}

constexpr int kAllReduceLane = 10;  // core/trace.h: kAllReduceLane + bucket index

// One rank's events split into steps: step k is everything after step k-1's optimizer.step
// and up to the end of step k's optimizer.step.
std::vector<std::vector<Event>> steps_of(const std::vector<Event>& events, int rank) {
  std::vector<std::vector<Event>> steps(1);
  for (const Event& e : events) {
    if (e.rank != rank) continue;
    steps.back().push_back(e);
    if (e.name == "optimizer.step") steps.emplace_back();
  }
  steps.pop_back();  // after the last step: evaluation, not a step
  return steps;
}

struct FashionRun {
  TempDir dir;
  std::string program = built("examples/fashion_mnist");
  FashionRun() { write_small_fashion_mnist(dir.path, 640, 200); }

  // Three buckets (see kBucketBytes) unless one_bucket: the default caps, one bucket of all.
  RunResult run_2_ranks(std::vector<std::string> extra, bool one_bucket = false,
                        const std::string& backend = "gloo") const {
    std::vector<std::string> args = {launcher_path(), "--nproc-per-node", "2", "--backend", backend, program,
                                     "--data-dir", dir.path, "--batch-size", "32", "--epochs", "1", "--quiet"};
    if (!one_bucket) {
      for (const char* flag : {"--first-bucket-cap-mb", "0.004", "--bucket-cap-mb", "0.1"}) args.push_back(flag);
    }
    args.insert(args.end(), extra.begin(), extra.end());
    RunResult r = run(args, 120s);
    REQUIRE_MESSAGE(r.code() == 0, r.err);
    return r;
  }
};

// The JSON line's "key":number.
double json_field(const std::string& out, const std::string& key) {
  std::smatch match;
  REQUIRE_MESSAGE(std::regex_search(out, match, std::regex("\"" + key + "\":(-?[0-9.eE+-]+)")), "no ", key, " in ", out);
  return std::stod(match[1].str());
}

// --explain's "exposed ... (P% of communication not hidden by compute)".
double exposed_percent(const std::string& out) {
  std::smatch exposed;
  REQUIRE_MESSAGE(std::regex_search(out, exposed, std::regex("exposed [0-9.]+ ms \\(([0-9.]+)% of communication")),
                  out);
  return std::stod(exposed[1].str());
}

// A rank's all-reduce events, and how many of them start before the last backward node of
// their step ends (overlap).
struct AllReduceCount {
  int all = 0, early = 0;
};
AllReduceCount all_reduces_of(const std::vector<Event>& events, int rank) {
  AllReduceCount count;
  for (const auto& step : steps_of(events, rank)) {
    double last_node_end = 0;
    for (const Event& e : step)
      if (e.lane == 2 && ends_with(e.name, "Backward")) last_node_end = std::max(last_node_end, e.end);
    REQUIRE(last_node_end > 0);
    for (const Event& e : step) {
      count.all += e.lane >= kAllReduceLane;
      count.early += e.lane >= kAllReduceLane && e.begin < last_node_end;
    }
  }
  return count;
}

}  // namespace

TEST_CASE("a 2-rank fashion_mnist trace shows, per rank and step, backward, one all-reduce per bucket, the step") {
  FashionRun fashion;
  const std::string path = fashion.dir.path + "/run.json";
  const RunResult traced = fashion.run_2_ranks({"--trace", path});
  CHECK(traced.err.find("trace of this node's ranks written to " + path) != std::string::npos);
  const std::vector<Event> events = read_trace(path);

  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    const auto steps = steps_of(events, rank);
    REQUIRE(steps.size() == kStepsPerRank);
    for (size_t k = 0; k < steps.size(); ++k) {
      CAPTURE(k);
      std::map<std::string, int> backward_nodes;
      std::map<int, std::vector<const Event*>> all_reduces;  // bucket -> events
      int optimizer_steps = 0, grads_ready = 0, batches = 0;
      for (const Event& e : steps[k]) {
        if (e.lane == 2 && ends_with(e.name, "Backward")) ++backward_nodes[e.name];
        if (e.lane >= kAllReduceLane) all_reduces[e.lane - kAllReduceLane].push_back(&e);
        if (e.lane == 3 && e.name.find(" ready -> bucket ") != std::string::npos) ++grads_ready;
        if (e.lane == 4 && e.name == "optimizer.step") ++optimizer_steps;
        if (e.lane == 1 && e.name == "next batch") ++batches;
      }
      // Linear -> ReLU -> Linear -> ReLU -> Linear -> DDP's output sink -> cross_entropy,
      // backwards.
      CHECK(backward_nodes == std::map<std::string, int>{{"CrossEntropyBackward", 1},
                                                         {"DDPSinkBackward", 1},
                                                         {"LinearBackward", 3},
                                                         {"ReluBackward", 2}});
      CHECK(grads_ready == 6);
      CHECK(optimizer_steps == 1);
      CHECK(batches == 1);
      const std::vector<int64_t>& bucket_bytes = k == 0 ? kBucketBytes : kRebuiltBucketBytes;
      REQUIRE(all_reduces.size() == bucket_bytes.size());
      for (size_t b = 0; b < bucket_bytes.size(); ++b) {
        CAPTURE(b);
        REQUIRE(all_reduces[static_cast<int>(b)].size() == 1);
        const json& args = all_reduces[static_cast<int>(b)][0]->args;
        CHECK(args.at("bytes").get<int64_t>() == bucket_bytes[b]);
        CHECK(args.at("backend") == "gloo");
        CHECK(args.at("algorithm") == "ring");
        CHECK(args.at("world_size") == 2);
      }
    }
  }

  // Clocks aligned: an all-reduce cannot finish on one rank before the other has launched it,
  // so the two ranks' spans of the same bucket and step overlap on the merged time line (up
  // to the alignment's error, half the best round trip through the store: well under 0.5 ms).
  constexpr double kAlignmentUs = 500;
  const auto steps0 = steps_of(events, 0), steps1 = steps_of(events, 1);
  for (size_t k = 0; k < steps0.size(); ++k) {
    for (const Event& a : steps0[k]) {
      if (a.lane < kAllReduceLane) continue;
      for (const Event& b : steps1[k]) {
        if (b.lane != a.lane) continue;
        CHECK_MESSAGE(a.begin <= b.end + kAlignmentUs, "step ", k, " ", a.name, ": rank 0 launched after rank 1 finished");
        CHECK_MESSAGE(b.begin <= a.end + kAlignmentUs, "step ", k, " ", a.name, ": rank 1 launched after rank 0 finished");
      }
    }
  }

  // Tracing reads shapes and clocks, never values: the run computes what an untraced run does.
  const RunResult plain = fashion.run_2_ranks({});
  CHECK(json_field(plain.out, "train_loss") == json_field(traced.out, "train_loss"));
  CHECK(json_field(plain.out, "test_accuracy") == json_field(traced.out, "test_accuracy"));
}

TEST_CASE("with overlap some all-reduce starts before backward's last node ends; with --no-overlap, or on shm, none does") {
  FashionRun fashion;
  for (const bool overlap : {true, false}) {
    CAPTURE(overlap);
    const std::string path = fashion.dir.path + (overlap ? "/overlap.json" : "/no_overlap.json");
    std::vector<std::string> extra = {"--trace", path};
    if (!overlap) extra.push_back("--no-overlap");
    fashion.run_2_ranks(extra);
    const std::vector<Event> events = read_trace(path);
    const int early_launches = all_reduces_of(events, 0).early + all_reduces_of(events, 1).early;
    if (overlap) {
      // Buckets 0 and 1 fill before the first layer's backward: 2 per step and rank.
      CHECK(early_launches == 2 * 2 * kStepsPerRank);
    } else {
      CHECK(early_launches == 0);
    }
  }
  // shm runs a collective on the thread that waits for it (Note [Shm progress]): buckets
  // launched during backward start only at DDP's wait after it, and --explain counts all of
  // their communication as exposed.
  const std::string path = fashion.dir.path + "/shm.json";
  const RunResult shm = fashion.run_2_ranks({"--trace", path, "--explain"}, /*one_bucket=*/false, "shm");
  CHECK(shm.out.find("explain: DDP bucket plan, 4 buckets (world size 2, shm;") != std::string::npos);
  CHECK(exposed_percent(shm.out) == 100.0);
  const AllReduceCount rank0 = all_reduces_of(read_trace(path), 0);
  CHECK(rank0.all == 3 + 4 * (kStepsPerRank - 1));
  CHECK(rank0.early == 0);
}

TEST_CASE("--explain prints the bucket plan and per-step counts that match the counters and the trace") {
  FashionRun fashion;
  const std::string path = fashion.dir.path + "/explain.json";
  const RunResult r = fashion.run_2_ranks({"--explain", "--trace", path});
  // The plan: three buckets, their bytes, parameters in reverse order, and why each closed.
  CHECK(r.out.find("explain: DDP bucket plan, 3 buckets (world size 2, gloo;") != std::string::npos);
  CHECK(r.out.find("explain: bucket 0: 5160 bytes, 2 parameters: 4.bias [10], 4.weight [10, 128]; closed: reached "
                   "the first-bucket cap (4194 bytes)") != std::string::npos);
  CHECK(r.out.find("explain: bucket 1: 131584 bytes, 2 parameters: 2.bias [128], 2.weight [128, 256]; closed: "
                   "reached the bucket cap (104857 bytes)") != std::string::npos);
  CHECK(r.out.find("explain: bucket 2: 803840 bytes, 2 parameters: 0.bias [256], 0.weight [256, 784]; closed: "
                   "reached the bucket cap (104857 bytes)") != std::string::npos);
  // After the first step the plan is rebuilt from the ready order: four buckets.
  CHECK(r.out.find("explain: DDP bucket plan, 4 buckets (world size 2, gloo; first bucket cap 4194 bytes, bucket cap "
                   "104857 bytes; rebuilt from the order gradients became ready on rank 0)") != std::string::npos);
  CHECK(r.out.find("explain: bucket 0: 5120 bytes, 1 parameter: 4.weight [10, 128]; closed: reached the "
                   "first-bucket cap (4194 bytes)") != std::string::npos);
  // Per step: one all-reduce per bucket (3 in step 1, then 4), the buckets' bytes; on 2 ranks
  // a ring sends 2(N-1)/N * S = S bytes per rank.
  CHECK(r.out.find("explain: epoch 1: 10 steps; per step: 3.90 all_reduce calls, 940584 bytes reduced, 940584 bytes sent per "
                   "rank (ring formula 2(N-1)/N * S with N = 2)") != std::string::npos);
  // The counters' totals, and the trace holds as many all-reduce events for rank 0.
  CHECK(r.out.find("explain: epoch 1: counters over these steps: all_reduce 39 calls, 9405840 bytes") !=
        std::string::npos);
  int traced_all_reduces = 0;
  for (const Event& e : read_trace(path)) traced_all_reduces += e.rank == 0 && e.lane >= kAllReduceLane;
  CHECK(traced_all_reduces == 39);
  // Buckets 0 and 1 are in flight while the first layer's backward runs: some communication
  // is hidden. One bucket is complete only when backward's last node is done: none is.
  CHECK(exposed_percent(r.out) < 100.0);
  const RunResult one = fashion.run_2_ranks({"--explain"}, /*one_bucket=*/true);
  CHECK(one.out.find("explain: DDP bucket plan, 1 bucket (world size 2, gloo;") != std::string::npos);
  CHECK(one.out.find("explain: epoch 1: 10 steps; per step: 1.00 all_reduce calls, 940584 bytes reduced") !=
        std::string::npos);
  CHECK(one.out.find("explain: DDP bucket plan, 1 bucket (world size 2, gloo; first bucket cap 1048576 bytes, bucket "
                     "cap 26214400 bytes; rebuilt from the order gradients became ready on rank 0)") !=
        std::string::npos);
  CHECK(exposed_percent(one.out) == 100.0);
  // ZeRO-1's broadcasts are counted too: its 6 parameters each step, and DDP's new bucket
  // order once (48 bytes, 6 int64) in the first epoch. Its memory row is exact: rank 0 owns
  // the first weight (200,704 of the 235,146 parameters), whose momentum is 802,816 bytes.
  const RunResult zero = fashion.run_2_ranks({"--explain", "--strategy", "zero1"}, /*one_bucket=*/true);
  CHECK_MESSAGE(zero.out.find("explain: epoch 1: per step: broadcast 6.10 calls of 940589 bytes (ZeRO-1: each parameter "
                              "from the rank that owns it") != std::string::npos,
                zero.out);
  CHECK_MESSAGE(zero.out.find("zero1       940584      940584     802816        940584     3624568   <- this run") !=
                    std::string::npos,
                zero.out);
  CHECK(zero.out.find("peak model state 3624568 bytes") != std::string::npos);
  // The naive rung all-reduces each .grad in place: its own row, no communication buffer, and
  // the measured peak agrees (docs/ladder.md's table).
  const RunResult naive = fashion.run_2_ranks({"--explain", "--dp", "naive"}, /*one_bucket=*/true);
  CHECK_MESSAGE(naive.out.find("naive       940584      940584     940584             0     2821752   <- this run") !=
                    std::string::npos,
                naive.out);
  CHECK(naive.out.find("peak model state 2821752 bytes") != std::string::npos);
}

TEST_CASE("--explain on the CNN with a 0.25 MiB first bucket: the Linear layers' bucket is reduced during the convolutions' backward") {
  FashionRun fashion;
  fashion.program = built("examples/fashion_mnist_cnn");
  const RunResult r = fashion.run_2_ranks({"--explain", "--first-bucket-cap-mb", "0.25"}, /*one_bucket=*/true);
  // docs/ddp/06-overlap.md shows this plan.
  CHECK(r.out.find("explain: bucket 0: 824872 bytes, 4 parameters: 11.bias [10], 11.weight [10, 128], 8.bias [128], "
                   "8.weight [128, 1600]; closed: reached the first-bucket cap (262144 bytes)") != std::string::npos);
  CHECK(r.out.find("explain: bucket 1: 75264 bytes, 4 parameters: 4.bias [64], 4.weight [64, 32, 3, 3], 1.bias [32], "
                   "1.weight [32, 1, 3, 3]; closed: no parameters left") != std::string::npos);
  CHECK(r.out.find("explain: epoch 1: 10 steps; per step: 2.00 all_reduce calls, 900136 bytes reduced") !=
        std::string::npos);
  CHECK(exposed_percent(r.out) < 100.0);
}

TEST_CASE("NANODDP_TRACE traces a program without a --trace flag; world size 1 writes the named file") {
  TempDir dir;
  const std::string path = dir.path + "/toy.json";
  const RunResult r = run({"/usr/bin/env", "NANODDP_TRACE=" + path, built("examples/toy_ddp"), "--epochs", "2"});
  REQUIRE_MESSAGE(r.code() == 0, r.err);
  int steps = 0, backward_nodes = 0, all_reduces = 0;
  for (const Event& e : read_trace(path)) {
    steps += e.name == "optimizer.step";
    backward_nodes += e.lane == 2 && e.name == "LinearBackward";
    all_reduces += e.lane >= kAllReduceLane;
  }
  CHECK(steps == 2 * 13);  // 100 pairs in batches of 8: 13 per epoch
  CHECK(backward_nodes == 2 * 13);
  CHECK(all_reduces == 0);  // one rank: the gradient is already the mean

  // A trace path that is a folder is refused before any training, and nothing is left behind.
  const RunResult folder = run({built("examples/toy_ddp"), "--epochs", "2", "--trace", dir.path});
  CHECK(folder.code() != 0);
  CHECK_MESSAGE(folder.err.find("trace file " + dir.path + " exists but is a folder") != std::string::npos, folder.err);
  CHECK(folder.out.find("epoch") == std::string::npos);
  CHECK(read_file(dir.path + ".tmp").empty());

  // A device is named as one (/dev/null would be replaced by the rename, not written into).
  const RunResult device = run({built("examples/toy_ddp"), "--epochs", "2", "--trace", "/dev/null"});
  CHECK(device.code() != 0);
  CHECK_MESSAGE(device.err.find("trace file /dev/null exists but is not a regular file (a device, pipe or socket)") !=
                    std::string::npos,
                device.err);
  CHECK(device.out.find("epoch") == std::string::npos);
  // A missing folder is named.
  const RunResult missing = run({built("examples/toy_ddp"), "--epochs", "2", "--trace", dir.path + "/no/run.json"});
  CHECK(missing.code() != 0);
  CHECK_MESSAGE(missing.err.find("folder " + dir.path + "/no does not exist") != std::string::npos, missing.err);
}

TEST_CASE("a trace replaces only a trace: another file at its path stops the run before training, untouched") {
  TempDir dir;
  const std::string notes = dir.path + "/notes.txt", trace = dir.path + "/run.json";
  {
    std::ofstream out(notes);
    out << "my precious notes\n";
  }
  for (const std::vector<std::string>& launch :
       {std::vector<std::string>{built("examples/toy_ddp"), "--epochs", "1", "--trace", notes},
        std::vector<std::string>{launcher_path(), "--nproc-per-node", "2", built("examples/toy_ddp"), "--epochs", "1",
                                 "--trace", notes}}) {
    const RunResult r = run(launch);
    CHECK(r.code() == 1);
    CHECK_MESSAGE(r.err.find("refusing to replace " + notes + ": it is not a trace (it begins \"my precious notes\")") !=
                      std::string::npos,
                  r.err);
    CHECK(r.out.find("epoch") == std::string::npos);
    CHECK(read_file(notes) == "my precious notes\n");
  }
  // The same file named by NANODDP_TRACE: one process stops before training (exit 1); the
  // launcher says it once and starts no rank.
  for (const std::vector<std::string>& launch :
       {std::vector<std::string>{"/usr/bin/env", "NANODDP_TRACE=" + notes, built("examples/toy_ddp"), "--epochs", "1"},
        std::vector<std::string>{"/usr/bin/env", "NANODDP_TRACE=" + notes, launcher_path(), "--nproc-per-node", "2",
                                 built("examples/toy_ddp"), "--epochs", "1"}}) {
    const RunResult r = run(launch);
    CHECK(r.code() == 1);
    CHECK_MESSAGE(r.err.find("NANODDP_TRACE: the trace file " + notes + ": refusing to replace " + notes) !=
                      std::string::npos,
                  r.err);
    const bool stopped = r.err.find("NANODDP_TRACE=" + notes + " was refused") != std::string::npos ||
                         r.err.find("nanoddp-run: NANODDP_TRACE is refused (above); no rank was started") !=
                             std::string::npos;
    CHECK_MESSAGE(stopped, r.err);
    CHECK_MESSAGE(r.err.find("[rank ") == std::string::npos, r.err);  // no rank started under the launcher
    CHECK(r.out.find("epoch") == std::string::npos);
    CHECK(read_file(notes) == "my precious notes\n");
  }
  // A program's own --trace overrides the refused variable: it trains and writes that trace.
  {
    const RunResult r =
        run({"/usr/bin/env", "NANODDP_TRACE=" + notes, built("examples/toy_ddp"), "--epochs", "1", "--trace", trace});
    CHECK_MESSAGE(r.code() == 0, r.err);
    CHECK(!read_trace(trace).empty());
    CHECK(read_file(notes) == "my precious notes\n");
  }
  // Our own traces, of one rank and merged by the launcher, are replaced as before.
  for (int twice = 0; twice < 2; ++twice) {
    RunResult r = run({built("examples/toy_ddp"), "--epochs", "1", "--trace", trace});
    CHECK_MESSAGE(r.code() == 0, r.err);
    r = run({launcher_path(), "--nproc-per-node", "2", built("examples/toy_ddp"), "--epochs", "1", "--trace", trace});
    CHECK_MESSAGE(r.code() == 0, r.err);
  }
  CHECK(!read_trace(trace).empty());
}

TEST_CASE("a trace that cannot be written at the end fails the run with exit 1, as a failed checkpoint does") {
  TempDir dir;
  const std::string path = dir.path + "/toy.json";
  // 8 blocks (4 KiB) of file: the trace (about 12 KB) is larger, the error messages are not
  // (the harness may keep stderr in a file). stdout goes to /dev/null, which has no limit.
  const RunResult r = run({"/bin/sh", "-c", "ulimit -f 8; exec \"$0\" --epochs 1 --trace \"$1\" >/dev/null",
                           built("examples/toy_ddp"), path});
  CHECK(r.code() == 1);
  CHECK_MESSAGE(r.err.find("toy_ddp: the trace file " + path + ": write failed at byte offset 4096 of ") !=
                    std::string::npos,
                r.err);
  // Said once: the write at exit does not try again.
  CHECK_MESSAGE(r.err.find("the trace was not written") == std::string::npos, r.err);
  CHECK_MESSAGE(r.err.find("write failed") == r.err.rfind("write failed"), r.err);
  CHECK(::access(path.c_str(), F_OK) != 0);
}

TEST_CASE("replace_file, which writes trace files: past ulimit -f, or when the writer throws, the old file stays and no "
          "temporary is left; a file at <path>.tmp is never touched, and a symlink at path is followed") {
  TempDir dir;
  const std::string path = dir.path + "/trace.json";
  replace_file(path, "the trace file", [](std::ostream& out) { out << "old"; });
  CHECK(read_file(path) == "old");
  const std::string message = io_error_past_file_size_limit(4096, [&] {
    replace_file(path, "the trace file", [](std::ostream& out) { out << std::string(65536, 'x'); });
  });
  CHECK_MESSAGE(message.find("the trace file " + path + ": write failed at byte offset 4096 of 65536 (into the temporary "
                             "file " + path + ".tmp.") == 0,
                message);
  CHECK_MESSAGE(message.find(", removed; " + path + " is as it was): File too large (the file size limit, ulimit -f, is "
                             "4096 bytes)") != std::string::npos,
                message);
  CHECK(read_file(path) == "old");
  CHECK(entries_of(dir.path) == "trace.json");  // no temporary left

  // The writer's own exception passes through, after the temporary file is removed.
  CHECK_THROWS_WITH_AS(replace_file(path, "the trace file",
                                    [](std::ostream& out) {
                                      out << "partial";
                                      throw ValueError("no more events");
                                    }),
                       "no more events", ValueError);
  CHECK(read_file(path) == "old");
  CHECK(entries_of(dir.path) == "trace.json");

  // Someone's file at <path>.tmp is not the writer's scratch space; a symlink at path is
  // followed (the file it names is replaced, the link stays), as for checkpoints.
  {
    std::ofstream(path + ".tmp") << "my notes";
  }
  replace_file(path, "the trace file", [](std::ostream& out) { out << "new"; });
  CHECK(read_file(path) == "new");
  CHECK(read_file(path + ".tmp") == "my notes");
  const std::string real = dir.path + "/real.json", link = dir.path + "/link.json";
  std::ofstream(real) << "old";
  REQUIRE(::symlink(real.c_str(), link.c_str()) == 0);
  replace_file(link, "the trace file", [](std::ostream& out) { out << "through the link"; });
  CHECK(read_file(real) == "through the link");
  struct stat info {};
  CHECK((::lstat(link.c_str(), &info) == 0 && S_ISLNK(info.st_mode)));

  // A path in a folder that does not exist: an IOError that names it.
  const std::string missing = dir.path + "/missing/trace.json";
  std::string error;
  try {
    replace_file(missing, "the trace file", [](std::ostream&) {});
  } catch (const IOError& e) {
    error = e.what();
  }
  CHECK_MESSAGE(error.find("the trace file " + missing + ": folder " + dir.path + "/missing does not exist") == 0, error);
}

TEST_CASE("the recorder gives back every event exactly, across its record and text blocks") {
  // Note [Trace storage]: 4096 records and 1 MiB of text per block; these 10,000 events fill
  // three record blocks, and their text (one string larger than a whole block) several text
  // blocks.
  trace::start("");  // in memory only
  const double t0 = trace::now_us();
  std::vector<std::string> names, args;
  for (int i = 0; i < 10000; ++i) {
    names.push_back("event " + std::to_string(i) + std::string(static_cast<size_t>(i % 7), 'x'));
    args.push_back(i == 5000 ? "\"big\":\"" + std::string(3 << 20, 'b') + "\""
                             : "\"i\":" + std::to_string(i) + (i % 3 ? "" : ",\"shapes\":\"[64, 784]\""));
    trace::complete(i % 5, names.back(), t0 + i, t0 + i + 0.5, args.back());
  }
  trace::complete(trace::Lane::Data, "", t0 + 20000, t0 + 20000);  // empty name and args
  const std::vector<trace::Event> events = trace::events_since(t0);
  trace::stop();
  REQUIRE(events.size() == 10001);
  for (size_t i = 0; i < names.size(); ++i) {
    CAPTURE(i);
    REQUIRE(events[i].name == names[i]);
    REQUIRE(events[i].args_json == args[i]);
    REQUIRE(events[i].lane == static_cast<int>(i % 5));
    REQUIRE(events[i].begin_us == t0 + static_cast<double>(i));
    REQUIRE(events[i].end_us == t0 + static_cast<double>(i) + 0.5);
  }
  CHECK(events.back().name.empty());
  CHECK(events.back().args_json.empty());
  CHECK(trace::events_since(t0).empty());  // stop() forgot them
}
