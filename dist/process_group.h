// ProcessGroup: the collectives every rank of a job calls together, one backend per file.
//
//   auto pg = dist::init_process_group();                  // dist/init.h: shm, Gloo, MPI or NCCL
//   pg->all_reduce(grad, dist::ReduceOp::Avg)->wait();      // grad: any shape, in place
//   pg->barrier()->wait(std::chrono::seconds(30));
//
// Contract (PyTorch c10d's):
//  - Every rank calls the same collectives in the same order, with tensors of the same
//    element count and dtype and the same op and root (all_gather/reduce_scatter: world_size
//    of them). Groups from init_process_group check this before each collective (Note
//    [Collective check] in process_group_checked.cpp): when ranks disagree, every rank gets
//    a DistError naming the collective, its sequence number in the group and what each rank
//    called ("rank 0: all_reduce(sum) #470, 235146 float32; rank 1: all_reduce(sum) #470, 2
//    float32") from that work's wait(), nothing is sent, and the group stays usable. PyTorch checks this only
//    with TORCH_DISTRIBUTED_DEBUG=DETAIL. Without the check a mismatch hangs, aborts the process or corrupts
//    data, depending on the backend.
//  - A collective returns a Work at once; its tensors must stay untouched until wait()
//    returns. Work keeps them alive. Works of one group complete in the order issued:
//    waiting on a work (barrier included) first completes every earlier work of the group,
//    so after barrier()->wait() every earlier result is final (an Avg divided), whether or
//    not anyone waited on it.
//  - wait(timeout) throws TimeoutError when the work has not finished within the earlier of
//    timeout and the group's timeout (InitOptions::timeout; wait(0ms) waits for that one alone,
//    as torch's), and DistError when it failed (NCCL: wait() returns once every rank has called
//    the collective, and its watchdog keeps the timeout, Work::wait); with the collective
//    check, up to one second more (at most the timeout again) goes to asking the store which
//    rank never came.
//    After either error the group is unusable (a peer is gone or out of step) and the job should
//    exit, as after a c10d timeout. An MPI rank with a request still unfinished at exit
//    skips MPI_Finalize (it would wait for the dead peer forever).
//  - Max and Min propagate NaN whichever rank holds it, as torch.maximum/torch.minimum and
//    NCCL do (torch's Gloo backend does not: its max(1, NaN) depends on which rank holds it),
//    and take -0 < +0 (IEEE 754's maximum): every backend gives the same bits whichever rank
//    holds which zero (Note [Max and Min] in detail.h).
//  - Every message names the rank, world size, host, backend, the collective and its sizes.
//  - Tensors: dense, contiguous. Copies (broadcast, all_gather, send, recv) take any dtype,
//    byte for byte, as torch.distributed's do. Reductions take float32 or int64 (uint8 and
//    int32 are refused: sums would wrap or differ by backend), and
//    float16 and bfloat16, reduced with Sum only: each backend adds two values at a time in
//    float32 and rounds each partial sum back to 16 bits (to nearest, ties to even), as Gloo's
//    and NCCL's half sums do, so over 3 or more ranks the last bit depends on the backend's
//    order of adds (float32 sums' too); DDP's compression hooks use them (dist/comm_hooks.h);
//    CUDA tensors of the group's device on NCCL; CPU tensors on shm, Gloo and MPI, and CUDA
//    ones too when the group comes from init_process_group (staged through pinned host
//    memory, dist/host_staging.h). device() says which device a group's own tensors should be on.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "dist/store.h"

