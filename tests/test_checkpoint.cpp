// Checkpoint files under real processes: writers that save the same path at once, and a
// writer killed with SIGKILL in the middle of a save, one stopped by the file size limit, and
// targets a save must refuse (a folder, a pipe) or follow (a symlink).
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/file_io.h"
#include "nn/checkpoint.h"
#include "nn/safetensors.h"
#include "tests/multiprocess.h"
#include "tests/subprocess.h"

using namespace nanoddp;
using namespace nanoddp::nn;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

// Writer w's checkpoint: "w" holds numel copies of w + 1, "writer" holds w. A load that mixed
// two writers' bytes, or cut one short, fails its checksum or these values.
StateDict writer_state(int writer, int64_t numel) {
  StateDict state;
  state["w"] = Tensor::full({numel}, static_cast<float>(writer + 1));
  state["writer"] = Tensor::from_vector(std::vector<int64_t>{writer});
  return state;
}

// Which writer's complete checkpoint path holds; throws if it is neither.
int writer_of(const std::string& path, int64_t numel) {
  const StateDict state = load_checkpoint(path);
  const int writer = static_cast<int>(state.at("writer").to_int_vector().at(0));
  const std::vector<float> values = state.at("w").to_vector();
  if (static_cast<int64_t>(values.size()) != numel ||
      values != std::vector<float>(static_cast<size_t>(numel), static_cast<float>(writer + 1)))
    throw std::runtime_error("checkpoint " + path + " mixes writers");
  return writer;
}

std::vector<std::string> temporaries_of(const std::string& path) {
  std::vector<std::string> found;
  const std::string base = fs::path(path).filename().string() + ".tmp";
  for (const auto& entry : fs::directory_iterator(fs::path(path).parent_path()))
    if (entry.path().filename().string().rfind(base, 0) == 0) found.push_back(entry.path().string());
  return found;
}

// Forks a process that saves writer 1's checkpoint of numel values at path (SIGINT and SIGTERM
// at their defaults, as in a program that handles neither) and sends it signal_number as soon
// as its temporary file appears. Returns the process's wait status, and whether the signal went
// out while the temporary file was there (false: the save ended first).
std::pair<int, bool> save_and_signal(const std::string& path, int64_t numel, int signal_number) {
  for (const auto& stale : temporaries_of(path)) fs::remove(stale);
  std::fflush(nullptr);
  const pid_t writer = ::fork();
  REQUIRE(writer >= 0);
  if (writer == 0) {
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    try {
      save_checkpoint(path, writer_state(1, numel));
    } catch (...) {
      ::_exit(1);
    }
    ::_exit(0);
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < deadline) {
    if (!temporaries_of(path).empty()) {
      ::kill(writer, signal_number);
      REQUIRE(::waitpid(writer, &status, 0) == writer);
      return {status, true};
    }
    if (::waitpid(writer, &status, WNOHANG) == writer) return {status, false};  // finished before we saw it
    std::this_thread::sleep_for(100us);
  }
  ::kill(writer, SIGKILL);
  REQUIRE(::waitpid(writer, &status, 0) == writer);
  FAIL("the save neither showed its temporary file nor ended in 60 s");
  return {status, false};
}

}  // namespace

TEST_CASE("two processes saving the same path at once: every save succeeds, every load is whole") {
  testing::TempDir dir;
  const std::string path = dir.path + "/run.ckpt";
  constexpr int64_t kNumel = 1 << 12;  // 16 KiB a save; the fsync makes saves overlap
  constexpr int kSaves = 40;
  save_checkpoint(path, writer_state(0, kNumel));
  // Ranks 0 and 1 save kSaves times each (every failure is thrown, so reported); rank 2 loads
  // all the while and checks each file is one writer's complete checkpoint.
  const std::string failures = testing::run_ranks(
      3,
      [&](int rank) {
        if (rank < 2) {
          const StateDict mine = writer_state(rank, kNumel);
          for (int i = 0; i < kSaves; ++i) save_checkpoint(path, mine);
          return;
        }
        for (int i = 0; i < 2 * kSaves; ++i) writer_of(path, kNumel);
      },
      120s);
  CHECK_MESSAGE(failures.empty(), failures);
  const int last = writer_of(path, kNumel);
  CHECK((last == 0 || last == 1));
  CHECK(temporaries_of(path).empty());
}

