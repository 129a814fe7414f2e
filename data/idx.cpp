#include "data/idx.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "core/error.h"
#include "core/file_io.h"

namespace nanoddp::data {

namespace {

constexpr uint8_t kTypeUnsignedByte = 0x08;
// Reads grow the buffer by at most this much at a time, so memory follows the bytes that
// really arrive, never the header's promise.
constexpr size_t kChunkBytes = size_t{4} << 20;  // 4 MiB
// gzread's internal buffer; larger than zlib's 8 KiB default to cut calls on 47 MB files.
constexpr unsigned kGzBufferBytes = 256u << 10;  // 256 KiB

struct GzFileCloser {
  void operator()(gzFile file) const { gzclose(file); }
};
using GzFile = std::unique_ptr<gzFile_s, GzFileCloser>;

// A gzip or raw file being read, with the byte offset reached in its (decompressed) stream
// for error messages.
class IdxStream {
 public:
  explicit IdxStream(const std::string& path) : path_(path) {
    // Opened without blocking and checked on the open descriptor: gzopen would read a folder
    // as a failed stream, and wait forever on a FIFO without a writer or on a terminal.
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    NANODDP_CHECK(fd >= 0, IOError, "cannot open IDX file '", path_, "': ", std::strerror(errno));
    struct stat info {};
    if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
      const bool folder = S_ISDIR(info.st_mode);
      ::close(fd);
      NANODDP_THROW(IOError, "cannot open IDX file '", path_,
                    "': ", folder ? "it is a folder" : "not a regular file");
    }
    file_bytes_ = static_cast<uint64_t>(info.st_size);
    errno = 0;
    file_.reset(gzdopen(fd, "rb"));
    if (file_ == nullptr) {
      const int error = errno;
      ::close(fd);
      NANODDP_THROW(IOError, "cannot open IDX file '", path_,
                    "': ", error != 0 ? std::strerror(error) : "out of memory");
    }
    // No larger than the file: a small file then costs no 768 KiB of zlib buffers.
    gzbuffer(file_.get(), static_cast<unsigned>(std::clamp<uint64_t>(file_bytes_, 8192, kGzBufferBytes)));
  }

  // Reads up to n bytes into out; returns how many arrived (< n only at the end of the data).
  // A corrupt or cut gzip stream throws IOError at the offset reached.
  size_t read(uint8_t* out, size_t n) {
    size_t total = 0;
    while (total < n) {
      const auto want = static_cast<unsigned>(std::min<size_t>(n - total, 1u << 30));
      const int got = gzread(file_.get(), out + total, want);
      if (got < 0) fail_stream();
      if (got == 0) {
        // gzread reports a stream cut short as a plain end (0 bytes) and records the error;
        // a clean end leaves Z_OK.
        int errnum = Z_OK;
        gzerror(file_.get(), &errnum);
        if (errnum != Z_OK) fail_stream();
        break;
      }
      total += static_cast<size_t>(got);
      offset_ += static_cast<uint64_t>(got);
    }
    return total;
  }

  // Where the next byte would come from: "byte offset 16" or, for gzip, "byte offset 16 of the
  // decompressed stream".
  std::string where(uint64_t offset) const {
    std::string text = "byte offset " + std::to_string(offset);
    if (!gzdirect(file_.get())) text += " of the decompressed stream";
    return text;
  }

  uint64_t offset() const { return offset_; }
  const std::string& path() const { return path_; }

  // The most data bytes the file can hold after a header of header_bytes: exact for a raw
  // file, 1032 x its size for gzip (deflate never expands a byte past that ratio).
  uint64_t most_data_bytes(size_t header_bytes) const {
    if (file_bytes_ == UINT64_MAX) return UINT64_MAX;  // not a regular file (a pipe): unknown
    if (gzdirect(file_.get())) return file_bytes_ > header_bytes ? file_bytes_ - header_bytes : 0;
    constexpr uint64_t kMaxDeflateRatio = 1032;
    return file_bytes_ <= UINT64_MAX / kMaxDeflateRatio ? file_bytes_ * kMaxDeflateRatio : UINT64_MAX;
  }