namespace nanoddp::dist {

// Element-wise reductions (torch.distributed.ReduceOp). Avg is Sum divided by world_size,
// float32 only: an int64 average would have to round, so it throws ValueError. Max and Min
// return NaN for an element that is NaN on any rank (torch.maximum/torch.minimum).
enum class ReduceOp { Sum, Avg, Max, Min };
const char* reduce_op_name(ReduceOp op);  // "sum", "avg", "max", "min"

// Which library runs the collectives. Auto: NCCL for a CUDA device; MPI when the process was
// started by mpirun or srun (OMPI_COMM_WORLD_SIZE, PMIX_RANK or PMI_RANK is set, RANK is not)
// and MPI is built in; shm when every rank is on this machine (LOCAL_WORLD_SIZE == WORLD_SIZE,
// as nanoddp-run and torchrun set them on one node, or a plain single process with no rank or
// world size given anywhere); ShmGloo ("shm+gloo") when
// LOCAL_WORLD_SIZE < WORLD_SIZE and GROUP_RANK (the node's index, set by nanoddp-run) is
// known (see make_two_level_process_group); Gloo otherwise. init_process_group resolves Auto
// from NANODDP_BACKEND first.
enum class Backend { Auto, Gloo, Mpi, Nccl, Shm, ShmGloo };
const char* backend_name(Backend backend);  // "auto", "gloo", "mpi", "nccl", "shm", "shm+gloo"
// One of those names (case-insensitive); throws ValueError on anything else.
Backend parse_backend(const std::string& text);
// Those names, in the order --backend flags list them: auto, shm, shm+gloo, gloo, mpi, nccl.
std::vector<std::string> backend_names();
// "" when this build of the library has backend (auto and shm: always); otherwise what it
// lacks and how to build it ("nanoddp was built without NCCL (configure with ...)"), for
// a flag's check to say before anything starts.
std::string backend_unavailable(Backend backend);

// The collectives a ProcessGroup counts (see ProcessGroup::count).
enum class Collective { AllReduce, Broadcast, AllGather, ReduceScatter, Barrier };
constexpr int kNumCollectives = 5;
const char* collective_name(Collective collective);  // "all_reduce", "broadcast", ...

// What one rank has issued of one collective since the group was built (or reset_counts).
// bytes: the payload this rank passed in, summed over calls (all_reduce and broadcast: the
// tensor; all_gather: the input; reduce_scatter: the output, i.e. this rank's share of the
// reduced result; barrier: 0). It is what the caller asked for, not what the backend's
// algorithm puts on the wire: a ring all-reduce of S bytes sends 2(N-1)/N * S per rank.
struct CollectiveCount {
  int64_t calls = 0;
  int64_t bytes = 0;
};

// What one rank's collectives and sends really moved, where the backend can see it (Note
// [Bytes moved] in process_group.cpp), since the group was built.
struct MovedBytes {
  // false where the library moves the data out of our sight (Gloo, MPI, NCCL choose and run
  // their own algorithms): bytes and the algorithm counts are then empty.
  bool measured = false;
  // Bytes this rank wrote into peers' memory or read from it (shm: slots written, peers'
  // collective buffers read), collectives and send/recv together.
  int64_t bytes = 0;
  // All-reduce calls by the algorithm that ran them ("ring", "direct").
  std::map<std::string, int64_t> all_reduces_by_algorithm;
};

// The default timeout of every collective and every store wait. PyTorch uses 30 minutes; we
// use 5: a healthy step of this framework takes milliseconds and even a checkpoint or an
// evaluation on rank 0 takes well under a minute, while a crashed or stuck peer should be
// reported before anyone gives up on the job. Pass a longer one in InitOptions if rank 0 does
// long work between collectives.
constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::minutes(5);

// One issued collective (c10d::Work).
// What the collective check hands a backend that runs the check itself (Note [Fused collective
// check] in dist/process_group_checked.cpp): this rank's fingerprint of the coming collective,
// and what to do with the table of every rank's fingerprints (rank-major, as many int64s per
// rank as `fingerprint` holds). verify throws DistError when the ranks disagree. refuse, when
// set, runs first, before any exchange, and throws DistError when the call must not be made at
// all (an earlier call on the group found the ranks out of step).
struct CollectiveGuard {
  std::vector<int64_t> fingerprint;
  std::function<void(const std::vector<int64_t>& table)> verify;
  std::function<void()> refuse;
};

// While one lives on a thread, the collectives started there leave the send/recv their group
// holds back (NCCL: Note [NCCL point-to-point]) where they are: the collective check's worker
// starts a collective later than its call, at which the caller issued them already, and what
// is queued by then was called after the collective (Note [Host fingerprints] in
// dist/process_group_checked.cpp). Nests. Internal: the check's worker and the NCCL group use it.
namespace detail {
class CollectiveCalledEarlier {
 public:
  CollectiveCalledEarlier();
  ~CollectiveCalledEarlier();
  CollectiveCalledEarlier(const CollectiveCalledEarlier&) = delete;
  CollectiveCalledEarlier& operator=(const CollectiveCalledEarlier&) = delete;
  static bool active();  // on this thread

