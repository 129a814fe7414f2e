// The store's wire format (Note [Store wire format] in store_wire.cpp): the request decoding as
// pure functions, so the server and the fuzzer run the same code, and the constants and
// encoders that the server (store_server.h) and the client (store_client.h) share. Internal:
// not a public header.
//
//   StoreRequest request;  size_t consumed = 0;  std::string error;
//   if (decode_store_request(bytes, n, request, consumed, error) == StoreDecode::kRequest) serve(request);
//   // then drop the first `consumed` bytes and decode again
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <set>
#include <cstdint>
#include <string>
#include <vector>

namespace nanoddp::dist {

// The request verbs, the first byte of every request.
enum Verb : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kCheck = 4, kWait = 5 };

// One request, as the client sent it. Which fields are set depends on verb (store_wire.cpp).
struct StoreRequest {
  uint8_t verb = 0;
  std::vector<std::string> keys;  // SET, GET, ADD: one; CHECK, WAIT: n
  std::string value;              // SET
  int64_t delta = 0;              // ADD
  uint64_t timeout_ms = 0;        // WAIT
};

enum class StoreDecode {
  kRequest,   // a whole request was decoded; consumed is its length in bytes
  kNeedMore,  // bytes hold only the start of a request: wait for more
  kError,     // not our protocol (an unknown verb, a length over its limit); error says why
};

// Decodes the first request in bytes[0, nbytes). Every length is checked against
// kMaxKeyBytes / kMaxValueBytes / kMaxKeysPerRequest before anything is allocated.
StoreDecode decode_store_request(const uint8_t* bytes, size_t nbytes, StoreRequest& request, size_t& consumed,
                                 std::string& error);

// ADD on the stored bytes of a counter (nullptr: the key is absent, counted as 0): kOk with
// value = counter + delta; kNotCounter when stored is not a decimal int64; kOverflow when the
// sum does not fit in int64 (torch's TCPStore wraps around silently). value is set only on kOk.
enum class CounterAdd { kOk, kNotCounter, kOverflow };
CounterAdd add_to_counter(const std::vector<uint8_t>* stored, int64_t delta, int64_t& value);

namespace store_detail {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x5044444E;  // bytes 'N' 'D' 'D' 'P'
// 2: the hello carries the job id and the token; 3: the rank and world size; 4: the round;
// 5: the generation; 6: the client's pid and host.
constexpr uint32_t kVersion = 6;
constexpr uint32_t kMaxIdentityBytes = 256;  // a job id or a token in the hello

enum Hello : uint8_t {
  kWelcome = 0,
  kWrongJob = 1,
  kBadToken = 2,
  kWrongWorld = 3,
  kWrongRound = 4,
  kDuplicateRank = 5
};
// Where the server notes the ranks it refused for another world size or for a rank that
// another process holds, each with why (Note [Store wire format]).
inline const char* const kRefusedKey = "nanoddp/refused";
// What a refusal for a rank that another process holds advises (both sides say it).
inline const char* const kTwoClaimsHint =
    "two processes claim one rank (one --node-rank given to two nodes, or RANK set twice)";
// Where it notes the rank of every client it admitted ("0,1,3,"), so that a wait that times out
// can name the ranks that never reached the store rather than a key only the backend knows.
inline const char* const kArrivedKey = "nanoddp/arrived";
// Where it notes the ranks claimed by clients of this job id that it refused for their token:
// a hint for a timeout (a node given another NANODDP_STORE_TOKEN), never a reason to stop,
// since a client without the token is not trusted.
inline const char* const kBadTokenKey = "nanoddp/bad_token";
// Where it notes the clients of another job id that it refused ("rank 1 of job 'b'; "): a hint for
// a timeout (nodes started with different NANODDP_JOB_ID), never a reason to stop, since
// another job sharing the port must not end this one.
inline const char* const kOtherJobKey = "nanoddp/other_job";

enum Status : uint8_t { kOk = 0, kMissing = 1, kNotCounter = 2, kTimeout = 3, kOverflow = 4, kJobBroken = 5 };

// How long past a WAIT's own deadline a client gives the server to answer before it calls the
// server dead.
constexpr std::chrono::milliseconds kReplyGrace{10000};

inline void put_u8(std::vector<uint8_t>& out, uint8_t v) { out.push_back(v); }
inline void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
inline void put_u64(std::vector<uint8_t>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
inline void put_bytes(std::vector<uint8_t>& out, const uint8_t* data, size_t n) {
  put_u32(out, static_cast<uint32_t>(n));
  out.insert(out.end(), data, data + n);
}
inline void put_str(std::vector<uint8_t>& out, const std::string& s) {
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

inline void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

inline void set_nonblocking(int fd, bool on) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

// The ranks in a server's note ("0,1,3,"), each once.
std::set<int> ranks_in(const std::string& note);

// "rank 3" or "ranks 1, 2 and 7 more": the first few of a set of ranks.
std::string name_ranks(const std::vector<int>& ranks);

// For a wait's timeout: the ranks in 0..world_size-1 missing from `arrived` (the server's note
// "0,1,3,"), or, when all came, that one of them failed or is stuck before setting the key.
std::string who_is_missing(const std::string& arrived, int world_size);

}  // namespace store_detail

}  // namespace nanoddp::dist
