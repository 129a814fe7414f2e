// The examples, run as a user runs them: toy_ddp under the launcher (shm, Gloo and MPI, and
// two "nodes" on this machine), the tutorial's divergence reported, and fashion_mnist's
// resume equal to an uninterrupted run (on a small Fashion-MNIST-shaped data set written
// here, so it does not need the package).
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <thread>

#include "core/random.h"
#include "data/idx.h"
#include "dist/launch.h"
#include "dist/process_group.h"
#include "examples/example_utils.h"
#include "kernels/kernels.h"
#include "nn/checkpoint.h"
#include "nn/safetensors.h"
#include "tests/small_fashion_mnist.h"
#include "tests/subprocess.h"

using namespace nanoddp;
using namespace nanoddp::testing;

namespace {

// The value of "key":number in a JSON line (our examples print flat objects of numbers).
double json_field(const std::string& line, const std::string& key) {
  const std::regex pattern("\"" + key + "\":(-?[0-9.eE+-]+)");
  std::smatch match;
  REQUIRE_MESSAGE(std::regex_search(line, match, pattern), "no \"", key, "\" in ", line);
  return std::stod(match[1].str());
}

// The JSON lines of a run's stdout, whatever prefix a launcher put before them.
std::vector<std::string> json_lines(const std::string& out) {
  std::vector<std::string> found;
  for (const std::string& line : lines_of(out)) {
    const size_t brace = line.find('{');
    if (brace != std::string::npos) found.push_back(line.substr(brace));
  }
  return found;
}

// The lines of a --metrics file, each one JSON object ("null" values kept as written).
std::vector<std::string> metrics_lines(const std::string& path) {
  std::vector<std::string> found;
  for (const std::string& line : lines_of(read_file(path))) {
    REQUIRE_MESSAGE(line.front() == '{', "not a JSON line: ", line);
    found.push_back(line);
  }
  return found;
}

// Parameters of toy_ddp runs: one (weight, bias) per JSON line.
std::vector<std::pair<double, double>> toy_results(const RunResult& r) {
  std::vector<std::pair<double, double>> results;
  for (const std::string& line : json_lines(r.out)) results.emplace_back(json_field(line, "weight"), json_field(line, "bias"));
  return results;
}

}  // namespace

TEST_CASE("median_of: the middle value, or the mean of the two middle ones") {
  CHECK(examples::median_of({4.0, 1.0, 3.0}) == 3.0);
  CHECK(examples::median_of({4.0, 1.0, 3.0, 2.0}) == 2.5);
  CHECK(examples::median_of({7.0}) == 7.0);
  CHECK(examples::median_of({5.0, 5.0, 1.0, 9.0, 5.0, 0.5}) == 5.0);
  CHECK(std::isnan(examples::median_of({})));
}

TEST_CASE("toy_ddp: 2 ranks end with equal parameters, equal to 1 rank with the global batch") {
  // Without shuffling, rank r of 2 takes the even or odd indices; its batch of 8 and the other
  // rank's make up exactly the single rank's batch of 16, step for step.
  const RunResult one = run({built("examples/toy_ddp"), "--batch-size", "16", "--init-weight", "0.5", "--init-bias", "0"});
  REQUIRE_MESSAGE(one.code() == 0, one.err);
  for (const char* backend : {"gloo", "mpi", "shm"}) {
    CAPTURE(backend);
    const RunResult two = run({launcher_path(), "--nproc-per-node", "2", "--backend", backend, built("examples/toy_ddp"),
                               "--init-weight", "0.5", "--init-bias", "0"},
                              60s);
    REQUIRE_MESSAGE(two.code() == 0, two.err);
    const auto ranks = toy_results(two), single = toy_results(one);
    REQUIRE(ranks.size() == 2);
    CHECK(ranks[0] == ranks[1]);  // bit for bit: every rank took the same steps
    CHECK(ranks[0].first == doctest::Approx(single[0].first).epsilon(1e-5));
    CHECK(ranks[0].second == doctest::Approx(single[0].second).epsilon(1e-5));
    CHECK(two.out.find("Rank 1, Epoch [5], Loss: ") != std::string::npos);
  }
}

TEST_CASE("toy_ddp refuses a --batch-size beyond a rank's share of the 100 pairs, as fashion_mnist does") {
  RunResult r = run({built("examples/toy_ddp"), "--batch-size", "101"});
  CHECK(r.code() == 2);
  CHECK_MESSAGE(r.err.find("--batch-size 101 is more than the 100 pairs of the data: give at most 100") !=
                    std::string::npos,
                r.err);
  CHECK(r.out.empty());  // refused before training
  r = run({launcher_path(), "--nproc-per-node", "2", built("examples/toy_ddp"), "--batch-size", "51"}, 60s);
  CHECK(r.code() == 2);
  CHECK_MESSAGE(r.err.find("--batch-size 51 is more than the 50 pairs each of 2 ranks gets (of 100): give at most 50") !=
                    std::string::npos,
                r.err);
  // The whole share is a batch: one step per epoch.
  r = run({built("examples/toy_ddp"), "--batch-size", "100"});
  CHECK_MESSAGE(r.err.empty(), r.err);
}

TEST_CASE("custom_layer takes --backend, --device and --timeout as the other examples do, and fits y = |x| on 2 ranks") {
  const RunResult r = run({launcher_path(), "--nproc-per-node", "2", built("examples/custom_layer"), "--backend", "gloo",
                           "--device", "cpu", "--timeout", "30", "--steps", "60"},
                          60s);
  REQUIRE_MESSAGE(r.code() == 0, r.out, r.err);
  CHECK(std::regex_search(r.out, std::regex("gradient check: max \\|analytic - numeric\\| = [0-9.]+e-(0[5-9]|[1-9][0-9])")));
  for (const std::string rank : {"0", "1"}) {
    CAPTURE(rank);
    std::smatch match;
    REQUIRE_MESSAGE(std::regex_search(r.out, match, std::regex("rank " + rank + ": loss after 60 steps ([0-9.]+)")), r.out);
    CHECK(std::stod(match[1].str()) < 0.05);  // an untrained output near 0 costs E[x^2] = 4/3 on [-2, 2]
  }
}

TEST_CASE("toy_ddp's defaults reach w = 2, b = 0 at world sizes 1 to 8, and its three checks pass") {
  for (int world = 1; world <= 8; ++world) {
    CAPTURE(world);
    const RunResult r = run({launcher_path(), "--nproc-per-node", std::to_string(world), "--backend", "gloo",
                             built("examples/toy_ddp")},
                            60s);
    REQUIRE_MESSAGE(r.code() == 0, r.out, r.err);
    const auto ranks = toy_results(r);
    REQUIRE(ranks.size() == static_cast<size_t>(world));
    for (const auto& [weight, bias] : ranks) {
      CHECK(std::abs(weight - 2.0) < 0.01);
      CHECK(std::abs(bias) < 0.01);
    }
    CHECK(r.out.find("check 1: every rank ends with the same parameters (all " + std::to_string(world) +
                     " equal, bit for bit): yes") != std::string::npos);
    CHECK(std::regex_search(r.out, std::regex("check 2: one process on the global batch of " +
                                              std::to_string(8 * world) + " .*: yes")));
    CHECK(std::regex_search(r.out, std::regex("check 3: the fit is y = 2x: .*: yes")));
  }
}

TEST_CASE("toy_ddp: two nodes on this machine (nanoddp-run --nnodes 2) train like 1 rank with the global batch") {
  // 2 launchers x 2 ranks, node identity from the launcher (GROUP_RANK): auto picks shm+gloo.
  // Rank r of 4 takes indices r, r+4, ...: the 4 batches of 8 make up the single rank's 32.
  const RunResult one = run({built("examples/toy_ddp"), "--batch-size", "32", "--init-weight", "0.5", "--init-bias", "0"});
  REQUIRE_MESSAGE(one.code() == 0, one.err);
  const int port = dist::pick_free_port("127.0.0.1");
  const std::string node = "\"$0\" --nnodes 2 --nproc-per-node 2 --master-port $1 --node-rank";
  const std::string job = "\"$2\" --init-weight 0.5 --init-bias 0";
  const RunResult four = run({"/bin/sh", "-c",
                              node + " 1 " + job + " & other=$!; " + node + " 0 " + job +
                                  "; mine=$?; wait $other; exit $((mine | $?))",
                              launcher_path(), std::to_string(port), built("examples/toy_ddp")},
                             90s);
  REQUIRE_MESSAGE(four.code() == 0, four.out, four.err);
  const auto ranks = toy_results(four), single = toy_results(one);
  REQUIRE(ranks.size() == 4);
  for (const auto& r : ranks) {
    CHECK(r == ranks[0]);
    CHECK(r.first == doctest::Approx(single[0].first).epsilon(1e-5));
    CHECK(r.second == doctest::Approx(single[0].second).epsilon(1e-5));
  }
}

TEST_CASE("toy_ddp refuses a starting weight or bias that is empty, not a number or past float32") {
  for (const char* flag : {"--init-weight", "--init-bias"}) {
    for (const char* value : {"", "nan", "inf", "-1e39", "0.5x"}) {
      const RunResult r = run({built("examples/toy_ddp"), flag, value}, 60s);
      CHECK(r.code() == 2);
      CHECK_MESSAGE(r.err.find(std::string(flag) +
                               ": must be a finite number between -3.40282e+38 and 3.40282e+38, got '" +
                               value + "'") != std::string::npos,
                    flag << " '" << value << "': " << r.err);
    }
  }
}

TEST_CASE("toy_ddp --raw stops with an error naming the epoch and step where the loss diverged") {
  const RunResult r = run({built("examples/toy_ddp"), "--raw"});
  CHECK(r.code() != 0);
  CHECK(std::regex_search(r.err, std::regex("loss became (inf|nan|-inf) at epoch [0-9]+, step [0-9]+ on rank 0")));
}

