#include "dist/host_staging.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/op_helpers.h"
#include "dist/deadline.h"
#include "dist/detail.h"
#include "dist/start_worker.h"
#include "kernels/device_memory.h"

namespace nanoddp::dist {

namespace {

// Page-locked host blocks for staging, kept by exact size and reused: cudaMallocHost costs
// far more than a copy, and DDP stages the same few bucket sizes every step. Each block
// holds a reference to the pool, so the pool outlives every staging tensor.
class PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  // May run on whatever thread lets go of the last staging tensor: with the device that
  // allocated the blocks current, not GPU 0 (Note [Current device] in
  // kernels/cuda/device_memory.cpp).
  ~PinnedPool() {
    if (free_.empty() && to_free_.empty()) return;
    try {
      kernels::cuda::set_device(device_);
    } catch (...) {  // CUDA is gone (the process is ending): freeing fails quietly too
    }
    for (auto& [nbytes, block] : free_) kernels::cuda::free_pinned(block);
    for (void* block : to_free_) kernels::cuda::free_pinned(block);
  }

  // An uninitialised host tensor of this shape and dtype in pinned memory. On the caller's
  // thread, which frees the blocks given back past the cache's room.
  // device: the GPU the tensor is staged from.
  Tensor take(const Shape& shape, DType dtype, int device) {
    const size_t nbytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
    void* block = nullptr;
    std::vector<void*> to_free;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      to_free.swap(to_free_);
      auto it = free_.find(nbytes);
      if (it != free_.end()) {
        block = it->second;
        free_.erase(it);
        cached_bytes_ -= nbytes;
      }
    }
    if (!to_free.empty() || (block == nullptr && nbytes > 0))
      kernels::cuda::set_device(device);  // the caller's thread may never have chosen one
    for (void* freed : to_free) kernels::cuda::free_pinned(freed);
    if (block == nullptr && nbytes > 0) {
      device_ = device;
      block = kernels::cuda::allocate_pinned(nbytes);
      detail::register_exit_handler_after_cuda();  // CUDA is up now (Note [NCCL shutdown])
    }
    auto impl = std::make_shared<TensorImpl>();
    impl->shape = shape;
    impl->dtype = dtype;
    impl->storage =
        std::make_shared<Storage>(block, nbytes, Device::cpu(),
                                  [pool = shared_from_this(), nbytes](void* p) { pool->give(p, nbytes); });
    return Tensor(impl);
  }

 private:
  static constexpr size_t kMaxCachedBytes = size_t(1) << 30;

  // Runs wherever a staging tensor's last holder lets go (the backend's thread, the staging
  // worker), so it never calls CUDA: on a thread with no device chosen that would open a
  // context on GPU 0 (Note [Current device] in kernels/cuda/device_memory.cpp). A block past
  // the cache's room is freed by the next take(). Never throws (without memory to note the
  // block, it is leaked).
  void give(void* block, size_t nbytes) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    try {
      if (cached_bytes_ + nbytes <= kMaxCachedBytes) {
        free_.emplace(nbytes, block);
        cached_bytes_ += nbytes;
      } else {
        to_free_.push_back(block);
      }
    } catch (...) {
    }
  }

  std::mutex mutex_;
  int device_ = 0;              // the last device a block was allocated for
  std::vector<void*> to_free_;  // given back past kMaxCachedBytes; freed by take()
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

