#include "dist/output_relay.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>

#include "dist/launch_detail.h"

namespace nanoddp::dist::launch_detail {

namespace {
std::atomic<int> g_writers_left_behind{0};
}  // namespace

int OutputRelay::writers_left_behind() { return g_writers_left_behind; }

namespace {
bool same_file(int a, int b) {
  struct stat sa {}, sb {};
  return fstat(a, &sa) == 0 && fstat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}
}  // namespace

OutputRelay::OutputRelay()
    : stdout_writer_(std::make_shared<Writer>()),
      stderr_writer_(same_file(1, 2) ? stdout_writer_ : std::make_shared<Writer>()) {}

void OutputRelay::run(const std::shared_ptr<Writer>& writer) {
  std::unique_lock<std::mutex> lock(writer->mutex);
  while (true) {
    writer->changed.wait(lock, [&] { return writer->stop || !writer->lines.empty(); });
    if (writer->lines.empty()) {  // stopped, and nothing left
      if (writer->left_behind) --g_writers_left_behind;
      return;
    }
    auto [fd, text] = std::move(writer->lines.front());
    writer->lines.pop_front();
    writer->writing = true;
    // In slices, each counted as written when it is: progress that flush() sees, however
    // slowly the reader takes a long batch of lines.
    constexpr size_t kSlice = 16 * 1024;
    for (size_t offset = 0; offset < text.size(); offset += kSlice) {
      const size_t n = std::min(kSlice, text.size() - offset);
      lock.unlock();
      write_all(fd, text.data() + offset, n);  // may block for as long as the reader does
      lock.lock();
      writer->queued_bytes -= n;
      writer->last_progress = std::chrono::steady_clock::now();
      writer->changed.notify_all();
    }
    writer->writing = false;
    writer->changed.notify_all();
  }
}

void OutputRelay::write(int fd, std::string text) {
  if (text.empty()) return;
  const std::shared_ptr<Writer>& writer = fd == 2 ? stderr_writer_ : stdout_writer_;
  std::lock_guard<std::mutex> lock(writer->mutex);
  if (!writer->thread.joinable()) writer->thread = std::thread([writer] { run(writer); });
  if (writer->queued_bytes == 0)
    writer->last_progress = std::chrono::steady_clock::now();  // not stalled till now
  writer->queued_bytes += text.size();
  writer->lines.emplace_back(fd, std::move(text));
  writer->changed.notify_all();
}

bool OutputRelay::full(int fd) const {
  Writer& writer = fd == 2 ? *stderr_writer_ : *stdout_writer_;
  std::lock_guard<std::mutex> lock(writer.mutex);
  return writer.queued_bytes > kMaxQueuedBytes;
}

bool OutputRelay::flush(const std::function<std::chrono::milliseconds()>& stall_limit) {
  while (true) {
    // A stall is the time since the last byte taken by a writer that still holds some: a
    // reader stalled since before the flush (while a stopped job's ranks ended) has used it up.
    bool pending = false;
    auto last_progress = std::chrono::steady_clock::time_point::min();
    for (const auto& writer : {stdout_writer_, stderr_writer_}) {
      std::lock_guard<std::mutex> lock(writer->mutex);
      if (writer->queued_bytes == 0) continue;
      pending = true;
      last_progress = std::max(last_progress, writer->last_progress);
    }
    if (!pending) return true;
    const auto limit = stall_limit();
    if (limit != kWaitForever && std::chrono::steady_clock::now() - last_progress >= limit) {
      drop_launcher_output();
      return false;
    }
    for (const auto& writer : {stdout_writer_, stderr_writer_}) {
      std::unique_lock<std::mutex> lock(writer->mutex);
      if (writer->queued_bytes > 0) writer->changed.wait_for(lock, std::chrono::milliseconds(10));
    }
  }
}

OutputRelay::~OutputRelay() {
  for (const auto& writer : {stdout_writer_, stderr_writer_}) {
    bool idle = false;
    {
      std::lock_guard<std::mutex> lock(writer->mutex);
      if (!writer->thread.joinable()) continue;  // never started, or already let go (2>&1)
      writer->stop = true;
      idle = writer->lines.empty() && !writer->writing;
      if (!idle) {
        writer->left_behind = true;
        ++g_writers_left_behind;
      }
      writer->changed.notify_all();
    }
    // A writer blocked in write() holds only its shared state: it may outlive the relay.
    if (idle) {
      writer->thread.join();
    } else {
      writer->thread.detach();
    }
  }
}

}  // namespace nanoddp::dist::launch_detail
