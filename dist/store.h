// Store: the key-value rendezvous every rank meets at before any collective runs.
//
//   TCPStore store({"10.0.0.1", 29500, /*is_server=*/rank == 0, 4, rank});
//   store.set("nccl/unique_id", bytes);            // rank 0
//   auto id = store.get("nccl/unique_id");         // every rank; waits up to the timeout
//
// Follows PyTorch's c10d::TCPStore: rank 0 serves the store at MASTER_ADDR:MASTER_PORT (a
// thread of its own), every rank (rank 0 included) is a client. Values are opaque bytes;
// add() keeps a decimal int64 counter, so get() of a counter returns its digits.
//
// Contract: every verb that can block takes at most the store's timeout and then throws
// TimeoutError; a dead or foreign server gives DistError. Every length read from the wire is
// checked against kMaxKeyBytes / kMaxValueBytes / kMaxKeysPerRequest before anything is
// allocated (see Note [Store wire format] in store_wire.cpp), so a stray client (a port scanner,
// an HTTP request) is dropped by the server and a stray server is reported by the client.
// Every message names the store's host:port and the rank, world size and host it runs on.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace nanoddp::dist {

// The abstract verbs, so a ProcessGroup can be given any store (tests use TCPStore too).
class Store {
 public:
  virtual ~Store() = default;
  // Sets key to value, waking every wait() on key. Overwrites an existing value.
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // The value of key, waiting up to timeout() for some rank to set it
  // (torch.distributed.Store.get). Throws TimeoutError naming the key.
  virtual std::vector<uint8_t> get(const std::string& key) = 0;
  // Adds delta to the int64 counter at key (absent = 0) and returns the new value
  // (torch.distributed.Store.add). Throws DistError if key holds something not a counter.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Returns once every key is set; throws TimeoutError naming the missing keys after
  // timeout (torch.distributed.Store.wait). TCPStore throws DistError at once instead when
  // the server has refused a rank of another world size: the job cannot complete.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }
  // True when every key is set; never blocks on other ranks (torch.distributed.Store.check).
  virtual bool check(const std::vector<std::string>& keys) = 0;

  // The default timeout of get() and wait().
  virtual std::chrono::milliseconds timeout() const = 0;
  // True when the process that serves this store runs on this machine and is stopped
  // (SIGSTOP, Ctrl-Z, a debugger): it will not answer. Never blocks.
  virtual bool server_stopped() const { return false; }