// Note [Staging without a host wait]
// A staged collective cannot start before its tensors are in host memory, and a host wait for
// the copy would stall the caller in the middle of backward (Note [Host syncs] in
// kernels/device_memory.h). So each copy to the host is queued on the compute stream, after
// every kernel queued before it, with a host function behind it
// (kernels::cuda::call_after_stream) that says the copies have run; the call goes to a thread
// of the group's own (dist/start_worker.h), which waits for that word and then issues the call
// to the backend. The caller never waits: DDP's bucket all-reduces reach the backend in
// backward's order, each as soon as its gradients are in host memory.
// The backend gets the calls in the order they were made: while the thread holds one, every
// later call (staged or not, barrier and send/recv too) queues behind it; a job that stages
// nothing never starts the thread. The group's end issues what the thread still holds, so
// that the backend's end deals with every call made before it. shm is the exception: its
// engine runs every call in the thread that waits, holding it meanwhile, so a call issued by
// the worker could wait for the very wait that waits for it; there the copy to the host is
// made at the call, with a host wait. Under the collective check fused into the backend (Note
// [Fused collective check] in dist/process_group_checked.cpp) the guard goes with the call,
// and the thread starts it with the backend's start_guarded. A host block stays out of the
// pool until its copy has run, whatever becomes of the call.

// Set by the host function queued behind a call's copies to host memory.
class Arrival {
 public:
  // The host function (kernels::cuda::call_after_stream): arg is a std::shared_ptr<Arrival>*,
  // which it deletes. Touches nothing but this object: no CUDA call, no tensor, no pool.
  static void arrive_and_release(void* arg) noexcept {
    auto* self = static_cast<std::shared_ptr<Arrival>*>(arg);
    (*self)->arrive();
    delete self;
  }

