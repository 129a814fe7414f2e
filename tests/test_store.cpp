// TCPStore: verbs, timeouts, a busy port, and peers that break the wire format.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "dist/store.h"
#include "tests/multiprocess.h"

using namespace nanoddp;
using namespace nanoddp::dist;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

TCPStoreOptions server_options(std::chrono::milliseconds timeout = 5000ms) {
  TCPStoreOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.is_server = true;
  o.rank = 0;
  o.world_size = 2;
  o.timeout = timeout;
  return o;
}

TCPStoreOptions client_options(int port, std::chrono::milliseconds timeout = 5000ms) {
  TCPStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.rank = 1;
  o.world_size = 2;
  o.timeout = timeout;
  return o;
}

// Sends what this process writes on fd 2 into a file while alive; text() reads it back.
struct StderrCapture {
  std::string path;
  int saved = -1;
  StderrCapture() {
    char name[] = "/tmp/nanoddp_stderr_XXXXXX";
    const int fd = mkstemp(name);
    REQUIRE(fd >= 0);
    path = name;
    saved = dup(2);
    dup2(fd, 2);
    close(fd);
  }
  void restore() {
    if (saved < 0) return;
    dup2(saved, 2);
    close(saved);
    saved = -1;
  }
  std::string text() {
    restore();
    std::ifstream in(path);
    std::stringstream all;
    all << in.rdbuf();
    return all.str();
  }
  ~StderrCapture() {
    restore();
    std::remove(path.c_str());
  }
};

// A raw TCP connection to 127.0.0.1:port, for speaking a broken protocol.
int raw_connect(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

void send_bytes(int fd, const std::vector<uint8_t>& bytes) {
  REQUIRE(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size()));
}

// Reads until the peer closes; returns how many bytes came before that (-1: timed out).
long read_until_closed(int fd) {
  long total = 0;
  char buf[256];
  while (true) {
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return total;
    if (n < 0) return -1;
    total += n;
  }
}

std::vector<uint8_t> le32(uint32_t v) {
  return {uint8_t(v), uint8_t(v >> 8), uint8_t(v >> 16), uint8_t(v >> 24)};
}

// A client's hello (Note [Store wire format]): magic, version 6, job id, token, rank, world
// size (-1: not a rank), round 0, generation 0, pid 4242 and host "fake".
std::vector<uint8_t> hello(const std::string& job_id = "", const std::string& token = "") {
  auto h = le32(0x5044444E);
  auto v = le32(6);
  h.insert(h.end(), v.begin(), v.end());
  for (const std::string& text : {job_id, token}) {
    auto n = le32(static_cast<uint32_t>(text.size()));
    h.insert(h.end(), n.begin(), n.end());
    h.insert(h.end(), text.begin(), text.end());
  }
  for (int i = 0; i < 2; ++i) {
    auto none = le32(0xFFFFFFFFu);
    h.insert(h.end(), none.begin(), none.end());
  }
  for (int i = 0; i < 2; ++i) {
    auto zero = le32(0);  // round, generation
    h.insert(h.end(), zero.begin(), zero.end());
  }
  auto pid = le32(4242), n = le32(4);
  h.insert(h.end(), pid.begin(), pid.end());
  h.insert(h.end(), n.begin(), n.end());
  for (char c : std::string("fake")) h.push_back(static_cast<uint8_t>(c));
  return h;
}

// The length of this process's own hello with no job id and no token: ten u32 fields
// (magic, version, the two empty lengths, rank, world size, round, generation, pid, the host's
// length) and the host name.
size_t own_hello_bytes() {
  char host[256] = {};
  REQUIRE(::gethostname(host, sizeof(host) - 1) == 0);
  return 40 + std::strlen(host);
}

// What TCPStore(options) says in a child process: "admitted", or its error.
std::string connect_in_child(const TCPStoreOptions& options) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(fds[0]);
    std::string why = "admitted";
    try {
      TCPStore twin(options);
    } catch (const std::exception& e) {
      why = e.what();
    }
    [[maybe_unused]] auto n = ::write(fds[1], why.data(), why.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string said;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof(buf))) > 0;) said.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  return said;
}

