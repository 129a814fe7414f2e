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
//
// The collective check's fingerprints travel through shared memory when every rank is on this
// machine (Note [Shared-memory fingerprints] in dist/host_fingerprints.cpp).
#include "core/error.h"
#include "core/op_helpers.h"
#include "core/half_convert.h"
#include "dist/deadline.h"
#include "dist/detail.h"
#include "dist/launcher_link.h"
#include "dist/process_group.h"

#if NANODDP_WITH_GLOO

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <type_traits>

#include <signal.h>
#include <unistd.h>

#include "dist/gloo_store.h"
#include "dist/host_fingerprints.h"

namespace nanoddp::dist {

namespace {

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
    case ReduceOp::Max:  // Note [Max and Min] in dist/detail.h
      return [](void* out, const void* a, const void* b, size_t n) {
        auto* o = static_cast<T*>(out);
        auto* x = static_cast<const T*>(a);
        auto* y = static_cast<const T*>(b);
        for (size_t i = 0; i < n; ++i) o[i] = detail::max_of(x[i], y[i]);
      };
    case ReduceOp::Min:
      return [](void* out, const void* a, const void* b, size_t n) {
        auto* o = static_cast<T*>(out);
        auto* x = static_cast<const T*>(a);
        auto* y = static_cast<const T*>(b);
        for (size_t i = 0; i < n; ++i) o[i] = detail::min_of(x[i], y[i]);
      };
  }
  return {};
}

// Sum of 16-bit floats (Float16, BFloat16 from core/half.h): widen to float32, add, round
// back, as Gloo's own float16 sum does; the one sum every backend defines for them.
template <typename T>
gloo::AllreduceOptions::Func sum_16bit() {
  return [](void* out, const void* a, const void* b, size_t n) {
    auto* o = static_cast<T*>(out);
    auto* x = static_cast<const T*>(a);
    auto* y = static_cast<const T*>(b);
    if constexpr (std::is_same_v<T, Float16>) {
      float16_add(o, x, y, static_cast<int64_t>(n));  // F16C where the CPU has it (core/half_convert.h)
    } else {
      for (size_t i = 0; i < n; ++i) o[i] = T::from_float(x[i].to_float() + y[i].to_float());
    }
  };
}

// A peer as its Gloo errors name it ("Connection closed by peer [10.0.0.2]:40123$3"): its
// listening address as Gloo prints it, and who it is.
struct GlooPeer {
  int rank = -1;
  std::string address;  // as our pair with it prints it (one GlooPeer per candidate address)
  long pid = 0;
  std::string host;
};

// What the worker thread and its tasks need, shared so that a worker left running after a
// timeout (see ~ProcessGroupGloo) never touches a destroyed group.
struct GlooRunner {
  std::shared_ptr<gloo::Context> context;
  std::chrono::milliseconds timeout{};
  int rank = 0;
  int world_size = 1;
  uint32_t tag = 0;  // worker thread only
  std::atomic<bool> broken{false};  // a wait timed out: the group is out of step
  std::vector<GlooPeer> peers;      // every rank but this one; set before the worker starts
  // The shm group the fingerprints travel through, or null (Note [Shared-memory fingerprints]
  // in dist/host_fingerprints.cpp).
  std::shared_ptr<ProcessGroup> fingerprint_group;

  // For an error of Gloo's: "; lost rank 1 (pid 4242 on node7)" when it names a peer whose
  // connection closed (then also reported to the launcher, Note [Launcher link]), "; peer: rank
  // 1 (...)" when it names one otherwise (a timeout), else "".
  std::string name_peer(const std::string& error) const {
    for (const GlooPeer& peer : peers) {
      for (size_t at = error.find(peer.address); at != std::string::npos; at = error.find(peer.address, at + 1)) {
        const size_t end = at + peer.address.size();
        if (end < error.size() && std::isdigit(static_cast<unsigned char>(error[end]))) continue;  // a longer port
        const bool lost = error.find("closed") != std::string::npos || error.find("Read error") != std::string::npos ||
                          error.find("Write error") != std::string::npos;
        if (lost) report_lost_peer(rank, peer.rank);
        return std::string(lost ? "; lost rank " : "; peer: rank ") + std::to_string(peer.rank) + " (pid " +
               std::to_string(peer.pid) + " on " + peer.host + ")";
      }
    }
    return "";
  }

  uint32_t next_tag() { return tag++; }

