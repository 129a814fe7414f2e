// TCPStore: a poll() server on rank 0 and a blocking client on every rank.
//
// Note [Store wire format]
// Integers are little-endian, as on every host we build for (x86-64, AArch64).
//   1. The client connects and sends a hello: u32 kMagic ("NDDP"), u32 kVersion, str job_id,
//      str token (each <= kMaxIdentityBytes), i32 rank, i32 world_size (-1: not a rank).
//   2. The server answers u32 kMagic, u32 kVersion, then one status byte:
//        kWelcome   then u32 server pid, str server host: the verbs may follow;
//        kWrongJob  then str the server's job id: another job's rank reached this store;
//        kBadToken  nothing: the client does not know the job's secret token;
//        kWrongWorld then u32 the server's world size: a rank of this job with another world
//                   size (nodes started with different --nproc-per-node); the server also
//                   keeps the refusal under kRefusedKey, which a rank's timed-out wait quotes.
//      After a refusal, and after a wrong magic or version, the server closes the connection,
//      so a port scanner, an HTTP client, a stranger without the token or another job's rank
//      never reaches the verbs (no key can be read or written), and a client that reached
//      something other than its job's store says which of these it met. The job id is checked
//      first and is not secret; the token is compared in constant time. Empty on the server
//      means "no check" (a store built without a job id or token accepts any).
//   3. Each request is one verb byte and its fields; each gets exactly one reply:
//        SET   str key, bytes value             -> u8 kOk
//        GET   str key                          -> u8 kOk, bytes value | u8 kMissing
//        ADD   str key, i64 delta               -> u8 kOk, i64 value   | u8 kNotCounter
//        CHECK u32 n, n * str key               -> u8 kOk (all set)    | u8 kMissing
//        WAIT  u32 n, n * str key, u64 timeout_ms -> u8 kOk | u8 kTimeout | u8 kJobBroken
//      str = u32 length <= kMaxKeyBytes, then bytes; bytes = u32 length <= kMaxValueBytes,
//      then bytes; n <= kMaxKeysPerRequest. A length over its limit is a protocol error at
//      once, before any byte of the body is awaited or allocated.
//      ADD answers u8 kOverflow when the sum would not fit in int64.
//      WAIT answers u8 kJobBroken, at once and to every pending WAIT, once the server has
//      refused a rank for another world size: that rank's keys will never come, and the
//      waiters learn why from kRefusedKey instead of sitting out their timeout.
//   4. WAIT's deadline is kept by the server (it answers kTimeout when it passes), so a
//      client never abandons a request half-way and the stream stays in step.
#include "dist/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/error.h"
#include "dist/detail.h"
#include "dist/launcher_link.h"
#include "dist/store_wire.h"

