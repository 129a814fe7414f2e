// The shared-memory process group: CPU tensors between ranks on one machine, through one
// segment of shared memory that every rank maps. The all-reduce is the textbook ring, written
// out so that it can be read; it is also the fast path on one machine (no sockets, no
// threads: Note [Shm progress]). This file holds the group: it checks each call, gives it its
// Envelope and issues it as a work. The rest, one concern per file:
//
//   ring_shm.cpp          the algorithms: the ring, the direct all-reduce (Note [Shm direct all-reduce])
//   shm_segment.h, .cpp   the segment's layout and lifecycle (Note [Shm segment])
//   shm_slots.cpp         posting and reading the slots of a channel
//   shm_wait.h, .cpp      spinning, futex doorbells, abort and liveness (Note [Shm waiting])
//   shm_progress.h, .cpp  works, run in issue order by the thread that waits (Note [Shm progress])
#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>

#include "core/error.h"
#include "core/op_helpers.h"
#include "dist/deadline.h"
#include "dist/process_group.h"
#include "dist/ring_shm.h"
#include "dist/shm_progress.h"
#include "dist/shm_segment.h"

namespace nanoddp::dist {

namespace {

using namespace shm;

// ---- the group ---------------------------------------------------------------------------

std::atomic<int> next_shm_group_id{0};

class ProcessGroupShm : public ProcessGroup {
 public:
  ProcessGroupShm(std::shared_ptr<Store> store, const ShmOptions& options)
      : ProcessGroup(options.rank, options.world_size),
        store_(std::move(store)),
        timeout_(detail::cap_timeout(options.timeout)),  // Note [Long timeouts]
        sent_messages_(static_cast<size_t>(options.world_size), 0),
        received_messages_(static_cast<size_t>(options.world_size), 0) {
    // Groups are built in the same order on every rank, so the counter names the same group.
    prefix_ = !options.store_prefix.empty() ? options.store_prefix
                                            : "shm/" + std::to_string(next_shm_group_id++) + "/";
    if (world_size_ > 1)
      engine_ = std::make_shared<ShmEngine>(
          std::make_unique<ShmSegment>(*store_, prefix_, rank_, world_size_, timeout_), timeout_);
  }

  // Works issued but not yet run fail (ShmEngine::drop_pending); a Work still held keeps the
  // engine until it goes.
  ~ProcessGroupShm() override {
    if (engine_ != nullptr) engine_->drop_pending();
  }

  std::string backend_name() const override { return "shm"; }
  bool collectives_run_in_wait() const override { return true; }
  MovedBytes moved_bytes() const override {
    MovedBytes moved;
    moved.measured = true;
    moved.bytes = engine_ != nullptr ? engine_->segment().moved_bytes.load(std::memory_order_relaxed) : 0;
    moved.all_reduces_by_algorithm = {{"ring", ring_all_reduces_.load(std::memory_order_relaxed)},
                                      {"direct", direct_all_reduces_.load(std::memory_order_relaxed)}};
    return moved;
  }
  Store& store() override { return *store_; }
  std::string all_reduce_algorithm_for(const Tensor& tensor) const override {
    return shared_buffer_of(tensor) != nullptr ? "direct" : "ring";
  }

  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op) override {
    std::string name = std::string("all_reduce(") + reduce_op_name(op) + ")";
    check_tensor(name, tensor, Device::cpu());
    check_reduce(name, tensor, op);
    count_call(Collective::AllReduce, tensor);
    if (world_size_ == 1 || tensor.numel() == 0) return std::make_shared<CompletedWork>();
    Envelope envelope = next_envelope(Kind::AllReduce, tensor, op, 0);
    if (auto buffer = shared_buffer_of(tensor)) {
      direct_all_reduces_.fetch_add(1, std::memory_order_relaxed);
      envelope.buffer = buffer->id;
      return collective(describe(name, tensor), envelope.seq, [tensor, buffer, op, envelope](Ring& ring) {
        direct_all_reduce(ring.shm, envelope, *buffer, tensor.dtype(), op, ring.deadline, ring.what);
      });
    }
    ring_all_reduces_.fetch_add(1, std::memory_order_relaxed);
    return collective(describe(name, tensor), envelope.seq, [tensor, op, envelope](Ring& ring) mutable {
      ring.envelope = envelope;
      ring.all_reduce(tensor, op);
    });
  }

