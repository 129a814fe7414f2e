#include "dist/sharded_checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <set>

#include "core/error.h"
#include "core/file_io.h"
#include "core/hash.h"
#include "dist/detail.h"
#include "dist/host_collectives.h"
#include "nn/checkpoint.h"

namespace nanoddp::dist {

namespace {

constexpr int64_t kVersion = 1;
const std::string kManifestPrefix = "sharded_checkpoint.";
const std::string kVersionKey = kManifestPrefix + "version";
const std::string kWorldSizeKey = kManifestPrefix + "world_size";
const std::string kGenerationKey = kManifestPrefix + "generation";
const std::string kShardNbytesKey = kManifestPrefix + "shard_nbytes";
const std::string kShardChecksumsKey = kManifestPrefix + "shard_checksums";
const std::string kShardPrefixKey = kManifestPrefix + "shard_prefix";
const std::string kRankKey = kManifestPrefix + "rank";  // in each shard file, with the generation
const std::string kShapePrefix = "shape/", kDtypePrefix = "dtype/", kRangesPrefix = "ranges/";
const std::string kDigestPrefix = "digest/";  // in a save report: a whole entry's FNV-1a

Tensor int64_tensor(const std::vector<int64_t>& values) {
  return Tensor::from_vector(values, Shape({static_cast<int64_t>(values.size())}));
}

Tensor text_tensor(const std::string& text) {
  Tensor t = Tensor::empty(Shape({static_cast<int64_t>(text.size())}), DType::UInt8);
  if (!text.empty()) std::memcpy(t.impl()->storage->data(), text.data(), text.size());
  return t;
}

std::string text_of(const Tensor& t) {
  return std::string(static_cast<const char*>(t.impl()->storage->data()), t.nbytes());
}

std::string base_name(const std::string& path) { return std::filesystem::path(path).filename().string(); }

// Every rank's bytes, [r] from rank r: lengths first, then the bytes padded to the longest
// (all_gather needs one size), as int64 words.
std::vector<std::string> all_gather_bytes(ProcessGroup& pg, const std::string& bytes,
                                          std::chrono::milliseconds timeout) {
  const std::vector<std::vector<int64_t>> lengths =
      all_gather_host(pg, {static_cast<int64_t>(bytes.size())}, timeout);
  int64_t longest = 0;
  for (const auto& l : lengths) longest = std::max(longest, l[0]);
  std::vector<int64_t> words(static_cast<size_t>((longest + 7) / 8), 0);
  if (!bytes.empty()) std::memcpy(words.data(), bytes.data(), bytes.size());
  const std::vector<std::vector<int64_t>> gathered = all_gather_host(pg, words, timeout);
  std::vector<std::string> out;
  for (size_t r = 0; r < gathered.size(); ++r)
    out.emplace_back(reinterpret_cast<const char*>(gathered[r].data()), static_cast<size_t>(lengths[r][0]));
  return out;
}

// The generation a shard file name under base carries ("run.ckpt.g12.shard-0-of-4" -> 12), or
// -1 when the name is not exactly one of base's shard file names (shard_file_name's
// pattern, nothing before or after: "run.ckpt.g12.shard-0-of-4.bak" is someone's copy).
int64_t generation_of_shard_name(const std::string& name, const std::string& base) {
  const std::string head = base + ".g";
  if (name.compare(0, head.size(), head) != 0) return -1;
  // Reads a run of 1 to 18 digits at `at`; -1 when there is none.
  size_t at = head.size();
  auto number = [&]() -> int64_t {
    const size_t end = std::min(name.find_first_not_of("0123456789", at), name.size());
    if (end == at || end - at > 18) return -1;
    const int64_t value = std::stoll(name.substr(at, end - at));
    at = end;
    return value;
  };
  auto literal = [&](const char* text) {
    const size_t n = std::strlen(text);
    if (name.compare(at, n, text) != 0) return false;
    at += n;
    return true;
  };
  const int64_t generation = number();
  if (generation < 0 || !literal(".shard-") || number() < 0 || !literal("-of-") || number() < 0) return -1;
  return at == name.size() ? generation : -1;
}

// The names of base's shard files in folder, with their generations.
std::vector<std::pair<std::string, int64_t>> shard_files_in(const std::string& folder,
                                                            const std::string& base) {
  std::vector<std::pair<std::string, int64_t>> found;
  std::error_code error;
  for (const auto& item : std::filesystem::directory_iterator(folder, error)) {
    const std::string name = item.path().filename().string();
    const int64_t generation = generation_of_shard_name(name, base);
    if (generation >= 0) found.emplace_back(folder + "/" + name, generation);
  }
  return found;
}

// The generation of the sharded set whose manifest is path; -1 when path is missing or is not
// a readable manifest (a full checkpoint names no shard files).
int64_t manifest_generation(const std::string& path) {
  if (::access(path.c_str(), F_OK) != 0) return -1;
  try {
    const nn::StateDict state = nn::load_checkpoint(path);
    if (!is_sharded_manifest(state)) return -1;
    const auto it = state.find(kGenerationKey);
    if (it == state.end() || it->second.dtype() != DType::Int64 || it->second.numel() != 1) return -1;
    return it->second.to_int_vector()[0];
  } catch (const Error&) {
    return -1;
  }
}

// One rank's account of its save: what it holds and whether its shard file was written.
struct RankReport {
  bool ok = false;
  std::string error;
  int64_t nbytes = 0, checksum = 0;
  std::map<std::string, ShardedEntry> entries;  // pieces left out
  // FNV-1a of the bytes of each entry this rank holds whole: replicated values must agree.
  std::map<std::string, int64_t> digests;
};

std::string report_bytes(const RankReport& report) {
  nn::StateDict state;
  state["ok"] = int64_tensor({report.ok ? 1 : 0});
  state["error"] = text_tensor(report.error);
  state["shard"] = int64_tensor({report.nbytes, report.checksum});
  for (const auto& [name, entry] : report.entries) {
    state[kShapePrefix + name] = int64_tensor(entry.shape.sizes());
    state[kDtypePrefix + name] = int64_tensor({static_cast<int64_t>(entry.dtype)});
    state[kRangesPrefix + name] = int64_tensor({entry.begin, entry.end});
  }
  for (const auto& [name, digest] : report.digests) state[kDigestPrefix + name] = int64_tensor({digest});
  return nn::checkpoint_bytes(state);
}

RankReport parse_report(const std::string& bytes, int rank) {
  const nn::StateDict state = nn::parse_checkpoint(bytes, "rank " + std::to_string(rank) + "'s save report");
  RankReport report;
  report.ok = state.at("ok").to_int_vector()[0] != 0;
  report.error = text_of(state.at("error"));
  const std::vector<int64_t> shard = state.at("shard").to_int_vector();
  report.nbytes = shard[0];
  report.checksum = shard[1];
  for (const auto& [key, value] : state) {
    if (key.compare(0, kShapePrefix.size(), kShapePrefix) != 0) continue;
    const std::string name = key.substr(kShapePrefix.size());
    ShardedEntry& entry = report.entries[name];
    entry.shape = Shape(value.to_int_vector());
    entry.dtype = static_cast<DType>(state.at(kDtypePrefix + name).to_int_vector()[0]);
    const std::vector<int64_t> range = state.at(kRangesPrefix + name).to_int_vector();
    entry.begin = range[0];
    entry.end = range[1];
    const auto digest = state.find(kDigestPrefix + name);
    if (digest != state.end()) report.digests[name] = digest->second.to_int_vector()[0];
  }
  return report;
}

// Whether every rank that holds part of a tensor holds all of it, and more than one does:
// state every rank has alike, saved by each.
bool is_replicated(const std::vector<std::pair<int64_t, int64_t>>& ranges, int64_t numel) {
  int holders = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin == end) continue;
    if (begin != 0 || end != numel) return false;
    ++holders;
  }
  return holders > 1;
}

