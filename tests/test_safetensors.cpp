// safetensors: exact bytes of a file written by hand against the format, round trips, and
// every kind of malformed file refused with an IOError that names the file and the problem.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>

#include "core/half.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/safetensors.h"

using namespace nanoddp;
using namespace nanoddp::nn;

namespace {

std::string temp_path(const std::string& name) {
  return "/tmp/nanoddp_test_" + std::to_string(::getpid()) + "_" + name;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// A file in the format: 8-byte little-endian length (header.size() unless given), header, data.
std::string file_bytes(const std::string& header, const std::string& data, uint64_t header_length = UINT64_MAX) {
  if (header_length == UINT64_MAX) header_length = header.size();
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header_length >> (8 * i)) & 0xff);
  return bytes + header + data;
}

// The message of the IOError that loading path throws ("no IOError" when it loads).
std::string load_error(const std::string& path) {
  try {
    load_safetensors(path);
  } catch (const IOError& e) {
    return e.what();
  }
  return "no IOError";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("save_safetensors writes the published layout, byte for byte") {
  const std::string path = temp_path("layout.safetensors");
  save_safetensors(path, {{"w", Tensor::from_vector({1.0f, -2.0f}, {2})}}, {{"format", "pt"}});
  // The JSON, with keys sorted, padded with spaces to a multiple of 8 bytes (88 here).
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"w":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}})";
  REQUIRE(header.size() == 85);
  const std::string data("\x00\x00\x80\x3f\x00\x00\x00\xc0", 8);  // 1.0f, -2.0f little-endian
  CHECK(read_bytes(path) == file_bytes(header + "   ", data));
  std::remove(path.c_str());
}

TEST_CASE(
    "save_safetensors lays tensors out as the safetensors library does: widest dtype first, each aligned") {
  // Names in an order where name order alone puts a 1-byte tensor before an 8-byte one.
  const std::string path = temp_path("aligned.safetensors");
  StateDict state;
  state["a.mask"] = Tensor::zeros({3}, DType::UInt8);
  state["b.half"] = Tensor::zeros({1}, DType::Float16);
  state["c.step"] = Tensor::zeros({1}, DType::Int64);
  state["d.weight"] = Tensor::zeros({5}, DType::Float32);
  state["e.bf"] = Tensor::zeros({3}, DType::BFloat16);
  state["f.count"] = Tensor::zeros({1}, DType::Int32);
  state["g.bias"] = Tensor::zeros({1}, DType::Float32);
  save_safetensors(path, state);
  const std::string bytes = read_bytes(path);
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  const std::string header = bytes.substr(8, header_length);
  // safetensors' Dtype order, descending (I64, F32, I32, BF16, F16, U8), then by name.
  const std::vector<std::pair<std::string, std::string>> want = {
      {"c.step", "[0,8]"}, {"d.weight", "[8,28]"}, {"g.bias", "[28,32]"}, {"f.count", "[32,36]"},
      {"e.bf", "[36,42]"}, {"b.half", "[42,44]"},  {"a.mask", "[44,47]"}};
  for (const auto& entry : want) {
    CAPTURE(entry.first);
    CHECK(contains(header, "\"" + entry.first + "\":{\"data_offsets\":" + entry.second));
  }
  CHECK((8 + header_length) % 8 == 0);
  const StateDict loaded = load_safetensors(path);
  CHECK(loaded.size() == state.size());
  std::remove(path.c_str());
}