// Both builds of the job: the MLP, and the CNN whose Dropout masks must repeat after a resume.
// extra_flags pick another optimizer or schedule, whose state the checkpoint must carry.
void check_resume_equals_uninterrupted(const std::string& example, const std::vector<std::string>& extra_flags = {}) {
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 200);
  const std::string program = built("examples/" + example);
  std::vector<std::string> common = {"--data-dir", dir.path, "--batch-size", "32", "--quiet"};
  common.insert(common.end(), extra_flags.begin(), extra_flags.end());
  auto args = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = {launcher_path(), "--nproc-per-node", "2", "--backend", "gloo", program};
    all.insert(all.end(), common.begin(), common.end());
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  const std::string straight_ckpt = dir.path + "/straight.ckpt", resumed_ckpt = dir.path + "/resumed.ckpt";
  const RunResult straight = run(args({"--epochs", "3", "--checkpoint", straight_ckpt}), 120s);
  REQUIRE_MESSAGE(straight.code() == 0, straight.err);
  const RunResult first = run(args({"--epochs", "3", "--stop-after", "1", "--checkpoint", resumed_ckpt}), 120s);
  REQUIRE_MESSAGE(first.code() == 0, first.err);
  const RunResult rest = run(args({"--epochs", "3", "--checkpoint", resumed_ckpt, "--resume"}), 120s);
  REQUIRE_MESSAGE(rest.code() == 0, rest.err);

  const auto a = json_lines(straight.out), b = json_lines(rest.out);
  REQUIRE(a.size() == 1);
  REQUIRE(b.size() == 1);
  CHECK(a[0].find("\"example\":\"" + example + "\"") != std::string::npos);
  CHECK(json_field(a[0], "test_accuracy") == json_field(b[0], "test_accuracy"));
  CHECK(json_field(a[0], "train_loss") == json_field(b[0], "train_loss"));
  // The saved weights and momentum buffers are the same, bit for bit.
  const nn::StateDict x = nn::load_checkpoint(straight_ckpt), y = nn::load_checkpoint(resumed_ckpt);
  REQUIRE(x.size() == y.size());
  for (const auto& entry : x) {
    // Not a structured binding: CAPTURE's lambda cannot capture one (C++17, clang).
    const std::string& name = entry.first;
    const Tensor& tensor = entry.second;
    CAPTURE(name);
    REQUIRE(y.count(name) == 1);
    if (name == "job") continue;  // which job wrote it: every launch is its own
    if (tensor.dtype() == DType::Float32) {
      CHECK(tensor.to_vector() == y.at(name).to_vector());
    } else {
      CHECK(tensor.to_int_vector() == y.at(name).to_int_vector());
    }
  }
}

TEST_CASE("fashion_mnist: resuming from a checkpoint equals an uninterrupted run") {
  check_resume_equals_uninterrupted("fashion_mnist");
}

TEST_CASE("fashion_mnist --optimizer adamw --warmup-epochs 1: the resumed run equals an uninterrupted one") {
  // The checkpoint after epoch 1 holds AdamW's moments and step counts and both schedulers,
  // with the switch from warm-up to cosine at the resume point.
  check_resume_equals_uninterrupted("fashion_mnist", {"--optimizer", "adamw", "--warmup-epochs", "1", "--lr", "0.002"});
}

TEST_CASE(
    "fashion_mnist --precision fp16: the resumed run equals an uninterrupted one, loss scale included") {
  // The checkpoint holds the GradScaler's scale and growth tracker: a resumed run that began
  // again at 65536 skipped other steps than the uninterrupted one (Adam's moments then differ).
  check_resume_equals_uninterrupted("fashion_mnist",
                                    {"--precision", "fp16", "--optimizer", "adam", "--lr", "0.002"});
}

TEST_CASE("fashion_mnist --resume with another --schedule is refused, naming the checkpoint's") {
  // A cosine at its middle resumed as a constant would jump back to --lr; a constant resumed
  // as a cosine has no cosine state. Either way the error names the flag to give.
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 200);
  const std::string program = built("examples/fashion_mnist");
  for (const std::string saved : {"cosine", "constant"}) {
    const std::string other = saved == "cosine" ? "constant" : "cosine",
                      ckpt = dir.path + "/" + saved + ".ckpt";
    CAPTURE(saved);
    auto run_with = [&](const std::string& schedule, std::vector<std::string> extra) {
      std::vector<std::string> all = {program,      "--data-dir", dir.path,       "--batch-size",
                                      "64",         "--quiet",    "--epochs",     "2",
                                      "--schedule", schedule,     "--checkpoint", ckpt};
      all.insert(all.end(), extra.begin(), extra.end());
      return run(all, 120s);
    };
    const RunResult first = run_with(saved, {"--stop-after", "1"});
    REQUIRE_MESSAGE(first.code() == 0, first.err);
    const RunResult resumed = run_with(other, {"--resume"});
    CHECK(resumed.code() == 1);
    CHECK_MESSAGE(resumed.err.find("its run used --schedule " + saved + " and this one --schedule " + other +
                                   ": resume with --schedule " + saved) != std::string::npos,
                  resumed.err);
    CHECK(run_with(saved, {"--resume"}).code() == 0);
  }
}

TEST_CASE("fashion_mnist_cnn --batch-norm under fsdp and a ladder rung: the accuracy reported is the saved model's") {
  // Without DDP's broadcast_buffers each rank's running statistics follow its own batches; the
  // evaluation and the checkpoint then see different models unless rank 0's are given to all.
  TempDir dir;
  write_small_fashion_mnist(dir.path, 1280, 2000);
  for (const std::vector<std::string>& strategy : {std::vector<std::string>{"--strategy", "fsdp"},
                                                  std::vector<std::string>{"--dp", "naive"}}) {
    CAPTURE(strategy[1]);
    const std::string ckpt = dir.path + "/" + strategy[1] + ".ckpt";
    auto job = [&](std::vector<std::string> extra) {
      std::vector<std::string> all = {launcher_path(), "--nproc-per-node", "2", built("examples/fashion_mnist_cnn"),
                                      "--data-dir", dir.path, "--batch-size", "32", "--epochs", "1", "--quiet",
                                      "--batch-norm", "--checkpoint", ckpt};
      all.insert(all.end(), strategy.begin(), strategy.end());
      all.insert(all.end(), extra.begin(), extra.end());
      const RunResult r = run(all, 240s);
      REQUIRE_MESSAGE(r.code() == 0, r.err);
      return json_field(json_lines(r.out).at(0), "test_accuracy");
    };
    const double trained = job({});
    CHECK(job({"--resume"}) == trained);  // nothing left to train: the checkpoint evaluated again
  }
}

TEST_CASE("Evaluation over test shards of unequal batch counts: FSDP, ZeRO-2 and DDP's buffers stay in step") {
  // 2001 test images at world 2: rank 0 evaluates 1001 (two batches of 1000), rank 1 1000 (one);
  // with 1 image rank 1 has none. Under FSDP and ZeRO-2 a forward all-gathers, and DDP's first
  // forward after training broadcasts BatchNorm's buffers: rank 1 must forward as often as rank
  // 0. Every strategy then counts the same correct images as DDP without BatchNorm does.
  for (const int64_t n_test : {int64_t{2001}, int64_t{1}}) {
    CAPTURE(n_test);
    TempDir dir;
    write_small_fashion_mnist(dir.path, 256, n_test);
    auto accuracy = [&](const std::string& example, std::vector<std::string> flags) {
      CAPTURE(example);
      std::vector<std::string> all = {launcher_path(), "--nproc-per-node", "2", built("examples/" + example),
                                      "--data-dir", dir.path, "--batch-size", "32", "--epochs", "1", "--quiet"};
      all.insert(all.end(), flags.begin(), flags.end());
      const RunResult r = run(all, 120s);
      REQUIRE_MESSAGE(r.code() == 0, r.err);
      const double value = json_field(json_lines(r.out).at(0), "test_accuracy");
      const double correct = value * static_cast<double>(n_test);
      CHECK(std::abs(correct - std::round(correct)) < 1e-6);  // over all n_test images, each once
      return value;
    };
    const double ddp = accuracy("fashion_mnist", {"--strategy", "ddp"});
    CHECK(accuracy("fashion_mnist", {"--strategy", "fsdp"}) == ddp);
    CHECK(accuracy("fashion_mnist", {"--strategy", "zero2"}) == ddp);
    const double ddp_batch_norm = accuracy("fashion_mnist_cnn", {"--strategy", "ddp", "--batch-norm"});
    CHECK(accuracy("fashion_mnist_cnn", {"--strategy", "fsdp", "--batch-norm"}) == ddp_batch_norm);
  }
}

TEST_CASE("fashion_mnist: a run resumed with more --epochs follows this run's learning-rate schedule") {
  // A finished 1-epoch cosine run ends at lr 0; resumed for --epochs 2, its second epoch must
  // use the lr of an uninterrupted 2-epoch run, not go on from the saved 0.
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 200);
  const std::string program = built("examples/fashion_mnist"), ckpt = dir.path + "/run.ckpt";
  auto run_with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = {program, "--data-dir", dir.path, "--batch-size", "32", "--quiet"};
    all.insert(all.end(), extra.begin(), extra.end());
    const RunResult r = run(all, 120s);
    REQUIRE_MESSAGE(r.code() == 0, r.err);
  };
  run_with({"--epochs", "2", "--metrics", dir.path + "/straight.jsonl"});
  run_with({"--epochs", "1", "--checkpoint", ckpt});
  run_with({"--epochs", "2", "--checkpoint", ckpt, "--resume", "--metrics", dir.path + "/resumed.jsonl"});
  auto epoch_2_lrs = [](const std::vector<std::string>& lines) {
    std::vector<double> lrs;
    for (const std::string& line : lines)
      if (json_field(line, "epoch") == 2) lrs.push_back(json_field(line, "lr"));
    return lrs;
  };
  const std::vector<double> straight = epoch_2_lrs(metrics_lines(dir.path + "/straight.jsonl"));
  const std::vector<double> resumed = epoch_2_lrs(metrics_lines(dir.path + "/resumed.jsonl"));
  REQUIRE(straight.size() == 2);  // 20 steps per epoch: the update at step 40 and the epoch's line
  CHECK(resumed == straight);
  // Step 39 of 40 on the cosine: 0.05 * (1 + cos(pi * 39 / 40)) / 2.
  CHECK(straight[0] == doctest::Approx(0.05 * (1 + std::cos(M_PI * 39 / 40)) / 2).epsilon(1e-5));
}

