// The collective check's fingerprints on the host: through shared memory (Note [Shared-memory
// fingerprints] in dist/host_fingerprints.cpp) for a Gloo group whose ranks all run on this
// machine, and the CPU group an NCCL group's check exchanges them through (Note [Host
// fingerprints] in dist/process_group_checked.cpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dist/process_group.h"
#include "dist/store.h"

namespace nanoddp::dist {

// A shm group (store keys "<prefix>fingerprints/") for the fingerprints of the group of
// world_size ranks whose keys start with prefix, or null when world_size is 1, a rank runs on
// another machine or a rank cannot make the segment. Collective: every rank of the group calls
// it, and every rank decides the same. TimeoutError when a rank never comes (one that runs
// without the collective check, for instance: the error says so).
std::shared_ptr<ProcessGroup> make_shm_fingerprint_group(const std::shared_ptr<Store>& store,
                                                         const std::string& prefix, int rank, int world_size,
                                                         std::chrono::milliseconds timeout);

// The CPU group for the fingerprints of a device group (NCCL) of world_size ranks: the shm
// group above when every rank runs on this machine, else a Gloo group (store keys
// "<prefix>gloo/", its sockets towards master_addr), or null when world_size is 1 or a rank's
// build has no Gloo (the check then exchanges through the device group). Collective, as above:
// every rank decides the same; DistError or TimeoutError when a rank cannot join it.
std::shared_ptr<ProcessGroup> make_host_fingerprint_group(const std::shared_ptr<Store>& store,
                                                          const std::string& prefix, int rank, int world_size,
                                                          const std::string& master_addr, int master_port,
                                                          std::chrono::milliseconds timeout);

// Every rank's `mine` (all the same length), rank-major, through group (one made above). A
// failure is thrown with its type kept (TimeoutError, so that the check names stragglers, or
// DistError), as "<description>: the collective check's fingerprint exchange (through shared
// memory) failed: ...", in the words of the collective being checked, not of the fingerprint
// group ("through Gloo" for a Gloo group).
std::vector<int64_t> all_gather_fingerprints(ProcessGroup& group, const std::vector<int64_t>& mine,
                                             const std::string& description,
                                             std::chrono::milliseconds timeout);

}  // namespace nanoddp::dist
