// The store's client: one blocking socket per TCPStore, guarded by a mutex. Internal: included
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
#include <optional>
#include <set>
#include <thread>

#include "core/error.h"
#include "dist/deadline.h"
#include "dist/detail.h"
#include "dist/launcher_link.h"
#include "dist/store.h"
#include "dist/store_wire.h"

namespace nanoddp::dist {

using namespace store_detail;

class TCPStore::Client {
 public:
  Client(const TCPStoreOptions& options, int port, const std::string& context)
      : context_(context + ": store " + options.host + ":" + std::to_string(port)), rank_(options.rank) {
    // A rank of a newer round or generation may reach the old group's server while that one is
    // still going (Note [Restart rounds]; a program that destroyed its group and initialised
    // a new one before rank 0 did): it connects again until the timeout. The old server may
    // also close a connection it accepted as it goes away: for such a rank that is not rank 0
    // failing, for up to kOldServerGrace after the first such close.
    constexpr auto kOldServerGrace = std::chrono::seconds(2);
    const auto deadline = detail::deadline_after(options.timeout);
    const bool may_meet_old_server = options.round > 0 || options.generation > 0;
    std::optional<Clock::time_point> first_close;
    uint32_t server_round = 0, server_generation = 0;
    while (true) {
      connect(options.host, port, options.timeout, options.connect_notice_after, context);
      try {
        if (hello(options, server_round, server_generation)) return;
      } catch (const ClosedBeforeHello&) {
        if (!first_close) first_close = Clock::now();
        const bool retry = may_meet_old_server && Clock::now() - *first_close < kOldServerGrace;
        if (!retry) {
          report_lost_peer(rank_, 0);  // blamed only if rank 0 failed too (Note [Launcher link])
          NANODDP_THROW(DistError, context_, ": the store closed the connection before answering the hello: "
                        "rank 0 exited (see its error), or MASTER_PORT is served by an older nanoddp or another "
                        "program");
        }
      }
      fd_.reset();
      if (Clock::now() >= deadline && server_round == static_cast<uint32_t>(options.round)) {
        NANODDP_THROW(TimeoutError, context_, ": this process's group is generation ", options.generation,
                      " (its default groups count from 0), but the store still serves generation ",
                      server_generation, " after ", options.timeout.count(),
                      " ms: rank 0 did not destroy its earlier group (destroy_process_group) and initialise "
                      "this one");
      }
      NANODDP_CHECK(Clock::now() < deadline, TimeoutError, context_, ": this rank is of restart round ",
                    options.round, " (NANODDP_RESTART_COUNT), but the store still serves round ", server_round,
                    " after ", options.timeout.count(),
                    " ms: the launcher of rank 0's node did not restart the group (every node's nanoddp-run "
                    "needs the same --max-restarts)");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  // Sends one request and returns its status byte; reply_tail(status, deadline) reads the
  // rest of the reply, which depends on the status.
  // report_loss: a closed connection is reported to the launcher as rank 0 lost (Note
  // [Launcher link]); false for a look at the store after an error of this rank's own.
  template <typename Tail>
  uint8_t request(const std::vector<uint8_t>& message, std::chrono::milliseconds reply_timeout,
                  const char* verb, Tail&& reply_tail, bool report_loss = true) {
    std::lock_guard<std::mutex> lock(mutex_);
    NANODDP_CHECK(fd_.valid(), DistError, context_, ": ", verb,
                  " after an earlier failure broke the connection");
    auto deadline = detail::deadline_after(reply_timeout);
    report_loss_ = report_loss;
    try {
      send_all(message, verb);
      uint8_t status = 0;
      recv_exact(&status, 1, deadline, verb);
      reply_tail(status, deadline);
      report_loss_ = true;
      return status;
    } catch (...) {
      report_loss_ = true;
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
    auto deadline = detail::deadline_after(timeout, started);
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

  // What hello throws when the server closes the connection before its answer.
  struct ClosedBeforeHello {};

  // Steps 1-2 of Note [Store wire format]. False: the server is of an older round or
  // generation (server_round, server_generation), which is about to go; connect again. Throws
  // ClosedBeforeHello when the server closed the connection instead of answering.
  bool hello(const TCPStoreOptions& options, uint32_t& server_round, uint32_t& server_generation) {
    NANODDP_CHECK(options.job_id.size() <= kMaxIdentityBytes && options.token.size() <= kMaxIdentityBytes,
                  ValueError, context_, ": a job id or token longer than ", kMaxIdentityBytes, " bytes");
    std::vector<uint8_t> message;
    put_u32(message, kMagic);
    put_u32(message, kVersion);
    put_str(message, options.job_id);
    put_str(message, options.token);
    put_u32(message, static_cast<uint32_t>(options.rank));
    put_u32(message, static_cast<uint32_t>(options.world_size));
    put_u32(message, static_cast<uint32_t>(options.round));
    put_u32(message, static_cast<uint32_t>(options.generation));
    put_u32(message, static_cast<uint32_t>(::getpid()));
    put_str(message, detail::host_name().substr(0, kMaxIdentityBytes));
    const auto deadline = Clock::now() + std::min(options.timeout, kReplyGrace);
    uint8_t reply[8];
    try {
      // A server going away may reset the connection before the hello is even sent.
      send_all(message, "hello");
      recv_exact(reply, sizeof(reply), deadline, "hello");
    } catch (const TimeoutError&) {
      throw;
    } catch (const DistError&) {
      throw ClosedBeforeHello{};  // the constructor decides: retried, or the error
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
    if (status == kDuplicateRank) {
      uint8_t pid[4];
      recv_exact(pid, 4, deadline, "hello");
      const std::string host = recv_identity(deadline);
      NANODDP_THROW(DistError, context_, ": refused: rank ", options.rank, " is already held by pid ",
                    Reader{pid, 4}.uint(4), " on ", host, " (this is pid ", ::getpid(), " on ", detail::host_name(),
                    "): ", kTwoClaimsHint);
    }
    if (status == kWrongRound) {
      uint8_t theirs[8];
      recv_exact(theirs, 8, deadline, "hello");
      Reader server{theirs, 8};
      server_round = static_cast<uint32_t>(server.uint(4));
      server_generation = static_cast<uint32_t>(server.uint(4));
      const auto round = static_cast<uint32_t>(options.round),
                 generation = static_cast<uint32_t>(options.generation);
      NANODDP_CHECK(server_round <= round, DistError, context_, ": refused: this rank is of restart round ",
                    options.round,
                    " (NANODDP_RESTART_COUNT), but the group was restarted and the store serves round ",
                    server_round, ": a rank of an earlier start must not join the new one");
      NANODDP_CHECK(
          server_round < round || server_generation < generation, DistError, context_,
          ": refused: this process's group is generation ", generation,
          " (its default groups count from 0), but rank 0's store serves generation ", server_generation,
          ": every rank must call destroy_process_group() and init_process_group() as often as rank 0");
      return false;
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
    return true;
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

  // Whether the server's process is on this machine, not this one, and stopped (T) or traced (t).
  bool server_stopped() const {
    if (server_pid_ <= 0 || server_pid_ == ::getpid() || server_host_ != detail::host_name()) return false;
    const char state = detail::process_state(server_pid_);
    return state == 'T' || state == 't';
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
      pollfd p{fd, POLLOUT, 0};
      int n = ::poll(&p, 1, std::max(1, detail::poll_milliseconds(deadline - Clock::now())));
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
      if (n < 0 && (error == EPIPE || error == ECONNRESET) && server_pid_ > 0 && report_loss_)
        report_lost_peer(rank_, 0);
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
      int ready = ::poll(&pfd, 1, detail::poll_milliseconds(deadline - Clock::now()));
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) continue;  // the deadline check above reports it
      ssize_t n = ::recv(fd_.get(), p + got, nbytes - got, 0);
      if (n < 0 && errno == EINTR) continue;
      // A reset is a close too: the server's process ended with our request unread.
      if (n < 0 && errno == ECONNRESET) n = 0;
      if (n == 0 && server_pid_ > 0) {
        if (report_loss_) report_lost_peer(rank_, 0);  // Note [Launcher link]
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
  bool report_loss_ = true;  // under mutex_ (request())
  detail::Fd fd_;
};

}  // namespace nanoddp::dist
