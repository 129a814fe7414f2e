// Deadlines and poll(2) timeouts from timeouts of any length (Note [Long timeouts]).
//
//   timeout_ = detail::cap_timeout(options.timeout);              // what the group keeps
//   const auto deadline = detail::deadline_after(timeout);     // never in the past by overflow
//   ::poll(&pfd, 1, detail::poll_milliseconds(deadline - Clock::now()));
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace nanoddp::dist::detail {

// Note [Long timeouts]
// A timeout may be as long as its type holds (milliseconds::max() for "never"). Added to
// steady_clock's nanoseconds it would overflow into a deadline in the past, added to a grace
// it would overflow its own type, and as poll(2)'s int milliseconds it would wrap. So the
// store and every process group take at most kLongestTimeout (a longer one counts as that),
// every deadline comes from deadline_after and every poll timeout from poll_milliseconds.
// About 35 years: "never" for any job, with room for a grace or a library's nanosecond clock
// (Gloo adds the timeout, and while connecting five times it, to steady_clock's now).
constexpr std::chrono::milliseconds kLongestTimeout{int64_t(1) << 40};
inline std::chrono::milliseconds cap_timeout(std::chrono::milliseconds timeout) {
  return std::min(timeout, kLongestTimeout);
}

inline std::chrono::steady_clock::time_point deadline_after(
    std::chrono::milliseconds timeout,
    std::chrono::steady_clock::time_point from = std::chrono::steady_clock::now()) {
  using TimePoint = std::chrono::steady_clock::time_point;
  if (timeout.count() <= 0) return from;
  const auto room = std::chrono::duration_cast<std::chrono::milliseconds>(TimePoint::max() - from);
  return timeout >= room ? TimePoint::max() : from + timeout;
}
// What is left of a wait's timeout since begin, for the wait it hands on to: at least 1 ms,
// since 0 would mean the group's whole timeout (effective_wait_timeout).
inline std::chrono::milliseconds timeout_left(std::chrono::milliseconds timeout,
                                              std::chrono::steady_clock::time_point begin) {
  const auto spent =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - begin);
  return std::max(timeout - spent, std::chrono::milliseconds(1));
}

// poll(2)'s timeout for `left` until a deadline: rounded up to whole milliseconds, 0 when
// passed, at most 2^30 ms (12 days; the caller polls again).
inline int poll_milliseconds(std::chrono::steady_clock::duration left) {
  if (left.count() <= 0) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<int64_t>(ms, int64_t(1) << 30));
}

}  // namespace nanoddp::dist::detail
