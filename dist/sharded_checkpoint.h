// Sharded checkpoints: each rank writes the pieces of the state it holds to a file of its own,
// and rank 0 writes a small manifest that names them and says how every tensor is split. Any
// world size reads the set back (torch.distributed.checkpoint's save/load with resharding).
//
//   dist::ShardedStateDict mine = fsdp.sharded_model_state_dict();       // this rank's pieces
//   dist::save_sharded_checkpoint("run.ckpt", mine, *pg);               // a collective
//   dist::ShardedCheckpointReader reader("run.ckpt");                    // at any world size
//   Tensor part = reader.read_range("model.0.weight", 100, 200);         // opens only what it needs
//
// Note [Sharded checkpoint sets]
// A set is FILE, the manifest, and FILE.g<G>.shard-<r>-of-<W> for r in [0, W): one shard file per
// rank of the saving group, G a generation number new to each save. Every tensor of the state
// is seen as its flattened elements [0, numel); each rank holds a contiguous range of them
// (possibly empty), and together the ranges tile [0, numel) exactly. FSDP's ranges come from
// the flat parameters: rank r's shard [r S, (r + 1) S) of a unit cut at each parameter's
// offset; ZeRO-1's from ownership: the owner holds all of a parameter, the others nothing.
// State every rank holds alike (step counts, the schedule) is either held by one rank or saved
// whole by several (replicated); a reader takes a replicated tensor from a file it has open
// already, so that it opens no file for it alone.
// Saving, in numbered steps:
//   1. rank 0 picks G, one more than any generation of FILE's shard files on disk, and sends it;
//   2. each rank writes its shard file atomically (write_file_atomically, core/file_io.h);
//   3. the ranks gather on rank 0 what each holds (names, shapes, dtypes, ranges) and whether
//      its write succeeded; a failure anywhere fails every rank, and FILE is untouched;
//   4. rank 0 keeps FILE as FILE.prev (a hard link) and replaces FILE with the new manifest,
//      which holds the world size, G, each tensor's shape, dtype and per-rank range, and each
//      shard file's size and checksum. This rename is the commit point: before it FILE names
//      the previous set, whose shard files are all still there; after it, the new one;
//   5. rank 0 removes the shard files that neither FILE nor FILE.prev names (the set before
//      the previous one, and what a crashed save left behind), and tells every rank that the
//      save is done.
// Loading at W' reads the manifest, then only the shard files whose ranges overlap the ranges a
// rank asks for: an FSDP rank at W' = 2 reading a set saved at W = 4 asks for [r S', (r + 1) S')
// of each unit and opens the two old shards inside it.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "dist/process_group.h"
#include "nn/module.h"

