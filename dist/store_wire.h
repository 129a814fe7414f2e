// The store server's request decoding (Note [Store wire format] in store.cpp) as pure
// functions, so the server and the fuzzer run the same code. Internal: not a public header.
//
//   StoreRequest request;  size_t consumed = 0;  std::string error;
//   if (decode_store_request(bytes, n, request, consumed, error) == StoreDecode::kRequest) serve(request);
//   // then drop the first `consumed` bytes and decode again
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace nanoddp::dist {

// The request verbs, the first byte of every request.
enum Verb : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kCheck = 4, kWait = 5 };

// One request, as the client sent it. Which fields are set depends on verb (store.cpp).
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

}  // namespace nanoddp::dist
