#include "dist/process_group.h"

#include <algorithm>
#include <cctype>
#include <iterator>
#include <sstream>

#include "core/error.h"
#include "dist/detail.h"

namespace nanoddp::dist {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::Auto: return "auto";
    case Backend::Gloo: return "gloo";
    case Backend::Mpi: return "mpi";
    case Backend::Nccl: return "nccl";
    case Backend::Shm: return "shm";
    case Backend::ShmGloo: return "shm+gloo";
  }
  return "?";
}

std::chrono::milliseconds effective_wait_timeout(std::chrono::milliseconds requested,
                                                 std::chrono::milliseconds group_timeout) {
  return requested.count() <= 0 ? group_timeout : std::min(requested, group_timeout);
}

namespace {
// Every backend, in the order flags and messages list them.
constexpr Backend kBackends[] = {Backend::Auto, Backend::Shm, Backend::ShmGloo, Backend::Gloo, Backend::Mpi,
                                 Backend::Nccl};
}  // namespace

std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (Backend backend : kBackends) names.push_back(backend_name(backend));
  return names;
}

std::string backend_unavailable(Backend backend) {
  const bool gloo = NANODDP_WITH_GLOO, mpi = NANODDP_WITH_MPI, nccl = NANODDP_WITH_NCCL;
  if ((backend == Backend::Gloo || backend == Backend::ShmGloo) && !gloo)
    return "nanoddp was built without Gloo (install libgloo-dev and reconfigure with -Dgloo=enabled)";
  if (backend == Backend::Mpi && !mpi)
    return "nanoddp was built without MPI (install libopenmpi-dev and reconfigure with -Dmpi=enabled)";
  if (backend == Backend::Nccl && !nccl)
    return "nanoddp was built without NCCL (configure with -Dcuda=enabled on a machine with the CUDA toolkit "
           "and NCCL)";
  return "";
}

Backend parse_backend(const std::string& text) {
  std::string lower = text;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  std::string expected;
  for (Backend backend : kBackends) {
    if (lower == backend_name(backend)) return backend;
    expected += std::string(expected.empty() ? "" : backend == kBackends[std::size(kBackends) - 1] ? " or " : ", ") +
                backend_name(backend);
  }
  NANODDP_THROW(ValueError, "unknown backend '", text, "' (expected ", expected, ")");
}

std::shared_ptr<Work> ProcessGroup::send(const Tensor& tensor, int dst, int) {
  NANODDP_THROW(DistError, describe("send to rank " + std::to_string(dst), tensor),
                ": this backend has no point-to-point");
}

std::shared_ptr<Work> ProcessGroup::recv(Tensor& tensor, int src, int) {
  NANODDP_THROW(DistError, describe("recv from rank " + std::to_string(src), tensor),
                ": this backend has no point-to-point");
}

const char* collective_name(Collective collective) {
  switch (collective) {
    case Collective::AllReduce: return "all_reduce";
    case Collective::Broadcast: return "broadcast";
    case Collective::AllGather: return "all_gather";
    case Collective::ReduceScatter: return "reduce_scatter";
    case Collective::Barrier: return "barrier";
  }
  return "?";
}

// Note [Collective counters]
// A learner should be able to check claims such as "DDP issues one all-reduce per bucket per
// optimizer step, none inside no_sync" by reading numbers, not code. Each backend reports
// every collective to count_call() once its arguments are checked (a refused call is not
// counted), so the counters are kept in this one place and mean the same whatever the backend. Relaxed
// atomics: the counters order nothing; they are read by tests and --explain after the collectives they count
// have been waited for.
//
// Note [Bytes moved]
// The counters above say what the caller asked for. What crosses between ranks depends on the
// algorithm: a ring all-reduce of S bytes sends 2(N-1)/N S per rank, but with pieces cut
// from whole elements (8 bytes on 3 ranks: 4, 4 and 0 per piece, so a rank sends 8 or 12,
// not 10.7), and shm's direct all-reduce over collective buffers posts nothing at all: each
// rank reads its peers' buffers in place. Where the data goes through our own code (shm),
// the backend counts it as it moves: every byte written into a peer's slot, every byte read
// from a peer's buffer (ProcessGroup::moved_bytes), including the collective check's
// fingerprints and send/recv. Gloo, MPI and NCCL choose and run their algorithms inside the
// library, so for them only the formula is printed, named as such (dist/explain.h).
void ProcessGroup::count_call(Collective collective, const Tensor& payload) {
  const auto i = static_cast<size_t>(collective);
  calls_[i].fetch_add(1, std::memory_order_relaxed);
  if (payload.defined())
    bytes_[i].fetch_add(static_cast<int64_t>(payload.nbytes()), std::memory_order_relaxed);
}