// A server's welcome: magic, version 6, status ok, pid 4242, host "fake".
std::vector<uint8_t> welcome() {
  auto w = le32(0x5044444E);
  auto v = le32(6);
  w.insert(w.end(), v.begin(), v.end());
  w.push_back(0);
  auto pid = le32(4242), n = le32(4);
  w.insert(w.end(), pid.begin(), pid.end());
  w.insert(w.end(), n.begin(), n.end());
  for (char c : std::string("fake")) w.push_back(static_cast<uint8_t>(c));
  return w;
}

// A listening socket on a free port, closed at scope exit.
struct Listener {
  int fd = -1;
  int port = 0;
  Listener() {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    REQUIRE(::listen(fd, 4) == 0);
    socklen_t len = sizeof(addr);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
  }
  ~Listener() { ::close(fd); }
};

}  // namespace

TEST_CASE("store: set, get, add, check and wait between a server and a client") {
  TCPStore server(server_options());
  REQUIRE(server.port() > 0);
  TCPStore client(client_options(server.port()));

  server.set("greeting", std::string("hello"));
  CHECK(client.get_string("greeting") == "hello");
  client.set("greeting", std::string("overwritten"));
  CHECK(server.get_string("greeting") == "overwritten");

  std::vector<uint8_t> binary(70000);
  for (size_t i = 0; i < binary.size(); ++i) binary[i] = static_cast<uint8_t>(i * 7 + 3);
  client.set("blob", binary);
  CHECK(server.get("blob") == binary);
  client.set("empty", std::vector<uint8_t>{});
  CHECK(server.get("empty").empty());

  CHECK(server.add("counter", 5) == 5);
  CHECK(client.add("counter", -2) == 3);
  CHECK(client.add("counter", 0) == 3);
  CHECK(server.get_string("counter") == "3");  // counters are decimal text, as in PyTorch

  CHECK(client.check({"greeting", "counter"}));
  CHECK_FALSE(client.check({"greeting", "absent"}));
  CHECK(client.check({}));

  // get() waits for a key another client sets later.
  std::thread setter([&] {
    std::this_thread::sleep_for(100ms);
    server.set("late", std::string("arrived"));
  });
  auto start = Clock::now();
  CHECK(client.get_string("late") == "arrived");
  CHECK(Clock::now() - start >= 90ms);
  setter.join();

  // add() on a key holding text that is not a number is refused, and the store still works.
  CHECK_THROWS_AS(client.add("greeting", 1), DistError);
  CHECK(client.add("counter", 1) == 4);

  // A sum past int64 is refused (not wrapped: signed overflow is undefined in C++), the
  // counter keeps its value, and the connection stays usable.
  CHECK(client.add("big", INT64_MAX - 1) == INT64_MAX - 1);
  try {
    client.add("big", 2);
    FAIL("expected DistError");
  } catch (const DistError& e) {
    CHECK(std::string(e.what()).find("add('big', 2): the counter would overflow int64") != std::string::npos);
  }
  CHECK_THROWS_AS(client.add("big", INT64_MAX), DistError);
  CHECK(client.add("big", 1) == INT64_MAX);
  CHECK(client.add("big", INT64_MIN) == -1);
  CHECK(server.add("below", INT64_MIN) == INT64_MIN);
  CHECK_THROWS_AS(server.add("below", -1), DistError);
}

