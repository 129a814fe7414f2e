// A checkpoint file and the one before it, so that a damaged newest file costs the steps since
// the previous save, never the run.
//
//   examples::save_keeping_previous("run.ckpt", state);           // run.ckpt.prev: the last one
//   auto [state, used] = examples::load_newest_readable("run.ckpt"); // falls back to run.ckpt.prev
//
// Saving keeps the current file as PATH.prev (nn::keep_previous_checkpoint), then writes the new one with nn::save_checkpoint, which replaces
// PATH atomically. PATH itself is never absent or half-written: a save that fails (a full disk,
// ulimit -f) leaves it as it was, and the error (IOError) names the file. Loading takes PATH
// and, when PATH is missing, truncated or corrupt (every byte is checksummed), PATH.prev, with a
// warning on stderr that names the damaged file and why.
#pragma once

#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>

#include <unistd.h>

#include "core/error.h"
#include "nn/checkpoint.h"

namespace nanoddp::examples {

inline std::string previous_checkpoint(const std::string& path) { return path + ".prev"; }

// Keeps the current PATH as PATH.prev, then saves `state` to PATH. Throws IOError naming the
// file the failed step wrote.
inline void save_keeping_previous(const std::string& path, const nn::StateDict& state) {
  nn::keep_previous_checkpoint(path);
  nn::save_checkpoint(path, state);
}

// The newest checkpoint that loads, and the file it came from: PATH, else PATH.prev (with a
// warning on stderr naming PATH and what is wrong with it). Throws IOError naming both files
// when neither loads, or PATH's error when there is no PATH.prev.
inline std::pair<nn::StateDict, std::string> load_newest_readable(const std::string& path) {
  const std::string previous = previous_checkpoint(path);
  try {
    return {nn::load_checkpoint(path), path};
  } catch (const IOError& e) {
    if (::access(previous.c_str(), F_OK) != 0) throw;
    std::fprintf(stderr, "warning: checkpoint %s cannot be loaded (%s); using the previous one, %s\n",
                 path.c_str(), message_of(e).c_str(), previous.c_str());
    std::fflush(stderr);
    try {
      return {nn::load_checkpoint(previous), previous};
    } catch (const IOError& e2) {
      NANODDP_THROW(IOError, "neither checkpoint loads: ", message_of(e), "; ", message_of(e2));
    }
  }
}

// True when PATH or PATH.prev exists: there is something to resume from. False only when
// nothing is there: a checkpoint that exists but cannot be read must stop a resume with its
// error, not start over and overwrite it.
inline bool checkpoint_exists(const std::string& path) {
  std::error_code error;
  const bool exists = std::filesystem::exists(path, error) || std::filesystem::exists(previous_checkpoint(path), error);
  NANODDP_CHECK(!error, IOError, "cannot look for ", path, ": ", error.message());
  return exists;
}

}  // namespace nanoddp::examples
