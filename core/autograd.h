// Autograd: the graph of Nodes that backward() walks, how an op records itself in it, and the
// switch that turns recording off.
//
//   Tensor y = ...;                                              // the op's forward
//   return record("TanhBackward", y, /*inputs=*/{x}, /*saved=*/{y},
//                 [](const Node& node, const Tensor& dy) { ... node.saved(0) ... return grads; });
//   { NoGradGuard no_grad;  w.copy_(w_new); }                    // nothing here is recorded
//
// Every differentiable op records a Node holding the op's inputs (the graph's edges, Note
// [Graph edges]) and the tensors it saved for backward: with record() (a backward lambda
// right below the forward) or, for an op with more state, a Node subclass passed to
// make_result(). Tensor::backward runs the engine below:
//   1. walk the graph from the root, counting for each tensor how many consumers it feeds;
//   2. pop ready tensors (all consumers done) in reverse creation order, as PyTorch's engine
//      does, so a model's last layer gets its gradient first (Note [Bucket order] in dist/);
//   3. a non-leaf calls its Node's apply() and adds the returned gradients into its inputs'
//      buffers, then, unless retain_graph, releases the Node (its saved tensors dropped; the
//      edges stay), so activations are freed as backward passes them; a leaf that requires grad
//      adds its (complete) buffer into .grad and then runs its post-accumulate-grad hooks:
//      DDP's signal that this gradient is final;
//   4. the callbacks queued during the pass run (queue_callback).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/random.h"
#include "core/tensor.h"
#include "core/trace.h"

namespace nanoddp {

struct CheckpointFrame;  // a checkpointed region's kept inputs and recomputed tensors

struct Node {
  // Note [Graph teardown]
  // A node holds its inputs' handles, which hold their grad_fn nodes: a graph dropped without
  // backward (losses summed for a log line over 300000 steps) would free node by node in
  // nested destructors and overflow the stack. The destructor hands each input's grad_fn that
  // dies with it to the outermost node's destructor, which frees them one at a time (torch's
  // deleteNode does the same).
  virtual ~Node();
  // Gradients w.r.t. inputs (same order), given the gradient of this node's output.
  // An entry may be undefined when that input needs no gradient.
  virtual std::vector<Tensor> apply(const Tensor& grad_output) = 0;
  virtual const char* name() const = 0;
  // Drops the saved tensors after backward; overrides must call Node::release(), and set
  // freed_saved_tensors when they free state of their own that apply() reads. The edges stay
  // (they hold no memory, Note [Graph edges]): a second backward through a node that saved
  // nothing (a sum, an add, a reshape) runs again and accumulates, as in torch; one through a
  // node that saved something throws before any gradient moves. A product with a number
  // (mul(t, 0.5f)) saves nothing here and runs again; torch keeps the number as a tensor and
  // throws there.
  virtual void release() {
    // Undefined placeholders hold nothing (linear's input when only the bias needs a gradient).
    freed_saved_tensors =
        freed_saved_tensors || checkpoint_frame_ != nullptr ||
        std::any_of(saved_.begin(), saved_.end(), [](const Tensor& t) { return t.defined(); });
    saved_.clear();
    saved_versions_.clear();
    checkpoint_frame_.reset();
    released = true;
  }

  // Note [Saved tensors]
  // Backward often needs a value from forward: an input (linear's, for the weight's
  // gradient), the output (tanh's y, relu's) or a by-product (cross_entropy's softmax). It is
  // saved here, since edges keep no memory (Note [Graph edges]); a node saves only what its
  // formula reads. The output holds this Node as its grad_fn, so a Node holding the output
  // itself would be a reference cycle that never frees. What is kept is a detached handle:
  // the same storage and shape, no graph (torch's ctx.save_for_backward keeps outputs the
  // same way). An undefined tensor may be saved as a placeholder. Saved tensors go at
  // release(). They are what the graph holds, so they are counted as activations (Note
  // [Memory categories]). Inside a checkpointed region nothing is kept: the rerun saves them
  // (Note [Checkpointed regions]). Each keeps its memory's version at the save (Note [Version
  // counter] in core/storage.h): a tensor the user changed in place after the forward saved
  // it (x.fill_(0) between loss = f(x) and loss.backward()) would give a wrong gradient
  // silently, so reading it throws instead, as torch's "modified by an inplace operation".
  void save_for_backward(const std::vector<Tensor>& tensors);
  // The i-th saved tensor, in save_for_backward order. Throws ValueError after release(), or
  // when its memory's version differs from the one recorded at the save (naming the node, the
  // tensor's shape and both versions). In a checkpointed region the first read recomputes the region
  // (Note [Checkpointed regions]), which may throw what its forward throws.
  const Tensor& saved(size_t i) const;
  const std::vector<Tensor>& saved_tensors() const;
  // For a node of a checkpointed region: reruns the region if no node of it has yet, which
  // gives this node its saved tensors (Note [Checkpointed regions]). The engine calls it
  // before apply(); a no-op for any other node.
  void unpack_checkpointed() const;
  // Whether input i wants a gradient: defined and requiring grad (torch's
  // ctx.needs_input_grad[i]). A backward may skip computing the others.
  bool needs_input_grad(size_t i) const { return i < inputs.size() && inputs[i].defined() && inputs[i].requires_grad(); }

