// The NCCL process group: CUDA tensors, one GPU per rank.
//
// One file, though long: its helpers (the communicator under one mutex, Note [NCCL threads];
// the lane and launch(), Note [NCCL streams]) serve this group only, and each collective below
// is correct only through their contracts, so a reader checks the one against the other here,
// in one place, as in PyTorch's ProcessGroupNCCL.cpp. What other groups share lives apart
// (dist/nccl_protocol.h: the polling, the Work, the point-to-point queue, tested without a GPU).
//
// Note [NCCL rendezvous]
//   1. Every rank publishes "<host> <PCI bus id>" of its GPU in the store and reads all the
//      others'. Two ranks on one GPU is refused here, with both ranks named: NCCL cannot
//      hold two ranks of a communicator on one device ("duplicate GPU" / ncclInvalidUsage).
//      The error points to Gloo or MPI, which run several ranks on one GPU by staging its
//      tensors through host memory.
//   2. Rank 0 creates the unique id (ncclGetUniqueId) and sets it; the others get it.
//   3. Every rank builds its communicator non-blocking (config.blocking = 0) and polls
//      ncclCommGetAsyncError, so a rank that never arrives ends in TimeoutError and
//      ncclCommAbort instead of a hang. Every later call follows Note [NCCL non-blocking]
//      (dist/nccl_protocol.h): it may answer ncclInProgress, and is polled until enqueued.
//   Steps 2 and 3 run twice when the world has more than one rank: once for the collectives'
//   communicator, once for the send/recv one (Note [NCCL point-to-point]).
//
// Note [NCCL streams]
// Collectives run on the group's collective stream, send/recv on a stream of their own (Note
// [NCCL point-to-point]). Each call first waits (cudaStreamWaitEvent) for an event recorded on
// the compute stream, so it sees every kernel issued before it; its end is another event,
// recorded once every NCCL call of it is enqueued. Work::wait makes the compute stream wait for
// that event and returns; from the launch on, waited on or not, the watchdog follows the event
// until the timeout, aborting the call's communicator on timeout or NCCL error so that no
// kernel spins forever (Note [NCCL stream-ordered wait] in dist/nccl_protocol.h; a barrier
// waits on the host). The watchdog holds the tensors until the event has passed or an abort
// has stopped NCCL's kernels, so the caching allocator cannot reuse their memory while NCCL
// uses it, and dropping a Work never blocks.
//
// Note [NCCL point-to-point]
// ncclSend and ncclRecv hold their stream until the peer posts the matching call, and NCCL runs
// the calls of one communicator in the order issued. Two consequences shape send() and recv().
//
// Their own communicator and stream. Were send/recv on the collectives' communicator, rank 0
// running send(t, 1), all_reduce(x) against rank 1 running all_reduce(x), recv(t, 0).wait()
// would wait in a circle once t outgrows NCCL's buffers: rank 0's send for a recv queued behind
// rank 1's all_reduce, which waits for rank 0's all_reduce, queued behind the send. So send/recv
// get a second communicator of the same ranks, with its own stream, and the two progress
// independently (PyTorch's ProcessGroupNCCL keeps point-to-point apart in the same way, with a
// communicator per pair of ranks). It is built with the group, not at the first send: building
// a communicator is a rendezvous of all its ranks, so a lazy one would make a send wait on the
// host for its peer to call send/recv too. A world of one has no peer and builds none.
//
// Connections. NCCL connects a pair of ranks lazily, at their first send/recv in each
// direction, and that set-up is a host-side exchange with the peer: a non-blocking
// communicator reports the first call in progress until the peer has posted its side. So the
// first send to a rank, issued before a collective or by a dropped Work, would wait on the
// host (up to the timeout, then abort the communicator) for a peer that may itself be waiting
// in that collective. The group therefore connects at construction, when every rank is there
// anyway: one NCCL group of a 1-element send and recv with each peer, waited for. That costs
// NCCL's per-connection buffers for every peer, so beyond 8 ranks only the ring neighbours
// (rank ± 1, what dist::ring_all_reduce uses) are connected, and a first send/recv with any
// other rank is such a rendezvous: make it where the peer is sure to post its side (an
// exchange in one group, or before any collective).
// Module loading and memory. A host call that waits for the whole device, while a send/recv
// kernel spins for a peer that waits for this rank, never returns, and no timeout reaches a
// thread stuck inside CUDA. Two such calls hide in ordinary code. (1) With CUDA's lazy module
// loading (the default since CUDA 12.2), the first launch of a kernel loads it, and loading may
// synchronize the context. So the group loads, when it is built, the kernels its collectives
// launch (the NaN-ordered keys of Max/Min, Note [NCCL NaN]); a kernel of the caller's own first
// launched after an unwaited send can still wait so: run each kernel once before, or set
// CUDA_MODULE_LOADING=EAGER. (2) An allocation the cache cannot serve calls cudaMalloc, and
// after an out-of-memory the cache frees its blocks (cudaFree synchronizes the device). So every
// collective allocates its temporaries before it issues the queued send/recv. Under the
// collective check's worker (Note [Host fingerprints] in dist/process_group_checked.cpp) the
// send/recv go out at the call and the temporaries are allocated at the later launch: there an
// out-of-memory retry while a send spins can still wait so.
// Ordering: a send/recv group follows the compute stream, and its Work's wait() orders the
// compute stream after it; it is not ordered after a collective still in flight, so, as for
// every asynchronous call, wait on a collective before sending its result. A timeout or an
// NCCL error in send/recv aborts the send/recv communicator: every later send/recv throws
// DistError, while collectives go on; when a send/recv that wait() had handed to the compute
// stream was cut short (Note [NCCL stream-ordered wait]), every later host read of device
// memory throws too.
// Two communicators also bring NCCL's documented hazard ("Using multiple NCCL communicators
// concurrently"): a send/recv kernel spinning for its peer beside a collective kernel works
// while both fit on the GPU at once (a few blocks each: they do), but any call that
// synchronizes the whole device meanwhile, such as the cudaFree of the caching allocator's
// empty_cache() or of its retry after an out-of-memory, waits for the spinning kernel, whose
// peer may be waiting for this rank's collective: a deadlock, ended only by the timeout. So do
// not empty the cache while a send/recv is in flight. PyTorch's ProcessGroupNCCL makes the same
// trade-off.
//
// Grouping. Two ranks that each send, then receive (an exchange, every step of a ring in
// dist/ring.cpp) would each wait in their send for a receive queued behind the peer's own
// send. NCCL's answer is a group (ncclGroupStart ... ncclGroupEnd): its calls progress
// together. So send() and recv() queue their call (detail::PointToPointQueue), and the queued
// calls go out as one NCCL group at the first of: a Work of theirs is waited on, tested or
// dropped; this group runs a collective (under the collective check: it is called); the group
// ends. Calls made back to back therefore form one group, which
// torch.distributed.batch_isend_irecv asks its user to build by hand, and no
// call is left unsent: a send whose Work is dropped goes out at once, as
// torch.distributed.isend's does, also when only a store barrier or exit follows. Issuing each
// call at once instead would deadlock the exchange, which the Gloo, MPI and shm groups run as
// written. What remains for the caller: a send/recv Work that is held, neither waited on nor
// dropped, stays queued while this rank blocks outside the group (a store wait, another
// group); wait on it or drop it first. And an exchange stays one group only while both Works
// are held: dropping the send's Work before calling recv issues the send alone.
//
// NCCL has no tags: messages between two ranks match by order, so a tag other than 0 is
// refused rather than ignored; a receive of a different size or dtype than the send is not
// detected by NCCL (Note [Collective check] covers collectives only).
//
// Note [NCCL shutdown]
// When the group goes, send/recv still queued are issued, and the lanes' streams are drained
// (up to the timeout), so a last send reaches its peer. Then each communicator is finalized
// (ncclCommFinalize, polled like any call) and destroyed, or aborted when finalizing fails or
// times out, so exit never hangs on a peer that is gone: the send/recv one first, then the
// collectives', on every rank, whatever Works the user still holds (finalizing completes their
// calls, and a held Work then finds its event passed). Before that, a lane whose stream is
// still busy after the timeout (a kernel waiting for a peer that is gone) is aborted: freeing
// the other communicator could wait for that kernel, and nothing else would stop it. The
// default group is dropped by destroy_process_group() or, failing that, by an exit handler that
// init_process_group registers after CUDA is up: exit handlers run in reverse order, so it runs
// before the CUDA runtime unloads (dist/init.cpp). A CPU group that stages CUDA tensors may come
// before CUDA does: its staging pool registers the handler again when it first takes pinned
// memory (detail::register_exit_handler_after_cuda).
#include "core/error.h"
#include "dist/deadline.h"
#include "dist/detail.h"
#include "dist/nccl_protocol.h"
#include "dist/process_group.h"

