// Internal helpers shared by dist/*.cpp (not a public header): an owned socket, the host
// name, the "rank r/world on host" text every dist error carries, and a tensor's bytes.
//
//   detail::Fd fd(::socket(AF_INET, SOCK_STREAM, 0));   // closed when fd goes out of scope
//   NANODDP_THROW(DistError, detail::where(rank, world_size), ": all_reduce ...");
#pragma once

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/storage.h"
#include "core/tensor.h"

namespace nanoddp::nn {
class Module;
}
namespace nanoddp::dist {
class ProcessGroup;
}

namespace nanoddp::dist::detail {

// The first byte of t's elements (any dtype, any device's pointer), for copies by byte offset.
inline uint8_t* bytes_of(const Tensor& t) { return static_cast<uint8_t*>(t.impl()->storage->data()); }

// Note [Max and Min]
// The element-wise Max and Min of every CPU backend's all_reduce (shm, Gloo, MPI, the ring).
// A NaN wins whichever rank holds it (torch.maximum), and -0 counts as less than +0 (IEEE
// 754-2019's maximum and minimum, as NCCL's ordered keys in process_group_nccl.cpp): the
// result is the same bits whichever rank's value comes first, so every backend and every
// chunk order of a ring agree.
template <bool IsMax, typename T>
inline T max_or_min(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (a != a || b != b) return a != a ? a : b;
    if (a == b) return std::signbit(a) == IsMax ? b : a;  // Max keeps +0, Min -0
  }
  return (IsMax ? a < b : b < a) ? b : a;
}
template <typename T>
inline T max_of(T a, T b) {
  return max_or_min<true>(a, b);
}
template <typename T>
inline T min_of(T a, T b) {
  return max_or_min<false>(a, b);
}

// ReduceOp::Avg's last step, on every CPU path: a float32 sum divided by world_size in place.
// Division, not multiplication by 1/world_size, so an exactly representable mean is exact.
void divide_by_world_size(float* data, int64_t n, int world_size);
inline void divide_by_world_size(const Tensor& t, int world_size) {
  divide_by_world_size(t.data<float>(), t.numel(), world_size);
}

// The first byte of `parts` when they lie end to end, in order, in one allocation, as the
// per-rank slices of one flat vector do (FSDP's gathered parameters and gradients); null
// otherwise, and null when `other` (the collective's other side) lies in that allocation too
// (in place, which MPI and Gloo would need told). A backend then hands that one buffer to
// all_gather / reduce_scatter instead of copying the parts through a buffer of its own.
uint8_t* back_to_back(const std::vector<Tensor>& parts, const Tensor& other);

// An owned file descriptor (RAII): closed exactly once.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// gethostname(), or "unknown-host".
std::string host_name();

// pid's state letter in /proc/<pid>/stat (R, S, D, T stopped, t traced, Z, X, ...), or '\0'
// when it cannot be read (the process is gone, or in another pid namespace).
char process_state(int pid);

// pid's children, every thread's (/proc/<pid>/task/<tid>/children), zombies included; none
// when /proc cannot be read.
std::vector<int> child_pids(int pid);

// "rank 1/4 on node7" (or "rank ?/? on node7" when unknown): the prefix of every dist error.
std::string where(int rank, int world_size);

// A yes/no environment variable: unset or "" -> fallback; 1/true/yes/on or 0/false/no/off
// (any case). Anything else is a ValueError naming the variable: a misspelt value silently
// keeping the default (NANODDP_STORE_LISTEN_ALL=ture: the other nodes then wait out the
// timeout) is worse than stopping.
bool env_flag(const char* name, bool fallback);

// strerror(errno) as a string, for messages.
std::string errno_text(int err);

// The local IPv4/IPv6 address this host uses to reach host:port (a UDP connect, which sends
// nothing), so Gloo listens on the interface that reaches MASTER_ADDR. Throws DistError when
// host does not resolve.
std::string local_address_towards(const std::string& host, int port);

// Note [NCCL shutdown] for the groups that stage CUDA tensors (dist/host_staging.h): a Gloo,
// MPI or shm group may be made before CUDA is, and then the exit handler that init_process_group
// registers runs after the CUDA runtime's teardown. So the staging pool calls this when it first
// takes pinned memory (CUDA is up then): it registers, once, one more handler that drops the
// default group, which then runs before that teardown. Defined in dist/init.cpp.
void register_exit_handler_after_cuda();
bool exit_handler_after_cuda_registered();

// Checks, before a wrapper's first collective, that every rank of pg holds the same model: the
// same number of parameters and buffers, each with the same name and shape, in the same order;
// parameters alike in requires_grad, buffers in dtype. A collective (two all_gathers). Throws
// DistError naming the first parameter or buffer that differs and the rank it differs from,
// beginning "<wrapper> on rank r/W" (wrapper: "DDP", "FSDP"); defined in dist/model_check.cpp.
// PyTorch's DDP checks parameters' shapes only (_verify_param_shape_across_processes); FSDP
// checks nothing and its broadcasts misalign.
void verify_same_model(ProcessGroup& pg, const nn::Module& module, const std::string& wrapper,
                       std::chrono::milliseconds timeout);

// Note [Interrupted backward] in dist/reducer.cpp: after a backward that ended by an exception
// on this rank, having issued `issued` of its collectives (buckets, reductions), checks with
// one all_reduce that every rank's ended the same way. Throws DistError beginning "<wrapper>
// on rank r/W" when the counts differ, or when the all_reduce fails (a rank still inside that
// backward's collective: the collective check's mismatch; without the check that pairing is
// undefined, as any mismatched collective is). Does nothing at world size 1.
// Defined in dist/detail.cpp.
void agree_after_interrupted_backward(ProcessGroup& pg, int64_t issued, const std::string& wrapper,
                                      std::chrono::milliseconds timeout);

// "DDP on rank 1/4": the start of the errors a wrapper of pg raises.
std::string wrapper_on_rank(const std::string& wrapper, const ProcessGroup& pg);

}  // namespace nanoddp::dist::detail