TEST_CASE("kill -9 during a save leaves the previous checkpoint loadable") {
  testing::TempDir dir;
  const std::string path = dir.path + "/run.ckpt";
  constexpr int64_t kSmall = 4, kLarge = int64_t{1} << 22;  // the new one: 16 MiB, a long write
  save_checkpoint(path, writer_state(0, kSmall));
  // Kill the writer as soon as its temporary file appears. When the kill lands before the
  // rename, path must still be the previous checkpoint, whole; a kill that comes too late
  // finds the new one, whole. Some trial must land mid-save, or the test proved nothing.
  int killed_mid_save = 0;
  for (int trial = 0; trial < 5 && killed_mid_save < 2; ++trial) {
    save_and_signal(path, kLarge, SIGKILL);
    const bool mid_save = !temporaries_of(path).empty();
    const int found = writer_of(path, mid_save ? kSmall : kLarge);  // throws unless whole
    CHECK(found == (mid_save ? 0 : 1));
    if (mid_save) {
      ++killed_mid_save;
    } else {
      save_checkpoint(path, writer_state(0, kSmall));  // back to the small one for the next trial
    }
  }
  CHECK(killed_mid_save > 0);
  // What the killed writers left, the next save removes.
  CHECK_FALSE(temporaries_of(path).empty());
  save_checkpoint(path, writer_state(0, kSmall));
  CHECK(temporaries_of(path).empty());
}

TEST_CASE(
    "a save removes the temporary files of its path that dead writers of its pid space left, no other") {
  testing::TempDir dir;
  const std::string path = dir.path + "/run.ckpt";
  const std::string prefix = temporary_file_prefix(path);  // "<path>.tmp.<space>."
  REQUIRE(prefix.rfind(path + ".tmp.", 0) == 0);
  const std::string space = prefix.substr(path.size() + 5, 16);
  const pid_t gone = ::fork();  // a pid that no process has once it is reaped
  if (gone == 0) ::_exit(0);
  REQUIRE(::waitpid(gone, nullptr, 0) == gone);
  const auto temporary = [&](const std::string& of, const std::string& writer_space, pid_t pid) {
    const std::string name = of + ".tmp." + writer_space + "." + std::to_string(pid) + ".Ab12Cd";
    std::FILE* file = std::fopen(name.c_str(), "w");
    REQUIRE(file != nullptr);
    std::fclose(file);
    return name;
  };
  const std::string stale = temporary(path, space, gone);
  const std::string live = temporary(path, space, ::getppid());  // the test runner's parent runs
  // Another machine's or container's writer: its pid means nothing here.
  const std::string elsewhere =
      temporary(path, std::string(16, '0') == space ? "0000000000000001" : std::string(16, '0'), gone);
  const std::string other_file = temporary(dir.path + "/other.ckpt", space, gone);
  save_checkpoint(path, writer_state(0, 4));
  CHECK_FALSE(fs::exists(stale));
  CHECK(fs::exists(live));
  CHECK(fs::exists(elsewhere));
  CHECK(fs::exists(other_file));
  CHECK(writer_of(path, 4) == 0);
  // A name too long for the pid space keeps the short form and still saves.
  const std::string long_path = dir.path + "/" + std::string(240, 'n');
  CHECK(temporary_file_prefix(long_path).empty());
  save_checkpoint(long_path, writer_state(0, 4));
  CHECK(writer_of(long_path, 4) == 0);
}

TEST_CASE("Ctrl-C (SIGINT) or SIGTERM during a save: the process ends by the signal, with no temporary file left") {
  testing::TempDir dir;
  const std::string path = dir.path + "/run.ckpt";
  constexpr int64_t kSmall = 4, kLarge = int64_t{1} << 22;  // 16 MiB: a long write
  save_checkpoint(path, writer_state(0, kSmall));
  // Signal the writer as soon as its temporary file appears (Note [Temporary files and
  // signals] in core/file_io.cpp); some trial must land mid-save, or the test proved nothing.
  int signalled_mid_save = 0;
  for (int trial = 0; trial < 6 && signalled_mid_save < 2; ++trial) {
    const int signal_number = trial % 2 == 0 ? SIGINT : SIGTERM;
    CAPTURE(signal_number);
    const auto [status, seen] = save_and_signal(path, kLarge, signal_number);
    CHECK(temporaries_of(path).empty());
    if (WIFSIGNALED(status)) {
      CHECK(WTERMSIG(status) == signal_number);  // ended as the signal ends it, not with an exit code
      if (seen) ++signalled_mid_save;
      // The previous checkpoint, whole; or, when the signal came after the rename (while the
      // folder was being synced), the new one, whole.
      int found = -1;
      try {
        found = writer_of(path, kSmall);
      } catch (const std::exception&) {
        found = writer_of(path, kLarge);
      }
      CHECK((found == 0 || found == 1));
      if (found == 1) save_checkpoint(path, writer_state(0, kSmall));
    } else {
      save_checkpoint(path, writer_state(0, kSmall));  // it had finished: back to the small one
    }
  }
  CHECK(signalled_mid_save > 0);
}

