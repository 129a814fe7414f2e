// Autograd: the graph of Nodes that backward() walks, and the switch that turns recording off.
//
//   { NoGradGuard no_grad;  w.copy_(w_new); }       // nothing here is recorded
//   struct MyBackward : Node { ... std::vector<Tensor> apply(const Tensor& dout) override; };
//
// Every differentiable op (core/ops.cpp) builds its output with make_result(), which records
// a Node holding the op's inputs and whatever it saved for backward. Tensor::backward runs
// the engine below:
//   1. walk the graph from the root, counting for each tensor how many consumers it feeds;
//   2. pop ready tensors (all consumers done) in reverse creation order, as PyTorch's engine
//      does, so a model's last layer gets its gradient first (Note [Bucket order] in dist/);
//   3. a non-leaf calls its Node's apply() and adds the returned gradients into its inputs'
//      buffers; a leaf that requires grad adds its (complete) buffer into .grad and then runs
//      its post-accumulate-grad hooks: DDP's signal that this gradient is final;
//   4. unless retain_graph, every visited Node is released (saved tensors dropped); then the
//      callbacks queued during the pass run (queue_callback).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace nanoddp {

struct Node {
  virtual ~Node() = default;
  // Gradients w.r.t. inputs (same order), given the gradient of this node's output.
  // An entry may be undefined when that input needs no gradient.
  virtual std::vector<Tensor> apply(const Tensor& grad_output) = 0;
  virtual const char* name() const = 0;
  // Drops saved tensors after backward; overrides must call Node::release().
  virtual void release() { inputs.clear(); released = true; }

  std::vector<Tensor> inputs;  // the op's tensor inputs: the graph's edges
  uint64_t sequence_nr = 0;    // creation order; later nodes run first
  bool released = false;
};

// Whether ops record graphs on this thread (torch.is_grad_enabled).
bool is_grad_enabled();

// Disables graph recording on this thread for its lifetime (torch.no_grad()).
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// Attaches node (with node->inputs already set) to result if grad mode is on and any input
// requires grad; then result.requires_grad() is true. Returns result.
Tensor make_result(Tensor result, std::shared_ptr<Node> node);

// Runs callback once the backward pass now running on this thread has finished, after every
// gradient and hook (torch's Variable._execution_engine.queue_callback). DDP queues its
// "wait for every bucket" step here. Throws ValueError when no backward is running.
// An exception thrown by a callback propagates out of backward().
void queue_callback(std::function<void()> callback);

// Runs the engine (see top of file). Called by Tensor::backward.
void run_backward(const Tensor& root, const Tensor& grad_root, bool retain_graph);

}  // namespace nanoddp