  // Note [Shm direct all-reduce]: every rank maps every rank's buffer (map_shared_buffer).
  Tensor new_collective_buffer(int64_t numel, DType dtype, Device device) override {
    if (world_size_ == 1 || device != Device::cpu() || numel <= 0)
      return ProcessGroup::new_collective_buffer(numel, dtype, device);
    const int64_t id = next_buffer_id_++;
    const size_t nbytes = static_cast<size_t>(numel) * dtype_size(dtype);
    const std::string what = where() + ": shm collective buffer #" + std::to_string(id) + " of " +
                             std::to_string(numel) + " " + dtype_name(dtype);
    const std::string key = prefix_ + "buffer/" + std::to_string(id) + "/";
    auto buffer = map_shared_buffer(*store_, key, id, nbytes, rank_, world_size_, timeout_, what);

    {
      std::lock_guard<std::mutex> lock(buffers_mutex_);
      for (auto it = buffers_.begin(); it != buffers_.end();) it = it->second.expired() ? buffers_.erase(it) : ++it;
      buffers_[buffer->region[rank_]] = buffer;
    }
    auto impl = std::make_shared<TensorImpl>();
    impl->storage = std::make_shared<Storage>(buffer->region[rank_], nbytes, Device::cpu(),
                                              [buffer](void*) mutable { buffer.reset(); });
    impl->shape = Shape{numel};
    impl->dtype = dtype;
    return Tensor(std::move(impl));
  }

  std::shared_ptr<Work> broadcast(Tensor& tensor, int root) override {
    check_tensor("broadcast", tensor, Device::cpu());
    NANODDP_CHECK(root >= 0 && root < world_size_, ValueError, describe("broadcast", tensor), ": root ", root,
                  " is not a rank of this group");
    count_call(Collective::Broadcast, tensor);
    if (world_size_ == 1 || tensor.numel() == 0) return std::make_shared<CompletedWork>();
    Envelope envelope = next_envelope(Kind::Broadcast, tensor, ReduceOp::Sum, root);
    return collective(describe("broadcast from rank " + std::to_string(root), tensor), envelope.seq,
                      [tensor, root, envelope](Ring& ring) {
                        ring.envelope = envelope;
                        ring.broadcast(bytes_of(tensor), tensor.numel(), dtype_size(tensor.dtype()), root);
                      });
  }

  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override {
    check_tensor("all_gather", input, Device::cpu());
    check_list("all_gather", outputs, input);
    count_call(Collective::AllGather, input);
    std::vector<Tensor> outs = outputs;
    if (world_size_ == 1 || input.numel() == 0) {
      copy_values(outs[rank_], input);
      return std::make_shared<CompletedWork>();
    }
    Envelope envelope = next_envelope(Kind::AllGather, input, ReduceOp::Sum, 0);
    return collective(describe("all_gather", input), envelope.seq, [outs, input, envelope](Ring& ring) {
      ring.envelope = envelope;
      Parts parts = Parts::of_tensors(outs);
      std::memcpy(parts.data[ring.rank()], bytes_of(input), input.nbytes());
      ring.all_gather(parts);
    });
  }

  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                       ReduceOp op) override {
    std::string name = std::string("reduce_scatter(") + reduce_op_name(op) + ")";
    check_tensor(name, output, Device::cpu());
    check_reduce(name, output, op);
    check_list(name, inputs, output);
    count_call(Collective::ReduceScatter, output);
    if (world_size_ == 1 || output.numel() == 0) {
      copy_values(output, inputs[0]);
      return std::make_shared<CompletedWork>();
    }
    Envelope envelope = next_envelope(Kind::ReduceScatter, output, op, 0);
    std::vector<Tensor> ins = inputs;
    return collective(describe(name, output), envelope.seq, [ins, output, op, envelope](Ring& ring) {
      ring.envelope = envelope;
      ring.reduce_scatter(Parts::of_tensors(ins), bytes_of(output), reduce_fn(output.dtype(), op));
      if (op == ReduceOp::Avg) detail::divide_by_world_size(output, ring.n());
    });
  }

  std::shared_ptr<Work> barrier() override {
    count_call(Collective::Barrier);
    if (world_size_ == 1) return std::make_shared<CompletedWork>();
    // A one-element all-reduce: along the ring every rank hears, transitively, from all.
    Tensor token = Tensor::zeros({1}, DType::Int64);
    Envelope envelope = next_envelope(Kind::Barrier, token, ReduceOp::Sum, 0);
    return collective(where() + ": shm barrier", envelope.seq, [token, envelope](Ring& ring) {
      ring.envelope = envelope;
      Parts parts = Parts::of_buffer(bytes_of(token), 1, sizeof(int64_t), ring.n());
      ring.reduce_scatter(parts, reduce_fn(DType::Int64, ReduceOp::Sum));
      ring.all_gather(parts);
    });
  }