 private:
  // zlib reads ahead (a whole small file at once) and checks the trailer's CRC only at the
  // end, so the error can come before gzread delivered a byte: the message gives both how far
  // the decompressed data got and how far into the file zlib had read when it stopped.
  [[noreturn]] void fail_stream() const {
    int errnum = Z_OK;
    const char* message = gzerror(file_.get(), &errnum);
    const std::string reason = errnum == Z_ERRNO ? std::strerror(errno) : message;
    const z_off_t read_to = gzoffset(file_.get());
    const std::string file_position =
        read_to < 0 ? std::string()
                    : ", zlib having read the file to byte offset " + std::to_string(read_to) +
                          (file_bytes_ != UINT64_MAX ? " of " + std::to_string(file_bytes_) : std::string());
    NANODDP_THROW(IOError, "IDX file '", path_, "': corrupt or truncated gzip data after ", where(offset_),
                  file_position, " (zlib: ", reason, ")");
  }

  std::string path_;
  GzFile file_;
  uint64_t file_bytes_ = UINT64_MAX;  // the file's size on disk; UINT64_MAX when unknown
  uint64_t offset_ = 0;
};

uint32_t big_endian_u32(const uint8_t* bytes) {
  return (uint32_t{bytes[0]} << 24) | (uint32_t{bytes[1]} << 16) | (uint32_t{bytes[2]} << 8) |
         uint32_t{bytes[3]};
}

std::string hex_magic(const uint8_t* bytes) {
  static const char* digits = "0123456789abcdef";
  std::string text = "0x";
  for (int i = 0; i < 4; ++i) {
    text += digits[bytes[i] >> 4];
    text += digits[bytes[i] & 15];
  }
  return text;
}

std::string join_sizes(const std::vector<int64_t>& sizes) {
  std::string text;
  for (size_t d = 0; d < sizes.size(); ++d) text += (d > 0 ? "x" : "") + std::to_string(sizes[d]);
  return text;
}

// "2x3x4 = 24 data bytes" (or "24 data bytes" for one dimension).
std::string promised(const std::vector<int64_t>& sizes, uint64_t data_bytes) {
  const std::string bytes = std::to_string(data_bytes) + " data bytes";
  return sizes.size() > 1 ? join_sizes(sizes) + " = " + bytes : bytes;
}

}  // namespace

