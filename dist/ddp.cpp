#include "dist/ddp.h"

#include <algorithm>
#include <sstream>

#include "core/autograd.h"
#include "dist/detail.h"
#include "dist/host_collectives.h"

namespace nanoddp::dist {

namespace {

// Note [Frozen parameters]
// A parameter with requires_grad false (a frozen layer in fine-tuning) gets no gradient, so
// it is left out of the buckets, as PyTorch's DDP builds its reducer from the parameters that
// require grad only. It still takes part in construction: its shape is checked and rank 0's
// value broadcast like any other, and whether it requires grad must agree across ranks (else
// the ranks would plan different buckets, and their all-reduces would not match).
// The plan is fixed at construction, so requires_grad must not change afterwards: a parameter
// unfrozen later has no hook and no bucket, and each rank would step it with its own
// gradient, drifting apart without any error (what PyTorch's DDP does); one frozen later
// never becomes ready. forward() compares each parameter's flag with construction's.
std::vector<std::pair<std::string, Tensor>> trainable(std::vector<std::pair<std::string, Tensor>> named) {
  named.erase(std::remove_if(named.begin(), named.end(), [](const auto& np) { return !np.second.requires_grad(); }),
              named.end());
  return named;
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> pg,
                                                 DDPOptions options)
    : module_(register_module("module", std::move(module))),
      pg_(std::move(pg)),
      timeout_(options.timeout),
      broadcast_buffers_(options.broadcast_buffers) {
  NANODDP_CHECK(module_ != nullptr && pg_ != nullptr, ValueError, "DistributedDataParallel needs a module and a process group");
  NANODDP_CHECK(options.reduce_dtype == DType::Float32 || is_16bit_float(options.reduce_dtype), ValueError,
                "DistributedDataParallel: reduce_dtype must be float32, float16 or bfloat16, got ",
                options.reduce_dtype);
  verify_model_matches();
  // After the check, which makes requires_grad agree across ranks: every rank throws or none.
  const std::vector<Tensor> params = module_->parameters();
  NANODDP_CHECK(std::any_of(params.begin(), params.end(), [](const Tensor& p) { return p.requires_grad(); }),
                ValueError, "DistributedDataParallel is not needed when a module has no parameter that requires a "
                "gradient (it has ", params.size(), params.size() == 1 ? " parameter" : " parameters",
                params.empty() ? "" : ", all frozen", "): there is nothing to average. Call the module directly");
  broadcast_parameters(/*root=*/0);
  broadcast_buffers(/*root=*/0);
  reducer_ = std::make_shared<Reducer>(trainable(module_->named_parameters()), pg_, options);
  if (options.reduce_dtype != DType::Float32) {
    register_comm_hook(pg_, options.reduce_dtype == DType::BFloat16 ? bf16_compress_hook : fp16_compress_hook);
    reduce_dtype_ = options.reduce_dtype;  // after: register_comm_hook refuses once it is set
  }
  for (const Tensor& p : params) requires_grad_at_construction_.emplace_back(p, p.requires_grad());
}

void DistributedDataParallel::check_requires_grad_unchanged() const {
  bool changed = false;
  for (const auto& [p, required] : requires_grad_at_construction_) changed |= p.requires_grad() != required;
  if (!changed) return;
  std::ostringstream names;
  int count = 0;
  for (const auto& [name, p] : module_->named_parameters()) {
    for (const auto& [q, required] : requires_grad_at_construction_) {
      if (q.impl() != p.impl() || p.requires_grad() == required) continue;
      names << (count++ ? ", " : "") << name << (required ? " (frozen after wrapping)" : " (unfrozen after wrapping)");
    }
  }
  NANODDP_THROW(
      ValueError, "DDP on rank ", pg_->rank(), "/", pg_->size(),
      ": requires_grad changed after DistributedDataParallel was constructed: ", names.str(),
      ". DDP plans its gradient buckets from the parameters that require grad at construction, so an "
      "unfrozen parameter's gradient would not be averaged across ranks. Set requires_grad before "
      "wrapping the model, or construct a new DistributedDataParallel after changing it");
}

void DistributedDataParallel::verify_model_matches() {
  detail::verify_same_model(*pg_, *module_, "DDP", timeout_);
}

void DistributedDataParallel::broadcast_parameters(int root) {
  NoGradGuard no_grad;
  std::vector<std::shared_ptr<Work>> works;
  for (Tensor& p : module_->parameters()) {
    Tensor data = p.detach();  // same storage: the broadcast writes the parameter itself
    works.push_back(pg_->broadcast(data, root));
  }
  for (auto& work : works) work->wait(timeout_);
}

Tensor DistributedDataParallel::forward(const Tensor& input) {
  reducer_->abandon_interrupted_backward();  // Note [Interrupted backward] in reducer.cpp
  if (is_grad_enabled()) check_requires_grad_unchanged();  // Note [Frozen parameters]
  // Note [Join], steps 1 to 3.
  if (const auto not_joined = Join::notify_join_context(*this))
    reducer_->set_divide_factor(divide_by_initial_world_size_ ? pg_->size() : *not_joined);
  const bool will_sync = reducer_->sync() && is_grad_enabled();
  if (is_grad_enabled()) reducer_->set_backward_syncs(will_sync);
  if (join_config().enable)
    all_reduce_host(*pg_, std::vector<int64_t>{will_sync ? 1 : 0}, ReduceOp::Sum, timeout_);
  if (require_forward_param_sync_ && syncs_buffers()) {
    // Note [Join] step 3b: inside a Join rank 0 may have stopped; the highest rank still
    // training is the source instead (PyTorch's _find_common_rank).
    int64_t root = 0;
    if (join_config().enable)
      root = all_reduce_host(*pg_, std::vector<int64_t>{pg_->rank()}, ReduceOp::Max, timeout_)[0];
    broadcast_buffers(static_cast<int>(root));
  }
  // Note [Bucket rebuild] in reducer.cpp: once, before the second synced backward (a broadcast
  // from rank 0); Note [Join] step 3c. A joined rank does the same in DDPJoinHook::main_hook.
  if (will_sync) reducer_->rebuild_buckets();
  require_forward_param_sync_ = will_sync;
  Tensor output = (*module_)(input);
  if (!output.requires_grad()) return output;
  // The sink: an identity on the output whose backward tells the reducer that this backward is
  // a DDP forward's (Reducer::begin_ddp_backward). It runs before any parameter's gradient is
  // final, since every parameter of this forward lies behind the output.
  std::weak_ptr<Reducer> reducer = reducer_;
  return record("DDPSinkBackward", output.detach(), {output}, {},
                [reducer](const Node&, const Tensor& grad_output) -> std::vector<Tensor> {
                  if (auto alive = reducer.lock()) alive->begin_ddp_backward();
                  return {grad_output};
                });
}

void DistributedDataParallel::broadcast_buffers(int root) {
  NoGradGuard no_grad;
  const auto named = module_->named_buffers();
  const bool is_root = pg_->rank() == root;
  // One flat broadcast per dtype present, in DType's order (the same on every rank: the
  // construction check compared the buffers' names and dtypes).
  for (int d = 0; d <= static_cast<int>(kLastDType); ++d) {
    const auto dtype = static_cast<DType>(d);
    std::vector<Tensor> group;
    int64_t numel = 0;
    for (const auto& [name, b] : named) {
      if (b.dtype() != dtype) continue;
      NANODDP_CHECK(group.empty() || b.device() == group[0].device(), DeviceError, "DDP on rank ", pg_->rank(),
                    ": buffer '", name, "' is on ", b.device(), " but other buffers are on ", group[0].device());
      group.push_back(b);
      numel += b.numel();
    }
    if (group.empty()) continue;
    const Device device = group[0].device();
    Tensor flat = Tensor::empty({numel}, dtype, device);
    auto* base = static_cast<char*>(flat.impl()->storage->data());
    size_t offset = 0;
    for (const Tensor& b : group) {
      if (is_root) copy_bytes(base + offset, device, b.impl()->storage->data(), device, b.nbytes());
      offset += b.nbytes();
    }
    pg_->broadcast(flat, root)->wait(timeout_);
    if (is_root) continue;
    offset = 0;
    for (const Tensor& b : group) {
      copy_bytes(b.impl()->storage->data(), device, base + offset, device, b.nbytes());
      offset += b.nbytes();
    }
  }
}

// What a joined rank does in place of DDP's iterations (PyTorch's _DDPJoinHook).
class DDPJoinHook : public JoinHook {
 public:
  DDPJoinHook(DistributedDataParallel& ddp, bool divide_by_initial_world_size) : ddp_(ddp) {
    ddp_.divide_by_initial_world_size_ = divide_by_initial_world_size;
  }
  // When the Join ends, DDP divides by the world size again.
  ~DDPJoinHook() override {
    ddp_.divide_by_initial_world_size_ = true;
    ddp_.reducer_->set_divide_factor(ddp_.pg_->size());
  }