namespace nanoddp::dist {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x5044444E;  // bytes 'N' 'D' 'D' 'P'
constexpr uint32_t kVersion = 3;  // 2: the hello carries the job id and the token; 3: the rank and world size
constexpr uint32_t kMaxIdentityBytes = 256;  // a job id or a token in the hello

enum Hello : uint8_t { kWelcome = 0, kWrongJob = 1, kBadToken = 2, kWrongWorld = 3 };
// Where the server notes the ranks it refused for another world size (Note [Store wire format]).
const char* const kRefusedKey = "nanoddp/refused";
// Where it notes the rank of every client it admitted ("0,1,3,"), so that a wait that times out
// can name the ranks that never reached the store rather than a key only the backend knows.
const char* const kArrivedKey = "nanoddp/arrived";
// Where it notes the ranks claimed by clients of this job id that it refused for their token:
// a hint for a timeout (a node given another NANODDP_STORE_TOKEN), never a reason to stop,
// since a client without the token is not trusted.
const char* const kBadTokenKey = "nanoddp/bad_token";

enum Status : uint8_t { kOk = 0, kMissing = 1, kNotCounter = 2, kTimeout = 3, kOverflow = 4, kJobBroken = 5 };

// How long past a WAIT's own deadline a client gives the server to answer before it calls the
// server dead.
constexpr std::chrono::milliseconds kReplyGrace{10000};

// Note [Store drain]
// The server lives in rank 0's process and goes when rank 0's store does, often as rank 0
// returns from main. Its peers may still be one request behind: in a barrier (set my key,
// then wait for everyone's), rank 0's wait is answered by the last peer's set, and rank 0 can
// be gone before that peer's own wait arrives. The kernel then resets the connection and
// the peer fails in a barrier that every rank passed (one run in three, 2 ranks on shm).
// So a stopping server stops accepting and drains: it keeps answering its open connections
// until every peer has closed its own (its process ended or destroyed its store), or none
// has sent anything for kDrainQuiet, or kDrainLimit has passed. A peer that asks later than
// that meets a closed connection, and is told it lost the process that serves the store.
constexpr std::chrono::milliseconds kDrainQuiet{500};
constexpr std::chrono::milliseconds kDrainLimit{5000};

void put_u8(std::vector<uint8_t>& out, uint8_t v) { out.push_back(v); }
void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_u64(std::vector<uint8_t>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_bytes(std::vector<uint8_t>& out, const uint8_t* data, size_t n) {
  put_u32(out, static_cast<uint32_t>(n));
  out.insert(out.end(), data, data + n);
}
void put_str(std::vector<uint8_t>& out, const std::string& s) {
  put_bytes(out, reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// Reads fields from a byte buffer that may hold only part of a message. A read past the end
// sets need_more; a length over its limit sets error. Both stop all later reads.
struct Reader {
  Reader(const uint8_t* bytes, size_t nbytes) : data(bytes), size(nbytes) {}
  const uint8_t* data;
  size_t size;
  size_t pos = 0;
  bool need_more = false;
  std::string error;

  bool ok() const { return !need_more && error.empty(); }
  bool take(size_t n) {
    if (!ok()) return false;
    if (size - pos < n) {
      need_more = true;
      return false;
    }
    return true;
  }
  uint64_t uint(int nbytes) {
    if (!take(nbytes)) return 0;
    uint64_t v = 0;
    for (int i = 0; i < nbytes; ++i) v |= static_cast<uint64_t>(data[pos + i]) << (8 * i);
    pos += nbytes;
    return v;
  }
  std::string blob(uint32_t limit, const char* what) {
    uint32_t n = static_cast<uint32_t>(uint(4));
    if (!ok()) return {};
    if (n > limit) {
      error = std::string(what) + " of " + std::to_string(n) +
              " bytes exceeds the limit of " + std::to_string(limit);
      return {};
    }
    if (!take(n)) return {};
    std::string s(reinterpret_cast<const char*>(data + pos), n);
    pos += n;
    return s;
  }
};

}  // namespace

StoreDecode decode_store_request(const uint8_t* bytes, size_t nbytes, StoreRequest& request, size_t& consumed,
                                 std::string& error) {
  Reader r{bytes, nbytes};
  request = StoreRequest{};
  request.verb = static_cast<uint8_t>(r.uint(1));
  switch (request.verb) {
    case kSet:
      request.keys.push_back(r.blob(kMaxKeyBytes, "key"));
      request.value = r.blob(kMaxValueBytes, "value");
      break;
    case kGet:
      request.keys.push_back(r.blob(kMaxKeyBytes, "key"));
      break;
    case kAdd:
      request.keys.push_back(r.blob(kMaxKeyBytes, "key"));
      request.delta = static_cast<int64_t>(r.uint(8));
      break;
    case kCheck:
    case kWait: {
      const auto n = static_cast<uint32_t>(r.uint(4));
      if (r.ok() && n > kMaxKeysPerRequest)
        r.error = "a request for " + std::to_string(n) + " keys exceeds the limit of " +
                  std::to_string(kMaxKeysPerRequest);
      for (uint32_t i = 0; i < n && r.ok(); ++i) request.keys.push_back(r.blob(kMaxKeyBytes, "key"));
      if (request.verb == kWait) request.timeout_ms = r.uint(8);
      break;
    }
    default:
      if (r.ok()) r.error = "unknown verb " + std::to_string(request.verb);
  }
  if (!r.error.empty()) {
    error = r.error;
    return StoreDecode::kError;
  }
  if (r.need_more) return StoreDecode::kNeedMore;
  consumed = r.pos;
  return StoreDecode::kRequest;
}

CounterAdd add_to_counter(const std::vector<uint8_t>* stored, int64_t delta, int64_t& value) {
  int64_t counter = 0;
  if (stored != nullptr) {
    const std::string text(stored->begin(), stored->end());
    if (text.empty() || text.size() > 20) return CounterAdd::kNotCounter;
    char* end = nullptr;
    errno = 0;
    const long long parsed = std::strtoll(text.c_str(), &end, 10);
    if (errno != 0 || end != text.c_str() + text.size()) return CounterAdd::kNotCounter;
    counter = parsed;
  }
  if (__builtin_add_overflow(counter, delta, &counter)) return CounterAdd::kOverflow;
  value = counter;
  return CounterAdd::kOk;
}

namespace {

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void set_nonblocking(int fd, bool on) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

// a == b in a time that depends on the lengths only, so a wrong token's timing tells nothing
// about how much of it was right.
bool same_secret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

// ---- server ------------------------------------------------------------------------------

class TCPStore::Server {
 public:
  Server(const TCPStoreOptions& options, const std::string& context)
      : context_(context), job_id_(options.job_id), token_(options.token), world_size_(options.world_size) {
    listen_ = bind_listen(options.listen_on_all_interfaces ? std::string() : options.host, options.port);
    int fds[2];
    NANODDP_CHECK(::pipe(fds) == 0, DistError, context_, ": store: pipe: ",
                  detail::errno_text(errno));
    wake_read_ = detail::Fd(fds[0]);
    wake_write_ = detail::Fd(fds[1]);
    thread_ = std::thread([this] { loop(); });
  }

  ~Server() {
    stop_ = true;
    char byte = 1;
    [[maybe_unused]] auto n = ::write(wake_write_.get(), &byte, 1);
    thread_.join();
  }

  int port() const { return port_; }
  int64_t rejected() const { return rejected_.load(); }

 private:
  struct Conn {
    detail::Fd fd;
    std::vector<uint8_t> in;
    std::vector<uint8_t> out;
    bool greeted = false;
  };
  struct Waiter {
    int conn;  // the connection's fd, unique while it is open
    std::vector<std::string> keys;
    Clock::time_point deadline;
  };

  // Listens on `host`'s address (the first of its addresses that this machine has), or on every
  // interface when host is "". IPv6 "any" with v4-mapped addresses accepts both families.
  detail::Fd bind_listen(const std::string& host, int port) {
    std::vector<sockaddr_storage> addresses;
    std::vector<socklen_t> lengths;
    if (host.empty()) {
      sockaddr_in6 any6{};
      any6.sin6_family = AF_INET6;
      any6.sin6_addr = in6addr_any;
      sockaddr_in any4{};
      any4.sin_family = AF_INET;
      any4.sin_addr.s_addr = htonl(INADDR_ANY);
      for (const sockaddr* a : {reinterpret_cast<const sockaddr*>(&any6), reinterpret_cast<const sockaddr*>(&any4)}) {
        sockaddr_storage storage{};
        const socklen_t len = a->sa_family == AF_INET6 ? sizeof(any6) : sizeof(any4);
        std::memcpy(&storage, a, len);
        addresses.push_back(storage);
        lengths.push_back(len);
      }
    } else {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* found = nullptr;
      const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
      NANODDP_CHECK(rc == 0, DistError, context_, ": store: cannot resolve the master address '", host,
                    "' to listen on: ", gai_strerror(rc));
      for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
        sockaddr_storage storage{};
        std::memcpy(&storage, a->ai_addr, a->ai_addrlen);
        addresses.push_back(storage);
        lengths.push_back(a->ai_addrlen);
      }
      ::freeaddrinfo(found);
    }
    detail::Fd fd;
    int rc = -1, err = 0;
    for (size_t i = 0; i < addresses.size() && rc != 0; ++i) {
      sockaddr_storage& addr = addresses[i];
      fd = detail::Fd(::socket(addr.ss_family, SOCK_STREAM, 0));
      if (!fd.valid()) {
        err = errno;
        continue;
      }
      int one = 1, zero = 0;
      // SO_REUSEADDR lets a new job bind while an old connection lingers in TIME_WAIT; a port
      // that another process listens on still fails, which is what we want to report.
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (addr.ss_family == AF_INET6) {
        ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
        reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = htons(static_cast<uint16_t>(port));
      } else {
        reinterpret_cast<sockaddr_in*>(&addr)->sin_port = htons(static_cast<uint16_t>(port));
      }
      rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), lengths[i]);
      if (rc != 0) err = errno;
      if (rc != 0 && err == EADDRINUSE) break;  // the port is taken: no other address will do
    }
    NANODDP_CHECK(fd.valid(), DistError, context_, ": store: socket: ", detail::errno_text(err));
    if (rc != 0) {
      NANODDP_CHECK(err != EADDRNOTAVAIL, DistError, context_, ": store: the master address '", host,
                    "' is not an address of ", detail::host_name(),
                    " (rank 0 serves the store there); set MASTER_ADDR / --master-addr to one of its addresses, "
                    "or NANODDP_STORE_LISTEN_ALL=1 to listen on every interface (behind NAT)");
      NANODDP_CHECK(err != EADDRINUSE, DistError, context_, ": MASTER_PORT ", port,
                    " is already in use on ", detail::host_name(),
                    " (another job or an earlier run still holds it); choose another port, "
                    "or 0 to let the launcher pick a free one");
      NANODDP_THROW(DistError, context_, ": store: bind to port ", port, ": ",
                    detail::errno_text(err));
    }
    // Two stores binding one port at once may both succeed (SO_REUSEADDR, neither listening
    // yet); the second then finds the port taken here, which is the same user error as above.
    if (::listen(fd.get(), 1024) != 0) {
      err = errno;
      NANODDP_CHECK(err != EADDRINUSE, DistError, context_, ": MASTER_PORT ", port, " is already in use on ",
                    detail::host_name(),
                    " (another job took it while this store was starting); choose another port, "
                    "or 0 to let the launcher pick a free one");
      NANODDP_THROW(DistError, context_, ": store: listen on port ", port, ": ", detail::errno_text(err));
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = ntohs(bound.ss_family == AF_INET6
                      ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                      : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    set_nonblocking(fd.get(), true);
    return fd;
  }

  void loop() {
    std::vector<pollfd> fds;
    // Set once stop_ is seen (Note [Store drain]).
    bool draining = false;
    Clock::time_point drain_end, quiet_end;
    while (true) {
      if (stop_ && !draining) {
        draining = true;
        listen_ = detail::Fd();  // no new connections
        drain_end = Clock::now() + kDrainLimit;
        quiet_end = Clock::now() + kDrainQuiet;
      }
      if (draining) {
        const bool unsent = std::any_of(conns_.begin(), conns_.end(), [](const auto& c) { return !c.second.out.empty(); });
        const Clock::time_point now = Clock::now();
        if (conns_.empty() || now >= drain_end || (now >= quiet_end && !unsent)) break;
      }
      fds.clear();
      // While draining, the wake pipe stays readable (stop_ wrote to it) and the listening
      // socket is closed: both are left out, and the connections follow at index 2 as always.
      fds.push_back({draining ? -1 : wake_read_.get(), POLLIN, 0});
      fds.push_back({draining ? -1 : listen_.get(), POLLIN, 0});
      for (auto& [id, conn] : conns_) {
        short events = POLLIN;
        if (!conn.out.empty()) events |= POLLOUT;
        fds.push_back({id, events, 0});
      }
      int timeout_ms = -1;
      if (!waiters_.empty()) {
        auto next = std::min_element(waiters_.begin(), waiters_.end(),
                                     [](const Waiter& a, const Waiter& b) {
                                       return a.deadline < b.deadline;
                                     })->deadline;
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now());
        timeout_ms = static_cast<int>(std::max<int64_t>(0, left.count()) + 1);
      }
      if (draining) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(std::min(drain_end, quiet_end) - Clock::now());
        const int drain_ms = static_cast<int>(std::max<int64_t>(0, left.count()) + 1);
        timeout_ms = timeout_ms < 0 ? drain_ms : std::min(timeout_ms, drain_ms);
      }
      int n = ::poll(fds.data(), fds.size(), timeout_ms);
      if (n < 0 && errno != EINTR) break;  // cannot happen with valid fds; stop serving
      if (stop_ && !draining) continue;  // start draining first
      if (n > 0) {
        if (fds[1].revents & POLLIN) accept_all();
        for (size_t i = 2; i < fds.size(); ++i) {
          if (fds[i].revents == 0) continue;
          int id = fds[i].fd;
          if (!conns_.count(id)) continue;
          bool alive = true;
          if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
            alive = read_from(id);
            if (draining) quiet_end = Clock::now() + kDrainQuiet;  // a peer still talks
          }
          if (alive && (fds[i].revents & POLLOUT)) alive = flush(id);
          if (!alive) drop(id);
        }
      }
      expire_waiters();
    }
  }

