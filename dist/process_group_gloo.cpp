// The Gloo process group: CPU tensors over Gloo's TCP transport.
//
// Note [Gloo worker thread]
// Each group owns one worker thread that runs the group's collectives in issue order; a
// collective call only queues a task and returns its Work. That is what lets DDP launch a
// bucket's all-reduce while backward goes on, and it is what PyTorch's ProcessGroupGloo does.
// Gloo's TCP device has a network thread of its own, so on a 2-core machine a collective
// crosses three threads; that hand-off is the main cost of small Gloo all-reduces here (see
// benchmarks/allreduce_bench.cpp). No thread is pinned to a core: pinning made small
// all-reduces ~20x slower when the worker and network threads shared the core.
//
// Note [Gloo new-style API]
// Only the option-struct entry points (gloo::allreduce, broadcast, allgather, barrier) are
// used. After the older algorithm classes (AllreduceRingChunked, HalvingDoubling) had run
// on a context, later new-style all-reduces on it were measured 7-15x slower. This Gloo has
// no new-style reduce-scatter, so reduce_scatter is an all-reduce of the concatenated inputs
// followed by a copy of this rank's slice: world_size times the traffic of a true
// reduce-scatter, but exact and on the fast path.
#include "core/error.h"
#include "dist/detail.h"
#include "dist/process_group.h"