 private:
  bool previous_;
};
}  // namespace detail

// What the calling thread's collectives are for while one lives: an FSDP unit's all_gather or
// reduction, a DDP bucket's all-reduce (Note [Collective purpose] in
// dist/process_group_checked.cpp). The collective check compares it with the rest of the
// fingerprint. Nests: the innermost one names the calls.
class CollectivePurpose {
 public:
  enum class Kind : int64_t {
    FsdpUnit = 1,
    DdpBucket = 2,
    FsdpStateDict = 3,
    FsdpLoadStateDict = 4,
    FsdpOptimState = 5,
    ZeroConsolidate = 6,  // ZeroRedundancyOptimizer.consolidate_state_dict (index unused)
    ZeroLoad = 7,         // ZeroRedundancyOptimizer.load_state_dict's agreement (index unused)
    Join = 8,             // Join's own all-reduces: index 0 the count of ranks still training, 1 who ran out
    GradScalerUnscale = 9,  // GradScaler.unscale_'s inf/NaN verdict (index unused)
    FsdpLoadCheck = 10,     // FullyShardedDataParallel.load_full_state_dict's agreement (index unused)
  };
  CollectivePurpose(Kind kind, size_t index);
  ~CollectivePurpose();
  CollectivePurpose(const CollectivePurpose&) = delete;
  CollectivePurpose& operator=(const CollectivePurpose&) = delete;

  // The innermost purpose alive on this thread, as one int64 (0: none).
  static int64_t current();
  // "FSDP unit 2", "DDP bucket 0", "FSDP unit 2's state dict" (its load, its optimizer state),
  // "ZeroRedundancyOptimizer.consolidate_state_dict" (.load_state_dict), "Join's count of
  // ranks still training", "GradScaler.unscale_'s inf/NaN check", or "" for 0.
  static std::string describe(int64_t code);

 private:
  int64_t previous_;
};

// How long a wait(requested) may block in a group whose timeout is group_timeout: the earlier
// of the two, or group_timeout alone when requested is 0 or less (torch's kNoTimeout). Every
// backend's Work::wait goes through it.
std::chrono::milliseconds effective_wait_timeout(std::chrono::milliseconds requested,
                                                 std::chrono::milliseconds group_timeout);

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective (and every earlier one of its group) has finished, or throws
  // TimeoutError after timeout or the group's timeout, whichever is earlier, or DistError
  // when it failed. A timeout of 0 (or less) sets no limit of its own: the group's timeout
  // applies, as torch's Work.wait(timeout=timedelta(0)). A CPU result is then in the tensors; a CUDA result
  // is ordered before every later kernel on the compute stream. Calling wait() again returns at once (or
  // throws the same error).
  // NCCL, as torch's ProcessGroupNCCL by default: wait() only orders the compute stream after the
  // collective and returns, so the host does not wait for the device (a barrier's wait() does);
  // with the collective check (on by default) it first waits, on the host, for every rank to have
  // called the collective (Note [Host fingerprints] in dist/process_group_checked.cpp), TimeoutError
  // when one has not within the timeout. The
  // timeout, counted from the launch, is kept by a watchdog thread, which follows every collective,
  // waited on or not: past it, or on an NCCL error, it aborts the communicator and prints why. From
  // then on every call of the group throws DistError with that reason, and so does every host read
  // of device memory (a copy to the host, item(), synchronize()) once a collective that wait() had
  // handed to the compute stream was cut short (Note [NCCL stream-ordered wait] in
  // dist/nccl_protocol.h). Where torch's watchdog ends the process, here the next read fails.
  // (torch 2.x blocks the host when wait() is given a timeout explicitly; here a timeout only sets
  // the watchdog's deadline.)
  virtual void wait(std::chrono::milliseconds timeout = kDefaultTimeout) = 0;
  // True once finished (successfully or not); never blocks. On a group whose collectives run
  // in wait() (collectives_run_in_wait(): shm, shm+gloo) it stays false until some thread
  // waits on this work or a later one: poll with wait(), not a loop on is_completed().
  virtual bool is_completed() = 0;
};

