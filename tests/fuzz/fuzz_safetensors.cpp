// libFuzzer target: the safetensors reader (nn::parse_safetensors, which load_safetensors runs
// on a file's bytes). Any exception but IOError, and any sanitizer report (a stack overflow
// included), is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "nn/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    nanoddp::nn::SafetensorsMetadata metadata;
    const nanoddp::nn::StateDict state = nanoddp::nn::parse_safetensors(bytes, "fuzz.safetensors", &metadata);
    // What was accepted must be whole: every tensor's bytes lie inside the file.
    size_t total = 0;
    for (const auto& [name, tensor] : state) total += tensor.nbytes();
    if (total > bytes.size()) __builtin_trap();
  } catch (const nanoddp::IOError&) {
  }
  return 0;
}