#if NANODDP_WITH_GLOO

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace nanoddp::dist {

namespace {

// Our Store seen through Gloo's rendezvous interface; keys get a per-group prefix so groups
// built one after the other in one job never read each other's addresses.
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(std::shared_ptr<dist::Store> store, std::string prefix)
      : store_(std::move(store)), prefix_(std::move(prefix)) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(prefix_ + key, std::vector<uint8_t>(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto bytes = store_->get(prefix_ + key);
    return std::vector<char>(bytes.begin(), bytes.end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, store_->timeout()); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> prefixed;
    for (const auto& key : keys) prefixed.push_back(prefix_ + key);
    store_->wait(prefixed, timeout);
  }

 private:
  std::shared_ptr<dist::Store> store_;
  std::string prefix_;
};

// Gloo's element-wise reduction signature: out[i] = a[i] (op) b[i]; out may alias a or b.
template <typename T>
gloo::AllreduceOptions::Func reduce_function(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:  // Avg sums, then divides once at the end
      return [](void* out, const void* a, const void* b, size_t n) {
        auto* o = static_cast<T*>(out);
        auto* x = static_cast<const T*>(a);
        auto* y = static_cast<const T*>(b);
        for (size_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
      };
    case ReduceOp::Max:
      return [](void* out, const void* a, const void* b, size_t n) {
        auto* o = static_cast<T*>(out);
        auto* x = static_cast<const T*>(a);
        auto* y = static_cast<const T*>(b);
        for (size_t i = 0; i < n; ++i) o[i] = x[i] < y[i] ? y[i] : x[i];
      };
    case ReduceOp::Min:
      return [](void* out, const void* a, const void* b, size_t n) {
        auto* o = static_cast<T*>(out);
        auto* x = static_cast<const T*>(a);
        auto* y = static_cast<const T*>(b);
        for (size_t i = 0; i < n; ++i) o[i] = y[i] < x[i] ? y[i] : x[i];
      };
  }
  return {};
}

// Divides a float32 sum by world_size in place (Avg). Division, not multiplication by
// 1/world_size, so an exactly representable average comes out exact.
void divide(float* data, size_t n, int world_size) {
  const float w = static_cast<float>(world_size);
  for (size_t i = 0; i < n; ++i) data[i] /= w;
}

// A collective queued on the worker thread. Finished = ran (error or not).
class GlooWork : public Work {
 public:
  GlooWork(std::string description, std::function<void()> run,
           std::shared_ptr<std::atomic<bool>> broken)
      : description_(std::move(description)), run_(std::move(run)), broken_(std::move(broken)) {}

  void wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!done_cv_.wait_for(lock, timeout, [this] { return done_; })) {
      broken_->store(true);
      NANODDP_THROW(TimeoutError, description_, ": did not complete within ", timeout.count(),
                    " ms (a peer may have exited or be out of step)");
    }
    if (error_) std::rethrow_exception(error_);
  }

  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }

  // Runs on the worker thread; never throws.
  void run() {
    std::exception_ptr error;
    try {
      run_();
    } catch (const gloo::Exception& e) {
      try {
        NANODDP_THROW(DistError, description_, ": Gloo failed: ", e.what());
      } catch (...) {
        error = std::current_exception();
      }
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    run_ = nullptr;  // lets go of the tensors
    error_ = error;
    done_ = true;
    done_cv_.notify_all();
  }

 private:
  std::string description_;
  std::function<void()> run_;
  std::shared_ptr<std::atomic<bool>> broken_;
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

std::atomic<int> next_group_id{0};

class ProcessGroupGloo : public ProcessGroup {
 public:
  ProcessGroupGloo(std::shared_ptr<dist::Store> store, const GlooOptions& options)
      : ProcessGroup(options.rank, options.world_size),
        store_(std::move(store)),
        timeout_(options.timeout) {
    // Groups are built in the same order on every rank, so the counter names the same group.
    std::string prefix = "gloo/" + std::to_string(next_group_id++) + "/";
    try {
      gloo::transport::tcp::attr attr;
      attr.hostname = detail::local_address_towards(options.master_addr, options.master_port);
      auto device = gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<gloo::rendezvous::Context>(rank_, world_size_);
      context->setTimeout(timeout_);
      GlooStore gloo_store(store_, prefix);
      context->connectFullMesh(gloo_store, device);
      context_ = context;
    } catch (const gloo::Exception& e) {
      NANODDP_THROW(DistError, where(), ": gloo: connecting the full mesh of ", world_size_,
                    " ranks failed: ", e.what());
    }
    worker_ = std::thread([this] { work_loop(); });
  }

  ~ProcessGroupGloo() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    queue_cv_.notify_all();
    // After a timeout the worker may sit in a collective until Gloo's own timeout: do not
    // make the caller (often an exception path) wait for it. The process is about to exit.
    if (broken_->load()) {
      worker_.detach();
      new std::shared_ptr<gloo::Context>(std::move(context_));  // leaked on purpose, see above
    } else {
      worker_.join();
    }
  }

  std::string backend_name() const override { return "gloo"; }
  Store& store() override { return *store_; }

  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op) override {
    std::string what = std::string("all_reduce(") + reduce_op_name(op) + ")";
    check_tensor(what, tensor, Device::cpu());
    check_reduce(what, tensor, op);
    if (world_size_ == 1 || tensor.numel() == 0) return std::make_shared<CompletedWork>();
    return enqueue(describe(what, tensor), [this, tensor, op] {
      all_reduce_now(tensor, op, tensor.numel());
    });
  }

  std::shared_ptr<Work> broadcast(Tensor& tensor, int root) override {
    check_tensor("broadcast", tensor, Device::cpu());
    NANODDP_CHECK(root >= 0 && root < world_size_, ValueError, describe("broadcast", tensor),
                  ": root ", root, " is not a rank of this group");
    if (world_size_ == 1 || tensor.numel() == 0) return std::make_shared<CompletedWork>();
    return enqueue(describe("broadcast from rank " + std::to_string(root), tensor),
                   [this, tensor, root] {
                     gloo::BroadcastOptions opts(context_);
                     set_output(opts, tensor, tensor.numel());
                     opts.setRoot(root);
                     opts.setTag(next_tag());
                     opts.setTimeout(timeout_);
                     gloo::broadcast(opts);
                   });
  }

  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override {
    check_tensor("all_gather", input, Device::cpu());
    check_list("all_gather", outputs, input);
    std::vector<Tensor> outs = outputs;
    if (world_size_ == 1) {
      outs[0].copy_(input);
      return std::make_shared<CompletedWork>();
    }
    if (input.numel() == 0) return std::make_shared<CompletedWork>();
    return enqueue(describe("all_gather", input), [this, outs, input] {
      const size_t nbytes = input.nbytes();
      Tensor gathered = Tensor::empty({input.numel() * world_size_}, input.dtype());
      gloo::AllgatherOptions opts(context_);
      if (input.dtype() == DType::Float32) {
        opts.setInput(input.data<float>(), input.numel());
        opts.setOutput(gathered.data<float>(), gathered.numel());
      } else {
        opts.setInput(input.data<int64_t>(), input.numel());
        opts.setOutput(gathered.data<int64_t>(), gathered.numel());
      }
      opts.setTag(next_tag());
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
      const auto* src = static_cast<const uint8_t*>(gathered.impl()->storage->data());
      for (int r = 0; r < world_size_; ++r)
        std::memcpy(outs[r].impl()->storage->data(), src + r * nbytes, nbytes);
    });
  }

  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                       ReduceOp op) override {
    std::string what = std::string("reduce_scatter(") + reduce_op_name(op) + ")";
    check_tensor(what, output, Device::cpu());
    check_reduce(what, output, op);
    check_list(what, inputs, output);
    if (world_size_ == 1) {
      output.copy_(inputs[0]);
      return std::make_shared<CompletedWork>();
    }
    if (output.numel() == 0) return std::make_shared<CompletedWork>();
    // Note [Gloo new-style API]: all-reduce the concatenation, keep our slice.
    const size_t nbytes = output.nbytes();
    Tensor flat = Tensor::empty({output.numel() * world_size_}, output.dtype());
    auto* dst = static_cast<uint8_t*>(flat.impl()->storage->data());
    for (int r = 0; r < world_size_; ++r)
      std::memcpy(dst + r * nbytes, inputs[r].impl()->storage->data(), nbytes);
    return enqueue(describe(what, output), [this, flat, output, op, nbytes] {
      all_reduce_now(flat, op, flat.numel());
      std::memcpy(output.impl()->storage->data(),
                  static_cast<const uint8_t*>(flat.impl()->storage->data()) + rank_ * nbytes,
                  nbytes);
    });
  }

  std::shared_ptr<Work> barrier() override {
    if (world_size_ == 1) return std::make_shared<CompletedWork>();
    return enqueue(where() + ": gloo barrier", [this] {
      gloo::BarrierOptions opts(context_);
      opts.setTag(next_tag());
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

 private:
  template <typename Options>
  static void set_output(Options& opts, const Tensor& tensor, int64_t numel) {
    if (tensor.dtype() == DType::Float32)
      opts.setOutput(tensor.data<float>(), static_cast<size_t>(numel));
    else
      opts.setOutput(tensor.data<int64_t>(), static_cast<size_t>(numel));
  }

  // Runs on the worker thread.
  void all_reduce_now(const Tensor& tensor, ReduceOp op, int64_t numel) {
    gloo::AllreduceOptions opts(context_);
    set_output(opts, tensor, numel);
    opts.setReduceFunction(tensor.dtype() == DType::Float32 ? reduce_function<float>(op)
                                                            : reduce_function<int64_t>(op));
    opts.setTag(next_tag());
    opts.setTimeout(timeout_);
    gloo::allreduce(opts);
    if (op == ReduceOp::Avg) divide(tensor.data<float>(), static_cast<size_t>(numel), world_size_);
  }

  uint32_t next_tag() { return tag_++; }

  std::shared_ptr<Work> enqueue(std::string description, std::function<void()> run) {
    auto work = std::make_shared<GlooWork>(std::move(description), std::move(run), broken_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(work);
    }
    queue_cv_.notify_one();
    return work;
  }

  void work_loop() {
    while (true) {
      std::shared_ptr<GlooWork> work;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        queue_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and nothing left to run
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work->run();
    }
  }

  std::shared_ptr<dist::Store> store_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<gloo::Context> context_;
  uint32_t tag_ = 0;  // used by the worker thread only
  std::shared_ptr<std::atomic<bool>> broken_ = std::make_shared<std::atomic<bool>>(false);
  std::mutex mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<GlooWork>> queue_;
  bool stop_ = false;
  std::thread worker_;  // last: started in the constructor body
};

}  // namespace

std::shared_ptr<ProcessGroup> make_gloo_process_group(std::shared_ptr<Store> store,
                                                      const GlooOptions& options) {
  NANODDP_CHECK(store != nullptr, ValueError, "make_gloo_process_group: no store");
  return std::make_shared<ProcessGroupGloo>(std::move(store), options);
}

}  // namespace nanoddp::dist

#else  // !NANODDP_WITH_GLOO

namespace nanoddp::dist {

std::shared_ptr<ProcessGroup> make_gloo_process_group(std::shared_ptr<Store>,
                                                      const GlooOptions& options) {
  NANODDP_THROW(DistError, detail::where(options.rank, options.world_size),
                ": nanoddp was built without Gloo (install libgloo-dev and reconfigure with "
                "-Dgloo=enabled)");
}

}  // namespace nanoddp::dist

#endif