  void accept_all() {
    while (true) {
      int fd = ::accept(listen_.get(), nullptr, nullptr);
      if (fd < 0) return;  // EAGAIN: no more; other errors: the client will retry
      set_nonblocking(fd, true);
      set_nodelay(fd);
      conns_[fd].fd = detail::Fd(fd);
    }
  }

  // Reads what is available and serves every complete request. False: close it.
  bool read_from(int id) {
    Conn& conn = conns_[id];
    uint8_t buf[65536];
    while (true) {
      ssize_t got = ::recv(id, buf, sizeof(buf), 0);
      if (got == 0) return false;
      if (got < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        if (errno == EINTR) continue;
        return false;
      }
      conn.in.insert(conn.in.end(), buf, buf + got);
      // A request is at most a few limits long; more buffered input than that without a
      // complete request means the peer is not speaking our protocol.
      if (conn.in.size() > size_t(kMaxValueBytes) + 2 * kMaxKeyBytes + 64) {
        ++rejected_;
        return false;
      }
    }
    while (true) {
      Reader r{conn.in.data(), conn.in.size()};
      bool alive = conn.greeted ? serve_one(id, r) : greet(conn, r);
      if (!r.error.empty() || !alive) {
        ++rejected_;
        // Best effort, before closing: what is queued (a refusal is a few bytes). What the peer
        // sent after it is read and dropped: closing a socket with unread input resets the
        // connection, and the client could lose the refusal.
        flush(id);
        ::shutdown(id, SHUT_WR);
        uint8_t unread[4096];
        while (::recv(id, unread, sizeof(unread), MSG_DONTWAIT) > 0) {
        }
        return false;
      }
      if (r.need_more) break;
      conn.in.erase(conn.in.begin(), conn.in.begin() + static_cast<std::ptrdiff_t>(r.pos));
      if (conn.in.empty()) break;
    }
    return flush(id);
  }

