// Whether this test program is built with AddressSanitizer (tools/sanitize): a case that
// cannot run there (its allocator aborts where malloc returns null, or it is too slow for the
// unit suite's limit) skips itself with a message, and the default build runs it.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kUnderAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kUnderAddressSanitizer = true;
#else
constexpr bool kUnderAddressSanitizer = false;
#endif
#else
constexpr bool kUnderAddressSanitizer = false;
#endif