// What is wrong with ranges, one per rank, as a split of numel elements ("" when nothing is):
// the non-empty ones, in order of their starts, must follow each other from 0 to numel, or
// all be the whole tensor.
std::string tiling_problem(const std::vector<std::pair<int64_t, int64_t>>& ranges, int64_t numel) {
  std::vector<std::pair<int64_t, int64_t>> held;
  for (size_t r = 0; r < ranges.size(); ++r) {
    const auto [begin, end] = ranges[r];
    if (!(0 <= begin && begin <= end && end <= numel))
      return "rank " + std::to_string(r) + "'s range [" + std::to_string(begin) + ", " + std::to_string(end) +
             ") is not within its " + std::to_string(numel) + " elements";
    if (begin < end) held.emplace_back(begin, end);
  }
  if (is_replicated(ranges, numel)) return "";
  std::sort(held.begin(), held.end());
  int64_t next = 0;
  for (const auto& [begin, end] : held) {
    if (begin != next)
      return std::string(begin < next ? "two ranks hold" : "no rank holds") + " elements from " +
             std::to_string(std::min(begin, next)) + " (of " + std::to_string(numel) + ")";
    next = end;
  }
  if (next != numel)
    return "no rank holds elements from " + std::to_string(next) + " (of " + std::to_string(numel) + ")";
  return "";
}

}  // namespace

