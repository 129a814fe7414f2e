// GlooStore: our Store seen through Gloo's rendezvous interface, for the Gloo process group
// (dist/process_group_gloo.cpp, its only user). Needs Gloo's headers: include it only where
// NANODDP_WITH_GLOO is set.
#pragma once

#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/address.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dist/store.h"

namespace nanoddp::dist {

// Our Store seen through Gloo's rendezvous interface; keys get a per-group prefix so groups
// built one after the other in one job never read each other's addresses.
//
// It also notes, for naming lost peers (GlooPeer), the address each peer gave this rank in the
// full-mesh rendezvous: Gloo's connectFullMesh stores under the key "<k>" rank k's pair
// addresses for every other rank, in rank order (Address::bytes() each), and a pair prints the
// address it was given as its peer's in its errors. A value in another layout is ignored.
class GlooStore : public gloo::rendezvous::Store {
 public:
  // timeout: how long a wait for the peers' keys may last, whatever Gloo asks for (it passes
  // its context's timeout, which connecting the mesh sets to a fifth of the group's).
  GlooStore(std::shared_ptr<dist::Store> store, std::string prefix, int rank, int world_size,
            std::chrono::milliseconds timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), rank_(rank), world_size_(world_size), timeout_(timeout) {}

  // Rank -> the address of its pair with this rank, as this rank's pair prints it.
  const std::map<int, std::string>& peer_addresses() const { return peer_addresses_; }

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(prefix_ + key, std::vector<uint8_t>(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto bytes = store_->get(prefix_ + key);
    std::vector<char> value(bytes.begin(), bytes.end());
    note_peer_address(key, value);
    return value;
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& /*gloo's*/) override {
    std::vector<std::string> prefixed;
    for (const auto& key : keys) prefixed.push_back(prefix_ + key);
    store_->wait(prefixed, timeout_);  // a rank that starts late has the group's whole timeout to arrive
  }

 private:
  void note_peer_address(const std::string& key, const std::vector<char>& value) {
    char* end = nullptr;
    const long peer = std::strtol(key.c_str(), &end, 10);
    if (key.empty() || *end != '\0' || peer < 0 || peer >= world_size_ || peer == rank_ || world_size_ < 2 ||
        value.size() % static_cast<size_t>(world_size_ - 1) != 0)
      return;
    const size_t chunk = value.size() / static_cast<size_t>(world_size_ - 1);
    const size_t index = static_cast<size_t>(rank_ < peer ? rank_ : rank_ - 1);
    try {
      const std::vector<char> mine(value.begin() + static_cast<std::ptrdiff_t>(index * chunk),
                                   value.begin() + static_cast<std::ptrdiff_t>((index + 1) * chunk));
      peer_addresses_[static_cast<int>(peer)] = gloo::transport::tcp::Address(mine).str();
    } catch (const std::exception&) {  // not an address: only the message loses the name
    }
  }

  std::shared_ptr<dist::Store> store_;
  std::string prefix_;
  int rank_, world_size_;
  std::chrono::milliseconds timeout_;
  std::map<int, std::string> peer_addresses_;
};

}  // namespace nanoddp::dist