#if NANODDP_WITH_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/nan_ordered.h"
#include "kernels/device_memory.h"

namespace nanoddp::dist {

namespace {


// The failure is the DistError's: cleared as the thread's last CUDA error, which the next
// kernel launch's check would otherwise report as its own.
#define NANODDP_NCCL_DIST_CUDA(call, what)                                                  \
  do {                                                                                      \
    cudaError_t status_ = (call);                                                           \
    if (status_ != cudaSuccess) (void)cudaGetLastError();                                   \
    NANODDP_CHECK(status_ == cudaSuccess, DistError, what, ": ", #call, " failed: ",        \
                  cudaGetErrorName(status_), " (", cudaGetErrorString(status_), ")");       \
  } while (0)

using detail::AsyncState;

AsyncState async_state(ncclResult_t result) {
  return result == ncclSuccess ? AsyncState::Done : result == ncclInProgress ? AsyncState::InProgress : AsyncState::Failed;
}

// Note [NCCL threads]
// NCCL's calls are not thread-safe (NCCL user guide, "Thread Safety"): one communicator must not
// be called from two threads at once, nor two communicators of one device, and the calls of an
// ncclGroupStart/End group must all come from one thread. Here several threads do call in: a
// Work's wait() or is_completed() on any thread polls ncclCommGetAsyncError and may abort; a
// dropped send's Work issues its group from whichever thread drops it; the main thread, or the
// collective check's worker (Note [Host fingerprints]), issues collectives (on the other
// communicator of the same device) meanwhile. So every NCCL call of
// every communicator in this process runs under one mutex, held for that single call (or one
// whole group, start to end), never across a sleep between polls; in non-blocking mode
// (Note [NCCL non-blocking]) no call waits on a peer, so the mutex is held briefly. It also
// orders ncclCommAbort against a poll on another thread: the communicator is marked aborted
// (or closed) under the mutex, so no call uses the handle after that, and ncclCommAbort /
// ncclCommDestroy themselves run outside it, because freeing a communicator can wait for the
// device, hence for a kernel of the other communicator that only another thread's abort would
// stop. That steps outside NCCL's documented contract (an abort may then run beside a call on
// the other communicator of the device), as PyTorch does too: its NCCLComm serialises the
// other calls with a mutex of its own, and its watchdog's thread aborts without it.
std::mutex& nccl_call_mutex() {
  static std::mutex* mutex = new std::mutex;  // never destroyed: Works may close after static destructors
  return *mutex;
}

// An NCCL communicator (RAII): finalized and destroyed, or aborted (Note [NCCL shutdown]).
// Every NCCL call on it goes through call(), under nccl_call_mutex() (Note [NCCL threads]).
class NcclComm : public detail::AsyncComm {
 public:
  NcclComm(ncclComm_t comm, std::chrono::milliseconds timeout, int device)
      : comm_(comm), timeout_(timeout), device_(device) {}
  ~NcclComm() override { close(); }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // Runs nccl_call(comm) under the mutex and returns what its result says, with the library's
  // text in *error for a failure. Failed without calling when the communicator was aborted or
  // closed.
  template <typename NcclCall>
  AsyncState call(NcclCall&& nccl_call, std::string* error) {
    std::lock_guard<std::mutex> lock(nccl_call_mutex());
    if (aborted_.load() || closed_) {
      *error = aborted_.load() ? aborted_message()
                               : "the communicator was finalized (its process group was destroyed)";
      return AsyncState::Failed;
    }
    return checked_locked(nccl_call(comm_), error);
  }

