#include "dist/init.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <mutex>

#include "core/error.h"
#include "core/trace.h"
#include "dist/detail.h"
#include "dist/host_fingerprints.h"
#include "dist/host_staging.h"
#include "dist/launcher_link.h"
#include "dist/store_wire.h"
#include "kernels/kernels.h"

namespace nanoddp::dist {

namespace {

// Rounds of the clock exchange below; the one with the shortest round trip is kept.
constexpr int kClockRounds = 8;

// This rank's clock minus rank 0's, estimated through the store (Note [Trace clocks] in
// core/trace_merge.cpp). Rank 0 answers each peer in turn; groups are built in the same order
// on every rank, so `prefix` names the same exchange everywhere.
double clock_offset_to_rank0(ProcessGroup& group, Store& store, const std::string& prefix) {
  double best_offset = 0, best_round_trip = -1;
  for (int peer = 1; peer < group.size(); ++peer) {
    if (group.rank() != 0 && group.rank() != peer) continue;
    for (int round = 0; round < kClockRounds; ++round) {
      const std::string key = prefix + std::to_string(peer) + "/" + std::to_string(round);
      if (group.rank() == 0) {
        store.wait({key + "/ask"});
        store.set(key + "/answer", std::to_string(trace::now_us()));
        continue;
      }
      const double asked = trace::now_us();
      store.set(key + "/ask", std::vector<uint8_t>{1});
      store.wait({key + "/answer"});
      const double answered = trace::now_us();
      const std::vector<uint8_t> bytes = store.get(key + "/answer");
      const double rank0 = std::stod(std::string(bytes.begin(), bytes.end()));
      if (best_round_trip < 0 || answered - asked < best_round_trip) {
        best_round_trip = answered - asked;
        best_offset = (asked + answered) / 2 - rank0;
      }
    }
  }
  return best_offset;
}

// When a trace is being recorded: names this process's rank in it and aligns its clock with
// rank 0's. Without a store (MPI) the ranks leave one barrier together instead, which is as
// exact as the barrier's exit is simultaneous.
void join_trace(ProcessGroup& group, Store* store) {
  if (!trace::enabled()) return;
  static int generation = 0;
  trace::set_rank(group.rank(), group.size());
  if (group.size() == 1) return;
  if (store != nullptr) {
    const std::string prefix = "trace/clock/" + std::to_string(generation++) + "/";
    // The common instant is 0 on rank 0's clock: rank r's clock read -offset then.
    trace::set_clock_sync(-clock_offset_to_rank0(group, *store, prefix));
  } else {
    group.barrier()->wait();
    trace::set_clock_sync(trace::now_us());
  }
}

std::mutex default_mutex;
std::shared_ptr<ProcessGroup> default_group;
// How many default groups this process has initialised: the next one's store generation
// (TCPStoreOptions::generation), so a rank that re-initialises before rank 0 has destroyed the
// old group waits for rank 0's new store instead of joining the old one.
int groups_initialised = 0;

// Note [NCCL shutdown] (dist/process_group_nccl.cpp): a default group still alive at exit is
// dropped by an exit handler registered once the group (and so CUDA) is up. Exit handlers
// run in reverse order of registration, so this one runs before the CUDA runtime's teardown,
// unlike the destructor of default_group itself.
void register_exit_handler() {
  static std::once_flag once;
  std::call_once(once, [] { std::atexit([] { destroy_process_group(); }); });
}

std::atomic<bool> after_cuda_registered{false};

// Where each field of LaunchEnv comes from, the first one set winning (dist/init.h).
constexpr std::initializer_list<const char*> kRankVars = {"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"};
constexpr std::initializer_list<const char*> kWorldSizeVars = {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE",
                                                               "SLURM_NTASKS"};
constexpr std::initializer_list<const char*> kLocalRankVars = {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                                                               "SLURM_LOCALID"};
constexpr std::initializer_list<const char*> kLocalWorldSizeVars = {
    "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"};

// The first of names that is set (non-empty), or nullptr.
const char* env_source(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    const char* text = std::getenv(name);
    if (text != nullptr && *text != '\0') return name;
  }
  return nullptr;
}

// "RANK=3" for a value read from the environment (sources: the names it is read from), else
// the InitOptions field that gave it.
std::string value_source(std::initializer_list<const char*> sources, int value, bool from_env,
                         const char* option) {
  const char* name = from_env ? env_source(sources) : nullptr;
  return name != nullptr ? std::string(name) + "=" + std::to_string(value)
                         : std::string(option) + " = " + std::to_string(value);
}

// The first of names that is set, parsed as an int in [lo, hi]; -1 when none is set.
int env_int(std::initializer_list<const char*> names, long lo, long hi) {
  const char* name = env_source(names);
  if (name == nullptr) return -1;
  const char* text = std::getenv(name);
  char* end = nullptr;
  errno = 0;
  long value = std::strtol(text, &end, 10);
  NANODDP_CHECK(errno == 0 && *end == '\0' && value >= lo && value <= hi, ValueError,
                "environment variable ", name, "='", text, "' is not an integer in [", lo, ", ", hi,
                "]");
  return static_cast<int>(value);
}

struct Address {
  std::string host;
  int port = 0;
};

// "tcp://host:port" or "tcp://[v6addr]:port".
Address parse_tcp_url(const std::string& url) {
  const std::string scheme = "tcp://";
  std::string rest = url.substr(scheme.size());
  Address address;
  size_t colon;
  if (!rest.empty() && rest[0] == '[') {
    size_t close = rest.find(']');
    NANODDP_CHECK(close != std::string::npos, ValueError, "init_method '", url,
                  "': unterminated [IPv6 address]");
    address.host = rest.substr(1, close - 1);
    colon = close + 1;
    NANODDP_CHECK(colon < rest.size() && rest[colon] == ':', ValueError, "init_method '", url,
                  "': expected tcp://[address]:port");
  } else {
    colon = rest.rfind(':');
    NANODDP_CHECK(colon != std::string::npos && colon > 0, ValueError, "init_method '", url,
                  "': expected tcp://host:port");
    address.host = rest.substr(0, colon);
  }
  std::string port = rest.substr(colon + 1);
  char* end = nullptr;
  long value = std::strtol(port.c_str(), &end, 10);
  NANODDP_CHECK(!port.empty() && *end == '\0' && value >= 0 && value <= 65535, ValueError,
                "init_method '", url, "': port '", port, "' is not in 0..65535");
  address.port = static_cast<int>(value);
  return address;
}

std::string env_text(const char* name) {
  const char* text = std::getenv(name);
  return text == nullptr ? std::string() : std::string(text);
}

// The backend the program asked for, reconciled with the launcher's (NANODDP_BACKEND, set by
// `nanoddp-run --backend` and spawn): Auto follows the launcher; two different explicit choices
// are an error naming both, since one of them would be silently ignored.
Backend requested_backend(Backend asked, const std::string& where) {
  const char* text = std::getenv(kLauncherBackendEnv);
  if (text == nullptr || *text == '\0') return asked;
  Backend launcher = Backend::Auto;
  try {
    launcher = parse_backend(text);
  } catch (const ValueError& e) {
    NANODDP_THROW(ValueError, where, ": ", kLauncherBackendEnv, "='", text,
                  "' (from nanoddp-run --backend): ", message_of(e));
  }
  if (asked == Backend::Auto) return launcher;
  NANODDP_CHECK(launcher == Backend::Auto || launcher == asked, ValueError, where, ": the program asks for backend ",
                backend_name(asked), " but the launcher was given --backend ", backend_name(launcher), " (",
                kLauncherBackendEnv, "=", text, "); drop one of the two or make them agree");
  return asked;
}

// The group as init_process_group hands it out: with the collective check unless turned off
// (InitOptions::check_collectives, NANODDP_CHECK_COLLECTIVES=0; read before any rendezvous).
// fingerprint_group: Note [Host fingerprints] in dist/process_group_checked.cpp.
std::shared_ptr<ProcessGroup> checked(std::shared_ptr<ProcessGroup> group, bool check_collectives,
                                      std::chrono::milliseconds timeout,
                                      std::shared_ptr<ProcessGroup> fingerprint_group = nullptr) {
  if (!check_collectives) return group;
  return make_checked_process_group(std::move(group), timeout, std::move(fingerprint_group));
}

}  // namespace

