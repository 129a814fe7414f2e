// libFuzzer target: the store server's request decoding (dist/store_wire.h), on the bytes a
// client would send after its hello. Requests are decoded one after another and served
// against an in-memory key-value map as the server does (ADD through add_to_counter), until
// the bytes run out (kNeedMore) or break the protocol (kError). Any exception, a length past
// its limit, or any sanitizer report is a finding.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dist/store.h"
#include "dist/store_wire.h"

using namespace nanoddp::dist;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::map<std::string, std::vector<uint8_t>> store;
  size_t offset = 0;
  while (offset < size) {
    StoreRequest request;
    size_t consumed = 0;
    std::string error;
    const StoreDecode result = decode_store_request(data + offset, size - offset, request, consumed, error);
    if (result == StoreDecode::kError && error.empty()) __builtin_trap();
    if (result != StoreDecode::kRequest) break;
    if (consumed == 0 || consumed > size - offset || request.keys.size() > kMaxKeysPerRequest ||
        request.value.size() > kMaxValueBytes)
      __builtin_trap();
    for (const auto& key : request.keys)
      if (key.size() > kMaxKeyBytes) __builtin_trap();
    offset += consumed;
    switch (request.verb) {
      case kSet:
        store[request.keys.at(0)].assign(request.value.begin(), request.value.end());
        break;
      case kAdd: {
        auto it = store.find(request.keys.at(0));
        int64_t value = 0;
        if (add_to_counter(it == store.end() ? nullptr : &it->second, request.delta, value) == CounterAdd::kOk) {
          const std::string text = std::to_string(value);
          store[request.keys.at(0)].assign(text.begin(), text.end());
        }
        break;
      }
      default:  // GET, CHECK, WAIT read the map only
        for (const auto& key : request.keys) (void)store.count(key);
    }
  }
  return 0;
}
