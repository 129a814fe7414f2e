// The NCCL process group: CUDA tensors, one GPU per rank.
//
// Note [NCCL rendezvous]
//   1. Every rank publishes "<host> <PCI bus id>" of its GPU in the store and reads all the
//      others'. Two ranks on one GPU is refused here, with both ranks named: NCCL cannot
//      hold two ranks of a communicator on one device ("duplicate GPU" / ncclInvalidUsage).
//   2. Rank 0 creates the unique id (ncclGetUniqueId) and sets it; the others get it.
//   3. Every rank builds its communicator non-blocking (config.blocking = 0) and polls
//      ncclCommGetAsyncError, so a rank that never arrives ends in TimeoutError and
//      ncclCommAbort instead of a hang.
//
// Note [NCCL streams]
// Collectives run on the group's own stream. Each one first waits (cudaStreamWaitEvent) for
// an event recorded on the compute stream, so it sees every kernel issued before it; its end
// is another event. Work::wait makes the compute stream wait for that event, then polls it
// from the host until the timeout, aborting the communicator on timeout or NCCL error so that
// no kernel spins forever. The Work holds the tensors until then, so the caching allocator
// cannot reuse their memory while NCCL reads it.
#include "core/error.h"
#include "dist/detail.h"
#include "dist/process_group.h"

#if NANODDP_WITH_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "kernels/device_memory.h"