  std::shared_ptr<Work> send(const Tensor& tensor, int dst, int tag) override {
    check_point_to_point(describe("send to rank " + std::to_string(dst), tensor), tensor, dst, tag, true);
    Envelope envelope{sent_messages_[dst]++, Kind::Send, static_cast<int32_t>(tensor.dtype()), 0, tag,
                      tensor.numel()};
    auto pieces = std::make_shared<int64_t>(0);
    ShmSegment& shm = engine_->segment();
    return engine_->issue(engine_, describe("send to rank " + std::to_string(dst), tensor), dst,
                          [&shm, tensor, dst, envelope, pieces](Clock::time_point) {
                            return piecewise(tensor, *pieces, [&](uint8_t* data, size_t nbytes) {
                              return shm.try_post(dst, envelope, data, nbytes);
                            });
                          });
  }

  std::shared_ptr<Work> recv(Tensor& tensor, int src, int tag) override {
    check_point_to_point(describe("recv from rank " + std::to_string(src), tensor), tensor, src, tag, false);
    Envelope envelope{
        received_messages_[src]++, Kind::Send, static_cast<int32_t>(tensor.dtype()), 0, tag, tensor.numel()};
    auto pieces = std::make_shared<int64_t>(0);
    ShmSegment& shm = engine_->segment();
    std::string what = describe("recv from rank " + std::to_string(src), tensor);
    return engine_->issue(engine_, what, src, [&shm, tensor, src, envelope, pieces, what](Clock::time_point) {
      return piecewise(tensor, *pieces, [&](uint8_t* data, size_t nbytes) {
        const SlotHeader* slot = shm.try_peek(src);
        if (slot == nullptr) return false;
        shm.check_envelope(src, *slot, envelope, nbytes, what);
        if (nbytes > 0) std::memcpy(data, ShmSegment::payload(slot), nbytes);
        shm.release(src);
        return true;
      });
    });
  }

 private:
  // Moves the pieces of tensor from *done on while move(piece, nbytes) succeeds; true when all
  // have moved. An empty tensor still moves one empty piece (its envelope is checked).
  template <typename Move>
  static bool piecewise(const Tensor& tensor, int64_t& done, Move&& move) {
    const int64_t total =
        std::max<int64_t>(1, (static_cast<int64_t>(tensor.nbytes()) + kSlotBytes - 1) / kSlotBytes);
    while (done < total) {
      const size_t first = static_cast<size_t>(done) * kSlotBytes;
      const size_t nbytes = std::min(kSlotBytes, tensor.nbytes() - first);
      if (!move(bytes_of(tensor) + first, nbytes)) return false;
      ++done;
    }
    return true;
  }

  // The collective buffer that tensor is, whole; null for any other tensor.
  std::shared_ptr<SharedBuffer> shared_buffer_of(const Tensor& tensor) const {
    std::lock_guard<std::mutex> lock(buffers_mutex_);
    auto it = buffers_.find(bytes_of(tensor));
    if (it == buffers_.end()) return nullptr;
    auto buffer = it->second.lock();
    return buffer != nullptr && buffer->nbytes == tensor.nbytes() ? buffer : nullptr;
  }

  Envelope next_envelope(Kind kind, const Tensor& tensor, ReduceOp op, int root) {
    return Envelope{collective_seq_++,        kind, static_cast<int32_t>(tensor.dtype()),
                    static_cast<int32_t>(op), root, tensor.numel(), -1};
  }

  // seq: the collective's Envelope::seq.
  std::shared_ptr<Work> collective(std::string description, uint64_t seq, std::function<void(Ring&)> body) {
    ShmSegment& shm = engine_->segment();
    auto what = std::make_shared<std::string>(description);
    return engine_->issue(engine_, std::move(description), ShmWork::kCollective,
                          [&shm, seq, body = std::move(body), what](Clock::time_point deadline) {
                            struct Running {
                              ShmSegment& shm;
                              ~Running() { shm.end_collective(); }
                            } running{shm};
                            shm.begin_collective(seq);
                            Ring ring{shm, Envelope{}, deadline, *what};
                            body(ring);
                            return true;
                          });
  }

  std::shared_ptr<Store> store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<ShmEngine> engine_;
  std::atomic<int64_t> ring_all_reduces_{0}, direct_all_reduces_{0};
  uint64_t collective_seq_ = 0;
  int64_t next_buffer_id_ = 0;
  mutable std::mutex buffers_mutex_;
  std::map<const uint8_t*, std::weak_ptr<SharedBuffer>> buffers_;  // by region[rank]
  std::vector<uint64_t> sent_messages_;
  std::vector<uint64_t> received_messages_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_shm_process_group(std::shared_ptr<Store> store,
                                                     const ShmOptions& options) {
  NANODDP_CHECK(store != nullptr || options.world_size == 1, ValueError, "make_shm_process_group: no store");
  return std::make_shared<ProcessGroupShm>(std::move(store), options);
}

}  // namespace nanoddp::dist
