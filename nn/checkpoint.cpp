#include "nn/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <unordered_map>

#include "core/file_io.h"
#include "core/hash.h"

namespace nanoddp::nn {

namespace {

constexpr char kMagic[8] = {'N', 'D', 'D', 'P', 'C', 'K', 'P', 'T'};
// 2: the checksum is FNV-1a with its standard offset basis; version 1 used
// kCheckpointVersion1OffsetBasis, and its files still load.
constexpr uint32_t kVersion = 2;
constexpr uint32_t kMaxNameBytes = 4096;

template <typename T>
void put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// Reads fields from an in-memory file, naming the file and offset when it runs short.
class Reader {
 public:
  Reader(const std::string& path, const std::string& bytes, size_t end) : path_(path), bytes_(bytes), end_(end) {}
  template <typename T>
  T get(const char* what) {
    T value;
    std::memcpy(&value, take(sizeof(T), what), sizeof(T));
    return value;
  }
  const char* take(size_t n, const char* what) {
    NANODDP_CHECK(n <= end_ - offset_, IOError, "checkpoint ", path_, ": truncated at byte offset ", offset_,
                  " reading ", what, " (", n, " bytes wanted, ", end_ - offset_, " left)");
    const char* p = bytes_.data() + offset_;
    offset_ += n;
    return p;
  }
  size_t offset() const { return offset_; }

