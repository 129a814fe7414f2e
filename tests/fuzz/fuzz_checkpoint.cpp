// libFuzzer target: the checkpoint loader (nn::parse_checkpoint, which load_checkpoint runs on
// a file's bytes). The input is a checkpoint without its trailing checksum; the target appends
// the right one, so the fuzzer explores the fields behind it instead of failing on the
// checksum every time. Any exception but IOError, and any sanitizer report, is a finding.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "core/error.h"
#include "core/hash.h"
#include "nn/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  // Sealed as the reader checks it: version 1's basis for a version 1 header.
  uint32_t version = 0;
  if (bytes.size() >= 12) std::memcpy(&version, bytes.data() + 8, sizeof(version));
  const uint64_t sum = nanoddp::fnv1a(
      bytes, version == 1 ? nanoddp::nn::kCheckpointVersion1OffsetBasis : nanoddp::kFnv1aOffsetBasis);
  bytes.append(reinterpret_cast<const char*>(&sum), sizeof(sum));
  try {
    const nanoddp::nn::StateDict state = nanoddp::nn::parse_checkpoint(bytes, "fuzz.ckpt");
    // What was accepted must be whole: every tensor's bytes lie inside the file.
    size_t total = 0;
    for (const auto& [name, tensor] : state) total += name.size() + tensor.nbytes();
    if (total > bytes.size()) __builtin_trap();
  } catch (const nanoddp::IOError&) {
  }
  return 0;
}
