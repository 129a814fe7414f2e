#include "core/trace.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>

#include "core/error.h"

namespace nanoddp::trace {

namespace detail {
std::atomic<bool> recording{false};
}

namespace {

struct Recorder {
  std::mutex mutex;
  std::vector<Event> events;
  std::string path;  // "" = in memory only
  int rank = 0;
  int world_size = 1;
  double clock_sync_us = 0;
  bool exit_hook_registered = false;
};

Recorder& recorder() {
  static Recorder* r = new Recorder();  // never destroyed: events may arrive during exit
  return *r;
}

std::string absolute(const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  char cwd[4096];
  if (::getcwd(cwd, sizeof(cwd)) == nullptr) return path;
  return std::string(cwd) + "/" + path;
}

std::string folder_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash);
}

// run.json -> run.rank1.json; run -> run.rank1
std::string rank_path(const std::string& path, int rank) {
  const size_t slash = path.rfind('/');
  const size_t dot = path.rfind('.');
  const std::string tag = ".rank" + std::to_string(rank);
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return path + tag;
  return path.substr(0, dot) + tag + path.substr(dot);
}

void write_at_exit() {
  try {
    write();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nanoddp: the trace was not written: %s\n", e.what());
  }
}

// NANODDP_TRACE=FILE starts recording as the library loads, before main().
const bool started_from_environment = [] {
  const char* path = std::getenv("NANODDP_TRACE");
  if (path != nullptr && *path != '\0') {
    try {
      start(path);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "nanoddp: NANODDP_TRACE: %s\n", e.what());
    }
  }
  return true;
}();

void write_event(std::ostream& out, const Event& e, int pid) {
  out << "{\"name\":" << json_string(e.name) << ",\"cat\":" << json_string(lane_name(e.lane))
      << ",\"ph\":\"X\",\"pid\":" << pid << ",\"tid\":" << e.lane << ",\"ts\":" << e.begin_us
      << ",\"dur\":" << (e.end_us - e.begin_us) << ",\"args\":{" << e.args_json << "}}";
}

}  // namespace

std::string lane_name(int lane) {
  switch (lane) {
    case static_cast<int>(Lane::Data): return "data";
    case static_cast<int>(Lane::Compute): return "compute";
    case static_cast<int>(Lane::DDP): return "ddp";
    case static_cast<int>(Lane::Optimizer): return "optimizer";
    default: break;
  }
  if (lane >= kAllReduceLane) return "all_reduce bucket " + std::to_string(lane - kAllReduceLane);
  return "lane " + std::to_string(lane);
}

double now_us() {
  using namespace std::chrono;
  return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}

void start(const std::string& path) {
  Recorder& r = recorder();
  const std::string full = absolute(path);
  if (!full.empty()) {
    NANODDP_CHECK(::access(folder_of(full).c_str(), W_OK) == 0, IOError, "cannot write the trace file ", full,
                  ": its folder ", folder_of(full), " is missing or not writable");
  }
  std::lock_guard<std::mutex> lock(r.mutex);
  r.events.clear();
  r.path = full;
  if (!r.exit_hook_registered) {
    std::atexit(write_at_exit);
    r.exit_hook_registered = true;
  }
  detail::recording.store(true, std::memory_order_relaxed);
}

void stop() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  detail::recording.store(false, std::memory_order_relaxed);
  r.events.clear();
  r.path.clear();
}

void forget_in_memory_events() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.path.empty()) r.events.clear();
}

void set_rank(int rank, int world_size) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.rank = rank;
  r.world_size = world_size;
}

void set_clock_sync(double us) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.clock_sync_us = us;
}

void complete(int lane, std::string name, double begin_us, double end_us, std::string args_json) {
  if (!enabled()) return;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.events.push_back(Event{lane, std::move(name), begin_us, end_us, std::move(args_json)});
}

std::vector<Event> events_since(double since_us) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<Event> found;
  for (const Event& e : r.events)
    if (e.begin_us >= since_us) found.push_back(e);
  return found;
}

std::string write() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!enabled() || r.path.empty()) return "";
  const char* parts_dir = std::getenv("NANODDP_TRACE_PARTS");
  std::string target;
  if (parts_dir != nullptr && *parts_dir != '\0')
    target = std::string(parts_dir) + "/rank" + std::to_string(r.rank) + ".json";
  else
    target = r.world_size > 1 ? rank_path(r.path, r.rank) : r.path;

  const std::string temporary = target + ".tmp";
  {
    std::ofstream out(temporary);
    NANODDP_CHECK(out.good(), IOError, "cannot write the trace file ", temporary);
    out.precision(3);
    out << std::fixed;
    const int pid = r.rank;
    out << "{\"otherData\":{\"rank\":" << r.rank << ",\"world_size\":" << r.world_size
        << ",\"clock_sync_us\":" << r.clock_sync_us << ",\"trace_file\":" << json_string(r.path) << "},\n";
    out << "\"displayTimeUnit\":\"ms\",\n\"traceEvents\":[\n";
    out << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << pid << ",\"args\":{\"name\":\"rank " << r.rank
        << "\"}},\n";
    out << "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" << pid << ",\"args\":{\"sort_index\":" << r.rank
        << "}}";
    std::vector<int> lanes;
    for (const Event& e : r.events)
      if (std::find(lanes.begin(), lanes.end(), e.lane) == lanes.end()) lanes.push_back(e.lane);
    for (int lane : lanes) {
      out << ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << pid << ",\"tid\":" << lane
          << ",\"args\":{\"name\":" << json_string(lane_name(lane)) << "}}";
      out << ",\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":" << pid << ",\"tid\":" << lane
          << ",\"args\":{\"sort_index\":" << lane << "}}";
    }
    for (const Event& e : r.events) {
      out << ",\n";
      write_event(out, e, pid);
    }
    out << "\n]}\n";
    out.flush();
    NANODDP_CHECK(out.good(), IOError, "writing the trace file ", temporary, " failed (disk full?)");
  }
  NANODDP_CHECK(std::rename(temporary.c_str(), target.c_str()) == 0, IOError, "cannot rename ", temporary, " to ",
                target);
  return target;
}

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

}  // namespace nanoddp::trace