TEST_CASE("a save past the file size limit (ulimit -f) is an IOError naming it; the old checkpoint stays") {
  testing::TempDir dir;
  const std::string path = dir.path + "/run.ckpt";
  constexpr int64_t kSmall = 4, kLarge = 16384;  // the new one: 64 KiB, past the 32 KiB limit
  save_checkpoint(path, writer_state(0, kSmall));
  // Not killed by SIGXFSZ, and no temporary file left next to the checkpoint.
  const std::string message =
      testing::io_error_past_file_size_limit(32768, [&] { save_checkpoint(path, writer_state(1, kLarge)); });
  CHECK_MESSAGE(message.find("File too large") != std::string::npos, message);
  CHECK_MESSAGE(message.find("ulimit -f, is 32768 bytes") != std::string::npos, message);
  CHECK_MESSAGE(message.find("checkpoint " + path + ": write failed at byte offset 32768 of ") == 0, message);
  CHECK_MESSAGE(message.find("(into the temporary file " + path + ".tmp.") != std::string::npos, message);
  CHECK(temporaries_of(path).empty());
  CHECK(writer_of(path, kSmall) == 0);
}

TEST_CASE("a saved file's mode is torch.save's: 0666 less the umask when new, the old file's mode when it replaces one") {
  testing::TempDir dir;
  const StateDict state = writer_state(1, 4);
  const auto mode_of = [](const std::string& path) {
    struct stat info {};
    REQUIRE(::stat(path.c_str(), &info) == 0);
    return info.st_mode & 07777;
  };
  const mode_t old_mask = ::umask(077);
  save_checkpoint(dir.path + "/private.ckpt", state);
  save_safetensors(dir.path + "/private.safetensors", state);
  ::umask(022);
  save_checkpoint(dir.path + "/shared.ckpt", state);
  ::umask(old_mask);
  CHECK(mode_of(dir.path + "/private.ckpt") == 0600);  // not a fixed 0644: the umask counts
  CHECK(mode_of(dir.path + "/private.safetensors") == 0600);
  CHECK(mode_of(dir.path + "/shared.ckpt") == 0644);
  // Replacing a file keeps its mode, as writing it in place would.
  REQUIRE(::chmod((dir.path + "/shared.ckpt").c_str(), 0640) == 0);
  save_checkpoint(dir.path + "/shared.ckpt", state);
  CHECK(mode_of(dir.path + "/shared.ckpt") == 0640);
  CHECK(writer_of(dir.path + "/shared.ckpt", 4) == 1);
}

TEST_CASE("saves check their target first: no folder, a folder, a pipe, an empty path are IOErrors; a symlink is written through") {
  testing::TempDir dir;
  const std::string fifo = dir.path + "/pipe", real = dir.path + "/real.ckpt", link = dir.path + "/run.ckpt";
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  const StateDict state = writer_state(1, 4);
  using Save = std::function<void(const std::string&)>;
  const std::vector<std::pair<const char*, Save>> saves = {
      {"checkpoint", [&](const std::string& path) { save_checkpoint(path, state); }},
      {"safetensors", [&](const std::string& path) { save_safetensors(path, state); }},
  };
  for (const auto& one_save : saves) {
    // Named copies, not structured bindings: clang refuses bindings inside doctest's macros.
    const char* const what = one_save.first;
    const Save& save = one_save.second;
    CAPTURE(what);
    // Each is refused up front, naming the problem: a missing folder by its name (not a
    // temporary file's), a folder before any temporary file is written, a pipe or device (as
    // root, /dev/full) without being replaced by a regular file, an empty path without a
    // ".tmp.XXXXXX" in the working folder.
    const std::vector<std::pair<std::string, std::string>> refused = {
        {dir.path + "/missing/run.ckpt", ": folder " + dir.path + "/missing does not exist"},
        {dir.path, " exists but is a folder"},
        {fifo, " exists but is not a regular file"},
        {"", ": the path is empty"},
    };
    for (const auto& one_refused : refused) {
      const std::string& path = one_refused.first;
      const std::string& message = one_refused.second;
      CAPTURE(path);
      try {
        save(path);
        FAIL("expected IOError");
      } catch (const IOError& e) {
        CHECK_MESSAGE(std::string(e.what()).find(std::string(what) + (path.empty() ? "" : " " + path) + message) !=
                          std::string::npos,
                      e.what());
      }
    }
    struct stat info {};
    CHECK((::lstat(fifo.c_str(), &info) == 0 && S_ISFIFO(info.st_mode)));
    CHECK(fs::directory_iterator(dir.path) != fs::directory_iterator());
    // A symlink (to a file not there yet, then to the file) stays a link; its target is saved.
    fs::remove(real);
    fs::remove(link);
    fs::create_symlink("real.ckpt", link);
    save(link);
    save(link);
    CHECK(fs::is_symlink(link));
    CHECK(fs::is_regular_file(real));
    CHECK(temporaries_of(real).empty());
    if (std::string(what) == "checkpoint") CHECK(writer_of(link, 4) == 1);
  }
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir.path)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"pipe", "real.ckpt", "run.ckpt"});  // no temporary left
}
