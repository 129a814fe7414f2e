// The classic DDP tutorial (a 1-feature linear regression over 100 pairs (i, 2i)), corrected.
//
//   nanoddp-run --nproc-per-node 2 build/examples/toy_ddp        # or alone: build/examples/toy_ddp
//
// The tutorial it follows fed 1-feature inputs to Linear(2, 1) (a shape error) and trained on
// raw inputs up to 99 with lr 0.01, where SGD diverges. Here: Linear(1, 1), inputs [B, 1],
// x = i/100 and y = 2i/100, lr 0.1. --raw restores the unscaled data, and training then stops
// with an error naming the epoch and step where the loss stopped being finite.
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <optional>

#include "data/dataloader.h"
#include "dist/ddp.h"
#include "dist/init.h"
#include "examples/example_utils.h"
#include "examples/metrics.h"
#include "tools/cli_checks.h"
#include "nn/layers.h"
#include "nn/optim.h"

using namespace nanoddp;

namespace {

constexpr int64_t kPairs = 100;

std::shared_ptr<data::TensorDataset> toy_dataset(bool raw) {
  std::vector<float> xs, ys;
  const float scale = raw ? 1.0f : 100.0f;
  for (int64_t i = 0; i < kPairs; ++i) {
    xs.push_back(static_cast<float>(i) / scale);
    ys.push_back(2.0f * static_cast<float>(i) / scale);
  }
  return std::make_shared<data::TensorDataset>(Tensor::from_vector(xs, {kPairs, 1}), Tensor::from_vector(ys, {kPairs, 1}));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"toy_ddp: the classic DDP tutorial, corrected (Linear(1, 1) on y = 2x)"};
  int epochs = 5;
  float lr = 0.1f;
  int64_t batch_size = 8;
  bool raw = false;
  std::optional<float> init_weight, init_bias;
  std::string device_name = "cpu", backend = "auto";
  uint64_t seed = 0;
  std::string metrics_path;
  app.add_option("--epochs", epochs, "passes over the data")->check(cli::integer_in(1));
  app.add_option("--lr", lr, "SGD learning rate")->check(cli::number_in(0));
  app.add_option("--batch-size", batch_size, "examples per rank per step")->check(cli::integer_in(1));
  app.add_flag("--raw", raw, "the tutorial's unscaled data (x up to 99): SGD diverges");
  app.add_option("--init-weight", init_weight, "start from this weight instead of a random one");
  app.add_option("--init-bias", init_bias, "start from this bias instead of a random one");
  app.add_option("--seed", seed, "seed of the initial weights");
  app.add_option("--device", device_name, "cpu or cuda (rank r uses cuda:LOCAL_RANK)");
  app.add_option("--backend", backend, "auto, shm, gloo, mpi or nccl");
  app.add_option("--metrics", metrics_path, "JSON-lines file rank 0 writes one line per epoch to (examples/metrics.h)");
  CLI11_PARSE(app, argc, argv);

  try {
    const Device device = examples::rank_device(device_name);
    dist::InitOptions init;
    init.backend = dist::parse_backend(backend);
    init.device = device;
    auto pg = dist::init_process_group(init);
    const int rank = pg->rank(), world_size = pg->size();
    examples::MetricsLog metrics(rank == 0 ? metrics_path : "");

    auto dataset = toy_dataset(raw);
    data::DataLoaderOptions loader_options;
    loader_options.device = device;
    data::DataLoader loader(dataset, batch_size,
                            data::DistributedSampler(dataset->size(), world_size, rank, /*shuffle=*/false),
                            loader_options);

    Generator gen(seed);
    auto model = std::make_shared<nn::Linear>(1, 1, gen);
    if (init_weight) model->weight.fill_(*init_weight);
    if (init_bias) model->bias.fill_(*init_bias);
    model->to(device);
    dist::DistributedDataParallel ddp(model, pg);
    nn::SGD optimizer(ddp.parameters(), {lr});
    nn::MSELoss loss_fn;

    float last_loss = NAN;
    for (int epoch = 0; epoch < epochs; ++epoch) {
      loader.set_epoch(epoch);
      int64_t step = 0, samples = 0;
      double loss_sum = 0;
      const auto start = std::chrono::steady_clock::now();
      for (const data::Batch& batch : loader) {
        ++step;
        optimizer.zero_grad();
        Tensor loss = loss_fn(ddp(batch.input), batch.target);
        loss.backward();
        optimizer.step();
        last_loss = loss.item();
        loss_sum += last_loss;
        samples += batch.input.size(0);
        if (!std::isfinite(last_loss)) std::fflush(stdout);  // this rank's earlier lines first
        NANODDP_CHECK(std::isfinite(last_loss), ValueError, "the loss became ", last_loss, " at epoch ",
                      epoch + 1, ", step ", step, " on rank ", rank,
                      raw ? ": SGD diverges on the unscaled data (x up to 99); drop --raw or lower --lr"
                          : "; lower --lr or start from smaller --init-weight/--init-bias");
      }
      std::printf("Rank %d, Epoch [%d], Loss: %.6f\n", rank, epoch + 1, last_loss);
      examples::MetricsRecord record;
      record.step = (epoch + 1) * loader.size();
      record.epoch = epoch + 1;
      record.loss = loss_sum / static_cast<double>(std::max<int64_t>(step, 1));
      record.lr = lr;
      record.samples_per_s = static_cast<double>(samples) * world_size /
                             std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      metrics.write(record);
    }
    const Tensor weight = model->weight.to(Device::cpu()), bias = model->bias.to(Device::cpu());
    std::printf("{\"example\":\"toy_ddp\",\"rank\":%d,\"world_size\":%d,\"weight\":%s,\"bias\":%s,\"loss\":%s}\n",
                rank, world_size, examples::json_number(weight.item()).c_str(),
                examples::json_number(bias.item()).c_str(), examples::json_number(last_loss).c_str());
    std::fflush(stdout);
    pg->barrier()->wait();  // rank 0 serves the store: let every rank finish first
    dist::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "toy_ddp: %s\n", e.what());
    return 1;
  }
  return 0;
}