LaunchEnv read_launch_env() {
  LaunchEnv env;
  env.rank = env_int(kRankVars, 0, INT_MAX);
  env.world_size = env_int(kWorldSizeVars, 1, INT_MAX);
  env.local_rank = env_int(kLocalRankVars, 0, INT_MAX);
  env.local_world_size = env_int(kLocalWorldSizeVars, 1, INT_MAX);
  // Variables left over from another job, or set by hand, that cannot describe one process of
  // one job: refused here, before they pick a GPU (get_local_rank) or a rendezvous.
  if (env.local_rank >= 0 && env.local_world_size > 0) {
    NANODDP_CHECK(env.local_rank < env.local_world_size, ValueError,
                  "environment: ", value_source(kLocalRankVars, env.local_rank, true, ""), " is not below ",
                  value_source(kLocalWorldSizeVars, env.local_world_size, true, ""),
                  " (local ranks are 0..local world size - 1); were they left over from another job?");
  }
  if (env.local_rank >= 0 && env.local_world_size < 0) {
    // No local world size: the local rank is bounded by the job's size, 1 for a process with
    // no WORLD_SIZE (a plain single process is local rank 0).
    NANODDP_CHECK(env.local_rank < std::max(env.world_size, 1), ValueError, "environment: ",
                  value_source(kLocalRankVars, env.local_rank, true, ""), " is not below ",
                  env.world_size > 0 ? value_source(kWorldSizeVars, env.world_size, true, "")
                                     : std::string("the world size 1 of a process without WORLD_SIZE"),
                  " (a host cannot run more ranks than the job has); was it left over from another job?");
  }
  if (env.local_world_size > 0 && env.world_size > 0) {
    NANODDP_CHECK(env.local_world_size <= env.world_size, ValueError,
                  "environment: ", value_source(kLocalWorldSizeVars, env.local_world_size, true, ""),
                  " is more than ", value_source(kWorldSizeVars, env.world_size, true, ""),
                  " (a host cannot run more ranks than the job has); were they left over from another job?");
  }
  env.node_rank = env_int({"GROUP_RANK"}, 0, INT_MAX);
  if (const char* addr = std::getenv("MASTER_ADDR")) env.master_addr = addr;
  int port = env_int({"MASTER_PORT"}, 0, 65535);
  env.master_port = port < 0 ? 0 : port;
  return env;
}

