#include "dist/detail.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "core/error.h"
#include "dist/host_collectives.h"
#include "dist/process_group.h"

namespace nanoddp::dist::detail {

void divide_by_world_size(float* data, int64_t n, int world_size) {
  const float w = static_cast<float>(world_size);
  for (int64_t i = 0; i < n; ++i) data[i] /= w;
}

uint8_t* back_to_back(const std::vector<Tensor>& parts, const Tensor& other) {
  if (parts.empty() || other.is_alias_of(parts[0])) return nullptr;
  uint8_t* first = bytes_of(parts[0]);
  for (size_t r = 0; r < parts.size(); ++r)
    if (!parts[r].is_alias_of(parts[0]) || bytes_of(parts[r]) != first + r * parts[0].nbytes()) return nullptr;
  return first;
}

std::string host_name() {
  // Read once: every collective's description names the host, and a system call per
  // collective showed up in the collective check's profile.
  static const std::string name = [] {
    char text[256] = {};
    if (::gethostname(text, sizeof(text) - 1) != 0) return std::string("unknown-host");
    return std::string(text);
  }();
  return name;
}

char process_state(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return '\0';
  const size_t paren = text.rfind(')');  // the command name may hold spaces and parentheses
  return paren == std::string::npos || paren + 2 >= text.size() ? '\0' : text[paren + 2];
}

std::vector<int> child_pids(int pid) {
  std::vector<int> pids;
  const std::string tasks_dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* tasks = opendir(tasks_dir.c_str());
  if (tasks == nullptr) return pids;
  while (const dirent* task = readdir(tasks)) {
    if (task->d_name[0] == '.') continue;
    std::ifstream list(tasks_dir + "/" + task->d_name + "/children");
    for (int child; list >> child;) pids.push_back(child);
  }
  closedir(tasks);
  return pids;
}

std::string where(int rank, int world_size) {
  std::string r = rank >= 0 ? std::to_string(rank) : "?";
  std::string w = world_size >= 0 ? std::to_string(world_size) : "?";
  return "rank " + r + "/" + w + " on " + host_name();
}

std::string errno_text(int err) { return std::strerror(err); }

bool env_flag(const char* name, bool fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  std::string value(text);
  std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return std::tolower(c); });
  if (value == "1" || value == "true" || value == "yes" || value == "on") return true;
  if (value == "0" || value == "false" || value == "no" || value == "off") return false;
  NANODDP_THROW(ValueError, "environment variable ", name, "='", text,
                "' is neither 1 (true, yes, on) nor 0 (false, no, off)");
}

std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  NANODDP_CHECK(rc == 0, DistError, "cannot resolve MASTER_ADDR '", host, "': ", gai_strerror(rc));
  std::string address;
  for (addrinfo* a = found; a != nullptr && address.empty(); a = a->ai_next) {
    Fd fd(::socket(a->ai_family, SOCK_DGRAM, 0));
    // A UDP connect only picks the route and the source address; no packet is sent.
    if (!fd.valid() || ::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len) != 0) continue;
    char text[INET6_ADDRSTRLEN] = {};
    const void* src = local.ss_family == AF_INET6
                          ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                          : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
    if (::inet_ntop(local.ss_family, src, text, sizeof(text)) != nullptr) address = text;
  }
  ::freeaddrinfo(found);
  NANODDP_CHECK(!address.empty(), DistError, "no local interface routes to MASTER_ADDR '", host,
                "'");
  return address;
}

std::string wrapper_on_rank(const std::string& wrapper, const ProcessGroup& pg) {
  return wrapper + " on rank " + std::to_string(pg.rank()) + "/" + std::to_string(pg.size());
}

void agree_after_interrupted_backward(ProcessGroup& pg, int64_t issued, const std::string& wrapper,
                                      std::chrono::milliseconds timeout) {
  if (pg.size() == 1) return;
  const std::string who = wrapper_on_rank(wrapper, pg);
  std::vector<int64_t> agreed;
  try {
    agreed = all_reduce_host(pg, std::vector<int64_t>{issued, -issued}, ReduceOp::Max, timeout);
  } catch (const Error& e) {
    NANODDP_THROW(DistError, who,
                  ": the previous backward on this rank ended by an exception, and the other ranks "
                  "did not end theirs the same way, or the group takes no more collectives (",
                  message_of(e),
                  "); the ranks are out of step and cannot train on "
                  "(PyTorch: \"Expected to have finished reduction in the prior iteration\")");
  }
  NANODDP_CHECK(agreed[0] == -agreed[1], DistError, who, ": the previous backward ended by an exception on every "
                "rank, but after ", -agreed[1], " collective(s) on one and ", agreed[0], " on another, so the ranks "
                "are out of step and cannot train on (PyTorch: \"Expected to have finished reduction in the prior "
                "iteration\")");
}

}  // namespace nanoddp::dist::detail
