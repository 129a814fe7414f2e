// A small program for tests/test_safetensors_python.py, which checks our files against the
// reference `safetensors` Python package in both directions:
//   safetensors_tool write PATH   writes a fixed set of tensors and metadata (below)
//   safetensors_tool print PATH   loads PATH and prints one line per tensor (sorted by name):
//                                 name dtype shape values..., then "metadata key value" lines
#include <cstdio>
#include <cstring>
#include <iostream>

#include "nn/safetensors.h"

using namespace nanoddp;

int main(int argc, char** argv) {
  if (argc != 3 || (std::strcmp(argv[1], "write") != 0 && std::strcmp(argv[1], "print") != 0)) {
    std::fprintf(stderr, "usage: safetensors_tool write|print PATH\n");
    return 2;
  }
  try {
    if (std::strcmp(argv[1], "write") == 0) {
      nn::StateDict state;
      state["fc.weight"] = Tensor::from_vector({0.5f, -1.25f, 3.0f, 1e-8f, -0.0f, 65504.0f}, {2, 3});
      state["fc.bias"] = Tensor::from_vector({-2.5f});
      state["labels"] = Tensor::from_vector(std::vector<int64_t>{-1, 0, 1LL << 40});
      state["empty"] = Tensor::zeros({0, 2});
      nn::save_safetensors(argv[2], state, {{"format", "pt"}, {"epochs", "3"}});
      return 0;
    }
    nn::SafetensorsMetadata metadata;
    for (const auto& [name, tensor] : nn::load_safetensors(argv[2], &metadata)) {
      std::cout << name << ' ' << dtype_name(tensor.dtype()) << ' ' << tensor.shape();
      if (tensor.dtype() == DType::Int64) {
        for (int64_t v : tensor.to_int_vector()) std::cout << ' ' << v;
      } else if (tensor.dtype() == DType::Float32) {
        for (float v : tensor.to_vector()) std::cout << ' ' << v;
      } else {
        for (int64_t i = 0; i < tensor.numel(); ++i) std::cout << ' ' << int{tensor.data<uint8_t>()[i]};
      }
      std::cout << '\n';
    }
    for (const auto& [key, value] : metadata) std::cout << "metadata " << key << ' ' << value << '\n';
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "safetensors_tool: %s\n", e.what());
    return 1;
  }
}