ShardedEntry whole_entry(const Tensor& t) {
  ShardedEntry entry;
  entry.shape = t.shape();
  entry.dtype = t.dtype();
  entry.begin = 0;
  entry.end = t.numel();
  entry.piece = t.detach().to(Device::cpu()).clone().reshape({t.numel()});
  return entry;
}

void merge_prefixed(ShardedStateDict& into, const std::string& prefix, const ShardedStateDict& part) {
  for (const auto& [name, entry] : part) into[prefix + name] = entry;
}

// Whether file is there with nbytes bytes and ends with checksum, as its rank reported writing
// it; nothing else is read.
bool shard_file_matches(const std::string& file, int64_t nbytes, int64_t checksum) {
  std::ifstream in(file, std::ios::binary | std::ios::ate);
  if (!in || static_cast<int64_t>(in.tellg()) != nbytes || nbytes < static_cast<int64_t>(sizeof(int64_t)))
    return false;
  int64_t stored = 0;
  in.seekg(nbytes - static_cast<int64_t>(sizeof(int64_t)));
  in.read(reinterpret_cast<char*>(&stored), sizeof(stored));
  return in && stored == checksum;
}

std::string shard_file_name(const std::string& path, int64_t generation, int rank, int world_size) {
  return path + ".g" + std::to_string(generation) + ".shard-" + std::to_string(rank) + "-of-" +
         std::to_string(world_size);
}

bool is_shard_file_name(const std::string& path, const std::string& file) {
  return folder_of(file) == folder_of(path) && generation_of_shard_name(base_name(file), base_name(path)) >= 0;
}

bool is_sharded_manifest(const nn::StateDict& state) { return state.count(kVersionKey) != 0; }

int remove_unused_shard_files(const std::string& path) {
  // What a rank killed while writing its shard left: "<shard file>.tmp.<space>.<pid>.XXXXXX".
  // The next save takes a new generation, so no later write of that shard file removes it.
  std::set<std::string> written;
  std::error_code error;
  for (const auto& item : std::filesystem::directory_iterator(folder_of(path), error)) {
    const std::string name = item.path().filename().string();
    const size_t tmp = name.find(".tmp.");
    if (tmp != std::string::npos && generation_of_shard_name(name.substr(0, tmp), base_name(path)) >= 0)
      written.insert(folder_of(path) + "/" + name.substr(0, tmp));
  }
  for (const std::string& file : written) remove_stale_temporaries(file);
  const auto files = shard_files_in(folder_of(path), base_name(path));
  if (files.empty()) return 0;  // the common case of full checkpoints: no manifest is read
  const int64_t current = manifest_generation(path), previous = manifest_generation(path + ".prev");
  int removed = 0;
  for (const auto& [file, generation] : files)
    if (generation != current && generation != previous && nn::is_checkpoint_file(file) &&
        std::remove(file.c_str()) == 0)
      ++removed;
  return removed;
}