TEST_CASE("fashion_mnist_cnn: resuming from a checkpoint equals an uninterrupted run") {
  check_resume_equals_uninterrupted("fashion_mnist_cnn");
}

namespace {

// One epoch of 10 steps on 2 ranks over Gloo (640 training images, 32 per rank per step)
// with --explain; returns stdout.
std::string explained_epoch(const std::string& example, const std::vector<std::string>& extra) {
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 200);
  std::vector<std::string> args = {launcher_path(), "--nproc-per-node", "2", "--backend", "gloo",
                                   built("examples/" + example), "--data-dir", dir.path, "--batch-size", "32",
                                   "--epochs", "1", "--quiet", "--explain"};
  args.insert(args.end(), extra.begin(), extra.end());
  const RunResult r = run(args, 120s);
  REQUIRE_MESSAGE(r.code() == 0, r.err);
  return r.out;
}

}  // namespace

TEST_CASE(
    "fashion_mnist --strategy fsdp --explain on Gloo: reduce_scatter's real traffic, an all_reduce of each "
    "unit") {
  // The default MLP's three units hold 235,146 parameters (940,584 bytes), so their shards at
  // W = 2 are 470,292 bytes: the ring's reduce_scatter sends one shard, Gloo's all_reduce of
  // the whole unit 2(N-1) of them.
  const std::string out = explained_epoch("fashion_mnist", {"--strategy", "fsdp"});
  CHECK_MESSAGE(out.find("reduce_scatter 3.00 calls of 470292 shard bytes; 1410876 bytes sent per rank") !=
                    std::string::npos,
                out);
  CHECK_MESSAGE(
      out.find("gloo runs reduce_scatter as an all_reduce of the whole unit (Note [Gloo new-style API]): "
               "about 940584 bytes sent per rank for it") != std::string::npos,
      out);
}

TEST_CASE("fashion_mnist --find-unused-parameters: one more all-reduce per step, of an int64 per parameter") {
  // The default MLP is one bucket of 940584 bytes; find_unused_parameters adds the used map,
  // 6 parameters x 8 bytes = 48 bytes, in every step (docs/ddp/04-hooks-and-buckets.md). Every
  // parameter is used, so the gradients, and the training, are the same.
  const std::string plain = explained_epoch("fashion_mnist", {});
  const std::string unused = explained_epoch("fashion_mnist", {"--find-unused-parameters"});
  CHECK(plain.find("explain: epoch 1: counters over these steps: all_reduce 10 calls, 9405840 bytes") !=
        std::string::npos);
  CHECK(unused.find("explain: epoch 1: counters over these steps: all_reduce 20 calls, 9406320 bytes") !=
        std::string::npos);
  const auto a = json_lines(plain), b = json_lines(unused);
  REQUIRE(a.size() == 1);
  REQUIRE(b.size() == 1);
  CHECK(json_field(a[0], "train_loss") == json_field(b[0], "train_loss"));
  CHECK(json_field(a[0], "test_accuracy") == json_field(b[0], "test_accuracy"));
}

TEST_CASE("fashion_mnist_cnn --sync-batch-norm: three all-reduces per BatchNorm layer per step, --batch-norm none") {
  // With a BatchNorm2d after each Conv2d the CNN is one bucket of 900904 bytes (225226
  // parameters). SyncBatchNorm adds, per layer and step, all-reduces of C + 1 and C floats in
  // forward and 2 C in backward (docs/batch-norm.md): for C = 32 and 64, 6 calls and
  // (129 + 257) x 4 = 1544 bytes.
  const std::string local = explained_epoch("fashion_mnist_cnn", {"--batch-norm"});
  const std::string synced = explained_epoch("fashion_mnist_cnn", {"--sync-batch-norm"});
  CHECK(local.find("explain: epoch 1: counters over these steps: all_reduce 10 calls, 9009040 bytes") !=
        std::string::npos);
  CHECK(synced.find("explain: epoch 1: counters over these steps: all_reduce 70 calls, 9024480 bytes") !=
        std::string::npos);
  for (const std::string& out : {local, synced}) {
    const auto lines = json_lines(out);
    REQUIRE(lines.size() == 1);
    CHECK(std::isfinite(json_field(lines[0], "train_loss")));
  }
}

TEST_CASE("--checkpoint-activations: the same training bit for bit on 2 ranks, fewer peak activation bytes") {
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 200);
  // One run's JSON line: 1 epoch on 2 ranks over `backend`, with `extra`.
  auto trained = [&](const std::string& example, const std::string& backend, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {launcher_path(), "--nproc-per-node", "2", "--backend", backend,
                                     built("examples/" + example), "--data-dir", dir.path, "--batch-size", "32",
                                     "--epochs", "1", "--quiet"};
    args.insert(args.end(), extra.begin(), extra.end());
    const RunResult r = run(args, 120s);
    REQUIRE_MESSAGE(r.code() == 0, r.err);
    const auto lines = json_lines(r.out);
    REQUIRE(lines.size() == 1);
    return lines[0];
  };
  // The same loss and accuracy, exactly, with --checkpoint-activations and without, in fewer
  // peak activation bytes where `fewer_bytes`; returns both lines.
  auto same_training = [&](const std::string& example, const std::string& backend, std::vector<std::string> flags,
                           bool fewer_bytes = true) {
    CAPTURE(example);
    const std::string plain = trained(example, backend, flags);
    flags.push_back("--checkpoint-activations");
    const std::string checkpointed = trained(example, backend, flags);
    CHECK(json_field(plain, "train_loss") == json_field(checkpointed, "train_loss"));
    CHECK(json_field(plain, "test_accuracy") == json_field(checkpointed, "test_accuracy"));
    if (fewer_bytes)
      CHECK(json_field(checkpointed, "peak_activation_bytes") < json_field(plain, "peak_activation_bytes"));
    return std::make_pair(plain, checkpointed);
  };
  for (const std::string example : {"fashion_mnist", "fashion_mnist_cnn"}) {
    // Dropout draws the same masks in the rerun.
    const auto lines = same_training(example, "gloo", {});
    CHECK(lines.first.find("\"checkpoint_activations\":false") != std::string::npos);
    CHECK(lines.second.find("\"checkpoint_activations\":true") != std::string::npos);
    MESSAGE(example, " peak activation bytes at batch 32: ", json_field(lines.first, "peak_activation_bytes"),
            " plain, ", json_field(lines.second, "peak_activation_bytes"), " checkpointed");
    // Under bf16 autocast too, where a block's input is the 16-bit output of the one before
    // (bytes not compared: the MLP's first block keeps its float32 images, where Linear alone
    // keeps their 16-bit copy, so its checkpointed peak is the higher, 193,280 against 144,384
    // at batch 32).
    same_training(example, "gloo", {"--precision", "bf16"}, /*fewer_bytes=*/false);
  }
  // A unit of FSDP or ZeRO-2 inside a block is gathered again by the rerun, SyncBatchNorm
  // all-reduces its statistics again: the same training all the same.
  same_training("fashion_mnist", "shm", {"--strategy", "fsdp"});
  same_training("fashion_mnist_cnn", "shm", {"--strategy", "zero2"});
  same_training("fashion_mnist_cnn", "shm", {"--sync-batch-norm"});
}

TEST_CASE("--precision bf16 and fp16 train and say so in the JSON line; a bad value is refused by name") {
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 200);
  const std::vector<std::pair<std::string, std::string>> runs = {
      {"fashion_mnist", "fp32"}, {"fashion_mnist", "bf16"}, {"fashion_mnist", "fp16"}, {"fashion_mnist_cnn", "bf16"}};
  for (const auto& [example, precision] : runs) {
    const std::string name = example + " " + precision;  // CAPTURE cannot name a structured binding (C++17)
    CAPTURE(name);
    const RunResult r = run({launcher_path(), "--nproc-per-node", "2", "--backend", "gloo",
                             built("examples/" + example), "--data-dir", dir.path, "--batch-size", "32", "--epochs", "1",
                             "--quiet", "--precision", precision},
                            120s);
    REQUIRE_MESSAGE(r.code() == 0, r.err);
    const auto lines = json_lines(r.out);
    REQUIRE(lines.size() == 1);
    CHECK(lines[0].find("\"precision\":\"" + precision + "\"") != std::string::npos);
    CHECK(std::isfinite(json_field(lines[0], "train_loss")));
    CHECK(json_field(lines[0], "peak_activation_bytes") > 0);
  }
  const RunResult bad = run({built("examples/fashion_mnist"), "--data-dir", dir.path, "--precision", "fp8"}, 60s);
  CHECK(bad.code() == 2);
  CHECK_MESSAGE(bad.err.find("--precision") != std::string::npos, bad.err);
  CHECK_MESSAGE(bad.err.find("fp8") != std::string::npos, bad.err);
  // fp16 with micro-batches: each micro-batch's backward is loss-scaled (accumulate_gradients' loss_scale).
  const RunResult accumulated = run({built("examples/fashion_mnist"), "--data-dir", dir.path, "--precision", "fp16",
                                     "--accumulate", "2", "--epochs", "1", "--quiet"},
                                    60s);
  REQUIRE_MESSAGE(accumulated.code() == 0, accumulated.err);
  const auto lines = json_lines(accumulated.out);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].find("\"precision\":\"fp16\"") != std::string::npos);
  CHECK(std::isfinite(json_field(lines[0], "train_loss")));
}

TEST_CASE("fashion_mnist: a missing data folder is a clear error, not a crash") {
  const RunResult r = run({built("examples/fashion_mnist"), "--data-dir", "/nonexistent/folder", "--epochs", "1"});
  CHECK(r.code() == 1);
  CHECK(r.err.find("/nonexistent/folder") != std::string::npos);
  CHECK(r.err.find("dataset-fashion-mnist") != std::string::npos);
}