class ProcessGroup {
 public:
  ProcessGroup(int rank, int world_size) : rank_(rank), world_size_(world_size) {}
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return world_size_; }
  virtual std::string backend_name() const = 0;  // "gloo", "mpi", "nccl", "shm", "shm+gloo"
  // The device whose tensors this group's collectives take: cuda:N for NCCL (the GPU it was
  // built on), cpu for Gloo and MPI (which also take CUDA tensors, staged through host
  // memory). Code that reduces numbers of its own (counts, losses, DDP's checks) builds its
  // tensors here: dist/host_collectives.h does it for host values.
  virtual Device device() const { return Device::cpu(); }

  // tensor: any shape, float32 or int64 (Avg: float32 only) or float16/bfloat16 (Sum only),
  // reduced in place across ranks;
  // every rank ends with the same values (torch.distributed.all_reduce).
  virtual std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op = ReduceOp::Sum) = 0;
  // tensor: any shape and dtype; root's values are copied into every rank's tensor
  // (torch.distributed.broadcast). Throws ValueError when root is not in [0, size()).
  virtual std::shared_ptr<Work> broadcast(Tensor& tensor, int root) = 0;
  // outputs: size() tensors of input's shape and dtype (any dtype); outputs[r] receives rank
  // r's input (torch.distributed.all_gather). Throws ValueError/ShapeError on a count/shape mismatch.
  virtual std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) = 0;
  // inputs: size() tensors of output's shape and dtype (the dtypes and ops all_reduce takes);
  // output = reduce over ranks r' of rank r''s inputs[rank()]
  // (torch.distributed.reduce_scatter). The inputs are read, never
  // written, and may be read until wait() returns: as with torch's async_op=True, change
  // them only after.
  virtual std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                               ReduceOp op = ReduceOp::Sum) = 0;
  // Completes once every rank has called it (torch.distributed.barrier).
  virtual std::shared_ptr<Work> barrier() = 0;

  // Point-to-point (torch.distributed.isend / irecv; wait() on the Work for send / recv).
  // tensor: any shape and dtype; recv's tensor must have the shape and dtype of the matching send.
  // Messages between two ranks arrive in the order sent; tag must match too. On shm they share
  // the pair's channel with the collectives, in order: a message sent before a collective must
  // be received before it, and recvs go in the order of the sends whatever their tags (torch's
  // isend/irecv and our Gloo and MPI allow both; shm says so with a DistError). Throws
  // ValueError when dst/src is not another rank of the group; a mismatch in size, dtype or
  // tag is a DistError on the receiving side (shm; MPI for a size that differs, Note [MPI
  // probed recv]) or, where the library cannot tell, data cut short, or reinterpreted when both are n
  // elements of one size (int32[n] sent, float32[n] received). On Gloo (and shm+gloo, whose
  // send and recv go through Gloo) a recv smaller than its send ends the process inside Gloo's own thread
  // (SIGABRT, "op.preamble.length <= op.nbytes"), as in torch's Gloo backend: the launcher names the rank.
  // NCCL queues send/recv and issues them together, as one NCCL group, when one of them is waited on, tested
  // or dropped, when a collective is called, or when the group goes (so an exchange cannot deadlock, and a
  // send whose Work is dropped still goes out); they run on a communicator and stream of their own, beside
  // the collectives (Note [NCCL point-to-point]). NCCL takes tag 0 only (ValueError otherwise: NCCL has no
  // tags). The base class throws DistError: the backend has no point-to-point.
  virtual std::shared_ptr<Work> send(const Tensor& tensor, int dst, int tag = 0);
  virtual std::shared_ptr<Work> recv(Tensor& tensor, int src, int tag = 0);

  // The rendezvous store the group was built on. Throws DistError for MPI, which needs none.
  virtual Store& store();

  // A zeroed [numel] tensor of dtype on device for collectives this group runs on again and
  // again (DDP's buckets). Collective: every rank calls it in the same order with the same
  // numel and dtype. shm places a CPU buffer in memory that every rank of the group maps, so
  // an all_reduce of the whole buffer reads the peers' buffers directly instead of copying
  // through its ring slots (Note [Shm direct all-reduce] in ring_shm.cpp); the base
  // class returns Tensor::zeros. Either way it is an ordinary tensor: any collective takes
  // it, and it stays valid after the group is gone. One rule on shm: an all_reduce of a whole
  // buffer needs every rank's buffer, not a buffer on some ranks and ordinary tensors on
  // others (the direct all-reduce reads the peers' buffers in place); such a mix is a
  // DistError on every rank, found after the call started, so the group is then unusable.
  // Like torch.distributed's _symmetric_memory.empty followed by rendezvous. Throws DistError
  // when ranks ask for different sizes (shm), or TimeoutError when a rank does not call it
  // within the timeout.
  virtual Tensor new_collective_buffer(int64_t numel, DType dtype, Device device);

  // The all-reduce algorithm whose traffic formula describes this backend: "ring" (each rank
  // sends 2(N-1)/N of the payload). Gloo's all-reduce is a ring; Open MPI and NCCL choose per
  // size and report it as the library's choice.
  virtual std::string all_reduce_algorithm() const { return "ring"; }
  // The algorithm an all_reduce of `tensor` runs: all_reduce_algorithm(), except on shm, where
  // a collective buffer (new_collective_buffer) is reduced by the "direct" all-reduce
  // (Note [Shm direct all-reduce]). What the trace's bucket spans say.
  virtual std::string all_reduce_algorithm_for(const Tensor& tensor) const {
    (void)tensor;
    return all_reduce_algorithm();
  }

  // True when a collective moves only while some thread waits on it: shm and shm+gloo run it
  // on the waiting thread (Note [Shm progress]). False when it runs after the call returns,
  // on the backend's own thread (Gloo), the device (NCCL), or at each poll (MPI's test).
  // DDP's trace and --explain then time a bucket's all-reduce from the wait that runs it,
  // not from its launch: launched early, it still hides nothing.
  virtual bool collectives_run_in_wait() const { return false; }

  // Note [Fused collective check] in dist/process_group_checked.cpp: issues the collective
  // that `start` issues on this group, preceded, in the same unit of the backend's progress,
  // by an all-gather of guard.fingerprint and guard.verify on the table. When verify throws,
  // the collective does not run and the returned Work's wait() rethrows it. Returns null,
  // without calling start, where the backend cannot (the default): the check then exchanges
  // the fingerprints with a collective of its own. One caller at a time.
  virtual std::shared_ptr<Work> start_guarded(CollectiveGuard guard,
                                              const std::function<std::shared_ptr<Work>()>& start) {
    (void)guard;
    (void)start;
    return nullptr;
  }
  // True where start_guarded issues (Gloo): for a wrapper that starts the collective later,
  // on another thread, and must know now whether the guard can go with it (host staging).
  virtual bool can_start_guarded() const { return false; }

  // Issues the send/recv calls this group holds back to issue them together (NCCL groups
  // them: Note [NCCL point-to-point]), as its next collective does; a no-op elsewhere. For a
  // caller that starts a collective later than it is called (the collective check's worker,
  // Note [Host fingerprints] in dist/process_group_checked.cpp), so that a send followed by a
  // collective still goes out at the collective's call. Failures are the send/recv Works' to
  // report; never throws.
  virtual void issue_queued_point_to_point() {}

  // Bytes this rank really moved, and which all-reduce algorithm ran (MovedBytes); the base
  // class measures nothing.
  virtual MovedBytes moved_bytes() const { return {}; }

  // Counters (Note [Collective counters]): calls and bytes of each collective this rank has
  // issued, including those a world of one completes at once; a call refused for its
  // arguments is not counted. Safe to read from any thread. Virtual for wrappers that only
  // move tensors (host staging), which read their inner group's.
  virtual CollectiveCount count(Collective collective) const;
  virtual void reset_counts();

 protected:
  // Every backend (and the collective check) calls this once in each collective, once its
  // arguments are checked; it is the only place that counts, so the counters mean the same on
  // every backend.
  // payload: the tensor whose bytes are counted (see CollectiveCount); none for barrier.
  void count_call(Collective collective, const Tensor& payload = Tensor());

  // "rank 1/4 on host: gloo all_reduce(sum) of [1048579] float32" and the like.
  std::string describe(const std::string& collective, const Tensor& tensor) const;
  std::string where() const;  // "rank 1/4 on host"
  // Shared argument checks; each throws ValueError/ShapeError/DeviceError with describe().
  // check_tensor: defined and on device, any dtype (what a copy needs); check_reduce: a dtype
  // and op the backends can add (every reduction calls both).
  void check_tensor(const std::string& collective, const Tensor& tensor, Device device) const;
  void check_reduce(const std::string& collective, const Tensor& tensor, ReduceOp op) const;
  void check_list(const std::string& collective, const std::vector<Tensor>& list,
                  const Tensor& like) const;
  // send/recv: a defined tensor on device(), a tag >= 0 (torch.distributed's rule), and a peer
  // that is another rank of the group. what: describe()'s text for the call.
  void check_point_to_point(const std::string& what, const Tensor& tensor, int peer, int tag, bool is_send) const;

  int rank_;
  int world_size_;

 private:
  std::array<std::atomic<int64_t>, kNumCollectives> calls_{};
  std::array<std::atomic<int64_t>, kNumCollectives> bytes_{};
};

