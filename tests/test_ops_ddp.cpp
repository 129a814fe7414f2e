// The op harness, DDP column: for every row of tests/op_cases.cpp with a model builder, 2 ranks
// (Gloo, forked) x 8 samples train exactly like 1 rank on the 16-sample batch. Rank 1 starts
// from other weights, so DDP's broadcast is part of what is checked; parameters and buffers
// (running statistics) are compared. A row with batch statistics (BatchNorm) normalises each
// rank's 8 samples on their own, so plain DDP must differ from the 1-rank run (it is not the
// same training), and the same model after convert_sync_batchnorm must equal it.
#include <doctest/doctest.h>

#include <cmath>
#include <sstream>

#include "dist/ddp.h"
#include "dist/init.h"
#include "dist/sync_batch_norm.h"
#include "nn/optim.h"
#include "tests/multiprocess.h"
#include "tests/op_cases.h"

using namespace nanoddp;
using namespace nanoddp::testing;

namespace {

constexpr int kSteps = 3;
constexpr int64_t kGlobalBatch = 16;
constexpr float kTolerance = 2e-5f;  // float rounding: the ranks sum in another order

struct Batch {
  Tensor x, y;
};

// Step s's global batch: [16, sample...] normals and labels in [0, 3).
Batch global_batch(const Shape& sample, int step) {
  Generator gen(500 + step);
  std::vector<int64_t> sizes{kGlobalBatch};
  for (int64_t s : sample.sizes()) sizes.push_back(s);
  Tensor x = Tensor::randn(Shape(sizes), gen);
  std::vector<int64_t> labels;
  for (int64_t i = 0; i < kGlobalBatch; ++i) labels.push_back(static_cast<int64_t>(gen.randint(3)));
  return {x, Tensor::from_vector(labels)};
}

// Samples [begin, end) of a batch.
Batch slice(const Batch& b, int64_t begin, int64_t end) {
  const int64_t per_sample = b.x.numel() / kGlobalBatch;
  std::vector<int64_t> sizes = b.x.shape().sizes();
  sizes[0] = end - begin;
  const std::vector<float> xs = b.x.to_vector();
  const std::vector<int64_t> ys = b.y.to_int_vector();
  return {Tensor::from_vector(std::vector<float>(xs.begin() + begin * per_sample, xs.begin() + end * per_sample),
                              Shape(sizes)),
          Tensor::from_vector(std::vector<int64_t>(ys.begin() + begin, ys.begin() + end))};
}

// The largest |a - b| of each named tensor, one line each, and whether all are <= tolerance.
bool compare(const std::vector<std::pair<std::string, Tensor>>& got, const std::vector<Tensor>& want,
             std::ostringstream& report, float* largest) {
  bool ok = got.size() == want.size();
  *largest = 0;
  for (size_t i = 0; ok && i < want.size(); ++i) {
    float worst = 0;
    if (want[i].dtype() == DType::Int64) {  // num_batches_tracked: equal or not
      worst = got[i].second.to_int_vector() == want[i].to_int_vector() ? 0.0f : HUGE_VALF;
    } else {
      const std::vector<float> a = got[i].second.to_vector(), b = want[i].to_vector();
      for (size_t j = 0; j < a.size(); ++j) worst = std::max(worst, std::abs(a[j] - b[j]));
    }
    report << got[i].first << ": max |diff| " << worst << "\n";
    ok = ok && worst <= kTolerance;
    *largest = std::max(*largest, worst);
  }
  return ok;
}

// Parameters, then buffers, with their names.
std::vector<std::pair<std::string, Tensor>> named_state(const nn::Module& model) {
  auto named = model.named_parameters();
  for (auto& entry : model.named_buffers()) named.push_back(entry);
  return named;
}

std::vector<Tensor> train_one_rank(const OpCase& c) {
  Generator gen(7);
  auto model = c.model(gen);
  nn::SGD opt(model->parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
  for (int s = 0; s < kSteps; ++s) {
    const Batch b = global_batch(c.sample, s);
    opt.zero_grad();
    cross_entropy((*model)(b.x), b.y).backward();
    opt.step();
  }
  std::vector<Tensor> state;
  for (auto& [name, t] : named_state(*model)) state.push_back(t);
  return state;
}

// 2-rank DDP for kSteps on this rank's half of each global batch; sync: the model's
// BatchNorm layers converted to SyncBatchNorm first.
std::vector<std::pair<std::string, Tensor>> train_ddp(const OpCase& c, int rank,
                                                      const std::shared_ptr<dist::ProcessGroup>& pg, bool sync) {
  Generator gen(rank == 0 ? 7 : 99);
  auto model = c.model(gen);
  if (sync) dist::convert_sync_batchnorm(model, pg);
  dist::DistributedDataParallel ddp(model, pg);
  nn::SGD opt(ddp.parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
  const int64_t half = kGlobalBatch / 2;
  for (int s = 0; s < kSteps; ++s) {
    const Batch b = slice(global_batch(c.sample, s), half * rank, half * (rank + 1));
    opt.zero_grad();
    cross_entropy(ddp(b.x), b.y).backward();
    opt.step();
  }
  return named_state(*model);
}

}  // namespace

TEST_CASE("op harness: 2-rank DDP equals 1-rank training on a model around each op") {
  int checked = 0;
  for (const OpCase& c : op_cases()) {
    if (!c.model) continue;
    ++checked;
    CAPTURE(c.name);
    const int port = free_port();
    const std::string failures = run_ranks(2, [&](int rank) {
      dist::InitOptions options;
      options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
      options.rank = rank;
      options.world_size = 2;
      options.backend = dist::Backend::Gloo;
      options.timeout = std::chrono::seconds(30);
      auto pg = dist::init_process_group(options);
      const std::vector<Tensor> want = train_one_rank(c);
      std::ostringstream report, synced_report;
      float largest = 0, synced_largest = 0;
      const bool same = compare(train_ddp(c, rank, pg, /*sync=*/false), want, report, &largest);
      const bool synced_same =
          !c.batch_statistics || compare(train_ddp(c, rank, pg, /*sync=*/true), want, synced_report, &synced_largest);
      pg->barrier()->wait();
      dist::destroy_process_group();
      if (c.batch_statistics) {  // per-rank statistics: a different training, by far more than rounding
        expect(!same && largest > 100 * kTolerance, "rank ", rank,
               " with per-rank batch statistics should differ from the 1-rank run:\n", report.str());
        expect(synced_same, "rank ", rank, " with SyncBatchNorm differs from the 1-rank reference:\n",
               synced_report.str());
      } else {
        expect(same, "rank ", rank, " differs from the 1-rank reference:\n", report.str());
      }
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
  CHECK(checked >= 4);
}