void save_sharded_checkpoint(const std::string& path, const ShardedStateDict& mine, ProcessGroup& pg,
                             std::chrono::milliseconds timeout) {
  const int rank = pg.rank(), world = pg.size();
  const std::string where = "sharded checkpoint " + path;
  // 1. The generation: new to every file of path's sets on disk, so no save ever writes over a
  // shard file that a manifest may name.
  int64_t generation = 0;
  if (rank == 0) {
    generation = std::max<int64_t>({0, manifest_generation(path), manifest_generation(path + ".prev")}) + 1;
    for (const auto& [file, g] : shard_files_in(folder_of(path), base_name(path)))
      generation = std::max(generation, g + 1);
  }
  generation = all_gather_host(pg, {generation}, timeout)[0][0];

  // 2. This rank's shard file.
  RankReport report;
  std::exception_ptr error;
  try {
    nn::StateDict pieces;
    pieces[kGenerationKey] = int64_tensor({generation});
    pieces[kRankKey] = int64_tensor({rank});
    for (const auto& [name, entry] : mine) {
      NANODDP_CHECK(name.compare(0, kManifestPrefix.size(), kManifestPrefix) != 0, ValueError, where,
                    ": the name '", name, "' is reserved for the set's own records");
      const int64_t numel = entry.shape.numel(), length = entry.end - entry.begin;
      NANODDP_CHECK(0 <= entry.begin && entry.begin <= entry.end && entry.end <= numel, ValueError, where,
                    ": '", name, "' on rank ", rank, ": range [", entry.begin, ", ", entry.end,
                    ") is not within its ", numel, " elements (shape ", entry.shape, ")");
      if (length == 0) continue;
      NANODDP_CHECK(
          entry.piece.defined() && entry.piece.numel() == length && entry.piece.dtype() == entry.dtype,
          ValueError, where, ": '", name, "' on rank ", rank, ": the piece of [", entry.begin, ", ",
          entry.end, ") is ", entry.piece.defined() ? entry.piece.numel() : 0, " elements of ",
          entry.piece.defined() ? dtype_name(entry.piece.dtype()) : "nothing", ", expected ", length, " of ",
          dtype_name(entry.dtype));
      pieces[name] = entry.piece.to(Device::cpu()).reshape({length});
      if (length == numel) {
        const Tensor& piece = pieces[name];
        report.digests[name] = static_cast<int64_t>(
            fnv1a(std::string_view(static_cast<const char*>(piece.data_ptr()), piece.nbytes())));
      }
    }
    const std::string bytes = nn::checkpoint_bytes(pieces);
    write_file_atomically(shard_file_name(path, generation, rank, world), bytes, "checkpoint shard");
    report.nbytes = static_cast<int64_t>(bytes.size());
    std::memcpy(&report.checksum, bytes.data() + bytes.size() - sizeof(int64_t), sizeof(int64_t));
    report.ok = true;
  } catch (const Error& e) {
    error = std::current_exception();
    report.error = message_of(e);
  }
  for (const auto& [name, entry] : mine) {
    ShardedEntry described = entry;
    described.piece = Tensor();
    report.entries[name] = described;
  }

  // 3. What every rank holds, and whether it wrote its file; any failure fails every rank.
  // The report itself can fail (its keys are the entries' names with a prefix: a name the
  // shard file took may be too long here); then it carries only the error, so that every
  // rank still learns of it at this all-gather instead of waiting for this rank.
  std::string wire;
  try {
    wire = report_bytes(report);
  } catch (const Error& e) {
    if (!error) error = std::current_exception();
    report.ok = false;
    report.error = message_of(e);
    report.entries.clear();
    report.digests.clear();
    wire = report_bytes(report);
  }
  const std::vector<std::string> gathered = all_gather_bytes(pg, wire, timeout);
  std::vector<RankReport> reports;
  std::string failed;
  for (int r = 0; r < world; ++r) {
    reports.push_back(parse_report(gathered[static_cast<size_t>(r)], r));
    if (!reports.back().ok)
      failed += (failed.empty() ? "" : "; ") + ("rank " + std::to_string(r) + ": " + reports.back().error);
  }
  if (error) std::rethrow_exception(error);
  NANODDP_CHECK(failed.empty(), IOError, where, ": not saved, other ranks failed (", failed, "); ", path,
                " still names the previous set");

  // 4. Rank 0 commits: the manifest replaces path.
  std::string manifest_error;
  if (rank == 0) {
    try {
      nn::StateDict manifest;
      manifest[kVersionKey] = int64_tensor({kVersion});
      manifest[kWorldSizeKey] = int64_tensor({world});
      manifest[kGenerationKey] = int64_tensor({generation});
      manifest[kShardPrefixKey] = text_tensor(base_name(path));
      std::vector<int64_t> nbytes, checksums;
      for (const RankReport& r : reports) {
        nbytes.push_back(r.nbytes);
        checksums.push_back(r.checksum);
      }
      manifest[kShardNbytesKey] = int64_tensor(nbytes);
      manifest[kShardChecksumsKey] = int64_tensor(checksums);
      std::set<std::string> names;
      for (const RankReport& r : reports)
        for (const auto& [name, entry] : r.entries) names.insert(name);
      for (const std::string& name : names) {
        const ShardedEntry* first = nullptr;
        std::vector<std::pair<int64_t, int64_t>> ranges(static_cast<size_t>(world), {0, 0});
        for (int r = 0; r < world; ++r) {
          const auto it = reports[static_cast<size_t>(r)].entries.find(name);
          if (it == reports[static_cast<size_t>(r)].entries.end()) continue;
          if (first == nullptr) first = &it->second;
          NANODDP_CHECK(it->second.shape == first->shape && it->second.dtype == first->dtype, ValueError,
                        where, ": '", name, "' is ", it->second.shape, " ", dtype_name(it->second.dtype),
                        " on rank ", r, " but ", first->shape, " ", dtype_name(first->dtype),
                        " on another rank");
          ranges[static_cast<size_t>(r)] = {it->second.begin, it->second.end};
        }
        const std::string problem = tiling_problem(ranges, first->shape.numel());
        NANODDP_CHECK(problem.empty(), ValueError, where, ": '", name, "': ", problem);
        if (is_replicated(ranges, first->shape.numel())) {  // any holder's copy is read back
          int first_holder = -1;
          for (int r = 0; r < world; ++r) {
            const auto& digests = reports[static_cast<size_t>(r)].digests;
            const auto it = digests.find(name);
            if (it == digests.end()) continue;
            if (first_holder < 0) {
              first_holder = r;
              continue;
            }
            NANODDP_CHECK(it->second == reports[static_cast<size_t>(first_holder)].digests.at(name),
                          ValueError, where, ": '", name, "' is held whole by ranks ", first_holder, " and ",
                          r,
                          " with different values: a replicated entry must be the same on every rank that "
                          "holds it (have the replicas diverged?)");
          }
        }
        std::vector<int64_t> flat;
        for (const auto& [begin, end] : ranges) {
          flat.push_back(begin);
          flat.push_back(end);
        }
        manifest[kShapePrefix + name] = int64_tensor(first->shape.sizes());
        manifest[kDtypePrefix + name] = int64_tensor({static_cast<int64_t>(first->dtype)});
        manifest[kRangesPrefix + name] = Tensor::from_vector(flat, Shape({world, 2}));
      }
      // Every shard file must be where the manifest will say, as its rank wrote it: a rank that
      // was given another path, or saved into a folder only its machine sees, would leave a
      // manifest naming files no reader finds. Checked before path or path.prev is touched.
      for (int r = 0; r < world; ++r) {
        const std::string file = shard_file_name(path, generation, r, world);
        const RankReport& report = reports[static_cast<size_t>(r)];
        NANODDP_CHECK(shard_file_matches(file, report.nbytes, report.checksum), IOError, where,
                      ": rank 0 does not find rank ", r, "'s shard file ", file, " as rank ", r,
                      " wrote it: every rank must save with the same path, in a folder every rank sees");
      }
      // A set whose manifest or shard files are damaged is not kept over FILE.prev (which a
      // resume fell back to); remove_unused_shard_files then removes that set.
      nn::keep_previous_checkpoint(path, [](const std::string& file) {
        try {
          const nn::StateDict state = nn::load_checkpoint(file);
          return !is_sharded_manifest(state) || ShardedCheckpointReader(file, state).shard_files_present();
        } catch (const Error&) {
          return false;
        }
      });
      nn::save_checkpoint(path, manifest);
      // 5. The sets that no manifest names any more.
      remove_unused_shard_files(path);
    } catch (const Error& e) {
      error = std::current_exception();
      manifest_error = message_of(e);
    }
  }
  const std::string rank0_error = all_gather_bytes(pg, manifest_error, timeout)[0];
  if (error) std::rethrow_exception(error);
  NANODDP_CHECK(rank0_error.empty(), IOError, where, ": not saved, rank 0 could not write the manifest (",
                rank0_error, ")");
}

