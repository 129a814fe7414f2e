#include "core/autograd.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "core/autocast.h"
#include "core/memory.h"
#include "core/ops.h"
#include "core/storage.h"

namespace nanoddp {

namespace {

thread_local bool grad_mode_enabled = true;
// Note [Checkpointed regions]: the region whose forward runs now, and the one being rerun.
thread_local std::shared_ptr<CheckpointFrame> recording_frame;
thread_local CheckpointFrame* rerunning_frame = nullptr;
thread_local bool backward_running = false;
thread_local uint64_t running_backward_pass = 0;  // backward_pass_id()
std::atomic<uint64_t> next_backward_pass{1};
thread_local std::vector<std::function<void()>> backward_callbacks;

// Marks a backward pass as running and drops queued callbacks however it ends.
class BackwardScope {
 public:
  BackwardScope() {
    NANODDP_CHECK(!backward_running, ValueError, "backward() called from inside a backward pass (a hook?)");
    backward_running = true;
    running_backward_pass = next_backward_pass++;
  }
  ~BackwardScope() {
    backward_running = false;
    running_backward_pass = 0;
    backward_callbacks.clear();
  }
};
std::atomic<uint64_t> next_sequence_nr{0};

// Note [Graph edges]: input itself when it is a leaf that requires grad, else a handle with
// its grad_fn, shape, dtype, device and requires_grad, and a stand-in storage of its size
// with no memory.
Tensor graph_edge(const Tensor& input) {
  if (!input.defined() || (input.is_leaf() && input.requires_grad())) return input;
  auto edge = std::make_shared<TensorImpl>();
  edge->storage = std::make_shared<Storage>(nullptr, std::max<size_t>(input.impl()->storage->nbytes(), 1),
                                            input.device(), Storage::Deleter());
  edge->shape = input.shape();
  edge->dtype = input.dtype();
  edge->requires_grad = input.requires_grad();
  edge->grad_fn = input.grad_fn();
  return Tensor(std::move(edge));
}

// The engine's name for a tensor of the graph: its node, or the leaf itself. Edges to one
// tensor are distinct handles with one grad_fn (Note [Graph edges]).
const void* graph_key(const Tensor& t) {
  return t.grad_fn() ? static_cast<const void*>(t.grad_fn().get()) : static_cast<const void*>(t.impl());
}

// Adds g into a tensor's gradient buffer. The first gradient is kept as it is; a sum is
// always a fresh tensor, since slot or g may be shared (an add gives both inputs the same
// gradient tensor).
void accumulate_into(Tensor& slot, const Tensor& g) {
  if (!slot.defined()) {
    slot = g.is_leaf() && !g.requires_grad() ? g : g.detach();
    return;
  }
  if (slot.dtype() != DType::Float32) {  // a 16-bit intermediate used twice: add in float32, round once
    slot = add(slot, g);
    return;
  }
  Tensor sum = slot.clone();
  NANODDP_DISPATCH(sum.device(), accumulate, sum.data<float>(), g.data<float>(), 1.0f, g.numel());
  slot = sum;
}

// Throws ShapeError unless a gradient of (shape, dtype, device) can be added to leaf's .grad
// `grad` (undefined: nothing to add to). set_data can change a leaf after its .grad was made
// (torch then fails in the add: "The size of tensor a (2) must match the size of tensor b (8)").
void check_grad_takes(const Tensor& leaf, const Tensor& grad, const Shape& shape, DType dtype,
                      Device device) {
  NANODDP_CHECK(
      !grad.defined() || (grad.shape() == shape && grad.dtype() == dtype && grad.device() == device),
      ShapeError, "backward: a leaf ", leaf.shape(), " ", leaf.dtype(), " has a .grad of ", grad.shape(), " ",
      grad.dtype(), " on ", grad.device(), " that a gradient ", shape, " ", dtype, " on ", device,
      " cannot be added to (set_data changed the tensor after .grad was made? set_grad(Tensor()) first)");
}

// Note [Locking .grad]: backward passes on several threads may share leaves (torch locks each
// AccumulateGrad likewise). One process-wide lock covers every read of a leaf's .grad handle
// by the engine and every add into a .grad: the engine's own (accumulate_leaf_grad) and a
// node's into its accumulation target, which the node takes around that write alone
// (Node::lock_grads). It is never held while a node computes anything else, so a node that
// waits (SyncBatchNorm's all-reduce) holds nothing another thread's backward needs.
std::mutex& leaf_grad_mutex() {
  static std::mutex mutex;
  return mutex;
}

// A leaf's .grad accumulates across backward calls, as in PyTorch. The first gradient is
// taken over without a copy when nothing else can see it (PyTorch "steals" it the same way):
// no other handle to the tensor and no other tensor on its storage, which is not a view of
// another's (Note [Storage views]). A .grad that exists is accumulated into in place, so a
// .grad that is a view of a DDP bucket (gradient_as_bucket_view) stays one.
void accumulate_leaf_grad(const Tensor& leaf, Tensor g) {
  const std::lock_guard<std::mutex> lock(leaf_grad_mutex());
  Tensor current = leaf.grad();
  if (!current.defined()) {
    const bool unshared =
        g.use_count() == 1 && g.impl()->storage.use_count() == 1 && g.impl()->storage->base() == nullptr && g.is_leaf();
    Tensor grad = unshared ? g : g.clone();
    set_memory_category(grad, MemoryCategory::Gradients);
    const_cast<Tensor&>(leaf).set_grad(grad);
  } else {
    check_grad_takes(leaf, current, g.shape(), g.dtype(), g.device());
    NANODDP_DISPATCH(current.device(), accumulate, current.data<float>(), g.data<float>(), 1.0f, g.numel());
    current.impl()->storage->bump_version();  // Note [Version counter]
  }
}

// Note [Accumulating into .grad]: input i's .grad is offered when i is a leaf, this node is
// its last consumer in this backward and no other consumer gave it a gradient (so this one is
// its whole gradient), .grad can take it in place (float32, same shape and device), and
// .grad shares no memory with what the node reads (its saved tensors, the incoming gradient;
// its inputs too, of which only leaves have memory): writing into it must not change an
// operand of the same product.
void offer_accumulation_targets(Node& fn, const Tensor& grad_output,
                                const std::unordered_map<const void*, int>& pending,
                                const std::unordered_map<const void*, Tensor>& grads) {
  fn.accumulation_targets.assign(fn.inputs.size(), Tensor());
  const std::lock_guard<std::mutex> lock(leaf_grad_mutex());  // Note [Locking .grad]
  for (size_t i = 0; i < fn.inputs.size(); ++i) {
    const Tensor& input = fn.inputs[i];
    if (!fn.needs_input_grad(i) || input.grad_fn()) continue;
    if (pending.at(graph_key(input)) != 1 || grads.count(graph_key(input)) > 0) continue;
    const Tensor grad = input.grad();
    if (!grad.defined() || grad.dtype() != DType::Float32 || grad.shape() != input.shape() ||
        grad.device() != input.device() || grad.is_alias_of(grad_output))
      continue;
    bool read_by_node = false;
    for (const Tensor& operand : fn.inputs) read_by_node = read_by_node || grad.is_alias_of(operand);
    for (const Tensor& operand : fn.saved_tensors()) read_by_node = read_by_node || grad.is_alias_of(operand);
    if (!read_by_node) fn.accumulation_targets[i] = grad;
  }
}

// A saved tensor: a detached handle (Note [Saved tensors]), its allocation counted as an
// activation.
Tensor keep_for_backward(const Tensor& t) {
  if (!t.defined()) return t;
  set_memory_category(t, MemoryCategory::Activations);
  return t.detach();
}

// t's memory's version (Note [Version counter]); 0 for an undefined placeholder.
uint64_t version_of(const Tensor& t) { return t.defined() ? t.impl()->storage->version() : 0; }

// Throws ValueError unless t's memory is at `recorded`, the version the forward kept it at
// (Note [Version counter]): a backward would otherwise read the new values. who names t.
void check_unchanged(const std::string& who, const Tensor& t, uint64_t recorded) {
  if (!t.defined()) return;
  const uint64_t now = version_of(t);
  NANODDP_CHECK(
      now == recorded, ValueError, who, " (", t.shape(), " ", t.dtype(),
      ") was modified in place (copy_, fill_, zero_, or a backward adding into it as a .grad) after the "
      "forward saved it: it is at version ",
      now, ", the forward saved version ", recorded,
      ". Its backward would use the new values; clone it before changing it, or change it after backward "
      "(torch: \"modified by an inplace operation\")");
}

}  // namespace

// Note [Checkpointed regions]. Slot k is the k-th node the region's forward attached.
struct CheckpointFrame {
  std::function<std::vector<Tensor>(const std::vector<Tensor>&)> fn;
  std::vector<Tensor> inputs;                // detached; requires_grad as the originals
  std::vector<uint64_t> input_versions;      // each input's version when kept (Note [Version counter])
  std::vector<Generator> generators;         // each drawn-from generator, before the draw
  AutocastState autocast;                    // the forward's, so the rerun casts the same way
  std::vector<std::weak_ptr<Node>> nodes;    // per slot, attached in forward
  std::vector<std::shared_ptr<Node>> rerun;  // per slot, attached by the rerun
  size_t rerun_draws = 0;
  bool recomputed_done = false;