 private:
  const std::string& path_;
  const std::string& bytes_;
  size_t end_;
  size_t offset_ = 0;
};

// For a file whose checksum fails: where it was cut short, found by walking the entries'
// headers (each says how many bytes its entry takes). A write cut short (a full disk, an
// interrupted copy) is the usual damage, and the offset where the file ends tells the user
// what to look for. Returns "" when the entries fit the file, or when a header the walk
// reads is not one a save writes (a name too long, a bad dtype or dim, a byte count that is
// not the shape's, a name with a control character in the bytes present): a changed byte, not
// an end, and the caller reports a corrupt file. The last one catches a changed name length
// that runs past the end: the "name" it reads then takes in the next dtype and sizes.
std::string where_truncated(const std::string& bytes) {
  size_t offset = sizeof(kMagic) + sizeof(uint32_t);
  const auto read_u64 = [&](size_t at, uint64_t& value) {
    if (at > bytes.size() || bytes.size() - at < sizeof(value)) return false;
    std::memcpy(&value, bytes.data() + at, sizeof(value));
    return true;
  };
  uint64_t count = 0;
  if (!read_u64(offset, count)) return "in the header";
  offset += sizeof(uint64_t);
  for (uint64_t i = 0; i < count; ++i) {
    const std::string entry = "entry " + std::to_string(i) + " of " + std::to_string(count);
    uint32_t name_bytes = 0;
    if (offset + sizeof(name_bytes) > bytes.size()) return "in " + entry;
    std::memcpy(&name_bytes, bytes.data() + offset, sizeof(name_bytes));
    const size_t dim_at = offset + sizeof(uint32_t) + name_bytes + sizeof(uint8_t);  // after the name and dtype
    if (name_bytes > kMaxNameBytes) return "";
    const size_t name_at = offset + sizeof(uint32_t), name_present_end = std::min(dim_at - 1, bytes.size());
    for (size_t at = name_at; at < name_present_end; ++at)
      if (static_cast<unsigned char>(bytes[at]) < 0x20) return "";
    if (dim_at >= bytes.size()) return "in " + entry;
    const uint8_t dtype = static_cast<uint8_t>(bytes[dim_at - 1]), dim = static_cast<uint8_t>(bytes[dim_at]);
    if (dtype > static_cast<uint8_t>(kLastDType) || dim > Shape::kMaxDims) return "";
    uint64_t numel = 1;
    for (uint8_t d = 0; d < dim; ++d) {
      uint64_t size = 0;
      if (!read_u64(dim_at + 1 + d * sizeof(int64_t), size)) return "in " + entry;
      if (static_cast<int64_t>(size) < 0 || __builtin_mul_overflow(numel, size, &numel)) return "";
    }
    uint64_t nbytes = 0;
    if (!read_u64(dim_at + 1 + dim * sizeof(int64_t), nbytes)) return "in " + entry;
    uint64_t shape_bytes = 0;
    if (__builtin_mul_overflow(numel, dtype_size(static_cast<DType>(dtype)), &shape_bytes) || nbytes != shape_bytes)
      return "";
    const size_t data_at = dim_at + 1 + dim * sizeof(int64_t) + sizeof(uint64_t);
    if (nbytes > bytes.size() - data_at)
      return "in the data of " + entry + " (" + std::to_string(nbytes) + " bytes from byte offset " +
             std::to_string(data_at) + ")";
    offset = data_at + nbytes;
  }
  if (bytes.size() - offset < sizeof(uint64_t)) return "before the checksum";
  return "";
}

// check_replaces_only's test for our format: the magic (the size is not needed).
bool begins_as_checkpoint(const std::string& head, uint64_t) {
  return head.compare(0, sizeof(kMagic), kMagic, sizeof(kMagic)) == 0;
}

}  // namespace

void save_checkpoint(const std::string& path, const StateDict& tensors) {
  write_file_atomically(path, checkpoint_bytes(tensors), "checkpoint");
}

std::string checkpoint_bytes(const StateDict& tensors) {
  std::string bytes(kMagic, sizeof(kMagic));
  put<uint32_t>(bytes, kVersion);
  put<uint64_t>(bytes, tensors.size());
  for (const auto& [name, tensor] : tensors) {
    NANODDP_CHECK(name.size() <= kMaxNameBytes, ValueError, "checkpoint: name longer than ", kMaxNameBytes, " bytes");
    // where_truncated tells a cut file from a corrupt one by the names: none holds a control
    // character (state_dict keys are dotted module paths).
    for (size_t i = 0; i < name.size(); ++i)
      NANODDP_CHECK(static_cast<unsigned char>(name[i]) >= 0x20, ValueError, "checkpoint: name '", name,
                    "' holds the control character 0x", std::hex, int(static_cast<unsigned char>(name[i])),
                    std::dec, " at byte ", i, "; names hold no control characters");
    const Tensor host = host_tensor_to_save(tensor, "checkpoint", name);
    put<uint32_t>(bytes, static_cast<uint32_t>(name.size()));
    bytes += name;
    put<uint8_t>(bytes, static_cast<uint8_t>(host.dtype()));
    put<uint8_t>(bytes, static_cast<uint8_t>(host.dim()));
    for (int64_t size : host.shape().sizes()) put<int64_t>(bytes, size);
    put<uint64_t>(bytes, host.nbytes());
    if (host.nbytes() > 0)
      bytes.append(static_cast<const char*>(host.impl()->storage->data()), host.nbytes());
  }
  put<uint64_t>(bytes, fnv1a(bytes));
  return bytes;
}

namespace {
// Throws IOError unless bytes are a checkpoint whose checksum holds: every byte as written.
void check_checksum(const std::string& bytes, const std::string& path) {
  NANODDP_CHECK(bytes.size() >= sizeof(kMagic) + sizeof(uint64_t), IOError, "checkpoint ", path, ": only ",
                bytes.size(), " bytes, too short to be a checkpoint");
  const size_t body = bytes.size() - sizeof(uint64_t);
  NANODDP_CHECK(std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0, IOError, "checkpoint ", path,
                ": bad magic at byte offset 0 (not a nanoddp checkpoint)");
  uint64_t stored_sum;
  std::memcpy(&stored_sum, bytes.data() + body, sizeof(stored_sum));
  // The version picks the checksum's basis; parse_checkpoint checks it once the checksum holds.
  uint32_t written_version = 0;
  if (body >= sizeof(kMagic) + sizeof(written_version))
    std::memcpy(&written_version, bytes.data() + sizeof(kMagic), sizeof(written_version));
  const uint64_t basis = written_version == 1 ? kCheckpointVersion1OffsetBasis : kFnv1aOffsetBasis;
  if (stored_sum != fnv1a(std::string_view(bytes).substr(0, body), basis)) {
    const std::string cut = where_truncated(bytes);
    NANODDP_CHECK(cut.empty(), IOError, "checkpoint ", path, ": truncated: the file ends at byte offset ",
                  bytes.size(), ", ", cut, " (was its write cut short?)");
    NANODDP_THROW(IOError, "checkpoint ", path, ": checksum mismatch (checksum at byte offset ", body,
                  "): the file is corrupt");
  }
}
}  // namespace

void keep_previous_checkpoint(const std::string& path, const std::function<bool(const std::string&)>& loads) {
  if (::access(path.c_str(), F_OK) != 0) return;
  const std::string previous = path + ".prev", staged = previous + ".tmp";
  const auto path_loads = [&] {
    if (loads) return loads(path);
    try {  // every byte checked, no tensor built
      check_checksum(read_regular_file(path, "checkpoint"), path);
      return true;
    } catch (const Error&) {
      return false;
    }
  };
  if (::access(previous.c_str(), F_OK) == 0 && !path_loads()) return;
  // A save that died after this step and before replacing path left path.prev a link to path
  // itself: it already keeps this very file. (A rename between two links to one file does
  // nothing, and would leave path.prev.tmp behind.) lstat: a symbolic link at path.prev is not
  // that file, and is replaced.
  struct stat current {}, kept {};
  if (::stat(path.c_str(), &current) == 0 && ::lstat(previous.c_str(), &kept) == 0 &&
      current.st_dev == kept.st_dev && current.st_ino == kept.st_ino)
    return;
  // A leftover of a save that died here is a link to a checkpoint; anything else is not ours.
  if (::access(staged.c_str(), F_OK) == 0) {
    NANODDP_CHECK(is_checkpoint_file(staged), IOError, "cannot keep the previous checkpoint ", path, " as ", previous,
                  ": refusing to replace ", staged, ", which is not a nanoddp checkpoint; move it away");
    std::remove(staged.c_str());
  }
  // A symbolic link at path is followed: the save replaces the file it names, which is what
  // path.prev must keep (a link to the link would follow the save to the new checkpoint).
  // A link to another file system (a scratch disk) cannot be hard-linked: a copy is kept.
  if (::linkat(AT_FDCWD, path.c_str(), AT_FDCWD, staged.c_str(), AT_SYMLINK_FOLLOW) != 0) {
    NANODDP_CHECK(errno == EXDEV, IOError, "cannot keep the previous checkpoint ", path, " as ", previous,
                  ": link: ", std::strerror(errno));
    write_file_atomically(staged, read_regular_file(path, "checkpoint"), "checkpoint");
  }
  NANODDP_CHECK(std::rename(staged.c_str(), previous.c_str()) == 0, IOError, "cannot keep the previous checkpoint ",
                path, " as ", previous, ": rename: ", std::strerror(errno));
}

void check_checkpoint_writable(const std::string& path) {
  // A save keeps the file it replaces as path.prev (keep_previous_checkpoint), staged as
  // path.prev.tmp: it replaces those two in turn.
  for (const std::string& replaced : {path, path + ".prev", path + ".prev.tmp"}) {
    check_writable(replaced, "checkpoint");
    check_replaces_only(replaced, "checkpoint", "a nanoddp checkpoint", begins_as_checkpoint);
  }
}

bool is_checkpoint_file(const std::string& path) {
  if (!is_regular_file(path)) return false;  // opening a FIFO would wait for a writer
  std::ifstream in(path, std::ios::binary);
  std::string head(sizeof(kMagic), '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  return in.gcount() == static_cast<std::streamsize>(head.size()) && begins_as_checkpoint(head, 0);
}

StateDict load_checkpoint(const std::string& path) {
  const std::string bytes = read_regular_file(path, "checkpoint");
  return parse_checkpoint(bytes, path);
}

StateDict parse_checkpoint(const std::string& bytes, const std::string& path) {
  check_checksum(bytes, path);
  const size_t body = bytes.size() - sizeof(uint64_t);
  // The checksum proves the bytes are what some writer wrote, not that the writer was sane:
  // every size is still checked against the bytes present before it is trusted.
  Reader in(path, bytes, body);
  in.take(sizeof(kMagic), "magic");
  const uint32_t version = in.get<uint32_t>("version");
  NANODDP_CHECK(version == kVersion || version == 1, IOError, "checkpoint ", path, ": version ", version,
                " at byte offset 8, expected ", kVersion, " (or 1)");
  const uint64_t count = in.get<uint64_t>("tensor count");
  StateDict state;
  // Where each name's entry starts: a second entry of one name would replace the first
  // silently, and which one a reader keeps is not the file's to leave open (save never
  // writes one).
  std::unordered_map<std::string, size_t> entry_offset_of;
  for (uint64_t i = 0; i < count; ++i) {
    const size_t entry_offset = in.offset();
    const uint32_t name_bytes = in.get<uint32_t>("name length");
    NANODDP_CHECK(name_bytes <= kMaxNameBytes, IOError, "checkpoint ", path, ": name length ", name_bytes,
                  " at byte offset ", entry_offset, " exceeds the limit of ", kMaxNameBytes);
    const std::string name(in.take(name_bytes, "name"), name_bytes);
    const auto [first, inserted] = entry_offset_of.emplace(name, entry_offset);
    NANODDP_CHECK(inserted, IOError, "checkpoint ", path, ": a second entry for '", name, "' at byte offset ",
                  entry_offset, " (the first is at byte offset ", first->second, ")");
    const size_t dtype_offset = in.offset();
    const uint8_t dtype = in.get<uint8_t>("dtype");
    const uint8_t dim = in.get<uint8_t>("dim");
    // Every DType save writes (core/device.h numbers them 0 to 5: Float32, Int64, UInt8,
    // Float16, BFloat16, Int32).
    NANODDP_CHECK(dtype <= static_cast<uint8_t>(kLastDType) && dim <= Shape::kMaxDims, IOError, "checkpoint ", path,
                  ": bad dtype ", int(dtype), " or dim ", int(dim), " of '", name, "' at byte offset ", dtype_offset);
    const size_t sizes_offset = in.offset();
    std::vector<int64_t> sizes(dim);
    for (auto& size : sizes) size = in.get<int64_t>("size");
    // Shape checks each size and their product, a zero size included (the other sizes must
    // still multiply within int64); its error becomes one naming the file and the offset.
    Shape shape;
    try {
      shape = Shape(sizes);
    } catch (const ShapeError& e) {
      NANODDP_THROW(IOError, "checkpoint ", path, ": sizes of '", name, "' at byte offset ", sizes_offset,
                    ": ", message_of(e));
    }
    int64_t expected_bytes = 0;
    NANODDP_CHECK(!__builtin_mul_overflow(shape.numel(), static_cast<int64_t>(dtype_size(static_cast<DType>(dtype))),
                                          &expected_bytes),
                  IOError, "checkpoint ", path, ": sizes of '", name, "' at byte offset ", sizes_offset, ": shape ",
                  shape, " of ", static_cast<DType>(dtype), " needs more bytes than int64 can count");
    const uint64_t nbytes = in.get<uint64_t>("byte count");
    NANODDP_CHECK(nbytes == static_cast<uint64_t>(expected_bytes), IOError, "checkpoint ", path, ": '", name,
                  "' at byte offset ", entry_offset, " claims ", nbytes, " bytes for shape ", shape, " of ",
                  static_cast<DType>(dtype), " (", expected_bytes, " bytes)");
    const char* data = in.take(nbytes, "tensor data");  // checks nbytes against the bytes left
    Tensor t = Tensor::empty(shape, static_cast<DType>(dtype));
    if (nbytes > 0) std::memcpy(t.impl()->storage->data(), data, nbytes);
    state[name] = t;
  }
  NANODDP_CHECK(in.offset() == body, IOError, "checkpoint ", path, ": ", body - in.offset(),
                " unexpected bytes at byte offset ", in.offset());
  return state;
}

void merge_prefixed(StateDict& into, const std::string& prefix, const StateDict& part) {
  for (const auto& [name, t] : part) into[prefix + name] = t;
}

StateDict strip_prefix(const StateDict& state, const std::string& prefix) {
  StateDict part;
  for (const auto& [name, t] : state)
    if (name.rfind(prefix, 0) == 0) part[name.substr(prefix.size())] = t;
  return part;
}

}  // namespace nanoddp::nn
