// Device and DType: where a tensor lives and what its elements are.
//
//   Device d = Device::parse("cuda:1");   // {CUDA, 1}
//   Device::cpu().str() == "cpu"
//   dtype_size(DType::Int64) == 8
#pragma once

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>

#include "core/half.h"

namespace nanoddp {

struct Device {
  enum class Type { CPU, CUDA };
  Type type = Type::CPU;
  // GPU ordinal; 0 for the CPU. Tests use a second host device, {CPU, 1} ("cpu:1"), as a
  // stand-in for a GPU: host memory the CPU kernels run on, yet not Device::cpu(), so code that
  // hands a host tensor where the device's tensor belongs fails without a GPU.
  int index = 0;

  static Device cpu() { return {Type::CPU, 0}; }
  static Device cuda(int index = 0) { return {Type::CUDA, index}; }
  // "cpu", "cuda" (= cuda:0) or "cuda:N". Throws ValueError on anything else.
  static Device parse(const std::string& text);

  bool is_cpu() const { return type == Type::CPU; }
  bool is_cuda() const { return type == Type::CUDA; }
  std::string str() const;  // "cpu" or "cuda:N", as torch.device prints ("cpu:1" for the stand-in)
  bool operator==(const Device& other) const { return type == other.type && index == other.index; }
  bool operator!=(const Device& other) const { return !(*this == other); }
};

std::ostream& operator<<(std::ostream& out, const Device& device);

// Element types. Float32 is the default for everything; Int64 holds class labels (as
// torch.long); UInt8 holds raw image bytes. Float16 and BFloat16 (core/half.h) hold
// compressed communication (collectives sum them) and what nn::autocast's matrix products
// return; kernels widen them to float32 to compute (Note [Autocast] in core/autocast.h).
// Int32 holds max_pool2d's saved argmax indices (half the bytes of torch's int64 ones). The
// values are stored in files (checkpoints), so a new dtype goes at the end.
enum class DType { Float32, Int64, UInt8, Float16, BFloat16, Int32 };
constexpr DType kLastDType = DType::Int32;

inline size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::Float32: return 4;
    case DType::Int64: return 8;
    case DType::UInt8: return 1;
    case DType::Float16: return 2;
    case DType::BFloat16: return 2;
    case DType::Int32: return 4;
  }
  return 0;
}

inline bool is_16bit_float(DType dtype) { return dtype == DType::Float16 || dtype == DType::BFloat16; }

const char* dtype_name(DType dtype);  // "float32", "int64", "uint8", "float16", "bfloat16", "int32"
std::ostream& operator<<(std::ostream& out, DType dtype);

// The C++ type for each DType, used by Tensor::data<T>() to check the dtype.
template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::Float32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::Int64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::UInt8; }
template <> constexpr DType dtype_of<Float16>() { return DType::Float16; }
template <> constexpr DType dtype_of<BFloat16>() { return DType::BFloat16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::Int32; }

}  // namespace nanoddp