TEST_CASE("store: four processes meet through add and wait") {
  int port = testing::free_port();
  std::string failures = testing::run_ranks(4, [port](int rank) {
    TCPStoreOptions o;
    o.host = "127.0.0.1";
    o.port = port;
    o.is_server = rank == 0;
    o.rank = rank;
    o.world_size = 4;
    o.timeout = 20000ms;
    TCPStore store(o);
    store.set("addr/" + std::to_string(rank), "rank" + std::to_string(rank));
    store.add("arrived", rank + 1);
    store.wait({"addr/0", "addr/1", "addr/2", "addr/3"});
    for (int r = 0; r < 4; ++r)
      testing::expect(store.get_string("addr/" + std::to_string(r)) == "rank" + std::to_string(r),
                      "wrong value for rank ", r);
    // Everyone leaves only after all have read: the server must outlive the reads.
    int64_t done = store.add("done", 1);
    if (rank == 0) {
      while (done < 4) {
        std::this_thread::sleep_for(2ms);
        done = store.add("done", 0);
      }
      testing::expect(store.add("arrived", 0) == 1 + 2 + 3 + 4, "arrived counter wrong");
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("store: waits time out on time and name the missing key") {
  TCPStore server(server_options(300ms));
  TCPStore client(client_options(server.port(), 300ms));
  client.set("present", std::string("x"));

  auto start = Clock::now();
  try {
    client.wait({"present", "never-set"}, 250ms);
    FAIL("wait returned for a key nobody set");
  } catch (const TimeoutError& e) {
    std::string what = e.what();
    CHECK(what.find("never-set") != std::string::npos);
    CHECK(what.find("rank 1/2") != std::string::npos);
  }
  auto elapsed = Clock::now() - start;
  CHECK(elapsed >= 240ms);
  CHECK(elapsed < 3000ms);

  start = Clock::now();
  CHECK_THROWS_AS(client.get("also-never-set"), TimeoutError);
  CHECK(Clock::now() - start < 3000ms);

  // The connection is still in step after the timeouts.
  CHECK(client.get_string("present") == "x");
}

TEST_CASE("store: a client with no server gives up after its timeout") {
  int port = testing::free_port();
  auto start = Clock::now();
  CHECK_THROWS_AS(TCPStore(client_options(port, 300ms)), TimeoutError);
  auto elapsed = Clock::now() - start;
  CHECK(elapsed >= 250ms);
  CHECK(elapsed < 3000ms);
}

TEST_CASE("store: a client waiting for the server says so once on stderr") {
  int port = testing::free_port();
  TCPStoreOptions o = client_options(port, 1500ms);
  o.connect_notice_after = 200ms;
  StderrCapture capture;
  CHECK_THROWS_AS(TCPStore{o}, TimeoutError);
  const std::string err = capture.text();
  const std::string line = ": still waiting for the store at 127.0.0.1:" + std::to_string(port) +
                           " (served by rank 0; last error: Connection refused); giving up after 1500 ms\n";
  CHECK_MESSAGE(err.rfind("rank 1/2 on ", 0) == 0, err);
  CHECK_MESSAGE(err.find(line) != std::string::npos, err);
  CHECK_MESSAGE(err.find(line) == err.rfind(line), err);  // once, not per retry
  CHECK(std::count(err.begin(), err.end(), '\n') == 1);
}

TEST_CASE("store: an unknown host fails at once, naming it") {
  const std::string host = "no-such-host.invalid";  // RFC 6761: never resolves
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), "80", nullptr, &found);
  if (found != nullptr) ::freeaddrinfo(found);
  if (rc == EAI_AGAIN || rc == 0) {  // no resolver reachable (or a resolver that answers anything)
    MESSAGE("skipped: this machine's resolver answers '", host, "' with ", rc == 0 ? "an address" : gai_strerror(rc));
    return;
  }
  TCPStoreOptions o = client_options(29500, 60000ms);
  o.host = host;
  auto start = Clock::now();
  std::string message;
  try {
    TCPStore store(o);
  } catch (const DistError& e) {
    message = e.what();
  }
  CHECK(Clock::now() - start < 2000ms);
  CHECK_MESSAGE(message.find("cannot resolve the store host 'no-such-host.invalid'") != std::string::npos, message);
  CHECK_MESSAGE(message.find(gai_strerror(rc)) != std::string::npos, message);
}

TEST_CASE("store: a busy MASTER_PORT fails at once and names the port") {
  Listener busy;
  TCPStoreOptions o = server_options();
  o.port = busy.port;
  auto start = Clock::now();
  try {
    TCPStore store(o);
    FAIL("bound a port that is in use");
  } catch (const DistError& e) {
    std::string what = e.what();
    CHECK(what.find("MASTER_PORT " + std::to_string(busy.port)) != std::string::npos);
    CHECK(what.find("already in use") != std::string::npos);
  }
  CHECK(Clock::now() - start < 1000ms);
}

TEST_CASE("store: the server drops peers that break the wire format and keeps serving") {
  TCPStore server(server_options());
  server.set("key", std::string("value"));

  SUBCASE("a foreign hello (an HTTP request)") {
    int fd = raw_connect(server.port());
    std::string http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    send_bytes(fd, std::vector<uint8_t>(http.begin(), http.end()));
    CHECK(read_until_closed(fd) == 0);  // no reply, just closed
    ::close(fd);
  }
  SUBCASE("a key length of 4 GiB") {
    int fd = raw_connect(server.port());
    auto msg = hello();
    msg.push_back(1);  // SET
    auto huge = le32(0xFFFFFFFFu);
    msg.insert(msg.end(), huge.begin(), huge.end());
    send_bytes(fd, msg);
    CHECK(read_until_closed(fd) >= 0);  // closed at once, not waiting for 4 GiB
    ::close(fd);
  }
  SUBCASE("a value one byte over the limit") {
    int fd = raw_connect(server.port());
    auto msg = hello();
    msg.push_back(1);  // SET
    auto klen = le32(1);
    msg.insert(msg.end(), klen.begin(), klen.end());
    msg.push_back('k');
    auto vlen = le32(kMaxValueBytes + 1);
    msg.insert(msg.end(), vlen.begin(), vlen.end());
    send_bytes(fd, msg);
    CHECK(read_until_closed(fd) >= 0);
    ::close(fd);
  }
  SUBCASE("an unknown verb") {
    int fd = raw_connect(server.port());
    auto msg = hello();
    msg.push_back(99);
    send_bytes(fd, msg);
    CHECK(read_until_closed(fd) >= 0);
    ::close(fd);
  }
  CHECK(server.rejected_connections() == 1);
  TCPStore client(client_options(server.port()));
  CHECK(client.get_string("key") == "value");
}

TEST_CASE("store: a client refuses a server that is not a nanoddp store or sends huge lengths") {
  SUBCASE("wrong hello") {
    Listener fake;
    std::thread peer([&] {
      int fd = ::accept(fake.fd, nullptr, nullptr);
      char buf[8];
      [[maybe_unused]] auto n = ::recv(fd, buf, 8, MSG_WAITALL);
      std::string reply = "HTTP/1.";
      ::send(fd, reply.data(), 8, MSG_NOSIGNAL);
      ::close(fd);
    });
    try {
      TCPStore client(client_options(fake.port));
      FAIL("accepted a foreign server");
    } catch (const DistError& e) {
      CHECK(std::string(e.what()).find("other than a nanoddp store") != std::string::npos);
    }
    peer.join();
  }
  SUBCASE("a reply value of 2 GiB") {
    Listener fake;
    std::atomic<bool> release{false};
    std::thread peer([&] {
      int fd = ::accept(fake.fd, nullptr, nullptr);
      std::vector<char> buf(own_hello_bytes());
      [[maybe_unused]] auto n = ::recv(fd, buf.data(), buf.size(), MSG_WAITALL);
      auto reply = welcome();
      reply.push_back(0);  // WAIT: ok
      reply.push_back(0);  // GET: ok, then the length
      auto huge = le32(0x7FFFFFFFu);
      reply.insert(reply.end(), huge.begin(), huge.end());
      ::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL);
      while (!release) std::this_thread::sleep_for(1ms);
      ::close(fd);
    });
    TCPStore client(client_options(fake.port));
    try {
      client.get("anything");
      FAIL("accepted a 2 GiB value");
    } catch (const DistError& e) {
      CHECK(std::string(e.what()).find("over the limit") != std::string::npos);
    }
    // The broken connection is not reused.
    CHECK_THROWS_AS(client.check({"x"}), DistError);
    release = true;
    peer.join();
  }
}

TEST_CASE("store: arguments over the limits are refused before anything is sent") {
  TCPStore server(server_options());
  CHECK_THROWS_AS(server.set(std::string(kMaxKeyBytes + 1, 'k'), std::string("v")), ValueError);
  CHECK_THROWS_AS(server.set("k", std::vector<uint8_t>(kMaxValueBytes + 1)), ValueError);
  server.set("k", std::string("still fine"));
  CHECK(server.get_string("k") == "still fine");
}

TEST_CASE("store: only clients with the job's id and secret token get in") {
  TCPStoreOptions server_opts = server_options();
  server_opts.job_id = "job-a";
  server_opts.token = "s3cret-token";
  TCPStore server(server_opts);
  server.set("key", std::string("value"));
  auto refusal = [&](const std::string& job_id, const std::string& token) {
    TCPStoreOptions o = client_options(server.port());
    o.job_id = job_id;
    o.token = token;
    try {
      TCPStore client(o);
      return std::string("admitted");
    } catch (const DistError& e) {
      return std::string(e.what());
    }
  };
  SUBCASE("another job's rank (two jobs on one port) is told whose store it reached") {
    const std::string why = refusal("job-b", "s3cret-token");
    CHECK_MESSAGE(why.find("this store serves job 'job-a', not this rank's job 'job-b'") != std::string::npos, why);
    CHECK_MESSAGE(why.find("MASTER_PORT " + std::to_string(server.port())) != std::string::npos, why);
    // This job goes on waiting (another job must not end it), and its timeout names the
    // refused clients: nodes of one job started with different NANODDP_JOB_IDs. A byte
    // outside printable ASCII in a client's id is shown as '?'.
    refusal(std::string("job-\x01" "c"), "s3cret-token");
    std::string timeout;
    try {
      server.wait({"gloo/0/1"}, 200ms);
    } catch (const TimeoutError& e) {
      timeout = e.what();
    }
    CHECK_MESSAGE(
        timeout.find("the store refused clients of another job: rank 1 of job 'job-b'; rank 1 of job "
                     "'job-?c' (every node of one job must export the same NANODDP_JOB_ID)") !=
            std::string::npos,
        timeout);
  }
  SUBCASE("a wrong or missing token") {
    const std::string wrong = refusal("job-a", "s3cret-tokeN");
    CHECK_MESSAGE(wrong.find("refused: this rank does not have the job's secret token (NANODDP_STORE_TOKEN differs)") !=
                      std::string::npos,
                  wrong);
    const std::string missing = refusal("job-a", "");
    CHECK_MESSAGE(missing.find("NANODDP_STORE_TOKEN is not set") != std::string::npos, missing);
    // Rank 0's wait for that rank's key times out (a client without the token cannot stop the
    // job), and says which rank the refused clients claimed to be.
    std::string timeout;
    try {
      server.wait({"gloo/0/1"}, 200ms);
    } catch (const TimeoutError& e) {
      timeout = e.what();
    }
    CHECK_MESSAGE(timeout.find("(rank 1 never reached the store: not started, or started with another "
                               "MASTER_ADDR/MASTER_PORT); the store refused clients of this job for a wrong token, claiming "
                               "rank 1: every node must export the same NANODDP_STORE_TOKEN") !=
                      std::string::npos,
                  timeout);
  }
  SUBCASE("a raw client without the token reads and writes nothing") {
    for (const std::string& token : {std::string(), std::string("guess")}) {
      int fd = raw_connect(server.port());
      auto msg = hello("job-a", token);
      msg.push_back(2);  // GET "key", sent before the answer to the hello
      auto klen = le32(3);
      msg.insert(msg.end(), klen.begin(), klen.end());
      for (char c : std::string("key")) msg.push_back(static_cast<uint8_t>(c));
      msg.push_back(1);  // SET "key" = "evil"
      msg.insert(msg.end(), klen.begin(), klen.end());
      for (char c : std::string("key")) msg.push_back(static_cast<uint8_t>(c));
      auto vlen = le32(4);
      msg.insert(msg.end(), vlen.begin(), vlen.end());
      for (char c : std::string("evil")) msg.push_back(static_cast<uint8_t>(c));
      send_bytes(fd, msg);
      // The refusal is the 9-byte header and nothing else: no value, no ack of the SET.
      CHECK(read_until_closed(fd) == 9);
      ::close(fd);
    }
  }
  CHECK(server.rejected_connections() >= 1);
  TCPStoreOptions good = client_options(server.port());
  good.job_id = "job-a";
  good.token = "s3cret-token";
  TCPStore client(good);
  CHECK(client.get_string("key") == "value");  // never overwritten by a refused client
}

TEST_CASE("store: a rank of another world size (nodes started with different --nproc-per-node) is refused, and "
          "the ranks waiting for it are told at once") {
  TCPStore server(server_options(400ms));  // rank 0 of WORLD_SIZE=2
  // A wait already pending when the stranger arrives; its own timeout is far off.
  std::string pending_why;
  std::thread pending([&] {
    TCPStore member(client_options(server.port()));
    member.set("member/waiting", std::string("yes"));
    try {
      member.wait({"ready/2"}, 120s);
    } catch (const Error& e) {
      pending_why = e.what();
    }
  });
  server.wait({"member/waiting"}, 10s);
  std::this_thread::sleep_for(100ms);  // its wait is most likely queued now; if not, it is refused on arrival
  TCPStoreOptions stranger = client_options(server.port());
  stranger.rank = 3;
  stranger.world_size = 4;
  std::string why;
  try {
    TCPStore client(stranger);
  } catch (const DistError& e) {
    why = e.what();
  }
  CHECK_MESSAGE(why.find("refused: this rank is in a job of WORLD_SIZE=4, but rank 0, which serves the store, has "
                         "WORLD_SIZE=2: every node must start the same number of ranks") != std::string::npos,
                why);
  pending.join();
  const std::string told = "the store refused rank 3 with WORLD_SIZE=4, which does not match this job";
  CHECK_MESSAGE(pending_why.find("wait for 'ready/2' cannot end: " + told) != std::string::npos, pending_why);
  // A wait that starts after the refusal ends at once too, as a DistError, not a TimeoutError.
  std::string later_why;
  try {
    server.wait({"ready/1"}, 120s);
  } catch (const TimeoutError& e) {
    later_why = std::string("TimeoutError: ") + e.what();
  } catch (const DistError& e) {
    later_why = e.what();
  }
  CHECK_MESSAGE(later_why.find("cannot end: " + told + " (WORLD_SIZE=2)") != std::string::npos, later_why);
  TCPStore member(client_options(server.port()));  // WORLD_SIZE=2, as the server: admitted
  member.set("ready/1", std::string("yes"));
  CHECK(server.get_string("ready/1") == "yes");
  server.wait({"ready/1"}, 400ms);  // keys that are set still answer
}

TEST_CASE("store: a second process claiming a rank is refused, naming the holder, and the ranks waiting are told "
          "at once") {
  TCPStoreOptions server_opts = server_options();
  server_opts.world_size = 3;
  TCPStore server(server_opts);
  TCPStoreOptions one = client_options(server.port());
  one.world_size = 3;
  TCPStore holder(one);  // rank 1, this process
  TCPStore again(one);   // the same process again (its groups share the store): admitted
  again.set("again", std::string("yes"));
  std::string pending_why;
  std::thread pending([&] {
    try {
      holder.wait({"ready/2"}, 120s);
    } catch (const Error& e) {
      pending_why = e.what();
    }
  });
  // Another process claims rank 1, as a second node given the same --node-rank would.
  std::string child_why;
  pid_t child = 0;
  {
    // The child's pid is in the message: learn it from the server's note afterwards.
    child_why = connect_in_child(one);
    const std::string note = server.get_string("nanoddp/refused");
    const size_t at = note.find("(pid ");
    REQUIRE(at != std::string::npos);
    child = static_cast<pid_t>(std::atoi(note.c_str() + at + 5));
  }
  char host[256] = {};
  REQUIRE(::gethostname(host, sizeof(host) - 1) == 0);
  const std::string parent = "pid " + std::to_string(::getpid()) + " on " + host;
  const std::string twin = "pid " + std::to_string(child) + " on " + host;
  CHECK_MESSAGE(child_why.find("refused: rank 1 is already held by " + parent + " (this is " + twin +
                               "): two processes claim one rank (one --node-rank given to two nodes, or RANK set "
                               "twice)") != std::string::npos,
                child_why);
  pending.join();
  CHECK_MESSAGE(pending_why.find("wait for 'ready/2' cannot end: the store refused a second rank 1 (" + twin +
                                 ") while " + parent + " holds it: two processes claim one rank") != std::string::npos,
                pending_why);
  CHECK(server.get_string("again") == "yes");
}

TEST_CASE("store: once every rank has come, a stray claiming a rank is refused alone, also after the rank's holder "
          "left") {
  TCPStore server(server_options());  // rank 0 of WORLD_SIZE=2
  TCPStoreOptions one = client_options(server.port());
  auto holder = std::make_unique<TCPStore>(one);  // rank 1: every rank is here
  CHECK_MESSAGE(connect_in_child(one).find("refused: rank 1 is already held by pid " + std::to_string(::getpid())) !=
                    std::string::npos,
                "the stray was not refused");
  // The job goes on: a wait still waits for its key, which comes.
  std::thread later([&] {
    std::this_thread::sleep_for(100ms);
    holder->set("later", std::string("yes"));
  });
  server.wait({"later"}, 5s);
  later.join();
  CHECK(!server.check({"nanoddp/refused"}));
  // The holder's connection closes (its process ended): the job has come together, so no other
  // process takes its place in this round, and the job is not failed for it.
  holder.reset();
  std::this_thread::sleep_for(100ms);  // the server has seen the connection close
  CHECK(connect_in_child(one).find("refused: rank 1 is already held by pid " + std::to_string(::getpid())) !=
        std::string::npos);
  CHECK(!server.check({"nanoddp/refused"}));
}

TEST_CASE("store: before every rank has come, a rank whose holder left may be claimed by another process") {
  TCPStoreOptions three = server_options();
  three.world_size = 3;
  TCPStore server(three);  // rank 0 of WORLD_SIZE=3
  TCPStoreOptions one = client_options(server.port());
  one.world_size = 3;
  { TCPStore gone(one); }  // rank 1 came and left (its process failed during the rendezvous, say)
  std::this_thread::sleep_for(200ms);  // the server has seen the connection close
  CHECK(connect_in_child(one) == "admitted");
  CHECK(!server.check({"nanoddp/refused"}));
}

TEST_CASE("store: a wait that times out names the ranks that never reached the store") {
  TCPStoreOptions opts = server_options(300ms);
  opts.world_size = 4;
  TCPStore server(opts);  // rank 0
  TCPStoreOptions two = client_options(server.port(), 300ms);
  two.rank = 2;
  two.world_size = 4;
  TCPStore rank2(two);
  auto timeout_text = [&](TCPStore& store) {
    try {
      store.wait({"gloo/0/1"}, 300ms);
    } catch (const TimeoutError& e) {
      return std::string(e.what());
    }
    return std::string("no timeout");
  };
  std::string text = timeout_text(rank2);
  CHECK_MESSAGE(text.find("wait for 'gloo/0/1' timed out after 300 ms (ranks 1, 3 never reached the store") !=
                    std::string::npos,
                text);
  TCPStoreOptions one = two, three = two;
  one.rank = 1;
  three.rank = 3;
  TCPStore rank1(one), rank3(three);
  text = timeout_text(server);
  CHECK_MESSAGE(text.find("(all 4 ranks reached the store: one failed or is stuck before setting it)") !=
                    std::string::npos,
                text);
}

TEST_CASE("store: garbage on the port never crashes the server") {
  TCPStore server(server_options());
  server.set("key", std::string("value"));
  uint64_t state = 0x9E3779B97F4A7C15ull;  // a fixed xorshift sequence: the same garbage every run
  auto next = [&] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  for (int trial = 0; trial < 200; ++trial) {
    // Half the trials start with a valid hello, so the garbage also reaches the verbs.
    std::vector<uint8_t> bytes = trial % 2 == 0 ? hello() : std::vector<uint8_t>{};
    const size_t n = 1 + next() % 512;
    for (size_t i = 0; i < n; ++i) bytes.push_back(static_cast<uint8_t>(next()));
    int fd = raw_connect(server.port());
    ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    ::shutdown(fd, SHUT_WR);
    ::close(fd);
  }
  TCPStore client(client_options(server.port()));
  CHECK(client.get_string("key") == "value");
  CHECK(client.add("counter", 5) == 5);
}

TEST_CASE("store: the server listens on the master address only, unless told otherwise") {
  // Linux routes all of 127.0.0.0/8 to the loopback interface, so 127.0.0.2 is another address
  // of this machine: a server bound to every interface answers there, one bound to 127.0.0.1
  // does not.
  auto reachable_at = [](int port, const char* address) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, address, &addr.sin_addr);
    const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    return ok;
  };
  TCPStore only_master(server_options());
  CHECK(reachable_at(only_master.port(), "127.0.0.1"));
  CHECK_FALSE(reachable_at(only_master.port(), "127.0.0.2"));
  TCPStoreOptions all = server_options();
  all.listen_on_all_interfaces = true;
  TCPStore everywhere(all);
  CHECK(reachable_at(everywhere.port(), "127.0.0.2"));

  TCPStoreOptions elsewhere = server_options();
  elsewhere.host = "192.0.2.1";  // TEST-NET-1: never an address of this machine
  try {
    TCPStore store(elsewhere);
    FAIL("bound to an address this machine does not have");
  } catch (const DistError& e) {
    CHECK_MESSAGE(std::string(e.what()).find("is not an address of") != std::string::npos, e.what());
  }
}