  // Note [Join], steps 3' to 4'.
  void main_hook() override {
    const int64_t syncing =
        all_reduce_host(*ddp_.pg_, std::vector<int64_t>{0}, ReduceOp::Sum, ddp_.timeout_)[0];
    if (ddp_.require_forward_param_sync_ && ddp_.syncs_buffers()) {  // 3b': this rank is never the source
      const int64_t root = all_reduce_host(*ddp_.pg_, std::vector<int64_t>{-1}, ReduceOp::Max, ddp_.timeout_)[0];
      ddp_.broadcast_buffers(static_cast<int>(root));
    }
    ddp_.require_forward_param_sync_ = syncing > 0;  // as the others' forwards set theirs
    if (syncing > 0) {
      ddp_.reducer_->rebuild_buckets();  // 3c': as the others' forward
      ddp_.reducer_->shadow_synced_backward();
    }
  }
  void post_hook(bool is_last_joiner) override { ddp_.sync_final_model(is_last_joiner); }

 private:
  DistributedDataParallel& ddp_;
};

std::unique_ptr<JoinHook> DistributedDataParallel::join_hook(const JoinOptions& options) {
  return std::make_unique<DDPJoinHook>(*this, options.divide_by_initial_world_size);
}

// The ranks that joined last ran every iteration; the others stopped stepping when they
// joined. All take the parameters of the highest-numbered last joiner (PyTorch's
// _sync_final_model).
void DistributedDataParallel::sync_final_model(bool is_last_joiner) {
  const int64_t candidate = is_last_joiner ? pg_->rank() : -1;
  const int64_t authoritative_rank =
      all_reduce_host(*pg_, std::vector<int64_t>{candidate}, ReduceOp::Max, timeout_)[0];
  broadcast_parameters(static_cast<int>(authoritative_rank));
  broadcast_buffers(static_cast<int>(authoritative_rank));
}

}  // namespace nanoddp::dist