  // Step 2 of Note [Store wire format]. False: refused (the refusal is queued in conn.out).
  bool greet(Conn& conn, Reader& r) {
    uint32_t magic = static_cast<uint32_t>(r.uint(4));
    uint32_t version = static_cast<uint32_t>(r.uint(4));
    if (r.ok() && (magic != kMagic || version != kVersion)) return false;  // before any length
    std::string job_id = r.blob(kMaxIdentityBytes, "job id");
    std::string token = r.blob(kMaxIdentityBytes, "token");
    const auto rank = static_cast<int32_t>(r.uint(4)), world_size = static_cast<int32_t>(r.uint(4));
    if (!r.ok()) return true;
    put_u32(conn.out, kMagic);
    put_u32(conn.out, kVersion);
    if (!job_id_.empty() && job_id != job_id_) {
      put_u8(conn.out, kWrongJob);
      put_str(conn.out, job_id_);
    } else if (!token_.empty() && !same_secret(token, token_)) {
      put_u8(conn.out, kBadToken);
      append_note(kBadTokenKey, std::to_string(rank) + ",", 4096);
    } else if (world_size_ > 0 && world_size > 0 && world_size != world_size_) {
      put_u8(conn.out, kWrongWorld);
      put_u32(conn.out, static_cast<uint32_t>(world_size_));
      append_note(kRefusedKey,
                  std::string(data_.count(kRefusedKey) > 0 ? "; " : "") + "rank " + std::to_string(rank) +
                      " with WORLD_SIZE=" + std::to_string(world_size),
                  4096);
      fail_waiters(kJobBroken);
    } else {
      if (rank >= 0) append_note(kArrivedKey, std::to_string(rank) + ",", size_t(1) << 20);
      put_u8(conn.out, kWelcome);
      put_u32(conn.out, static_cast<uint32_t>(::getpid()));
      put_str(conn.out, detail::host_name());
      conn.greeted = true;
      return true;
    }
    return false;  // read_from sends the refusal and closes
  }

  // Serves the first request in r once it is complete. False: a protocol error.
  bool serve_one(int id, Reader& r) {
    StoreRequest request;
    size_t consumed = 0;
    switch (decode_store_request(r.data, r.size, request, consumed, r.error)) {
      case StoreDecode::kNeedMore:
        r.need_more = true;
        return true;
      case StoreDecode::kError:
        return false;
      case StoreDecode::kRequest:
        r.pos = consumed;
        break;
    }
    std::vector<uint8_t>& out = conns_[id].out;
    switch (request.verb) {
      case kSet:
        data_[request.keys[0]].assign(request.value.begin(), request.value.end());
        put_u8(out, kOk);
        wake_waiters();
        return true;
      case kGet: {
        auto it = data_.find(request.keys[0]);
        if (it == data_.end()) {
          put_u8(out, kMissing);
        } else {
          put_u8(out, kOk);
          put_bytes(out, it->second.data(), it->second.size());
        }
        return true;
      }
      case kAdd: {
        auto it = data_.find(request.keys[0]);
        int64_t value = 0;
        switch (add_to_counter(it == data_.end() ? nullptr : &it->second, request.delta, value)) {
          case CounterAdd::kNotCounter:
            put_u8(out, kNotCounter);
            return true;
          case CounterAdd::kOverflow:
            put_u8(out, kOverflow);
            return true;
          case CounterAdd::kOk:
            break;
        }
        std::string text = std::to_string(value);
        data_[request.keys[0]].assign(text.begin(), text.end());
        put_u8(out, kOk);
        put_u64(out, static_cast<uint64_t>(value));
        wake_waiters();
        return true;
      }
      default: {  // kCheck, kWait: decode_store_request admits no other verb
        bool ready = all_set(request.keys);
        if (request.verb == kCheck || ready) {
          put_u8(out, ready ? kOk : kMissing);
        } else if (data_.count(kRefusedKey) > 0) {
          put_u8(out, kJobBroken);
        } else {
          // Clamp so a huge timeout cannot overflow the clock.
          auto ms = std::chrono::milliseconds(std::min<uint64_t>(request.timeout_ms, uint64_t(1) << 40));
          waiters_.push_back({id, std::move(request.keys), Clock::now() + ms});
        }
        return true;
      }
    }
  }