  // Note [Accumulating into .grad]
  // A leaf's .grad that already exists (zero_grad() without set_to_none, accumulation over
  // micro-batches, DDP's gradient_as_bucket_view) receives its new gradient by an add. When
  // this node's gradient is the only one input i gets in this backward, the engine offers
  // that .grad here during apply(): a node that can compute its gradient straight into it
  // (a GEMM with beta = 1, kernels::matmul) adds into it and returns it as input i's
  // gradient; the engine then runs the leaf's hooks without adding again. That saves the
  // temporary gradient and one pass over it. A node may ignore the offer and return a fresh
  // tensor as always. Undefined when nothing is offered, and never a tensor that shares
  // memory with the node's inputs, saved tensors or incoming gradient (a node that takes the
  // offer reads nothing else). A node that takes it writes .grad last, after every step of
  // apply() that can throw, so a failed backward leaves .grad as it was. The sum is
  // .grad + (this gradient), rounded as the GEMM accumulates: bit for bit a temporary then
  // an add when .grad is zero or the GEMM's inner dimension fits one Eigen block (on the
  // CPU: same bits for batches of 64 and 256 rows, not for 300), within rounding otherwise;
  // the CPU's panel loop (Note [Panel matmuls]) adds .grad after the whole sum, exactly a
  // temporary then an add. The node holds lock_grads() around its write (Note [Locking
  // .grad] in autograd.cpp), and the engine counts the add as an in-place change of the
  // .grad's memory (Note [Version counter]).
  const Tensor& accumulation_target(size_t i) const;
  // The lock every add into a leaf's .grad holds, so that backward passes on several threads
  // may share leaves (torch's AccumulateGrad locks each leaf likewise).
  static std::unique_lock<std::mutex> lock_grads();
  std::vector<Tensor> accumulation_targets;  // set by the engine around apply() only

  // Note [Graph edges]
  // A node's inputs are the graph's edges: where backward sends each gradient, and each
  // input's shape, dtype, device and requires_grad. An edge does not keep its input's memory,
  // as PyTorch's Edge holds the producing node and not the tensor: make_result() replaces an
  // input made by an op with a handle that has its grad_fn and metadata and no memory (data()
  // throws ValueError), and an input that is not in the graph (a leaf that needs no gradient,
  // a batch) the same way. A leaf that requires grad is held itself: its .grad is where its
  // gradient goes (torch's AccumulateGrad holds it too). So an activation no backward formula
  // reads, a convolution's output that only feeds a ReLU (which saves its own output), is
  // freed as soon as the forward lets it go. A backward reads values only through saved().
  std::vector<Tensor> inputs;
  uint64_t sequence_nr = 0;    // creation order; later nodes run first
  bool released = false;
  bool freed_saved_tensors = false;  // release() dropped saved tensors (or a checkpointed region's)

 private:
  friend struct CheckpointFrame;
  friend Tensor make_result(Tensor result, std::shared_ptr<Node> node);
  // Throws ValueError unless saved tensor i's memory is at the version recorded at the save.
  void check_saved_version(size_t i) const;
  std::vector<Tensor> saved_;
  std::vector<uint64_t> saved_versions_;  // each saved tensor's version at the save
  bool in_graph_ = false;  // attached to an output by make_result
  mutable std::shared_ptr<CheckpointFrame> checkpoint_frame_;  // set until unpacked
};

// A Node whose backward is a function: what record() builds.
struct FunctionNode : Node {
  // Gradients w.r.t. node.inputs (same order; undefined where not needed), given dout. It
  // reads values through node.saved(i) only, and metadata (shape, dtype, requires_grad)
  // through node.inputs (Note [Graph edges]). Capture no Tensor in it: save it (Note [Saved
  // tensors]).
  using Backward = std::function<std::vector<Tensor>(const Node& node, const Tensor& grad_output)>;
  FunctionNode(const char* name, Backward backward) : name_(name), backward_(std::move(backward)) {}
  std::vector<Tensor> apply(const Tensor& grad_output) override { return backward_(*this, grad_output); }
  const char* name() const override { return name_; }

