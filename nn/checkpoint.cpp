#include "nn/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "core/hash.h"

namespace nanoddp::nn {

namespace {

constexpr char kMagic[8] = {'N', 'D', 'D', 'P', 'C', 'K', 'P', 'T'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kMaxNameBytes = 4096;

// The folder a checkpoint file lives in ("." for a bare name).
std::string folder_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

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

void write_all(int fd, const std::string& bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    NANODDP_CHECK(n > 0, IOError, "checkpoint ", path, ": write failed at byte offset ", done, ": ",
                  std::strerror(errno));
    done += static_cast<size_t>(n);
  }
}

}  // namespace

void save_checkpoint(const std::string& path, const StateDict& tensors) {
  std::string bytes(kMagic, sizeof(kMagic));
  put<uint32_t>(bytes, kVersion);
  put<uint64_t>(bytes, tensors.size());
  for (const auto& [name, tensor] : tensors) {
    NANODDP_CHECK(name.size() <= kMaxNameBytes, ValueError, "checkpoint: name longer than ", kMaxNameBytes, " bytes");
    const Tensor host = tensor.to(Device::cpu());
    put<uint32_t>(bytes, static_cast<uint32_t>(name.size()));
    bytes += name;
    put<uint8_t>(bytes, static_cast<uint8_t>(host.dtype()));
    put<uint8_t>(bytes, static_cast<uint8_t>(host.dim()));
    for (int64_t size : host.shape().sizes()) put<int64_t>(bytes, size);
    put<uint64_t>(bytes, host.nbytes());
    if (host.nbytes() > 0) bytes.append(static_cast<const char*>(host.impl()->storage->data()), host.nbytes());
  }
  put<uint64_t>(bytes, fnv1a(bytes));

  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  NANODDP_CHECK(fd >= 0, IOError, "checkpoint: cannot create ", tmp, ": ", std::strerror(errno));
  try {
    write_all(fd, bytes, tmp);
    NANODDP_CHECK(::fsync(fd) == 0, IOError, "checkpoint: fsync ", tmp, ": ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    NANODDP_THROW(IOError, "checkpoint: rename ", tmp, " -> ", path, ": ", std::strerror(error));
  }
  // Make the rename itself durable.
  const int dir_fd = ::open(folder_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

void check_checkpoint_writable(const std::string& path) {
  struct stat info {};
  NANODDP_CHECK(::stat(path.c_str(), &info) != 0 || S_ISREG(info.st_mode), IOError, "checkpoint ", path,
                " exists but is not a regular file");
  const std::string dir = folder_of(path);
  NANODDP_CHECK(::access(dir.c_str(), W_OK) == 0, IOError, "checkpoint ", path, ": cannot write in folder ", dir, ": ",
                std::strerror(errno));
}

StateDict load_checkpoint(const std::string& path) {
  struct stat info {};
  NANODDP_CHECK(::stat(path.c_str(), &info) == 0, IOError, "checkpoint ", path, ": cannot open: ", std::strerror(errno));
  NANODDP_CHECK(S_ISREG(info.st_mode), IOError, "checkpoint ", path, ": not a regular file");
  std::ifstream file(path, std::ios::binary);
  NANODDP_CHECK(file.good(), IOError, "checkpoint ", path, ": cannot open: ", std::strerror(errno));
  const std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  NANODDP_CHECK(bytes.size() >= sizeof(kMagic) + sizeof(uint64_t), IOError, "checkpoint ", path, ": only ",
                bytes.size(), " bytes, too short to be a checkpoint");
  const size_t body = bytes.size() - sizeof(uint64_t);
  NANODDP_CHECK(std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0, IOError, "checkpoint ", path,
                ": bad magic at byte offset 0 (not a nanoddp checkpoint)");
  uint64_t stored_sum;
  std::memcpy(&stored_sum, bytes.data() + body, sizeof(stored_sum));
  NANODDP_CHECK(stored_sum == fnv1a(bytes.substr(0, body)), IOError, "checkpoint ", path,
                ": checksum mismatch (checksum at byte offset ", body, "): the file is corrupt");

  Reader in(path, bytes, body);
  in.take(sizeof(kMagic), "magic");
  const uint32_t version = in.get<uint32_t>("version");
  NANODDP_CHECK(version == kVersion, IOError, "checkpoint ", path, ": version ", version, " at byte offset 8, expected ",
                kVersion);
  const uint64_t count = in.get<uint64_t>("tensor count");
  StateDict state;
  for (uint64_t i = 0; i < count; ++i) {
    const size_t entry_offset = in.offset();
    const uint32_t name_bytes = in.get<uint32_t>("name length");
    NANODDP_CHECK(name_bytes <= kMaxNameBytes, IOError, "checkpoint ", path, ": name length ", name_bytes,
                  " at byte offset ", entry_offset);
    const std::string name(in.take(name_bytes, "name"), name_bytes);
    const uint8_t dtype = in.get<uint8_t>("dtype");
    const uint8_t dim = in.get<uint8_t>("dim");
    NANODDP_CHECK(dtype <= static_cast<uint8_t>(DType::UInt8) && dim <= Shape::kMaxDims, IOError, "checkpoint ", path,
                  ": bad dtype/dim of '", name, "' at byte offset ", entry_offset);
    std::vector<int64_t> sizes(dim);
    for (auto& size : sizes) size = in.get<int64_t>("size");
    const Shape shape(sizes);
    const uint64_t nbytes = in.get<uint64_t>("byte count");
    NANODDP_CHECK(nbytes == static_cast<uint64_t>(shape.numel()) * dtype_size(static_cast<DType>(dtype)), IOError,
                  "checkpoint ", path, ": '", name, "' at byte offset ", entry_offset, " claims ", nbytes,
                  " bytes for shape ", shape);
    const char* data = in.take(nbytes, "tensor data");
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