namespace {

// Every rank of a group must build the same backend. Ranks that chose different ones (nodes
// started with different --backend, a NANODDP_BACKEND of their own) would each wait for keys
// of their own backend's rendezvous until the timeout. So rank 0 publishes its choice and the
// others compare at once; one that differs says why under the store's refusal note, which
// ends every rank's waits with it (Note [Store wire format], kJobBroken), and throws.
void agree_on_backend(TCPStore& store, Backend backend, int rank, int world_size) {
  if (world_size == 1) return;
  const std::string key = "nanoddp/backend", mine = backend_name(backend);
  if (rank == 0) return store.set(key, mine);
  const std::string theirs = store.get_string(key);
  if (theirs == mine) return;
  const std::string advice = "every rank must use one backend (the same --backend, NANODDP_BACKEND or "
                             "InitOptions::backend on every node)";
  store.set(store_detail::kRefusedKey, "rank " + std::to_string(rank) + ", which chose backend " + mine +
                                           " where rank 0 chose " + theirs + ": " + advice);
  NANODDP_THROW(DistError, detail::where(rank, world_size), ": this rank chose backend ", mine,
                ", but rank 0 chose ", theirs, ": ", advice);
}

// Throws the store's refusal note, with error's own text after it, when there is one; returns
// otherwise (and when the store does not answer: TCPStore::refusal_note).
void rethrow_if_refused(TCPStore& store, const DistError& error, int rank, int world_size) {
  const std::string refused = store.refusal_note();
  if (refused.empty() || std::string(error.what()).find(refused) != std::string::npos) return;  // none, or said
  NANODDP_THROW(DistError, detail::where(rank, world_size), ": the store refused ", refused, " (what this rank met: ",
                message_of(error), ")");
}

}  // namespace

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(default_mutex);
  NANODDP_CHECK(default_group == nullptr, DistError, detail::where(default_group->rank(),
                default_group->size()), ": init_process_group called twice; call "
                "destroy_process_group first");
  LaunchEnv env = read_launch_env();
  // Every variable is read, and refused if malformed, before anything waits for a peer.
  const bool check_collectives =
      options.check_collectives && detail::env_flag("NANODDP_CHECK_COLLECTIVES", true);
  const bool listen_on_all_interfaces = detail::env_flag(kStoreListenAllEnv, false);
  const int given_rank = options.rank >= 0 ? options.rank : env.rank;
  const int given_world_size = options.world_size >= 0 ? options.world_size : env.world_size;
  // Neither given: a plain single process, rank 0 of 1 (as below), not an unknown rank.
  const bool single_process = given_rank < 0 && given_world_size < 0 && !launched_by_mpi();
  const std::string where = single_process ? detail::where(0, 1) : detail::where(given_rank, given_world_size);
  NANODDP_CHECK(!options.device.is_cuda() || kernels::cuda_built(), DeviceError, where, ": device ",
                options.device, " was asked for, but this build of nanoddp has no CUDA (configure with "
                "-Dcuda=enabled on a machine with the CUDA toolkit); use the cpu device");
  // A run that asked for a trace and cannot have it stops here, before training, as a refused
  // --trace does (the reason was printed as the library loaded).
  NANODDP_CHECK(trace::environment_error().empty(), IOError, where, ": NANODDP_TRACE=", env_text("NANODDP_TRACE"),
                " was refused (the reason is above): unset it or name a trace file");
  watch_launcher(options.rank >= 0 ? options.rank : env.rank);  // Note [Launcher link]

  Backend backend = requested_backend(options.backend, where);
  if (backend == Backend::Auto) {
    // A plain single process is a group of one, on one machine: shm, as for a launched job
    // on one node (so a lone run reports the backend a one-node job uses).
    const bool one_machine = single_process || (env.world_size > 0 && env.local_world_size == env.world_size);
    const bool nodes_known = env.world_size > 0 && env.local_world_size > 0 && env.node_rank >= 0;
    backend = options.device.is_cuda() ? Backend::Nccl
              : launched_by_mpi()      ? Backend::Mpi
              : one_machine            ? Backend::Shm
              : nodes_known            ? Backend::ShmGloo
                                       : Backend::Gloo;
  }

  if (backend == Backend::Mpi) {
    auto group = make_mpi_process_group(options.timeout);
    int rank = options.rank >= 0 ? options.rank : env.rank;
    int world_size = options.world_size >= 0 ? options.world_size : env.world_size;
    // Without mpirun MPI sees one process; say where the mpi choice came from, which is then
    // the mistake more often than the missing mpirun.
    const bool from_launcher_env = options.backend == Backend::Auto && !launched_by_mpi() &&
                                   std::getenv(kLauncherBackendEnv) != nullptr;
    NANODDP_CHECK((rank < 0 || rank == group->rank()) &&
                      (world_size < 0 || world_size == group->size()),
                  DistError, where,
                  ": MPI says rank ", group->rank(), " of ", group->size(),
                  " but the options/environment say rank ", rank, " of ", world_size,
                  "; launch with nanoddp-run --nproc-per-node ", world_size < 0 ? group->size() : world_size,
                  " --backend mpi (it starts the ranks through mpirun)",
                  from_launcher_env ? std::string(" (the mpi backend came from ") + kLauncherBackendEnv +
                                          "=mpi in the environment; unset it to let the program pick)"
                                    : std::string());
    // CUDA tensors through host memory (dist/host_staging.h), then the collective check.
    default_group = checked(stage_device_tensors(group, options.timeout), check_collectives, options.timeout);
    ++groups_initialised;
    register_exit_handler();
    join_trace(*default_group, nullptr);
    return default_group;
  }

  int rank = options.rank >= 0 ? options.rank : env.rank;
  int world_size = options.world_size >= 0 ? options.world_size : env.world_size;
  if (rank < 0 && world_size < 0) rank = 0, world_size = 1;  // a plain single process
  NANODDP_CHECK(world_size >= 1, ValueError, detail::where(rank, world_size),
                ": world size unknown: set WORLD_SIZE (or pass InitOptions::world_size)");
  NANODDP_CHECK(rank >= 0, ValueError, detail::where(rank, world_size),
                ": rank unknown: set RANK (or pass InitOptions::rank)");
  NANODDP_CHECK(rank < world_size, ValueError, detail::where(rank, world_size), ": ",
                value_source(kRankVars, rank, options.rank < 0, "InitOptions::rank"), " is not below ",
                value_source(kWorldSizeVars, world_size, options.world_size < 0, "InitOptions::world_size"),
                " (ranks are 0..world size - 1)",
                options.rank < 0 && options.world_size < 0 ? "; were they left over from another job?" : "");

  Address master;
  if (options.init_method.rfind("tcp://", 0) == 0) {
    master = parse_tcp_url(options.init_method);
  } else {
    NANODDP_CHECK(options.init_method == "env://", ValueError, detail::where(rank, world_size),
                  ": init_method '", options.init_method, "' is neither env:// nor tcp://host:port");
    master.host = env.master_addr;
    master.port = env.master_port;
    // A 1-rank job's store is reached by no other process: it listens on a free loopback port,
    // so MASTER_ADDR/MASTER_PORT left over from an outer job (whose store may hold that port)
    // cannot make a single process fail.
    if (world_size == 1) master.host = "127.0.0.1", master.port = 0;
    NANODDP_CHECK(!master.host.empty(), ValueError, detail::where(rank, world_size),
                  ": MASTER_ADDR is not set (the address of rank 0's host; nanoddp-run sets it)");
    NANODDP_CHECK(
        world_size == 1 || master.port > 0, ValueError, detail::where(rank, world_size),
        std::getenv("MASTER_PORT") != nullptr && *std::getenv("MASTER_PORT") != '\0'
            ? ": MASTER_PORT=0 names no port: the other ranks must know rank 0's (the launcher picks "
              "a free one when its --master-port is 0)"
            : ": MASTER_PORT is not set (a free TCP port on rank 0's host)");
  }
  NANODDP_CHECK(master.port > 0 || world_size == 1, ValueError, detail::where(rank, world_size),
                ": port 0 only works for a 1-rank job: the other ranks must know the port");

  TCPStoreOptions store_options;
  store_options.host = master.host;
  store_options.port = master.port;
  store_options.is_server = rank == 0;
  store_options.rank = rank;
  store_options.world_size = world_size;
  store_options.timeout = options.timeout;
  store_options.job_id = env_text(kJobIdEnv);
  store_options.token = env_text(kStoreTokenEnv);
  store_options.round = std::max(0, env_int({kRestartCountEnv}, 0, INT_MAX));
  store_options.generation = groups_initialised;
  store_options.listen_on_all_interfaces = listen_on_all_interfaces;
  if (rank == 0 && world_size > 1 && store_options.token.empty()) {
    const std::string warning =
        detail::where(rank, world_size) + ": warning: the store at " + master.host + ":" +
        std::to_string(master.port) + " admits any client that reaches it: " + kStoreTokenEnv +
        " is not set (nanoddp-run sets one for a job on one node; with " +
        "--nnodes > 1, or under mpirun or srun, export the same secret to every rank)\n";
    ssize_t ignored = ::write(2, warning.data(), warning.size());  // one write: never interleaved
    (void)ignored;
  }
  // Note [Launcher link], item 3, for the launcher's own world only: a group of other ranks or
  // another size (InitOptions given) numbers its ranks unlike the launcher.
  const bool launcher_world = rank == env.rank && world_size == env.world_size;
  // Withdrawn if this init throws: a rank that catches the error and goes on waits for nobody.
  struct JoiningReport {
    int rank, world_size;
    bool active, joined = false;
    ~JoiningReport() {
      if (active)
        report_rendezvous(rank, world_size, joined ? RendezvousStage::Joined : RendezvousStage::Left);
    }
  } joining{rank, world_size, launcher_world};
  if (launcher_world) report_rendezvous(rank, world_size, RendezvousStage::Joining);
  auto store = std::make_shared<TCPStore>(store_options);
  agree_on_backend(*store, backend, rank, world_size);

  std::shared_ptr<ProcessGroup> group, fingerprint_group;
  try {
    if (backend == Backend::Nccl) {
      NcclOptions nccl;
      nccl.rank = rank;
      nccl.world_size = world_size;
      nccl.device = options.device.is_cuda() ? options.device
                                             : Device::cuda(env.local_rank < 0 ? 0 : env.local_rank);
      nccl.timeout = options.timeout;
      group = make_nccl_process_group(store, nccl);
      // The check's fingerprints stay on the host (Note [Host fingerprints]).
      const std::string fingerprints_prefix = "check-fingerprints/" + std::to_string(groups_initialised) + "/";
      if (check_collectives) {
        try {
          fingerprint_group = make_host_fingerprint_group(store, fingerprints_prefix, rank, world_size,
                                                          master.host, store->port(), options.timeout);
        } catch (const DistError& e) {
          // A refusal by the store (a twin rank, another world size) is the cause to report, as
          // the catch below does; anything else is said to come from the check's group.
          if (!store->refusal_note().empty()) {
            rethrow_if_refused(*store, e, rank, world_size);
            throw;
          }
          const std::string what = std::string(": the collective check's fingerprint group for NCCL (shared memory "
                                               "on one machine, Gloo across machines): ") +
                                   message_of(e) + "; NANODDP_CHECK_COLLECTIVES=0 goes without it";
          if (dynamic_cast<const TimeoutError*>(&e) != nullptr)
            NANODDP_THROW(TimeoutError, detail::where(rank, world_size), what);
          NANODDP_THROW(DistError, detail::where(rank, world_size), what);
        }
      }
    } else if (backend == Backend::Shm) {
      ShmOptions shm;
      shm.rank = rank;
      shm.world_size = world_size;
      shm.timeout = options.timeout;
      group = make_shm_process_group(store, shm);
    } else if (backend == Backend::ShmGloo) {
      NANODDP_CHECK(env.node_rank >= 0 && env.local_rank >= 0 && env.local_world_size > 0, ValueError,
                    detail::where(rank, world_size),
                    ": shm+gloo needs GROUP_RANK, LOCAL_RANK and LOCAL_WORLD_SIZE (nanoddp-run sets them)");
      TwoLevelOptions two;
      two.rank = rank;
      two.world_size = world_size;
      two.node_rank = env.node_rank;
      two.local_rank = env.local_rank;
      two.local_world_size = env.local_world_size;
      two.master_addr = master.host;
      two.master_port = store->port();
      two.timeout = options.timeout;
      group = make_two_level_process_group(store, two);
    } else {
      GlooOptions gloo;
      gloo.rank = rank;
      gloo.world_size = world_size;
      gloo.master_addr = master.host;
      gloo.master_port = store->port();
      gloo.timeout = options.timeout;
      gloo.fingerprints_over_shm = check_collectives;
      group = make_gloo_process_group(store, gloo);
    }
  } catch (const DistError& e) {
    // A rank refused by the store (a twin, another backend, another world size) may end this
    // rank's rendezvous by a path other than a store wait (a shared segment its creator has
    // already unlinked, a peer's socket gone): the refusal is the cause to report.
    rethrow_if_refused(*store, e, rank, world_size);
    throw;
  }
  // A CPU group takes CUDA tensors too (dist/host_staging.h); then the collective check.
  default_group = checked(stage_device_tensors(group, options.timeout), check_collectives, options.timeout, fingerprint_group);
  ++groups_initialised;
  joining.joined = true;  // the group is up; reported as `joining` goes out of scope
  register_exit_handler();
  join_trace(*default_group, store.get());
  return default_group;
}

std::shared_ptr<ProcessGroup> default_process_group() {
  std::lock_guard<std::mutex> lock(default_mutex);
  NANODDP_CHECK(default_group != nullptr, DistError, detail::where(-1, -1),
                ": no default process group; call init_process_group first");
  return default_group;
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(default_mutex);
  return default_group != nullptr;
}

void destroy_process_group() {
  std::shared_ptr<ProcessGroup> group;
  {
    std::lock_guard<std::mutex> lock(default_mutex);
    group = std::move(default_group);
    default_group = nullptr;
  }
  // group (and its store) is destroyed here, outside the lock, unless a DDP still holds it.
}

void detail::register_exit_handler_after_cuda() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::atexit([] { destroy_process_group(); });
    after_cuda_registered.store(true);
  });
}
bool detail::exit_handler_after_cuda_registered() { return after_cuda_registered.load(); }

int get_rank() { return default_process_group()->rank(); }
int get_world_size() { return default_process_group()->size(); }

int get_local_rank() {
  int local_rank = read_launch_env().local_rank;
  return local_rank < 0 ? 0 : local_rank;
}

}  // namespace nanoddp::dist
