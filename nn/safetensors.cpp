#include "nn/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "core/file_io.h"

namespace nanoddp::nn {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian; so is our storage");

namespace {

using json = nlohmann::json;

constexpr const char* kMetadataKey = "__metadata__";
// The reference implementation refuses larger headers (and so do we: a corrupt length
// should not make us parse 1 GB of garbage).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

const char* safetensors_dtype(DType dtype) {
  switch (dtype) {
    case DType::Float32: return "F32";
    case DType::Int64: return "I64";
    case DType::UInt8: return "U8";
    case DType::Float16: return "F16";  // IEEE half, core/half.h
    case DType::BFloat16: return "BF16";
    case DType::Int32: return "I32";
  }
  NANODDP_THROW(ValueError, "safetensors: no safetensors name for dtype ", dtype);
}

// Where the safetensors library's own writer puts a dtype's tensors: the widest first (its
// Dtype enum, descending), so that with the data 8-byte aligned every tensor starts at a
// multiple of its element size, and a reader may view the bytes in place.
int layout_rank(DType dtype) {
  switch (dtype) {
    case DType::Int64:
      return 0;
    case DType::Float32:
      return 1;
    case DType::Int32:
      return 2;
    case DType::BFloat16:
      return 3;
    case DType::Float16:
      return 4;
    case DType::UInt8:
      return 5;
  }
  return 6;
}

bool parse_dtype(const std::string& name, DType* dtype) {
  for (DType candidate : {DType::Float32, DType::Int64, DType::UInt8, DType::Float16, DType::BFloat16, DType::Int32}) {
    if (name == safetensors_dtype(candidate)) {
      *dtype = candidate;
      return true;
    }
  }
  return false;
}

// A header value as an error message shows it: the JSON text of a short array of plain values
// (numbers, short strings), else what kind of value it is. dump() recurses once per level of nesting, and 200
// KB of header nest 100,000 levels deep, so nothing longer or deeper is ever dumped.
std::string shown(const json& value) {
  constexpr size_t kMaxShownElements = 8;
  const auto plain = [](const json& element) {
    return element.is_number() || element.is_boolean() || element.is_null() ||
           (element.is_string() && element.get_ref<const std::string&>().size() <= 32);
  };
  if (value.is_array() && value.size() <= kMaxShownElements && std::all_of(value.begin(), value.end(), plain))
    return value.dump();
  if (plain(value)) return value.dump();
  std::string kind = std::string("(a JSON ") + value.type_name();
  if (value.is_array() || value.is_object())
    kind += " of " + std::to_string(value.size()) + (value.size() == 1 ? " element" : " elements");
  return kind + ")";
}

// One tensor's entry as read from the header, before its bytes are trusted.
struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

Entry parse_entry(const std::string& path, const std::string& name, const json& value) {
  auto fail = [&](const std::string& why) {
    NANODDP_THROW(IOError, "safetensors ", path, ": tensor '", name, "': ", why);
  };
  if (!value.is_object()) fail("header entry is not a JSON object");
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!value.contains(field)) fail(std::string("no \"") + field + "\" in its header entry");

  Entry entry;
  entry.name = name;
  const json& dtype = value["dtype"];
  if (!dtype.is_string()) fail("\"dtype\" is not a string");
  if (!parse_dtype(dtype.get<std::string>(), &entry.dtype))
    fail("dtype " + dtype.get<std::string>() +
         " is not supported (nanoddp reads F32, F16, BF16, I64, I32 and U8)");

  const json& shape = value["shape"];
  if (!shape.is_array()) fail("\"shape\" is not an array");
  if (shape.size() > static_cast<size_t>(Shape::kMaxDims))
    fail("shape has " + std::to_string(shape.size()) + " dimensions, more than nanoddp's " +
               std::to_string(Shape::kMaxDims));
  std::vector<int64_t> sizes;
  for (const json& size : shape) {
    if (!size.is_number_unsigned() || size.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail("shape " + shown(shape) + " holds something other than a non-negative integer");
    sizes.push_back(size.get<int64_t>());
  }

  const json& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned())
    fail("\"data_offsets\" " + shown(offsets) + " is not two non-negative integers");
  entry.begin = offsets[0].get<uint64_t>();
  entry.end = offsets[1].get<uint64_t>();
  if (entry.begin > entry.end) fail("data_offsets " + shown(offsets) + " end before they begin");

