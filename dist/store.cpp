// TCPStore: a poll() server on rank 0 (store_server.h) and a blocking client on every rank
// (store_client.h), speaking Note [Store wire format] (store_wire.cpp).
#include "dist/store.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/deadline.h"
#include "dist/detail.h"
#include "dist/store_client.h"
#include "dist/store_server.h"
#include "dist/store_wire.h"

namespace nanoddp::dist {

using namespace store_detail;

// ---- TCPStore ----------------------------------------------------------------------------

TCPStore::TCPStore(const TCPStoreOptions& options) : options_(options) {
  NANODDP_CHECK(options.port >= 0 && options.port <= 65535, ValueError,
                detail::where(options.rank, options.world_size), ": store port ", options.port,
                " is not in 0..65535");
  NANODDP_CHECK(options.is_server || options.port != 0, ValueError,
                detail::where(options.rank, options.world_size),
                ": a store client needs the server's port, not 0");
  NANODDP_CHECK(options.round >= 0, ValueError, detail::where(options.rank, options.world_size),
                ": store round ", options.round, " is negative");
  NANODDP_CHECK(options.generation >= 0, ValueError, detail::where(options.rank, options.world_size),
                ": store generation ", options.generation, " is negative");
  std::string context = detail::where(options.rank, options.world_size);
  options_.timeout = detail::cap_timeout(options.timeout);  // Note [Long timeouts]
  port_ = options.port;
  if (options.is_server) {
    server_ = std::make_unique<Server>(options_, context);
    port_ = server_->port();
  }
  client_ = std::make_unique<Client>(options_, port_, context);
}

TCPStore::~TCPStore() {
  client_.reset();  // close our connection before the server stops
  server_.reset();
}

int64_t TCPStore::rejected_connections() const { return server_ ? server_->rejected() : 0; }

bool TCPStore::server_stopped() const { return client_ != nullptr && client_->server_stopped(); }

namespace {
void check_key(const std::string& context, const std::string& key) {
  NANODDP_CHECK(key.size() <= kMaxKeyBytes, ValueError, context, ": key of ", key.size(),
                " bytes exceeds the limit of ", kMaxKeyBytes);
}
}  // namespace

void TCPStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  check_key(client_->context(), key);
  NANODDP_CHECK(value.size() <= kMaxValueBytes, ValueError, client_->context(), ": set('", key,
                "'): value of ", value.size(), " bytes exceeds the limit of ", kMaxValueBytes);
  std::vector<uint8_t> msg;
  put_u8(msg, kSet);
  put_str(msg, key);
  put_bytes(msg, value.data(), value.size());
  uint8_t status = client_->request(msg, kReplyGrace + options_.timeout, "set", [](uint8_t, auto) {});
  NANODDP_CHECK(status == kOk, DistError, client_->context(), ": set('", key,
                "'): unexpected status ", int(status));
}

uint8_t TCPStore::get_now(const std::string& key, std::chrono::milliseconds reply_timeout, std::vector<uint8_t>* value,
                         bool report_loss) {
  std::vector<uint8_t> msg;
  put_u8(msg, kGet);
  put_str(msg, key);
  return client_->request(
      msg, reply_timeout, "get",
      [&](uint8_t st, Clock::time_point deadline) {
        if (st == kOk) *value = client_->recv_bytes(deadline, "get");
      },
      report_loss);
}

std::string TCPStore::refusal_note() {
  std::vector<uint8_t> value;
  try {
    if (get_now(kRefusedKey, std::chrono::milliseconds(1000), &value, /*report_loss=*/false) != kOk) return "";
  } catch (const Error&) {
    return "";
  }
  return std::string(value.begin(), value.end());
}

std::vector<uint8_t> TCPStore::get(const std::string& key) {
  wait({key}, options_.timeout);
  std::vector<uint8_t> value;
  const uint8_t status = get_now(key, kReplyGrace + options_.timeout, &value, /*report_loss=*/true);
  NANODDP_CHECK(status == kOk, DistError, client_->context(), ": get('", key,
                "'): unexpected status ", int(status));
  return value;
}