Tensor read_idx(const std::string& path, int dims) {
  NANODDP_CHECK(dims >= 1 && dims <= Shape::kMaxDims, ValueError, "read_idx: dims must be in [1, ",
                Shape::kMaxDims, "], got ", dims);
  IdxStream stream(path);

  // ---- magic: 0x00 0x00 <type> <dims> ----
  uint8_t magic[4];
  const size_t magic_got = stream.read(magic, 4);
  NANODDP_CHECK(magic_got == 4, IOError, "IDX file '", path, "': truncated at ", stream.where(magic_got),
                ": the 4-byte magic number needs ", 4 - magic_got, " more byte(s)");
  const uint8_t expected[4] = {0, 0, kTypeUnsignedByte, static_cast<uint8_t>(dims)};
  NANODDP_CHECK(std::equal(magic, magic + 4, expected), IOError, "IDX file '", path, "': bad magic number ",
                hex_magic(magic), " at ", stream.where(0), ", expected ", hex_magic(expected),
                " (unsigned bytes in ", dims, " dimension(s))",
                magic[0] == 0x1f && magic[1] == 0x8b ? "; the file looks gzipped twice" : "");

  // ---- sizes: dims x uint32 big-endian ----
  const size_t header_bytes = 4 + 4 * static_cast<size_t>(dims);
  uint8_t size_bytes[4 * Shape::kMaxDims];
  const size_t sizes_got = stream.read(size_bytes, 4 * static_cast<size_t>(dims));
  NANODDP_CHECK(sizes_got == 4 * static_cast<size_t>(dims), IOError, "IDX file '", path, "': truncated at ",
                stream.where(4 + sizes_got), ": the header of ", dims, " dimension size(s) ends at byte ",
                header_bytes);
  std::vector<int64_t> sizes(dims);
  // Each size is < 2^32, so the product of up to 4 cannot be formed in 64 bits; stop at a
  // bound no real file reaches. Any product below it is checked against the data anyway.
  constexpr uint64_t kMaxDataBytes = uint64_t{1} << 48;
  uint64_t data_bytes = 1;
  for (int d = 0; d < dims; ++d) sizes[d] = big_endian_u32(size_bytes + 4 * d);
  // The bound applies to the nonzero sizes even when one size is 0 (no data at all), so that
  // no partial product of the shape can overflow int64 later.
  bool empty = false;
  for (int d = 0; d < dims; ++d) {
    const auto size = static_cast<uint64_t>(sizes[d]);
    if (size == 0) {
      empty = true;
      continue;
    }
    NANODDP_CHECK(data_bytes <= kMaxDataBytes / size, IOError, "IDX file '", path,
                  "': corrupt header at byte offset 4: dimension sizes ", join_sizes(sizes),
                  " promise more than 2^48 bytes");
    data_bytes *= size;
  }
  if (empty) data_bytes = 0;

  // ---- data: exactly data_bytes, read in chunks straight into the tensor ----
  // Allocating before reading is safe up to kEagerBytes: untouched pages cost no memory, so a
  // lying header costs address space, not RAM, and the read below stops at the real end.
  // Beyond it (no real file comes close) nothing is allocated that has not arrived.
  constexpr uint64_t kEagerBytes = uint64_t{1} << 30;
  std::vector<uint8_t> spill;
  Tensor out;
  // The file's own size bounds what it can hold: the bytes after the header of a raw file, or
  // 1032 times a gzip file's size (deflate's largest ratio). A header promising more than that
  // lies; it is read in chunks, so the error comes at the real end without a huge allocation.
  const uint64_t holdable = stream.most_data_bytes(header_bytes);
  // Set when the tensor cannot be allocated (ulimit -v): the data is read and dropped chunk by
  // chunk, so that a lying header still ends as the truncation IOError below, and an honest
  // file as an error naming it and its size.
  bool no_room = false;
  std::vector<uint8_t> dropped;
  if (data_bytes <= kEagerBytes && data_bytes <= holdable) {
    try {
      out = Tensor::empty(Shape(sizes), DType::UInt8);
    } catch (const ValueError&) {
      no_room = true;
      dropped.resize(kChunkBytes);
    }
  }
  uint64_t done = 0;
  while (done < data_bytes) {
    // Past what the file can hold, ask for one byte more than it can: the read comes up short
    // at the real end (the error below) without growing the buffer for bytes that cannot come.
    const uint64_t can_come = holdable > done ? holdable - done : 0;
    const uint64_t ask = can_come == UINT64_MAX ? can_come : can_come + 1;
    const size_t want = static_cast<size_t>(std::min<uint64_t>({data_bytes - done, kChunkBytes, ask}));
    uint8_t* target = nullptr;
    if (out.defined()) {
      target = out.data<uint8_t>() + done;
    } else if (no_room) {
      target = dropped.data();
    } else {
      spill.resize(done + want);
      target = spill.data() + done;
    }
    const size_t got = stream.read(target, want);
    done += got;
    NANODDP_CHECK(got == want, IOError, "IDX file '", path, "': truncated at ", stream.where(header_bytes + done),
                  ": header promises ", promised(sizes, data_bytes), " after the ", header_bytes, "-byte header, got ",
                  done);
  }
  uint8_t extra = 0;
  NANODDP_CHECK(stream.read(&extra, 1) == 0, IOError, "IDX file '", path, "': unexpected data at ",
                stream.where(header_bytes + data_bytes), ": header promises ", promised(sizes, data_bytes),
                " after the ", header_bytes, "-byte header, but the file goes on");
  NANODDP_CHECK(!no_room, ValueError, "IDX file '", path, "': its ", promised(sizes, data_bytes),
                " do not fit in this process's memory (ulimit -v?)");
  if (!out.defined()) {
    out = Tensor::empty(Shape(sizes), DType::UInt8);
    std::memcpy(out.data<uint8_t>(), spill.data(), spill.size());
  }
  return out;
}