// A Work that is finished when created: world size 1, or backends that ran synchronously.
class CompletedWork : public Work {
 public:
  void wait(std::chrono::milliseconds) override {}
  bool is_completed() override { return true; }
};

// ---- backend factories (each defined in its backend's file, or a stub that throws
// DistError "nanoddp was built without Gloo/MPI/NCCL") ---------------------------------

struct GlooOptions {
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";  // Gloo listens on the interface that reaches it
  int master_port = 29500;
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // Store keys of this group start with this; "" = "gloo/<n>/", n counting the groups this
  // process made (the same on every rank when all ranks make the same groups in order).
  std::string store_prefix;
  // When every rank is on this machine, the collective check's fingerprints travel through
  // shared memory instead of Gloo's sockets (Note [Shared-memory fingerprints] in
  // dist/host_fingerprints.cpp): a shm group of its own, made with this one. init_process_group
  // sets it when the check is on.
  bool fingerprints_over_shm = false;
};
// Connects a full mesh of TCP pairs among the ranks through store (each rank publishes its
// address, then connects to every other). One worker thread per group runs the collectives
// in issue order, so all_reduce returns at once (Note [Gloo worker thread] in
// process_group_gloo.cpp).
std::shared_ptr<ProcessGroup> make_gloo_process_group(std::shared_ptr<Store> store,
                                                      const GlooOptions& options);

