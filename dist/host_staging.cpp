#include "dist/host_staging.h"

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "core/op_helpers.h"
#include "dist/detail.h"
#include "kernels/device_memory.h"

namespace nanoddp::dist {

namespace {

// Page-locked host blocks for staging, kept by exact size and reused: cudaMallocHost costs
// far more than a copy, and DDP stages the same few bucket sizes every step. Each block
// holds a reference to the pool, so the pool outlives every staging tensor.
class PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  ~PinnedPool() {
    for (auto& [nbytes, block] : free_) kernels::cuda::free_pinned(block);
  }

  // An uninitialised host tensor of this shape and dtype in pinned memory.
  Tensor take(const Shape& shape, DType dtype) {
    const size_t nbytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
    void* block = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(nbytes);
      if (it != free_.end()) {
        block = it->second;
        free_.erase(it);
        cached_bytes_ -= nbytes;
      }
    }
    if (block == nullptr && nbytes > 0) {
      block = kernels::cuda::allocate_pinned(nbytes);
      detail::register_exit_handler_after_cuda();  // CUDA is up now (Note [NCCL shutdown])
    }
    auto impl = std::make_shared<TensorImpl>();
    impl->shape = shape;
    impl->dtype = dtype;
    impl->storage = std::make_shared<Storage>(block, nbytes, Device::cpu(),
                                              [pool = shared_from_this(), nbytes](void* p) { pool->give(p, nbytes); });
    return Tensor(impl);
  }

 private:
  static constexpr size_t kMaxCachedBytes = size_t(1) << 30;

  void give(void* block, size_t nbytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (cached_bytes_ + nbytes <= kMaxCachedBytes) {
        free_.emplace(nbytes, block);
        cached_bytes_ += nbytes;
        return;
      }
    }
    kernels::cuda::free_pinned(block);
  }

  std::mutex mutex_;
  std::multimap<size_t, void*> free_;
  size_t cached_bytes_ = 0;
};

// A host tensor the device may still read, when nothing will tell when it has: leaked, never
// reused. Never throws (without memory for the handle, nothing can be done about it).
void keep_forever(const Tensor& host) noexcept {
  try {
    new Tensor(host);
  } catch (...) {
  }
}

// Host tensors whose copy back to the GPU is queued but may not have run: each is kept (its
// pinned block out of the pool) until its event has passed (Note [Compute-stream events]).
class CopiesInFlight {
 public:
  ~CopiesInFlight() {
    for (Copy& copy : copies_) {
      try {
        kernels::cuda::set_device(copy.device);
        kernels::cuda::wait_for_event(copy.event);
      } catch (...) {
        keep_forever(copy.host);  // the device may still read it
      }
      kernels::cuda::destroy_event(copy.event);
    }
  }

  // Queues the copy of host into device_tensor on its GPU's compute stream.
  void copy_back(const Tensor& device_tensor, const Tensor& host) {
    const int device = device_tensor.device().index;
    kernels::cuda::set_device(device);
    std::lock_guard<std::mutex> lock(mutex_);
    // Room first, so that keeping host below cannot fail once the copy is queued.
    if (copies_.size() == copies_.capacity()) copies_.reserve(2 * copies_.size() + 1);
    void* event = kernels::cuda::create_event();
    try {
      kernels::cuda::copy_async(device_tensor.data_ptr(), host.data_ptr(), host.nbytes(),
                                kernels::cuda::CopyKind::HostToDevice);
      kernels::cuda::record_event(event);
    } catch (...) {
      kernels::cuda::destroy_event(event);
      keep_forever(host);  // nothing tells when the copy has read it
      throw;
    }
    copies_.push_back(Copy{host, event, device});
  }

  // Lets go of the host tensors whose copies have run.
  void collect() {
    std::vector<Copy> done;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = copies_.begin(); it != copies_.end();) {
        kernels::cuda::set_device(it->device);
        if (kernels::cuda::event_passed(it->event)) {
          done.push_back(std::move(*it));
          it = copies_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (Copy& copy : done) kernels::cuda::destroy_event(copy.event);
  }

 private:
  struct Copy {
    Tensor host;
    void* event;
    int device;
  };
  std::mutex mutex_;
  std::vector<Copy> copies_;
};

// The collective's Work, then the copies of its results back to the device tensors: queued on
// the device's compute stream, so the host does not wait for them.
class StagedWork : public Work {
 public:
  // copy_back: (device tensor, host tensor holding its result)
  StagedWork(std::shared_ptr<Work> inner, std::vector<std::pair<Tensor, Tensor>> copy_back,
             std::shared_ptr<CopiesInFlight> in_flight)
      : inner_(std::move(inner)), copy_back_(std::move(copy_back)), in_flight_(std::move(in_flight)) {}

  void wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    // Each pair leaves the list once its copy is queued: a wait after one that threw queues
    // only the rest.
    while (!copy_back_.empty()) {
      auto& [device_tensor, host] = copy_back_.back();
      if (device_tensor.device().is_cuda())
        in_flight_->copy_back(device_tensor, host);
      else
        copy_values(device_tensor, host);  // the host stand-in cpu:1 of the tests
      copy_back_.pop_back();
    }
  }
  bool is_completed() override { return inner_->is_completed(); }

 private:
  std::shared_ptr<Work> inner_;
  std::vector<std::pair<Tensor, Tensor>> copy_back_;
  std::shared_ptr<CopiesInFlight> in_flight_;
};