  bool all_set(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(),
                       [this](const std::string& k) { return data_.count(k) > 0; });
  }

  void wake_waiters() {
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (all_set(it->keys)) {
        answer(it->conn, kOk);
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Appends to one of the server's own notes (kRefusedKey, kArrivedKey, kBadTokenKey) while it
  // holds fewer than max_bytes: clients flooding the hello cannot grow it without bound.
  void append_note(const char* key, const std::string& text, size_t max_bytes) {
    std::vector<uint8_t>& note = data_[key];
    if (note.size() < max_bytes) note.insert(note.end(), text.begin(), text.end());
  }

  void fail_waiters(Status status) {
    for (const Waiter& w : waiters_) answer(w.conn, status);
    waiters_.clear();
  }

  void expire_waiters() {
    auto now = Clock::now();
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->deadline <= now) {
        answer(it->conn, kTimeout);
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void answer(int id, Status status) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    put_u8(it->second.out, status);
    if (!flush(id)) drop(id);
  }

  // Sends what the socket takes now; the rest waits for POLLOUT. False: the peer is gone.
  bool flush(int id) {
    Conn& conn = conns_[id];
    size_t sent = 0;
    while (sent < conn.out.size()) {
      ssize_t n = ::send(id, conn.out.data() + sent, conn.out.size() - sent, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        if (errno == EINTR) continue;
        return false;
      }
      sent += static_cast<size_t>(n);
    }
    conn.out.erase(conn.out.begin(), conn.out.begin() + static_cast<std::ptrdiff_t>(sent));
    return true;
  }

  void drop(int id) {
    waiters_.erase(std::remove_if(waiters_.begin(), waiters_.end(),
                                  [id](const Waiter& w) { return w.conn == id; }),
                   waiters_.end());
    conns_.erase(id);
  }

  std::string context_;
  std::string job_id_, token_;  // empty: not checked
  int world_size_;              // < 1: not checked
  detail::Fd listen_, wake_read_, wake_write_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> rejected_{0};
  std::map<int, Conn> conns_;
  std::vector<Waiter> waiters_;
  std::map<std::string, std::vector<uint8_t>> data_;
  std::thread thread_;  // last: starts after every member above exists
};

// ---- client ------------------------------------------------------------------------------

class TCPStore::Client {
 public:
  Client(const TCPStoreOptions& options, int port, const std::string& context)
      : context_(context + ": store " + options.host + ":" + std::to_string(port)), rank_(options.rank) {
    connect(options.host, port, options.timeout, options.connect_notice_after, context);
    hello(options);
  }

  // Sends one request and returns its status byte; reply_tail(status, deadline) reads the
  // rest of the reply, which depends on the status.
  template <typename Tail>
  uint8_t request(const std::vector<uint8_t>& message, std::chrono::milliseconds reply_timeout,
                  const char* verb, Tail&& reply_tail) {
    std::lock_guard<std::mutex> lock(mutex_);
    NANODDP_CHECK(fd_.valid(), DistError, context_, ": ", verb,
                  " after an earlier failure broke the connection");
    auto deadline = Clock::now() + reply_timeout;
    try {
      send_all(message, verb);
      uint8_t status = 0;
      recv_exact(&status, 1, deadline, verb);
      reply_tail(status, deadline);
      return status;
    } catch (...) {
      fd_.reset();  // a half-read reply would put the stream out of step: never reuse it
      throw;
    }
  }

  uint64_t recv_u64(Clock::time_point deadline, const char* verb) {
    uint8_t b[8];
    recv_exact(b, 8, deadline, verb);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(b[i]) << (8 * i);
    return v;
  }

  std::vector<uint8_t> recv_bytes(Clock::time_point deadline, const char* verb) {
    uint8_t b[4];
    recv_exact(b, 4, deadline, verb);
    uint32_t n = uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
    NANODDP_CHECK(n <= kMaxValueBytes, DistError, context_, ": ", verb, ": the server sent a ",
                  n, "-byte value, over the limit of ", kMaxValueBytes,
                  " bytes; is the peer a nanoddp store?");
    std::vector<uint8_t> value(n);
    recv_exact(value.data(), n, deadline, verb);
    return value;
  }

  const std::string& context() const { return context_; }

 private:
  void connect(const std::string& host, int port, std::chrono::milliseconds timeout,
               std::chrono::milliseconds notice_after, const std::string& where) {
    const auto started = Clock::now();
    auto deadline = started + timeout;
    bool noticed = false;
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    std::string last_error = "no attempt";
    // Ranks usually start a few milliseconds before rank 0 listens: a short, capped backoff
    // keeps a job's start fast (a refused connect costs microseconds), while still not
    // spinning when rank 0 is slow to come up.
    constexpr auto kMaxBackoff = std::chrono::milliseconds(10);
    auto backoff = std::chrono::milliseconds(1);
    while (true) {
      addrinfo* found = nullptr;
      int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
      if (rc != 0) {
        // Only EAI_AGAIN ("temporary failure in name resolution") may heal by waiting; an
        // unknown name (EAI_NONAME), a permanent DNS failure (EAI_FAIL) and the rest would
        // only make the job sit silent for the whole timeout.
        NANODDP_CHECK(rc == EAI_AGAIN, DistError, context_, ": cannot resolve the store host '", host,
                      "' (MASTER_ADDR / --master-addr): ", gai_strerror(rc));
        last_error = std::string("cannot resolve host: ") + gai_strerror(rc);
      } else {
        for (addrinfo* a = found; a != nullptr && !fd_.valid(); a = a->ai_next) {
          detail::Fd fd(::socket(a->ai_family, a->ai_socktype, a->ai_protocol));
          if (!fd.valid()) continue;
          if (connect_before(fd.get(), a->ai_addr, a->ai_addrlen, deadline, last_error)) {
            fd_ = std::move(fd);
          }
        }
        ::freeaddrinfo(found);
      }
      if (fd_.valid()) break;
      // The server (rank 0) may not be listening yet: retry until the timeout.
      auto now = Clock::now();
      NANODDP_CHECK(now < deadline, TimeoutError, context_, ": could not connect within ",
                    timeout.count(), " ms (last error: ", last_error,
                    "); is rank 0 running and MASTER_ADDR/MASTER_PORT right?");
      if (!noticed && now - started >= notice_after) {
        noticed = true;  // once: a line per retry would bury the ranks' own output
        const auto limit = timeout.count() % 1000 == 0 ? std::to_string(timeout.count() / 1000) + " s"
                                                       : std::to_string(timeout.count()) + " ms";
        const std::string line = where + ": still waiting for the store at " + host + ":" + std::to_string(port) +
                                 " (served by rank 0; last error: " + last_error + "); giving up after " + limit + "\n";
        ssize_t ignored = ::write(2, line.data(), line.size());  // one write: lines of ranks never interleave
        (void)ignored;
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
      backoff = std::min(backoff * 2, kMaxBackoff);
    }
    set_nodelay(fd_.get());
  }

  // Steps 1-2 of Note [Store wire format].
  void hello(const TCPStoreOptions& options) {
    NANODDP_CHECK(options.job_id.size() <= kMaxIdentityBytes && options.token.size() <= kMaxIdentityBytes,
                  ValueError, context_, ": a job id or token longer than ", kMaxIdentityBytes, " bytes");
    std::vector<uint8_t> message;
    put_u32(message, kMagic);
    put_u32(message, kVersion);
    put_str(message, options.job_id);
    put_str(message, options.token);
    put_u32(message, static_cast<uint32_t>(options.rank));
    put_u32(message, static_cast<uint32_t>(options.world_size));
    send_all(message, "hello");
    const auto deadline = Clock::now() + std::min(options.timeout, kReplyGrace);
    uint8_t reply[8];
    try {
      recv_exact(reply, sizeof(reply), deadline, "hello");
    } catch (const TimeoutError&) {
      throw;
    } catch (const DistError&) {
      report_lost_peer(rank_, 0);  // blamed only if rank 0 failed too (Note [Launcher link])
      NANODDP_THROW(DistError, context_, ": the store closed the connection before answering the hello: rank 0 "
                    "exited (see its error), or MASTER_PORT is served by an older nanoddp or another program");
    }
    Reader r{reply, sizeof(reply)};
    const auto magic = static_cast<uint32_t>(r.uint(4)), version = static_cast<uint32_t>(r.uint(4));
    NANODDP_CHECK(magic == kMagic && version == kVersion, DistError, context_,
                  ": the peer answered the hello with something other than a nanoddp store "
                  "(is MASTER_PORT used by another program?)");
    uint8_t status = 0;
    recv_exact(&status, 1, deadline, "hello");
    if (status == kWrongJob) {
      const std::string theirs = recv_identity(deadline);
      NANODDP_THROW(DistError, context_, ": refused: this store serves job '", theirs, "', not ",
                    options.job_id.empty() ? std::string("this rank's job, which has no id") : "this rank's job '" + options.job_id + "'",
                    " (NANODDP_JOB_ID): two jobs use MASTER_PORT ", options.port,
                    "; give each job its own --master-port, or 0 to pick a free one");
    }
    if (status == kWrongWorld) {
      uint8_t theirs[4];
      recv_exact(theirs, 4, deadline, "hello");
      NANODDP_THROW(DistError, context_, ": refused: this rank is in a job of WORLD_SIZE=", options.world_size,
                    ", but rank 0, which serves the store, has WORLD_SIZE=", Reader{theirs, 4}.uint(4),
                    ": every node must start the same number of ranks (nanoddp-run --nproc-per-node) and agree "
                    "on --nnodes");
    }
    NANODDP_CHECK(status != kBadToken, DistError, context_,
                  ": refused: this rank does not have the job's secret token (NANODDP_STORE_TOKEN ",
                  options.token.empty() ? "is not set" : "differs", "); nanoddp-run gives its ranks one; "
                  "under mpirun or srun export the same token to every rank");
    NANODDP_CHECK(status == kWelcome, DistError, context_, ": unexpected hello status ", int(status));
    uint8_t pid[4];
    recv_exact(pid, 4, deadline, "hello");
    server_pid_ = static_cast<int>(Reader{pid, 4}.uint(4));
    server_host_ = recv_identity(deadline);
  }

  std::string recv_identity(Clock::time_point deadline) {
    uint8_t b[4];
    recv_exact(b, 4, deadline, "hello");
    const auto n = static_cast<uint32_t>(Reader{b, 4}.uint(4));
    NANODDP_CHECK(n <= kMaxIdentityBytes, DistError, context_, ": hello: a ", n, "-byte name from the server, over "
                  "the limit of ", kMaxIdentityBytes, "; is the peer a nanoddp store?");
    std::string text(n, '\0');
    recv_exact(text.data(), n, deadline, "hello");
    return text;
  }

 public:
  // "rank 0 (pid 4242 on node7)": who serves the store, from its hello.
  std::string server() const {
    return "rank 0 (pid " + std::to_string(server_pid_) + " on " + server_host_ + ")";
  }

 private:

  static bool connect_before(int fd, const sockaddr* addr, socklen_t len,
                             Clock::time_point deadline, std::string& error) {
    set_nonblocking(fd, true);
    int rc = ::connect(fd, addr, len);
    if (rc != 0 && errno != EINPROGRESS) {
      error = detail::errno_text(errno);
      return false;
    }
    if (rc != 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      pollfd p{fd, POLLOUT, 0};
      int n = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(1, left.count())));
      if (n <= 0) {
        error = n == 0 ? "connect timed out" : detail::errno_text(errno);
        return false;
      }
      int err = 0;
      socklen_t err_len = sizeof(err);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &err_len);
      if (err != 0) {
        error = detail::errno_text(err);
        return false;
      }
    }
    set_nonblocking(fd, false);
    return true;
  }

  void send_all(const std::vector<uint8_t>& bytes, const char* verb) {
    size_t sent = 0;
    while (sent < bytes.size()) {
      ssize_t n = ::send(fd_.get(), bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      // A closed connection to rank 0's server: rank 0 is gone (Note [Launcher link]).
      const int error = errno;
      if (n < 0 && (error == EPIPE || error == ECONNRESET) && server_pid_ > 0) report_lost_peer(rank_, 0);
      NANODDP_CHECK(n > 0, DistError, context_, ": ", verb, ": send failed (",
                    detail::errno_text(error), "); the store server (rank 0) may have exited");
      sent += static_cast<size_t>(n);
    }
  }

  void recv_exact(void* out, size_t nbytes, Clock::time_point deadline, const char* verb) {
    auto* p = static_cast<uint8_t*>(out);
    size_t got = 0;
    while (got < nbytes) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      NANODDP_CHECK(left.count() > 0, TimeoutError, context_, ": ", verb,
                    ": no reply from the store server in time");
      pollfd pfd{fd_.get(), POLLIN, 0};
      int ready = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), 1 << 30)));
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) continue;  // the deadline check above reports it
      ssize_t n = ::recv(fd_.get(), p + got, nbytes - got, 0);
      if (n < 0 && errno == EINTR) continue;
      // A reset is a close too: the server's process ended with our request unread.
      if (n < 0 && errno == ECONNRESET) n = 0;
      if (n == 0 && server_pid_ > 0) {
        report_lost_peer(rank_, 0);  // Note [Launcher link]
        NANODDP_THROW(DistError, context_, ": ", verb, ": lost ", server(),
                      ", which serves the store: it closed the connection (it exited or failed)");
      }
      NANODDP_CHECK(n > 0, DistError, context_, ": ", verb, ": ",
                    n == 0 ? std::string("the store server closed the connection (rank 0 exited?)")
                           : "recv failed: " + detail::errno_text(errno));
      got += static_cast<size_t>(n);
    }
  }

  std::string context_;
  int rank_ = -1;
  int server_pid_ = 0;  // from the hello
  std::string server_host_;
  std::mutex mutex_;
  detail::Fd fd_;
};