  // Every rank's `mine` (all the same length), rank-major, through Gloo.
  std::vector<int64_t> all_gather(const std::vector<int64_t>& mine) {
    std::vector<int64_t> table(mine.size() * static_cast<size_t>(world_size));
    gloo::AllgatherOptions opts(context);
    opts.setInput(const_cast<int64_t*>(mine.data()), mine.size());
    opts.setOutput(table.data(), table.size());
    prepare(opts);
    gloo::allgather(opts);
    return table;
  }

  template <typename Options>
  void prepare(Options& opts) {
    opts.setTag(next_tag());
    opts.setTimeout(timeout);
  }

  void all_reduce(const Tensor& tensor, ReduceOp op) {
    gloo::AllreduceOptions opts(context);
    const size_t numel = static_cast<size_t>(tensor.numel());
    switch (tensor.dtype()) {
      case DType::Float32:
        opts.setOutput(tensor.data<float>(), numel);
        opts.setReduceFunction(reduce_function<float>(op));
        break;
      case DType::Float16:  // Sum only (ProcessGroup::check_reduce)
        opts.setOutput(tensor.data<Float16>(), numel);
        opts.setReduceFunction(sum_16bit<Float16>());
        break;
      case DType::BFloat16:
        opts.setOutput(tensor.data<BFloat16>(), numel);
        opts.setReduceFunction(sum_16bit<BFloat16>());
        break;
      case DType::Int64:
        opts.setOutput(tensor.data<int64_t>(), numel);
        opts.setReduceFunction(reduce_function<int64_t>(op));
        break;
      default:  // check_reduce refuses it first
        NANODDP_THROW(ValueError, "gloo: no reduction for ", dtype_name(tensor.dtype()));
    }
    prepare(opts);
    gloo::allreduce(opts);
    if (op == ReduceOp::Avg) detail::divide_by_world_size(tensor.data<float>(), static_cast<int64_t>(numel), world_size);
  }
};

using GlooTask = std::function<void(GlooRunner&)>;

// A collective queued on the worker thread. Finished = ran (error or not).
class GlooWork : public Work {
 public:
  GlooWork(std::string description, GlooTask task, std::shared_ptr<GlooRunner> runner)
      : description_(std::move(description)), task_(std::move(task)), runner_(std::move(runner)) {}

  void wait(std::chrono::milliseconds timeout) override {
    timeout = effective_wait_timeout(timeout, runner_->timeout);  // every wait ends by the group's timeout
    std::unique_lock<std::mutex> lock(mutex_);
    if (!done_cv_.wait_for(lock, timeout, [this] { return done_; })) {
      runner_->broken = true;
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
      task_(*runner_);
    } catch (const gloo::Exception& e) {
      try {
        NANODDP_THROW(DistError, description_, ": Gloo failed: ", message_of(e),
                      runner_->name_peer(message_of(e)));
      } catch (...) {
        error = std::current_exception();
      }
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = nullptr;  // lets go of the tensors
    error_ = error;
    done_ = true;
    done_cv_.notify_all();
  }

 private:
  std::string description_;
  GlooTask task_;
  std::shared_ptr<GlooRunner> runner_;
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

// The queue between callers and the worker thread (Note [Gloo worker thread]).
class GlooQueue {
 public:
  void push(std::shared_ptr<GlooWork> work) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(work));
    }
    cv_.notify_one();
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
  }
  // Runs works in order until stopped with nothing left, or stopped after a timeout.
  void run(GlooRunner& runner) {
    while (true) {
      std::shared_ptr<GlooWork> work;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (stop_ && (queue_.empty() || runner.broken)) return;
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work->run();
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<GlooWork>> queue_;
  bool stop_ = false;
};

// A send or recv on the caller's thread (not the worker: point-to-point does not wait for
// the collectives queued before it, as in PyTorch's ProcessGroupGloo). Gloo's pair threads
// move the bytes; wait() waits on the unbound buffer.
class GlooPointToPointWork : public Work {
 public:
  GlooPointToPointWork(std::string description, Tensor tensor,
                       std::unique_ptr<gloo::transport::UnboundBuffer> buffer, bool is_send,
                       std::chrono::milliseconds group_timeout)
      : description_(std::move(description)),
        tensor_(std::move(tensor)),
        buffer_(std::move(buffer)),
        is_send_(is_send),
        group_timeout_(group_timeout) {}

  void wait(std::chrono::milliseconds timeout) override {
    if (done_) return;
    timeout = effective_wait_timeout(timeout, group_timeout_);
    try {
      const bool completed = is_send_ ? buffer_->waitSend(timeout) : buffer_->waitRecv(timeout);
      NANODDP_CHECK(completed, DistError, description_, ": aborted");
    } catch (const gloo::IoException& e) {
      if (message_of(e).find("Timed out") != std::string::npos)
        NANODDP_THROW(TimeoutError, description_, ": did not complete within ", timeout.count(),
                      " ms (a peer may have exited or be out of step): ", message_of(e));
      NANODDP_THROW(DistError, description_, ": Gloo failed: ", message_of(e));
    } catch (const gloo::Exception& e) {
      NANODDP_THROW(DistError, description_, ": Gloo failed: ", message_of(e));
    }
    done_ = true;
  }
  // Gloo's unbound buffer cannot be polled; a work is known complete once waited for.
  bool is_completed() override { return done_; }

 private:
  std::string description_;
  Tensor tensor_;  // kept alive while Gloo reads or writes it
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer_;
  bool is_send_;
  std::chrono::milliseconds group_timeout_;
  bool done_ = false;
};

std::atomic<int> next_gloo_group_id{0};

// Note [Gloo and SIGPIPE]
// Gloo writes to its sockets without MSG_NOSIGNAL. When a peer dies (kill -9), the next write
// to it raises SIGPIPE, whose default ends this rank by that signal, before the collective can
// fail with an error naming the lost peer; the launcher may then name this rank (141) instead
// of the one killed. Python, torch's host, ignores SIGPIPE from its start, so torch's Gloo
// always sees EPIPE. A process that makes a Gloo group does the same: SIGPIPE is ignored
// unless the program set a disposition of its own. A write to a closed pipe (stdout into
// `head`) then fails with EPIPE instead of ending the program, as in Python.
void ignore_sigpipe_as_python_does() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) return;
  struct sigaction ignore {};
  sigemptyset(&ignore.sa_mask);
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ignore, nullptr);
}