TEST_CASE("fashion_mnist: bad runs stop with errors that say why") {
  TempDir dir;
  write_small_fashion_mnist(dir.path, 256, 64);
  const std::string program = built("examples/fashion_mnist");
  auto run_with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = {program, "--data-dir", dir.path, "--quiet"};
    all.insert(all.end(), extra.begin(), extra.end());
    return run(all, 60s);
  };
  RunResult r = run_with({"--lr", "1e6", "--epochs", "2"});
  CHECK(r.code() == 1);
  CHECK(std::regex_search(
      r.err, std::regex("loss became -?nan in epoch 1 by step [0-9]+; lower --lr or --momentum")));
  // Adam has no --momentum to lower.
  r = run_with({"--optimizer", "adam", "--lr", "1e30", "--epochs", "2"});
  CHECK(r.code() == 1);
  CHECK_MESSAGE(std::regex_search(
                    r.err, std::regex("loss became -?(nan|inf) in epoch 1 by step [0-9]+; lower --lr\n")),
                r.err);
  // Flags read into a float refuse what a float cannot hold, instead of running with inf.
  for (const char* flag : {"--momentum", "--weight-decay"}) {
    r = run_with({flag, "1e39"});
    CHECK(r.code() == 2);
    CHECK_MESSAGE(
        r.err.find(std::string(flag) + ": must be a finite number between 0 and 3.40282e+38, got '1e39'") !=
            std::string::npos,
        r.err);
  }
  r = run_with({"--resume"});
  CHECK(r.code() == 2);  // a usage error: argparse's status
  CHECK(r.err.find("--resume needs --checkpoint") != std::string::npos);
  r = run_with({"--checkpoint", dir.path + "/missing/folder/run.ckpt"});
  CHECK(r.code() == 1);
  CHECK_MESSAGE(r.err.find("folder " + dir.path + "/missing/folder does not exist") != std::string::npos, r.err);
  // A user is shown the problem, not the library's source location (message_of in core/error.h).
  CHECK_MESSAGE(r.err.find(".cpp:") == std::string::npos, r.err);
  const std::string ckpt = dir.path + "/run.ckpt";
  // --resume before any checkpoint exists (a first run, or a mistyped FILE) says so, then trains.
  r = run({program, "--data-dir", dir.path, "--epochs", "1", "--checkpoint", ckpt, "--resume"}, 60s);
  CHECK_MESSAGE(r.code() == 0, r.err);
  CHECK_MESSAGE(r.out.find("no checkpoint at " + ckpt + " yet: training starts at epoch 1\n") != std::string::npos,
                r.out);
  r = run_with({"--epochs", "2", "--checkpoint", ckpt});
  REQUIRE_MESSAGE(r.code() == 0, r.err);
  // The result line's accuracy (json_field stops the test if it is null).
  auto result_accuracy = [](const RunResult& result) {
    const auto lines = json_lines(result.out);
    REQUIRE(lines.size() == 1);
    return json_field(lines[0], "test_accuracy");
  };
  const double trained_accuracy = result_accuracy(r);
  r = run_with({"--epochs", "1", "--checkpoint", ckpt, "--resume"});
  CHECK(r.code() == 1);
  CHECK(r.err.find("cannot resume from checkpoint " + ckpt) != std::string::npos);
  CHECK(r.err.find("2 epochs done, more than --epochs 1") != std::string::npos);
  for (const char* hidden : {"64", "64,64,64"}) {  // one width other, one layer more: the model cannot take it
    r = run_with({"--epochs", "2", "--hidden", hidden, "--checkpoint", ckpt, "--resume"});
    CHECK(r.code() == 1);
    CHECK_MESSAGE(r.err.find("the checkpoint holds another model than this run builds: was it saved by the other "
                             "Fashion-MNIST example, or (fashion_mnist) with other --hidden sizes?") != std::string::npos,
                  r.err);
    CHECK_MESSAGE(r.err.find(".cpp:") == std::string::npos, r.err);  // nor the wrapped error's
  }
  r = run_with({"--optimizer", "rmsprop"});
  CHECK(r.code() == 2);
  CHECK(r.err.find("--optimizer") != std::string::npos);
  r = run_with({"--optimizer", "adam", "--momentum", "0.9"});
  CHECK(r.code() == 2);
  CHECK(r.err.find("--momentum applies to --optimizer sgd only") != std::string::npos);
  r = run_with({"--batch-size", "4", "--accumulate", "5"});
  CHECK(r.code() == 2);
  CHECK(r.err.find("--accumulate 5 is more micro-batches than --batch-size 4 has examples") != std::string::npos);
  r = run_with({"--epochs", "2", "--warmup-epochs", "2"});
  CHECK(r.code() == 2);
  CHECK(r.err.find("--warmup-epochs 2 leaves no epoch after the warm-up of --epochs 2") != std::string::npos);
  // --epochs is the whole run's length, resumed or not: a stop past it is refused either way.
  for (const std::vector<std::string>& flags : {std::vector<std::string>{"--epochs", "2", "--stop-after", "3"},
                                                {"--epochs", "2", "--stop-after", "3", "--checkpoint", ckpt, "--resume"}}) {
    r = run_with(flags);
    CHECK(r.code() == 2);
    CHECK_MESSAGE(r.err.find("--stop-after 3 is past --epochs 2") != std::string::npos, r.err);
    CHECK(r.out.empty());
  }
  // A stop at or before the checkpoint's epochs trains nothing, and says so.
  r = run_with({"--epochs", "3", "--stop-after", "1", "--checkpoint", ckpt, "--resume"});
  CHECK(r.code() == 0);
  CHECK_MESSAGE(r.err.find("fashion_mnist: nothing to train: the checkpoint has 2 epochs done, and this run ends "
                           "after epoch 1 (--stop-after)") != std::string::npos,
                r.err);
  // ... and its result line reports the resumed model, whose accuracy is the run's that saved it.
  CHECK(result_accuracy(r) == trained_accuracy);
  r = run_with({"--epochs", "1", "--optimizer", "adam", "--comm-hook", "bf16", "--gradient-as-bucket-view"});
  REQUIRE_MESSAGE(r.code() == 0, r.err);
  // The result line says how the run was made: two runs that differ in a flag are told apart.
  CHECK(r.out.find("\"optimizer\":\"adam\",\"comm_hook\":\"bf16\",\"gradient_as_bucket_view\":true,\"strategy\":\"ddp\","
                   "\"peak_model_state_bytes\":") != std::string::npos);
  r = run_with({"--batch-size", "0"});
  CHECK(r.code() == 2);
  CHECK(r.err.find("--batch-size: must be an integer >= 1, got '0'") != std::string::npos);
  r = run_with({"--batch-size", "257"});
  CHECK(r.code() == 2);
  CHECK_MESSAGE(r.err.find("--batch-size 257 is more than the 256 training images in " + dir.path + ": give at most 256") !=
                    std::string::npos,
                r.err);
  // Two ranks draw from 128 images each: 129 would be cut to 128 without a word.
  r = run({launcher_path(), "--nproc-per-node", "2", built("examples/fashion_mnist"), "--data-dir", dir.path,
           "--batch-size", "129", "--epochs", "1"},
          60s);
  CHECK(r.code() == 2);
  CHECK_MESSAGE(r.err.find("--batch-size 129 is more than the 128 training images each of 2 ranks gets (of 256 in " +
                           dir.path + "): give at most 128") != std::string::npos,
                r.err);
  // The checkpoint is SGD's (the default): another --optimizer is named, with the one to give.
  r = run_with({"--epochs", "3", "--optimizer", "adamw", "--checkpoint", ckpt, "--resume"});
  CHECK(r.code() == 1);
  CHECK_MESSAGE(r.err.find("cannot resume from checkpoint " + ckpt + ": its run used --optimizer sgd and this one "
                           "--optimizer adamw: resume with --optimizer sgd") != std::string::npos,
                r.err);
  // A run of args exits with code and says text on stderr.
  const auto says = [&](const std::vector<std::string>& args, int code, const std::string& text) {
    const RunResult result = run_with(args);
    CHECK_MESSAGE(result.code() == code, result.err);
    CHECK_MESSAGE(result.err.find(text) != std::string::npos, result.err);
  };
  // So is another --momentum or --weight-decay (torch's load_state_dict would restore the saved
  // ones over what the run asked for, without a word).
  says({"--epochs", "3", "--momentum", "0.5", "--checkpoint", ckpt, "--resume"}, 1,
       "its run used --momentum 0.9 and this one --momentum 0.5: resume with --momentum 0.9");
  says({"--epochs", "3", "--weight-decay", "0.01", "--checkpoint", ckpt, "--resume"}, 1,
       "its run used --weight-decay 0 and this one --weight-decay 0.01");
  // Another --lr with the checkpoint's schedule (same --epochs): the schedule goes on (a loaded
  // torch optimizer keeps its lr), and the run says, under --quiet too, that the flag is not used.
  says({"--epochs", "2", "--lr", "0.5", "--checkpoint", ckpt, "--resume"}, 0,
       "warning: --lr 0.5 is not used: the checkpoint's learning-rate schedule (from --lr 0.05) goes on");
  // A run that learns nothing (a finite loss no better than guessing) says so, and still ends.
  says({"--epochs", "1", "--lr", "3", "--batch-size", "8"}, 0,
       "is no better than guessing among the 10 classes (ln 10 = 2.3026): the run is not learning; try a lower --lr");
  // With --lr 0 a lower one is no advice.
  says({"--epochs", "1", "--lr", "0"}, 0, "the run is not learning; the learning rate is 0, so no step changes the weights");
  // With another --epochs the schedule is this run's, replayed, and so is its --lr: said too.
  says({"--epochs", "3", "--lr", "0.5", "--checkpoint", ckpt, "--resume"}, 0,
       "warning: --lr 0.5 is used, where the checkpoint's run had --lr 0.05: the learning-rate schedule is "
       "replayed over this run's steps");
  // A checkpoint from the middle of an epoch (the run killed at step 5 of 8, saved after step
  // 3) resumes only with the seed that ordered that epoch.
  const std::string mid = dir.path + "/mid.ckpt";
  r = run({"/usr/bin/env", "NANODDP_FAULT_KILL_AT=0:5", program, "--data-dir", dir.path, "--quiet",
           "--epochs", "1", "--batch-size", "32", "--checkpoint", mid, "--checkpoint-every", "3"},
          60s);
  CHECK(r.code() == 128 + SIGKILL);
  r = run_with({"--epochs", "1", "--batch-size", "32", "--checkpoint", mid, "--resume", "--seed", "7"});
  CHECK(r.code() == 1);
  CHECK_MESSAGE(
      r.err.find("it was saved during epoch 1, after step 3, by a run with --seed 0, whose data order that "
                 "epoch is not this run's (--seed 7): resume with --seed 0") != std::string::npos,
      r.err);
  r = run_with({"--epochs", "1", "--batch-size", "32", "--checkpoint", mid, "--resume"});
  CHECK_MESSAGE(r.code() == 0, r.err);
  // A fault that could never happen (a rank the job lacks, a step past its end) is refused:
  // a fault test would otherwise pass without its fault.
  for (const auto& fault_said : std::vector<std::pair<std::string, std::string>>{
           {"NANODDP_FAULT_KILL_AT=1:2",
            "NANODDP_FAULT_KILL_AT='1:2' names rank 1, but this run has ranks 0..0"},
           {"NANODDP_FAULT_STOP_AT=0:8",
            "NANODDP_FAULT_STOP_AT='0:8' names step 8, but this run has steps 0..7"}}) {
    // No structured binding: doctest's assertions are lambdas, which cannot capture one in C++17.
    const std::string& fault = fault_said.first;
    const std::string& said = fault_said.second;
    r = run({"/usr/bin/env", fault, program, "--data-dir", dir.path, "--quiet", "--epochs", "1",
             "--batch-size", "32"},
            60s);
    CHECK(r.code() == 1);
    CHECK_MESSAGE(r.err.find(said + ": the fault would never happen") != std::string::npos, r.err);
  }

  TempDir empty;
  write_small_fashion_mnist(empty.path, 0, 10);
  r = run({program, "--data-dir", empty.path, "--quiet"}, 60s);
  CHECK(r.code() == 1);
  CHECK(r.err.find("0 training and 10 test images") != std::string::npos);
}

