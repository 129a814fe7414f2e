#include "dist/ddp.h"

#include <algorithm>
#include <sstream>

#include "core/autograd.h"
#include "core/hash.h"
#include "dist/host_collectives.h"

namespace nanoddp::dist {

namespace {

// A parameter's identity across ranks: FNV-1a of its name, whether it requires grad, its dims
// and sizes. Names cannot cross the wire as text through our collectives, so ranks compare
// hashes and each rank reports its own name.
constexpr int kSignatureDims = 2;  // sig[2] is the number of dims, sizes follow
constexpr int kSignatureWidth = 3 + Shape::kMaxDims;

void write_signature(int64_t* out, const std::string& name, const Tensor& p) {
  const Shape& shape = p.shape();
  out[0] = static_cast<int64_t>(fnv1a(name) >> 1);  // >> 1: non-negative as int64
  out[1] = p.requires_grad() ? 1 : 0;
  out[kSignatureDims] = shape.dim();
  for (int d = 0; d < Shape::kMaxDims; ++d) out[kSignatureDims + 1 + d] = d < shape.dim() ? shape[d] : 0;
}

std::string signature_shape(const int64_t* sig) {
  std::ostringstream out;
  out << "[";
  for (int64_t d = 0; d < sig[kSignatureDims]; ++d) out << (d ? ", " : "") << sig[kSignatureDims + 1 + d];
  out << "]";
  return out.str();
}

// Note [Frozen parameters]
// A parameter with requires_grad false (a frozen layer in fine-tuning) gets no gradient, so
// it is left out of the buckets, as PyTorch's DDP builds its reducer from the parameters that
// require grad only. It still takes part in construction: its shape is checked and rank 0's
// value broadcast like any other, and whether it requires grad must agree across ranks (else
// the ranks would plan different buckets, and their all-reduces would not match).
std::vector<std::pair<std::string, Tensor>> trainable(std::vector<std::pair<std::string, Tensor>> named) {
  named.erase(std::remove_if(named.begin(), named.end(), [](const auto& np) { return !np.second.requires_grad(); }),
              named.end());
  return named;
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> pg,
                                                 DDPOptions options)
    : module_(register_module("module", std::move(module))), pg_(std::move(pg)), timeout_(options.timeout) {
  NANODDP_CHECK(module_ != nullptr && pg_ != nullptr, ValueError, "DistributedDataParallel needs a module and a process group");
  verify_parameters_match();
  broadcast_parameters();
  reducer_ = std::make_unique<Reducer>(trainable(module_->named_parameters()), pg_, options);
}

void DistributedDataParallel::verify_parameters_match() {
  const auto named = module_->named_parameters();
  const int world = pg_->size();
  const std::string who = "DDP on rank " + std::to_string(pg_->rank()) + "/" + std::to_string(world);

  // 1a. The same number of parameters everywhere. (all_gather_host builds its tensors on the
  // group's device: NCCL takes only GPU tensors.)
  const auto counts = all_gather_host(*pg_, {static_cast<int64_t>(named.size())}, timeout_);
  for (int r = 0; r < world; ++r)
    NANODDP_CHECK(counts[r][0] == static_cast<int64_t>(named.size()), DistError, who, ": this rank has ",
                  named.size(), " parameters but rank ", r, " has ", counts[r][0],
                  "; every rank must build the same model");
  if (named.empty()) return;

  // 1b. The same names and shapes, in the same order.
  const int64_t P = static_cast<int64_t>(named.size());
  std::vector<int64_t> mine(static_cast<size_t>(P * kSignatureWidth));
  for (int64_t i = 0; i < P; ++i) write_signature(mine.data() + i * kSignatureWidth, named[i].first, named[i].second);
  const auto all = all_gather_host(*pg_, mine, timeout_);
  for (int64_t i = 0; i < P; ++i) {
    const int64_t* own = mine.data() + i * kSignatureWidth;
    for (int r = 0; r < world; ++r) {
      const int64_t* theirs = all[r].data() + i * kSignatureWidth;
      const bool same_name = own[0] == theirs[0];
      const bool same_shape = std::equal(own + kSignatureDims, own + kSignatureWidth, theirs + kSignatureDims);
      NANODDP_CHECK(same_name && same_shape, DistError, who, ": parameter #", i, " '", named[i].first, "' ",
                    named[i].second.shape(), " differs from rank ", r, "'s parameter #", i,
                    same_name ? "" : " (another name)", " of shape ", signature_shape(theirs),
                    "; every rank must build the same model");
      NANODDP_CHECK(own[1] == theirs[1], DistError, who, ": parameter #", i, " '", named[i].first, "' ",
                    own[1] ? "requires grad" : "is frozen (requires_grad false)", " here but ",
                    theirs[1] ? "requires grad" : "is frozen", " on rank ", r,
                    "; freeze the same parameters on every rank before wrapping the model in DDP");
    }
  }
}

void DistributedDataParallel::broadcast_parameters() {
  NoGradGuard no_grad;
  std::vector<std::shared_ptr<Work>> works;
  for (Tensor& p : module_->parameters()) {
    Tensor data = p.detach();  // same storage: the broadcast writes the parameter itself
    works.push_back(pg_->broadcast(data, 0));
  }
  for (auto& work : works) work->wait(timeout_);
}

}  // namespace nanoddp::dist
