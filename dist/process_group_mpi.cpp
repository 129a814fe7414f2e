// The MPI process group: CPU tensors over Open MPI (shared memory on a host, TCP or
// InfiniBand across hosts), for jobs started by mpirun or srun.
//
// Note [MPI progress]
// Collectives are nonblocking MPI_I* calls; wait() polls MPI_Test until the request is done
// or the timeout passes, which is what gives MPI collectives a timeout at all (a blocking
// MPI_Allreduce waits forever for a dead peer). Open MPI has no progress thread, so the
// collective moves only while some rank sits in an MPI call: on a CPU there is no overlap
// with backward either way, and a Work polled right after issue costs about what the
// blocking call costs (benchmarks/allreduce_bench.cpp --compare-blocking-mpi). A timed
// out request cannot be cancelled: the group is unusable and the job should exit, after
// which mpirun stops the other ranks.
#include "core/error.h"
#include "dist/detail.h"
#include "dist/process_group.h"

#if NANODDP_WITH_MPI

// The C interface only: Open MPI's deprecated C++ bindings warn and add nothing.
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

namespace nanoddp::dist {

namespace {

// Initialises MPI on first use and finalises it when the process exits normally (Open MPI
// reports a rank that exits without MPI_Finalize as failed).
class MpiRuntime {
 public:
  static void ensure_initialized() { static MpiRuntime runtime; }

 private:
  MpiRuntime() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) return;  // the application did it; it finalises too
    // Open MPI's nonblocking all-reduce (libnbc) picks, by default, algorithms that measured
    // about 2x slower than its blocking MPI_Allreduce on one host (1 MiB, 2 ranks: 397 us vs
    // 239 us); its ring algorithm matched the blocking call at every size from 4 KiB to
    // 16 MiB. Ask for it unless the user chose otherwise (overwrite = 0).
    ::setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", 0);
    int provided = 0;
    // Serialized: the collectives' caller and a DDP hook may be different threads, never at
    // once (every call below holds mpi_mutex()).
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    NANODDP_CHECK(rc == MPI_SUCCESS, DistError, detail::where(-1, -1), ": MPI_Init_thread failed");
    owned_ = true;
  }
  ~MpiRuntime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Finalize();
  }
  bool owned_ = false;
};

std::mutex& mpi_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return std::string(text, static_cast<size_t>(len));
}

MPI_Datatype mpi_type(DType dtype) { return dtype == DType::Float32 ? MPI_FLOAT : MPI_INT64_T; }

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return MPI_SUM;  // Avg divides after the sum
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
  }
  return MPI_SUM;
}

class MpiWork : public Work {
 public:
  // finish runs once, on the waiting thread, after the request completed (copies, Avg).
  MpiWork(std::string description, MPI_Request request, std::function<void()> finish)
      : description_(std::move(description)), request_(request), finish_(std::move(finish)) {}

  ~MpiWork() override {
    // A request never waited for stays with MPI; freeing it lets MPI finish it alone. Our
    // tensors die with the closure only after completion is known, so skip it otherwise.
    if (!done_ && request_ != MPI_REQUEST_NULL) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) {
        std::lock_guard<std::mutex> lock(mpi_mutex());
        int flag = 0;
        MPI_Test(&request_, &flag, MPI_STATUS_IGNORE);
        if (!flag) new std::function<void()>(std::move(finish_));  // keep the buffers alive
      }
    }
  }

  void wait(std::chrono::milliseconds timeout) override {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!test()) {
      NANODDP_CHECK(std::chrono::steady_clock::now() < deadline, TimeoutError, description_,
                    ": did not complete within ", timeout.count(),
                    " ms (a peer may have exited or be out of step)");
      std::this_thread::yield();  // 2 cores: let the peer rank's process run
    }
    if (!error_.empty()) NANODDP_THROW(DistError, description_, ": ", error_);
  }

  bool is_completed() override { return test(); }

 private:
  bool test() {
    if (done_) return true;
    int flag = 0;
    int rc;
    {
      std::lock_guard<std::mutex> lock(mpi_mutex());
      rc = MPI_Test(&request_, &flag, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS) {
      error_ = "MPI_Test failed: " + mpi_error_text(rc);
      done_ = true;
      return true;
    }
    if (!flag) return false;
    done_ = true;
    if (finish_) finish_();
    finish_ = nullptr;
    return true;
  }

  std::string description_;
  MPI_Request request_;
  std::function<void()> finish_;
  bool done_ = false;
  std::string error_;
};

class ProcessGroupMpi : public ProcessGroup {
 public:
  ProcessGroupMpi(MPI_Comm comm, int rank, int world_size, std::chrono::milliseconds timeout)
      : ProcessGroup(rank, world_size), comm_(comm), timeout_(timeout) {}