  // Finalizes (polled up to the timeout) and destroys the communicator, or aborts it when that
  // fails: ncclCommFinalize completes every call issued on it, so a Work that outlives its group
  // still sees its event pass. Idempotent; never throws.
  void close() {
    {
      std::lock_guard<std::mutex> releasing(release_mutex_);  // an abort under way finishes first
      std::lock_guard<std::mutex> lock(nccl_call_mutex());
      if (aborted_.load() || closed_) return;
    }
    // Given up by a wait that timed out or failed, or by the watchdog, whose abort may not
    // have run yet: no finalize, which would wait for calls that cannot end (abort() waits for
    // that abort).
    if (!abort_reason().empty() || abort_begun()) return abort();
    try {
      detail::issue_and_wait_enqueued(*this, "ncclCommFinalize", timeout_, [&](std::string* error) {
        return call([](ncclComm_t comm) { return ncclCommFinalize(comm); }, error);
      });
    } catch (const std::exception& e) {
      std::fprintf(stderr, "nanoddp: %s; aborting the NCCL communicator instead\n", message_of(e).c_str());
      abort();
      return;
    }
    std::lock_guard<std::mutex> releasing(release_mutex_);
    ncclComm_t comm = nullptr;
    {
      std::lock_guard<std::mutex> lock(nccl_call_mutex());
      if (aborted_.load() || closed_) return;
      closed_ = true;  // from here no call() touches comm_
      comm = comm_;
    }
    // Outside the mutex: freeing the communicator's memory can wait for the device, i.e. for a
    // kernel of the other communicator that only an abort on another thread (which needs the
    // mutex) would stop.
    const ncclResult_t result = ncclCommDestroy(comm);
    if (result != ncclSuccess)
      std::fprintf(stderr, "nanoddp: ncclCommDestroy failed: %s\n", ncclGetErrorString(result));
  }

  void abort() override {
    std::lock_guard<std::mutex> releasing(release_mutex_);
    ncclComm_t comm = nullptr;
    {
      std::lock_guard<std::mutex> lock(nccl_call_mutex());
      if (aborted_.load() || closed_) return;
      aborted_.store(true);               // from here no call() touches comm_
      // Before any kernel stops, and after the flag: a stream-ordered wait() marks its
      // collective, then reads the flag (EventWork::wait), so one of the two sees the other.
      detail::Watchdog::aborting(*this);
      comm = comm_;
    }
    // The watchdog aborts from threads that have no device set; a failure (at exit, say) is
    // not this thread's next launch's error.
    if (cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
    ncclCommAbort(comm);  // outside the mutex, as ncclCommDestroy in close()
  }
  bool aborted() const override { return aborted_.load(); }
  // Done once closed: finalizing completed every call.
  AsyncState state(std::string* error) override {
    std::lock_guard<std::mutex> lock(nccl_call_mutex());
    if (aborted_.load()) {
      *error = "an abort (earlier timeout or error)";
      return AsyncState::Failed;
    }
    if (closed_) return AsyncState::Done;
    ncclResult_t async = ncclSuccess;
    const ncclResult_t result = ncclCommGetAsyncError(comm_, &async);
    if (result != ncclSuccess) return checked_locked(result, error);
    return checked_locked(async, error);
  }

 private:
  // What a call's result says, with the library's text for an error. Under the mutex.
  AsyncState checked_locked(ncclResult_t result, std::string* error) const {
    const AsyncState state = async_state(result);
    if (state == AsyncState::Failed)
      *error = std::string(ncclGetErrorString(result)) + " (" + ncclGetLastError(comm_) + ")";
    return state;
  }

  ncclComm_t comm_;
  std::chrono::milliseconds timeout_;
  int device_;
  std::atomic<bool> aborted_{false};  // written under the mutex; read without it by aborted()
  bool closed_ = false;               // under the mutex
  // Held while ncclCommAbort or ncclCommDestroy runs, and taken before nccl_call_mutex(): a
  // close() or abort() that finds another thread releasing the communicator returns only once
  // it is gone, so that "closed" means the device resources are free.
  std::mutex release_mutex_;
};

// An event of the current device. The last owner of a Work may drop it on any thread, one that
// never chose a device among them: the event's device is made current first, and left so
// (Note [Current device] in kernels/cuda/device_memory.cpp), so that the runtime does not
// open a context on GPU 0 for it.
class CudaEvent {
 public:
  CudaEvent() {
    NANODDP_NCCL_DIST_CUDA(cudaGetDevice(&device_), "nccl group");
    NANODDP_NCCL_DIST_CUDA(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "nccl group");
  }
  ~CudaEvent() {  // never throws; nothing to do about a failure here but clear it
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess) (void)cudaGetLastError();
    if (current != device_ && cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
    if (cudaEventDestroy(event_) != cudaSuccess) (void)cudaGetLastError();
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  int device_ = 0;
  cudaEvent_t event_ = nullptr;
};

// A communicator and the stream its calls run on (Note [NCCL streams]). The group has two:
// one for collectives, one for send/recv (Note [NCCL point-to-point]).
struct NcclLane {
  NcclLane(Device device, std::chrono::milliseconds timeout, std::shared_ptr<NcclComm> comm, const std::string& what)
      : device(device), timeout(timeout), comm(std::move(comm)) {
    NANODDP_NCCL_DIST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), what);
  }
  // The communicator is finalized (or aborted) before its stream goes, also while Works issued
  // on it still hold it: so every rank finalizes its communicators in the group's order, not
  // in the order its user happens to drop Works (Note [NCCL shutdown]). A stream destroyed with
  // work still on it is released by CUDA once that work is done.
  ~NcclLane() {
    // A failure here is nobody's to report: cleared, so that the next launch check does not
    // report it as its kernel's (also when a failed constructor unwinds).
    if (cudaSetDevice(device.index) != cudaSuccess) (void)cudaGetLastError();
    comm->close();
    try {
      detail::Watchdog::instance().forget(*comm);  // finalized or aborted: every call has ended
    } catch (...) {
      // Destructors never throw; the watchdog lets go of them once their events pass.
    }
    comm.reset();
    if (stream != nullptr && cudaStreamDestroy(stream) != cudaSuccess) (void)cudaGetLastError();
  }
  NcclLane(const NcclLane&) = delete;
  NcclLane& operator=(const NcclLane&) = delete;