CollectiveCount ProcessGroup::count(Collective collective) const {
  const auto i = static_cast<size_t>(collective);
  return {calls_[i].load(std::memory_order_relaxed), bytes_[i].load(std::memory_order_relaxed)};
}

void ProcessGroup::reset_counts() {
  for (int i = 0; i < kNumCollectives; ++i) {
    calls_[i].store(0, std::memory_order_relaxed);
    bytes_[i].store(0, std::memory_order_relaxed);
  }
}

Tensor ProcessGroup::new_collective_buffer(int64_t numel, DType dtype, Device device) {
  return Tensor::zeros({numel}, dtype, device);
}

Store& ProcessGroup::store() {
  NANODDP_THROW(DistError, where(), ": the ", backend_name(), " process group has no store");
}

std::string ProcessGroup::where() const { return detail::where(rank_, world_size_); }

std::string ProcessGroup::describe(const std::string& collective, const Tensor& tensor) const {
  std::ostringstream out;
  out << where() << ": " << backend_name() << " " << collective;
  if (tensor.defined()) {
    out << " of " << tensor.shape() << " " << dtype_name(tensor.dtype()) << " ("
        << tensor.nbytes() << " bytes) on " << tensor.device();
  }
  return out.str();
}

void ProcessGroup::check_tensor(const std::string& collective, const Tensor& tensor,
                                Device device) const {
  NANODDP_CHECK(tensor.defined(), ValueError, describe(collective, tensor),
                ": the tensor is undefined");
  NANODDP_CHECK(tensor.device() == device, DeviceError, describe(collective, tensor),
                ": this ", backend_name(), " group works on ", device, " tensors");
}

void ProcessGroup::check_point_to_point(const std::string& what, const Tensor& tensor, int peer, int tag,
                                        bool is_send) const {
  check_tensor(is_send ? "send" : "recv", tensor, device());
  NANODDP_CHECK(tag >= 0, ValueError, what, ": tag ", tag, " must be >= 0, as torch.distributed's");
  NANODDP_CHECK(peer >= 0 && peer < size() && peer != rank(), ValueError, what, ": ",
                is_send ? "destination" : "source", " rank ", peer, " must be another rank of this group (0..",
                size() - 1, ", not ", rank(), ")");
}

void ProcessGroup::check_reduce(const std::string& collective, const Tensor& tensor,
                                ReduceOp op) const {
  const DType dtype = tensor.dtype();
  NANODDP_CHECK(dtype == DType::Float32 || dtype == DType::Int64 || is_16bit_float(dtype), ValueError,
                describe(collective, tensor),
                ": only float32, int64, float16 and bfloat16 tensors can be reduced (broadcast, all_gather, "
                "send and recv copy any dtype)");
  NANODDP_CHECK(op != ReduceOp::Avg || tensor.dtype() == DType::Float32, ValueError,
                describe(collective, tensor), ": avg needs float32, not ", dtype_name(tensor.dtype()),
                tensor.dtype() == DType::Int64 ? " (an int64 average would round)" : "",
                "; use sum and divide");
  NANODDP_CHECK(!is_16bit_float(tensor.dtype()) || op == ReduceOp::Sum, ValueError, describe(collective, tensor),
                ": ", dtype_name(tensor.dtype()), " tensors can only be summed (", reduce_op_name(op),
                " asked); they exist for compressed gradients");
}

void ProcessGroup::check_list(const std::string& collective, const std::vector<Tensor>& list,
                              const Tensor& like) const {
  NANODDP_CHECK(static_cast<int>(list.size()) == world_size_, ValueError,
                describe(collective, like), ": needs ", world_size_, " tensors, got ",
                list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    NANODDP_CHECK(list[i].defined() && list[i].shape() == like.shape() &&
                      list[i].dtype() == like.dtype() && list[i].device() == like.device(),
                  ShapeError, describe(collective, like), ": tensor ", i, " of the list is ",
                  list[i].defined() ? list[i].shape().str() + " " + dtype_name(list[i].dtype())
                                    : std::string("undefined"),
                  ", expected ", like.shape(), " ", dtype_name(like.dtype()), " on ",
                  like.device());
  }
}

}  // namespace nanoddp::dist
