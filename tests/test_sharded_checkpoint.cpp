// Sharded checkpoints (dist/sharded_checkpoint.h): a set saved by 4 ranks loads at 2, 3 and 4
// and trains on as one process with the unsharded optimizer would; a set and a full checkpoint
// hold the same state and load into each other's runs; a failed or crashed save leaves the
// previous set loadable; a damaged shard file is named. Ranks meet on shm (NANODDP_TEST_BACKEND
// picks another; the last case reruns the resharding case on Gloo).
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/file_io.h"
#include "core/ops.h"
#include "dist/ddp.h"
#include "dist/fsdp.h"
#include "dist/init.h"
#include "dist/sharded_checkpoint.h"
#include "dist/zero_redundancy_optimizer.h"
#include "nn/adam.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "tests/batches.h"
#include "tests/dist_ranks.h"
#include "tests/multiprocess.h"
#include "tests/subprocess.h"

using namespace nanoddp;
using nanoddp::testing::Batch;
using nanoddp::testing::expect;
using nanoddp::testing::TempDir;
using namespace std::chrono_literals;

namespace {

std::shared_ptr<dist::ProcessGroup> join(int rank, int world, int port,
                                         std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  dist::InitOptions options;
  options.timeout = timeout;
  options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  options.rank = rank;
  options.world_size = world;
  const char* backend = std::getenv("NANODDP_TEST_BACKEND");
  options.backend = backend != nullptr ? dist::parse_backend(backend) : dist::Backend::Shm;
  return dist::init_process_group(options);
}

// fn on `world` forked ranks; the group each joins is destroyed before the rank exits.
std::string on_ranks(int world, const std::function<void(int rank)>& fn) {
  return testing::run_ranks(world, [&fn](int rank) {
    fn(rank);
    dist::destroy_process_group();
  });
}

constexpr int64_t kGlobalBatch = 12;  // splits evenly over 1, 2, 3 and 4 ranks
constexpr int kSteps = 4;             // 2 before the save, 2 after the load
constexpr int kSavedAfter = 2;
constexpr float kTolerance = 2e-5f;  // float sums in another order than one process's

// 5 -> 6 -> 3: FSDP units of 36 and 21 elements, shards of 9 and 6 at 4 ranks (padded), 12 and
// 7 at 3, 18 and 11 at 2. ZeRO-1 owns its 4 parameters (30, 18, 6, 3 elements) one per rank at 4.
std::shared_ptr<nn::Sequential> make_mlp(uint64_t seed) {
  Generator gen(seed);
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Linear(5, 6, gen));
  model->add(nn::ReLU());
  model->add(nn::Linear(6, 3, gen));
  return model;
}

Batch global_batch(int step) {
  return testing::random_batch(500 + static_cast<uint64_t>(step), kGlobalBatch, 5, 3);
}
Batch share(const Batch& b, int rank, int world) {
  const int64_t per_rank = kGlobalBatch / world;
  return testing::rows(b, rank * per_rank, (rank + 1) * per_rank);
}

std::unique_ptr<nn::Optimizer> make_optimizer(bool adamw, std::vector<Tensor> params) {
  if (adamw) {
    nn::AdamWOptions options;
    options.lr = 0.05f;
    return std::make_unique<nn::AdamW>(std::move(params), options);
  }
  return std::make_unique<nn::SGD>(std::move(params), nn::SGDOptions{/*lr=*/0.1f, /*momentum=*/0.9f});
}

enum class Strategy { Fsdp, Zero1 };
struct Config {
  Strategy strategy;
  bool adamw;
  std::string name() const {
    return std::string(strategy == Strategy::Fsdp ? "fsdp" : "zero1") + (adamw ? "-adamw" : "-sgd");
  }
};
const std::vector<Config> kConfigs = {
    {Strategy::Fsdp, false}, {Strategy::Fsdp, true}, {Strategy::Zero1, false}, {Strategy::Zero1, true}};

// One process with the plain optimizer on the global batch: the model and optimizer state
// after `steps` steps.
std::pair<nn::StateDict, nn::StateDict> train_reference(bool adamw, int steps) {
  auto model = make_mlp(7);
  auto opt = make_optimizer(adamw, model->parameters());
  for (int s = 0; s < steps; ++s) {
    const Batch b = global_batch(s);
    opt->zero_grad();
    cross_entropy((*model)(b.x), b.y).backward();
    opt->step();
  }
  return {model->state_dict(), opt->state_dict()};
}