  void set(const std::string& key, const std::string& value) {
    set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get_string(const std::string& key) {
    auto bytes = get(key);
    return std::string(bytes.begin(), bytes.end());
  }
};

// Limits on what one request or reply may carry. Keys are short names; the largest value the
// library stores is a Gloo address or an NCCL unique id (128 bytes), so 16 MiB is generous.
constexpr uint32_t kMaxKeyBytes = 4096;
constexpr uint32_t kMaxValueBytes = 16u << 20;
constexpr uint32_t kMaxKeysPerRequest = 4096;

// How long a client retries connecting in silence before it prints one line on stderr saying
// what it waits for (rank 0 not started, wrong MASTER_ADDR/PORT): the default timeout is
// minutes, and a job that prints nothing for minutes looks hung.
inline constexpr std::chrono::milliseconds kStoreConnectNoticeAfter = std::chrono::seconds(10);

struct TCPStoreOptions {
  std::string host = "127.0.0.1";  // the server's address (MASTER_ADDR); clients connect here
  int port = 29500;                // MASTER_PORT; 0 on the server picks a free port (see port())
  bool is_server = false;          // true on exactly one rank (rank 0): it binds the port
  // This client's rank and world size (-1: not a rank). The server refuses a rank of another
  // world size, and a second process claiming a rank that another holds (Note [Store wire
  // format] in store_wire.cpp); messages name them.
  int world_size = -1;
  int rank = -1;
  // How long get()/wait() wait, and how long a client keeps retrying to connect while the
  // server is not up yet.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  // After this long without a connection the client prints, once, "rank 1/2 on host: still
  // waiting for the store at 10.0.0.1:29500 (served by rank 0; ...); giving up after 300 s".
  std::chrono::milliseconds connect_notice_after = kStoreConnectNoticeAfter;
  // Who may use the store (Note [Store wire format] in store_wire.cpp). The server refuses a client
  // whose job id differs ("this store serves job X, not Y": two jobs on one port) or whose
  // token differs (a stranger); "" on the server turns that check off. At most 256 bytes each.
  // init_process_group takes them from NANODDP_JOB_ID and NANODDP_STORE_TOKEN.
  std::string job_id;
  std::string token;
  // Which start of the group this is (NANODDP_RESTART_COUNT, Note [Restart rounds] in
  // launch.cpp), 0..INT_MAX. The server admits only clients of its own round: a client of an
  // older round gets DistError at once; one of a newer round reached the old group's server,
  // which is about to go, and connects again until `timeout` (then TimeoutError).
  int round = 0;
  // Which default group of this process this is: init_process_group numbers the groups it made
  // 0, 1, ... (a call that threw makes none; a program may destroy_process_group() and init
  // again, on the same MASTER_PORT). Ordered
  // after `round` and treated like it: the server admits only its own generation; a client of
  // an older one gets DistError at once; a client of a newer one reached the server of the
  // group rank 0 has not yet destroyed, and connects again until `timeout`.
  int generation = 0;
  // The server listens on `host`'s address only (it must be an address of this machine); true:
  // on every interface, as PyTorch's TCPStore always does.
  bool listen_on_all_interfaces = false;
};

// A TCP store (PyTorch's TCPStore). The server side runs a poll() loop on one thread; clients
// are blocking sockets guarded by a mutex, so one TCPStore may be shared by threads.
// Unlike PyTorch's TCPStore, which listens on every interface and serves any client that
// connects, it listens on the master address only and admits only its job's ranks (job id
// and secret token in the hello; see TCPStoreOptions).
// Errors: DistError when the port is in use ("MASTER_PORT 29500 is already in use on host"),
// when `host` is not an address of the server's machine, when the server refuses this client
// (another job's store; no or wrong token), when the server (rank 0) closes the connection
// ("lost rank 0 (pid 4242 on node7)"),
// at once when the host cannot be resolved (an unknown name: EAI_NONAME, EAI_FAIL, ...; only a
// temporary resolver failure, EAI_AGAIN, is retried), or when the peer breaks the protocol;
// TimeoutError when the server cannot be reached within timeout (refused connections are
// retried: rank 0 may not be listening yet).
class TCPStore : public Store {
 public:
  explicit TCPStore(const TCPStoreOptions& options);
  ~TCPStore() override;
  TCPStore(const TCPStore&) = delete;
  TCPStore& operator=(const TCPStore&) = delete;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  using Store::set;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  using Store::wait;
  bool check(const std::vector<std::string>& keys) override;
  std::chrono::milliseconds timeout() const override { return options_.timeout; }
  bool server_stopped() const override;
  // The server's refusal note (why it refused a rank of this job: Note [Store wire format]),
  // or "" when there is none, or no answer within a second. For a look at the store after an
  // error: reports no lost peer to the launcher; never throws.
  std::string refusal_note();

  int port() const { return port_; }  // the bound port (the real one when options.port == 0)
  const std::string& host() const { return options_.host; }
  // Server only: how many connections the server dropped for breaking the protocol.
  int64_t rejected_connections() const;

 private:
  class Server;
  class Client;
  // One GET, answered at once (kOk with *value, or kMissing), within reply_timeout; report_loss
  // as Client::request's.
  uint8_t get_now(const std::string& key, std::chrono::milliseconds reply_timeout, std::vector<uint8_t>* value,
                  bool report_loss);

  TCPStoreOptions options_;
  int port_ = 0;
  std::unique_ptr<Server> server_;
  std::unique_ptr<Client> client_;
};

}  // namespace nanoddp::dist
