// The two-level process group ("shm+gloo"): ranks on several machines, several ranks per
// machine. Inside a node the ranks share memory, which is an order of magnitude faster than
// any network; across nodes only one rank per node talks, so each node's link carries one
// copy of the buffer instead of local_world_size copies (what NCCL and Horovod's hierarchical
// all-reduce do).
//
//   all_reduce, 2 nodes x 2 ranks:
//     node 0: rank 0, rank 1 ──shm all_reduce──> rank 0 (leader) ─┐
//     node 1: rank 2, rank 3 ──shm all_reduce──> rank 2 (leader) ─┴─ gloo all_reduce
//     each leader ──shm broadcast──> the other ranks of its node
//
// The three groups are made in the same order on every rank (step numbers as in
// ProcessGroupTwoLevel's constructor), each with store keys of its own: "shm/node<k>/" for
// node k's shared-memory group, "gloo/leaders/" for the leaders, "gloo/world/" for all ranks.
// Works run on the waiting thread in issue order, as the shm group's do (Note [Shm progress]
// in shm_progress.cpp).
#include <deque>
#include <functional>
#include <mutex>

#include "core/error.h"
#include "dist/deadline.h"
#include "dist/detail.h"
#include "dist/process_group.h"

namespace nanoddp::dist {

namespace {

using Clock = std::chrono::steady_clock;

// Remaining time before deadline, at least 1 ms: a wait of 0 ms would wait for the group's
// whole timeout (effective_wait_timeout), where a passed deadline must end the wait now.
std::chrono::milliseconds left(Clock::time_point deadline) {
  auto rest = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(rest, std::chrono::milliseconds(1));
}

// The group's collectives queued in issue order; a wait() runs every earlier one first.
class TwoLevelQueue;

class TwoLevelWork : public Work {
 public:
  TwoLevelWork(std::shared_ptr<TwoLevelQueue> queue, std::function<void(Clock::time_point)> run)
      : queue_(std::move(queue)), run_(std::move(run)) {}
  void wait(std::chrono::milliseconds timeout) override;
  bool is_completed() override;

 private:
  friend class TwoLevelQueue;
  std::shared_ptr<TwoLevelQueue> queue_;
  std::function<void(Clock::time_point)> run_;
  bool done_ = false;
  std::exception_ptr error_;
};

class TwoLevelQueue {
 public:
  explicit TwoLevelQueue(std::chrono::milliseconds timeout) : timeout(timeout) {}
  const std::chrono::milliseconds timeout;  // the group's: bounds every wait (effective_wait_timeout)

  void push(std::shared_ptr<TwoLevelWork> work) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back(std::move(work));
  }
  // Runs pending works in issue order until target is done.
  void run_until(TwoLevelWork& target, Clock::time_point deadline) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (!target.done_ && !pending_.empty()) {
      auto work = pending_.front();
      pending_.pop_front();
      try {
        work->run_(deadline);
      } catch (...) {
        work->error_ = std::current_exception();
      }
      work->run_ = nullptr;
      work->done_ = true;
    }
  }
  bool done(const TwoLevelWork& work) {
    std::lock_guard<std::mutex> lock(mutex_);
    return work.done_;
  }
  // The group is going: works not run yet fail (their waits throw DistError), and let go of
  // what they hold (a work and the queue hold each other).
  void drop_pending() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& work : pending_) {
      work->error_ = std::make_exception_ptr(
          DistError("shm+gloo: the process group was destroyed before this collective ran"));
      work->run_ = nullptr;
      work->done_ = true;
    }
    pending_.clear();
  }

 private:
  std::mutex mutex_;
  std::deque<std::shared_ptr<TwoLevelWork>> pending_;
};

void TwoLevelWork::wait(std::chrono::milliseconds timeout) {
  if (!queue_->done(*this))
    queue_->run_until(*this, detail::deadline_after(effective_wait_timeout(timeout, queue_->timeout)));
  if (error_) std::rethrow_exception(error_);
}

bool TwoLevelWork::is_completed() { return queue_->done(*this); }

class ProcessGroupTwoLevel : public ProcessGroup {
 public:
  ProcessGroupTwoLevel(std::shared_ptr<Store> store, const TwoLevelOptions& o)
      : ProcessGroup(o.rank, o.world_size), store_(std::move(store)) {
    NANODDP_CHECK(o.local_world_size >= 1 && o.world_size % o.local_world_size == 0 && o.local_rank >= 0 &&
                      o.local_rank < o.local_world_size &&
                      o.rank == o.node_rank * o.local_world_size + o.local_rank,
                  ValueError, where(),
                  ": shm+gloo needs ranks numbered node by node with the same "
                  "number per node, but rank ",
                  o.rank, " says node ", o.node_rank, ", local rank ", o.local_rank, " of ",
                  o.local_world_size, " (world size ", o.world_size, ")");
    const int nnodes = o.world_size / o.local_world_size;
    queue_ = std::make_shared<TwoLevelQueue>(detail::cap_timeout(o.timeout));  // Note [Long timeouts]
    // 1. The node's shared-memory group.
    ShmOptions shm;
    shm.rank = o.local_rank;
    shm.world_size = o.local_world_size;
    shm.timeout = o.timeout;
    shm.store_prefix = "shm/node" + std::to_string(o.node_rank) + "/";
    local_ = make_shm_process_group(store_, shm);
    // 2. The leaders (local rank 0 of every node), rank = node index.
    GlooOptions gloo;
    gloo.master_addr = o.master_addr;
    gloo.master_port = o.master_port;
    gloo.timeout = o.timeout;
    if (o.local_rank == 0) {
      gloo.rank = o.node_rank;
      gloo.world_size = nnodes;
      gloo.store_prefix = "gloo/leaders/";
      leaders_ = make_gloo_process_group(store_, gloo);
    }
    // 3. Every rank, for what is not an all_reduce.
    gloo.rank = o.rank;
    gloo.world_size = o.world_size;
    gloo.store_prefix = "gloo/world/";
    world_ = make_gloo_process_group(store_, gloo);
  }