TEST_CASE("examples and layer_bench: flags they cannot use are refused by name before anything runs") {
  const std::string mlp = built("examples/fashion_mnist"), cnn = built("examples/fashion_mnist_cnn");
  const std::string backends = "must be one of auto, shm, shm+gloo, gloo, mpi or nccl";
  std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      // The CNN's layers are fixed: --hidden would otherwise be taken and ignored.
      {{cnn, "--hidden", "5"},
       "fashion_mnist_cnn: --hidden sets the widths of fashion_mnist's MLP; this CNN's layers are fixed"},
      {{mlp, "--backend", "bogus"}, "--backend: " + backends + ", got 'bogus'"},
      {{cnn, "--backend", ""}, "--backend: " + backends + ", got ''"},
      {{built("examples/toy_ddp"), "--backend", "tcp"}, "--backend: " + backends + ", got 'tcp'"},
      {{mlp, "--device", "gpu"}, "--device: must be cpu, cuda or cuda:N, got 'gpu'"},
      {{built("examples/toy_ddp"), "--device", "cuda:"},
       "--device: must be cpu, cuda or cuda:N, got 'cuda:'"},
      {{mlp, "--data-dir", ""}, "fashion_mnist: --data-dir: got an empty path; give a folder name"},
      {{mlp, "--checkpoint", ""}, "fashion_mnist: --checkpoint: got an empty path; give a file name"},
      {{cnn, "--export", ""}, "fashion_mnist_cnn: --export: got an empty path; give a file name"},
      {{built("examples/toy_ddp"), "--metrics", ""},
       "toy_ddp: --metrics: got an empty path; give a file name"},
      // CLI11 reads `--flag=` as `--flag`, and `--option=` as a missing value without saying why.
      {{mlp, "--gradient-as-bucket-view="},
       "fashion_mnist: --gradient-as-bucket-view= has no value after '='"},
      {{cnn, "--metrics="}, "fashion_mnist_cnn: --metrics= has no value after '='"},
      {{built("examples/custom_layer"), "--trace", ""},
       "custom_layer: --trace: got an empty path; give a file name"},
      // A layer name that matches none would print an empty table.
      {{built("benchmarks/layer_bench"), "--only", "Relu"}, "--only: must be one of ReLU, Sigmoid"},
      {{built("benchmarks/layer_bench"), "--only", ""}, "layer_bench: --only: must be one of ReLU, Sigmoid"},
      {{built("benchmarks/layer_bench"), "--only="}, "layer_bench: --only= has no value after '='"},
      // CLI11's other parse errors (its own exit codes 109, 114) are usage errors like the rest.
      {{built("examples/toy_ddp"), "--bogus"}, "toy_ddp: The following argument was not expected: --bogus\n"},
      // A misspelt flag gets the flag it most likely meant.
      {{mlp, "--epoch=3"},
       "fashion_mnist: The following argument was not expected: --epoch=3 (did you mean --epochs?)"},
      {{built("examples/toy_ddp"), "--metric", "m.jsonl"}, "(did you mean --metrics?)"},
      // A flag cut short: the one option it begins.
      {{mlp, "--data", "/x"}, "(did you mean --data-dir?)"},
      {{mlp, "--batch", "8"}, "(did you mean --batch-size?)"},
      // The option a flag begins wins over one spelt close to it (--seed is two letters from
      // --sched); a flag that begins several options, or is a real one out of place, gets none.
      {{mlp, "--sched", "constant"}, "(did you mean --schedule?)"},
      {{mlp, "--checkpoint-e", "5"}, "(did you mean --checkpoint-every?)"},
      {{mlp, "--checkpoint-", "x"}, "not expected: --checkpoint- x\n"},
      // Left-over arguments in the order given (CLI11 lists them last first).
      {{mlp, "--", "--epochs", "1"}, "not expected: -- --epochs 1\n"},
      {{mlp, "--epoch", "1"}, "not expected: --epoch 1 (did you mean --epochs?)\n"},
      {{mlp, "--epochs", "1", "--epoch", "1"}, "not expected: --epoch 1 (did you mean --epochs?)\n"},
      {{built("examples/custom_layer"), "--steps"},
       "custom_layer: --steps needs a value (INT:1 or more) after it"},
      {{mlp, "--epochs", "x"}, "fashion_mnist: --epochs: must be an integer >= 1, got 'x'"},
      // Past what an int holds: named, not CLI11's bare "Could not convert".
      {{mlp, "--epochs", "99999999999"},
       "--epochs: must be an integer between 1 and 2147483647, got '99999999999'"},
      {{mlp, "--epochs", "1", "--epochs", "2"}, "fashion_mnist: --epochs is given 2 times: give it once"},
      {{mlp, "--precision", ""}, "fashion_mnist: --precision: got '', expected one of {fp32,bf16,fp16}"},
      {{mlp, "--checkpoint-every", "99999999999999999999"},
       "--checkpoint-every: must be an integer between 0 and 2147483647, got '99999999999999999999'"},
      // A plain unsigned parse reads -1 and 2^64 + anything both as 2^64 - 1: two "different"
      // seeds, one run.
      {{mlp, "--seed", "-1"}, "--seed: must be an integer from 0 to 18446744073709551615, got '-1'"},
      {{built("examples/toy_ddp"), "--seed", "18446744073709551616"},
       "--seed: must be an integer from 0 to 18446744073709551615, got '18446744073709551616'"},
      {{mlp, "--hidden", "64,,32"}, "fashion_mnist: --hidden: an empty item in '64,,32'"},
      // CLI11 would join the two into 5,6.
      {{mlp, "--hidden", "5", "--hidden=6"},
       "fashion_mnist: --hidden is given 2 times: give it once, its items separated by commas (--hidden 5,...)"},
      {{mlp, "--quiet=3"}, "fashion_mnist: --quiet is a switch and takes no value"},
      {{mlp, "--bucket-cap-mb", "1e30"}, "--bucket-cap-mb: must be a finite number between 1e-06 and 1e+06"},
      // Two outputs on one file, or an output over the data, would overwrite each other.
      {{mlp, "--checkpoint", "/tmp/nanoddp-run.x", "--export", "/tmp/nanoddp-run.x"},
       "fashion_mnist: --checkpoint and --export name the same file (/tmp/nanoddp-run.x)"},
      {{cnn, "--metrics", "/tmp/m.jsonl", "--trace", "/tmp/./m.jsonl"},
       "fashion_mnist_cnn: --metrics and --trace name the same file (/tmp/m.jsonl)"},
      {{mlp, "--data-dir", "/tmp/data", "--checkpoint", "/tmp/data/train-labels-idx1-ubyte.gz"},
       "--checkpoint /tmp/data/train-labels-idx1-ubyte.gz is one of the data files in --data-dir /tmp/data"},
      // Nor over the checkpoint's other files: its previous one, and a set's shard files.
      {{mlp, "--checkpoint", "/tmp/ck", "--metrics", "/tmp/ck.prev"},
       "fashion_mnist: --metrics /tmp/ck.prev is where --checkpoint /tmp/ck keeps its previous checkpoint"},
      {{mlp, "--checkpoint", "/tmp/ck", "--export", "/tmp/./ck.prev.tmp"},
       "fashion_mnist: --export /tmp/./ck.prev.tmp is where --checkpoint /tmp/ck keeps its previous "
       "checkpoint"},
      {{cnn, "--checkpoint", "/tmp/ck", "--trace", "/tmp/ck.g3.shard-1-of-4"},
       "fashion_mnist_cnn: --trace /tmp/ck.g3.shard-1-of-4 has the name of a shard file of --checkpoint "
       "/tmp/ck"},
  };
  // What this build lacks is known at parse time too.
  if (!kernels::cuda_built())
    bad.push_back({{mlp, "--device", "cuda:99"}, "--device: cuda:99 needs a CUDA build, and this build of nanoddp has no CUDA"});
  if (!dist::backend_unavailable(dist::Backend::Nccl).empty())
    bad.push_back({{cnn, "--backend", "nccl"}, "--backend: nccl is not available: nanoddp was built without NCCL"});
  for (const auto& [args, message] : bad) {
    const std::string flag = args[1];  // CAPTURE's lambda cannot name a structured binding (C++17)
    CAPTURE(flag);
    const RunResult r = run(args);
    CHECK(r.code() == 2);  // argparse's status for every usage error
    CHECK_MESSAGE(r.err.find(message) != std::string::npos, r.err);
    CHECK(r.out.empty());
  }
  // A link to a file not written yet names that file: the checkpoint would go over the metrics.
  {
    TempDir links;
    std::filesystem::create_symlink("same", links.path + "/lnk");
    const RunResult r = run({mlp, "--checkpoint", links.path + "/lnk", "--metrics", links.path + "/same"});
    CHECK(r.code() == 2);
    CHECK_MESSAGE(r.err.find("--checkpoint and --metrics name the same file") != std::string::npos, r.err);
  }
  // --help lists --hidden for the MLP only, and every backend the runtime takes.
  const RunResult mlp_help = run({mlp, "--help"}), cnn_help = run({cnn, "--help"});
  CHECK(mlp_help.out.find("--hidden") != std::string::npos);
  CHECK(cnn_help.out.find("--hidden") == std::string::npos);
  CHECK(cnn_help.out.find("auto, shm, shm+gloo, gloo, mpi or nccl") != std::string::npos);
  CHECK(mlp_help.code() == 0);
  // Every option with a default shows it in --help (CLI11's "=value").
  const std::vector<std::pair<std::string, std::string>> defaults = {
      {"examples/toy_ddp", "--epochs INT:1 or more=10 "},      {"examples/toy_ddp", "--lr FLOAT:>= 0=0.4 "},
      {"examples/toy_ddp", "--batch-size INT:1 or more=8"},     {"examples/toy_ddp", "--timeout INT:1 or more=300 "},
      {"examples/custom_layer", "--steps INT:1 or more=300 "}, {"examples/custom_layer", "=auto\n"},
      {"examples/fashion_mnist", "--epochs INT:1 or more=10 "}, {"benchmarks/layer_bench", "--min-time FLOAT:>= 0=0.2 "},
      {"benchmarks/allreduce_bench", "|nccl=auto\n"},         {"benchmarks/allreduce_bench", "--warmup INT:0..1000000=3 "},
  };
  for (const auto& [program, shown] : defaults) {
    const std::string wanted = shown;  // CAPTURE's lambda cannot name a structured binding (C++17)
    CAPTURE(wanted);
    const RunResult help = run({built(program), "--help"});
    CHECK(help.code() == 0);
    CHECK_MESSAGE(help.out.find(shown) != std::string::npos, help.out);
  }
}