class ProcessGroupGloo : public ProcessGroup {
 public:
  ProcessGroupGloo(std::shared_ptr<dist::Store> store, const GlooOptions& options)
      : ProcessGroup(options.rank, options.world_size), store_(std::move(store)) {
    ignore_sigpipe_as_python_does();  // Note [Gloo and SIGPIPE]
    // Gloo adds it to its clock's nanoseconds (Note [Long timeouts]).
    const std::chrono::milliseconds timeout = detail::cap_timeout(options.timeout);
    runner_->timeout = timeout;
    runner_->rank = rank_;
    runner_->world_size = world_size_;
    // Groups are built in the same order on every rank, so the counter names the same group.
    std::string prefix = !options.store_prefix.empty()
                             ? options.store_prefix
                             : "gloo/" + std::to_string(next_gloo_group_id++) + "/";
    try {
      gloo::transport::tcp::attr attr;
      attr.hostname = detail::local_address_towards(options.master_addr, options.master_port);
      auto device = gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<gloo::rendezvous::Context>(rank_, world_size_);
      // Gloo's TCP pairs wait 5x the context's timeout for their initial connect
      // (gloo/transport/tcp/pair.h, waitUntil); give them a fifth so that connecting the
      // pairs, like every other wait, ends by the group's timeout. The wait for the peers'
      // addresses before that keeps the whole timeout (GlooStore).
      context->setTimeout(std::max(timeout / 5, std::chrono::milliseconds(1)));
      GlooStore gloo_store(store_, prefix, rank_, world_size_, timeout);
      context->connectFullMesh(gloo_store, device);
      context->setTimeout(timeout);
      runner_->context = context;
      runner_->peers = exchange_peers(*context, prefix, gloo_store.peer_addresses());
    } catch (const gloo::Exception& e) {
      NANODDP_THROW(DistError, where(), ": gloo: connecting the full mesh of ", world_size_,
                    " ranks failed: ", message_of(e));
    }
    if (options.fingerprints_over_shm)
      runner_->fingerprint_group =
          make_shm_fingerprint_group(store_, prefix, rank_, world_size_, timeout);
    worker_ = std::thread([queue = queue_, runner = runner_] { queue->run(*runner); });
  }

