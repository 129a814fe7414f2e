// trace::merge_parts: one file from the parts the ranks of a job wrote (core/trace.h).
//
// Note [Trace clocks]
// Each rank stamps events with its own steady clock. On one machine those clocks are the same
// clock; across machines they are not. So when a trace is being recorded, init_process_group
// estimates each rank's offset to rank 0's clock through the store, as NTP does: rank r notes
// its clock, sets a key, and waits for rank 0's answer, which carries rank 0's clock at the
// moment it saw the key. That moment lies within rank r's round trip, so the offset is known to
// half a round trip; of 8 rounds the shortest is kept (a rank descheduled on a busy machine
// only makes a round longer). A barrier would not do: on a loaded machine the ranks leave it
// milliseconds apart. Each rank records the reading of its clock at one common instant (0 on
// rank 0's clock), and the merge shifts rank r's events by (rank 0's reading - rank r's),
// which puts every rank on rank 0's clock. Under MPI, which has no store, the common instant is
// the exit of one MPI barrier.
#include <dirent.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/replace_file.h"
#include "core/trace.h"

namespace nanoddp::trace {

std::string merge_parts(const std::string& parts_dir) {
  std::vector<std::string> files;
  if (DIR* dir = ::opendir(parts_dir.c_str())) {
    while (dirent* entry = ::readdir(dir)) {
      const std::string name = entry->d_name;
      if (name.rfind("rank", 0) == 0 && name.size() > 5 && name.compare(name.size() - 5, 5, ".json") == 0)
        files.push_back(parts_dir + "/" + name);
    }
    ::closedir(dir);
  }
  if (files.empty()) return "";
  std::sort(files.begin(), files.end());

  std::vector<nlohmann::json> parts;
  for (const std::string& file : files) {
    std::ifstream in(file);
    try {
      parts.push_back(nlohmann::json::parse(in));
      const auto& other = parts.back().at("otherData");
      (void)other.at("rank").get<int>();
      (void)other.at("clock_sync_us").get<double>();
      (void)other.at("trace_file").get<std::string>();
    } catch (const nlohmann::json::exception& e) {
      NANODDP_THROW(IOError, "cannot merge the trace part ", file, ": ", message_of(e));
    }
  }
  std::sort(parts.begin(), parts.end(), [](const nlohmann::json& a, const nlohmann::json& b) {
    return a["otherData"]["rank"].get<int>() < b["otherData"]["rank"].get<int>();
  });
  const std::string target = parts[0]["otherData"]["trace_file"].get<std::string>();
  const double reference_sync = parts[0]["otherData"]["clock_sync_us"].get<double>();

  nlohmann::json merged;
  merged["displayTimeUnit"] = "ms";
  merged["otherData"] = {{"world_size", parts[0]["otherData"]["world_size"]}, {"ranks", parts.size()}};
  nlohmann::json& events = merged["traceEvents"] = nlohmann::json::array();
  for (const nlohmann::json& part : parts) {
    NANODDP_CHECK(part["otherData"]["trace_file"].get<std::string>() == target, IOError,
                  "trace parts in ", parts_dir, " name different files: ", target, " and ",
                  part["otherData"]["trace_file"].get<std::string>());
    const double shift = reference_sync - part["otherData"]["clock_sync_us"].get<double>();
    for (nlohmann::json event : part.at("traceEvents")) {
      if (event.contains("ts")) event["ts"] = event["ts"].get<double>() + shift;
      events.push_back(std::move(event));
    }
  }

  replace_file(target, "the merged trace", [&](std::ostream& out) { out << merged.dump() << "\n"; });
  return target;
}

}  // namespace nanoddp::trace