// ---- files the examples write: --metrics, --export; the live progress line ----------------

namespace {

bool is_null(const std::string& line, const std::string& key) {
  return line.find("\"" + key + "\":null") != std::string::npos;
}

}  // namespace

TEST_CASE("fashion_mnist --metrics: a line per progress update and per epoch that agrees with the result line") {
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 200);
  const std::string metrics = dir.path + "/run.jsonl";
  // 2 ranks x batch 32 over 640 images: 10 steps per epoch, so one progress update per epoch.
  const RunResult r = run({launcher_path(), "--nproc-per-node", "2", "--backend", "gloo", built("examples/fashion_mnist"),
                           "--data-dir", dir.path, "--batch-size", "32", "--epochs", "2", "--metrics", metrics},
                          120s);
  REQUIRE_MESSAGE(r.code() == 0, r.err);
  const auto result = json_lines(r.out);
  REQUIRE(result.size() == 1);
  const auto lines = metrics_lines(metrics);
  REQUIRE(lines.size() == 4);
  const double expected_epochs[] = {1, 1, 2, 2};
  double last_wall = -1;
  for (size_t i = 0; i < lines.size(); ++i) {
    CAPTURE(lines[i]);
    const bool epoch_end = i % 2 == 1;
    CHECK(json_field(lines[i], "step") == (i < 2 ? 10 : 20));
    CHECK(json_field(lines[i], "epoch") == expected_epochs[i]);
    CHECK(json_field(lines[i], "samples_per_s") > 0);
    CHECK(json_field(lines[i], "wall_s") >= last_wall);
    last_wall = json_field(lines[i], "wall_s");
    // The lr of step t of T = 20 on the cosine schedule: 0.05 * (1 + cos(pi t / T)) / 2, t = 9 or 19.
    const double t = i < 2 ? 9 : 19;
    CHECK(json_field(lines[i], "lr") == doctest::Approx(0.025 * (1 + std::cos(M_PI * t / 20))).epsilon(1e-6));
    CHECK(is_null(lines[i], "test_accuracy") == !epoch_end);
  }
  // The last epoch's line holds the run's result, digit for digit.
  CHECK(json_field(lines[3], "test_accuracy") == json_field(result[0], "test_accuracy"));
  CHECK(json_field(lines[3], "loss") == json_field(result[0], "train_loss"));
  CHECK(json_field(lines[3], "samples_per_s") == json_field(result[0], "samples_per_s"));
  // The median step is a step of this run: longer than nothing, shorter than the whole run.
  CHECK(json_field(result[0], "step_ms_median") > 0);
  CHECK(json_field(result[0], "step_ms_median") <= 1000 * json_field(lines[3], "wall_s"));

  // An unwritable --metrics file stops the run before training, naming the file.
  const RunResult bad = run({built("examples/fashion_mnist"), "--data-dir", dir.path, "--metrics",
                             dir.path + "/missing/run.jsonl"},
                            60s);
  CHECK(bad.code() != 0);
  CHECK(bad.err.find(dir.path + "/missing/run.jsonl") != std::string::npos);
}

TEST_CASE("fashion_mnist --metrics with --resume: the file reads as one run, without the killed run's extra steps") {
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 200);
  const std::string metrics = dir.path + "/run.jsonl", checkpoint = dir.path + "/run.ckpt";
  const std::vector<std::string> common = {built("examples/fashion_mnist"), "--data-dir", dir.path, "--batch-size",
                                           "64", "--epochs", "2", "--quiet", "--metrics", metrics, "--checkpoint",
                                           checkpoint};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = common;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  const RunResult first = run(with({"--stop-after", "1"}), 120s);
  REQUIRE_MESSAGE(first.code() == 0, first.err);
  REQUIRE(metrics_lines(metrics).size() == 2);
  // What a run killed in epoch 2 leaves past its checkpoint of epoch 1: a progress line of
  // epoch 2 and a line cut short. The resumed run takes those steps again: they must go.
  {
    std::ofstream killed_run(metrics, std::ios::app);
    killed_run << "{\"step\":15,\"epoch\":2,\"loss\":0.5,\"lr\":0.01,\"samples_per_s\":100,"
                  "\"test_accuracy\":null,\"wall_s\":1}\n{\"step\":17,\"ep";
  }
  const RunResult rest = run(with({"--resume"}), 120s);
  REQUIRE_MESSAGE(rest.code() == 0, rest.err);
  const auto lines = metrics_lines(metrics);
  REQUIRE(lines.size() == 4);
  const double steps[] = {10, 10, 20, 20}, epochs[] = {1, 1, 2, 2};  // 640 / 64 = 10 steps per epoch
  for (size_t i = 0; i < lines.size(); ++i) {
    CAPTURE(lines[i]);
    CHECK(json_field(lines[i], "step") == steps[i]);
    CHECK(json_field(lines[i], "epoch") == epochs[i]);
  }
  CHECK(json_field(lines[3], "test_accuracy") == json_field(json_lines(rest.out).at(0), "test_accuracy"));
}

TEST_CASE("fashion_mnist --metrics, resumed from a mid-epoch checkpoint: the lines before it stay, the rest are "
          "written again") {
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 200);
  const std::string metrics = dir.path + "/run.jsonl", checkpoint = dir.path + "/run.ckpt";
  // Batch 8: 80 steps, progress lines at steps 50 and 80. Saved at step 60, killed before 70.
  const std::vector<std::string> common = {built("examples/fashion_mnist"), "--data-dir", dir.path, "--batch-size",
                                           "8", "--epochs", "1", "--quiet", "--metrics", metrics, "--checkpoint",
                                           checkpoint, "--checkpoint-every", "60"};
  std::vector<std::string> killed = {"/usr/bin/env", "NANODDP_FAULT_KILL_AT=0:70"};
  killed.insert(killed.end(), common.begin(), common.end());
  const RunResult first = run(killed, 120s);
  REQUIRE_MESSAGE(first.code() != 0, first.err);
  REQUIRE(metrics_lines(metrics).size() == 1);
  std::vector<std::string> resumed = common;
  resumed.push_back("--resume");
  const RunResult rest = run(resumed, 120s);
  REQUIRE_MESSAGE(rest.code() == 0, rest.err);
  const auto lines = metrics_lines(metrics);
  REQUIRE(lines.size() == 3);
  const double steps[] = {50, 80, 80};
  for (size_t i = 0; i < lines.size(); ++i) {
    CAPTURE(lines[i]);
    CHECK(json_field(lines[i], "step") == steps[i]);
    CHECK(json_field(lines[i], "epoch") == 1);
  }
}

TEST_CASE("fashion_mnist: a mid-epoch checkpoint does not resume at another --batch-size of as many steps") {
  // 640 images: batches of 40 and of 41 both make 16 steps; 5 steps of 41 would skip examples
  // that 5 steps of 40 never trained on.
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 200);
  const std::string checkpoint = dir.path + "/run.ckpt";
  auto job = [&](const std::string& batch) {
    return std::vector<std::string>{built("examples/fashion_mnist"),
                                    "--data-dir",
                                    dir.path,
                                    "--batch-size",
                                    batch,
                                    "--epochs",
                                    "1",
                                    "--quiet",
                                    "--checkpoint",
                                    checkpoint,
                                    "--checkpoint-every",
                                    "5"};
  };
  std::vector<std::string> killed = {"/usr/bin/env", "NANODDP_FAULT_KILL_AT=0:7"};
  for (const std::string& arg : job("40")) killed.push_back(arg);
  REQUIRE(run(killed, 120s).code() != 0);
  std::vector<std::string> other = job("41");
  other.push_back("--resume");
  const RunResult r = run(other, 120s);
  CHECK(r.code() != 0);
  CHECK_MESSAGE(
      r.err.find("after step 5 of 16, by 1 rank with --batch-size 40; a checkpoint from the middle of "
                 "an epoch resumes only at the same world size and --batch-size (this run: 1 rank, "
                 "--batch-size 41, 16 steps per epoch)") != std::string::npos,
      r.err);
  // The same world size and batch size on a larger training set: the data is what differs.
  write_small_fashion_mnist(dir.path, 800, 200);
  std::vector<std::string> more_data = job("40");
  more_data.push_back("--resume");
  const RunResult data = run(more_data, 120s);
  CHECK(data.code() != 0);
  CHECK_MESSAGE(
      data.err.find("resumes only at the same world size and --batch-size on the same data (this run has "
                    "both, but its training set makes another number of steps per epoch: 1 rank, "
                    "--batch-size 40, 20 steps per epoch)") != std::string::npos,
      data.err);
}

