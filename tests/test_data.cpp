// data/: the IDX reader on hand-built files (raw, and gzip written by the small encoder
// below, independent of zlib), TensorDataset, DataLoader batching and prefetch, and
// FashionMNIST on small hand-built files and on the real ones when installed.
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "data/dataloader.h"
#include "data/dataset.h"
#include "data/fashion_mnist.h"
#include "data/idx.h"
#include "data/sampler.h"
#include "kernels/device_memory.h"
#include "kernels/kernels.h"
#include "tests/address_sanitizer.h"
#include "tests/subprocess.h"

using namespace nanoddp;
using namespace nanoddp::data;
namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

namespace {

// A folder under /tmp for this process, removed at exit.
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("nanoddp_test_data_" + std::to_string(getpid()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};
const TempDir& temp() {
  static TempDir dir;
  return dir;
}

void put_u32(Bytes& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(v >> shift));
}

// Header (magic 0x000008<D>, sizes) followed by data.
Bytes idx_bytes(uint8_t type, const std::vector<uint32_t>& sizes, const Bytes& data) {
  Bytes out{0, 0, type, static_cast<uint8_t>(sizes.size())};
  for (uint32_t s : sizes) put_u32(out, s);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

Bytes pattern(size_t n, int mul = 7) {
  Bytes out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>((i * mul + 3) % 256);
  return out;
}

uint32_t crc32(const Bytes& data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (uint8_t byte : data) {
    crc ^= byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

// A gzip member (RFC 1952) holding data in deflate "stored" blocks (RFC 1951, BTYPE 00).
Bytes gzip_stored(const Bytes& data) {
  Bytes out{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff};
  size_t pos = 0;
  do {
    const size_t len = std::min<size_t>(data.size() - pos, 65535);
    const bool final = pos + len == data.size();
    out.push_back(final ? 1 : 0);
    out.push_back(static_cast<uint8_t>(len));
    out.push_back(static_cast<uint8_t>(len >> 8));
    out.push_back(static_cast<uint8_t>(~len));
    out.push_back(static_cast<uint8_t>(~len >> 8));
    out.insert(out.end(), data.begin() + pos, data.begin() + pos + len);
    pos += len;
  } while (pos < data.size());
  const uint32_t crc = crc32(data);
  const auto size = static_cast<uint32_t>(data.size());
  for (int shift = 0; shift < 32; shift += 8) out.push_back(static_cast<uint8_t>(crc >> shift));
  for (int shift = 0; shift < 32; shift += 8) out.push_back(static_cast<uint8_t>(size >> shift));
  return out;
}

std::string write_file(const std::string& name, const Bytes& bytes) {
  const std::string path = temp().file(name);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
  return path;
}

Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

// The IOError message of fn(), or "" when it throws none.
template <typename Fn>
std::string io_error(Fn fn) {
  try {
    fn();
  } catch (const IOError& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::vector<float> floats(const Tensor& t) { return t.to_vector(); }

}  // namespace

// ---- IDX reader ---------------------------------------------------------------------------

TEST_CASE("read_idx_images: a good file, raw and gzipped, gives the header's shape and the bytes") {
  const Bytes data = pattern(2 * 3 * 4);
  const Bytes file = idx_bytes(8, {2, 3, 4}, data);
  for (const std::string& path : {write_file("good-raw", file), write_file("good.gz", gzip_stored(file))}) {
    CAPTURE(path);
    const Tensor images = read_idx_images(path);
    CHECK(images.dtype() == DType::UInt8);
    CHECK(images.shape() == Shape{2, 3, 4});
    const uint8_t* p = images.data<uint8_t>();
    CHECK(Bytes(p, p + data.size()) == data);
  }
}

TEST_CASE("read_idx_labels: uint8 on disk, int64 in memory") {
  const Bytes data{9, 0, 0, 3, 255};
  for (const std::string& path : {write_file("labels-raw", idx_bytes(8, {5}, data)),
                                  write_file("labels.gz", gzip_stored(idx_bytes(8, {5}, data)))}) {
    const Tensor labels = read_idx_labels(path);
    CHECK(labels.dtype() == DType::Int64);
    CHECK(labels.to_int_vector() == std::vector<int64_t>{9, 0, 0, 3, 255});
  }
  // An empty label file is valid.
  CHECK(read_idx_labels(write_file("labels-empty", idx_bytes(8, {0}, {}))).numel() == 0);
}

TEST_CASE("a gzip stream of several stored blocks (> 64 KiB) reads back whole") {
  const Bytes data = pattern(3 * 150 * 200, 13);
  const std::string path = write_file("big.gz", gzip_stored(idx_bytes(8, {3, 150, 200}, data)));
  const Tensor images = read_idx_images(path);
  CHECK(images.shape() == Shape{3, 150, 200});
  CHECK(Bytes(images.data<uint8_t>(), images.data<uint8_t>() + data.size()) == data);
}

TEST_CASE("truncated data: IOError with the file and the offset where the data stops") {
  const Bytes file = idx_bytes(8, {2, 3, 4}, pattern(20));  // header promises 24 bytes
  const std::string raw = write_file("short-raw", file);
  std::string message = io_error([&] { read_idx_images(raw); });
  CHECK(contains(message, raw));
  CHECK(contains(message, "truncated at byte offset 36"));  // 16-byte header + 20
  CHECK(contains(message, "2x3x4 = 24 data bytes"));

  const std::string gz = write_file("short.gz", gzip_stored(file));
  message = io_error([&] { read_idx_images(gz); });
  CHECK(contains(message, gz));
  CHECK(contains(message, "truncated at byte offset 36 of the decompressed stream"));
}

TEST_CASE("extra bytes after the promised data: IOError at the first extra byte") {
  const Bytes file = idx_bytes(8, {2, 3, 4}, pattern(25));
  for (const std::string& path : {write_file("long-raw", file), write_file("long.gz", gzip_stored(file))}) {
    const std::string message = io_error([&] { read_idx_images(path); });
    CHECK(contains(message, path));
    CHECK(contains(message, "unexpected data at byte offset 40"));
  }
}

TEST_CASE("truncated header and empty file") {
  const std::string empty = write_file("empty", {});
  std::string message = io_error([&] { read_idx_images(empty); });
  CHECK(contains(message, empty));
  CHECK(contains(message, "truncated at byte offset 0"));

  const std::string cut = write_file("cut-header", {0, 0, 8, 3, 0, 0, 0, 2, 0, 0});  // 10 of 16 bytes
  message = io_error([&] { read_idx_images(cut); });
  CHECK(contains(message, cut));
  CHECK(contains(message, "truncated at byte offset 10"));
}

TEST_CASE("wrong magic: labels read as images, another element type, a gzip inside a gzip") {
  const std::string labels = write_file("labels-as-images", idx_bytes(8, {4}, pattern(4)));
  std::string message = io_error([&] { read_idx_images(labels); });
  CHECK(contains(message, labels));
  CHECK(contains(message, "bad magic number 0x00000801 at byte offset 0, expected 0x00000803"));

  const std::string ints = write_file("int32-type", idx_bytes(0x0c, {1, 1, 1}, pattern(4)));
  message = io_error([&] { read_idx_images(ints); });
  CHECK(contains(message, "bad magic number 0x00000c03"));

  const std::string twice = write_file("twice.gz", gzip_stored(gzip_stored(idx_bytes(8, {1}, {1}))));
  message = io_error([&] { read_idx_labels(twice); });
  CHECK(contains(message, "byte offset 0 of the decompressed stream"));
  CHECK(contains(message, "gzipped twice"));
}

TEST_CASE("bad dimensions: zero-sized images, and a header promising absurd sizes") {
  const std::string zero_rows = write_file("zero-rows", idx_bytes(8, {5, 0, 28}, {}));
  std::string message = io_error([&] { read_idx_images(zero_rows); });
  CHECK(contains(message, zero_rows));
  CHECK(contains(message, "bad dimensions at byte offset 8"));

  // Sizes whose product passes 2^48 are rejected even beside a zero.
  const std::string zero_huge = write_file("zero-huge", idx_bytes(8, {0xFFFFFFFFu, 0xFFFFFFFFu, 0}, {}));
  CHECK(contains(io_error([&] { read_idx_images(zero_huge); }), "more than 2^48 bytes"));
  // A zero beside ordinary sizes: a valid empty file, and the zero-sized image is reported.
  const std::string zero_cols = write_file("zero-cols", idx_bytes(8, {70000, 28, 0}, {}));
  CHECK(contains(io_error([&] { read_idx_images(zero_cols); }), "bad dimensions at byte offset 12"));

  // 2^32-1 cubed cannot even be multiplied out: rejected from the header alone.
  const std::string huge =
      write_file("huge", idx_bytes(8, {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}, pattern(10)));
  message = io_error([&] { read_idx_images(huge); });
  CHECK(contains(message, huge));
  CHECK(contains(message, "more than 2^48 bytes"));

  // 65536 x 65536 x 1000 = 4.3 TB promised, 10 bytes present: a truncation error, and the
  // reader never allocates what the header promises (this would throw bad_alloc otherwise).
  const std::string big = write_file("big-promise", idx_bytes(8, {65536, 65536, 1000}, pattern(10)));
  message = io_error([&] { read_idx_images(big); });
  CHECK(contains(message, "truncated at byte offset 26"));
}

TEST_CASE("a gzip header that lies, read with little address space: still the truncation IOError") {
  // 600 KB of data, stored: the gzip file could hold 1032 times that, so the 600 MB the
  // header promises are allocated up front, unless the address space (ulimit -v) refuses.
  if (kUnderAddressSanitizer) {
    MESSAGE("skipped under AddressSanitizer: its allocator aborts where malloc returns null");
    return;
  }
  const std::string path =
      write_file("lying.gz", gzip_stored(idx_bytes(8, {600, 1000, 1000}, pattern(600000))));
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // This process's mapped size now, and 256 MB more.
    long vm_kb = 0;
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("VmSize:", 0) == 0) vm_kb = std::stol(line.substr(7));
    const rlim_t limit = static_cast<rlim_t>(vm_kb + (256 << 10)) << 10;
    const rlimit address_space{limit, limit};
    if (::setrlimit(RLIMIT_AS, &address_space) != 0) ::_exit(3);
    try {
      read_idx_images(path);
    } catch (const IOError& e) {
      ::_exit(contains(e.what(), path) && contains(e.what(), "truncated") ? 0 : 1);
    } catch (...) {
      ::_exit(1);  // such as "ValueError: out of host memory allocating 600000000 bytes"
    }
    ::_exit(2);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("corrupt gzip: a cut stream and a wrong checksum are IOErrors naming the file") {
  const Bytes gz = gzip_stored(idx_bytes(8, {2, 3, 4}, pattern(24)));
  const std::string cut = write_file("cut.gz", Bytes(gz.begin(), gz.begin() + 30));
  std::string message = io_error([&] { read_idx_images(cut); });
  CHECK(contains(message, cut));
  CHECK(contains(message, "byte offset"));

  Bytes bad_crc = gz;
  bad_crc[bad_crc.size() - 8] ^= 0xff;  // first CRC byte
  const std::string crc = write_file("bad-crc.gz", bad_crc);
  message = io_error([&] { read_idx_images(crc); });
  CHECK(contains(message, crc));
  CHECK(contains(message, "corrupt or truncated gzip data"));
  // The checksum is in the 8-byte trailer: zlib stopped there, whatever it had delivered.
  const std::string at = "zlib having read the file to byte offset ";
  REQUIRE_MESSAGE(contains(message, at), message);
  const size_t stopped = std::stoul(message.substr(message.find(at) + at.size()));
  CHECK(stopped >= bad_crc.size() - 8);
  CHECK(stopped <= bad_crc.size());
  CHECK(contains(message, " of " + std::to_string(bad_crc.size()) + " (zlib: "));
}

TEST_CASE("a missing file, a folder, a FIFO: IOError with the path and what it is, before any read") {
  const std::string path = temp().file("does-not-exist.gz");
  const std::string message = io_error([&] { read_idx_images(path); });
  CHECK(contains(message, path));
  CHECK(contains(message, "No such file or directory"));
  const std::string folder = temp().file("a-folder");
  REQUIRE(::mkdir(folder.c_str(), 0700) == 0);
  CHECK(contains(io_error([&] { read_idx_images(folder); }),
                 "cannot open IDX file '" + folder + "': it is a folder"));
  // A FIFO without a writer would block the open forever.
  const std::string fifo = temp().file("a-fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK(contains(io_error([&] { read_idx_labels(fifo); }),
                 "cannot open IDX file '" + fifo + "': not a regular file"));
  std::remove(fifo.c_str());
  ::rmdir(folder.c_str());
}

TEST_CASE("write_idx writes what read_idx reads, raw and gzipped; raw bytes are the format's") {
  Tensor data = Tensor::empty({2, 5, 3}, DType::UInt8);
  const Bytes values = pattern(30, 11);
  std::copy(values.begin(), values.end(), data.data<uint8_t>());
  for (bool gzip : {false, true}) {
    const std::string path = temp().file(gzip ? "written.gz" : "written-raw");
    write_idx(path, data, gzip);
    const Tensor back = read_idx(path, 3);
    CHECK(back.shape() == data.shape());
    CHECK(Bytes(back.data<uint8_t>(), back.data<uint8_t>() + 30) == values);
    if (!gzip) CHECK(read_file(path) == idx_bytes(8, {2, 5, 3}, values));
    if (gzip) CHECK(read_file(path)[0] == 0x1f);
  }
  CHECK_THROWS_AS(write_idx(temp().file("f"), Tensor::zeros({2}), false), ValueError);
}

TEST_CASE("write_idx past the file size limit is an IOError, and the file it replaces stays whole") {
  const std::string path = temp().file("limited-idx1-ubyte");
  Tensor small = Tensor::empty({4}, DType::UInt8), large = Tensor::empty({65536}, DType::UInt8);
  std::fill(small.data<uint8_t>(), small.data<uint8_t>() + 4, 7);
  std::fill(large.data<uint8_t>(), large.data<uint8_t>() + 65536, 9);
  write_idx(path, small, false);
  // Killed by SIGXFSZ before, and with the old file already cut to the limit.
  const std::string message =
      testing::io_error_past_file_size_limit(32768, [&] { write_idx(path, large, false); });
  CHECK_MESSAGE(message.find("write_idx " + path + ": write failed at byte offset 32768") == 0, message);
  CHECK(read_idx_labels(path).to_int_vector() == std::vector<int64_t>{7, 7, 7, 7});
}

// ---- TensorDataset -----------------------------------------------------------------------

namespace {

// inputs [N, 2] = (i, 10 i), targets [N] = 100 + i
std::shared_ptr<TensorDataset> numbered(int64_t N) {
  std::vector<float> x;
  std::vector<int64_t> y;
  for (int64_t i = 0; i < N; ++i) {
    x.push_back(static_cast<float>(i));
    x.push_back(static_cast<float>(10 * i));
    y.push_back(100 + i);
  }
  return std::make_shared<TensorDataset>(Tensor::from_vector(x, {N, 2}), Tensor::from_vector(y, {N}));
}

}  // namespace

TEST_CASE("TensorDataset: rows, shapes and errors") {
  auto ds = numbered(5);
  CHECK(ds->size() == 5);
  const Example e = ds->get(3);
  CHECK(e.input.shape() == Shape{2});
  CHECK(floats(e.input) == std::vector<float>{3, 30});
  CHECK(e.target.shape() == Shape{});
  CHECK(e.target.dtype() == DType::Int64);
  CHECK(e.target.to_int_vector() == std::vector<int64_t>{103});

  const Batch b = ds->get_batch({4, 0, 4});
  CHECK(b.input.shape() == Shape{3, 2});
  CHECK(floats(b.input) == std::vector<float>{4, 40, 0, 0, 4, 40});
  CHECK(b.target.to_int_vector() == std::vector<int64_t>{104, 100, 104});

  CHECK_THROWS_AS(ds->get(5), IndexError);
  CHECK_THROWS_AS(ds->get(-1), IndexError);
  CHECK_THROWS_AS(ds->get_batch({0, 5}), IndexError);
  CHECK_THROWS_AS(TensorDataset(Tensor::zeros({3, 2}), Tensor::zeros({4})), ShapeError);
  CHECK_THROWS_AS(TensorDataset(Tensor::zeros({3, 2}), Tensor::zeros({})), ShapeError);
}

namespace {

// A dataset with only get(): exercises the default stacking of Dataset::get_batch.
// Example i: input [2, 2] = i + (0, 0.25, 0.5, 0.75), target [] int64 = i mod 3.
// get throws ValueError at fail_at.
class Computed : public Dataset {
 public:
  explicit Computed(int64_t n, int64_t fail_at = -1) : n_(n), fail_at_(fail_at) {}
  int64_t size() const override { return n_; }
  Example get(int64_t i) const override {
    NANODDP_CHECK(i >= 0 && i < n_, IndexError, "Computed: index ", i);
    NANODDP_CHECK(i != fail_at_, ValueError, "Computed: example ", i, " is broken");
    const float f = static_cast<float>(i);
    Tensor target = Tensor::empty(Shape{}, DType::Int64);  // [] int64, as a label
    *target.data<int64_t>() = i % 3;
    return {Tensor::from_vector(std::vector<float>{f, f + 0.25f, f + 0.5f, f + 0.75f}, {2, 2}), target};
  }

 private:
  int64_t n_;
  int64_t fail_at_;
};

}  // namespace

TEST_CASE("Dataset::get_batch by default stacks get() results") {
  Computed ds(6);
  const Batch b = ds.get_batch({5, 1});
  CHECK(b.input.shape() == Shape{2, 2, 2});
  CHECK(floats(b.input) == std::vector<float>{5, 5.25f, 5.5f, 5.75f, 1, 1.25f, 1.5f, 1.75f});
  CHECK(b.target.shape() == Shape{2});
  CHECK(b.target.to_int_vector() == std::vector<int64_t>{2, 1});
  CHECK_THROWS_AS(ds.get_batch({}), ValueError);

  // A get() that returns an undefined tensor: the error names the example and the tensor.
  struct Holey : Dataset {
    int64_t size() const override { return 4; }
    Example get(int64_t index) const override {
      return {index == 2 ? Tensor() : Tensor::full({2}, 1.0f),
              Tensor::from_vector(std::vector<int64_t>{index}, {})};
    }
  } holey;
  CHECK(holey.get_batch({0, 1}).input.shape() == Shape{2, 2});
  try {
    holey.get_batch({1, 2});
    FAIL("expected ValueError");
  } catch (const ValueError& e) {
    CHECK(std::string(e.what()).find("example 2 has an undefined input") != std::string::npos);
  }
}

// ---- DataLoader --------------------------------------------------------------------------

namespace {

std::vector<Batch> collect(DataLoader& loader) {
  std::vector<Batch> out;
  for (const Batch& b : loader) out.push_back(b);
  return out;
}

std::vector<int64_t> targets_of(const std::vector<Batch>& batches) {
  std::vector<int64_t> out;
  for (const Batch& b : batches)
    for (int64_t t : b.target.to_int_vector()) out.push_back(t);
  return out;
}

}  // namespace

TEST_CASE("DataLoader: batch shapes, values, the last partial batch, drop_last") {
  auto ds = numbered(10);
  DataLoader loader(ds, 4);
  CHECK(loader.size() == 3);
  std::vector<Batch> batches = collect(loader);
  REQUIRE(batches.size() == 3);
  CHECK(batches[0].input.shape() == Shape{4, 2});
  CHECK(batches[2].input.shape() == Shape{2, 2});
  CHECK(batches[2].target.shape() == Shape{2});
  CHECK(floats(batches[1].input) == std::vector<float>{4, 40, 5, 50, 6, 60, 7, 70});
  CHECK(targets_of(batches) == std::vector<int64_t>{100, 101, 102, 103, 104, 105, 106, 107, 108, 109});

  DataLoaderOptions options;
  options.drop_last = true;
  DataLoader dropping(ds, 4, options);
  CHECK(dropping.size() == 2);
  batches = collect(dropping);
  REQUIRE(batches.size() == 2);
  CHECK(targets_of(batches) == std::vector<int64_t>{100, 101, 102, 103, 104, 105, 106, 107});

  // A batch size past the dataset: one partial batch, or none with drop_last.
  DataLoader one(ds, 64);
  CHECK(collect(one).size() == 1);
  DataLoader none(ds, 64, options);
  CHECK(none.size() == 0);
  CHECK(none.begin() == none.end());

  // The largest batch size: ceil(10 / (2^63 - 1)) is 1 (formed as (10 + 2^63 - 2) / (2^63 - 1)
  // it would wrap negative).
  DataLoader huge(ds, INT64_MAX);
  CHECK(huge.size() == 1);
  batches = collect(huge);
  REQUIRE(batches.size() == 1);
  CHECK(batches[0].target.shape() == Shape{10});
  CHECK(DataLoader(ds, INT64_MAX, options).size() == 0);
}

TEST_CASE("DataLoader with a DistributedSampler: this rank's indices, batched in order") {
  auto ds = numbered(10);
  DataLoader loader(ds, 3, DistributedSampler(10, 3, 1, /*shuffle=*/false));
  CHECK(loader.size() == 2);  // 4 indices: 1 4 7 0
  const std::vector<Batch> batches = collect(loader);
  REQUIRE(batches.size() == 2);
  CHECK(batches[0].target.to_int_vector() == std::vector<int64_t>{101, 104, 107});
  CHECK(batches[1].target.to_int_vector() == std::vector<int64_t>{100});

  // Shuffled: the batches follow sampler.indices() for the epoch set on the loader.
  DataLoader shuffled(ds, 3, DistributedSampler(10, 2, 0, true, 9));
  for (int64_t epoch : {0, 1, 2}) {
    shuffled.set_epoch(epoch);
    DistributedSampler reference(10, 2, 0, true, 9);
    reference.set_epoch(epoch);
    std::vector<int64_t> expected;
    for (int64_t i : reference.indices()) expected.push_back(100 + i);
    CHECK(targets_of(collect(shuffled)) == expected);
  }
}

// A named sampler copied into the loader would never see the caller's set_epoch: every epoch
// would repeat epoch 0's order (torch keeps the caller's object, so its idiom works there).
static_assert(
    !std::is_constructible_v<DataLoader, std::shared_ptr<const Dataset>, int64_t, DistributedSampler&>,
    "a named sampler must be shared (shared_ptr) or moved, never copied");
static_assert(
    !std::is_constructible_v<DataLoader, std::shared_ptr<const Dataset>, int64_t, const DistributedSampler&>);

TEST_CASE(
    "DataLoader with a shared sampler: the caller's set_epoch picks the loader's order (torch's idiom)") {
  auto ds = numbered(10);
  auto sampler = std::make_shared<DistributedSampler>(10, 2, 1, /*shuffle=*/true, /*seed=*/9);
  DataLoader loader(ds, 3, sampler);
  std::vector<std::vector<int64_t>> orders;
  for (int64_t epoch : {0, 1, 0}) {
    sampler->set_epoch(epoch);
    DistributedSampler reference(10, 2, 1, true, 9);
    reference.set_epoch(epoch);
    std::vector<int64_t> expected;
    for (int64_t i : reference.indices()) expected.push_back(100 + i);
    orders.push_back(targets_of(collect(loader)));
    CHECK(orders.back() == expected);
    CHECK(loader.sampler().epoch() == epoch);
  }
  CHECK(orders[0] != orders[1]);  // seed 9: epochs 0 and 1 differ on rank 1, and epoch 0 comes back
  CHECK(orders[2] == orders[0]);
  CHECK_THROWS_AS(DataLoader(ds, 3, std::shared_ptr<DistributedSampler>()), ValueError);
}

TEST_CASE("DataLoader shuffle without a sampler: a new permutation each pass, seeded") {
  auto ds = numbered(50);
  DataLoaderOptions options;
  options.shuffle = true;
  options.seed = 3;
  DataLoader a(ds, 8, options), b(ds, 8, options);
  std::vector<int64_t> previous;
  for (int pass = 0; pass < 3; ++pass) {
    const std::vector<int64_t> ta = targets_of(collect(a));
    CHECK(ta == targets_of(collect(b)));  // same seed, same order
    CHECK(std::set<int64_t>(ta.begin(), ta.end()).size() == 50u);
    std::vector<int64_t> expected;
    for (int64_t i : randperm(50, 3 + pass)) expected.push_back(100 + i);
    CHECK(ta == expected);
    CHECK(ta != previous);
    previous = ta;
  }
}

TEST_CASE("prefetch on and off give identical batches") {
  auto ds = numbered(37);
  for (int depth : {1, 2, 5}) {
    for (bool drop_last : {false, true}) {
      CAPTURE(depth);
      CAPTURE(drop_last);
      DataLoaderOptions off, on;
      off.drop_last = on.drop_last = drop_last;
      on.prefetch = true;
      on.prefetch_depth = depth;
      DataLoader plain(ds, 5, DistributedSampler(37, 2, 1, true, 4), off);
      DataLoader ahead(ds, 5, DistributedSampler(37, 2, 1, true, 4), on);
      for (int64_t epoch : {0, 1}) {
        plain.set_epoch(epoch);
        ahead.set_epoch(epoch);
        const std::vector<Batch> x = collect(plain), y = collect(ahead);
        REQUIRE(x.size() == y.size());
        REQUIRE(static_cast<int64_t>(x.size()) == plain.size());
        for (size_t k = 0; k < x.size(); ++k) {
          CHECK(floats(x[k].input) == floats(y[k].input));
          CHECK(x[k].input.shape() == y[k].input.shape());
          CHECK(x[k].target.to_int_vector() == y[k].target.to_int_vector());
        }
      }
    }
  }
}

TEST_CASE("prefetch: a dataset error reaches the training thread after the batches before it") {
  auto ds = std::make_shared<Computed>(20, /*fail_at=*/9);
  for (bool prefetch : {false, true}) {
    CAPTURE(prefetch);
    DataLoaderOptions options;
    options.prefetch = prefetch;
    DataLoader loader(ds, 4, options);
    int batches = 0;
    std::string message;
    try {
      for (const Batch& b : loader) {
        CHECK(b.input.shape() == Shape{4, 2, 2});
        ++batches;
      }
    } catch (const ValueError& e) {
      message = e.what();
    }
    CHECK(batches == 2);  // 0-3, 4-7; the batch 8-11 holds the broken example
    CHECK(contains(message, "example 9 is broken"));
    // A loop that skips the bad batch gets every other one, as torch's DataLoader gives them.
    std::vector<float> firsts;
    int errors = 0;
    for (auto it = loader.begin(); it != loader.end(); ++it) {
      try {
        firsts.push_back(it->input.to_vector()[0]);
      } catch (const ValueError&) {
        ++errors;
      }
    }
    CHECK(errors == 1);
    CHECK(firsts == std::vector<float>{0, 4, 12, 16});  // batches 0, 1, 3 and 4
  }
  // The first batch and the last fail: begin() still returns the pass, and ++ goes on from
  // them (torch: next(it) raises, and the next next(it) gives the batch after).
  for (const int64_t fail_at : {0, 18}) {
    for (bool prefetch : {false, true}) {
      CAPTURE(fail_at);
      CAPTURE(prefetch);
      DataLoaderOptions options;
      options.prefetch = prefetch;
      DataLoader loader(std::make_shared<Computed>(20, fail_at), 4, options);
      std::vector<float> firsts;
      int errors = 0;
      for (auto it = loader.begin(); it != loader.end(); ++it) {
        try {
          firsts.push_back((*it).input.to_vector()[0]);
        } catch (const ValueError& e) {
          CHECK(contains(e.what(), "example " + std::to_string(fail_at) + " is broken"));
          ++errors;
        }
      }
      CHECK(errors == 1);
      CHECK(firsts == (fail_at == 0 ? std::vector<float>{4, 8, 12, 16} : std::vector<float>{0, 4, 8, 12}));
    }
  }
}

TEST_CASE("prefetch: leaving a pass early and starting another joins the thread cleanly") {
  auto ds = numbered(100);
  DataLoaderOptions options;
  options.prefetch = true;
  options.prefetch_depth = 1;
  DataLoader loader(ds, 3, options);
  for (int pass = 0; pass < 5; ++pass) {
    int seen = 0;
    for (const Batch& b : loader) {
      CHECK(b.target.to_int_vector()[0] == 100 + 3 * seen);
      if (++seen == 2) break;  // the worker is blocked on a full queue here
    }
  }
  // A loader destroyed mid-pass joins its thread (a hang here would time the test out).
  auto partial = std::make_unique<DataLoader>(ds, 3, options);
  auto it = partial->begin();
  CHECK(it->target.to_int_vector() == std::vector<int64_t>{100, 101, 102});
  partial.reset();
}

TEST_CASE("DataLoader argument errors") {
  auto ds = numbered(10);
  CHECK_THROWS_AS(DataLoader(ds, 0), ValueError);
  CHECK_THROWS_AS(DataLoader(nullptr, 4), ValueError);
  DataLoaderOptions shuffle;
  shuffle.shuffle = true;
  CHECK_THROWS_AS(DataLoader(ds, 4, DistributedSampler(10, 1, 0), shuffle), ValueError);
  CHECK_THROWS_AS(DataLoader(ds, 4, DistributedSampler(11, 1, 0)), ValueError);
  DataLoaderOptions zero_depth;
  zero_depth.prefetch_depth = 0;
  CHECK_THROWS_AS(DataLoader(ds, 4, zero_depth), ValueError);
}

TEST_CASE("DataLoader to CUDA: DeviceError without a GPU, batches on the GPU with one") {
  auto ds = numbered(10);
  DataLoaderOptions options;
  options.device = Device::cuda(0);
  if (!kernels::cuda_built() || kernels::cuda::device_count() == 0) {
    CHECK_THROWS_AS(DataLoader(ds, 4, options), DeviceError);
    return;
  }
  for (bool prefetch : {false, true}) {
    options.prefetch = prefetch;
    DataLoader loader(ds, 4, options);
    // More batches than pinned buffers, over several passes, to exercise their reuse.
    for (int pass = 0; pass < 6; ++pass) {
      int64_t first = 0;
      for (const Batch& b : loader) {
        CHECK(b.input.device() == Device::cuda(0));
        CHECK(b.target.device() == Device::cuda(0));
        const std::vector<float> x = b.input.to(Device::cpu()).to_vector();
        const std::vector<int64_t> y = b.target.to(Device::cpu()).to_int_vector();
        for (size_t k = 0; k < y.size(); ++k) {
          CHECK(y[k] == 100 + first + static_cast<int64_t>(k));
          CHECK(x[2 * k] == static_cast<float>(first + k));
        }
        first += static_cast<int64_t>(y.size());
      }
      CHECK(first == 10);
    }
  }
}

// ---- FashionMNIST --------------------------------------------------------------------------

namespace {

// A small Fashion-MNIST folder: n images of 28x28 (pixel p of image i = (i * 31 + p) mod 256)
// and the given labels, gzipped like the real files.
std::string small_fashion_root(const std::string& name, int64_t n_images, const Bytes& labels) {
  const fs::path root = temp().path / name;
  fs::create_directories(root);
  Bytes pixels(static_cast<size_t>(n_images) * 784);
  for (int64_t i = 0; i < n_images; ++i)
    for (int64_t p = 0; p < 784; ++p) pixels[i * 784 + p] = static_cast<uint8_t>((i * 31 + p) % 256);
  const auto n = static_cast<uint32_t>(n_images);
  auto put = [&](const std::string& file, const Bytes& bytes) {
    std::ofstream out(root / file, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  };
  put("train-images-idx3-ubyte.gz", gzip_stored(idx_bytes(8, {n, 28, 28}, pixels)));
  put("train-labels-idx1-ubyte.gz",
      gzip_stored(idx_bytes(8, {static_cast<uint32_t>(labels.size())}, labels)));
  return root.string();
}

}  // namespace

TEST_CASE("FashionMNIST on a small hand-built folder: pixel / 255 per batch, flattened") {
  const std::string root = small_fashion_root("fm-small", 3, {7, 0, 9});
  auto ds = std::make_shared<FashionMNIST>(root, true);
  CHECK(ds->size() == 3);
  CHECK(ds->images().shape() == Shape{3, 28, 28});
  CHECK(ds->labels().to_int_vector() == std::vector<int64_t>{7, 0, 9});

  const Batch b = ds->get_batch({2, 0});
  CHECK(b.input.shape() == Shape{2, 784});
  CHECK(b.input.dtype() == DType::Float32);
  CHECK(b.target.to_int_vector() == std::vector<int64_t>{9, 7});
  const std::vector<float> x = floats(b.input);
  for (int64_t p = 0; p < 784; ++p) {
    REQUIRE(x[p] == static_cast<float>((2 * 31 + p) % 256) / 255.0f);
    REQUIRE(x[784 + p] == static_cast<float>(p % 256) / 255.0f);
  }
  const Example e = ds->get(1);
  CHECK(e.input.shape() == Shape{784});
  CHECK(floats(e.input)[5] == static_cast<float>(31 + 5) / 255.0f);
  CHECK(e.target.to_int_vector() == std::vector<int64_t>{0});

  DataLoader loader(ds, 2);
  const std::vector<Batch> batches = collect(loader);
  REQUIRE(batches.size() == 2);
  CHECK(batches[1].input.shape() == Shape{1, 784});
}

TEST_CASE("FashionMNIST errors: missing folder, a file for the folder, bad label, counts that differ") {
  const std::string missing = temp().file("no-such-folder");
  std::string message = io_error([&] { FashionMNIST(missing, true); });
  CHECK(contains(message, missing + "/train-images-idx3-ubyte.gz"));
  CHECK(contains(message, "apt-get install dataset-fashion-mnist"));

  const std::string a_file = temp().file("fm-a-file");
  std::ofstream(a_file) << "not a folder";
  message = io_error([&] { FashionMNIST(a_file, true); });
  CHECK(contains(message, "'" + a_file + "' is a file, not a folder"));

  const std::string bad_label = small_fashion_root("fm-bad-label", 3, {1, 10, 2});
  message = io_error([&] { FashionMNIST(bad_label, true); });
  CHECK(contains(message, "label 10 at byte offset 9"));

  const std::string mismatch = small_fashion_root("fm-mismatch", 3, {1, 2});
  message = io_error([&] { FashionMNIST(mismatch, true); });
  CHECK(contains(message, "holds 3 images but"));
}

TEST_CASE("FashionMNIST: the real files (skipped when dataset-fashion-mnist is not installed)") {
  if (!fs::exists(std::string(FashionMNIST::kDefaultRoot) + "/train-images-idx3-ubyte.gz")) {
    MESSAGE("skipped: ", FashionMNIST::kDefaultRoot, " is missing (apt-get install dataset-fashion-mnist)");
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  FashionMNIST train;
  FashionMNIST test(FashionMNIST::kDefaultRoot, false);
  MESSAGE("read both sets in ", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
          " s");
  CHECK(train.size() == 60000);
  CHECK(test.size() == 10000);
  CHECK(train.images().shape() == Shape{60000, 28, 28});
  // Values from the files (Python's gzip module): the first ten labels, and per-class counts.
  const std::vector<int64_t> train_labels = train.labels().to_int_vector();
  const std::vector<int64_t> test_labels = test.labels().to_int_vector();
  CHECK(std::vector<int64_t>(train_labels.begin(), train_labels.begin() + 10) ==
        std::vector<int64_t>{9, 0, 0, 3, 0, 2, 7, 2, 5, 5});
  CHECK(std::vector<int64_t>(test_labels.begin(), test_labels.begin() + 10) ==
        std::vector<int64_t>{9, 2, 1, 1, 6, 1, 4, 6, 5, 7});
  for (int64_t c = 0; c < 10; ++c) {
    CHECK(std::count(train_labels.begin(), train_labels.end(), c) == 6000);
    CHECK(std::count(test_labels.begin(), test_labels.end(), c) == 1000);
  }
  // Image 0 of the training set: its pixels sum to 76247; row 14 starts 0 0 1 4 6 7 2.
  const uint8_t* image0 = train.images().data<uint8_t>();
  int64_t total = 0;
  for (int p = 0; p < 784; ++p) total += image0[p];
  CHECK(total == 76247);
  const Batch b = train.get_batch({0});
  CHECK(b.input.at({0, 14 * 28 + 3}) == 4.0f / 255.0f);
  CHECK(b.input.at({0, 14 * 28 + 25}) == 1.0f);  // the pixel 255
}