  // numel * dtype size, refusing a product that overflows.
  uint64_t nbytes = dtype_size(entry.dtype);
  for (int64_t size : sizes) {
    const uint64_t factor = static_cast<uint64_t>(size);
    if (factor != 0 && nbytes > std::numeric_limits<uint64_t>::max() / factor)
      fail("shape " + shown(shape) + " overflows a 64-bit byte count");
    nbytes *= factor;
  }
  // Then Shape's own checks: the nonzero sizes must count in int64 even when one is 0.
  try {
    entry.shape = Shape(sizes);
  } catch (const ShapeError& e) {
    fail(message_of(e));
  }
  if (entry.end - entry.begin != nbytes)
    fail("data_offsets " + shown(offsets) + " span " + std::to_string(entry.end - entry.begin) +
         " bytes, but shape " + shown(shape) + " of " + dtype.get<std::string>() + " needs " +
         std::to_string(nbytes));
  return entry;
}

// Whether text is UTF-8, which the header's JSON must be.
bool is_utf8(const std::string& text) {
  try {
    (void)json(text).dump();
    return true;
  } catch (const json::type_error&) {
    return false;
  }
}

// The header's JSON, refusing a key that appears twice in one object. JSON leaves duplicate
// names undefined and readers differ: nlohmann keeps the last, others the first. A file with
// two entries for one tensor (or two "__metadata__") would load whichever this reader picks,
// silently, so it is refused instead. Throws IOError naming the key, or as json::parse does.
json parse_header(const std::string& path, const std::string& bytes, size_t begin, size_t end) {
  struct OpenObject {
    std::string name;  // the key whose value it is ("" for the header itself)
    std::set<std::string> keys;
  };
  std::vector<OpenObject> open_objects;
  std::string last_key;
  const auto refuse_duplicate_keys = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open_objects.push_back({open_objects.empty() ? "" : last_key, {}});
    } else if (event == json::parse_event_t::object_end) {
      open_objects.pop_back();
    } else if (event == json::parse_event_t::key) {
      last_key = parsed.get<std::string>();
      OpenObject& object = open_objects.back();
      if (!object.keys.insert(last_key).second) {
        if (open_objects.size() == 1)
          NANODDP_THROW(IOError, "safetensors ", path, ": the header (bytes 8 to ", end, ") lists '",
                        last_key, "' twice; a file with two entries for one name is ambiguous");
        NANODDP_THROW(IOError, "safetensors ", path, ": the header (bytes 8 to ", end, ") has key '",
                      last_key, "' twice in the entry '", object.name, "'");
      }
    }
    return true;
  };
  return json::parse(bytes.begin() + static_cast<std::ptrdiff_t>(begin),
                     bytes.begin() + static_cast<std::ptrdiff_t>(end), refuse_duplicate_keys);
}

}  // namespace