// ---- TCPStore ----------------------------------------------------------------------------

TCPStore::TCPStore(const TCPStoreOptions& options) : options_(options) {
  NANODDP_CHECK(options.port >= 0 && options.port <= 65535, ValueError,
                detail::where(options.rank, options.world_size), ": store port ", options.port,
                " is not in 0..65535");
  NANODDP_CHECK(options.is_server || options.port != 0, ValueError,
                detail::where(options.rank, options.world_size),
                ": a store client needs the server's port, not 0");
  std::string context = detail::where(options.rank, options.world_size);
  port_ = options.port;
  if (options.is_server) {
    server_ = std::make_unique<Server>(options, context);
    port_ = server_->port();
  }
  client_ = std::make_unique<Client>(options, port_, context);
}

TCPStore::~TCPStore() {
  client_.reset();  // close our connection before the server stops
  server_.reset();
}

int64_t TCPStore::rejected_connections() const { return server_ ? server_->rejected() : 0; }

namespace {
void check_key(const std::string& context, const std::string& key) {
  NANODDP_CHECK(key.size() <= kMaxKeyBytes, ValueError, context, ": key of ", key.size(),
                " bytes exceeds the limit of ", kMaxKeyBytes);
}
}  // namespace

void TCPStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  check_key(client_->context(), key);
  NANODDP_CHECK(value.size() <= kMaxValueBytes, ValueError, client_->context(), ": set('", key,
                "'): value of ", value.size(), " bytes exceeds the limit of ", kMaxValueBytes);
  std::vector<uint8_t> msg;
  put_u8(msg, kSet);
  put_str(msg, key);
  put_bytes(msg, value.data(), value.size());
  uint8_t status = client_->request(msg, kReplyGrace + options_.timeout, "set", [](uint8_t, auto) {});
  NANODDP_CHECK(status == kOk, DistError, client_->context(), ": set('", key,
                "'): unexpected status ", int(status));
}