TEST_CASE("store: a stopping server still answers a peer one request behind (rank 0 leaves a barrier first)") {
  // Note [Store drain]: rank 0's wait is answered by rank 1's set, and rank 0 returns from
  // main at once; rank 1, descheduled between its set and its wait, must still pass.
  for (int trial = 0; trial < 3; ++trial) {
    CAPTURE(trial);
    auto server = std::make_unique<TCPStore>(server_options());
    TCPStore client(client_options(server->port()));
    std::thread rank0([&] {
      server->set("mapped/0", std::string("1"));
      server->wait({"mapped/0", "mapped/1"});
      server.reset();
    });
    client.set("mapped/1", std::string("1"));
    std::this_thread::sleep_for(50ms * (trial + 1));
    CHECK_NOTHROW(client.wait({"mapped/0", "mapped/1"}));
    rank0.join();
  }
}

TEST_CASE("store: a client that loses the server names rank 0, its pid and host") {
  auto server = std::make_unique<TCPStore>(server_options(3000ms));
  TCPStore client(client_options(server->port(), 3000ms));
  std::thread stop([&] {
    std::this_thread::sleep_for(100ms);
    server.reset();  // rank 0 exits while rank 1 waits
  });
  try {
    client.wait({"never"});
    FAIL("the wait outlived the server");
  } catch (const DistError& e) {
    const std::string what = e.what();
    CHECK_MESSAGE(what.find("lost rank 0 (pid " + std::to_string(::getpid()) + " on ") != std::string::npos, what);
  }
  stop.join();
}