  // Publishes who this rank is and reads who the others are, so that an error naming a peer's
  // address can name the rank (GlooRunner::name_peer). A pair's errors print the peer address
  // it knows, which depends on the Gloo version: the address the peer gave in the rendezvous
  // (`given`, noted by GlooStore), or, where Gloo updates it once connected, the peer's end of
  // the socket, which the peer publishes here (its pair's address() after connecting).
  std::vector<GlooPeer> exchange_peers(gloo::Context& context, const std::string& prefix,
                                       const std::map<int, std::string>& given) {
    std::string who = std::to_string(::getpid()) + " " + detail::host_name();
    for (int r = 0; r < world_size_; ++r) who += " " + (r == rank_ ? std::string("-") : context.getPair(r)->address().str());
    store_->set(prefix + "who/" + std::to_string(rank_), who);
    std::vector<GlooPeer> peers;
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_) continue;
      std::istringstream fields(store_->get_string(prefix + "who/" + std::to_string(r)));
      GlooPeer peer;
      peer.rank = r;
      fields >> peer.pid >> peer.host;
      for (int i = 0; i <= rank_ && fields >> peer.address; ++i) {  // the rank_-th: its pair with us
      }
      if (fields) peers.push_back(peer);
      const auto it = given.find(r);
      if (it != given.end()) {
        peer.address = it->second;
        peers.push_back(peer);
      }
    }
    return peers;
  }

  ~ProcessGroupGloo() override {
    queue_->stop();
    // After a timeout the worker may sit in a collective until Gloo's own timeout: do not
    // make the caller (often an exception path) wait for it. The detached thread owns what
    // it uses (queue, runner), so it finishes or fails on its own before the process exits.
    if (runner_->broken)
      worker_.detach();
    else
      worker_.join();
  }

  std::string backend_name() const override { return "gloo"; }
  Store& store() override { return *store_; }

  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op) override {
    std::string what = std::string("all_reduce(") + reduce_op_name(op) + ")";
    check_tensor(what, tensor, Device::cpu());
    check_reduce(what, tensor, op);
    count_call(Collective::AllReduce, tensor);
    if (world_size_ == 1 || tensor.numel() == 0) return std::make_shared<CompletedWork>();
    return enqueue(describe(what, tensor),
                   [tensor, op](GlooRunner& runner) { runner.all_reduce(tensor, op); });
  }

  std::shared_ptr<Work> broadcast(Tensor& tensor, int root) override {
    check_tensor("broadcast", tensor, Device::cpu());
    NANODDP_CHECK(root >= 0 && root < world_size_, ValueError, describe("broadcast", tensor),
                  ": root ", root, " is not a rank of this group");
    count_call(Collective::Broadcast, tensor);
    if (world_size_ == 1 || tensor.numel() == 0) return std::make_shared<CompletedWork>();
    return enqueue(describe("broadcast from rank " + std::to_string(root), tensor),
                   [tensor, root](GlooRunner& runner) {
                     gloo::BroadcastOptions opts(runner.context);
                     // A copy: the bytes are all that matters, whatever the dtype.
                     opts.setOutput(static_cast<uint8_t*>(tensor.impl()->storage->data()), tensor.nbytes());
                     opts.setRoot(root);
                     runner.prepare(opts);
                     gloo::broadcast(opts);
                   });
  }

  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override {
    check_tensor("all_gather", input, Device::cpu());
    check_list("all_gather", outputs, input);
    count_call(Collective::AllGather, input);
    std::vector<Tensor> outs = outputs;
    if (world_size_ == 1) {
      copy_values(outs[0], input);
      return std::make_shared<CompletedWork>();
    }
    if (input.numel() == 0) return std::make_shared<CompletedWork>();
    return enqueue(describe("all_gather", input), [outs, input](GlooRunner& runner) {
      const size_t nbytes = input.nbytes();
      // Straight into the outputs when they are one buffer (and the input is not in it).
      uint8_t* into = detail::back_to_back(outs, input);
      Tensor gathered = into != nullptr ? Tensor() : Tensor::empty({input.numel() * runner.world_size}, input.dtype());
      gloo::AllgatherOptions opts(runner.context);
      // A copy: the bytes are all that matters, whatever the dtype.
      opts.setInput(static_cast<uint8_t*>(input.impl()->storage->data()), nbytes);
      opts.setOutput(into != nullptr ? into : detail::bytes_of(gathered), nbytes * runner.world_size);
      runner.prepare(opts);
      gloo::allgather(opts);
      if (into != nullptr) return;
      const auto* src = static_cast<const uint8_t*>(gathered.impl()->storage->data());
      for (size_t r = 0; r < outs.size(); ++r)
        std::memcpy(outs[r].impl()->storage->data(), src + r * nbytes, nbytes);
    });
  }

  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                       ReduceOp op) override {
    std::string what = std::string("reduce_scatter(") + reduce_op_name(op) + ")";
    check_tensor(what, output, Device::cpu());
    check_reduce(what, output, op);
    check_list(what, inputs, output);
    count_call(Collective::ReduceScatter, output);
    if (world_size_ == 1) {
      copy_values(output, inputs[0]);
      return std::make_shared<CompletedWork>();
    }
    if (output.numel() == 0) return std::make_shared<CompletedWork>();
    // Note [Gloo new-style API]: all-reduce the concatenation, keep our slice.
    const size_t nbytes = output.nbytes();
    Tensor flat = Tensor::empty({output.numel() * world_size_}, output.dtype());
    auto* dst = static_cast<uint8_t*>(flat.impl()->storage->data());
    for (int r = 0; r < world_size_; ++r)
      std::memcpy(dst + r * nbytes, inputs[r].impl()->storage->data(), nbytes);
    return enqueue(describe(what, output), [flat, output, op, nbytes](GlooRunner& runner) {
      runner.all_reduce(flat, op);
      std::memcpy(output.impl()->storage->data(),
                  static_cast<const uint8_t*>(flat.impl()->storage->data()) + runner.rank * nbytes,
                  nbytes);
    });
  }

  // Note [Fused collective check]: the collective's task first all-gathers the fingerprints
  // and verifies them. A call that queues nothing (an empty tensor) still queues the guard:
  // the peers' tasks wait for this rank's fingerprint.
  bool can_start_guarded() const override { return true; }
  std::shared_ptr<Work> start_guarded(CollectiveGuard guard,
                                      const std::function<std::shared_ptr<Work>()>& start) override {
    guard_ = std::move(guard);
    std::shared_ptr<Work> work;
    try {
      work = start();
    } catch (...) {
      guard_.reset();
      throw;
    }
    if (guard_) work = enqueue(where() + ": collective check", [](GlooRunner&) {});
    return work;
  }

  std::shared_ptr<Work> send(const Tensor& tensor, int dst, int tag) override {
    return point_to_point(tensor, dst, tag, true);
  }
  std::shared_ptr<Work> recv(Tensor& tensor, int src, int tag) override {
    return point_to_point(tensor, src, tag, false);
  }

  std::shared_ptr<Work> barrier() override {
    count_call(Collective::Barrier);
    if (world_size_ == 1) return std::make_shared<CompletedWork>();
    return enqueue(where() + ": gloo barrier", [](GlooRunner& runner) {
      gloo::BarrierOptions opts(runner.context);
      runner.prepare(opts);
      gloo::barrier(opts);
    });
  }

 private:
  std::shared_ptr<Work> point_to_point(const Tensor& tensor, int peer, int tag, bool is_send) {
    const std::string what = describe(
        (is_send ? "send to rank " : "recv from rank ") + std::to_string(peer), tensor);
    check_point_to_point(what, tensor, peer, tag, is_send);
    NANODDP_CHECK(!runner_->broken, DistError, what,
                  ": the group is unusable after an earlier timeout");
    // The tag is the slot, as in PyTorch; collectives use slots with a prefix above 32 bits.
    const uint64_t slot = static_cast<uint32_t>(tag);
    try {
      auto buffer = runner_->context->createUnboundBuffer(tensor.impl()->storage->data(),
                                                          tensor.nbytes());
      if (is_send)
        buffer->send(peer, slot);
      else
        buffer->recv(peer, slot);
      return std::make_shared<GlooPointToPointWork>(what, tensor, std::move(buffer), is_send,
                                                    runner_->timeout);
    } catch (const gloo::Exception& e) {
      NANODDP_THROW(DistError, what, ": Gloo failed: ", message_of(e));
    }
  }

  std::shared_ptr<Work> enqueue(std::string description, GlooTask task) {
    NANODDP_CHECK(!runner_->broken, DistError, description,
                  ": the group is unusable after an earlier timeout");
    if (guard_) {
      task = [guard = std::move(*guard_), task = std::move(task), description](GlooRunner& runner) {
        if (guard.refuse) guard.refuse();
        const std::vector<int64_t> table =
            runner.fingerprint_group != nullptr
                ? all_gather_fingerprints(*runner.fingerprint_group, guard.fingerprint, description,
                                          runner.timeout)
                : runner.all_gather(guard.fingerprint);
        guard.verify(table);
        task(runner);
      };
      guard_.reset();
    }
    auto work = std::make_shared<GlooWork>(std::move(description), std::move(task), runner_);
    queue_->push(work);
    return work;
  }

  std::shared_ptr<dist::Store> store_;
  std::shared_ptr<GlooRunner> runner_ = std::make_shared<GlooRunner>();
  std::shared_ptr<GlooQueue> queue_ = std::make_shared<GlooQueue>();
  std::thread worker_;
  std::optional<CollectiveGuard> guard_;  // set only inside start_guarded: the next task's
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
  NANODDP_THROW(DistError, detail::where(options.rank, options.world_size), ": ",
                backend_unavailable(Backend::Gloo));
}

}  // namespace nanoddp::dist

#endif