  // Step 2, once: rerun fn, then give each original node the rerun's saved tensors.
  void recompute() {
    if (recomputed_done) return;
    NANODDP_ASSERT(rerunning_frame == nullptr);
    // The rerun reads the inputs the region kept, as a backward reads its saved tensors.
    for (size_t i = 0; i < inputs.size(); ++i)
      check_unchanged("checkpoint: input " + std::to_string(i), inputs[i], input_versions[i]);
    trace::Span span(trace::Lane::Compute, "checkpoint_recompute");
    rerun.clear();
    rerun_draws = 0;
    {
      struct Rerun {  // restores the thread's state however fn ends
        std::shared_ptr<CheckpointFrame> recording = std::move(recording_frame);
        GradModeGuard grad{true};
        AutocastState autocast_outside = autocast_state();
        explicit Rerun(CheckpointFrame* frame) {
          rerunning_frame = frame;
          set_autocast_state(frame->autocast);
        }
        ~Rerun() {
          rerunning_frame = nullptr;
          recording_frame = std::move(recording);
          set_autocast_state(autocast_outside);
        }
      } guard(this);
      fn(inputs);  // its outputs go here; the rerun's nodes stay in `rerun`
    }
    NANODDP_CHECK(rerun.size() == nodes.size(), ValueError, "checkpoint: the recomputed region recorded ",
                  rerun.size(), " autograd nodes, its forward ", nodes.size(),
                  ": the function must run the same ops on the same inputs (torch.utils.checkpoint raises "
                  "CheckpointError)");
    for (size_t k = 0; k < nodes.size(); ++k) {
      const std::shared_ptr<Node> original = nodes[k].lock();
      const Node& again = *rerun[k];
      if (!original || original->released) continue;
      NANODDP_CHECK(std::string(original->name()) == again.name() && original->inputs.size() == again.inputs.size(),
                    ValueError, "checkpoint: node ", k, " of the region is ", original->name(),
                    " in forward and ", again.name(),
                    " when recomputed: the function must run the same ops on the same inputs");
      for (size_t j = 0; j < original->inputs.size(); ++j) {
        const Tensor& input = original->inputs[j];
        const Tensor& value = again.inputs[j];
        NANODDP_CHECK(input.defined() == value.defined() &&
                          (!input.defined() || (value.shape() == input.shape() && value.dtype() == input.dtype())),
                      ValueError, "checkpoint: input ", j, " of ", original->name(), " is ",
                      input.defined() ? input.shape().str() : std::string("undefined"),
                      " in forward and not when recomputed: the function must run the same ops on the same inputs");
      }
      original->saved_ = again.saved_;
      original->saved_versions_ = again.saved_versions_;
    }
    recomputed_done = true;
    rerun.clear();
    inputs.clear();
    generators.clear();
  }
};

Node::~Node() {
  // Note [Graph teardown]. Nodes are freed where their last owner lets go; the outermost
  // destructor on this thread collects the rest in `pending` and frees them in a loop.
  thread_local std::vector<std::shared_ptr<Node>>* pending = nullptr;
  std::vector<std::shared_ptr<Node>> collected;
  const bool outermost = pending == nullptr;
  if (outermost) pending = &collected;
  for (Tensor& input : inputs)
    if (input.defined() && input.use_count() == 1 && input.impl()->grad_fn)
      pending->push_back(std::move(input.impl()->grad_fn));
  if (!outermost) return;
  while (!collected.empty()) {
    std::shared_ptr<Node> next = std::move(collected.back());
    collected.pop_back();
    next.reset();  // its destructor appends its own inputs' nodes to `collected`
  }
  pending = nullptr;
}

void Node::save_for_backward(const std::vector<Tensor>& tensors) {
  if (recording_frame) return;  // step 1: the rerun saves them (Note [Checkpointed regions])
  // Counted as activations once the node is in a graph (make_result, or here when it already
  // is): a node made while no graph is recorded keeps nothing alive.
  for (const Tensor& t : tensors) {
    saved_.push_back(t.defined() ? t.detach() : t);
    saved_versions_.push_back(version_of(t));
    if (in_graph_) set_memory_category(t, MemoryCategory::Activations);
  }
}

void Node::check_saved_version(size_t i) const {
  check_unchanged(std::string(name()) + ": saved tensor " + std::to_string(i), saved_[i], saved_versions_[i]);
}

void Node::unpack_checkpointed() const {
  if (!checkpoint_frame_) return;
  checkpoint_frame_->recompute();
  checkpoint_frame_.reset();  // the last node of the region to unpack frees the frame
}

const std::vector<Tensor>& Node::saved_tensors() const {
  unpack_checkpointed();
  for (size_t i = 0; i < saved_.size(); ++i) check_saved_version(i);
  return saved_;
}

std::vector<Tensor> run_checkpointed(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn,
                                     const std::vector<Tensor>& inputs) {
  if (!grad_mode_enabled || recording_frame || rerunning_frame) return fn(inputs);
  auto frame = std::make_shared<CheckpointFrame>();
  frame->fn = fn;
  frame->autocast = autocast_state();
  for (const Tensor& input : inputs) {
    Tensor kept = keep_for_backward(input);
    frame->input_versions.push_back(version_of(input));
    // Set on the handle itself, not by set_requires_grad, whose float32 rule is for leaves
    // that receive a .grad: a 16-bit input (an autocast output) must make the rerun record too,
    // and nothing accumulates into this handle.
    if (input.defined() && input.requires_grad()) kept.impl()->requires_grad = true;
    frame->inputs.push_back(kept);
  }
  std::vector<Tensor> outputs;
  {
    struct Recording {  // step 1 for the region's forward, however fn ends
      explicit Recording(std::shared_ptr<CheckpointFrame> frame) { recording_frame = std::move(frame); }
      ~Recording() { recording_frame.reset(); }
    } recording(frame);
    outputs = fn(inputs);
  }
  return outputs;
}

Generator& checkpoint_generator(Generator& gen) {
  if (rerunning_frame) {
    CheckpointFrame& frame = *rerunning_frame;
    NANODDP_CHECK(frame.rerun_draws < frame.generators.size(), ValueError,
                  "checkpoint: the recomputed region draws random numbers more often than its forward (",
                  frame.generators.size(), " times): the function must run the same ops on the same inputs");
    return frame.generators[frame.rerun_draws++];
  }
  if (recording_frame) recording_frame->generators.push_back(gen);
  return gen;
}

bool is_recomputing() { return rerunning_frame != nullptr; }

bool is_grad_enabled() { return grad_mode_enabled; }

std::string trace_shapes(std::initializer_list<const Tensor*> tensors) {
  std::string shapes;
  for (const Tensor* t : tensors) {
    if (!shapes.empty()) shapes += ' ';
    shapes += t->defined() ? t->shape().str() : std::string("-");
  }
  return "\"shapes\":" + trace::json_string(shapes);
}

ForwardSpan::ForwardSpan(const char* op, std::initializer_list<const Tensor*> inputs)
    : span_(trace::Lane::Compute, op) {
  if (span_.active()) span_.set_args(trace_shapes(inputs));
}

NoGradGuard::NoGradGuard() : previous_(grad_mode_enabled) { grad_mode_enabled = false; }
NoGradGuard::~NoGradGuard() { grad_mode_enabled = previous_; }
GradModeGuard::GradModeGuard(bool enabled) : previous_(grad_mode_enabled) { grad_mode_enabled = enabled; }
GradModeGuard::~GradModeGuard() { grad_mode_enabled = previous_; }

Tensor make_result(Tensor result, std::shared_ptr<Node> node) {
  if (!grad_mode_enabled) return result;
  bool any_requires_grad = false;
  for (const Tensor& input : node->inputs) any_requires_grad |= input.defined() && input.requires_grad();
  if (!any_requires_grad) return result;
  node->sequence_nr = next_sequence_nr++;
  for (Tensor& input : node->inputs) input = graph_edge(input);
  for (const Tensor& t : node->saved_) set_memory_category(t, MemoryCategory::Activations);
  node->in_graph_ = true;
  if (recording_frame) {  // Note [Checkpointed regions], step 1
    node->checkpoint_frame_ = recording_frame;
    recording_frame->nodes.push_back(node);
  } else if (rerunning_frame) {
    rerunning_frame->rerun.push_back(node);
  }
  result.impl()->grad_fn = std::move(node);
  result.impl()->requires_grad = true;
  return result;
}

std::unique_lock<std::mutex> Node::lock_grads() { return std::unique_lock<std::mutex>(leaf_grad_mutex()); }

const Tensor& Node::accumulation_target(size_t i) const {
  static const Tensor none;
  return i < accumulation_targets.size() ? accumulation_targets[i] : none;
}

const Tensor& Node::saved(size_t i) const {
  NANODDP_CHECK(!released, ValueError, name(), ": saved tensors were freed by an earlier backward (pass retain_graph)");
  unpack_checkpointed();
  NANODDP_ASSERT(i < saved_.size());
  check_saved_version(i);
  return saved_[i];
}

Tensor record(const char* name, Tensor output, std::vector<Tensor> inputs, const std::vector<Tensor>& saved,
              FunctionNode::Backward backward) {
  if (!grad_mode_enabled) return output;
  bool any_requires_grad = false;
  for (const Tensor& input : inputs) any_requires_grad |= input.defined() && input.requires_grad();
  if (!any_requires_grad) return output;  // nothing saved: inference keeps no memory alive
  auto node = std::make_shared<FunctionNode>(name, std::move(backward));
  node->inputs = std::move(inputs);
  node->save_for_backward(saved);
  return make_result(std::move(output), std::move(node));
}

uint64_t backward_pass_id() { return running_backward_pass; }

void queue_callback(std::function<void()> callback) {
  NANODDP_CHECK(backward_running, ValueError, "queue_callback outside a backward pass");
  backward_callbacks.push_back(std::move(callback));
}

void run_backward(const Tensor& root, const Tensor& grad_root, bool retain_graph) {
  BackwardScope scope;
  trace::Span backward_span(trace::Lane::Compute, "backward");  // every node and callback below
  NANODDP_CHECK(root.requires_grad(), ValueError,
                "backward() on a tensor that does not require grad and has no grad_fn");
  Tensor seed = grad_root;
  if (!seed.defined()) {
    NANODDP_CHECK(root.numel() == 1, ValueError, "backward() without a gradient needs a one-element output, got ",
                  root.shape(), "; pass a gradient of that shape");
    seed = Tensor::ones(root.shape(), DType::Float32, root.device()).to(root.dtype());
  } else {
    NANODDP_CHECK(seed.shape() == root.shape(), ShapeError, "backward: gradient ", seed.shape(),
                  " does not match output ", root.shape());
    NANODDP_CHECK(seed.dtype() == DType::Float32 || is_16bit_float(seed.dtype()), ValueError,
                  "backward: gradient must be float32, float16 or bfloat16, got ", seed.dtype());
    // torch.autograd.backward refuses a gradient on another device than its output.
    NANODDP_CHECK(seed.device() == root.device(), DeviceError, "backward: gradient on ", seed.device(),
                  " for an output on ", root.device(), " (shape ", root.shape(), "); move it with .to(",
                  root.device(), ")");
    // As torch's engine (validate_outputs): the gradient takes its output's dtype, so that
    // every node sees gradients of the dtype it produced.
    if (seed.dtype() != root.dtype()) seed = seed.detach().to(root.dtype());
  }

  // 1. Count, for every tensor in the graph, how many graph edges point at it.
  // Only keys are kept: holding every edge would keep every node, and what it saved, alive
  // to the end of the pass (a consumer's edge keeps a node while the consumer waits).
  std::unordered_map<const void*, int> pending;
  {
    std::vector<Tensor> stack{root};
    std::unordered_set<const void*> seen{graph_key(root)};
    while (!stack.empty()) {
      Tensor t = stack.back();
      stack.pop_back();
      const auto& fn = t.grad_fn();
      if (!fn) {
        // A leaf's .grad that set_data left at another shape fails here, before anything moves.
        if (t.requires_grad()) {
          const std::lock_guard<std::mutex> lock(leaf_grad_mutex());  // Note [Locking .grad]
          check_grad_takes(t, t.grad(), t.shape(), t.dtype(), t.device());
        }
        continue;
      }
      NANODDP_CHECK(!fn->freed_saved_tensors, ValueError, "backward through ", fn->name(),
                    " a second time: its saved tensors were freed by the first backward (pass retain_graph)");
      for (const Tensor& input : fn->inputs) {
        if (!input.defined() || !input.requires_grad()) continue;
        ++pending[graph_key(input)];
        if (seen.insert(graph_key(input)).second) stack.push_back(input);
      }
    }
  }

  // 2-3. Process ready tensors: leaves first, then the most recently created node.
  auto priority = [](const Tensor& t) {
    return t.grad_fn() ? t.grad_fn()->sequence_nr : UINT64_MAX;
  };
  auto later_first = [&](const Tensor& a, const Tensor& b) { return priority(a) < priority(b); };
  std::priority_queue<Tensor, std::vector<Tensor>, decltype(later_first)> ready(later_first);
  std::unordered_map<const void*, Tensor> grads;
  grads[graph_key(root)] = seed;
  ready.push(root);
  std::unordered_set<const void*> accumulated_in_place;  // leaves whose node added into .grad

  while (!ready.empty()) {
    Tensor t = ready.top();
    ready.pop();
    Tensor g;
    if (auto it = grads.find(graph_key(t)); it != grads.end()) {
      g = it->second;
      grads.erase(it);
    }
    const std::shared_ptr<Node> fn = t.grad_fn();
    if (!fn) {
      const bool has_gradient = g.defined() || accumulated_in_place.erase(graph_key(t)) > 0;
      if (g.defined()) accumulate_leaf_grad(t, std::move(g));
      if (has_gradient) {
        NoGradGuard no_grad;  // as torch's engine runs hooks: what they compute is not recorded
        // A hook may remove itself or another, or register more (which changes the list it
        // is in): run the ones registered now, each unless removed meanwhile.
        const auto hooks = t.impl()->post_accumulate_grad_hooks;
        for (const auto& [id, hook] : hooks) {
          const auto& current = t.impl()->post_accumulate_grad_hooks;
          if (std::any_of(current.begin(), current.end(), [id = id](const auto& h) { return h.first == id; }))
            (*hook)(t);
        }
      }
      continue;
    }
    // A tensor whose consumers all returned no gradient still runs, with none, so that the
    // counts of the tensors it was made from reach zero.
    std::vector<Tensor> input_grads(fn->inputs.size());
    struct ClearTargets {  // the offer ends with this node's turn, however it ends
      Node& node;
      ~ClearTargets() { node.accumulation_targets.clear(); }
    } clear_targets{*fn};
    if (g.defined()) {
      trace::Span span(trace::Lane::Compute, fn->name());
      if (span.active()) span.set_args(trace_shapes({&g}));
      NoGradGuard no_grad;  // backward formulas are not themselves recorded
      fn->unpack_checkpointed();  // a checkpointed region reruns here (Note [Checkpointed regions])
      offer_accumulation_targets(*fn, g, pending, grads);
      input_grads = fn->apply(g);
    }
    NANODDP_ASSERT(input_grads.size() == fn->inputs.size());
    for (size_t i = 0; i < fn->inputs.size(); ++i) {
      const Tensor& input = fn->inputs[i];
      if (!fn->needs_input_grad(i)) continue;
      const Tensor& target = fn->accumulation_target(i);
      if (target.defined() && input_grads[i].defined() && input_grads[i].is_same(target)) {
        accumulated_in_place.insert(graph_key(input));  // Note [Accumulating into .grad]
        target.impl()->storage->bump_version();         // Note [Version counter]
      } else if (input_grads[i].defined()) {
        // A leaf whose data set_data replaced after the forward used it gets a gradient of its
        // old shape (torch fails in the add: "The size of tensor a (2) must match ...").
        NANODDP_CHECK(input.grad_fn() != nullptr || (input_grads[i].shape() == input.shape() &&
                                                     input_grads[i].dtype() == input.dtype()),
                      ShapeError, "backward: a leaf ", input.shape(), " ", input.dtype(), " gets a gradient ",
                      input_grads[i].shape(), " ", input_grads[i].dtype(),
                      " from the forward that used it: set_data changed the tensor between the forward and "
                      "this backward");
        NANODDP_ASSERT(input_grads[i].shape() == input.shape() && input_grads[i].dtype() == input.dtype());
        accumulate_into(grads[graph_key(input)], input_grads[i]);
      }
      if (--pending[graph_key(input)] == 0) ready.push(input);
    }
    if (!retain_graph) fn->release();  // its saved activations go now, not at the end
  }

  // 4. Run what hooks queued for the end of the pass.
  NoGradGuard no_grad;
  for (size_t i = 0; i < backward_callbacks.size(); ++i) {
    auto callback = std::move(backward_callbacks[i]);
    callback();
  }
}

}  // namespace nanoddp