void save_safetensors(const std::string& path, const StateDict& tensors, const SafetensorsMetadata& metadata) {
  json header = json::object();
  std::vector<std::pair<const std::string*, Tensor>> laid_out;  // (name, host copy), in file order
  for (const auto& [name, tensor] : tensors) {
    NANODDP_CHECK(name != kMetadataKey, ValueError, "safetensors ", path, ": a tensor may not be named ", kMetadataKey);
    laid_out.emplace_back(&name, host_tensor_to_save(tensor, "safetensors " + path, name));
  }
  std::stable_sort(laid_out.begin(), laid_out.end(), [](const auto& a, const auto& b) {
    return layout_rank(a.second.dtype()) < layout_rank(b.second.dtype());
  });  // stable: by name within a dtype, as StateDict is ordered
  std::vector<Tensor> host_tensors;
  uint64_t offset = 0;
  for (auto& [name, host] : laid_out) {
    header[*name] = {{"dtype", safetensors_dtype(host.dtype())},
                     {"shape", host.shape().sizes()},
                     {"data_offsets", {offset, offset + host.nbytes()}}};
    offset += host.nbytes();
    host_tensors.push_back(std::move(host));
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;

  std::string text;
  try {
    text = header.dump();
  } catch (const json::type_error&) {  // the only one dump() throws: bytes that are not UTF-8
    for (const auto& [name, tensor] : tensors)
      NANODDP_CHECK(is_utf8(name), ValueError, "safetensors ", path, ": the tensor name '", name,
                    "' is not UTF-8 text, which the format's JSON header needs");
    for (const auto& [key, value] : metadata)
      NANODDP_CHECK(is_utf8(key) && is_utf8(value), ValueError, "safetensors ", path,
                    ": the metadata entry '", key,
                    "' is not UTF-8 text, which the format's JSON header needs");
    throw;
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_bytes = text.size();
  std::string bytes(reinterpret_cast<const char*>(&header_bytes), sizeof(header_bytes));
  bytes.reserve(sizeof(header_bytes) + text.size() + offset);
  bytes += text;
  for (const Tensor& host : host_tensors)
    if (host.nbytes() > 0)
      bytes.append(static_cast<const char*>(host.impl()->storage->data()), host.nbytes());
  write_file_atomically(path, bytes, "safetensors");
}

void check_safetensors_writable(const std::string& path) {
  check_writable(path, "safetensors");
  // The format's own start: an 8-byte little-endian header length that fits in the file, then
  // the JSON header's '{'.
  check_replaces_only(path, "safetensors", "a safetensors file", [](const std::string& head, uint64_t size_bytes) {
    uint64_t header_bytes = 0;
    if (head.size() < sizeof(header_bytes) + 1) return false;
    std::memcpy(&header_bytes, head.data(), sizeof(header_bytes));
    return header_bytes > 0 && header_bytes <= size_bytes - sizeof(header_bytes) && head[sizeof(header_bytes)] == '{';
  });
}

StateDict load_safetensors(const std::string& path, SafetensorsMetadata* metadata) {
  return parse_safetensors(read_regular_file(path, "safetensors"), path, metadata);
}

StateDict parse_safetensors(const std::string& bytes, const std::string& path,
                            SafetensorsMetadata* metadata) {
  uint64_t header_bytes = 0;
  NANODDP_CHECK(bytes.size() >= sizeof(header_bytes), IOError, "safetensors ", path, ": only ", bytes.size(),
                " bytes, too short for the 8-byte header length");
  std::memcpy(&header_bytes, bytes.data(), sizeof(header_bytes));
  NANODDP_CHECK(header_bytes <= bytes.size() - sizeof(header_bytes), IOError, "safetensors ", path,
                ": header length ", header_bytes, " (at byte offset 0) runs past the end of the file (",
                bytes.size(), " bytes)");
  NANODDP_CHECK(header_bytes <= kMaxHeaderBytes, IOError, "safetensors ", path, ": header length ", header_bytes,
                " is over the limit of ", kMaxHeaderBytes, " bytes");
  const size_t data_start = sizeof(header_bytes) + header_bytes;
  const uint64_t data_bytes = bytes.size() - data_start;

  // As the format's specification: the header is JSON text that begins with '{'. A NUL
  // would end nlohmann's input early, hiding what follows it.
  NANODDP_CHECK(header_bytes > 0 && bytes[sizeof(header_bytes)] == '{', IOError, "safetensors ", path,
                ": the header (bytes 8 to ", data_start, ") does not start with '{'");
  const void* nul = std::memchr(bytes.data() + sizeof(header_bytes), '\0', header_bytes);
  NANODDP_CHECK(nul == nullptr, IOError, "safetensors ", path, ": the header (bytes 8 to ", data_start,
                ") holds a NUL byte at byte offset ", static_cast<const char*>(nul) - bytes.data());
  json header;
  try {
    header = parse_header(path, bytes, sizeof(header_bytes), data_start);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number past a double's range
    NANODDP_THROW(IOError, "safetensors ", path, ": the header (bytes 8 to ", data_start,
                  ") cannot be read as JSON: ", message_of(e));
  }
  NANODDP_CHECK(header.is_object(), IOError, "safetensors ", path, ": the header is not a JSON object");

  std::vector<Entry> entries;
  SafetensorsMetadata file_metadata;
  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey) {
      NANODDP_CHECK(value.is_object(), IOError, "safetensors ", path, ": ", kMetadataKey, " is not a JSON object");
      for (const auto& [key, text] : value.items()) {
        NANODDP_CHECK(text.is_string(), IOError, "safetensors ", path, ": ", kMetadataKey, " value of '", key,
                      "' is not a string");
        file_metadata[key] = text.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, name, value));
  }

  // The tensors must tile [0, data_bytes): sorted by begin, each starts where the last ended.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry& entry : entries) {
    NANODDP_CHECK(entry.end <= data_bytes, IOError, "safetensors ", path, ": tensor '", entry.name,
                  "' data_offsets [", entry.begin, ", ", entry.end, ") run past the end of the data (", data_bytes,
                  " bytes from byte offset ", data_start, ")");
    NANODDP_CHECK(entry.begin >= covered, IOError, "safetensors ", path, ": tensor '", entry.name, "' data_offsets [",
                  entry.begin, ", ", entry.end, ") overlap tensor '", previous ? previous->name : "", "' [",
                  previous ? previous->begin : 0, ", ", covered, ")");
    NANODDP_CHECK(entry.begin == covered, IOError, "safetensors ", path, ": data bytes [", covered, ", ", entry.begin,
                  ") belong to no tensor");
    covered = entry.end;
    previous = &entry;
  }
  NANODDP_CHECK(covered == data_bytes, IOError, "safetensors ", path, ": data bytes [", covered, ", ", data_bytes,
                ") belong to no tensor");

  StateDict state;
  for (const Entry& entry : entries) {
    Tensor t = Tensor::empty(entry.shape, entry.dtype);
    if (t.nbytes() > 0) std::memcpy(t.impl()->storage->data(), bytes.data() + data_start + entry.begin, t.nbytes());
    state[entry.name] = t;
  }
  if (metadata != nullptr) *metadata = std::move(file_metadata);  // replaced whole, and only on success
  return state;
}

}  // namespace nanoddp::nn
