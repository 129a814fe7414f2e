// nanoddp in one include: tensors and autograd, layers, optimizers and schedules, checkpoints,
// datasets and DistributedSampler, process groups and DistributedDataParallel, ZeRO, the
// launcher as a library.
//
//   #include <nanoddp/nanoddp.h>      // or one module: #include <nanoddp/nn/layers.h>
//   auto pg = nanoddp::dist::init_process_group();
//   nanoddp::dist::DistributedDataParallel ddp(model, pg);
//
// Build flags: `pkg-config --cflags --libs nanoddp` for an installed copy, or
// `dependency('nanoddp')` in Meson (installed, or nanoddp as a subproject). Both put
// <prefix>/include/nanoddp on the include path too, because the headers include each other
// as "core/tensor.h"; docs/install.md, "Use nanoddp in your own project", has a whole example.
#pragma once

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/device.h"
#include "core/error.h"
#include "core/half.h"
#include "core/memory.h"
#include "core/op_helpers.h"
#include "core/ops.h"
#include "core/random.h"
#include "core/shape.h"
#include "core/tensor.h"
#include "core/trace.h"
#include "data/dataloader.h"
#include "data/dataset.h"
#include "data/fashion_mnist.h"
#include "data/idx.h"
#include "data/sampler.h"
#include "dist/comm_hooks.h"
#include "dist/ddp.h"
#include "dist/explain.h"
#include "dist/fsdp.h"
#include "dist/grad_scaler.h"
#include "dist/gradient_accumulation.h"
#include "dist/host_collectives.h"
#include "dist/host_staging.h"
#include "dist/init.h"
#include "dist/join.h"
#include "dist/launch.h"
#include "dist/process_group.h"
#include "dist/reducer.h"
#include "dist/ring.h"
#include "dist/sharded_checkpoint.h"
#include "dist/spawn.h"
#include "dist/store.h"
#include "dist/sync_batch_norm.h"
#include "dist/zero_redundancy_optimizer.h"
#include "nn/activation_checkpoint.h"
#include "nn/activations.h"
#include "nn/adam.h"
#include "nn/autocast.h"
#include "nn/batch_norm.h"
#include "nn/checkpoint.h"
#include "nn/clip_grad.h"
#include "nn/conv.h"
#include "nn/dropout.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "nn/lr_scheduler.h"
#include "nn/module.h"
#include "nn/normalization.h"
#include "nn/optim.h"
#include "nn/optimizer.h"
#include "nn/safetensors.h"