std::vector<uint8_t> TCPStore::get(const std::string& key) {
  wait({key}, options_.timeout);
  std::vector<uint8_t> msg;
  put_u8(msg, kGet);
  put_str(msg, key);
  std::vector<uint8_t> value;
  uint8_t status = client_->request(msg, kReplyGrace + options_.timeout, "get",
                                    [&](uint8_t st, Clock::time_point deadline) {
                                      if (st == kOk) value = client_->recv_bytes(deadline, "get");
                                    });
  NANODDP_CHECK(status == kOk, DistError, client_->context(), ": get('", key,
                "'): unexpected status ", int(status));
  return value;
}

int64_t TCPStore::add(const std::string& key, int64_t delta) {
  check_key(client_->context(), key);
  std::vector<uint8_t> msg;
  put_u8(msg, kAdd);
  put_str(msg, key);
  put_u64(msg, static_cast<uint64_t>(delta));
  int64_t value = 0;
  uint8_t status = client_->request(msg, kReplyGrace + options_.timeout, "add",
                                    [&](uint8_t st, Clock::time_point deadline) {
                                      if (st == kOk)
                                        value = static_cast<int64_t>(client_->recv_u64(deadline, "add"));
                                    });
  NANODDP_CHECK(status != kNotCounter, DistError, client_->context(), ": add('", key,
                "'): the key holds a value that is not an int64 counter");
  NANODDP_CHECK(status != kOverflow, DistError, client_->context(), ": add('", key, "', ", delta,
                "): the counter would overflow int64");
  NANODDP_CHECK(status == kOk, DistError, client_->context(), ": add('", key,
                "'): unexpected status ", int(status));
  return value;
}