// One rank's training under FSDP FULL_SHARD or DDP + ZeRO-1, with the state in and out.
class Trainer {
 public:
  Trainer(const Config& config, std::shared_ptr<dist::ProcessGroup> pg, uint64_t seed)
      : pg_(std::move(pg)), model_(make_mlp(seed)) {
    if (config.strategy == Strategy::Fsdp) {
      dist::FSDPOptions options;
      options.auto_wrap_policy = dist::module_wrap_policy<nn::Linear>();
      fsdp_ = std::make_unique<dist::FullyShardedDataParallel>(model_, pg_, options);
      opt_ = make_optimizer(config.adamw, fsdp_->parameters());
    } else {
      ddp_ = std::make_unique<dist::DistributedDataParallel>(model_, pg_);
      opt_ = std::make_unique<dist::ZeroRedundancyOptimizer>(
          ddp_->parameters(), pg_,
          [&](std::vector<Tensor> p) { return make_optimizer(config.adamw, std::move(p)); });
    }
  }
  nn::Module& forward() { return fsdp_ ? static_cast<nn::Module&>(*fsdp_) : *ddp_; }
  // Global steps [from, to), each rank on its share of the global batch.
  void train(int from, int to) {
    for (int s = from; s < to; ++s) {
      const Batch b = share(global_batch(s), pg_->rank(), pg_->size());
      opt_->zero_grad();
      cross_entropy(forward()(b.x), b.y).backward();
      opt_->step();
    }
  }
  dist::ShardedStateDict sharded() const {
    dist::ShardedStateDict state;
    auto* zero = dynamic_cast<dist::ZeroRedundancyOptimizer*>(opt_.get());
    dist::merge_prefixed(state, "model.",
                         fsdp_ ? fsdp_->sharded_model_state_dict() : zero->sharded_model_state_dict(*model_));
    dist::merge_prefixed(state, "optimizer.",
                         fsdp_ ? fsdp_->sharded_optim_state_dict(*opt_) : zero->sharded_state_dict());
    return state;
  }
  void load(dist::ShardedCheckpointReader& reader) {
    if (fsdp_) {
      fsdp_->load_state_dict(fsdp_->read_local_state_dict(reader, "model."));
      opt_->load_state_dict(fsdp_->read_local_optim_state_dict(reader, "optimizer."));
    } else {
      model_->load_state_dict(reader.read_all("model."));
      opt_->load_state_dict(
          dynamic_cast<dist::ZeroRedundancyOptimizer&>(*opt_).read_local_state_dict(reader, "optimizer."));
    }
  }
  void load_full(const nn::StateDict& model, const nn::StateDict& optimizer) {
    if (fsdp_) {
      fsdp_->load_full_state_dict(model);
      opt_->load_state_dict(fsdp_->shard_full_optim_state_dict(optimizer));
    } else {
      model_->load_state_dict(model);
      opt_->load_state_dict(optimizer);
    }
  }
  // Collectives: the whole model and optimizer state (the optimizer's on rank 0 for ZeRO-1, {}
  // elsewhere).
  nn::StateDict full_model() {
    return fsdp_ ? fsdp_->full_state_dict(/*rank0_only=*/false) : model_->state_dict();
  }
  nn::StateDict full_optim() {
    if (fsdp_) return fsdp_->full_optim_state_dict(*opt_);
    auto& zero = dynamic_cast<dist::ZeroRedundancyOptimizer&>(*opt_);
    zero.consolidate_state_dict(0);
    return pg_->rank() == 0 ? zero.state_dict() : nn::StateDict{};
  }

 private:
  std::shared_ptr<dist::ProcessGroup> pg_;
  std::shared_ptr<nn::Sequential> model_;
  std::unique_ptr<dist::FullyShardedDataParallel> fsdp_;
  std::unique_ptr<dist::DistributedDataParallel> ddp_;
  std::unique_ptr<nn::Optimizer> opt_;
};

// "" when got and want hold the same entries within tolerance (0: bit for bit), else a line
// per entry that differs, with its largest difference.
std::string differences(const nn::StateDict& got, const nn::StateDict& want, float tolerance) {
  std::ostringstream report;
  if (got.size() != want.size()) report << got.size() << " entries, expected " << want.size() << "\n";
  for (const auto& [key, w] : want) {
    const auto it = got.find(key);
    if (it == got.end()) {
      report << key << ": missing\n";
      continue;
    }
    if (w.dtype() == DType::Int64) {
      if (it->second.dtype() != DType::Int64 || it->second.to_int_vector() != w.to_int_vector())
        report << key << ": differs\n";
      continue;
    }
    const std::vector<float> a = it->second.to_vector(), b = w.to_vector();
    if (a.size() != b.size()) {
      report << key << ": " << a.size() << " elements, expected " << b.size() << "\n";
      continue;
    }
    float worst = 0;
    for (size_t j = 0; j < a.size(); ++j) worst = std::max(worst, std::abs(a[j] - b[j]));
    if (!(worst <= tolerance)) report << key << ": max |diff| " << worst << "\n";
  }
  return report.str();
}