// Uses MPI_COMM_WORLD (duplicated); rank and size come from MPI. Initialises MPI once per
// process (finalised at exit). Collectives are nonblocking MPI_I* calls that wait() polls
// with MPI_Test against the timeout.
std::shared_ptr<ProcessGroup> make_mpi_process_group(std::chrono::milliseconds timeout);
// True when MPI is built in and the process looks launched by mpirun/srun, and not by a
// torchrun-style launcher inside them (RANK set: the innermost launcher wins).
bool launched_by_mpi();

struct ShmOptions {
  int rank = 0;
  int world_size = 1;
  std::chrono::milliseconds timeout = kDefaultTimeout;  // store waits while the segment is made
  std::string store_prefix;  // as GlooOptions::store_prefix; "" = "shm/<n>/"
};
// Ranks on one machine meet in one shared-memory segment, made through store and unnamed as
// soon as every rank has mapped it (Note [Shm segment] in shm_segment.h). all_reduce
// is a ring reduce-scatter + all-gather; works run on the thread that waits for them (Note
// [Shm progress]). Throws DistError when a rank is on another machine or /dev/shm is full.
std::shared_ptr<ProcessGroup> make_shm_process_group(std::shared_ptr<Store> store,
                                                     const ShmOptions& options);

struct TwoLevelOptions {
  int rank = 0;
  int world_size = 1;
  int node_rank = 0;         // this node's index (GROUP_RANK, from the launcher)
  int local_rank = 0;        // this rank's index on its node (LOCAL_RANK)
  int local_world_size = 1;  // ranks per node (LOCAL_WORLD_SIZE), the same on every node
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::chrono::milliseconds timeout = kDefaultTimeout;
};
// Two levels, as NCCL and Horovod's hierarchical all-reduce: all_reduce reduces among the
// ranks of a node through shared memory, all-reduces across nodes between one leader per
// node (local rank 0) over Gloo, then broadcasts the result on each node. Other collectives
// and send/recv run on a Gloo group of all ranks. Ranks must be numbered node by node (rank =
// node_rank * local_world_size + local_rank, as nanoddp-run and torchrun do); ValueError
// otherwise.
std::shared_ptr<ProcessGroup> make_two_level_process_group(std::shared_ptr<Store> store,
                                                           const TwoLevelOptions& options);