int64_t TCPStore::add(const std::string& key, int64_t delta) {
  check_key(client_->context(), key);
  std::vector<uint8_t> msg;
  put_u8(msg, kAdd);
  put_str(msg, key);
  put_u64(msg, static_cast<uint64_t>(delta));
  int64_t value = 0;
  uint8_t status = client_->request(msg, kReplyGrace + options_.timeout, "add",
                                    [&](uint8_t st, Clock::time_point deadline) {
                                      if (st == kOk)
                                        value = static_cast<int64_t>(client_->recv_u64(deadline, "add"));
                                    });
  NANODDP_CHECK(status != kNotCounter, DistError, client_->context(), ": add('", key,
                "'): the key holds a value that is not an int64 counter");
  NANODDP_CHECK(status != kOverflow, DistError, client_->context(), ": add('", key, "', ", delta,
                "): the counter would overflow int64");
  NANODDP_CHECK(status == kOk, DistError, client_->context(), ": add('", key,
                "'): unexpected status ", int(status));
  return value;
}

void TCPStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  NANODDP_CHECK(keys.size() <= kMaxKeysPerRequest, ValueError, client_->context(), ": wait on ",
                keys.size(), " keys exceeds the limit of ", kMaxKeysPerRequest);
  timeout = detail::cap_timeout(timeout);
  std::vector<uint8_t> msg;
  put_u8(msg, kWait);
  put_u32(msg, static_cast<uint32_t>(keys.size()));
  for (const auto& key : keys) {
    check_key(client_->context(), key);
    put_str(msg, key);
  }
  put_u64(msg, static_cast<uint64_t>(std::max<int64_t>(0, timeout.count())));
  uint8_t status = client_->request(msg, timeout + kReplyGrace, "wait", [](uint8_t, auto) {});
  std::string names;
  for (const auto& key : keys) names += (names.empty() ? "'" : ", '") + key + "'";
  if (status == kJobBroken) {
    std::string refused = refusal_note();
    if (refused.empty()) refused = "a rank that does not fit this job";  // the note could not be read
    NANODDP_THROW(DistError, client_->context(), ": wait for ", names, " cannot end: the store refused ", refused);
  }
  if (status == kTimeout) {
    // No refusal to report here: the server answers every wait kJobBroken once it has one.
    std::string arrived, bad_token, other_job;
    try {
      if (check({kArrivedKey})) arrived = get_string(kArrivedKey);
      if (check({kBadTokenKey})) bad_token = get_string(kBadTokenKey);
      if (check({kOtherJobKey})) other_job = get_string(kOtherJobKey);
    } catch (const Error&) {  // the message goes out without it
    }
    const std::set<int> claimed = ranks_in(bad_token);
    const std::string token_hint =
        claimed.empty() ? std::string()
                        : "; the store refused clients of this job for a wrong token, claiming " +
                              name_ranks({claimed.begin(), claimed.end()}) +
                              ": every node must export the same NANODDP_STORE_TOKEN";
    const std::string job_hint = other_job.empty()
                                     ? std::string()
                                     : "; the store refused clients of another job: " +
                                           other_job.substr(0, other_job.find_last_not_of("; ") + 1) +
                                           " (every node of one job must export the same NANODDP_JOB_ID)";
    NANODDP_THROW(TimeoutError, client_->context(), ": wait for ", names, " timed out after ",
                  timeout.count(), " ms (", who_is_missing(arrived, options_.world_size), ")", token_hint,
                  job_hint);
  }
  NANODDP_CHECK(status == kOk, DistError, client_->context(), ": wait: unexpected status ",
                int(status));
}

bool TCPStore::check(const std::vector<std::string>& keys) {
  NANODDP_CHECK(keys.size() <= kMaxKeysPerRequest, ValueError, client_->context(), ": check on ",
                keys.size(), " keys exceeds the limit of ", kMaxKeysPerRequest);
  std::vector<uint8_t> msg;
  put_u8(msg, kCheck);
  put_u32(msg, static_cast<uint32_t>(keys.size()));
  for (const auto& key : keys) {
    check_key(client_->context(), key);
    put_str(msg, key);
  }
  uint8_t status = client_->request(msg, kReplyGrace + options_.timeout, "check", [](uint8_t, auto) {});
  NANODDP_CHECK(status == kOk || status == kMissing, DistError, client_->context(),
                ": check: unexpected status ", int(status));
  return status == kOk;
}

}  // namespace nanoddp::dist