TEST_CASE("safetensors round-trip every dtype, empty tensors, scalars and metadata") {
  const std::string path = temp_path("roundtrip.safetensors");
  StateDict state;
  state["0.weight"] = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  state["0.bias"] = Tensor::from_vector({0.5f, -0.25f});
  state["steps"] = Tensor::from_vector(std::vector<int64_t>{-7, 1LL << 40});
  state["scalar"] = Tensor::scalar(3.5f);
  state["empty"] = Tensor::zeros({0, 4});
  state["pixels"] = Tensor::zeros({3}, DType::UInt8);
  state["pixels"].data<uint8_t>()[2] = 255;
  save_safetensors(path, state, {{"epochs", "10"}, {"note", "héllo \"quoted\""}});
  CHECK_FALSE(std::ifstream(path + ".tmp").good());

  SafetensorsMetadata metadata;
  const StateDict loaded = load_safetensors(path, &metadata);
  REQUIRE(loaded.size() == state.size());
  for (const auto& entry : state) {
    const std::string& name = entry.first;  // not a structured binding: CAPTURE cannot capture one (clang, C++17)
    const Tensor& tensor = entry.second;
    CAPTURE(name);
    REQUIRE(loaded.count(name) == 1);
    CHECK(loaded.at(name).dtype() == tensor.dtype());
    CHECK(loaded.at(name).shape() == tensor.shape());
  }
  uint64_t header_length = 0;
  std::memcpy(&header_length, read_bytes(path).data(), 8);
  CHECK(header_length % 8 == 0);  // padded, so the data starts 8-byte aligned
  CHECK(loaded.at("0.weight").to_vector() == state["0.weight"].to_vector());
  CHECK(loaded.at("0.bias").to_vector() == std::vector<float>{0.5f, -0.25f});
  CHECK(loaded.at("steps").to_int_vector() == std::vector<int64_t>{-7, 1LL << 40});
  CHECK(loaded.at("scalar").item() == 3.5f);
  CHECK(loaded.at("pixels").data<uint8_t>()[2] == 255);
  CHECK(metadata == SafetensorsMetadata{{"epochs", "10"}, {"note", "héllo \"quoted\""}});

  // Saving again without metadata: none is written, and a reader's map is cleared.
  save_safetensors(path, {{"x", Tensor::scalar(1.0f)}});
  load_safetensors(path, &metadata);
  CHECK(metadata.empty());
  CHECK_FALSE(contains(read_bytes(path), "__metadata__"));
  std::remove(path.c_str());
}

TEST_CASE("safetensors F16 and BF16: IEEE half and bfloat16 bits, and a BF16 file loads into a float32 model") {
  const std::string path = temp_path("half.safetensors");
  StateDict state;
  state["bias"] = Tensor::empty({1}, DType::Float16);
  state["bias"].data<Float16>()[0] = Float16::from_float(-2.0f);  // 0xC000
  state["weight"] = Tensor::empty({1, 2}, DType::BFloat16);
  state["weight"].data<BFloat16>()[0] = BFloat16::from_float(1.0f / 3);  // 0x3EAB
  state["weight"].data<BFloat16>()[1] = BFloat16::from_float(1.0f);      // 0x3F80
  save_safetensors(path, state);
  const std::string bytes = read_bytes(path);
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  const std::string header = bytes.substr(8, header_length), data = bytes.substr(8 + header_length);
  // BF16 before F16, as the safetensors library lays them out.
  CHECK(contains(header, R"("bias":{"data_offsets":[4,6],"dtype":"F16","shape":[1]})"));
  CHECK(contains(header, R"("weight":{"data_offsets":[0,4],"dtype":"BF16","shape":[1,2]})"));
  CHECK(data == std::string("\xAB\x3E\x80\x3F\x00\xC0", 6));  // little-endian

  const StateDict loaded = load_safetensors(path);
  CHECK(loaded.at("bias").dtype() == DType::Float16);
  CHECK(loaded.at("weight").dtype() == DType::BFloat16);
  Generator gen(0);
  Linear layer(2, 1, gen);
  layer.load_state_dict(loaded);  // converted as torch's copy_ does: exact, bf16 and f16 widen
  CHECK(layer.weight.to_vector() == std::vector<float>{0.333984375f, 1.0f});
  CHECK(layer.bias.to_vector() == std::vector<float>{-2.0f});
  std::remove(path.c_str());
}

TEST_CASE("save_safetensors refuses a tensor named __metadata__ and leaves no file when it cannot write") {
  const std::string path = temp_path("refused.safetensors");
  CHECK_THROWS_AS(save_safetensors(path, {{"__metadata__", Tensor::scalar(1.0f)}}), ValueError);
  CHECK_FALSE(std::ifstream(path).good());
  const std::string missing = temp_path("no_such_folder") + "/w.safetensors";
  try {
    save_safetensors(missing, {{"x", Tensor::scalar(1.0f)}});
    FAIL("expected IOError");
  } catch (const IOError& e) {
    CHECK_MESSAGE(contains(e.what(), missing + ": folder " + temp_path("no_such_folder") + " does not exist"), e.what());
  }
}

