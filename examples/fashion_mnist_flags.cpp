// fashion_mnist's and fashion_mnist_cnn's flags (examples/fashion_mnist.h): parsed into a
// FashionMnistConfig, checked, then handed to the training in examples/fashion_mnist.cpp.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <string>

#include "examples/fashion_mnist.h"
#include "examples/strategy_names.h"
#include "tools/cli_checks.h"

using namespace nanoddp;

int nanoddp::examples::fashion_mnist_main(int argc, char** argv, bool cnn) {
  examples::FashionMnistConfig config;
  config.cnn = cnn;
  if (cnn) config.batch_size = 32;
  const char* const kExample = config.example();
  CLI::App app{std::string(kExample) + ": " + (cnn ? "a CNN" : "an MLP") +
               " on Fashion-MNIST with DistributedDataParallel"};
  cli::set_option_defaults(app);
  app.add_option("--epochs", config.epochs, "epochs to train (in all, counting resumed ones)")
      ->check(cli::integer_in(1));
  app.add_option("--optimizer", config.optimizer,
                 "sgd (with --momentum), adam (L2 --weight-decay) or adamw (decoupled --weight-decay)")
      ->check(CLI::IsMember(examples::optimizer_names()));
  app.add_option("--lr", config.lr, "peak learning rate (default 0.05 for sgd, 1e-3 for adam and adamw)")
      ->check(cli::number_in(0));
  app.add_option("--momentum", config.momentum, "SGD momentum (default 0.9; sgd only)")
      ->check(cli::float_in(0));
  // float_in: SGD keeps its weight decay in a float.
  app.add_option("--weight-decay", config.weight_decay, "weight decay (default 0, or 1e-2 for adamw)")
      ->check(cli::float_in(0));
  app.add_option("--warmup-epochs", config.warmup_epochs,
                 "epochs of linear warm-up from lr/3 to lr, stepped per batch (LinearLR), before --schedule")
      ->check(cli::integer_in(0));
  app.add_option("--batch-size", config.batch_size, "examples per rank per step")->check(cli::integer_in(1));
  app.add_option("--seed", config.seed, "seed of the weights and of the data order")->check(cli::seed());
  config.group.add_to(app);
  app.add_option("--data-dir", config.data_dir, "folder with the four Fashion-MNIST IDX files")
      ->check(cli::folder_path());
  app.add_option("--checkpoint", config.checkpoint,
                 "file rank 0 writes after every epoch (and every --checkpoint-every steps; with "
                 "--checkpoint-format sharded, a set of files that every rank writes its part of)")
      ->check(cli::file_path());
  app.add_option(
         "--export", config.export_path,
         "safetensors file rank 0 writes the trained weights to, with PyTorch's names (0.weight, ...)")
      ->check(cli::file_path());
  app.add_option(
         "--metrics", config.metrics,
         "JSON-lines file rank 0 writes step, epoch, loss, lr, samples/s, test accuracy and wall time to "
         "(tools/plot draws it); --resume keeps the lines up to the checkpoint's step, a mid-epoch one's "
         "included")
      ->check(cli::file_path());
  app.add_flag("--resume", config.resume, "continue from --checkpoint if it exists");
  app.add_option(
         "--checkpoint-format", config.checkpoint_format,
         "full: one file that rank 0 writes; sharded: FILE names a set of files, one per rank "
         "(FILE.g<N>.shard-<r>-of-<W>), each written by its rank (--strategy zero1, zero2, fsdp). Either, "
         "saved at an epoch's end, resumes at any world size and strategy; a mid-epoch one "
         "(--checkpoint-every) "
         "at its own world size and --batch-size (docs/ddp/10-faults.md)")
      ->check(CLI::IsMember({"full", "sharded"}));
  app.add_option(
         "--checkpoint-every", config.checkpoint_every,
         "also save --checkpoint every this many optimizer steps during an epoch (0: at epoch ends only); a "
         "group restarted by nanoddp-run --max-restarts resumes from it by itself")
      ->check(cli::integer_in(0));
  app.add_option("--stop-after", config.stop_after,
                 "stop after this epoch (1..--epochs), as a job with a time limit would (the schedule still "
                 "spans --epochs; "
                 "0: never); rerun with --resume to go on")
      ->check(cli::integer_in(0));
  app.add_option("--schedule", config.schedule, "learning rate over training: cosine (to 0) or constant")
      ->check(CLI::IsMember({"cosine", "constant"}));
  app.add_flag("--no-overlap", config.no_overlap, "all-reduce after backward instead of during it");
  app.add_flag(
      "--gradient-as-bucket-view", config.gradient_as_bucket_view,
      "each .grad is a view of its DDP bucket (torch's gradient_as_bucket_view): no gradient copies, "
      "one copy of the gradients in memory");
  app.add_option(
         "--comm-hook", config.comm_hook,
         "how DDP reduces each gradient bucket: none (built in), allreduce (allreduce_hook), fp16 or bf16 "
         "(compressed to 16 bits: half the bytes)")
      ->check(CLI::IsMember({"none", "allreduce", "fp16", "bf16"}));
  app.add_option(
         "--strategy", config.strategy,
         "data parallelism: ddp (everything replicated), zero1 (optimizer state sharded), zero2 (gradients "
         "too: FSDP SHARD_GRAD_OP), fsdp (parameters too: FULL_SHARD); docs/ddp/12-sharding.md")
      ->check(CLI::IsMember(examples::strategy_names()));
  app.add_flag("--find-unused-parameters", config.find_unused_parameters,
               "DDP's find_unused_parameters: parameters may go unused; one more all-reduce per step "
               "(docs/ddp/04-hooks-and-buckets.md)");
  app.add_option(
         "--dp", config.dp,
         "the ladder's rung (docs/ladder.md): naive, flat, overlap (examples/ladder/), buckets (= --strategy "
         "ddp), zero1, fsdp (= --strategy zero1, fsdp)")
      ->check(CLI::IsMember(examples::dp_names()));
  app.add_option(
         "--accumulate", config.accumulate,
         "split each step's batch into K micro-batches, reduced once (no_sync on the first K-1; each loss "
         "weighted by its share of the samples): the same step, 1/K of the activations the layers save")
      ->check(cli::integer_in(1));
  app.add_flag("--prefetch", config.prefetch, "collate batches on a background thread");
  app.add_flag("--quiet", config.quiet, "only the final JSON line (and what --explain asks for)");
  app.add_option(
         "--precision", config.precision,
         "fp32, or bf16 / fp16: the forward under nn::autocast (Linear and Conv2d in 16 bits, float32 "
         "master weights and optimizer); fp16 adds a GradScaler (docs/mixed-precision.md)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_flag(
      "--checkpoint-activations", config.checkpoint_activations,
      "checkpoint every block (nn::checkpoint): backward reruns each block's forward instead of keeping its "
      "activations; the same gradients, bit for bit (docs/checkpointing.md)");
  if (cnn) {
    app.add_flag("--batch-norm", config.batch_norm,
                 "a BatchNorm2d after each convolution, statistics of this rank's batch");
    app.add_flag(
        "--sync-batch-norm", config.sync_batch_norm,
        "the same as SyncBatchNorm: statistics of every rank's batch together, three all-reduces per "
        "layer per step (docs/batch-norm.md)");
    // The CNN's layers are fixed (the model PyTorch's recipes train), so it has no --hidden;
    // one given is refused by name rather than taken and ignored.
    for (int i = 1; i < argc && std::string(argv[i]) != "--"; ++i) {
      const std::string arg = argv[i];
      if (arg == "--hidden" || arg.rfind("--hidden=", 0) == 0) {
        return cli::usage_error(
            kExample,
            "--hidden sets the widths of fashion_mnist's MLP; this CNN's layers are fixed (its "
            "hidden layer is Linear(1600, 128))");
      }
    }
  } else {
    app.add_option("--hidden", config.hidden,
                   "widths of the hidden layers, comma-separated (e.g. 1024,1024,512)")
        ->delimiter(',')
        ->check(cli::integer_in(1));
  }
  // Up to 1e6 MiB: the cap becomes a byte count, which a much larger number would overflow.
  app.add_option("--bucket-cap-mb", config.bucket_cap_mb,
                 "DDP bucket size cap in MiB (torch's bucket_cap_mb)")
      ->check(cli::number_in(1e-6, 1e6));
  app.add_option("--first-bucket-cap-mb", config.first_bucket_cap_mb, "cap of the first bucket in MiB")
      ->check(cli::number_in(1e-6, 1e6));
  app.add_option(
         "--trace", config.trace,
         "write a Chrome trace (ui.perfetto.dev) of the run to FILE; nanoddp-run merges the ranks' files")
      ->check(cli::file_path());
  app.add_flag(
      "--explain", config.explain,
      "print the bucket plan, then per step of each epoch the all-reduces, bytes and exposed communication");
  if (!cnn) {
    if (const std::string problem = cli::list_flag_problem(argc, argv, "--hidden"); !problem.empty())
      return cli::usage_error(kExample, problem);
  }
  if (auto code = cli::parse(app, argc, argv, kExample)) return *code;
  config.strategy_given = app.count("--strategy") > 0;
  config.bucket_cap_flag = app.count("--bucket-cap-mb") > 0         ? "--bucket-cap-mb"
                           : app.count("--first-bucket-cap-mb") > 0 ? "--first-bucket-cap-mb"
                                                                    : "";
  if (!config.dp.empty() && !config.strategy_given) config.strategy = examples::strategy_of_dp(config.dp);
  if (const std::string problem = examples::fashion_mnist_flags_problem(config); !problem.empty())
    return cli::usage_error(kExample, problem);
  try {
    return examples::run_fashion_mnist(config);
  } catch (const cli::UsageError& e) {
    return cli::usage_error(kExample, message_of(e));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", kExample, message_of(e).c_str());
    return 1;
  }
}