class StagingGroup : public ProcessGroup {
 public:
  explicit StagingGroup(std::shared_ptr<ProcessGroup> inner)
      : ProcessGroup(inner->rank(), inner->size()),
        inner_(std::move(inner)),
        pool_(std::make_shared<PinnedPool>()),
        in_flight_(std::make_shared<CopiesInFlight>()) {}

  std::string backend_name() const override { return inner_->backend_name(); }
  Device device() const override { return inner_->device(); }
  Store& store() override { return inner_->store(); }
  Tensor new_collective_buffer(int64_t numel, DType dtype, Device device) override {
    return inner_->new_collective_buffer(numel, dtype, device);
  }
  // Every call goes to the inner group, which counts it (Note [Collective counters]).
  CollectiveCount count(Collective collective) const override { return inner_->count(collective); }
  void reset_counts() override { inner_->reset_counts(); }

  // Staging issues the inner collective within the call: the guard reaches the inner one.
  std::shared_ptr<Work> start_guarded(CollectiveGuard guard,
                                      const std::function<std::shared_ptr<Work>()>& start) override {
    return inner_->start_guarded(std::move(guard), start);
  }

  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op) override {
    if (!staged({tensor})) return inner_->all_reduce(tensor, op);
    Tensor host = copy_in(tensor);
    return std::make_shared<StagedWork>(inner_->all_reduce(host, op), Pairs{{tensor, host}}, in_flight_);
  }

  std::shared_ptr<Work> broadcast(Tensor& tensor, int root) override {
    if (!staged({tensor})) return inner_->broadcast(tensor, root);
    Tensor host = copy_in(tensor);
    return std::make_shared<StagedWork>(inner_->broadcast(host, root), Pairs{{tensor, host}}, in_flight_);
  }

  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override {
    std::vector<Tensor> all = outputs;
    all.push_back(input);
    if (!staged(all)) return inner_->all_gather(outputs, input);
    const Tensor host_input = copy_in(input);
    std::vector<Tensor> host_outputs;
    Pairs back;
    for (Tensor& out : outputs) {
      host_outputs.push_back(host_like(out));
      back.emplace_back(out, host_outputs.back());
    }
    return std::make_shared<StagedWork>(inner_->all_gather(host_outputs, host_input), std::move(back), in_flight_);
  }

  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs, ReduceOp op) override {
    std::vector<Tensor> all = inputs;
    all.push_back(output);
    if (!staged(all)) return inner_->reduce_scatter(output, inputs, op);
    std::vector<Tensor> host_inputs;
    for (const Tensor& in : inputs) host_inputs.push_back(copy_in(in));
    Tensor host_output = host_like(output);
    return std::make_shared<StagedWork>(inner_->reduce_scatter(host_output, host_inputs, op),
                                        Pairs{{output, host_output}}, in_flight_);
  }

  std::shared_ptr<Work> barrier() override { return inner_->barrier(); }

  std::shared_ptr<Work> send(const Tensor& tensor, int dst, int tag) override {
    if (!staged({tensor})) return inner_->send(tensor, dst, tag);
    return std::make_shared<StagedWork>(inner_->send(copy_in(tensor), dst, tag), Pairs{}, in_flight_);
  }

  std::shared_ptr<Work> recv(Tensor& tensor, int src, int tag) override {
    if (!staged({tensor})) return inner_->recv(tensor, src, tag);
    Tensor host = host_like(tensor);
    return std::make_shared<StagedWork>(inner_->recv(host, src, tag), Pairs{{tensor, host}}, in_flight_);
  }

  std::string all_reduce_algorithm() const override { return inner_->all_reduce_algorithm(); }
  std::string all_reduce_algorithm_for(const Tensor& tensor) const override {
    return inner_->all_reduce_algorithm_for(tensor);
  }
  bool collectives_run_in_wait() const override { return inner_->collectives_run_in_wait(); }
  MovedBytes moved_bytes() const override { return inner_->moved_bytes(); }
  void issue_queued_point_to_point() override { inner_->issue_queued_point_to_point(); }

 private:
  using Pairs = std::vector<std::pair<Tensor, Tensor>>;

  // Staged when every tensor is defined and on one device other than the CPU. Anything else
  // goes to the backend untouched, whose checks name what is wrong (a mixed list, a dtype).
  static bool staged(const std::vector<Tensor>& tensors) {
    if (tensors.empty()) return false;
    for (const Tensor& t : tensors)
      if (!t.defined() || t.device() != tensors.front().device()) return false;
    return tensors.front().device() != Device::cpu();
  }

  Tensor host_like(const Tensor& t) {
    if (!t.device().is_cuda()) return Tensor::empty(t.shape(), t.dtype());
    in_flight_->collect();  // blocks whose copies back have run return to the pool first
    return pool_->take(t.shape(), t.dtype());
  }

  // A host copy of t, made after every kernel already queued on t's device.
  Tensor copy_in(const Tensor& t) {
    Tensor host = host_like(t);
    copy_values(host, t);  // not an autograd op: t may require grad (a loss all-reduced for a log)
    return host;
  }

  std::shared_ptr<ProcessGroup> inner_;
  std::shared_ptr<PinnedPool> pool_;
  std::shared_ptr<CopiesInFlight> in_flight_;
};

}  // namespace

std::shared_ptr<ProcessGroup> stage_device_tensors(std::shared_ptr<ProcessGroup> group) {
  if (group == nullptr || group->device() != Device::cpu() || std::dynamic_pointer_cast<StagingGroup>(group)) return group;
  return std::make_shared<StagingGroup>(std::move(group));
}

}  // namespace nanoddp::dist