  Device device;
  std::chrono::milliseconds timeout;
  std::shared_ptr<NcclComm> comm;  // shared with every Work issued on it, which may abort it
  cudaStream_t stream = nullptr;
};

// One NCCL call, call(ncclComm_t) -> ncclResult_t: issued (under the mutex of Note [NCCL
// threads]), then polled until it is enqueued (Note [NCCL non-blocking]), so whatever the
// caller queues next on the stream really follows it.
template <typename Call>
void enqueue(const NcclLane& lane, const std::string& what, Call&& call) {
  detail::issue_and_wait_enqueued(*lane.comm, what, lane.timeout,
                                  [&](std::string* error) { return lane.comm->call(call, error); });
}

cudaStream_t compute_stream() { return static_cast<cudaStream_t>(kernels::cuda::compute_stream()); }

// A call failed after queuing work on the lane's stream: waits (polling, up to the lane's
// timeout) until that work has run, with keep's tensors held. An NCCL error or timeout has
// aborted the communicator, which stops its kernels; after any other failure (no memory for
// the Work, a failed cudaEventRecord) the queued work ends on its own. Should the stream still
// not drain, the tensors are kept for the life of the process rather than handed back to the
// caching allocator while the device may still write them. Never throws.
// Polls the lane's stream until the work on it has run or the deadline passes: cudaSuccess,
// cudaErrorNotReady (still running) or the error the stream reports.
cudaError_t drain(const NcclLane& lane, std::chrono::steady_clock::time_point deadline) {
  cudaError_t status = cudaErrorNotReady;
  while ((status = cudaStreamQuery(lane.stream)) == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  // Not an error (NotReady), or one the caller reports from the status: cleared either way
  // (kernels::cuda::event_passed).
  if (status != cudaSuccess) (void)cudaGetLastError();
  return status;
}

void finish_after_error(const NcclLane& lane, const std::string& what, std::vector<Tensor> keep) {
  const cudaError_t status = drain(lane, detail::deadline_after(lane.timeout));
  if (status == cudaSuccess) return;
  const std::string stream_state = status == cudaErrorNotReady
                                       ? "had not drained after " + std::to_string(lane.timeout.count()) + " ms"
                                       : std::string("reported ") + cudaGetErrorName(status);
  std::fprintf(stderr, "nanoddp: %s failed, and its stream %s; its tensors are kept until exit\n", what.c_str(),
               stream_state.c_str());
  static auto* kept = new std::vector<Tensor>();  // leaked on purpose: see above
  static auto* kept_mutex = new std::mutex();
  std::lock_guard<std::mutex> lock(*kept_mutex);
  kept->insert(kept->end(), keep.begin(), keep.end());
}

// Note [NCCL streams]: order after the compute stream, run body on the lane's stream, record
// the end. The watchdog (or a wait on the host) aborts the lane's communicator when the call
// times out or NCCL reports an error.
template <typename Body>
std::shared_ptr<detail::EventWork> launch(const NcclLane& lane, const std::string& what, std::vector<Tensor> keep,
                                          Body&& body) {
  NANODDP_CHECK(!lane.comm->aborted(), DistError, what, ": ", lane.comm->aborted_message());
  kernels::cuda::set_device(lane.device.index);
  CudaEvent ready;
  NANODDP_NCCL_DIST_CUDA(cudaEventRecord(ready.get(), compute_stream()), what);
  NANODDP_NCCL_DIST_CUDA(cudaStreamWaitEvent(lane.stream, ready.get(), 0), what);
  try {
    body(lane.stream);  // every NCCL call in it is enqueued when it returns
  } catch (...) {
    // No Work will order the compute stream after the lane's stream or hold keep: what body
    // queued before it failed (a kernel that restores a buffer, the wait on `ready`) must be
    // finished before the error reaches a caller who may read or free the tensors.
    finish_after_error(lane, what, std::move(keep));
    throw;
  }
  // Past here the collective is on the stream: a failure must not hand keep back either.
  try {
    auto done = std::make_shared<CudaEvent>();
    NANODDP_NCCL_DIST_CUDA(cudaEventRecord(done->get(), lane.stream), what);
    detail::EventWork::Event event;
    const int device = lane.device.index;
    // Set the device first: a poll from a fresh thread would otherwise make device 0's context
    // current, creating one on GPU 0 in a process that uses another GPU.
    event.query = [done, device](std::string* error) {
      kernels::cuda::set_device(device);
      const cudaError_t status = cudaEventQuery(done->get());
      // At exit, once the runtime unloads, there is nothing left to wait for.
      if (status == cudaSuccess || status == cudaErrorCudartUnloading) return AsyncState::Done;
      if (status == cudaErrorNotReady) {
        (void)cudaGetLastError();  // recorded as the thread's last error: cleared (kernels::cuda::event_passed)
        return AsyncState::InProgress;
      }
      (void)cudaGetLastError();  // the Work's error now, not the thread's next launch's
      *error = std::string("cudaEventQuery: ") + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")";
      return AsyncState::Failed;
    };
    event.order_compute_stream = [done, device, what] {
      kernels::cuda::set_device(device);
      NANODDP_NCCL_DIST_CUDA(cudaStreamWaitEvent(compute_stream(), done->get(), 0), what);
    };
    return std::make_shared<detail::EventWork>(what, lane.comm, std::move(event), keep, lane.timeout);
  } catch (...) {
    finish_after_error(lane, what, std::move(keep));
    throw;
  }
}

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::Float32: return ncclFloat32;
    case DType::Float16: return ncclFloat16;
    case DType::BFloat16: return ncclBfloat16;
    case DType::Int64: return ncclInt64;
    case DType::UInt8: return ncclUint8;  // copies only: check_reduce refuses it for a reduction
    case DType::Int32: return ncclInt32;
  }
  NANODDP_THROW(ValueError, "nccl: no NCCL datatype for dtype ", static_cast<int>(dtype));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

// Note [NCCL NaN]
// ncclMax/ncclMin on floats drop a NaN (as a hardware max does); torch.maximum/minimum, and
// every other backend here, propagate it whichever rank holds it. So a float32 Max or Min
// reduces ordered integer keys instead (kernels/cuda/nan_ordered.h): the buffer is turned
// into keys on the group's stream, reduced as ncclUint32, and turned back. Two elementwise
// passes, on Max/Min only; int64 and Sum/Avg go straight to NCCL.
struct NanSafeReduction {
  bool keyed = false;
  kernels::cuda::NanAt nan_at = kernels::cuda::NanAt::Top;
  ncclDataType_t type = ncclFloat32;
  ncclRedOp_t op = ncclSum;
};
NanSafeReduction nan_safe(DType dtype, ReduceOp op) {
  NanSafeReduction r;
  r.keyed = dtype == DType::Float32 && (op == ReduceOp::Max || op == ReduceOp::Min);
  r.nan_at = op == ReduceOp::Min ? kernels::cuda::NanAt::Bottom : kernels::cuda::NanAt::Top;
  r.type = r.keyed ? ncclUint32 : nccl_type(dtype);
  r.op = nccl_op(op);
  return r;
}

// Note [NCCL point-to-point]: the queued calls as one NCCL group on the point-to-point lane.
std::shared_ptr<detail::EventWork> issue_point_to_point_group(const NcclLane& lane, const std::string& where,
                                                 const std::vector<detail::PointToPointQueue::Call>& calls) {
  std::vector<Tensor> keep;
  // The types first: nothing may throw between ncclGroupStart and ncclGroupEnd, which would
  // leave this thread's group open for every later call.
  std::vector<ncclDataType_t> types;
  for (const auto& call : calls) {
    keep.push_back(call.tensor);
    types.push_back(nccl_type(call.tensor.dtype()));
  }
  const std::string what = where + ": nccl group of " + std::to_string(calls.size()) + " send/recv";
  return launch(lane, what, keep, [&](cudaStream_t s) {
    enqueue(lane, what, [&](ncclComm_t comm) {
      ncclResult_t result = ncclGroupStart();
      if (result != ncclSuccess) return result;
      for (size_t i = 0; i < calls.size(); ++i) {
        const auto& call = calls[i];
        void* data = call.tensor.impl()->storage->data();
        const size_t count = static_cast<size_t>(call.tensor.numel());
        result = call.is_send ? ncclSend(data, count, types[i], call.peer, comm, s)
                              : ncclRecv(data, count, types[i], call.peer, comm, s);
        if (result != ncclSuccess && result != ncclInProgress) {
          ncclGroupEnd();
          return result;
        }
      }
      return ncclGroupEnd();
    });
  });
}

// Note [NCCL point-to-point], connections: every pair up to this world size, beyond it the ring
// neighbours only (NCCL's buffers for a connection cost device memory per peer).
constexpr int kConnectEveryPeerUpToWorldSize = 8;

// Whether rank and peer connect when the group is built: symmetric, so both sides agree.
bool connect_at_start(int rank, int peer, int world_size) {
  if (world_size <= kConnectEveryPeerUpToWorldSize) return true;
  return peer == (rank + 1) % world_size || rank == (peer + 1) % world_size;
}

std::atomic<int> next_nccl_group_id{0};

class ProcessGroupNccl : public ProcessGroup {
 public:
  ProcessGroupNccl(std::shared_ptr<Store> store, const NcclOptions& options)
      : ProcessGroup(options.rank, options.world_size),
        store_(std::move(store)),
        device_(options.device),
        timeout_(detail::cap_timeout(options.timeout)) {  // Note [Long timeouts]
    NANODDP_CHECK(device_.is_cuda(), ValueError, where(), ": NCCL needs a CUDA device, got ",
                  device_);
    int count = kernels::cuda::device_count();
    NANODDP_CHECK(count > 0, DeviceError, where(), ": NCCL needs a GPU: ",
                  kernels::cuda::unavailable_reason());
    NANODDP_CHECK(device_.index < count, DeviceError, where(), ": ", device_,
                  " does not exist; this host has ", count, " GPU(s) (LOCAL_RANK too high?)");
    kernels::cuda::set_device(device_.index);
    kernels::cuda::preload_ordered_key_kernels();  // Note [NCCL point-to-point], module loading
    prefix_ = "nccl/" + std::to_string(next_nccl_group_id++) + "/";

    // Note [NCCL rendezvous], step 1: one GPU per rank.
    char bus_id[64] = {};
    NANODDP_NCCL_DIST_CUDA(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device_.index), where());
    const std::string mine = detail::host_name() + " " + bus_id;
    store_->set(prefix_ + "gpu/" + std::to_string(rank_), mine);
    int same_gpu = -1;  // a rank that names this rank's GPU too
    for (int r = 0; r < world_size_ && same_gpu < 0; ++r)
      if (r != rank_ && store_->get_string(prefix_ + "gpu/" + std::to_string(r)) == mine) same_gpu = r;
    // Rank 0 serves the store: it gives up only once every rank has read the others' GPUs,
    // so that they all report the duplicate rather than a store that went away.
    store_->set(prefix_ + "gpu_read/" + std::to_string(rank_), std::string("1"));
    if (same_gpu >= 0 && rank_ == 0) {
      std::vector<std::string> keys;
      for (int r = 0; r < world_size_; ++r) keys.push_back(prefix_ + "gpu_read/" + std::to_string(r));
      try {
        store_->wait(keys, timeout_);
      } catch (const DistError&) {
        // A rank that never reads: report the duplicate all the same.
      }
    }
    NANODDP_CHECK(same_gpu < 0, DistError, where(), ": ranks ", std::min(same_gpu, rank_), " and ",
                  std::max(same_gpu, rank_), " both use the GPU at PCI ", bus_id, " on ", detail::host_name(),
                  " (duplicate GPU). NCCL needs one GPU per rank: give each rank "
                  "Device::cuda(get_local_rank()), and start at most as many ranks per host as it has GPUs; "
                  "to run several ranks on one GPU, use --backend gloo (or mpi), which stage CUDA tensors "
                  "through host memory");