  ~ProcessGroupTwoLevel() override { queue_->drop_pending(); }

  std::string backend_name() const override { return "shm+gloo"; }
  bool collectives_run_in_wait() const override { return true; }
  Store& store() override { return *store_; }
  // The local all-reduce (step 1) then runs on it directly (Note [Shm direct all-reduce]).
  Tensor new_collective_buffer(int64_t numel, DType dtype, Device device) override {
    return local_->new_collective_buffer(numel, dtype, device);
  }

  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op) override {
    const std::string name = std::string("all_reduce(") + reduce_op_name(op) + ")";
    check_tensor(name, tensor, Device::cpu());
    check_reduce(name, tensor, op);
    count_call(Collective::AllReduce, tensor);
    // Avg: sums at both levels, one division at the end.
    const ReduceOp level_op = op == ReduceOp::Avg ? ReduceOp::Sum : op;
    auto local = local_;
    auto leaders = leaders_;
    const int world_size = world_size_;
    return queued([tensor, op, level_op, local, leaders, world_size](Clock::time_point deadline) mutable {
      local->all_reduce(tensor, level_op)->wait(left(deadline));                 // 1. inside the node
      if (leaders) leaders->all_reduce(tensor, level_op)->wait(left(deadline));  // 2. across
      local->broadcast(tensor, 0)->wait(left(deadline));                         // 3. leader -> node
      if (op == ReduceOp::Avg) detail::divide_by_world_size(tensor, world_size);
    });
  }

  // The other collectives run on the world's Gloo group, queued behind the all-reduces like
  // them, so that works complete in the order issued (after barrier()->wait() every earlier
  // result is final, as on every other backend) and issuing never blocks. Their arguments are
  // checked here, at the call, as Gloo's own would be.
  std::shared_ptr<Work> broadcast(Tensor& tensor, int root) override {
    check_tensor("broadcast", tensor, Device::cpu());
    NANODDP_CHECK(root >= 0 && root < world_size_, ValueError, describe("broadcast", tensor), ": root ", root,
                  " is not a rank of this group");
    count_call(Collective::Broadcast, tensor);
    auto world = world_;
    return queued([world, tensor, root](Clock::time_point deadline) mutable {
      world->broadcast(tensor, root)->wait(left(deadline));
    });
  }
  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override {
    check_tensor("all_gather", input, Device::cpu());
    check_list("all_gather", outputs, input);
    count_call(Collective::AllGather, input);
    auto world = world_;
    return queued([world, outputs, input](Clock::time_point deadline) mutable {
      world->all_gather(outputs, input)->wait(left(deadline));
    });
  }
  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                       ReduceOp op) override {
    const std::string what = std::string("reduce_scatter(") + reduce_op_name(op) + ")";
    check_tensor(what, output, Device::cpu());
    check_reduce(what, output, op);
    check_list(what, inputs, output);
    count_call(Collective::ReduceScatter, output);
    auto world = world_;
    return queued([world, output, inputs, op](Clock::time_point deadline) mutable {
      world->reduce_scatter(output, inputs, op)->wait(left(deadline));
    });
  }
  std::shared_ptr<Work> barrier() override {
    count_call(Collective::Barrier);
    auto world = world_;
    return queued([world](Clock::time_point deadline) { world->barrier()->wait(left(deadline)); });
  }
  std::shared_ptr<Work> send(const Tensor& tensor, int dst, int tag) override {
    return world_->send(tensor, dst, tag);
  }
  std::shared_ptr<Work> recv(Tensor& tensor, int src, int tag) override {
    return world_->recv(tensor, src, tag);
  }

 private:
  std::shared_ptr<Work> queued(std::function<void(Clock::time_point)> run) {
    auto work = std::make_shared<TwoLevelWork>(queue_, std::move(run));
    queue_->push(work);
    return work;
  }

  std::shared_ptr<Store> store_;
  std::shared_ptr<ProcessGroup> local_, leaders_, world_;
  std::shared_ptr<TwoLevelQueue> queue_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_two_level_process_group(std::shared_ptr<Store> store,
                                                           const TwoLevelOptions& options) {
  NANODDP_CHECK(store != nullptr, ValueError, "make_two_level_process_group: no store");
  return std::make_shared<ProcessGroupTwoLevel>(std::move(store), options);
}

}  // namespace nanoddp::dist