namespace {

// The ranks in a server's note ("0,1,3,"), each once.
std::set<int> ranks_in(const std::string& note) {
  std::set<int> ranks;
  size_t begin = 0;
  while (begin < note.size()) {
    const size_t comma = note.find(',', begin);
    const long rank = std::strtol(note.substr(begin, comma - begin).c_str(), nullptr, 10);
    if (rank >= 0 && rank <= INT_MAX) ranks.insert(static_cast<int>(rank));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return ranks;
}

// "rank 3" or "ranks 1, 2 and 7 more": the first few of a set of ranks.
std::string name_ranks(const std::vector<int>& ranks) {
  constexpr size_t kNamed = 8;
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < std::min(ranks.size(), kNamed); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > kNamed) text += " and " + std::to_string(ranks.size() - kNamed) + " more";
  return text;
}

// For a wait's timeout: the ranks in 0..world_size-1 missing from `arrived`, or, when all
// came, that one of them failed or is stuck before setting the key.
std::string who_is_missing(const std::string& arrived, int world_size) {
  if (world_size <= 0 || arrived.empty()) return "a rank did not arrive or failed before setting it";
  const std::set<int> seen = ranks_in(arrived);
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r)
    if (seen.count(r) == 0) missing.push_back(r);
  if (missing.empty())
    return "all " + std::to_string(world_size) + " ranks reached the store: one failed or is stuck before setting it";
  return name_ranks(missing) + " never reached the store: not started, or started with another MASTER_ADDR/MASTER_PORT";
}

}  // namespace

void TCPStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  NANODDP_CHECK(keys.size() <= kMaxKeysPerRequest, ValueError, client_->context(), ": wait on ",
                keys.size(), " keys exceeds the limit of ", kMaxKeysPerRequest);
  std::vector<uint8_t> msg;
  put_u8(msg, kWait);
  put_u32(msg, static_cast<uint32_t>(keys.size()));
  for (const auto& key : keys) {
    check_key(client_->context(), key);
    put_str(msg, key);
  }
  put_u64(msg, static_cast<uint64_t>(std::max<int64_t>(0, timeout.count())));
  uint8_t status = client_->request(msg, timeout + kReplyGrace, "wait", [](uint8_t, auto) {});
  std::string names;
  for (const auto& key : keys) names += (names.empty() ? "'" : ", '") + key + "'";
  if (status == kJobBroken) {
    std::string refused = "a rank";
    try {
      refused = get_string(kRefusedKey);
    } catch (const Error&) {  // the message goes out without it
    }
    NANODDP_THROW(DistError, client_->context(), ": wait for ", names, " cannot end: the store refused ", refused,
                  ", which does not match this job",
                  options_.world_size > 0 ? " (WORLD_SIZE=" + std::to_string(options_.world_size) + ")" : "",
                  ": every node must start the same number of ranks (nanoddp-run --nproc-per-node)");
  }
  if (status == kTimeout) {
    // No refusal to report here: the server answers every wait kJobBroken once it has one.
    std::string arrived, bad_token;
    try {
      if (check({kArrivedKey})) arrived = get_string(kArrivedKey);
      if (check({kBadTokenKey})) bad_token = get_string(kBadTokenKey);
    } catch (const Error&) {  // the message goes out without it
    }
    const std::set<int> claimed = ranks_in(bad_token);
    const std::string token_hint =
        claimed.empty() ? std::string()
                        : "; the store refused clients of this job for a wrong token, claiming " +
                              name_ranks({claimed.begin(), claimed.end()}) +
                              ": every node must export the same NANODDP_STORE_TOKEN";
    NANODDP_THROW(TimeoutError, client_->context(), ": wait for ", names, " timed out after ",
                  timeout.count(), " ms (", who_is_missing(arrived, options_.world_size), ")",
                  token_hint);
  }
  NANODDP_CHECK(status == kOk, DistError, client_->context(), ": wait: unexpected status ",
                int(status));
}

bool TCPStore::check(const std::vector<std::string>& keys) {
  NANODDP_CHECK(keys.size() <= kMaxKeysPerRequest, ValueError, client_->context(), ": check on ",
                keys.size(), " keys exceeds the limit of ", kMaxKeysPerRequest);
  std::vector<uint8_t> msg;
  put_u8(msg, kCheck);
  put_u32(msg, static_cast<uint32_t>(keys.size()));
  for (const auto& key : keys) {
    check_key(client_->context(), key);
    put_str(msg, key);
  }
  uint8_t status = client_->request(msg, kReplyGrace + options_.timeout, "check", [](uint8_t, auto) {});
  NANODDP_CHECK(status == kOk || status == kMissing, DistError, client_->context(),
                ": check: unexpected status ", int(status));
  return status == kOk;
}

}  // namespace nanoddp::dist