TEST_CASE(
    "save_safetensors and save_checkpoint refuse a freed tensor, an undefined one, or a name that is not "
    "UTF-8") {
  const std::string path = temp_path("freed.safetensors");
  Tensor freed = Tensor::ones({1000});
  freed.impl()->storage->free_memory();  // as FSDP frees a unit's full vector outside its forward
  CHECK_THROWS_WITH_AS(
      save_safetensors(path, {{"a", freed}}),
      doctest::Contains(("safetensors " + path + ": tensor 'a' ([1000]) has its memory freed").c_str()),
      ValueError);
  CHECK_THROWS_WITH_AS(nn::save_checkpoint(path, {{"a", freed}}),
                       doctest::Contains("checkpoint: tensor 'a' ([1000]) has its memory freed"), ValueError);
  CHECK_THROWS_WITH_AS(save_safetensors(path, {{"b", Tensor()}}),
                       doctest::Contains(("safetensors " + path + ": tensor 'b' is undefined").c_str()),
                       ValueError);
  CHECK_THROWS_WITH_AS(nn::save_checkpoint(path, {{"b", Tensor()}}),
                       doctest::Contains("checkpoint: tensor 'b' is undefined"), ValueError);
  CHECK_THROWS_WITH_AS(save_safetensors(path, {{"bad\xff", Tensor::scalar(1.0f)}}),
                       doctest::Contains("the tensor name 'bad\xff' is not UTF-8 text"), ValueError);
  CHECK_THROWS_WITH_AS(save_safetensors(path, {{"a", Tensor::scalar(1.0f)}}, {{"note", "\xfe"}}),
                       doctest::Contains("the metadata entry 'note' is not UTF-8 text"), ValueError);
  CHECK_FALSE(std::ifstream(path).good());
}

TEST_CASE("load_safetensors replaces the caller's metadata map, and leaves it when the load fails") {
  const std::string path = temp_path("meta.safetensors");
  save_safetensors(path, {{"a", Tensor::scalar(1.0f)}}, {{"format", "pt"}});
  SafetensorsMetadata metadata = {{"stale", "x"}};
  load_safetensors(path, &metadata);
  CHECK(metadata == SafetensorsMetadata{{"format", "pt"}});
  write_bytes(path,
              file_bytes(R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
                         std::string(8, '\0')));
  CHECK_THROWS_AS(load_safetensors(path, &metadata), IOError);
  CHECK(metadata == SafetensorsMetadata{{"format", "pt"}});
  std::remove(path.c_str());
}