TEST_CASE("fashion_mnist --resume on another world size: the schedule is this run's, as if never interrupted") {
  // 640 images, batch 32: 20 steps per epoch on 1 rank, 10 on 2. Continued from the 1-rank
  // checkpoint's own step count, the cosine would leave its curve (and diverge at batch 128).
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 200);
  const std::string program = built("examples/fashion_mnist"), checkpoint = dir.path + "/run.ckpt";
  auto job = [&](int ranks, const std::string& metrics, std::vector<std::string> extra) {
    std::vector<std::string> all = {launcher_path(), "--nproc-per-node", std::to_string(ranks), program, "--data-dir",
                                    dir.path, "--batch-size", "32", "--epochs", "3", "--metrics", metrics};
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  const std::string resumed = dir.path + "/resumed.jsonl", straight = dir.path + "/straight.jsonl";
  const RunResult first = run(job(1, resumed, {"--stop-after", "1", "--checkpoint", checkpoint}), 120s);
  REQUIRE_MESSAGE(first.code() == 0, first.err);
  const RunResult rest = run(job(2, resumed, {"--checkpoint", checkpoint, "--resume"}), 120s);
  REQUIRE_MESSAGE(rest.code() == 0, rest.err);
  CHECK(rest.out.find("the checkpoint's run had 20 steps per epoch and this one has 10") != std::string::npos);
  const RunResult whole = run(job(2, straight, {}), 120s);
  REQUIRE_MESSAGE(whole.code() == 0, whole.err);
  // The log keeps the 1-rank run's epoch (its 20 steps), and the 2-rank steps count on from
  // there, 10 per epoch: one rising run of steps.
  std::vector<double> steps;
  for (const std::string& line : metrics_lines(resumed)) steps.push_back(json_field(line, "step"));
  CHECK(steps == std::vector<double>{20, 20, 30, 30, 40, 40});

  // Epochs 2 and 3: the same learning rate at the same points as the uninterrupted 2-rank run.
  std::vector<std::pair<double, double>> after_resume, uninterrupted;
  for (const std::string& line : metrics_lines(resumed))
    if (json_field(line, "epoch") > 1) after_resume.emplace_back(json_field(line, "epoch"), json_field(line, "lr"));
  for (const std::string& line : metrics_lines(straight))
    if (json_field(line, "epoch") > 1) uninterrupted.emplace_back(json_field(line, "epoch"), json_field(line, "lr"));
  REQUIRE(after_resume.size() == 4);
  CHECK(after_resume == uninterrupted);
  CHECK(after_resume.back().second < after_resume.front().second);
}

TEST_CASE(
    "fashion_mnist --metrics over three runs at 1, 2 and 1 ranks: the steps count on from each "
    "checkpoint's") {
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 200);
  const std::string metrics = dir.path + "/run.jsonl", checkpoint = dir.path + "/run.ckpt";
  auto job = [&](int ranks, std::vector<std::string> extra) {
    std::vector<std::string> all = {launcher_path(),
                                    "--nproc-per-node",
                                    std::to_string(ranks),
                                    built("examples/fashion_mnist"),
                                    "--data-dir",
                                    dir.path,
                                    "--batch-size",
                                    "32",
                                    "--epochs",
                                    "3",
                                    "--quiet",
                                    "--metrics",
                                    metrics,
                                    "--checkpoint",
                                    checkpoint};
    all.insert(all.end(), extra.begin(), extra.end());
    const RunResult r = run(all, 120s);
    REQUIRE_MESSAGE(r.code() == 0, r.err);
  };
  job(1, {"--stop-after", "1"});              // 20 steps per epoch
  job(2, {"--stop-after", "2", "--resume"});  // 10
  job(1, {"--resume"});                       // 20 again
  std::vector<double> steps;
  for (const std::string& line : metrics_lines(metrics)) steps.push_back(json_field(line, "step"));
  CHECK(steps == std::vector<double>{20, 20, 30, 30, 50, 50});
}

TEST_CASE("fashion_mnist --resume: ranks that found different checkpoints stop at the start, saying so") {
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 200);
  const std::string program = built("examples/fashion_mnist"), shared = dir.path + "/run.ckpt";
  const std::vector<std::string> common = {program, "--data-dir", dir.path, "--batch-size", "32", "--epochs", "2",
                                           "--quiet", "--timeout", "30"};
  std::vector<std::string> first_args = common;
  first_args.insert(first_args.end(), {"--stop-after", "1", "--checkpoint", shared});
  const RunResult first = run(first_args, 120s);
  REQUIRE_MESSAGE(first.code() == 0, first.err);
  // Two ranks started by hand, as on two nodes with disks of their own: rank 1's file is missing.
  const std::string port = std::to_string(dist::pick_free_port("127.0.0.1"));
  RunResult results[2];
  std::thread ranks[2];
  for (int rank = 0; rank < 2; ++rank)
    ranks[rank] = std::thread([&, rank] {
      std::vector<std::string> args = {"/usr/bin/env", "RANK=" + std::to_string(rank), "WORLD_SIZE=2",
                                       "LOCAL_RANK=" + std::to_string(rank), "LOCAL_WORLD_SIZE=2",
                                       "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port};
      args.insert(args.end(), common.begin(), common.end());
      args.insert(args.end(), {"--resume", "--checkpoint", rank == 0 ? shared : dir.path + "/elsewhere.ckpt"});
      results[rank] = run(args, 60s);
    });
  for (std::thread& rank : ranks) rank.join();
  for (const RunResult& result : results) {
    CHECK_MESSAGE(result.code() != 0, result.out);
    CHECK_MESSAGE(result.err.find("--resume: the ranks do not agree where to start (rank 0 resumes after epoch 1, "
                                  "rank 1 starts at epoch 1)") != std::string::npos,
                  result.err);
  }
}

TEST_CASE("toy_ddp --metrics: one line per epoch with the epoch's mean loss") {
  TempDir dir;
  const std::string metrics = dir.path + "/toy.jsonl";
  const RunResult r = run({built("examples/toy_ddp"), "--epochs", "3", "--init-weight", "0.5", "--init-bias", "0",
                           "--metrics", metrics});
  REQUIRE_MESSAGE(r.code() == 0, r.err);
  const auto lines = metrics_lines(metrics);
  REQUIRE(lines.size() == 3);
  for (size_t i = 0; i < lines.size(); ++i) {
    CAPTURE(lines[i]);
    CHECK(json_field(lines[i], "epoch") == static_cast<double>(i + 1));
    CHECK(json_field(lines[i], "step") == static_cast<double>(13 * (i + 1)));  // ceil(100 / 8) steps per epoch
    CHECK(json_field(lines[i], "lr") == doctest::Approx(0.4));  // toy_ddp's default
    CHECK(is_null(lines[i], "test_accuracy"));
  }
  // Training converges: each epoch's mean loss below the one before.
  CHECK(json_field(lines[1], "loss") < json_field(lines[0], "loss"));
  CHECK(json_field(lines[2], "loss") < json_field(lines[1], "loss"));
}

TEST_CASE("--checkpoint, --export and --metrics never replace a file the program did not write; its own output, yes") {
  TempDir dir;
  write_small_fashion_mnist(dir.path, 320, 100);
  const std::string notes = dir.path + "/README.md";
  const std::string notes_text = "# My notes\nnot a checkpoint\n";
  const std::string ckpt = dir.path + "/run.ckpt", exported = dir.path + "/w.safetensors", metrics = dir.path + "/m.jsonl";
  const std::vector<std::string> fashion = {built("examples/fashion_mnist"), "--data-dir", dir.path, "--epochs", "1",
                                            "--quiet"};
  auto fashion_with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = fashion;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  // The first run writes all three; a second run replaces them: they are its own.
  for (int round = 0; round < 2; ++round) {
    const RunResult r = run(fashion_with({"--checkpoint", ckpt, "--export", exported, "--metrics", metrics}), 120s);
    REQUIRE_MESSAGE(r.code() == 0, r.err);
  }
  CHECK(nn::load_checkpoint(ckpt).size() > 0);
  CHECK(nn::load_safetensors(exported).size() == 6);
  CHECK(metrics_lines(metrics).size() == 2);  // one run's lines: replaced, not appended to

  struct Case {
    std::vector<std::string> args;  // the flag and the file it must not replace
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--checkpoint", notes}, "checkpoint " + notes + ": refusing to replace " + notes +
                                    ": it is not a nanoddp checkpoint (it begins \"# My notes\")"},
      {{"--export", notes}, "safetensors " + notes + ": refusing to replace " + notes +
                                ": it is not a safetensors file (it begins \"# My notes\")"},
      {{"--export", ckpt}, "safetensors " + ckpt + ": refusing to replace " + ckpt +
                               ": it is not a safetensors file (it begins \"NDDPCKPT"},
      {{"--checkpoint", exported}, "checkpoint " + exported + ": refusing to replace " + exported +
                                       ": it is not a nanoddp checkpoint"},
      {{"--metrics", notes}, "--metrics " + notes + ": refusing to replace " + notes +
                                 ": line 1 is not a metrics line (it begins \"# My not\")"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.args[0]);
    CAPTURE(c.args[1]);
    std::ofstream(notes) << notes_text;
    const std::string ckpt_bytes = read_file(ckpt), exported_bytes = read_file(exported);
    const RunResult r = run(fashion_with(c.args), 120s);
    CHECK(r.code() == 1);
    CHECK_MESSAGE(r.err.find(c.message) != std::string::npos, r.err);
    CHECK_MESSAGE(r.err.find("so this program did not write it; move it away or name another file") !=
                      std::string::npos,
                  r.err);
    CHECK(r.out.find("test_accuracy") == std::string::npos);  // stopped before training
    CHECK(read_file(notes) == notes_text);
    CHECK(read_file(ckpt) == ckpt_bytes);
    CHECK(read_file(exported) == exported_bytes);
  }
  // A device is not a file to keep, and is not read (/dev/full read as a binary file, "not a
  // metrics line"; a terminal or a FIFO could block the read forever): it is written to, and
  // /dev/full's error is the write's.
  const RunResult to_full = run(fashion_with({"--metrics", "/dev/full"}), 120s);
  CHECK(to_full.code() == 1);
  CHECK_MESSAGE(
      to_full.err.find("--metrics /dev/full: write failed: No space left on device") != std::string::npos,
      to_full.err);
  const RunResult to_null = run(fashion_with({"--metrics", "/dev/null"}), 120s);
  CHECK_MESSAGE(to_null.code() == 0, to_null.err);
  // toy_ddp's --metrics likewise, under the launcher.
  std::ofstream(notes) << notes_text;
  const RunResult toy = run({launcher_path(), "--nproc-per-node", "2", built("examples/toy_ddp"), "--metrics", notes}, 120s);
  CHECK(toy.code() == 1);
  CHECK_MESSAGE(toy.err.find("--metrics " + notes + ": refusing to replace " + notes) != std::string::npos, toy.err);
  CHECK(read_file(notes) == notes_text);
}

