// Note [Shared-memory fingerprints]
// The collective check (Note [Fused collective check] in dist/process_group_checked.cpp)
// exchanges a 56-byte fingerprint before every collective.
//
// Through Gloo's sockets that is one more message each way, and on a machine with as many
// ranks as cores every Gloo message is expensive: it waits for the receiver's "ready" notice,
// then wakes the receiver's network thread and its worker, each waking a core or preempting a
// rank's compute. Measured on a 2-core VM (world-2 MLP, median step of 6 runs each): 4.1 ms
// unchecked, 6.0 ms with the fingerprints over Gloo. Through shared memory, one epoch's system
// time is 1.03 s against 0.79 s unchecked (2.50 s over Gloo), and the exchange takes about 50
// microseconds, waiting for the peer included.
//
// So when every rank of the group is on this machine (the same boot id and host name), the
// group makes a shm group of its own (make_shm_process_group, store keys
// "<prefix>fingerprints/") and the fingerprints are all-gathered there: a write into shared
// memory, read by a peer that spins briefly before it sleeps, with no socket and no other
// thread, inside the collective's task on Gloo's worker. Ranks on several machines keep Gloo's
// all-gather. The check of an NCCL group exchanges through such a shm group too, on a thread
// of the check's own, or through a Gloo group of its own when the ranks are on several
// machines or /dev/shm cannot hold the segment (Note [Host fingerprints] in
// dist/process_group_checked.cpp).
#include "dist/host_fingerprints.h"

#include <cstring>

#include "core/error.h"
#include "dist/detail.h"
#include "dist/shm_segment.h"

namespace nanoddp::dist {

namespace {

// Whether every rank of the group says `mine` under "<key>/<rank>": collective, so that every
// rank decides the same. TimeoutError when a rank never says anything (one that runs without
// the collective check, for instance: the error says so).
bool every_rank_says(Store& store, const std::string& key, int rank, int world_size, const std::string& mine,
                     std::chrono::milliseconds timeout) {
  store.set(key + "/" + std::to_string(rank), mine);
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(key + "/" + std::to_string(r));
  try {
    store.wait(keys, timeout);
  } catch (const TimeoutError& e) {
    NANODDP_THROW(
        TimeoutError, message_of(e),
        "; a rank that runs without the collective check never writes its key here: every rank must "
        "run with the same NANODDP_CHECK_COLLECTIVES (InitOptions::check_collectives)");
  }
  bool same = true;
  for (const std::string& each : keys) same = same && store.get_string(each) == mine;
  return same;
}

// True when every rank of the group runs on this machine (shm::machine_id) and could make the
// fingerprints' shm segment (/dev/shm there, `ulimit -f` big enough); collective.
bool shm_fingerprints_possible(Store& store, const std::string& prefix, int rank, int world_size,
                               std::chrono::milliseconds timeout) {
  const bool possible = shm::segment_possible(shm::Layout(world_size).total);
  const std::string mine = shm::machine_id() + (possible ? "" : " (no shm)");
  return every_rank_says(store, prefix + "machine", rank, world_size, mine, timeout) && possible;
}

// What a failed exchange through a fingerprint group (shm, or Gloo for an NCCL group across
// machines) says, in the checked collective's name: that group's own descriptions of its
// all_gather ("rank 2/4 on vm: shm all_gather of [7] int64 (56 bytes) on cpu: ", again inside a
// peer's abort) are dropped, so that a Gloo or NCCL job's error does not read as a collective
// of the fingerprint group.
std::string fingerprint_failure(std::string error, const std::string& backend) {
  const std::string start = backend + " all_gather of [", end = " on cpu: ";
  bool first = true;
  for (size_t at = error.find(start); at != std::string::npos; at = error.find(start, at)) {
    const size_t stop = error.find(end, at);
    if (stop == std::string::npos) break;
    // The first is this rank's own, after its "rank r/W on host: ", which the checked
    // collective's description already has: dropped with it.
    const size_t from = first && error.compare(0, 5, "rank ") == 0 ? 0 : at;
    error.erase(from, stop + end.size() - from);
    at = from;
    first = false;
  }
  return std::string("the collective check's fingerprint exchange (through ") +
         (backend == "shm" ? "shared memory" : backend == "gloo" ? "Gloo" : backend) + ") failed: " + error;
}

}  // namespace

std::shared_ptr<ProcessGroup> make_shm_fingerprint_group(const std::shared_ptr<Store>& store,
                                                         const std::string& prefix, int rank, int world_size,
                                                         std::chrono::milliseconds timeout) {
  if (world_size <= 1 || !shm_fingerprints_possible(*store, prefix, rank, world_size, timeout))
    return nullptr;
  ShmOptions shm;
  shm.rank = rank;
  shm.world_size = world_size;
  shm.timeout = timeout;
  shm.store_prefix = prefix + "fingerprints/";
  return make_shm_process_group(store, shm);
}

std::shared_ptr<ProcessGroup> make_host_fingerprint_group(const std::shared_ptr<Store>& store,
                                                          const std::string& prefix, int rank, int world_size,
                                                          const std::string& master_addr, int master_port,
                                                          std::chrono::milliseconds timeout) {
  if (auto shm = make_shm_fingerprint_group(store, prefix, rank, world_size, timeout)) return shm;
  if (world_size <= 1) return nullptr;
  // Every rank decides the same: Gloo only when every rank's build has it (a rank that tried
  // alone would wait for the others' addresses until the timeout).
  const bool gloo_built = backend_unavailable(Backend::Gloo).empty();
  if (!every_rank_says(*store, prefix + "gloo_built", rank, world_size, gloo_built ? "1" : "0", timeout) ||
      !gloo_built)
    return nullptr;
  GlooOptions gloo;
  gloo.rank = rank;
  gloo.world_size = world_size;
  gloo.master_addr = master_addr;
  gloo.master_port = master_port;
  gloo.timeout = timeout;
  gloo.store_prefix = prefix + "gloo/";
  return make_gloo_process_group(store, gloo);
}

std::vector<int64_t> all_gather_fingerprints(ProcessGroup& group, const std::vector<int64_t>& mine,
                                             const std::string& description,
                                             std::chrono::milliseconds timeout) {
  const int world_size = group.size();
  const auto length = static_cast<int64_t>(mine.size());
  std::vector<Tensor> rows;
  for (int r = 0; r < world_size; ++r) rows.push_back(Tensor::empty({length}, DType::Int64));
  try {
    group.all_gather(rows, Tensor::from_vector(mine))->wait(timeout);
  } catch (const TimeoutError& e) {  // the type kept: the check names stragglers on a timeout
    NANODDP_THROW(TimeoutError, description, ": ", fingerprint_failure(message_of(e), group.backend_name()));
  } catch (const DistError& e) {
    NANODDP_THROW(DistError, description, ": ", fingerprint_failure(message_of(e), group.backend_name()));
  }
  std::vector<int64_t> table(mine.size() * static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r)
    std::memcpy(table.data() + r * mine.size(), rows[r].data<int64_t>(), mine.size() * sizeof(int64_t));
  return table;
}

}  // namespace nanoddp::dist