namespace nanoddp::dist {

namespace {

using Clock = std::chrono::steady_clock;

#define NANODDP_NCCL_DIST_CUDA(call, what)                                                  \
  do {                                                                                      \
    cudaError_t status_ = (call);                                                           \
    NANODDP_CHECK(status_ == cudaSuccess, DistError, what, ": ", #call, " failed: ",        \
                  cudaGetErrorName(status_), " (", cudaGetErrorString(status_), ")");       \
  } while (0)

// ncclInProgress is success for a non-blocking communicator: the call is queued.
#define NANODDP_NCCL_DIST_NCCL(call, comm, what)                                            \
  do {                                                                                      \
    ncclResult_t status_ = (call);                                                          \
    NANODDP_CHECK(status_ == ncclSuccess || status_ == ncclInProgress, DistError, what, ": ", \
                  #call, " failed: ", ncclGetErrorString(status_), " (",                   \
                  (comm) ? ncclGetLastError(comm) : "", ")");                              \
  } while (0)

// An NCCL communicator: destroyed normally, or aborted after a timeout or error (RAII).
class NcclComm {
 public:
  explicit NcclComm(ncclComm_t comm) : comm_(comm) {}
  ~NcclComm() {
    if (aborted_.load()) return;
    ncclCommDestroy(comm_);
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  ncclComm_t get() const { return comm_; }
  void abort() {
    if (!aborted_.exchange(true)) ncclCommAbort(comm_);
  }
  bool aborted() const { return aborted_.load(); }
  // ncclSuccess, ncclInProgress, or the error that broke the communicator.
  ncclResult_t async_error() const {
    ncclResult_t result = ncclSuccess;
    if (aborted_.load()) return ncclInvalidUsage;
    ncclCommGetAsyncError(comm_, &result);
    return result;
  }

 private:
  ncclComm_t comm_;
  std::atomic<bool> aborted_{false};
};

class CudaEvent {
 public:
  CudaEvent() { cudaEventCreateWithFlags(&event_, cudaEventDisableTiming); }
  ~CudaEvent() { cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

ncclDataType_t nccl_type(DType dtype) { return dtype == DType::Float32 ? ncclFloat32 : ncclInt64; }

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

cudaStream_t compute_stream() { return static_cast<cudaStream_t>(kernels::cuda::compute_stream()); }

class NcclWork : public Work {
 public:
  NcclWork(std::string description, std::shared_ptr<NcclComm> comm, int device,
           std::vector<Tensor> keep_alive)
      : description_(std::move(description)),
        comm_(std::move(comm)),
        device_(device),
        keep_alive_(std::move(keep_alive)) {}

  cudaEvent_t done_event() const { return done_.get(); }

  void wait(std::chrono::milliseconds timeout) override {
    if (!waited_) {
      kernels::cuda::set_device(device_);
      NANODDP_NCCL_DIST_CUDA(cudaStreamWaitEvent(compute_stream(), done_.get(), 0), description_);
      waited_ = true;
    }
    auto deadline = Clock::now() + timeout;
    while (!is_completed()) {
      ncclResult_t error = comm_->async_error();
      if (error != ncclSuccess && error != ncclInProgress) {
        comm_->abort();
        NANODDP_THROW(DistError, description_, ": NCCL reported ", ncclGetErrorString(error),
                      "; the communicator was aborted");
      }
      if (Clock::now() > deadline) {
        comm_->abort();
        NANODDP_THROW(TimeoutError, description_, ": did not complete within ", timeout.count(),
                      " ms (a peer may have exited or be out of step); the communicator was "
                      "aborted");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    keep_alive_.clear();
  }

  bool is_completed() override {
    cudaError_t status = cudaEventQuery(done_.get());
    if (status == cudaErrorNotReady) return false;
    NANODDP_NCCL_DIST_CUDA(status, description_);
    return true;
  }

 private:
  std::string description_;
  std::shared_ptr<NcclComm> comm_;
  int device_;
  std::vector<Tensor> keep_alive_;
  CudaEvent done_;
  bool waited_ = false;
};

std::atomic<int> next_group_id{0};

class ProcessGroupNccl : public ProcessGroup {
 public:
  ProcessGroupNccl(std::shared_ptr<Store> store, const NcclOptions& options)
      : ProcessGroup(options.rank, options.world_size),
        store_(std::move(store)),
        device_(options.device),
        timeout_(options.timeout) {
    NANODDP_CHECK(device_.is_cuda(), ValueError, where(), ": NCCL needs a CUDA device, got ",
                  device_);
    int count = kernels::cuda::device_count();
    NANODDP_CHECK(count > 0, DeviceError, where(), ": NCCL needs a GPU: ",
                  kernels::cuda::unavailable_reason());
    NANODDP_CHECK(device_.index < count, DeviceError, where(), ": ", device_,
                  " does not exist; this host has ", count, " GPU(s) (LOCAL_RANK too high?)");
    kernels::cuda::set_device(device_.index);
    const std::string prefix = "nccl/" + std::to_string(next_group_id++) + "/";

    // Note [NCCL rendezvous], step 1: one GPU per rank.
    char bus_id[64] = {};
    NANODDP_NCCL_DIST_CUDA(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device_.index), where());
    const std::string mine = detail::host_name() + " " + bus_id;
    store_->set(prefix + "gpu/" + std::to_string(rank_), mine);
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_) continue;
      std::string theirs = store_->get_string(prefix + "gpu/" + std::to_string(r));
      NANODDP_CHECK(theirs != mine, DistError, where(), ": ranks ", std::min(r, rank_), " and ",
                    std::max(r, rank_), " both use the GPU at PCI ", bus_id, " on ",
                    detail::host_name(), " (duplicate GPU). NCCL needs one GPU per rank: give "
                    "each rank Device::cuda(get_local_rank()), and start at most as many ranks "
                    "per host as it has GPUs");
    }

    // Step 2: the unique id.
    ncclUniqueId id;
    if (rank_ == 0) {
      NANODDP_NCCL_DIST_NCCL(ncclGetUniqueId(&id), nullptr, where());
      store_->set(prefix + "unique_id",
                  std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                       reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
    } else {
      auto bytes = store_->get(prefix + "unique_id");
      NANODDP_CHECK(bytes.size() == sizeof(id), DistError, where(), ": the NCCL unique id from "
                    "the store has ", bytes.size(), " bytes, expected ", sizeof(id));
      std::memcpy(&id, bytes.data(), sizeof(id));
    }

    // Step 3: a non-blocking init we can time out.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t raw = nullptr;
    NANODDP_NCCL_DIST_NCCL(ncclCommInitRankConfig(&raw, world_size_, id, rank_, &config), raw,
                           where() + ": ncclCommInitRankConfig on " + device_.str());
    comm_ = std::make_shared<NcclComm>(raw);
    auto deadline = Clock::now() + timeout_;
    while (true) {
      ncclResult_t state = comm_->async_error();
      if (state == ncclSuccess) break;
      if (state != ncclInProgress) {
        comm_->abort();
        NANODDP_THROW(DistError, where(), ": NCCL communicator init on ", device_, " failed: ",
                      ncclGetErrorString(state));
      }
      if (Clock::now() > deadline) {
        comm_->abort();
        NANODDP_THROW(TimeoutError, where(), ": NCCL communicator init did not finish within ",
                      timeout_.count(), " ms (did every rank start?)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    NANODDP_NCCL_DIST_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), where());
  }

  ~ProcessGroupNccl() override {
    comm_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::string backend_name() const override { return "nccl"; }
  Store& store() override { return *store_; }

  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op) override {
    count_call(Collective::AllReduce, tensor);
    std::string what = describe(std::string("all_reduce(") + reduce_op_name(op) + ")", tensor);
    check_tensor("all_reduce", tensor, device_);
    check_reduce("all_reduce", tensor, op);
    void* data = tensor.impl()->storage->data();
    return launch(what, {tensor}, [&](cudaStream_t s) {
      NANODDP_NCCL_DIST_NCCL(ncclAllReduce(data, data, tensor.numel(), nccl_type(tensor.dtype()),
                                           nccl_op(op), comm_->get(), s),
                             comm_->get(), what);
    });
  }

  std::shared_ptr<Work> broadcast(Tensor& tensor, int root) override {
    count_call(Collective::Broadcast, tensor);
    std::string what = describe("broadcast from rank " + std::to_string(root), tensor);
    check_tensor("broadcast", tensor, device_);
    NANODDP_CHECK(root >= 0 && root < world_size_, ValueError, what, ": root ", root,
                  " is not a rank of this group");
    void* data = tensor.impl()->storage->data();
    return launch(what, {tensor}, [&](cudaStream_t s) {
      NANODDP_NCCL_DIST_NCCL(ncclBroadcast(data, data, tensor.numel(), nccl_type(tensor.dtype()),
                                           root, comm_->get(), s),
                             comm_->get(), what);
    });
  }

  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override {
    count_call(Collective::AllGather, input);
    std::string what = describe("all_gather", input);
    check_tensor("all_gather", input, device_);
    check_list("all_gather", outputs, input);
    Tensor gathered = Tensor::empty({input.numel() * world_size_}, input.dtype(), device_);
    std::vector<Tensor> keep = outputs;
    keep.push_back(input);
    keep.push_back(gathered);
    return launch(what, keep, [&](cudaStream_t s) {
      auto* dst = static_cast<uint8_t*>(gathered.impl()->storage->data());
      NANODDP_NCCL_DIST_NCCL(ncclAllGather(input.impl()->storage->data(), dst, input.numel(),
                                           nccl_type(input.dtype()), comm_->get(), s),
                             comm_->get(), what);
      for (int r = 0; r < world_size_; ++r)
        NANODDP_NCCL_DIST_CUDA(cudaMemcpyAsync(outputs[r].impl()->storage->data(),
                                               dst + r * input.nbytes(), input.nbytes(),
                                               cudaMemcpyDeviceToDevice, s),
                               what);
    });
  }

  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                       ReduceOp op) override {
    count_call(Collective::ReduceScatter, output);
    std::string what =
        describe(std::string("reduce_scatter(") + reduce_op_name(op) + ")", output);
    check_tensor("reduce_scatter", output, device_);
    check_reduce("reduce_scatter", output, op);
    check_list("reduce_scatter", inputs, output);
    Tensor flat = Tensor::empty({output.numel() * world_size_}, output.dtype(), device_);
    std::vector<Tensor> keep = inputs;
    keep.push_back(output);
    keep.push_back(flat);
    return launch(what, keep, [&](cudaStream_t s) {
      auto* dst = static_cast<uint8_t*>(flat.impl()->storage->data());
      for (int r = 0; r < world_size_; ++r)
        NANODDP_NCCL_DIST_CUDA(cudaMemcpyAsync(dst + r * output.nbytes(),
                                               inputs[r].impl()->storage->data(), output.nbytes(),
                                               cudaMemcpyDeviceToDevice, s),
                               what);
      NANODDP_NCCL_DIST_NCCL(ncclReduceScatter(dst, output.impl()->storage->data(),
                                               output.numel(), nccl_type(output.dtype()),
                                               nccl_op(op), comm_->get(), s),
                             comm_->get(), what);
    });
  }

  std::shared_ptr<Work> barrier() override {
    count_call(Collective::Barrier);
    // NCCL has no barrier: an all-reduce of one element has the same effect.
    Tensor token = Tensor::zeros({1}, DType::Float32, device_);
    return all_reduce(token, ReduceOp::Sum);
  }

 private:
  // Note [NCCL streams]: order after the compute stream, run body on ours, record the end.
  template <typename Body>
  std::shared_ptr<Work> launch(const std::string& what, std::vector<Tensor> keep, Body&& body) {
    NANODDP_CHECK(!comm_->aborted(), DistError, what, ": the communicator was aborted after an "
                  "earlier timeout or error");
    kernels::cuda::set_device(device_.index);
    CudaEvent ready;
    NANODDP_NCCL_DIST_CUDA(cudaEventRecord(ready.get(), compute_stream()), what);
    NANODDP_NCCL_DIST_CUDA(cudaStreamWaitEvent(stream_, ready.get(), 0), what);
    body(stream_);
    auto work = std::make_shared<NcclWork>(what, comm_, device_.index, std::move(keep));
    NANODDP_NCCL_DIST_CUDA(cudaEventRecord(work->done_event(), stream_), what);
    return work;
  }

  std::shared_ptr<Store> store_;
  Device device_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<NcclComm> comm_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_nccl_process_group(std::shared_ptr<Store> store,
                                                      const NcclOptions& options) {
  NANODDP_CHECK(store != nullptr, ValueError, "make_nccl_process_group: no store");
  return std::make_shared<ProcessGroupNccl>(std::move(store), options);
}

}  // namespace nanoddp::dist

#else  // !NANODDP_WITH_NCCL

namespace nanoddp::dist {

std::shared_ptr<ProcessGroup> make_nccl_process_group(std::shared_ptr<Store>,
                                                      const NcclOptions& options) {
  NANODDP_THROW(DistError, detail::where(options.rank, options.world_size),
                ": nanoddp was built without NCCL (configure with -Dcuda=enabled on a machine "
                "with the CUDA toolkit and NCCL)");
}

}  // namespace nanoddp::dist

#endif
