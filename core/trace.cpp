#include "core/trace.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>

#include "core/error.h"
#include "core/file_io.h"
#include "core/replace_file.h"

namespace nanoddp::trace {

namespace detail {
std::atomic<bool> recording{false};
}

namespace {

// Note [Trace storage]
// Events live until the file is written, while training allocates and frees a batch's
// tensors every step. Kept as one heap object per string, they sat between those tensors'
// blocks: the allocator could not reuse the holes for the next step's tensors and the heap
// grew by about a batch's worth each step (a 1-epoch Fashion-MNIST run went from 76 to
// 165 MB peak RSS for 15,000 events of ~130 bytes). So events are fixed-size records in
// blocks of kRecordsPerBlock, and their text (name, args) is appended to text blocks of
// kTextBlockBytes: one allocation per few thousand events, none freed until the trace is.
// Records point into the text blocks, which never move.
struct Record {
  int lane;
  uint32_t name_size;
  uint32_t args_size;
  const char* name;
  const char* args;
  double begin_us;
  double end_us;
};

class EventStore {
 public:
  void add(int lane, const std::string& name, double begin_us, double end_us, const std::string& args) {
    if (records_.empty() || used_in_last_ == kRecordsPerBlock) {
      records_.push_back(std::make_unique<Record[]>(kRecordsPerBlock));
      used_in_last_ = 0;
    }
    records_.back()[used_in_last_++] = Record{lane,
                                               static_cast<uint32_t>(name.size()),
                                               static_cast<uint32_t>(args.size()),
                                               keep(name),
                                               keep(args),
                                               begin_us,
                                               end_us};
  }
  void clear() {
    records_.clear();
    text_.clear();
    used_in_last_ = 0;
    text_left_ = 0;
  }
  // Calls fn(record) for every event, in recording order.
  template <typename Fn>
  void for_each(Fn&& fn) const {
    for (size_t b = 0; b < records_.size(); ++b) {
      const size_t used = b + 1 == records_.size() ? used_in_last_ : kRecordsPerBlock;
      for (size_t i = 0; i < used; ++i) fn(records_[b][i]);
    }
  }

 private:
  static constexpr size_t kRecordsPerBlock = 4096;
  static constexpr size_t kTextBlockBytes = 1 << 20;

  // A copy of text in the current text block (a new block when it does not fit).
  const char* keep(const std::string& text) {
    if (text.empty()) return "";
    if (text.size() > text_left_) {
      const size_t bytes = std::max(kTextBlockBytes, text.size());
      text_.push_back(std::make_unique<char[]>(bytes));
      text_next_ = text_.back().get();
      text_left_ = bytes;
    }
    char* copy = text_next_;
    std::memcpy(copy, text.data(), text.size());
    text_next_ += text.size();
    text_left_ -= text.size();
    return copy;
  }