TEST_CASE("fashion_mnist --export: the trained weights under PyTorch's names, as the checkpoint has them") {
  TempDir dir;
  write_small_fashion_mnist(dir.path, 320, 100);
  const std::string exported = dir.path + "/mlp.safetensors", checkpoint = dir.path + "/run.ckpt";
  const RunResult r = run({built("examples/fashion_mnist"), "--data-dir", dir.path, "--epochs", "1", "--quiet",
                           "--export", exported, "--checkpoint", checkpoint},
                          120s);
  REQUIRE_MESSAGE(r.code() == 0, r.err);
  nn::SafetensorsMetadata metadata;
  const nn::StateDict weights = nn::load_safetensors(exported, &metadata);
  const nn::StateDict saved = nn::strip_prefix(nn::load_checkpoint(checkpoint), "model.");
  const std::map<std::string, Shape> torch_shapes = {{"0.weight", {256, 784}}, {"0.bias", {256}},
                                                     {"2.weight", {128, 256}}, {"2.bias", {128}},
                                                     {"4.weight", {10, 128}},  {"4.bias", {10}}};
  REQUIRE(weights.size() == torch_shapes.size());
  for (const auto& entry : torch_shapes) {
    const std::string& name = entry.first;  // not a structured binding: CAPTURE cannot capture one (clang, C++17)
    const Shape& shape = entry.second;
    CAPTURE(name);
    REQUIRE(weights.count(name) == 1);
    CHECK(weights.at(name).shape() == shape);
    CHECK(weights.at(name).to_vector() == saved.at(name).to_vector());
  }
  CHECK(metadata.at("format") == "pt");
  CHECK(metadata.at("epochs") == "1");
  CHECK(std::stod(metadata.at("test_accuracy")) == json_field(json_lines(r.out).at(0), "test_accuracy"));

  // The README's PyTorch check of the file, where torch is installed (it is optional).
  if (run({"/usr/bin/python3", "-c", "import torch"}, 60s).code() == 0) {
    const std::string script = source_dir() + "/benchmarks/torch_reference/load_safetensors.py";
    const RunResult torch_check = run({"/usr/bin/python3", script, exported, "--data-dir", dir.path}, 120s);
    CHECK_MESSAGE(torch_check.code() == 0, torch_check.out, torch_check.err);
    CHECK(torch_check.out.find("\"torch_test_accuracy\"") != std::string::npos);
  } else {
    MESSAGE("benchmarks/torch_reference/load_safetensors.py not run: /usr/bin/python3 has no torch");
  }

  // An export path in a missing folder fails before training, naming it.
  const RunResult bad = run({built("examples/fashion_mnist"), "--data-dir", dir.path, "--export",
                             dir.path + "/missing/mlp.safetensors"},
                            60s);
  CHECK(bad.code() != 0);
  CHECK(bad.err.find(dir.path + "/missing/mlp.safetensors") != std::string::npos);
}

TEST_CASE("fashion_mnist progress: redrawn in place on a terminal with samples/s and ETA, plain lines in a pipe") {
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 100);
  // 640 / 8 = 80 steps per epoch: updates at steps 50 and 80.
  const std::string command = built("examples/fashion_mnist") + " --data-dir " + dir.path +
                              " --batch-size 8 --epochs 2";
  const RunResult on_terminal = run_on_terminal(command, 120s);
  REQUIRE_MESSAGE(on_terminal.code() == 0, on_terminal.out);
  CHECK(std::regex_search(on_terminal.out,
                          std::regex("\repoch 1/2 \\[#{12}\\.{8}\\] 50/80 loss [0-9.]+ [0-9]+ samples/s ETA [0-9]+:[0-9]{2}")));
  CHECK(std::regex_search(on_terminal.out, std::regex("\repoch 2/2 \\[#{20}\\] 80/80 loss [0-9.]+ [0-9]+ samples/s ETA 0:00")));
  CHECK(on_terminal.out.find("epoch 1/2 step 50/80") == std::string::npos);

  // Ctrl-C mid-epoch: the drawn line is ended before the process ends by the signal, so what
  // follows (the shell's prompt) starts on a line of its own.
  const std::string interrupted_command = "(sleep 4; kill -INT $$) & exec " + built("examples/fashion_mnist") +
                                          " --data-dir " + dir.path + " --batch-size 8 --epochs 1000";
  const RunResult interrupted = run_on_terminal(interrupted_command, 120s);
  CHECK(interrupted.code() == 128 + SIGINT);
  const size_t last_draw = interrupted.out.rfind("\repoch ");
  REQUIRE_MESSAGE(last_draw != std::string::npos, interrupted.out);
  CHECK_MESSAGE(interrupted.out.find('\n', last_draw) != std::string::npos, interrupted.out.substr(last_draw));

  const RunResult piped = run({built("examples/fashion_mnist"), "--data-dir", dir.path, "--batch-size", "8",
                               "--epochs", "2"},
                              120s);
  REQUIRE_MESSAGE(piped.code() == 0, piped.err);
  CHECK(piped.out.find('\r') == std::string::npos);
  CHECK(piped.out.find("ETA") == std::string::npos);
  CHECK(piped.out.find("epoch 1/2 step 50/80 loss ") != std::string::npos);
  CHECK(piped.out.find("epoch 2/2 step 80/80 loss ") != std::string::npos);
}

TEST_CASE("fashion_mnist --dp naive, flat, overlap train like --dp buckets (2 ranks); --accumulate 3 like one batch; conflicting flags are refused") {
  TempDir dir;
  write_small_fashion_mnist(dir.path, 640, 200);
  const std::string program = built("examples/fashion_mnist");
  auto train = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = {launcher_path(), "--nproc-per-node", "2", "--backend", "gloo", program,
                                    "--data-dir", dir.path, "--batch-size", "32", "--epochs", "2", "--quiet"};
    all.insert(all.end(), extra.begin(), extra.end());
    const RunResult r = run(all, 120s);
    REQUIRE_MESSAGE(r.code() == 0, r.err);
    const auto lines = json_lines(r.out);
    REQUIRE(lines.size() == 1);
    return lines[0];
  };
  const std::string buckets = train({"--dp", "buckets"});
  CHECK(buckets.find("\"strategy\":\"ddp\"") != std::string::npos);
  // The same sums in another order: equal to float rounding (the printed loss has 9 digits).
  for (const char* rung : {"naive", "flat", "overlap"}) {
    CAPTURE(rung);
    const std::string line = train({"--dp", rung});
    CHECK(line.find(std::string("\"strategy\":\"") + rung + "\"") != std::string::npos);
    CHECK(json_field(line, "train_loss") == doctest::Approx(json_field(buckets, "train_loss")).epsilon(1e-5));
    CHECK(std::abs(json_field(line, "test_accuracy") - json_field(buckets, "test_accuracy")) <= 0.005);
  }
  // Each batch of 32 in 3 micro-batches of 11, 11, 10 rows weighted by their share: the same step.
  const std::string accumulated = train({"--dp", "overlap", "--accumulate", "3"});
  CHECK(json_field(accumulated, "train_loss") == doctest::Approx(json_field(buckets, "train_loss")).epsilon(1e-5));

  const RunResult conflict = run({program, "--data-dir", dir.path, "--dp", "naive", "--strategy", "fsdp"}, 60s);
  CHECK(conflict.code() != 0);
  CHECK(conflict.err.find("--dp naive is a ladder rung, which --strategy fsdp would replace") != std::string::npos);
  const RunResult mapped = run({program, "--data-dir", dir.path, "--dp", "buckets", "--strategy", "zero1"}, 60s);
  CHECK(mapped.code() != 0);
  CHECK(mapped.err.find("--dp buckets means --strategy ddp, not --strategy zero1") != std::string::npos);
  const RunResult bucket_flag = run({program, "--data-dir", dir.path, "--dp", "flat", "--bucket-cap-mb", "1"}, 60s);
  CHECK(bucket_flag.code() != 0);
  CHECK(bucket_flag.err.find("--bucket-cap-mb is a DDP bucket option: --dp flat is a ladder rung") != std::string::npos);
  // The flag given is the one named, and FSDP has no buckets either.
  const RunResult first_cap = run({program, "--data-dir", dir.path, "--dp", "naive", "--first-bucket-cap-mb", "1"}, 60s);
  CHECK(first_cap.code() == 2);
  CHECK(first_cap.err.find("--first-bucket-cap-mb is a DDP bucket option: --dp naive") != std::string::npos);
  const RunResult sharded_cap = run({program, "--data-dir", dir.path, "--strategy", "fsdp", "--bucket-cap-mb", "1"}, 60s);
  CHECK(sharded_cap.code() == 2);
  CHECK(sharded_cap.err.find("--bucket-cap-mb is a DDP bucket option: it applies to --strategy ddp and zero1, not "
                             "fsdp") != std::string::npos);
}
