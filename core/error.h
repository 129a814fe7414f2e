// nanoddp errors: one exception hierarchy and the check macros that throw it.
//
//   NANODDP_CHECK(a.shape() == b.shape(), ShapeError,
//                 "mse_loss: input ", a.shape(), " and target ", b.shape(), " differ");
//   NANODDP_ASSERT(bucket.pending == 0);   // an invariant: "cannot happen"
//
// User errors (bad shapes, bad files, bad ranks) use NANODDP_CHECK with a message that names
// the problem; broken invariants use NANODDP_ASSERT. Both throw (never exit) and both append
// file:line. Library code never calls exit(); destructors never throw.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace nanoddp {

// Base of every exception nanoddp throws. what() is the full message, ending in "(file:line)".
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
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
  throw E(concat(parts..., " (", file, ":", line, ")"));
}

}  // namespace detail
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
