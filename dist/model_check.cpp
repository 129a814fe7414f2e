// detail::verify_same_model: every rank holds the same model, checked before a wrapper's
// first collective (DDP's and FSDP's constructors).
#include <algorithm>
#include <sstream>

#include "core/hash.h"
#include "dist/detail.h"
#include "dist/host_collectives.h"
#include "nn/module.h"

namespace nanoddp::dist::detail {

namespace {

// A parameter's or buffer's identity across ranks: FNV-1a of its name, a property that must
// agree (a parameter: whether it requires grad; a buffer: its dtype), its dims and sizes.
// Names cannot cross the wire as text through our collectives, so ranks compare hashes and
// each rank reports its own name.
constexpr int kSignatureDims = 2;  // sig[2] is the number of dims, sizes follow
constexpr int kSignatureWidth = 3 + Shape::kMaxDims;

void write_signature(int64_t* out, const std::string& name, const Tensor& t, int64_t property) {
  const Shape& shape = t.shape();
  out[0] = static_cast<int64_t>(fnv1a(name) >> 1);  // >> 1: non-negative as int64
  out[1] = property;
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

}  // namespace

void verify_same_model(ProcessGroup& pg, const nn::Module& module, const std::string& wrapper,
                       std::chrono::milliseconds timeout) {
  const std::string who = wrapper_on_rank(wrapper, pg);
  const auto params = module.named_parameters();
  const auto buffers = module.named_buffers();
  const int world = pg.size();
  const int64_t P = static_cast<int64_t>(params.size()), B = static_cast<int64_t>(buffers.size());

  // 1a. The same number of parameters and of buffers everywhere. (all_gather_host builds its
  // tensors on the group's device: NCCL takes only GPU tensors.)
  const auto counts = all_gather_host(pg, {P, B}, timeout);
  for (int r = 0; r < world; ++r) {
    NANODDP_CHECK(counts[r][0] == P, DistError, who, ": this rank has ", P, " parameters but rank ", r, " has ",
                  counts[r][0], "; every rank must build the same model");
    NANODDP_CHECK(counts[r][1] == B, DistError, who, ": this rank has ", B, " buffers but rank ", r, " has ",
                  counts[r][1], "; every rank must build the same model (and register the same buffers)");
  }
  if (P + B == 0) return;

  // 1b. The same names and shapes, in the same order; parameters' requires_grad and buffers'
  // dtypes agree. Buffers are checked as parameters are (PyTorch checks parameters only, in
  // _verify_param_shape_across_processes): broadcast_buffers packs them by dtype into one flat
  // tensor, so a buffer of another shape would receive another buffer's values, and another
  // dtype would leave the ranks in different broadcasts.
  std::vector<int64_t> mine(static_cast<size_t>((P + B) * kSignatureWidth));
  for (int64_t i = 0; i < P; ++i)
    write_signature(mine.data() + i * kSignatureWidth, params[i].first, params[i].second,
                    params[i].second.requires_grad() ? 1 : 0);
  for (int64_t i = 0; i < B; ++i)
    write_signature(mine.data() + (P + i) * kSignatureWidth, buffers[i].first, buffers[i].second,
                    static_cast<int64_t>(buffers[i].second.dtype()));
  const auto all = all_gather_host(pg, mine, timeout);
  for (int64_t k = 0; k < P + B; ++k) {
    const bool is_buffer = k >= P;
    const int64_t i = is_buffer ? k - P : k;
    const auto& [name, tensor] = is_buffer ? buffers[i] : params[i];
    const char* kind = is_buffer ? "buffer" : "parameter";
    const int64_t* own = mine.data() + k * kSignatureWidth;
    for (int r = 0; r < world; ++r) {
      const int64_t* theirs = all[r].data() + k * kSignatureWidth;
      const bool same_name = own[0] == theirs[0];
      const bool same_shape = std::equal(own + kSignatureDims, own + kSignatureWidth, theirs + kSignatureDims);
      NANODDP_CHECK(same_name && same_shape, DistError, who, ": ", kind, " #", i, " '", name, "' ", tensor.shape(),
                    " differs from rank ", r, "'s ", kind, " #", i, same_name ? "" : " (another name)", " of shape ",
                    signature_shape(theirs), "; every rank must build the same model");
      if (is_buffer) {
        NANODDP_CHECK(own[1] == theirs[1], DistError, who, ": buffer #", i, " '", name, "' is ", tensor.dtype(),
                      " here but ", static_cast<DType>(theirs[1]), " on rank ", r,
                      "; every rank must build the same model");
      } else {
        NANODDP_CHECK(own[1] == theirs[1], DistError, who, ": parameter #", i, " '", name, "' ",
                      own[1] ? "requires grad" : "is frozen (requires_grad false)", " here but ",
                      theirs[1] ? "requires grad" : "is frozen", " on rank ", r,
                      "; freeze the same parameters on every rank before wrapping the model in ", wrapper);
      }
    }
  }
}

}  // namespace nanoddp::dist::detail