  ~ProcessGroupMpi() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      std::lock_guard<std::mutex> lock(mpi_mutex());
      MPI_Comm_free(&comm_);
    }
  }

  std::string backend_name() const override { return "mpi"; }

  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op) override {
    std::string what = describe(std::string("all_reduce(") + reduce_op_name(op) + ")", tensor);
    check_tensor("all_reduce", tensor, Device::cpu());
    check_reduce("all_reduce", tensor, op);
    int count = checked_count(what, tensor.numel());
    void* data = tensor.impl()->storage->data();
    MPI_Request request;
    call(what, "MPI_Iallreduce", [&] {
      return MPI_Iallreduce(MPI_IN_PLACE, data, count, mpi_type(tensor.dtype()), mpi_op(op), comm_,
                            &request);
    });
    int world_size = world_size_;
    return std::make_shared<MpiWork>(what, request, [tensor, op, world_size] {
      if (op != ReduceOp::Avg) return;
      float* p = tensor.data<float>();
      const float w = static_cast<float>(world_size);
      for (int64_t i = 0; i < tensor.numel(); ++i) p[i] /= w;  // division: exact when representable
    });
  }

  std::shared_ptr<Work> broadcast(Tensor& tensor, int root) override {
    std::string what = describe("broadcast from rank " + std::to_string(root), tensor);
    check_tensor("broadcast", tensor, Device::cpu());
    NANODDP_CHECK(root >= 0 && root < world_size_, ValueError, what, ": root ", root,
                  " is not a rank of this group");
    int count = checked_count(what, tensor.numel());
    void* data = tensor.impl()->storage->data();
    MPI_Request request;
    call(what, "MPI_Ibcast", [&] {
      return MPI_Ibcast(data, count, mpi_type(tensor.dtype()), root, comm_, &request);
    });
    return std::make_shared<MpiWork>(what, request, [tensor] {});
  }

  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override {
    std::string what = describe("all_gather", input);
    check_tensor("all_gather", input, Device::cpu());
    check_list("all_gather", outputs, input);
    int count = checked_count(what, input.numel() * world_size_);
    Tensor gathered = Tensor::empty({input.numel() * world_size_}, input.dtype());
    MPI_Request request;
    call(what, "MPI_Iallgather", [&] {
      return MPI_Iallgather(input.impl()->storage->data(), count / world_size_,
                            mpi_type(input.dtype()), gathered.impl()->storage->data(),
                            count / world_size_, mpi_type(input.dtype()), comm_, &request);
    });
    std::vector<Tensor> outs = outputs;
    return std::make_shared<MpiWork>(what, request, [outs, input, gathered] {
      const size_t nbytes = input.nbytes();
      const auto* src = static_cast<const uint8_t*>(gathered.impl()->storage->data());
      for (size_t r = 0; r < outs.size(); ++r)
        std::memcpy(outs[r].impl()->storage->data(), src + r * nbytes, nbytes);
    });
  }

  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                       ReduceOp op) override {
    std::string what =
        describe(std::string("reduce_scatter(") + reduce_op_name(op) + ")", output);
    check_tensor("reduce_scatter", output, Device::cpu());
    check_reduce("reduce_scatter", output, op);
    check_list("reduce_scatter", inputs, output);
    int count = checked_count(what, output.numel() * world_size_) / world_size_;
    const size_t nbytes = output.nbytes();
    Tensor flat = Tensor::empty({output.numel() * world_size_}, output.dtype());
    auto* dst = static_cast<uint8_t*>(flat.impl()->storage->data());
    for (int r = 0; r < world_size_; ++r)
      std::memcpy(dst + r * nbytes, inputs[r].impl()->storage->data(), nbytes);
    MPI_Request request;
    call(what, "MPI_Ireduce_scatter_block", [&] {
      return MPI_Ireduce_scatter_block(flat.impl()->storage->data(),
                                       output.impl()->storage->data(), count,
                                       mpi_type(output.dtype()), mpi_op(op), comm_, &request);
    });
    int world_size = world_size_;
    return std::make_shared<MpiWork>(what, request, [flat, output, op, world_size] {
      if (op != ReduceOp::Avg) return;
      float* p = output.data<float>();
      for (int64_t i = 0; i < output.numel(); ++i) p[i] /= static_cast<float>(world_size);
    });
  }

  std::shared_ptr<Work> barrier() override {
    std::string what = where() + ": mpi barrier";
    MPI_Request request;
    call(what, "MPI_Ibarrier", [&] { return MPI_Ibarrier(comm_, &request); });
    return std::make_shared<MpiWork>(what, request, nullptr);
  }

 private:
  static int checked_count(const std::string& what, int64_t numel) {
    NANODDP_CHECK(numel <= INT_MAX, ValueError, what, ": MPI counts are int; ", numel,
                  " elements is more than ", INT_MAX);
    return static_cast<int>(numel);
  }

  template <typename Call>
  void call(const std::string& what, const char* name, Call&& fn) {
    int rc;
    {
      std::lock_guard<std::mutex> lock(mpi_mutex());
      rc = fn();
    }
    NANODDP_CHECK(rc == MPI_SUCCESS, DistError, what, ": ", name, " failed: ", mpi_error_text(rc));
  }

  MPI_Comm comm_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_mpi_process_group(std::chrono::milliseconds timeout) {
  MpiRuntime::ensure_initialized();
  std::lock_guard<std::mutex> lock(mpi_mutex());
  MPI_Comm comm;
  // A private communicator: our collectives never match an application's own MPI calls.
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  NANODDP_CHECK(rc == MPI_SUCCESS, DistError, detail::where(-1, -1), ": MPI_Comm_dup failed: ",
                mpi_error_text(rc));
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);  // errors come back as codes we throw
  int rank = 0, world_size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &world_size);
  return std::make_shared<ProcessGroupMpi>(comm, rank, world_size, timeout);
}

bool launched_by_mpi() {
  // A torchrun-style launcher inside an MPI allocation sets RANK: it is the innermost one.
  if (std::getenv("RANK") != nullptr) return false;
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr ||
         std::getenv("PMI_RANK") != nullptr;
}

}  // namespace nanoddp::dist

#else  // !NANODDP_WITH_MPI

namespace nanoddp::dist {

std::shared_ptr<ProcessGroup> make_mpi_process_group(std::chrono::milliseconds) {
  NANODDP_THROW(DistError, detail::where(-1, -1),
                ": nanoddp was built without MPI (install libopenmpi-dev and reconfigure with "
                "-Dmpi=enabled)");
}

bool launched_by_mpi() { return false; }

}  // namespace nanoddp::dist

#endif
