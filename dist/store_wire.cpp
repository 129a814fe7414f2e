// The store's wire format: what a client and the server send each other, and the server's
// request decoding.
//
// Note [Store wire format]
// Integers are little-endian, as on every host we build for (x86-64, AArch64).
//   1. The client connects and sends a hello: u32 kMagic ("NDDP"), u32 kVersion, str job_id,
//      str token (each <= kMaxIdentityBytes), i32 rank, i32 world_size (-1: not a rank),
//      u32 round (NANODDP_RESTART_COUNT: how many times the launcher restarted the group),
//      u32 generation (how many default groups this process initialised before this one),
//      u32 the client's pid, str its host name.
//   2. The server answers u32 kMagic, u32 kVersion, then one status byte:
//        kWelcome   then u32 server pid, str server host: the verbs may follow;
//        kWrongJob  then str the server's job id: another job's rank reached this store;
//        kBadToken  nothing: the client does not know the job's secret token;
//        kWrongWorld then u32 the server's world size: a rank of this job with another world
//                   size (nodes started with different --nproc-per-node); the server also
//                   keeps the refusal under kRefusedKey, which the waits it ends quote;
//        kDuplicateRank then u32 pid, str host of the process that holds the rank: another
//                   process of this job's round and generation holds it over a connection
//                   still open, or held it once every rank had come (two nodes given one
//                   --node-rank, RANK set twice); while not every rank has come, also kept
//                   under kRefusedKey (the job cannot come together), afterwards the stray
//                   alone is refused;
//        kWrongRound then u32 the server's round, u32 its generation: a rank of another start
//                   of the group, or of another group of the same processes (a program that
//                   destroyed its group and initialised a new one). Ordered by round, then
//                   generation: a rank of an older one is stale (its launcher did not restart,
//                   or it did not destroy its group) and fails at once; a rank of a newer one
//                   met the old group's server, which is about to go, and retries until its
//                   connect timeout (Note [Restart rounds]).
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
//      refused a rank for another world size, or a second claim of a rank before every rank
//      came, or a client has set kRefusedKey (a rank that chose another backend than rank
//      0's; a SET of that key adds to the note): the job cannot come together, and the
//      waiters learn why from kRefusedKey instead of sitting out their timeout.
//   4. WAIT's deadline is kept by the server (it answers kTimeout when it passes), so a
#include "dist/store_wire.h"

#include <climits>
#include <cstring>
#include <string>

#include "dist/store.h"

namespace nanoddp::dist {

using namespace store_detail;

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

}  // namespace nanoddp::dist