Tensor read_idx_images(const std::string& path) {
  Tensor images = read_idx(path, 3);
  // Sizes sit at byte offsets 4 (count), 8 (rows), 12 (cols).
  NANODDP_CHECK(images.size(1) > 0 && images.size(2) > 0, IOError, "IDX file '", path,
                "': bad dimensions at byte offset ", images.size(1) == 0 ? 8 : 12, ": images of ",
                images.size(1), "x", images.size(2), " pixels");
  return images;
}

Tensor read_idx_labels(const std::string& path) {
  const Tensor bytes = read_idx(path, 1);
  const int64_t N = bytes.size(0);
  Tensor labels = Tensor::empty({N}, DType::Int64);
  const uint8_t* in = N > 0 ? bytes.data<uint8_t>() : nullptr;
  int64_t* out = N > 0 ? labels.data<int64_t>() : nullptr;
  for (int64_t i = 0; i < N; ++i) out[i] = in[i];
  return labels;
}

namespace {
// bytes as one gzip member (deflate's windowBits 15 + 16 asks for the gzip wrapper), as gzip
// and torchvision's files are.
std::string gzip_compressed(const std::string& bytes, const std::string& path) {
  z_stream stream{};
  NANODDP_CHECK(
      deflateInit2(&stream, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK,
      IOError, "write_idx ", path, ": zlib cannot start compressing (out of memory)");
  struct End {  // deflateEnd on every way out, a throw from append included
    z_stream* stream;
    ~End() { deflateEnd(stream); }
  } end{&stream};
  std::string out;
  size_t offset = 0;
  int status = Z_OK;
  char chunk[1 << 16];
  while (status != Z_STREAM_END) {
    const size_t in = std::min<size_t>(bytes.size() - offset, 1u << 30);
    stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data() + offset));
    stream.avail_in = static_cast<uInt>(in);
    const int flush = offset + in == bytes.size() ? Z_FINISH : Z_NO_FLUSH;
    do {
      stream.next_out = reinterpret_cast<Bytef*>(chunk);
      stream.avail_out = sizeof chunk;
      status = deflate(&stream, flush);
      NANODDP_CHECK(status == Z_OK || status == Z_STREAM_END || status == Z_BUF_ERROR, IOError, "write_idx ",
                    path, ": zlib failed to compress (error ", status, ")");
      out.append(chunk, sizeof chunk - stream.avail_out);
    } while (stream.avail_out == 0);
    offset += in - stream.avail_in;
  }
  return out;
}
}  // namespace

void write_idx(const std::string& path, const Tensor& data, bool gzip) {
  NANODDP_CHECK(data.dtype() == DType::UInt8, ValueError, "write_idx: data must be uint8, got ",
                data.dtype());
  NANODDP_CHECK(data.dim() >= 1, ShapeError, "write_idx: data must have 1 to ", Shape::kMaxDims,
                " dimensions, got ", data.shape());
  const Tensor host = data.to(Device::cpu());
  std::vector<uint8_t> header{0, 0, kTypeUnsignedByte, static_cast<uint8_t>(data.dim())};
  for (int d = 0; d < data.dim(); ++d) {
    const int64_t size = data.size(d);
    NANODDP_CHECK(size <= std::numeric_limits<uint32_t>::max(), ShapeError, "write_idx: size ", size,
                  " of dimension ", d, " does not fit in the IDX header's uint32");
    for (int shift = 24; shift >= 0; shift -= 8) header.push_back(static_cast<uint8_t>(size >> shift));
  }

  std::string bytes(header.begin(), header.end());
  if (host.numel() > 0) bytes.append(reinterpret_cast<const char*>(host.data<uint8_t>()), host.nbytes());
  if (gzip) bytes = gzip_compressed(bytes, path);
  write_file_atomically(path, bytes, "write_idx");  // the old file or the new one, never half
}

}  // namespace nanoddp::data