TEST_CASE("load_safetensors refuses malformed files, naming the file and the problem") {
  const std::string path = temp_path("bad.safetensors");
  const std::string eight_bytes(8, '\x01');  // data for one F32 [2] tensor
  const std::string good = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  struct Case {
    const char* what;
    std::string bytes;
    const char* message;
  };
  const Case cases[] = {
      {"the good file, truncated in its data", file_bytes(good, eight_bytes).substr(0, 8 + good.size() + 5),
       "run past the end of the data"},
      {"a file shorter than the length field", std::string("\x10\x00\x00", 3),
       "too short for the 8-byte header length"},
      {"a header length beyond the file", file_bytes(good, eight_bytes, 1000),
       "runs past the end of the file"},
      {"a header length of 2^64 - 1", file_bytes(good, eight_bytes, UINT64_MAX - 1),
       "runs past the end of the file"},
      {"a header that is not JSON", file_bytes("{\"a\": ", eight_bytes), "cannot be read as JSON"},
      {"a number past a double's range",
       file_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"x":1e400})",
                  std::string(4, '\0')),
       "cannot be read as JSON"},
      {"a header that is a JSON array", file_bytes("[1, 2]", ""), "does not start with '{'"},
      {"an unsupported dtype",
       file_bytes(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", eight_bytes),
       "dtype F64 is not supported"},
      {"an unknown dtype",
       file_bytes(R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", eight_bytes),
       "dtype Q7 is not supported"},
      {"a missing field", file_bytes(R"({"a":{"dtype":"F32","shape":[2]}})", eight_bytes),
       "no \"data_offsets\""},
      {"a negative offset",
       file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", eight_bytes),
       "is not two non-negative integers"},
      {"offsets that end before they begin",
       file_bytes(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", eight_bytes),
       "end before they begin"},
      {"a byte count that does not match the shape",
       file_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight_bytes), "needs 12"},
      {"a shape whose byte count overflows",
       file_bytes(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})",
                  eight_bytes),
       "overflows a 64-bit byte count"},
      {"a negative size",
       file_bytes(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight_bytes),
       "non-negative integer"},
      {"too many dimensions",
       file_bytes(R"({"a":{"dtype":"F32","shape":[1,1,1,1,2],"data_offsets":[0,8]}})", eight_bytes),
       "5 dimensions"},
      {"offsets beyond the data", file_bytes(good, std::string(4, '\0')),
       "run past the end of the data (4 bytes"},
      {"overlapping tensors",
       file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                  std::string(12, '\0')),
       "tensor 'b' data_offsets [4, 12) overlap tensor 'a' [0, 8)"},
      {"a gap between tensors",
       file_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                  std::string(12, '\0')),
       "data bytes [4, 8) belong to no tensor"},
      {"trailing bytes", file_bytes(good, eight_bytes + "xx"), "data bytes [8, 10) belong to no tensor"},
      {"metadata that is not text", file_bytes(R"({"__metadata__":{"epochs":10}})", ""),
       "__metadata__ value of 'epochs' is not a string"},
      // JSON leaves a repeated name undefined (nlohmann keeps the last, other readers the
      // first): "a" would load as the first 4 bytes or the last.
      {"a tensor listed twice",
       file_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                  eight_bytes),
       "lists 'a' twice"},
      {"two __metadata__",
       file_bytes(R"({"__metadata__":{"epochs":"10"},"__metadata__":{"epochs":"20"}})", ""),
       "lists '__metadata__' twice"},
      {"a field twice in a tensor's entry",
       file_bytes(R"({"a":{"dtype":"F32","shape":[2],"dtype":"I64","data_offsets":[0,8]}})", eight_bytes),
       "has key 'dtype' twice in the entry 'a'"},
      {"a metadata key twice", file_bytes(R"({"__metadata__":{"epochs":"10","epochs":"20"}})", ""),
       "has key 'epochs' twice in the entry '__metadata__'"},
      // nlohmann stops at a NUL: what follows it would be read by no one.
      {"a NUL inside the header", file_bytes(good + std::string(1, '\0') + "junk", eight_bytes),
       "holds a NUL byte at byte offset 62"},
      {"a header that does not start with '{'", file_bytes(" " + good, eight_bytes),
       "does not start with '{'"},
      // An empty tensor whose other sizes overflow int64 is still not a shape.
      {"an empty shape that overflows int64",
       file_bytes(
           R"({"a":{"dtype":"F32","shape":[0,4611686018427387904,4611686018427387904],"data_offsets":[0,0]}})",
           ""),
       "has more elements than int64 can count"},
  };
  // 200 KB that nest 100,000 levels deep: only shown by their kind, never dumped (a
  // recursion per level would overflow the stack).
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const Case deep_cases[] = {
      {"a shape nested 100,000 deep",
       file_bytes(R"({"a":{"dtype":"F32","shape":[)" + deep + R"(],"data_offsets":[0,8]}})", eight_bytes),
       "shape (a JSON array of 1 element) holds something other than a non-negative integer"},
      {"data_offsets nested 100,000 deep",
       file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":)" + deep + "}}", eight_bytes),
       "\"data_offsets\" (a JSON array of 1 element) is not two non-negative integers"},
      {"a shape of a string",
       file_bytes(R"({"a":{"dtype":"F32","shape":[2,"x"],"data_offsets":[0,8]}})", eight_bytes),
       "shape [2,\"x\"] holds something other than a non-negative integer"},
  };
  for (const Case& c : deep_cases) {
    CAPTURE(c.what);
    write_bytes(path, c.bytes);
    const std::string message = load_error(path);
    CHECK_MESSAGE(contains(message, c.message), message.substr(0, 300));
  }
  for (const Case& c : cases) {
    CAPTURE(c.what);
    write_bytes(path, c.bytes);
    const std::string message = load_error(path);
    CHECK_MESSAGE(contains(message, path), message);
    CHECK_MESSAGE(contains(message, c.message), message);
  }
  // The good file loads, and a missing one is an IOError too.
  write_bytes(path, file_bytes(good, eight_bytes));
  CHECK(load_safetensors(path).at("a").shape() == Shape{2});
  std::remove(path.c_str());
  CHECK(contains(load_error(path), "cannot open"));
}