ShardedCheckpointReader::ShardedCheckpointReader(const std::string& path)
    : ShardedCheckpointReader(path, nn::load_checkpoint(path)) {}

ShardedCheckpointReader::ShardedCheckpointReader(const std::string& path, const nn::StateDict& manifest)
    : path_(path), folder_(folder_of(path)) {
  parse(manifest);
}

void ShardedCheckpointReader::parse(const nn::StateDict& manifest) {
  const std::string where = "sharded checkpoint " + path_;
  const auto int64s = [&](const std::string& key, size_t count) {
    const auto it = manifest.find(key);
    NANODDP_CHECK(it != manifest.end() && it->second.dtype() == DType::Int64 &&
                      it->second.numel() == static_cast<int64_t>(count),
                  IOError, where, ": the manifest has no '", key, "' of ", count, " int64");
    return it->second.to_int_vector();
  };
  const int64_t version = int64s(kVersionKey, 1)[0];
  NANODDP_CHECK(version == kVersion, IOError, where, ": manifest version ", version, ", this reader knows ",
                kVersion);
  const int64_t world = int64s(kWorldSizeKey, 1)[0];
  NANODDP_CHECK(world >= 1 && world <= (1 << 20), IOError, where, ": the manifest's world size is ", world);
  world_size_ = static_cast<int>(world);
  generation_ = int64s(kGenerationKey, 1)[0];
  shard_nbytes_ = int64s(kShardNbytesKey, static_cast<size_t>(world));
  shard_checksums_ = int64s(kShardChecksumsKey, static_cast<size_t>(world));
  const auto prefix = manifest.find(kShardPrefixKey);
  NANODDP_CHECK(prefix != manifest.end() && prefix->second.dtype() == DType::UInt8, IOError, where,
                ": the manifest does not name its shard files");
  prefix_ = text_of(prefix->second);
  NANODDP_CHECK(!prefix_.empty() && prefix_.find('/') == std::string::npos, IOError, where,
                ": the manifest's shard file name '", prefix_, "' is not a file name");
  for (const auto& [key, value] : manifest) {
    if (key.compare(0, kShapePrefix.size(), kShapePrefix) != 0) continue;
    const std::string name = key.substr(kShapePrefix.size());
    Entry entry;
    NANODDP_CHECK(value.dtype() == DType::Int64 && value.dim() == 1, IOError, where, ": the shape of '", name,
                  "' is a ", value.shape(), " ", dtype_name(value.dtype()),
                  " entry, not a list of int64 sizes");
    try {
      entry.shape = Shape(value.to_int_vector());
    } catch (const ShapeError& e) {
      NANODDP_THROW(IOError, where, ": the shape of '", name, "': ", message_of(e));
    }
    const int64_t dtype = int64s(kDtypePrefix + name, 1)[0];
    NANODDP_CHECK(dtype >= 0 && dtype <= static_cast<int64_t>(kLastDType), IOError, where, ": '", name,
                  "' has dtype number ", dtype);
    entry.dtype = static_cast<DType>(dtype);
    int64_t nbytes = 0;
    NANODDP_CHECK(
        !__builtin_mul_overflow(entry.shape.numel(), static_cast<int64_t>(dtype_size(entry.dtype)), &nbytes),
        IOError, where, ": '", name, "' of shape ", entry.shape, " needs more bytes than int64 can count");
    const std::vector<int64_t> flat = int64s(kRangesPrefix + name, static_cast<size_t>(2 * world));
    for (int r = 0; r < world_size_; ++r)
      entry.ranges.emplace_back(flat[static_cast<size_t>(2 * r)], flat[static_cast<size_t>(2 * r + 1)]);
    const std::string problem = tiling_problem(entry.ranges, entry.shape.numel());
    NANODDP_CHECK(problem.empty(), IOError, where, ": '", name, "': ", problem);
    entry.replicated = is_replicated(entry.ranges, entry.shape.numel());
    entries_[name] = std::move(entry);
  }
}

