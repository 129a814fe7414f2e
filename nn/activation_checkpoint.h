// Activation checkpointing (torch.utils.checkpoint.checkpoint, use_reentrant=False): a region
// of the forward keeps only its inputs; backward runs the region again to get the tensors
// its ops saved. One extra forward of the region buys back the memory of its activations.
//
//   Tensor h = nn::checkpoint([&](const Tensor& x) { return block(x); }, x);   // one block
//   model.checkpoint_blocks({1, 5, 9});    // nn::Sequential: children [1, 5), [5, 9), [9, end)
//
// How it works, and why backward stays a single pass that DDP's hooks see whole: Note
// [Checkpointed regions] in core/autograd.h. docs/checkpointing.md works the memory trade.
#pragma once

#include <functional>
#include <vector>

#include "core/tensor.h"

namespace nanoddp::nn {

// fn(inputs) -> outputs, run as a checkpointed region: the graph is recorded as usual (the
// outputs require grad when any input or any parameter fn uses does), but its nodes keep no
// saved tensors. The first backward that needs one reruns fn on the same inputs, with grad
// mode on and every generator a random op draws from (Dropout, Tensor::rand) in the state it
// had at that draw in forward: gradients are bitwise those of fn without checkpointing on the
// CPU. inputs: any tensors (undefined allowed); only their values are kept, not a copy. Under
// NoGradGuard, or inside another checkpointed region, fn simply runs (the outer region
// covers it). fn must run the same ops on the same inputs each time; a rerun that records
// other ops throws ValueError out of backward (torch's CheckpointError). An input changed in
// place between forward and backward makes that backward throw ValueError naming it (torch
// 1.13 reruns with the new values); a parameter changed so is not detected, as in torch,
// and gives the gradient of the new values. BatchNorm updates its running statistics once (the
// rerun skips it; torch 1.13 counts the batch twice); a BatchNorm switched between train and
// eval before backward makes the rerun record another node, refused as above. A copy of fn is
// kept until the region's backward: what it captures by reference (the layers) must live that
// long. Throws ValueError for an empty fn.
std::vector<Tensor> checkpoint(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn,
                               const std::vector<Tensor>& inputs);
// The one-input, one-output form: a block of layers.
Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& input);

}  // namespace nanoddp::nn
