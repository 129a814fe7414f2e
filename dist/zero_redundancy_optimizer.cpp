#include "dist/zero_redundancy_optimizer.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <numeric>
#include <sstream>
#include <string>

#include "core/autograd.h"
#include "dist/host_collectives.h"
#include "nn/checkpoint.h"

namespace nanoddp::dist {

namespace {
// "exp_avg.5" -> ("exp_avg", 5); false when the key has no numeric suffix.
bool split_key(const std::string& key, std::string& buffer, size_t& index) {
  const size_t dot = key.rfind('.');
  if (dot == std::string::npos || dot + 1 == key.size() || key.size() - dot > 19) return false;
  const std::string digits = key.substr(dot + 1);
  if (digits.find_first_not_of("0123456789") != std::string::npos) return false;
  buffer = key.substr(0, dot);
  index = std::stoul(digits);
  return true;
}
}  // namespace

std::vector<int> partition_parameters(const std::vector<int64_t>& numels, int world_size) {
  // Largest first; each to the rank with the fewest elements so far (torch's _partition_parameters).
  std::vector<size_t> order(numels.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  std::vector<int64_t> assigned(static_cast<size_t>(world_size), 0);
  std::vector<int> owner(numels.size(), 0);
  for (size_t i : order) {
    const auto least = std::min_element(assigned.begin(), assigned.end());
    owner[i] = static_cast<int>(least - assigned.begin());
    *least += numels[i];
  }
  return owner;
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<Tensor> params, std::shared_ptr<ProcessGroup> pg,
                                                 const LocalOptimizerFactory& make_local_optimizer)
    : Optimizer("ZeroRedundancyOptimizer", std::move(params)), pg_(std::move(pg)) {
  NANODDP_CHECK(pg_ != nullptr, ValueError, name_, ": no process group");
  NANODDP_CHECK(static_cast<bool>(make_local_optimizer), ValueError, name_, ": no local optimizer factory");
  std::vector<int64_t> numels;
  for (const Tensor& p : params_) numels.push_back(p.numel());
  owner_ = partition_parameters(numels, pg_->size());
  std::vector<Tensor> local_params;
  for (size_t i = 0; i < params_.size(); ++i)
    if (owner_[i] == pg_->rank()) {
      local_indices_.push_back(i);
      local_params.push_back(params_[i]);
    }
  {
    AllowNoParameters none_owned;  // a rank may own no parameter (fewer parameters than ranks)
    local_ = make_local_optimizer(std::move(local_params));
  }
  NANODDP_CHECK(local_ != nullptr, ValueError, name_, ": the factory returned no optimizer");
  name_ = "ZeroRedundancyOptimizer(" + local_->name() + ")";
}

void ZeroRedundancyOptimizer::step() {
  Join::notify_join_context(*this);
  step_and_broadcast();
}

// What a joined rank does in place of the others' step() (torch's _ZeROJoinHook): the same
// step, with the gradients DDP's join hook left (Note [Join] in join.cpp, step 5').
class ZeroJoinHook : public JoinHook {
 public:
  explicit ZeroJoinHook(ZeroRedundancyOptimizer& zero) : zero_(zero) {}
  void main_hook() override { zero_.step_and_broadcast(); }

 private:
  ZeroRedundancyOptimizer& zero_;
};

std::unique_ptr<JoinHook> ZeroRedundancyOptimizer::join_hook(const JoinOptions&) {
  return std::make_unique<ZeroJoinHook>(*this);
}

void ZeroRedundancyOptimizer::step_and_broadcast() {
  consolidated_.reset();  // the state moves on: a gathered copy would be stale
  local_->step();
  NoGradGuard no_grad;
  trace::Span span(trace::Lane::Optimizer, "zero.broadcast");
  std::vector<std::shared_ptr<Work>> works;
  works.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) works.push_back(pg_->broadcast(params_[i], owner_[i]));
  for (auto& work : works) work->wait();
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  NANODDP_CHECK(to >= 0 && to < pg_->size(), ValueError, name_, ".consolidate_state_dict: rank ", to,
                " is not in the group of ", pg_->size());
  consolidated_.reset();
  // This rank's shard as checkpoint bytes, packed into int64 words, every rank's padded to the
  // longest: all_gather needs one size.
  const std::string bytes = nn::checkpoint_bytes(shard_state());
  const int64_t length = static_cast<int64_t>(bytes.size());
  // One int64 gathered here and in load_state_dict: the purpose tells the two calls apart.
  const CollectivePurpose purpose(CollectivePurpose::Kind::ZeroConsolidate, 0);
  const std::vector<std::vector<int64_t>> lengths = all_gather_host(*pg_, {length});
  int64_t longest = 0;
  for (const auto& l : lengths) longest = std::max(longest, l[0]);
  std::vector<int64_t> words(static_cast<size_t>((longest + 7) / 8), 0);
  std::memcpy(words.data(), bytes.data(), bytes.size());
  const std::vector<std::vector<int64_t>> shards = all_gather_host(*pg_, words);
  if (pg_->rank() != to) return;
  nn::StateDict whole;
  for (int r = 0; r < pg_->size(); ++r) {
    const std::string shard(reinterpret_cast<const char*>(shards[r].data()), static_cast<size_t>(lengths[r][0]));
    for (auto& [key, t] : nn::parse_checkpoint(shard, "rank " + std::to_string(r) + "'s optimizer shard"))
      whole[key] = t.to(params_.empty() ? Device::cpu() : params_[0].device());
  }
  consolidated_ = std::move(whole);
}

nn::StateDict ZeroRedundancyOptimizer::state_dict() const {
  NANODDP_CHECK(consolidated_.has_value(), ValueError, name_, ".state_dict() on rank ", pg_->rank(),
                ": the state has not been consolidated on this rank (each rank holds only its shard); call "
                "consolidate_state_dict(to) on every rank first, then state_dict() on rank `to` (after each "
                "step), or local_state_dict() for this rank's shard");
  return *consolidated_;
}

nn::StateDict ZeroRedundancyOptimizer::local_state_dict() const {
  nn::StateDict state = shard_state();
  std::vector<int64_t> owned(local_indices_.begin(), local_indices_.end());
  state[kOwnedParametersKey] = Tensor::from_vector(owned, Shape{static_cast<int64_t>(owned.size())});
  return state;
}

nn::StateDict ZeroRedundancyOptimizer::shard_state() const {
  nn::StateDict global;
  for (const auto& [key, t] : local_->state_dict()) {
    std::string buffer;
    size_t local = 0;
    NANODDP_CHECK(split_key(key, buffer, local) && local < local_indices_.size(), ValueError, name_,
                  ": the local optimizer's state key '", key, "' names no parameter");
    global[buffer + "." + std::to_string(local_indices_[local])] = t;
  }
  return global;
}

void ZeroRedundancyOptimizer::load_state_dict(const nn::StateDict& state) {
  consolidated_.reset();
  // Note [ZeRO load agreement] A rank checks what it can of every entry (the key, the index,
  // a float32 entry's shape, which is its parameter's) but only the owner can check its
  // parameters' entries in full (Adam's step goes with its moments), and per-rank shards differ
  // by rank. One rank throwing while the others go on would leave them waiting for it in the
  // next step's broadcasts; so the ranks agree (one all_gather of a flag) and all load, or all
  // throw and keep the state they had.
  std::exception_ptr error;
  const nn::StateDict before = local_->state_dict();
  try {
    std::vector<size_t> local_of(params_.size(), SIZE_MAX);
    for (size_t j = 0; j < local_indices_.size(); ++j) local_of[local_indices_[j]] = j;
    check_covers_this_rank(state);
    nn::StateDict local;
    for (const auto& [key, t] : state) {
      if (key == kOwnedParametersKey) continue;
      std::string buffer;
      size_t index = 0;
      NANODDP_CHECK(split_key(key, buffer, index), ValueError, name_, ".load_state_dict: bad key '", key, "'");
      NANODDP_CHECK(index < params_.size(), ValueError, name_, ".load_state_dict: '", key, "' but only ",
                    params_.size(), " parameters");
      NANODDP_CHECK(!t.defined() || t.dtype() != DType::Float32 || t.shape() == params_[index].shape(),
                    ShapeError, name_, ".load_state_dict: '", key, "' is ", t.shape(), " but parameter ",
                    index, " is ", params_[index].shape());
      if (local_of[index] != SIZE_MAX) local[buffer + "." + std::to_string(local_of[index])] = t;
    }
    try {
      local_->load_state_dict(local);
    } catch (const Error& e) {
      // The local optimizer numbers its parameters apart: say which of params() they are.
      std::string numbers;
      for (size_t j = 0; j < local_indices_.size(); ++j)
        numbers += (j == 0 ? "" : ", ") + std::to_string(j) + " -> " + std::to_string(local_indices_[j]);
      const std::string context = name_ + ".load_state_dict on rank " + std::to_string(pg_->rank()) +
                                  " (its local parameters are " + numbers + "): ";
      if (dynamic_cast<const ShapeError*>(&e) != nullptr) NANODDP_THROW(ShapeError, context, message_of(e));
      if (dynamic_cast<const ValueError*>(&e) != nullptr) NANODDP_THROW(ValueError, context, message_of(e));
      throw;  // another kind (a failed copy to the device): as it is, after the agreement
    }
  } catch (const Error&) {
    error = std::current_exception();
  }
  const CollectivePurpose purpose(CollectivePurpose::Kind::ZeroLoad, 0);
  std::string failed_ranks;
  try {
    failed_ranks = ranks_that_failed(*pg_, error != nullptr);
  } catch (...) {  // no agreement (a peer in another collective, a timeout): nobody keeps the new state
    if (!error) local_->load_state_dict(before);
    throw;
  }
  if (failed_ranks.empty()) return;
  if (error) std::rethrow_exception(error);
  local_->load_state_dict(before);  // this rank loaded its share: put the old state back
  NANODDP_THROW(ValueError, name_, ".load_state_dict on rank ", pg_->rank(), ": rank(s) ", failed_ranks,
                " could not load their share of the state (their errors say why); no rank loaded it");
}

void ZeroRedundancyOptimizer::check_covers_this_rank(const nn::StateDict& state) const {
  const auto it = state.find(kOwnedParametersKey);
  if (it == state.end()) return;  // a whole state: it covers every rank
  NANODDP_CHECK(it->second.dtype() == DType::Int64 && it->second.dim() == 1, ValueError, name_,
                ".load_state_dict: '", kOwnedParametersKey, "' is not a list of parameter indices");
  const std::vector<int64_t> covered = it->second.to_int_vector();
  std::vector<int64_t> missing;
  for (size_t index : local_indices_)
    if (std::find(covered.begin(), covered.end(), static_cast<int64_t>(index)) == covered.end())
      missing.push_back(static_cast<int64_t>(index));
  const auto list = [](const auto& indices) {
    std::ostringstream text;
    text << "[";
    for (size_t i = 0; i < indices.size(); ++i) text << (i ? ", " : "") << indices[i];
    text << "]";
    return text.str();
  };
  NANODDP_CHECK(missing.empty(), ValueError, name_, ".load_state_dict on rank ", pg_->rank(),
                ": the state is a local_state_dict of parameters ", list(covered), ", and this rank owns ",
                list(local_indices_), " (", list(missing),
                " would start without their state): another rank's shard, or one saved at another world size. "
                "Each rank loads its own local_state_dict at the same world size, or every rank the consolidated "
                "state_dict()");
}

int64_t ZeroRedundancyOptimizer::state_nbytes() const {
  int64_t total = 0;
  for (const auto& [key, t] : local_->state_dict())
    if (t.dtype() == DType::Float32) total += static_cast<int64_t>(t.nbytes());
  return total;
}

ShardedStateDict ZeroRedundancyOptimizer::sharded_state_dict() const {
  ShardedStateDict out;
  for (const auto& [key, t] : shard_state()) out[key] = whole_entry(t);
  return out;
}

ShardedStateDict ZeroRedundancyOptimizer::sharded_model_state_dict(const nn::Module& model) const {
  const auto named = model.named_parameters();
  NANODDP_CHECK(named.size() == params_.size(), ValueError, name_,
                ".sharded_model_state_dict: the model has ", named.size(), " parameters, this optimizer ",
                params_.size());
  std::map<const TensorImpl*, size_t> index_of;
  for (size_t i = 0; i < named.size(); ++i) {
    NANODDP_CHECK(named[i].second.impl() == params_[i].impl(), ValueError, name_,
                  ".sharded_model_state_dict: the model's parameter ", i, " ('", named[i].first,
                  "') is not this optimizer's parameter ", i);
    index_of[named[i].second.impl()] = i;
  }
  // Every name of each parameter (a tied one has several, as state_dict does), by tensor.
  std::map<std::string, size_t> index_by_name;
  for (const auto& [name, p] : model.named_parameters(/*remove_duplicate=*/false))
    index_by_name[name] = index_of.at(p.impl());
  ShardedStateDict out;
  for (const auto& [name, t] : model.state_dict()) {
    const auto it = index_by_name.find(name);
    const int holder = it == index_by_name.end() ? 0 : owner_[it->second];
    if (holder == pg_->rank()) {
      out[name] = whole_entry(t);
    } else {
      ShardedEntry nothing;  // described, so the set knows its shape on every rank
      nothing.shape = t.shape();
      nothing.dtype = t.dtype();
      out[name] = nothing;
    }
  }
  return out;
}

nn::StateDict ZeroRedundancyOptimizer::read_local_state_dict(ShardedCheckpointReader& reader,
                                                             const std::string& prefix) const {
  nn::StateDict out;
  for (const std::string& name : reader.names()) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string key = name.substr(prefix.size());
    std::string buffer;
    size_t index = 0;
    NANODDP_CHECK(split_key(key, buffer, index) && index < params_.size(), ValueError, "sharded checkpoint ",
                  reader.path(), ": '", name, "' names no parameter of ", name_, "'s ", params_.size());
    if (owner_[index] == pg_->rank()) out[key] = reader.read(name);
  }
  return out;
}

}  // namespace nanoddp::dist