  std::vector<std::unique_ptr<Record[]>> records_;
  size_t used_in_last_ = 0;
  std::vector<std::unique_ptr<char[]>> text_;
  char* text_next_ = nullptr;
  size_t text_left_ = 0;
};

Event to_event(const Record& r) {
  return Event{r.lane, std::string(r.name, r.name_size), r.begin_us, r.end_us, std::string(r.args, r.args_size)};
}

struct Recorder {
  std::mutex mutex;
  EventStore events;
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

// run.json -> run.rank1.json; run -> run.rank1
std::string rank_path(const std::string& path, int rank) {
  const size_t slash = path.rfind('/');
  const size_t dot = path.rfind('.');
  const std::string tag = ".rank" + std::to_string(rank);
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return path + tag;
  return path.substr(0, dot) + tag + path.substr(dot);
}

// A trace of ours begins as a rank's (write(): {"otherData":{"rank":...) or a merged one
// does (merge_parts: {"displayTimeUnit":"ms",...).
bool begins_as_trace(const std::string& head, uint64_t /*size_bytes*/) {
  const auto begins = [&head](const std::string& start) { return head.compare(0, start.size(), start) == 0; };
  return begins("{\"otherData\":{\"rank\":") || begins("{\"displayTimeUnit\":\"ms\",");
}

// Throws IOError before anything is recorded when the trace could not be written to path at
// the end: the checks write_file_atomically makes, and a trace replaces only a trace.
void check_trace_target(const std::string& path) {
  check_writable(path, "trace file");
  check_replaces_only(path, "the trace file", "a trace", begins_as_trace);
}

// NANODDP_TRACE_PARTS: nanoddp-run's folder for this node's parts, or "" outside it.
std::string parts_folder() {
  const char* folder = std::getenv("NANODDP_TRACE_PARTS");
  return folder != nullptr ? folder : "";
}

void write_at_exit() {
  try {
    write();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nanoddp: the trace was not written: %s\n", message_of(e).c_str());
  }
}

std::string& environment_error_text() {
  static std::string text;
  return text;
}

// NANODDP_TRACE=FILE starts recording as the library loads, before main().
const bool started_from_environment = [] {
  const char* path = std::getenv("NANODDP_TRACE");
  if (path != nullptr && *path != '\0') {
    try {
      start(path);
    } catch (const std::exception& e) {
      environment_error_text() = message_of(e);
      std::fprintf(stderr, "nanoddp: NANODDP_TRACE: %s\n", message_of(e).c_str());
    }
  }
  return true;
}();

void write_event(std::ostream& out, const Record& e, int pid) {
  out << "{\"name\":" << json_string(std::string(e.name, e.name_size)) << ",\"cat\":" << json_string(lane_name(e.lane))
      << ",\"ph\":\"X\",\"pid\":" << pid << ",\"tid\":" << e.lane << ",\"ts\":" << e.begin_us
      << ",\"dur\":" << (e.end_us - e.begin_us) << ",\"args\":{";
  out.write(e.args, e.args_size);
  out << "}}";
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
  if (lane >= kFsdpUnitLane) return "fsdp unit " + std::to_string(lane - kFsdpUnitLane);
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
  if (!full.empty()) check_trace_target(full);
  std::lock_guard<std::mutex> lock(r.mutex);
  r.events.clear();
  r.path = full;
  if (!r.exit_hook_registered) {
    std::atexit(write_at_exit);
    r.exit_hook_registered = true;
  }
  detail::recording.store(true, std::memory_order_relaxed);
  environment_error_text().clear();  // a program's own --trace overrides a refused NANODDP_TRACE
}

const std::string& environment_error() { return environment_error_text(); }

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
  // This rank's own file, checked as start() checks path: before training, not at exit.
  if (!r.path.empty() && world_size > 1 && parts_folder().empty()) check_trace_target(rank_path(r.path, rank));
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
  r.events.add(lane, name, begin_us, end_us, args_json);
}

std::vector<Event> events_since(double since_us) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<Event> found;
  r.events.for_each([&](const Record& e) {
    if (e.begin_us >= since_us) found.push_back(to_event(e));
  });
  return found;
}

std::string write() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!enabled() || r.path.empty()) return "";
  const std::string parts_dir = parts_folder();
  std::string target;
  if (!parts_dir.empty()) {
    // nanoddp-run names the folder and the first rank to write a part creates it (a job
    // without a trace leaves none behind). A folder already there must be this user's.
    if (::mkdir(parts_dir.c_str(), 0700) != 0) {
      const int error = errno;
      struct stat info {};
      NANODDP_CHECK(error == EEXIST && ::lstat(parts_dir.c_str(), &info) == 0 && S_ISDIR(info.st_mode) &&
                        info.st_uid == ::geteuid(),
                    IOError, "the trace file: cannot create the folder for this node's trace parts ", parts_dir,
                    " (NANODDP_TRACE_PARTS): ",
                    error == EEXIST ? std::string("it exists and is not a folder of this user") : std::strerror(error));
    }
    target = parts_dir + "/rank" + std::to_string(r.rank) + ".json";
  } else
    target = r.world_size > 1 ? rank_path(r.path, r.rank) : r.path;

  replace_file(target, "the trace file", [&](std::ostream& out) {
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
    r.events.for_each([&](const Record& e) {
      if (std::find(lanes.begin(), lanes.end(), e.lane) == lanes.end()) lanes.push_back(e.lane);
    });
    for (int lane : lanes) {
      out << ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << pid << ",\"tid\":" << lane
          << ",\"args\":{\"name\":" << json_string(lane_name(lane)) << "}}";
      out << ",\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":" << pid << ",\"tid\":" << lane
          << ",\"args\":{\"sort_index\":" << lane << "}}";
    }
    r.events.for_each([&](const Record& e) {
      out << ",\n";
      write_event(out, e, pid);
    });
    out << "\n]}\n";
  });
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