std::vector<std::string> ShardedCheckpointReader::names() const {
  std::vector<std::string> out;
  for (const auto& item : entries_) out.push_back(item.first);
  return out;
}

const ShardedCheckpointReader::Entry& ShardedCheckpointReader::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  NANODDP_CHECK(it != entries_.end(), ValueError, "sharded checkpoint ", path_, " holds no '", name, "'");
  return it->second;
}

const Shape& ShardedCheckpointReader::shape(const std::string& name) const { return entry(name).shape; }
DType ShardedCheckpointReader::dtype(const std::string& name) const { return entry(name).dtype; }

bool ShardedCheckpointReader::shard_files_present() const {
  for (int rank = 0; rank < world_size_; ++rank)
    if (!shard_file_matches(folder_ + "/" + shard_file_name(prefix_, generation_, rank, world_size_),
                            shard_nbytes_[static_cast<size_t>(rank)], shard_checksums_[static_cast<size_t>(rank)]))
      return false;
  return true;
}

const nn::StateDict& ShardedCheckpointReader::shard(int rank) {
  const auto found = shards_.find(rank);
  if (found != shards_.end()) return found->second;
  const std::string file = folder_ + "/" + shard_file_name(prefix_, generation_, rank, world_size_);
  const std::string where = "sharded checkpoint " + path_ + ": shard file " + file + " (rank " +
                            std::to_string(rank) + " of " + std::to_string(world_size_) + ")";
  std::string bytes;
  try {
    bytes = read_regular_file(file, "checkpoint shard");
  } catch (const IOError& e) {
    NANODDP_THROW(IOError, where, ": ", message_of(e));
  }
  const int64_t expected = shard_nbytes_[static_cast<size_t>(rank)];
  NANODDP_CHECK(static_cast<int64_t>(bytes.size()) >= expected, IOError, where, ": truncated at byte offset ",
                bytes.size(), " (the manifest says ", expected, " bytes)");
  int64_t checksum = 0;
  if (bytes.size() >= sizeof(int64_t))
    std::memcpy(&checksum, bytes.data() + bytes.size() - sizeof(int64_t), sizeof(int64_t));
  NANODDP_CHECK(static_cast<int64_t>(bytes.size()) == expected &&
                    checksum == shard_checksums_[static_cast<size_t>(rank)],
                IOError, where, ": ", bytes.size(), " bytes with another checksum than the manifest's (",
                expected, " bytes): it is not the file this set's save wrote");
  nn::StateDict state = nn::parse_checkpoint(bytes, file);
  const auto marker = [&](const std::string& key) {
    const auto it = state.find(key);
    return it != state.end() && it->second.dtype() == DType::Int64 && it->second.numel() == 1
               ? it->second.to_int_vector()[0]
               : -1;
  };
  NANODDP_CHECK(marker(kGenerationKey) == generation_ && marker(kRankKey) == rank, IOError, where,
                ": it says generation ", marker(kGenerationKey), ", rank ", marker(kRankKey));
  files_read_.push_back(file);
  return shards_.emplace(rank, std::move(state)).first->second;
}