std::string set_path(const std::string& dir, const Config& config) {
  return dir + "/" + config.name() + ".ckpt";
}

// Every config trained kSavedAfter steps on 4 ranks and saved as a set in dir.
void save_sets_at_4(const std::string& dir) {
  const int port = testing::free_port();
  const std::string failures = on_ranks(4, [&](int rank) {
    auto pg = join(rank, 4, port);
    for (const Config& config : kConfigs) {
      Trainer trainer(config, pg, rank == 0 ? 7 : 99);  // the wrappers start every rank from rank 0's weights
      trainer.train(0, kSavedAfter);
      dist::save_sharded_checkpoint(set_path(dir, config), trainer.sharded(), *pg);
    }
  });
  REQUIRE_MESSAGE(failures.empty(), failures);
}

// A set of one tensor "x" of 8 float32 elements, rank r of 4 holding [2r, 2r + 2) of value
// + r, and "step" (int64) on rank 0.
dist::ShardedStateDict small_state(int rank, float value) {
  dist::ShardedStateDict state;
  dist::ShardedEntry x;
  x.shape = Shape({8});
  x.begin = 2 * rank;
  x.end = 2 * rank + 2;
  x.piece = Tensor::full({2}, value + static_cast<float>(rank));
  state["x"] = x;
  if (rank == 0)
    state["step"] = dist::whole_entry(Tensor::from_vector(std::vector<int64_t>{static_cast<int64_t>(value)}));
  return state;
}
std::vector<float> small_x(float value) {
  std::vector<float> x;
  for (int r = 0; r < 4; ++r) x.insert(x.end(), 2, value + static_cast<float>(r));
  return x;
}

void save_small(const std::string& path, float value) {
  const int port = testing::free_port();
  const std::string failures = on_ranks(4, [&](int rank) {
    auto pg = join(rank, 4, port);
    dist::save_sharded_checkpoint(path, small_state(rank, value), *pg);
  });
  REQUIRE_MESSAGE(failures.empty(), failures);
}