namespace nanoddp::dist {

// The elements [begin, end) of a tensor of `shape` and `dtype`, flattened in row-major order,
// that this rank holds: piece is a CPU tensor [end - begin] of dtype (undefined or empty when
// begin == end).
struct ShardedEntry {
  Shape shape;
  DType dtype = DType::Float32;
  int64_t begin = 0;
  int64_t end = 0;
  Tensor piece;
};
// By the tensor's name in the whole state ("model.0.weight", "optimizer.exp_avg.2").
using ShardedStateDict = std::map<std::string, ShardedEntry>;

// An entry holding all of t (copied to the CPU): what a rank saves of state it alone holds.
ShardedEntry whole_entry(const Tensor& t);
// Adds every entry of part to into as prefix + name.
void merge_prefixed(ShardedStateDict& into, const std::string& prefix, const ShardedStateDict& part);

// Saves every rank's entries as one set (Note [Sharded checkpoint sets]). A collective: every
// rank calls it with the same path, on a filesystem they all see. Entries of one name on
// several ranks must agree on shape and dtype, and their ranges must tile the tensor or each
// be all of it (then their values must be equal: any one is read back); a name on some ranks
// only is held by those. Throws ValueError for a malformed entry (a piece of
// another length or dtype than its range; a range outside its tensor) on the rank that has
// it, and on rank 0 for ranges that overlap or leave a gap and for whole copies whose values
// differ (compared by an FNV-1a digest of their bytes); IOError naming the file when a
// write fails (a full disk, ulimit -f). Whatever fails, it fails on every rank (the others
// name the failed ranks), and FILE still names the previous set, which loads as before.
// DistError or TimeoutError from the collectives.
void save_sharded_checkpoint(const std::string& path, const ShardedStateDict& mine, ProcessGroup& pg,
                             std::chrono::milliseconds timeout = kDefaultTimeout);

// The name of rank's shard file in a set of generation G saved by world_size ranks under
// path: "<path>.g<G>.shard-<rank>-of-<world_size>".
std::string shard_file_name(const std::string& path, int64_t generation, int rank, int world_size);
// True when file has the name of one of path's shard files (shard_file_name's pattern, any
// generation, rank and world size) in path's folder. Both as given: resolve them first to
// compare files reached by different paths.
bool is_shard_file_name(const std::string& path, const std::string& file);

// True when state (a parsed nanoddp checkpoint) is a sharded set's manifest rather than a
// full checkpoint.
bool is_sharded_manifest(const nn::StateDict& state);

// Removes the shard files in path's folder that belong to path's sets ("<basename>.g*.shard-*")
// but that neither path nor path.prev names. Only nanoddp checkpoint files are removed
// (nn::is_checkpoint_file): someone else's file that happens to have such a name stays.
// Returns how many it removed. For a program that saves a full checkpoint over a sharded one:
// the sets it replaced go. Files it cannot remove are left (a later call tries again).
int remove_unused_shard_files(const std::string& path);

// Reads a set at any world size: the manifest when built, each shard file when a read first
// needs it (then kept). Every error is an IOError naming the file: a missing or unreadable
// shard file (with its rank), one whose size or checksum is not the manifest's (another set's
// file, or truncated: the size it has and the one expected), a corrupt one (the offset, from
// nn::parse_checkpoint), a manifest whose ranges do not tile a tensor.
class ShardedCheckpointReader {
 public:
  // Reads and checks the manifest at path.
  explicit ShardedCheckpointReader(const std::string& path);
  // The same from a manifest already parsed from path (is_sharded_manifest(manifest)).
  ShardedCheckpointReader(const std::string& path, const nn::StateDict& manifest);

  const std::string& path() const { return path_; }
  int world_size() const { return world_size_; }
  int64_t generation() const { return generation_; }
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  // KeyError-like ValueError for a name the set does not hold.
  const Shape& shape(const std::string& name) const;
  DType dtype(const std::string& name) const;

  // The whole tensor, shape(name) of dtype(name), on the CPU.
  Tensor read(const std::string& name);
  // Its flattened elements [begin, end): [end - begin] of dtype(name). Opens only the shard
  // files whose ranges overlap. ValueError for a range outside [0, numel).
  Tensor read_range(const std::string& name, int64_t begin, int64_t end);
  // Every tensor whose name starts with prefix, whole, keyed without the prefix.
  nn::StateDict read_all(const std::string& prefix = "");
  // Which rank of how many reads: a tensor every saved rank holds whole, read before any shard
  // file is open, then comes from the file as far through the set as this rank is through its
  // group (saved rank rank * saved world size / world_size), the one its own shard most likely
  // needs, not from file 0 on every rank. ValueError unless 0 <= rank < world_size.
  void set_reading_rank(int rank, int world_size);
  // The shard files opened so far, in the order they were: what this rank read.
  const std::vector<std::string>& files_read() const { return files_read_; }
  // Whether every shard file is there with the size and the final checksum the manifest
  // gives it (read: the last 8 bytes of each; a byte changed inside a file is found only when
  // the file is read). What a save looks at before it keeps the set as the previous one.
  bool shard_files_present() const;

 private:
  struct Entry {
    Shape shape;
    DType dtype;
    std::vector<std::pair<int64_t, int64_t>> ranges;  // [world_size]
    bool replicated = false;                          // several ranks hold all of it
  };
  void parse(const nn::StateDict& manifest);
  const Entry& entry(const std::string& name) const;
  const nn::StateDict& shard(int rank);

  std::string path_;
  std::string folder_, prefix_;  // shard files are folder_/prefix_.g<G>.shard-...
  int world_size_ = 0;
  int64_t generation_ = 0;
  std::vector<int64_t> shard_nbytes_, shard_checksums_;
  std::map<std::string, Entry> entries_;
  std::map<int, nn::StateDict> shards_;
  std::vector<std::string> files_read_;
  int reading_rank_ = -1, reading_world_size_ = 0;
};

}  // namespace nanoddp::dist
