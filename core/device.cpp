#include "core/device.h"

#include "core/error.h"

namespace nanoddp {

Device Device::parse(const std::string& text) {
  if (text == "cpu") return cpu();
  if (text == "cuda") return cuda(0);
  const std::string prefix = "cuda:";
  if (text.rfind(prefix, 0) == 0 && text.size() > prefix.size()) {
    const std::string digits = text.substr(prefix.size());
    if (digits.find_first_not_of("0123456789") == std::string::npos && digits.size() < 6)
      return cuda(std::stoi(digits));
  }
  NANODDP_THROW(ValueError, "unknown device '", text, "': expected cpu, cuda or cuda:N");
}

std::string Device::str() const {
  if (is_cpu()) return index == 0 ? "cpu" : "cpu:" + std::to_string(index);
  return "cuda:" + std::to_string(index);
}

std::ostream& operator<<(std::ostream& out, const Device& device) { return out << device.str(); }

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::Float32: return "float32";
    case DType::Int64: return "int64";
    case DType::UInt8: return "uint8";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Int32: return "int32";
  }
  return "?";
}

std::ostream& operator<<(std::ostream& out, DType dtype) { return out << dtype_name(dtype); }

}  // namespace nanoddp