// The ranks of the saving group whose shard files reader opened, sorted ("0", "1").
std::vector<std::string> opened_shards(const dist::ShardedCheckpointReader& reader) {
  std::vector<std::string> ranks;
  for (const std::string& file : reader.files_read()) {
    const size_t at = file.rfind(".shard-") + 7;
    ranks.push_back(file.substr(at, file.find('-', at) - at));
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("a set saved at 4 ranks loads at 2, 3 and 4 and trains on as the unsharded optimizer (FSDP, ZeRO-1; SGD, AdamW)") {
  TempDir dir;
  save_sets_at_4(dir.path);
  for (const Config& config : kConfigs) {
    // What was saved is the unsharded optimizer's state after 2 steps (float rounding apart).
    const std::string name = config.name();
    CAPTURE(name);
    // No structured binding: CHECK_MESSAGE's message is a lambda, which cannot capture one in C++17.
    const std::pair<nn::StateDict, nn::StateDict> at_2 = train_reference(config.adamw, kSavedAfter);
    const nn::StateDict& model_at_2 = at_2.first;
    const nn::StateDict& optim_at_2 = at_2.second;
    dist::ShardedCheckpointReader reader(set_path(dir.path, config));
    CHECK(reader.world_size() == 4);
    const nn::StateDict saved_model = reader.read_all("model."), saved_optim = reader.read_all("optimizer.");
    CHECK_MESSAGE(differences(saved_model, model_at_2, kTolerance).empty(),
                  differences(saved_model, model_at_2, kTolerance));
    CHECK_MESSAGE(differences(saved_optim, optim_at_2, kTolerance).empty(),
                  differences(saved_optim, optim_at_2, kTolerance));
  }
  for (const int world : {2, 3, 4}) {
    const int port = testing::free_port();
    const std::string failures = on_ranks(world, [&](int rank) {
      auto pg = join(rank, world, port);
      for (const Config& config : kConfigs) {
        dist::ShardedCheckpointReader reader(set_path(dir.path, config));
        Trainer trainer(config, pg, 99);
        trainer.load(reader);
        if (config.strategy == Strategy::Fsdp && world == 2) {
          // Only the files that overlap its shards; AdamW's step counts, saved by every rank,
          // come from one of those.
          const std::vector<std::string> want =
              rank == 0 ? std::vector<std::string>{"0", "1"} : std::vector<std::string>{"1", "2", "3"};
          const std::vector<std::string> got = opened_shards(reader);
          expect(got == want, config.name(), " at 2 ranks, rank ", rank, " opened ", got.size(),
                 " shard files");
        }
        // Resharded exactly: gathered back, the state is the set's, bit for bit.
        const nn::StateDict model = trainer.full_model(), optim = trainer.full_optim();
        const std::string model_diff = differences(model, reader.read_all("model."), 0);
        expect(model_diff.empty(), config.name(), " at ", world, " ranks, rank ", rank,
               ": loaded model differs:\n", model_diff);
        if (rank == 0 || config.strategy == Strategy::Fsdp) {
          const std::string optim_diff = differences(optim, reader.read_all("optimizer."), 0);
          expect(optim_diff.empty(), config.name(), " at ", world, " ranks, rank ", rank,
                 ": loaded optimizer state differs:\n", optim_diff);
        }
        trainer.train(kSavedAfter, kSteps);
        const std::string final_diff =
            differences(trainer.full_model(), train_reference(config.adamw, kSteps).first, kTolerance);
        expect(final_diff.empty(), config.name(), " at ", world, " ranks, rank ", rank,
               ": trained on from the set, differs from one process:\n", final_diff);
      }
    });
    CHECK_MESSAGE(failures.empty(), "loaded at ", world, " ranks: ", failures);
  }
}

TEST_CASE("a set and a full checkpoint hold the same state, and each loads into the other's runs") {
  TempDir dir;
  const Config fsdp_adamw{Strategy::Fsdp, true}, zero_adamw{Strategy::Zero1, true};
  const std::string full_path = dir.path + "/full.ckpt";
  // At 4 ranks after 2 steps: the set, and the full checkpoint fashion_mnist writes.
  int port = testing::free_port();
  std::string failures = on_ranks(4, [&](int rank) {
    auto pg = join(rank, 4, port);
    Trainer trainer(fsdp_adamw, pg, 7);
    trainer.train(0, kSavedAfter);
    dist::save_sharded_checkpoint(set_path(dir.path, fsdp_adamw), trainer.sharded(), *pg);
    nn::StateDict full;
    nn::merge_prefixed(full, "model.", trainer.full_model());
    nn::merge_prefixed(full, "optimizer.", trainer.full_optim());
    if (rank == 0) nn::save_checkpoint(full_path, full);
    pg->barrier()->wait();
  });
  REQUIRE_MESSAGE(failures.empty(), failures);
  const nn::StateDict full = nn::load_checkpoint(full_path);
  dist::ShardedCheckpointReader reader(set_path(dir.path, fsdp_adamw));
  CHECK_MESSAGE(differences(reader.read_all(), full, 0).empty(), differences(reader.read_all(), full, 0));

  const nn::StateDict want = train_reference(true, kSteps).first;
  // The set into a run with the whole state on one rank (DDP's, or one process's).
  {
    auto model = make_mlp(99);
    model->load_state_dict(reader.read_all("model."));
    auto opt = make_optimizer(true, model->parameters());
    opt->load_state_dict(reader.read_all("optimizer."));
    for (int s = kSavedAfter; s < kSteps; ++s) {
      const Batch b = global_batch(s);
      opt->zero_grad();
      cross_entropy((*model)(b.x), b.y).backward();
      opt->step();
    }
    CHECK_MESSAGE(differences(model->state_dict(), want, kTolerance).empty(),
                  differences(model->state_dict(), want, kTolerance));
  }
  // FSDP's set into ZeRO-1 at 3 ranks; the full checkpoint into FSDP at 3 ranks, which trains
  // one step, saves a set of its own, and that set into ZeRO-1 at 2 ranks.
  port = testing::free_port();
  failures = on_ranks(3, [&](int rank) {
    auto pg = join(rank, 3, port);
    dist::ShardedCheckpointReader fsdp_set(set_path(dir.path, fsdp_adamw));
    Trainer zero(zero_adamw, pg, 99);
    zero.load(fsdp_set);
    zero.train(kSavedAfter, kSteps);
    const std::string zero_diff = differences(zero.full_model(), want, kTolerance);
    expect(zero_diff.empty(), "ZeRO-1 from FSDP's set, rank ", rank, ":\n", zero_diff);

    Trainer fsdp(fsdp_adamw, pg, 99);
    const nn::StateDict saved = nn::load_checkpoint(full_path);
    fsdp.load_full(nn::strip_prefix(saved, "model."), nn::strip_prefix(saved, "optimizer."));
    fsdp.train(kSavedAfter, kSavedAfter + 1);
    dist::save_sharded_checkpoint(dir.path + "/at3.ckpt", fsdp.sharded(), *pg);
  });
  REQUIRE_MESSAGE(failures.empty(), failures);
  port = testing::free_port();
  failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    dist::ShardedCheckpointReader at3(dir.path + "/at3.ckpt");
    expect(at3.world_size() == 3, "the set says world size ", at3.world_size());
    Trainer zero(zero_adamw, pg, 99);
    zero.load(at3);
    zero.train(kSavedAfter + 1, kSteps);
    const std::string diff = differences(zero.full_model(), want, kTolerance);
    expect(diff.empty(), "full -> FSDP at 3 -> set -> ZeRO-1 at 2, rank ", rank, ":\n", diff);
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("a rank at W = 2 opens only the shard files of W = 4 that overlap its shard: rank 0 files 0 and 1, rank 1 files 1, 2 and 3") {
  TempDir dir;
  const std::string path = dir.path + "/model.ckpt";
  int port = testing::free_port();
  std::string failures = on_ranks(4, [&](int rank) {
    auto pg = join(rank, 4, port);
    dist::FSDPOptions options;
    options.auto_wrap_policy = dist::module_wrap_policy<nn::Linear>();
    dist::FullyShardedDataParallel fsdp(make_mlp(7), pg, options);
    dist::save_sharded_checkpoint(path, fsdp.sharded_model_state_dict(), *pg);
  });
  REQUIRE_MESSAGE(failures.empty(), failures);
  // The manifest: unit "2" (2.weight, 18 elements, then 2.bias, 3) in shards of 6 at W = 4.
  const nn::StateDict manifest = nn::load_checkpoint(path);
  CHECK(manifest.at("sharded_checkpoint.world_size").to_int_vector() == std::vector<int64_t>{4});
  CHECK(manifest.at("ranges/2.weight").to_int_vector() == std::vector<int64_t>{0, 6, 6, 12, 12, 18, 0, 0});
  CHECK(manifest.at("ranges/2.bias").to_int_vector() == std::vector<int64_t>{0, 0, 0, 0, 0, 0, 0, 3});
  CHECK(manifest.at("ranges/0.weight").to_int_vector() == std::vector<int64_t>{0, 9, 9, 18, 18, 27, 27, 30});
  port = testing::free_port();
  failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    dist::FSDPOptions options;
    options.auto_wrap_policy = dist::module_wrap_policy<nn::Linear>();
    dist::FullyShardedDataParallel fsdp(make_mlp(99), pg, options);
    dist::ShardedCheckpointReader reader(path);
    fsdp.load_state_dict(fsdp.read_local_state_dict(reader));
    std::vector<std::string> opened;
    for (const std::string& file : reader.files_read())
      opened.push_back(std::filesystem::path(file).filename());
    std::sort(opened.begin(), opened.end());
    const std::vector<std::string> want =
        rank == 0 ? std::vector<std::string>{"model.ckpt.g1.shard-0-of-4", "model.ckpt.g1.shard-1-of-4"}
                  : std::vector<std::string>{"model.ckpt.g1.shard-1-of-4", "model.ckpt.g1.shard-2-of-4",
                                             "model.ckpt.g1.shard-3-of-4"};
    std::string got;
    for (const std::string& file : opened) got += file + " ";
    expect(opened == want, "rank ", rank, " opened ", got);
    const std::string diff = differences(fsdp.full_state_dict(false), make_mlp(7)->state_dict(), 0);
    expect(diff.empty(), "rank ", rank, ": loaded model differs:\n", diff);
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("a save that fails on one rank, or a rank that dies mid-save, leaves the previous set loadable; the next save clears what they left") {
  TempDir dir;
  const std::string path = dir.path + "/run.ckpt";
  save_small(path, 10);  // generation 1
  // Rank 2's piece is one element short: every rank fails, rank 2 naming its entry.
  int port = testing::free_port();
  std::string failures = on_ranks(4, [&](int rank) {
    auto pg = join(rank, 4, port);
    dist::ShardedStateDict state = small_state(rank, 20);
    if (rank == 2) state["x"].piece = Tensor::full({1}, 0.0f);
    const std::string error = error_of([&] { dist::save_sharded_checkpoint(path, state, *pg); });
    if (rank == 2)
      expect(contains(error,
                      "'x' on rank 2: the piece of [4, 6) is 1 elements of float32, expected 2 of float32"),
             "rank 2: ", error);
    else
      expect(contains(error, "sharded checkpoint " + path + ": not saved, other ranks failed (rank 2: ") &&
                 contains(error, "still names the previous set"),
             "rank ", rank, ": ", error);
  });
  REQUIRE_MESSAGE(failures.empty(), failures);
  {
    dist::ShardedCheckpointReader reader(path);
    CHECK(reader.generation() == 1);
    CHECK(reader.read("x").to_vector() == small_x(10));
  }
  // Rank 3 dies in the save, before it writes: the others time out, and nothing is committed.
  port = testing::free_port();
  failures = testing::run_ranks(4, [&](int rank) {
    auto pg = join(rank, 4, port, /*timeout=*/2s);
    if (rank == 3) ::_exit(0);
    const std::string error =
        error_of([&] { dist::save_sharded_checkpoint(path, small_state(rank, 30), *pg, /*timeout=*/2s); });
    expect(!error.empty(), "rank ", rank, ": the save succeeded without rank 3");
  });
  REQUIRE_MESSAGE(failures.empty(), failures);
  // A save that died after every shard file was written, before the manifest: its files are
  // those of a whole set (made here by saving elsewhere) under path's next generation.
  save_small(dir.path + "/crashed.ckpt", 30);
  for (int r = 0; r < 4; ++r)
    std::filesystem::rename(dist::shard_file_name(dir.path + "/crashed.ckpt", 1, r, 4),
                            dist::shard_file_name(path, 3, r, 4));
  CHECK(std::filesystem::exists(path + ".g2.shard-0-of-4"));  // the failed save's
  {
    dist::ShardedCheckpointReader reader(path);
    CHECK(reader.generation() == 1);
    CHECK(reader.read("x").to_vector() == small_x(10));
    CHECK(reader.read("step").to_int_vector() == std::vector<int64_t>{10});
  }
  // The next save takes a generation past every file on disk, and removes what no manifest names.
  save_small(path, 40);
  dist::ShardedCheckpointReader now(path), previous(path + ".prev");
  CHECK(now.generation() == 4);
  CHECK(now.read("x").to_vector() == small_x(40));
  CHECK(previous.generation() == 1);
  CHECK(previous.read("x").to_vector() == small_x(10));
  CHECK(!std::filesystem::exists(path + ".g2.shard-0-of-4"));
  CHECK(!std::filesystem::exists(path + ".g3.shard-0-of-4"));
  CHECK(std::filesystem::exists(path + ".g1.shard-0-of-4"));
  save_small(path, 50);  // generation 1 is named by neither path nor path.prev now
  CHECK(!std::filesystem::exists(path + ".g1.shard-0-of-4"));
  CHECK(std::filesystem::exists(path + ".g4.shard-3-of-4"));
  CHECK(std::filesystem::exists(path + ".g5.shard-3-of-4"));
  CHECK(dist::remove_unused_shard_files(path) == 0);
  // A file that only has a shard file's name is someone else's: it stays. So do copies of
  // shard files under names that are not exactly a shard file's.
  const std::string foreign = path + ".g2.shard-1-of-4";
  std::ofstream(foreign) << "# My notes\n";
  const std::vector<std::string> copies = {path + ".g4.shard-0-of-4.bak", path + ".g4.shard-mine",
                                           path + ".g4.shard-0-of-4x", path + ".gx4.shard-0-of-4"};
  for (const std::string& copy : copies) std::filesystem::copy_file(path + ".g4.shard-0-of-4", copy);
  save_small(path, 60);
  CHECK(!std::filesystem::exists(path + ".g4.shard-3-of-4"));
  CHECK(std::filesystem::exists(foreign));
  for (const std::string& copy : copies) {
    CAPTURE(copy);
    CHECK(std::filesystem::exists(copy));
  }
  CHECK(dist::remove_unused_shard_files(path) == 0);
  // A set with a truncated shard file (a resume fell back to path.prev) is not kept as
  // path.prev by the next save: path.prev stays the set that loads, and the damaged one goes.
  CHECK(dist::ShardedCheckpointReader(path).generation() == 6);
  const std::string damaged = dist::shard_file_name(path, 6, 2, 4);
  std::filesystem::resize_file(damaged, std::filesystem::file_size(damaged) - 1);
  // What ranks killed while writing left: a dead writer's temporary goes, a live one's stays.
  const std::string dead_writer =
      temporary_file_prefix(dist::shard_file_name(path, 6, 1, 4)) + "999999999.abc123";
  const std::string live_writer =
      temporary_file_prefix(dist::shard_file_name(path, 6, 1, 4)) + std::to_string(::getpid()) + ".abc123";
  std::ofstream(dead_writer) << "half a shard";
  std::ofstream(live_writer) << "half a shard";
  save_small(path, 70);
  CHECK(dist::ShardedCheckpointReader(path).generation() == 7);
  dist::ShardedCheckpointReader kept(path + ".prev");
  CHECK(kept.generation() == 5);
  CHECK(kept.read("x").to_vector() == small_x(50));
  CHECK(!std::filesystem::exists(damaged));
  CHECK(!std::filesystem::exists(dead_writer));
  CHECK(std::filesystem::exists(live_writer));
}

TEST_CASE("a replicated entry must hold the same values on every rank that saves it whole") {
  // "bias" is saved whole by ranks 1 and 3 (state every rank has alike, as DDP's): a reader
  // takes it from either, so copies that differ would load as one or the other.
  TempDir dir;
  const std::string path = dir.path + "/run.ckpt";
  save_small(path, 10);
  for (const bool diverged : {false, true}) {
    const int port = testing::free_port();
    const std::string failures = on_ranks(4, [&](int rank) {
      auto pg = join(rank, 4, port);
      dist::ShardedStateDict state = small_state(rank, 20);
      if (rank % 2 == 1)
        state["bias"] = dist::whole_entry(Tensor::from_vector({1.5f, diverged && rank == 3 ? 2.75f : 2.5f}));
      const std::string error = error_of([&] { dist::save_sharded_checkpoint(path, state, *pg); });
      if (!diverged)
        expect(error.empty(), "rank ", rank, ": ", error);
      else
        expect(contains(error, "'bias' is held whole by ranks 1 and 3 with different values"), "rank ", rank,
               ": ", error);
    });
    REQUIRE_MESSAGE(failures.empty(), (diverged ? "diverged: " : "equal: "), failures);
  }
  dist::ShardedCheckpointReader reader(path);  // the equal save's set, not the refused one
  CHECK(reader.read("bias").to_vector() == std::vector<float>{1.5f, 2.5f});
  CHECK(reader.read("x").to_vector() == small_x(20));
}

TEST_CASE("ranks given different paths save nothing: every rank fails, naming the shard file rank 0 cannot find") {
  // Rank 1 writes b.ckpt's shard file, so a.ckpt's manifest would name a file nobody wrote (as
  // between machines that do not share the folder). a.ckpt keeps its set, and no a.ckpt.prev
  // takes it over.
  TempDir dir;
  const std::string path = dir.path + "/a.ckpt", other = dir.path + "/b.ckpt";
  save_small(path, 10);
  const int port = testing::free_port();
  const std::string failures = on_ranks(4, [&](int rank) {
    auto pg = join(rank, 4, port);
    const std::string error = error_of(
        [&] { dist::save_sharded_checkpoint(rank == 1 ? other : path, small_state(rank, 20), *pg); });
    expect(contains(error, "rank 0 does not find rank 1's shard file " + path + ".g2.shard-1-of-4 as rank 1 wrote it"),
           "rank ", rank, ": ", error);
  });
  REQUIRE_MESSAGE(failures.empty(), failures);
  CHECK(dist::ShardedCheckpointReader(path).read("x").to_vector() == small_x(10));
  CHECK(!std::filesystem::exists(path + ".prev"));
}

TEST_CASE("an entry every rank saved whole, read first, comes from the file set_reading_rank points at") {
  // What a resume reads before its shards (fashion_mnist's job id): from file 0 every rank
  // would open a file most of them need for nothing.
  TempDir dir;
  const std::string path = dir.path + "/run.ckpt";
  const int port = testing::free_port();
  const std::string failures = on_ranks(4, [&](int rank) {
    auto pg = join(rank, 4, port);
    dist::ShardedStateDict state = small_state(rank, 10);
    state["job"] = dist::whole_entry(Tensor::from_vector(std::vector<int64_t>{42}));
    dist::save_sharded_checkpoint(path, state, *pg);
  });
  REQUIRE_MESSAGE(failures.empty(), failures);
  const std::vector<std::pair<std::pair<int, int>, std::string>> cases = {
      {{0, 2}, "0"}, {{1, 2}, "2"}, {{1, 3}, "1"}, {{2, 3}, "2"}, {{3, 4}, "3"}, {{-1, 0}, "0"}};
  for (const auto& c : cases) {  // no structured binding: CAPTURE cannot capture one in C++17
    const int rank = c.first.first, world = c.first.second;
    CAPTURE(rank);
    CAPTURE(world);
    dist::ShardedCheckpointReader reader(path);
    if (world > 0) reader.set_reading_rank(rank, world);
    CHECK(reader.read("job").to_int_vector() == std::vector<int64_t>{42});
    CHECK(opened_shards(reader) == std::vector<std::string>{c.second});
    // The rank's own range then needs no other file for what that file holds.
    CHECK(reader.read("x").to_vector() == small_x(10));
  }
  dist::ShardedCheckpointReader reader(path);
  CHECK_THROWS_WITH_AS(reader.set_reading_rank(2, 2), doctest::Contains("reading rank 2 of 2 is not a rank"),
                       ValueError);
}

TEST_CASE("a name no checkpoint can hold, on one rank only, fails every rank at once, naming it") {
  // A control character (refused by checkpoint_bytes) or a name so long that the save report's
  // prefixed key passes 4096 bytes: the rank that has it must still reach the report's
  // all-gather, or its peers wait for the timeout.
  TempDir dir;
  const std::string path = dir.path + "/run.ckpt";
  for (const std::string& name : {std::string("a\tb"), std::string(4094, 'n')}) {
    const int port = testing::free_port();
    const std::string failures = on_ranks(4, [&](int rank) {
      auto pg = join(rank, 4, port, /*timeout=*/20s);
      dist::ShardedStateDict state = small_state(rank, 20);
      if (rank == 1) state[name] = dist::whole_entry(Tensor::from_vector({1.0f}));
      const auto start = std::chrono::steady_clock::now();
      const std::string error = error_of([&] { dist::save_sharded_checkpoint(path, state, *pg, 20s); });
      expect(std::chrono::steady_clock::now() - start < 10s, "rank ", rank, ": the save took ",
             std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), " s to fail");
      if (rank == 1)
        expect(!error.empty() && error.find("digest/") == std::string::npos, "rank 1: ", error);
      else
        expect(contains(error, "not saved, other ranks failed (rank 1: "), "rank ", rank, ": ", error);
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("a missing, truncated, corrupt or foreign shard file is an IOError naming it; reads that do not need it go on") {
  TempDir dir;
  const std::string path = dir.path + "/run.ckpt", other = dir.path + "/other.ckpt";
  save_small(path, 10);
  save_small(other, 70);
  const auto file = [&](int r) { return dist::shard_file_name(path, 1, r, 4); };

  std::filesystem::remove(file(2));
  dist::ShardedCheckpointReader reader(path);
  CHECK(reader.read_range("x", 0, 4).to_vector() ==
        std::vector<float>{10, 10, 11, 11});  // files 0 and 1 only
  std::string error = error_of([&] { reader.read("x"); });
  CHECK_MESSAGE(
      contains(error, "sharded checkpoint " + path + ": shard file " + file(2) + " (rank 2 of 4): "), error);

  const std::string bytes = testing::read_file(file(1));
  std::ofstream(file(1), std::ios::binary | std::ios::trunc) << bytes.substr(0, 20);
  error = error_of([&] { dist::ShardedCheckpointReader(path).read("x"); });
  CHECK_MESSAGE(contains(error, "shard file " + file(1) +
                                    " (rank 1 of 4): truncated at byte offset 20 (the manifest says " +
                                    std::to_string(bytes.size()) + " bytes)"),
                error);
  std::ofstream(file(1), std::ios::binary | std::ios::trunc) << bytes;

  std::string damaged = testing::read_file(file(0));
  damaged[damaged.size() / 2] ^= 0x5A;
  std::ofstream(file(0), std::ios::binary | std::ios::trunc) << damaged;
  error = error_of([&] { dist::ShardedCheckpointReader(path).read_range("x", 0, 2); });
  CHECK_MESSAGE(contains(error, "checkpoint " + file(0) + ": checksum mismatch"), error);

  std::filesystem::copy_file(dist::shard_file_name(other, 1, 3, 4), file(3),
                             std::filesystem::copy_options::overwrite_existing);
  error = error_of([&] { dist::ShardedCheckpointReader(path).read_range("x", 6, 8); });
  const bool named_foreign = contains(error, "shard file " + file(3) + " (rank 3 of 4): ") &&
                             contains(error, "it is not the file this set's save wrote");
  CHECK_MESSAGE(named_foreign, error);

  // A manifest whose ranges leave a gap is refused when it is read.
  nn::StateDict manifest = nn::load_checkpoint(path);
  manifest["ranges/x"] = Tensor::from_vector(std::vector<int64_t>{0, 2, 2, 4, 4, 6, 7, 8}, Shape({4, 2}));
  nn::save_checkpoint(dir.path + "/gap.ckpt", manifest);
  error = error_of([&] { dist::ShardedCheckpointReader(dir.path + "/gap.ckpt"); });
  CHECK_MESSAGE(contains(error, "sharded checkpoint " + dir.path +
                                    "/gap.ckpt: 'x': no rank holds elements from 6 (of 8)"),
                error);
  // A shape that is not a list of int64 sizes is the file's fault, named as such.
  manifest = nn::load_checkpoint(path);
  manifest["shape/x"] = Tensor::from_vector({8.0f});
  nn::save_checkpoint(dir.path + "/float_shape.ckpt", manifest);
  error = error_of([&] { dist::ShardedCheckpointReader(dir.path + "/float_shape.ckpt"); });
  CHECK_MESSAGE(
      contains(error,
               "sharded checkpoint " + dir.path +
                   "/float_shape.ckpt: the shape of 'x' is a [1] float32 entry, not a list of int64 sizes"),
      error);
}

TEST_CASE("the resharding case passes on Gloo too (this file with NANODDP_TEST_BACKEND=gloo)") {
  if (std::getenv("NANODDP_TEST_BACKEND") != nullptr) return;
  const testing::RunResult r = testing::rerun_with_backend("tests/test_sharded_checkpoint", "gloo",
                                                           "--test-case='a set saved at 4 ranks*'", 240s);
  CHECK_MESSAGE(r.code() == 0, "gloo run failed:\n", r.out, r.err);
}
