// The store's server: a poll() loop on its own thread in rank 0's process. Internal: included
// by store.cpp only, which owns the TCPStore that holds it.
#pragma once

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
#include "dist/deadline.h"
#include "dist/detail.h"
#include "dist/launcher_link.h"
#include "dist/store.h"
#include "dist/store_wire.h"

namespace nanoddp::dist {
namespace store_detail {

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

// a == b in a time that depends on the lengths only, so a wrong token's timing tells nothing
// about how much of it was right.
inline bool same_secret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace store_detail

using namespace store_detail;

class TCPStore::Server {
 public:
  Server(const TCPStoreOptions& options, const std::string& context)
      : context_(context),
        job_id_(options.job_id),
        token_(options.token),
        world_size_(options.world_size),
        round_(static_cast<uint32_t>(options.round)),
        generation_(static_cast<uint32_t>(options.generation)) {
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
    int claimed_rank = -1;  // the rank this connection holds (holders_), or -1
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
      NANODDP_CHECK(err != EADDRINUSE, DistError, context_, ": MASTER_PORT ", port, " is already in use on ",
                    detail::host_name(),
                    " (another job or an earlier run still holds it, or this process's earlier group, "
                    "still referenced after destroy_process_group); choose another port, "
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
        timeout_ms = detail::poll_milliseconds(next - Clock::now());
      }
      if (draining) {
        const int drain_ms = detail::poll_milliseconds(std::min(drain_end, quiet_end) - Clock::now());
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
    // While its requests are served, this connection is not dropped under it (drop_unanswerable):
    // an answer that cannot reach it leaves it to the loop, whose flush fails too.
    struct Serving {
      int& serving;
      Serving(int& serving, int id) : serving(serving) { serving = id; }
      ~Serving() { serving = -1; }
    } serving(serving_, id);
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
    const auto round = static_cast<uint32_t>(r.uint(4)), generation = static_cast<uint32_t>(r.uint(4));
    const auto pid = static_cast<uint32_t>(r.uint(4));
    std::string host = r.blob(kMaxIdentityBytes, "host");
    if (!r.ok()) return true;
    const auto holder = rank >= 0 ? holders_.find(rank) : holders_.end();
    // Ranks outside the world are not counted: the job comes together with 0..world_size - 1.
    const bool in_world = world_size_ <= 0 || rank < world_size_;
    const bool come_together = world_size_ > 0 && static_cast<int>(holders_.size()) >= world_size_;
    // Another process for an admitted rank: refused while its holder is connected, and at any
    // time once the job has come together (a rank that left cannot be replaced in this round).
    const bool other_process = holder != holders_.end() && (holder->second.pid != pid || holder->second.host != host);
    const bool twin = other_process && (holder->second.connections > 0 || come_together);
    put_u32(conn.out, kMagic);
    put_u32(conn.out, kVersion);
    if (!job_id_.empty() && job_id != job_id_) {
      put_u8(conn.out, kWrongJob);
      put_str(conn.out, job_id_);
      append_note(kOtherJobKey, "rank " + std::to_string(rank) + " of job '" + printable(job_id) + "'; ",
                  4096);
    } else if (!token_.empty() && !same_secret(token, token_)) {
      put_u8(conn.out, kBadToken);
      append_note(kBadTokenKey, std::to_string(rank) + ",", 4096);
    } else if (round != round_ || generation != generation_) {
      put_u8(conn.out, kWrongRound);
      put_u32(conn.out, round_);
      put_u32(conn.out, generation_);
    } else if (world_size_ > 0 && world_size > 0 && world_size != world_size_) {
      put_u8(conn.out, kWrongWorld);
      put_u32(conn.out, static_cast<uint32_t>(world_size_));
      refuse_for_the_job("rank " + std::to_string(rank) + " with WORLD_SIZE=" + std::to_string(world_size) +
                         ", which does not match this job (WORLD_SIZE=" + std::to_string(world_size_) +
                         "): every node must start the same number of ranks (nanoddp-run --nproc-per-node) "
                         "and agree on --nnodes");
    } else if (twin) {
      // One process may connect more than once (its groups share the store); two may not.
      put_u8(conn.out, kDuplicateRank);
      put_u32(conn.out, holder->second.pid);
      put_str(conn.out, holder->second.host);
      const std::string why = "a second rank " + std::to_string(rank) + " (pid " + std::to_string(pid) + " on " +
                              printable(host) + ") while pid " + std::to_string(holder->second.pid) + " on " +
                              printable(holder->second.host) + " holds it: " + kTwoClaimsHint;
      // While the job comes together, the rank the twin stands for may never come: every rank
      // learns why at once. Once every rank has come, a stray is refused and the job goes on.
      if (!come_together) refuse_for_the_job(why);
    } else {
      if (rank >= 0 && in_world) {
        if (other_process) holders_.erase(holder);  // its holder left before the job came together
        holders_.try_emplace(rank, Holder{pid, host, 0});
        ++holders_[rank].connections;
        conn.claimed_rank = rank;
        append_note(kArrivedKey, std::to_string(rank) + ",", size_t(1) << 20);
      }
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
        put_u8(out, kOk);
        if (request.keys[0] == kRefusedKey) {
          // A rank that found the job cannot come together (init's backend agreement) says
          // why: added to the note, and every wait learns it at once, as after the server's
          // own refusals.
          refuse_for_the_job(printable(std::string(request.value.begin(), request.value.end()), 512));
          return true;
        }
        data_[request.keys[0]].assign(request.value.begin(), request.value.end());
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
          // A client's timeout, however long (Note [Long timeouts]).
          const auto ms = std::chrono::milliseconds(
              static_cast<int64_t>(std::min<uint64_t>(request.timeout_ms, detail::kLongestTimeout.count())));
          waiters_.push_back({id, std::move(request.keys), detail::deadline_after(ms)});
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
    drop_unanswerable();
  }

  // A client's text as a note may quote it: at most max_bytes, each outside printable ASCII
  // shown as '?' (it comes from any client that reaches the port).
  static std::string printable(const std::string& text, size_t max_bytes = 64) {
    std::string shown = text.substr(0, max_bytes);
    for (char& c : shown)
      if (c < 0x20 || c > 0x7e) c = '?';
    return shown;
  }

  // Appends to one of the server's own notes (kRefusedKey, kArrivedKey, kBadTokenKey,
  // kOtherJobKey) while it holds fewer than max_bytes: clients flooding the hello cannot grow
  // it without bound.
  void append_note(const char* key, const std::string& text, size_t max_bytes) {
    std::vector<uint8_t>& note = data_[key];
    if (note.size() < max_bytes) note.insert(note.end(), text.begin(), text.end());
  }

  // A refusal that the whole job fails for: noted (with why) under kRefusedKey, which every
  // rank's wait then quotes, at once.
  void refuse_for_the_job(const std::string& why) {
    append_note(kRefusedKey, std::string(data_.count(kRefusedKey) > 0 ? "; " : "") + why, 4096);
    fail_waiters(kJobBroken);
  }

  void fail_waiters(Status status) {
    for (const Waiter& w : waiters_) answer(w.conn, status);
    waiters_.clear();
    drop_unanswerable();
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
    drop_unanswerable();
  }

  void answer(int id, Status status) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    put_u8(it->second.out, status);
    // Dropped after the loop over waiters_ that answers (drop() erases from waiters_).
    if (!flush(id)) unanswerable_.push_back(id);
  }

  void drop_unanswerable() {
    std::vector<int> gone;
    gone.swap(unanswerable_);
    for (int id : gone)
      if (id != serving_) drop(id);
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
    if (auto conn = conns_.find(id); conn != conns_.end() && conn->second.claimed_rank >= 0) {
      auto holder = holders_.find(conn->second.claimed_rank);
      if (holder != holders_.end()) --holder->second.connections;
    }
    waiters_.erase(std::remove_if(waiters_.begin(), waiters_.end(),
                                  [id](const Waiter& w) { return w.conn == id; }),
                   waiters_.end());
    conns_.erase(id);
  }

  std::string context_;
  std::string job_id_, token_;  // empty: not checked
  int world_size_;              // < 1: not checked
  uint32_t round_;              // Note [Restart rounds]
  uint32_t generation_;         // TCPStoreOptions::generation
  detail::Fd listen_, wake_read_, wake_write_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> rejected_{0};
  std::map<int, Conn> conns_;
  std::vector<Waiter> waiters_;
  std::vector<int> unanswerable_;  // connections an answer could not reach (answer())
  int serving_ = -1;               // the connection read_from() serves now
  // The process that claimed each rank admitted so far (Note [Store wire format],
  // kDuplicateRank). The job has come together once every rank has been admitted.
  struct Holder {
    uint32_t pid;
    std::string host;
    int connections;  // open ones; before the job has come together, a rank with none is free
  };
  std::map<int, Holder> holders_;
  std::map<std::string, std::vector<uint8_t>> data_;
  std::thread thread_;  // last: starts after every member above exists
};

}  // namespace nanoddp::dist