    // Steps 2 and 3, for the collectives' communicator and, with a peer to talk to, the
    // point-to-point one (Note [NCCL point-to-point]).
    collectives_ = std::make_shared<NcclLane>(device_, timeout_, init_communicator("unique_id", "collectives"),
                                              where());
    if (world_size_ > 1) {
      point_to_point_ = std::make_shared<NcclLane>(
          device_, timeout_, init_communicator("point_to_point/unique_id", "send/recv"), where());
      connect_point_to_point();
      // The queue (which a send/recv Work shares) does not keep the lane: the group's end
      // finalizes it (Note [NCCL shutdown]), and close() has issued every call made before.
      point_to_point_queue_ = std::make_shared<detail::PointToPointQueue>(
          [weak_lane = std::weak_ptr<NcclLane>(point_to_point_),
           where = where()](const std::vector<detail::PointToPointQueue::Call>& calls) {
            const std::shared_ptr<NcclLane> lane = weak_lane.lock();
            NANODDP_CHECK(lane != nullptr, DistError, where, ": send/recv after the process group was destroyed");
            return issue_point_to_point_group(*lane, where, calls);
          },
          timeout_);
    }
  }

  // Note [NCCL shutdown]; destructors never throw.
  ~ProcessGroupNccl() override {
    // A failure here (CUDA already unloading at exit) is not the next launch's error.
    if (cudaSetDevice(device_.index) != cudaSuccess) (void)cudaGetLastError();
    if (point_to_point_queue_) point_to_point_queue_->close();  // nothing queued is left behind
    point_to_point_queue_.reset();
    // A kernel still running on one lane (its peer gone) can keep the other lane's finalize or
    // destroy waiting on the device for ever, and only an abort stops it. Both lanes drain
    // together (one deadline); those still busy after it are aborted at once, each on a thread
    // of its own, since freeing one communicator can wait for the other's kernel.
    const auto deadline = detail::deadline_after(timeout_);
    std::vector<NcclLane*> busy;
    for (NcclLane* lane : {collectives_.get(), point_to_point_.get()})
      if (lane != nullptr && drain(*lane, deadline) == cudaErrorNotReady) busy.push_back(lane);
    std::vector<std::thread> aborts;
    for (NcclLane* lane : busy) {
      std::fprintf(stderr, "nanoddp: %s: NCCL work was still running %lld ms after the group was destroyed; "
                   "aborting its communicator\n", where().c_str(), static_cast<long long>(timeout_.count()));
      try {
        aborts.emplace_back([lane] {
          if (cudaSetDevice(lane->device.index) != cudaSuccess) (void)cudaGetLastError();
          lane->comm->abort();
        });
      } catch (const std::exception&) {  // no thread to be had: abort here (never throws)
        lane->comm->abort();
      }
    }
    for (std::thread& abort : aborts) abort.join();
    point_to_point_.reset();
    collectives_.reset();
    // A stream error is the communicator's to report, and a failed stream destroy in the
    // lanes' ends is nobody's: cleared, so the next kernel launch does not report it.
    (void)cudaGetLastError();
  }