  void arrive() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      arrived_ = true;
    }
    arrived_cv_.notify_all();
  }
  bool arrived() {
    std::lock_guard<std::mutex> lock(mutex_);
    return arrived_;
  }

  // Waits until deadline for arrive(); true when it came.
  bool wait_until(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mutex_);
    return arrived_cv_.wait_until(lock, deadline, [&] { return arrived_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable arrived_cv_;
  bool arrived_ = false;
};

// The host tensors one call's copies write, and their arrival. Goes with the call; a block
// whose copy has not run by then is never reused (the device may still write it).
struct CopiesToHost {
  std::shared_ptr<Arrival> arrival;
  std::vector<Tensor> hosts;
  // Recorded after the copies on a GPU (null on the host stand-in): a failed device never
  // calls the host function, and its query says why (DeviceError).
  void* event = nullptr;
  int device = 0;
  // The group's timeout from the call: calls queued behind a stuck copy end with it, not one
  // timeout each.
  std::chrono::steady_clock::time_point deadline;

  bool queued = false;  // a copy was queued: until arrival, the device may write the blocks

  ~CopiesToHost() {
    if (queued && !arrival->arrived())
      for (const Tensor& host : hosts) keep_forever(host);
    if (event == nullptr) return;
    try {
      kernels::cuda::set_device(device);
    } catch (...) {  // destroyed on whatever device is current, as the best left to do
    }
    kernels::cuda::destroy_event(event);
  }

  // On the worker: waits until the deadline for the copies to have run. Throws DeviceError:
  // the device's when it failed, one naming call when the copies have not run (a DeviceError,
  // not a TimeoutError: this rank's own device is late, and the collective check would name a
  // peer that did not come for a TimeoutError).
  void wait(const std::string& call, std::chrono::milliseconds timeout) {
    while (
        !arrival->wait_until(std::min(deadline, std::chrono::steady_clock::now() + kDeviceCheckInterval))) {
      if (event != nullptr) {
        kernels::cuda::set_device(device);
        // Passed: the copies have run, and only the host function is late (its thread is not
        // scheduled yet). A failed device throws DeviceError here.
        if (kernels::cuda::event_passed(event)) {
          arrival->arrive();
          return;
        }
      }
      NANODDP_CHECK(std::chrono::steady_clock::now() < deadline, DeviceError, call,
                    ": its copy to host memory had not run on the device after ", timeout.count(),
                    " ms (a kernel queued before it is still running)");
    }
  }

 private:
  static constexpr std::chrono::milliseconds kDeviceCheckInterval{100};
};

// The first failure of a staged call's copies (a stuck or failed device). The calls after it
// are refused: issued, they would pair with the peers' earlier calls.
class StagingFailure {
 public:
  void set(const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (what_.empty()) what_ = what;
  }
  bool failed() {
    std::lock_guard<std::mutex> lock(mutex_);
    return !what_.empty();
  }
  // Throws DistError naming call when a failure came first.
  void check(const std::string& call) {
    std::lock_guard<std::mutex> lock(mutex_);
    NANODDP_CHECK(what_.empty(), DistError, call,
                  ": not issued: an earlier call's copy to host memory failed, "
                  "and the calls after it would pair with the other ranks' earlier ones: ",
                  what_);
  }

 private:
  std::mutex mutex_;
  std::string what_;
};

// The collective's Work, then the copies of its results back to the device tensors: queued on
// the device's compute stream, so the host does not wait for them.
class StagedWork : public Work {
 public:
  // copy_back: (device tensor, host tensor holding its result)
  StagedWork(std::shared_ptr<Work> inner, std::vector<std::pair<Tensor, Tensor>> copy_back,
             std::shared_ptr<CopiesInFlight> in_flight, std::chrono::milliseconds group_timeout)
      : inner_(std::move(inner)),
        copy_back_(std::move(copy_back)),
        in_flight_(std::move(in_flight)),
        group_timeout_(group_timeout) {}

  void wait(std::chrono::milliseconds timeout) override {
    inner_->wait(effective_wait_timeout(timeout, group_timeout_));
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
  std::chrono::milliseconds group_timeout_;
};

class StagingGroup : public ProcessGroup {
 public:
  StagingGroup(std::shared_ptr<ProcessGroup> inner, std::chrono::milliseconds timeout)
      : ProcessGroup(inner->rank(), inner->size()),
        inner_(std::move(inner)),
        timeout_(detail::cap_timeout(timeout)),  // Note [Long timeouts]
        pool_(std::make_shared<PinnedPool>()),
        in_flight_(std::make_shared<CopiesInFlight>()),
        runs_in_wait_(inner_->collectives_run_in_wait()) {}

  std::string backend_name() const override { return inner_->backend_name(); }
  Device device() const override { return inner_->device(); }
  Store& store() override { return inner_->store(); }
  Tensor new_collective_buffer(int64_t numel, DType dtype, Device device) override {
    return inner_->new_collective_buffer(numel, dtype, device);
  }
  // Every call goes to the inner group, which counts it (Note [Collective counters]).
  CollectiveCount count(Collective collective) const override { return inner_->count(collective); }
  void reset_counts() override { inner_->reset_counts(); }

  // The call that start() makes here takes the guard to the inner group's start_guarded, now
  // or on the worker (Note [Staging without a host wait]).
  bool can_start_guarded() const override { return inner_->can_start_guarded(); }
  std::shared_ptr<Work> start_guarded(CollectiveGuard guard,
                                      const std::function<std::shared_ptr<Work>()>& start) override {
    if (!inner_->can_start_guarded()) return nullptr;
    guard_ = std::move(guard);
    struct Forget {
      std::optional<CollectiveGuard>& guard;
      ~Forget() { guard.reset(); }
    } forget{guard_};
    return start();
  }

  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op) override {
    if (!staged({tensor}))
      return issue({}, "all_reduce", tensor,
                   [inner = inner_, tensor, op]() mutable { return inner->all_reduce(tensor, op); });
    auto copies = copy_in({tensor});
    Tensor host = copies->hosts[0];
    return issue({copies, {{tensor, host}}}, "all_reduce", tensor,
                 [inner = inner_, host, op]() mutable { return inner->all_reduce(host, op); });
  }

  std::shared_ptr<Work> broadcast(Tensor& tensor, int root) override {
    const std::string what = "broadcast from rank " + std::to_string(root);
    if (!staged({tensor}))
      return issue({}, what, tensor,
                   [inner = inner_, tensor, root]() mutable { return inner->broadcast(tensor, root); });
    auto copies = copy_in({tensor});
    Tensor host = copies->hosts[0];
    return issue({copies, {{tensor, host}}}, what, tensor,
                 [inner = inner_, host, root]() mutable { return inner->broadcast(host, root); });
  }

  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override {
    std::vector<Tensor> all = outputs;
    all.push_back(input);
    if (!staged(all)) {
      return issue({}, "all_gather", input,
                   [inner = inner_, outputs, input]() mutable { return inner->all_gather(outputs, input); });
    }
    auto copies = copy_in({input});
    std::vector<Tensor> host_outputs;
    Pairs back;
    for (Tensor& out : outputs) {
      host_outputs.push_back(host_like(out));
      back.emplace_back(out, host_outputs.back());
    }
    return issue({copies, std::move(back)}, "all_gather", input,
                 [inner = inner_, host_outputs, host_input = copies->hosts[0]]() mutable {
                   return inner->all_gather(host_outputs, host_input);
                 });
  }

  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                       ReduceOp op) override {
    std::vector<Tensor> all = inputs;
    all.push_back(output);
    if (!staged(all)) {
      return issue({}, "reduce_scatter", output, [inner = inner_, output, inputs, op]() mutable {
        return inner->reduce_scatter(output, inputs, op);
      });
    }
    auto copies = copy_in(inputs);
    Tensor host_output = host_like(output);
    return issue({copies, {{output, host_output}}}, "reduce_scatter", output,
                 [inner = inner_, host_output, host_inputs = copies->hosts, op]() mutable {
                   return inner->reduce_scatter(host_output, host_inputs, op);
                 });
  }

  std::shared_ptr<Work> barrier() override {
    return issue({}, "barrier", Tensor(), [inner = inner_] { return inner->barrier(); });
  }

  // Point-to-point is not a collective: it never takes the check's guard.
  std::shared_ptr<Work> send(const Tensor& tensor, int dst, int tag) override {
    const std::string what = "send to rank " + std::to_string(dst);
    if (!staged({tensor}))
      return issue(
          {}, what, tensor, [inner = inner_, tensor, dst, tag] { return inner->send(tensor, dst, tag); },
          false);
    auto copies = copy_in({tensor});
    return issue(
        {copies, {}}, what, tensor,
        [inner = inner_, host = copies->hosts[0], dst, tag] { return inner->send(host, dst, tag); }, false);
  }

  std::shared_ptr<Work> recv(Tensor& tensor, int src, int tag) override {
    const std::string what = "recv from rank " + std::to_string(src);
    if (!staged({tensor})) {
      return issue(
          {}, what, tensor,
          [inner = inner_, tensor, src, tag]() mutable { return inner->recv(tensor, src, tag); }, false);
    }
    Tensor host = host_like(tensor);
    return issue(
        {nullptr, {{tensor, host}}}, what, tensor,
        [inner = inner_, host, src, tag]() mutable { return inner->recv(host, src, tag); }, false);
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
    return pool_->take(t.shape(), t.dtype(), t.device().index);
  }

  // Host copies of tensors (all on one device), queued after every kernel already queued there
  // (Note [Staging without a host wait]). Made at once, with a host wait, on a backend whose
  // calls run in the waiting thread; and at once on the host stand-in cpu:1 of the tests,
  // whose call still goes through the worker elsewhere.
  std::shared_ptr<CopiesToHost> copy_in(const std::vector<Tensor>& tensors) {
    auto copies = std::make_shared<CopiesToHost>();
    copies->arrival = std::make_shared<Arrival>();
    copies->deadline = detail::deadline_after(timeout_);
    for (const Tensor& t : tensors) copies->hosts.push_back(host_like(t));
    if (!tensors.front().device().is_cuda() || runs_in_wait_) {
      for (size_t i = 0; i < tensors.size(); ++i)
        copy_values(copies->hosts[i], tensors[i]);  // not an autograd op
      copies->arrival->arrive();
      return copies;
    }
    copies->device = tensors.front().device().index;
    kernels::cuda::set_device(copies->device);
    copies->event = kernels::cuda::create_event();
    auto handle = std::make_unique<std::shared_ptr<Arrival>>(copies->arrival);
    for (size_t i = 0; i < tensors.size(); ++i) {  // a throw after one is queued keeps the blocks
      void* device_data = tensors[i].data_ptr();
      kernels::cuda::copy_async(copies->hosts[i].data_ptr(), device_data, tensors[i].nbytes(),
                                kernels::cuda::CopyKind::DeviceToHost);
      copies->queued = true;
    }
    kernels::cuda::record_event(copies->event);
    kernels::cuda::call_after_stream(&Arrival::arrive_and_release, handle.get());
    handle.release();  // the host function deletes it
    return copies;
  }

  // What a staged call moves: the copies its start waits for (null: none, a recv) and the
  // (device tensor, host result) pairs its wait copies back.
  struct Staged {
    std::shared_ptr<CopiesToHost> copies;
    Pairs copy_back;
  };

  // Issues start on the inner group: now, when it has no copies to wait for (or the backend
  // runs calls in the waiting thread, where they were made at the call) and the worker holds no
  // earlier call, else on the worker once its copies have run. A collective takes the guard of
  // a fused check along (takes_guard). what and tensor (may be undefined) name the call in the
  // worker's errors.
  std::shared_ptr<Work> issue(Staged staged, const std::string& what, const Tensor& tensor,
                              std::function<std::shared_ptr<Work>()> start, bool takes_guard = true) {
    if (takes_guard && guard_) {
      start = [inner = inner_, guard = *std::exchange(guard_, std::nullopt), start = std::move(start)]() {
        auto work = inner->start_guarded(guard, start);
        NANODDP_CHECK(
            work != nullptr, DistError,
            "host staging: the backend says it starts guarded calls (can_start_guarded) but returned none");
        return work;
      };
    }
    std::shared_ptr<Work> work;
    const bool ready = staged.copies == nullptr || runs_in_wait_;
    if (ready && (worker_ == nullptr || worker_->idle())) {
      if (worker_ != nullptr && failure_->failed()) failure_->check(describe(what, tensor));
      work = start();
      if (staged.copy_back.empty()) return work;
    } else {
      if (worker_ == nullptr)
        worker_ = std::make_unique<detail::StartWorker>("host staging", detail::StartWorker::AtEnd::Finish);
      detail::StartWorker::Call call;
      call.description = describe(what, tensor);
      call.before = [copies = staged.copies, failure = failure_, description = call.description,
                     timeout = timeout_] {
        failure->check(description);
        if (copies == nullptr) return;
        try {
          copies->wait(description, timeout);
        } catch (const std::exception& e) {
          failure->set(e.what());
          throw;
        }
      };
      call.start = std::move(start);
      call.still_before =
          "its tensors, or those of a call made before it, were still on their way to host memory";
      work = worker_->queue(std::move(call));
    }
    return std::make_shared<StagedWork>(std::move(work), std::move(staged.copy_back), in_flight_, timeout_);
  }

  std::shared_ptr<ProcessGroup> inner_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<PinnedPool> pool_;
  std::shared_ptr<CopiesInFlight> in_flight_;
  // inner_->collectives_run_in_wait(): shm, whose engine runs every call in the thread that
  // waits, holding it meanwhile; a call issued by the worker then would wait for that wait.
  const bool runs_in_wait_;
  std::shared_ptr<StagingFailure> failure_ = std::make_shared<StagingFailure>();
  std::optional<CollectiveGuard> guard_;  // set only inside start_guarded, for the call it makes
  // Started by the first call that waits for a copy; ends (starting what it holds) before the
  // inner group goes.
  std::unique_ptr<detail::StartWorker> worker_;
};

}  // namespace

std::shared_ptr<ProcessGroup> stage_device_tensors(std::shared_ptr<ProcessGroup> group,
                                                   std::chrono::milliseconds timeout) {
  if (group == nullptr || group->device() != Device::cpu() || std::dynamic_pointer_cast<StagingGroup>(group))
    return group;
  return std::make_shared<StagingGroup>(std::move(group), timeout);
}

}  // namespace nanoddp::dist