struct NcclOptions {
  int rank = 0;
  int world_size = 1;
  Device device = Device::cuda(0);  // this rank's GPU: one GPU per rank
  std::chrono::milliseconds timeout = kDefaultTimeout;
};
// Rank 0 creates the NCCL unique id and publishes it in store; every rank builds its
// communicator from it. Throws DistError when two ranks name the same GPU on one host.
std::shared_ptr<ProcessGroup> make_nccl_process_group(std::shared_ptr<Store> store,
                                                      const NcclOptions& options);

// inner, with every collective checked first (Note [Collective check] in
// process_group_checked.cpp): ranks that disagree get a DistError instead of a hang, an abort
// or corrupt data. Every wait through it also ends by timeout, the group's (whatever the
// backend does). init_process_group wraps every group with it unless
// InitOptions::check_collectives is false. A virtual added to ProcessGroup must also be
// forwarded there (count and reset_counts excepted: the checked group counts the calls made
// through it; start_guarded and can_start_guarded too: the check is what calls them), and by
// host_staging.cpp's StagingGroup, which every CPU group is wrapped in.
// fingerprint_group: null, or a CPU group of the same ranks (rank r of it is rank r of inner)
// that the fingerprints travel through instead of inner's own collectives (Note [Host
// fingerprints] in process_group_checked.cpp; init_process_group gives NCCL one, as
// torch.distributed's ProcessGroupWrapper all-gathers its fingerprints on a Gloo group).
// ValueError when inner is null, when fingerprint_group is not a CPU group of inner's rank
// and size, or when inner runs its collectives in the waiting thread (shm, shm+gloo): there one
// ordered engine runs collectives and send/recv, and a collective started later by the check's
// thread would fall behind the send/recv called after it. DistError when the check's thread
// cannot be started.
std::shared_ptr<ProcessGroup> make_checked_process_group(std::shared_ptr<ProcessGroup> inner,
                                                         std::chrono::milliseconds timeout,
                                                         std::shared_ptr<ProcessGroup> fingerprint_group = nullptr);

}  // namespace nanoddp::dist