  Device device() const override { return device_; }
  std::string backend_name() const override { return "nccl"; }
  Store& store() override { return *store_; }

  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op) override {
    std::string what = describe(std::string("all_reduce(") + reduce_op_name(op) + ")", tensor);
    check_tensor("all_reduce", tensor, device_);
    check_reduce("all_reduce", tensor, op);
    count_call(Collective::AllReduce, tensor);
    return issue_all_reduce(tensor, op, what);
  }

  std::shared_ptr<Work> broadcast(Tensor& tensor, int root) override {
    std::string what = describe("broadcast from rank " + std::to_string(root), tensor);
    check_tensor("broadcast", tensor, device_);
    NANODDP_CHECK(root >= 0 && root < world_size_, ValueError, what, ": root ", root,
                  " is not a rank of this group");
    count_call(Collective::Broadcast, tensor);
    issue_queued_before_collective();
    void* data = tensor.impl()->storage->data();
    return launch(*collectives_, what, {tensor}, [&](cudaStream_t s) {
      enqueue(*collectives_, what, [&](ncclComm_t comm) {
        return ncclBroadcast(data, data, tensor.numel(), nccl_type(tensor.dtype()), root, comm, s);
      });
    });
  }

  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override {
    std::string what = describe("all_gather", input);
    check_tensor("all_gather", input, device_);
    check_list("all_gather", outputs, input);
    count_call(Collective::AllGather, input);
    // Allocated before the queued send/recv go out (Note [NCCL point-to-point], module loading
    // and memory).
    Tensor gathered = Tensor::empty({input.numel() * world_size_}, input.dtype(), device_);
    issue_queued_before_collective();
    std::vector<Tensor> keep = outputs;
    keep.push_back(input);
    keep.push_back(gathered);
    return launch(*collectives_, what, keep, [&](cudaStream_t s) {
      auto* dst = static_cast<uint8_t*>(gathered.impl()->storage->data());
      enqueue(*collectives_, what, [&](ncclComm_t comm) {
        return ncclAllGather(input.impl()->storage->data(), dst, input.numel(), nccl_type(input.dtype()),
                             comm, s);
      });
      for (int r = 0; r < world_size_; ++r)
        NANODDP_NCCL_DIST_CUDA(cudaMemcpyAsync(outputs[r].impl()->storage->data(),
                                               dst + r * input.nbytes(), input.nbytes(),
                                               cudaMemcpyDeviceToDevice, s),
                               what);
    });
  }

  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                       ReduceOp op) override {
    std::string what =
        describe(std::string("reduce_scatter(") + reduce_op_name(op) + ")", output);
    check_tensor("reduce_scatter", output, device_);
    check_reduce("reduce_scatter", output, op);
    check_list("reduce_scatter", inputs, output);
    count_call(Collective::ReduceScatter, output);
    Tensor flat = Tensor::empty({output.numel() * world_size_}, output.dtype(), device_);  // as all_gather's
    issue_queued_before_collective();
    std::vector<Tensor> keep = inputs;
    keep.push_back(output);
    keep.push_back(flat);
    return launch(*collectives_, what, keep, [&](cudaStream_t s) {
      auto* dst = static_cast<uint8_t*>(flat.impl()->storage->data());
      for (int r = 0; r < world_size_; ++r)
        NANODDP_NCCL_DIST_CUDA(cudaMemcpyAsync(dst + r * output.nbytes(),
                                               inputs[r].impl()->storage->data(), output.nbytes(),
                                               cudaMemcpyDeviceToDevice, s),
                               what);
      const NanSafeReduction reduction = nan_safe(output.dtype(), op);  // Note [NCCL NaN]
      void* out = output.impl()->storage->data();
      if (reduction.keyed) kernels::cuda::floats_to_ordered_keys(dst, flat.numel(), reduction.nan_at, s);
      enqueue(*collectives_, what, [&](ncclComm_t comm) {
        return ncclReduceScatter(dst, out, output.numel(), reduction.type, reduction.op, comm, s);
      });
      if (reduction.keyed) kernels::cuda::ordered_keys_to_floats(out, output.numel(), reduction.nan_at, s);
    });
  }

  std::shared_ptr<Work> barrier() override {
    count_call(Collective::Barrier);
    // NCCL has no barrier: an all-reduce of one element has the same effect, waited for on the
    // host, as torch's barrier is (Note [NCCL stream-ordered wait]).
    Tensor token = Tensor::zeros({1}, DType::Float32, device_);
    std::shared_ptr<detail::EventWork> work = issue_all_reduce(token, ReduceOp::Sum, where() + ": nccl barrier");
    work->set_waits(detail::EventWork::Waits::Host);
    return work;
  }

  // Before a collective: send/recv called before it go out no later than it does, so that a
  // send followed by a collective (and no wait) is not held back until the next wait. A
  // failure belongs to those calls (their Works report it), not to the collective.
  void issue_queued_point_to_point() override {
    if (!point_to_point_queue_) return;
    try {
      point_to_point_queue_->issue();
    } catch (const std::exception&) {
    }
  }

  // Note [NCCL point-to-point]: queued here, issued as one NCCL group later.
  std::shared_ptr<Work> send(const Tensor& tensor, int dst, int tag) override {
    return queue_point_to_point(tensor, dst, tag, /*is_send=*/true);
  }
  std::shared_ptr<Work> recv(Tensor& tensor, int src, int tag) override {
    return queue_point_to_point(tensor, src, tag, /*is_send=*/false);
  }

 private:
  // all_reduce once its arguments are checked and counted (barrier's is not an all_reduce's).
  std::shared_ptr<detail::EventWork> issue_all_reduce(Tensor& tensor, ReduceOp op, const std::string& what) {
    issue_queued_before_collective();
    void* data = tensor.impl()->storage->data();
    const NanSafeReduction reduction = nan_safe(tensor.dtype(), op);  // Note [NCCL NaN]
    return launch(*collectives_, what, {tensor}, [&](cudaStream_t s) {
      if (reduction.keyed) kernels::cuda::floats_to_ordered_keys(data, tensor.numel(), reduction.nan_at, s);
      try {
        enqueue(*collectives_, what, [&](ncclComm_t comm) {
          return ncclAllReduce(data, data, tensor.numel(), reduction.type, reduction.op, comm, s);
        });
      } catch (...) {
        // NCCL refused the call (Note [NCCL non-blocking] step 1: its communicator may be
        // aborted now): the caller's tensor must hold its floats again, not the keys, when the
        // error reaches it (launch waits for this kernel).
        if (reduction.keyed) kernels::cuda::ordered_keys_to_floats(data, tensor.numel(), reduction.nan_at, s);
        throw;
      }
      if (reduction.keyed) kernels::cuda::ordered_keys_to_floats(data, tensor.numel(), reduction.nan_at, s);
    });
  }

  // Note [NCCL rendezvous] steps 2-3 for one communicator of the group; id_key names its
  // unique id in the store.
  std::shared_ptr<NcclComm> init_communicator(const std::string& id_key, const std::string& purpose) {
    const std::string what = where() + ": NCCL communicator for " + purpose + " on " + device_.str();
    // NCCL lets the environment or its configuration files override config.blocking (step 3);
    // blocking calls would wait for peers with no timeout. Checked before the first NCCL call,
    // which copies the files' settings into the environment.
    const auto blocking = detail::nccl_setting("NCCL_COMM_BLOCKING");
    // NCCL reads the value as an integer (strtoll) and ignores an empty one.
    NANODDP_CHECK(!blocking || blocking->value.empty() || std::strtoll(blocking->value.c_str(), nullptr, 0) == 0,
                  DistError, what, ": NCCL_COMM_BLOCKING=", blocking->value,
                  " (from ", blocking->source,
                  ") would make NCCL calls wait for the peers without a timeout; remove it (this group polls "
                  "non-blocking communicators and times them out)");
    // Step 2: the unique id.
    ncclUniqueId id;
    if (rank_ == 0) {
      const ncclResult_t got = ncclGetUniqueId(&id);
      NANODDP_CHECK(got == ncclSuccess, DistError, what, ": ncclGetUniqueId failed: ", ncclGetErrorString(got), " (",
                    ncclGetLastError(nullptr), ")");
      store_->set(prefix_ + id_key, std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                                         reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
    } else {
      auto bytes = store_->get(prefix_ + id_key);
      NANODDP_CHECK(bytes.size() == sizeof(id), DistError, what, ": the NCCL unique id from the store has ",
                    bytes.size(), " bytes, expected ", sizeof(id));
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    // Step 3: a non-blocking init we can time out (Note [NCCL non-blocking]).
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t raw = nullptr;
    ncclResult_t started = ncclSuccess;
    std::string init_error;
    {
      std::lock_guard<std::mutex> lock(nccl_call_mutex());  // Note [NCCL threads]
      started = ncclCommInitRankConfig(&raw, world_size_, id, rank_, &config);
      if (async_state(started) == AsyncState::Failed || raw == nullptr)
        init_error = std::string(ncclGetErrorString(started)) + " (" + ncclGetLastError(raw) + ")";
    }
    if (!init_error.empty()) {
      if (raw != nullptr) ncclCommAbort(raw);  // outside the mutex, as NcclComm::abort
      NANODDP_THROW(DistError, what, ": ncclCommInitRankConfig failed: ", init_error);
    }
    auto comm = std::make_shared<NcclComm>(raw, timeout_, device_.index);
    detail::issue_and_wait_enqueued(*comm, what + " (did every rank start?)", timeout_,
                                    [&](std::string* error) { return comm->call([&](ncclComm_t) { return started; }, error); });
    return comm;
  }

  // Note [NCCL point-to-point], connections: one group of a 1-element send and recv with each
  // peer that connect_at_start names, waited for here.
  void connect_point_to_point() {
    std::vector<detail::PointToPointQueue::Call> calls;
    const Tensor one = Tensor::zeros({1}, DType::Float32, device_);
    for (int peer = 0; peer < world_size_; ++peer) {
      if (peer == rank_ || !connect_at_start(rank_, peer, world_size_)) continue;
      calls.push_back({one, peer, /*is_send=*/true});
      calls.push_back({Tensor::zeros({1}, DType::Float32, device_), peer, /*is_send=*/false});
    }
    auto connected = issue_point_to_point_group(
        *point_to_point_, where() + " (connecting send/recv with the peers at the start)", calls);
    connected->set_waits(detail::EventWork::Waits::Host);  // the group is ready when built
    connected->wait(timeout_);
  }

  std::shared_ptr<Work> queue_point_to_point(const Tensor& tensor, int peer, int tag, bool is_send) {
    const std::string what = describe((is_send ? "send to rank " : "recv from rank ") + std::to_string(peer), tensor);
    check_point_to_point(what, tensor, peer, tag, is_send);
    NANODDP_CHECK(tag == 0, ValueError, what, ": NCCL has no message tags (messages between two ranks match by "
                  "order), so tag must be 0, got ", tag);
    return detail::PointToPointQueue::add(point_to_point_queue_, {tensor, peer, is_send});
  }

  // Every collective's first step: the send/recv called before it, unless its caller issued
  // them already and this is the collective check's worker starting it later (Note [Host
  // fingerprints]): what is queued now was called after it.
  void issue_queued_before_collective() {
    if (!detail::CollectiveCalledEarlier::active()) issue_queued_point_to_point();
  }

  std::shared_ptr<Store> store_;
  Device device_;
  std::chrono::milliseconds timeout_;
  std::string prefix_;  // this group's keys in the store
  std::shared_ptr<NcclLane> collectives_;
  // Note [NCCL point-to-point]: its own communicator and stream, and the queue of calls not yet
  // issued. Empty at world size 1 (no peer).
  std::shared_ptr<NcclLane> point_to_point_;
  std::shared_ptr<detail::PointToPointQueue> point_to_point_queue_;
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
  NANODDP_THROW(DistError, detail::where(options.rank, options.world_size), ": ",
                backend_unavailable(Backend::Nccl));
}

}  // namespace nanoddp::dist

#endif