Tensor ShardedCheckpointReader::read_range(const std::string& name, int64_t begin, int64_t end) {
  const Entry& e = entry(name);
  NANODDP_CHECK(0 <= begin && begin <= end && end <= e.shape.numel(), ValueError, "sharded checkpoint ",
                path_, ": elements [", begin, ", ", end, ") of '", name, "', which has ", e.shape.numel());
  Tensor out = Tensor::empty(Shape({end - begin}), e.dtype);
  const size_t element = dtype_size(e.dtype);
  // A replicated tensor is read from one holder: one whose file is open already if any, else
  // the one set_reading_rank points at, else the first.
  int only = -1;
  if (e.replicated) {
    for (int r = 0; r < world_size_ && only < 0; ++r)
      if (e.ranges[static_cast<size_t>(r)].second > 0 && shards_.count(r) != 0) only = r;
    if (only < 0 && reading_world_size_ > 0) {
      const int guess =
          static_cast<int>(static_cast<int64_t>(reading_rank_) * world_size_ / reading_world_size_);
      if (e.ranges[static_cast<size_t>(guess)].second > 0) only = guess;
    }
    for (int r = 0; r < world_size_ && only < 0; ++r)
      if (e.ranges[static_cast<size_t>(r)].second > 0) only = r;
  }
  for (int r = 0; r < world_size_; ++r) {
    if (only >= 0 && r != only) continue;
    const auto [held_begin, held_end] = e.ranges[static_cast<size_t>(r)];
    const int64_t lo = std::max(begin, held_begin), hi = std::min(end, held_end);
    if (lo >= hi) continue;
    const nn::StateDict& state = shard(r);
    const std::string file = folder_ + "/" + shard_file_name(prefix_, generation_, r, world_size_);
    const auto it = state.find(name);
    NANODDP_CHECK(
        it != state.end() && it->second.dtype() == e.dtype && it->second.numel() == held_end - held_begin,
        IOError, "sharded checkpoint ", path_, ": shard file ", file, " lacks '", name,
        "' as the manifest describes it (", held_end - held_begin, " elements of ", dtype_name(e.dtype), ")");
    std::memcpy(detail::bytes_of(out) + static_cast<size_t>(lo - begin) * element,
                detail::bytes_of(it->second) + static_cast<size_t>(lo - held_begin) * element,
                static_cast<size_t>(hi - lo) * element);
  }
  return out;
}

void ShardedCheckpointReader::set_reading_rank(int rank, int world_size) {
  NANODDP_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, ValueError, "sharded checkpoint ", path_,
                ": reading rank ", rank, " of ", world_size, " is not a rank of the group");
  reading_rank_ = rank;
  reading_world_size_ = world_size;
}

Tensor ShardedCheckpointReader::read(const std::string& name) {
  const Entry& e = entry(name);
  return read_range(name, 0, e.shape.numel()).reshape(e.shape);
}

nn::StateDict ShardedCheckpointReader::read_all(const std::string& prefix) {
  nn::StateDict state;
  for (const auto& item : entries_)
    if (item.first.compare(0, prefix.size(), prefix) == 0)
      state[item.first.substr(prefix.size())] = read(item.first);
  return state;
}

}  // namespace nanoddp::dist
