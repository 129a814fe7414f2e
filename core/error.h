// nanoddp errors: one exception hierarchy and the check macros that throw it.
//
//   NANODDP_CHECK(a.shape() == b.shape(), ShapeError,
//                 "mse_loss: input ", a.shape(), " and target ", b.shape(), " differ");
//   NANODDP_ASSERT(bucket.pending == 0);   // an invariant: "cannot happen"
//
// User errors (bad shapes, bad files, bad ranks) use NANODDP_CHECK with a message that names
// the problem; broken invariants use NANODDP_ASSERT. Both throw (never exit) and both append
// file:line. Library code never calls exit(); destructors never throw.
//
// A program shows its user message_of(e): the message without the source location, as a
// PyTorch user sees a RuntimeError's text. An error that wraps another puts message_of(inner)
// into its own, so that one message carries one location, the outer throw's.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace nanoddp {

// Base of every exception nanoddp throws. what() is the full message, ending in " (file:line)"
// for an error a check macro throws (it passes `where` as "file:line").
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, const std::string& where = "")
      : std::runtime_error(where.empty() ? message : message + " (" + where + ")"),
        message_size_(message.size()) {}

  // what() without " (file:line)".
  std::string message() const { return std::string(what(), message_size_); }

 private:
  size_t message_size_;  // a length, not a copy: copying an exception must not allocate
};

class ShapeError : public Error { using Error::Error; };     // shapes that do not fit an op
class ValueError : public Error { using Error::Error; };     // a bad argument value
class IndexError : public Error { using Error::Error; };     // an index or class out of range
class DeviceError : public Error { using Error::Error; };    // wrong device; CUDA/cuBLAS failures
class IOError : public Error { using Error::Error; };        // files: missing, truncated, corrupt
class DistError : public Error { using Error::Error; };      // collectives, store, launcher
class TimeoutError : public DistError { using DistError::DistError; };  // a wait ran out
class InternalError : public Error { using Error::Error; };  // a broken invariant (a bug)

namespace detail {

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

template <typename E, typename... Parts>
[[noreturn]] void raise(const char* file, int line, const Parts&... parts) {
  throw E(concat(parts...), concat(file, ":", line));
}

}  // namespace detail

// The text to show a user or to put inside another error: an nanoddp Error's message without
// its source location, any other exception's what(). An InternalError keeps its location: it
// is a bug, and the location is the first thing its report needs.
inline std::string message_of(const std::exception& e) {
  const auto* error = dynamic_cast<const Error*>(&e);
  if (error == nullptr || dynamic_cast<const InternalError*>(&e) != nullptr) return e.what();
  return error->message();
}
}  // namespace nanoddp

// Throws nanoddp::<type>(message parts..., " (file:line)") when cond is false.
#define NANODDP_CHECK(cond, type, ...)                                            \
  do {                                                                            \
    if (!(cond)) ::nanoddp::detail::raise<::nanoddp::type>(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

// Throws nanoddp::<type> unconditionally.
#define NANODDP_THROW(type, ...) ::nanoddp::detail::raise<::nanoddp::type>(__FILE__, __LINE__, __VA_ARGS__)

// An internal invariant; failing it is a bug in nanoddp, reported as InternalError.
#define NANODDP_ASSERT(cond)                                                        \
  do {                                                                              \
    if (!(cond))                                                                    \
      ::nanoddp::detail::raise<::nanoddp::InternalError>(__FILE__, __LINE__,        \
                                                         "internal assertion failed: ", #cond); \
  } while (0)