 private:
  const char* name_;  // a string literal, "TanhBackward"
  Backward backward_;
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

// Sets grad mode on this thread for its lifetime (torch.enable_grad / set_grad_enabled).
class GradModeGuard {
 public:
  explicit GradModeGuard(bool enabled);
  ~GradModeGuard();
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool previous_;
};

// Note [Checkpointed regions]
// Activation checkpointing (torch.utils.checkpoint with use_reentrant=False) trades compute
// for memory: a region of the forward keeps only its inputs, and backward recomputes the
// rest. A graph holds activations only in the tensors its nodes save
// (save_for_backward; edges keep no memory, Note [Graph edges]). The region's graph is
// recorded as usual, with the real edges to the real parameters, so the engine walks it in
// its normal order and every leaf hook fires once, in the same backward: DDP's buckets and
// callbacks see nothing different. What changes is where the memory is:
//   1. forward: while the region runs, nodes save nothing, and each node attached is the
//      region's next slot. The frame keeps the region's inputs (detached) and a copy of every
//      Generator a random op draws from (checkpoint_generator), taken before the draw. So
//      when the region returns, nothing holds the tensors it made but for its outputs;
//   2. backward: the engine asks a node for its state before apply() (unpack_checkpointed).
//      The region's first node to be asked reruns its function on the kept inputs, with grad
//      mode on and the copied generators, so Dropout draws the same mask. The rerun records a
//      throwaway graph of the same ops: slot k's saved tensors go to the original node k;
//   3. a node is released right after its backward (unless retain_graph), so one region's
//      activations are alive at a time. The frame goes with the region's last node.
// This is torch's saved-tensor-hooks design: no nested backward runs, so nothing is reentrant.
// Same kernels on the same inputs give the same bits, so gradients are bitwise those of the
// run without checkpointing on the CPU. The rerun must record the same ops: one that records
// others throws ValueError. BatchNorm does not count the batch again in the rerun
// (is_recomputing). An input changed in place between forward and backward makes the rerun
// throw ValueError (Note [Version counter]; torch 1.13 reruns with the new values). A parameter
// changed in place is not detected, as in torch.

// Runs fn(inputs) as a checkpointed region and returns its outputs (what nn::checkpoint
// calls; see nn/activation_checkpoint.h for the contract). Without grad mode, or inside
// another region (forward or rerun), it simply calls fn: the outer region covers it.
std::vector<Tensor> run_checkpointed(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn,
                                     const std::vector<Tensor>& inputs);
// The generator a random op must draw from: gen itself, except while a checkpointed region
// is recomputed, where it is the copy of gen taken at the same draw in forward (so the rerun
// draws the same numbers and gen itself does not move). Random ops call it once per draw
// sequence, in the same order in forward and rerun. Throws ValueError when the rerun asks for
// more draws than the forward made.
Generator& checkpoint_generator(Generator& gen);
// Whether this thread is rerunning a checkpointed region now: ops with side effects beyond
// their output (BatchNorm's running statistics) skip them.
bool is_recomputing();

// Attaches node (with node->inputs already set) to result if grad mode is on and any input
// requires grad; then result.requires_grad() is true, and node->inputs are edges that keep
// no memory (Note [Graph edges]). Returns result.
Tensor make_result(Tensor result, std::shared_ptr<Node> node);

// Records an op: output was computed from inputs; saved are kept for backward (Note [Saved
// tensors]); backward(node, dout) returns one gradient per input. Returns output, attached to
// the graph when grad mode is on and an input requires grad; otherwise nothing is kept.
Tensor record(const char* name, Tensor output, std::vector<Tensor> inputs, const std::vector<Tensor>& saved,
              FunctionNode::Backward backward);

// A number for the backward pass running on this thread, a new one for each pass, 0 when none
// runs: how a hook tells this pass from an earlier one that an exception ended (whose queued
// callbacks never ran). DDP's Reducer keys its hooks to the pass its output's node ran in.
uint64_t backward_pass_id();

// Runs callback once the backward pass now running on this thread has finished, after every
// gradient and hook (torch's Variable._execution_engine.queue_callback), with grad mode off
// as the hooks. DDP queues its
// "wait for every bucket" step here. Throws ValueError when no backward is running.
// An exception thrown by a callback propagates out of backward().
void queue_callback(std::function<void()> callback);

// Times a differentiable op's forward as one event on the trace's compute lane, named by the
// op, with its inputs' shapes as args. Declared first thing in every op (core/ops.cpp, the
// layers in nn/, a user's op such as examples/custom_layer.cpp's), so that --trace shows the
// forward as well as the backward nodes; the op harness (tests/test_ops.cpp) checks that every
// row's forward records one. When tracing is off it costs one branch (Note [Trace cost] in
// core/trace.h).
//   ForwardSpan span("linear", {&input, &weight, &bias});
class ForwardSpan {
 public:
  ForwardSpan(const char* op, std::initializer_list<const Tensor*> inputs);

 private:
  trace::Span span_;
};

// "\"shapes\":\"[64, 784] [256, 784]\"": trace args naming tensors' shapes (undefined: "-").
std::string trace_shapes(std::initializer_list<const Tensor*> tensors);

// Runs the engine (see top of file). Called by Tensor::backward.
void run_backward(const Tensor& root, const Tensor& grad_root, bool retain_graph);

}  // namespace nanoddp
