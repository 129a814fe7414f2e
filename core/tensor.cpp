#include "core/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <sstream>

#include "core/autograd.h"
#include "core/op_helpers.h"
#include "core/random.h"
#include "kernels/kernels.h"

namespace nanoddp {

namespace {

std::shared_ptr<TensorImpl> new_impl(const Shape& shape, DType dtype, Device device) {
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = shape;
  impl->dtype = dtype;
  int64_t nbytes = 0;
  NANODDP_CHECK(!__builtin_mul_overflow(shape.numel(), static_cast<int64_t>(dtype_size(dtype)), &nbytes), ShapeError,
                "a ", dtype, " tensor of shape ", shape, " needs more bytes than int64 can count");
  impl->storage = Storage::allocate(static_cast<size_t>(nbytes), device);
  return impl;
}

// Builds a CPU tensor with fill(ptr, n) and moves it to device.
template <typename T, typename Fill>
Tensor host_built(const Shape& shape, Device device, Fill fill) {
  Tensor host(new_impl(shape, dtype_of<T>(), Device::cpu()));
  fill(host.data<T>(), host.numel());
  return host.to(device);
}

int64_t flat_index(const Shape& shape, std::initializer_list<int64_t> index) {
  NANODDP_CHECK(static_cast<int>(index.size()) == shape.dim(), IndexError, "index with ", index.size(),
                " coordinates into a tensor of shape ", shape);
  int64_t flat = 0;
  int d = 0;
  for (int64_t i : index) {
    NANODDP_CHECK(i >= 0 && i < shape[d], IndexError, "index ", i, " out of range for dimension ", d,
                  " of shape ", shape);
    flat = flat * shape[d] + i;
    ++d;
  }
  return flat;
}

struct ReshapeBackward : Node {
  Shape input_shape;
  std::vector<Tensor> apply(const Tensor& grad_output) override {
    return {grad_output.reshape(input_shape)};
  }
  const char* name() const override { return "ReshapeBackward"; }
};

struct CloneBackward : Node {
  std::vector<Tensor> apply(const Tensor& grad_output) override { return {grad_output}; }
  const char* name() const override { return "CloneBackward"; }
};

struct ToDeviceBackward : Node {
  Device input_device;
  std::vector<Tensor> apply(const Tensor& grad_output) override { return {grad_output.to(input_device)}; }
  const char* name() const override { return "ToDeviceBackward"; }
};

// Writes src's values into out, both on one device, each Float32, Float16 or BFloat16.
void cast_into(const Tensor& out, const Tensor& src) {
  const int64_t n = src.numel();
  const Device device = src.device();
  auto bits = [](const Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); };
  if (src.dtype() == out.dtype()) {
    copy_bytes(out.data_ptr(), device, src.data_ptr(), device, src.nbytes());
  } else if (src.dtype() == DType::Float32) {
    NANODDP_DISPATCH(device, float_to_16bit, bits(out), src.data<float>(), out.dtype(), 1.0f, n);
  } else if (out.dtype() == DType::Float32) {
    NANODDP_DISPATCH(device, float_from_16bit, out.data<float>(), bits(src), src.dtype(), n);
  } else {  // float16 <-> bfloat16 through float32, which holds either exactly
    Tensor wide = Tensor::empty(src.shape(), DType::Float32, device);
    cast_into(wide, src);
    cast_into(out, wide);
  }
}

Tensor cast(const Tensor& src, DType dtype) {
  Tensor out(new_impl(src.shape(), dtype, src.device()));
  cast_into(out, src);
  return out;
}

struct ToDTypeBackward : Node {
  DType input_dtype;
  std::vector<Tensor> apply(const Tensor& grad_output) override { return {cast(grad_output, input_dtype)}; }
  const char* name() const override { return "ToDTypeBackward"; }
};

bool is_float_dtype(DType dtype) { return dtype == DType::Float32 || is_16bit_float(dtype); }

}  // namespace

// ---- factories ----------------------------------------------------------------------------

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  return Tensor(new_impl(shape, dtype, device));
}

// Zero bytes are 0 in every dtype: written where the tensor lives (on CUDA queued, with no
// copy from the host to wait for).
Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  NANODDP_DISPATCH(device, zero_bytes, t.impl()->storage->data(), t.nbytes());
  return t;
}

Tensor Tensor::ones(const Shape& shape, DType dtype, Device device) {
  if (dtype == DType::Float32) return full(shape, 1.0f, device);
  if (dtype == DType::Int64)
    return host_built<int64_t>(shape, device, [](int64_t* p, int64_t n) { std::fill(p, p + n, 1); });
  if (dtype == DType::Float16)
    return host_built<Float16>(shape, device, [](Float16* p, int64_t n) { std::fill(p, p + n, Float16::from_float(1)); });
  if (dtype == DType::BFloat16)
    return host_built<BFloat16>(shape, device,
                                [](BFloat16* p, int64_t n) { std::fill(p, p + n, BFloat16::from_float(1)); });
  if (dtype == DType::Int32)
    return host_built<int32_t>(shape, device, [](int32_t* p, int64_t n) { std::fill(p, p + n, 1); });
  return host_built<uint8_t>(shape, device, [](uint8_t* p, int64_t n) { std::fill(p, p + n, 1); });
}

Tensor Tensor::full(const Shape& shape, float value, Device device) {
  Tensor t = empty(shape, DType::Float32, device);
  t.fill_(value);
  return t;
}

Tensor Tensor::arange(int64_t n, Device device) {
  NANODDP_CHECK(n >= 0, ValueError, "arange(", n, "): n must be >= 0");
  return host_built<float>({n}, device, [](float* p, int64_t count) {
    for (int64_t i = 0; i < count; ++i) p[i] = static_cast<float>(i);
  });
}

Tensor Tensor::rand(const Shape& shape, Generator& gen, Device device) {
  Generator& draw = checkpoint_generator(gen);  // Note [Checkpointed regions]
  return host_built<float>(shape, device, [&draw](float* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) p[i] = draw.uniform();
  });
}

Tensor Tensor::randn(const Shape& shape, Generator& gen, Device device) {
  Generator& draw = checkpoint_generator(gen);  // Note [Checkpointed regions]
  return host_built<float>(shape, device, [&draw](float* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) p[i] = draw.normal();
  });
}

template <typename T>
static Tensor tensor_from_values(const std::vector<T>& values, const Shape& shape, Device device) {
  const Shape actual = shape.dim() == 0 ? Shape{static_cast<int64_t>(values.size())} : shape;
  NANODDP_CHECK(actual.numel() == static_cast<int64_t>(values.size()), ShapeError, "from_vector: ",
                values.size(), " values do not fill shape ", actual);
  return host_built<T>(actual, device, [&values](T* p, int64_t n) { std::copy(values.begin(), values.begin() + n, p); });
}

Tensor Tensor::scalar(float value, Device device) { return full(Shape{}, value, device); }

Tensor Tensor::from_vector(const std::vector<float>& values, const Shape& shape, Device device) {
  return tensor_from_values(values, shape, device);
}

Tensor Tensor::from_vector(const std::vector<int64_t>& values, const Shape& shape, Device device) {
  return tensor_from_values(values, shape, device);
}

// ---- metadata -----------------------------------------------------------------------------

TensorImpl& Tensor::checked_impl() const {
  // Most often a .grad read before any backward reached it, or after zero_grad(), which sets
  // it to none as torch 2's default (torch's p.grad is None there).
  NANODDP_CHECK(impl_ != nullptr, ValueError,
                "use of an undefined tensor (Tensor(): a .grad before a backward reached its parameter, or "
                "after zero_grad() with set_to_none, is undefined, as torch's None; check defined() first)");
  return *impl_;
}

void* Tensor::data_ptr() const {
  const TensorImpl& self = checked_impl();
  NANODDP_CHECK(!self.storage->is_freed(), ValueError, "the data of a ", self.shape, " ", dtype_name(self.dtype),
                " tensor whose memory is freed (Note [Freeing a storage in place]: an FSDP unit's parameters "
                "outside its forward and backward; or Note [Graph edges]: a node's input, which a backward "
                "must read through save_for_backward)");
  return self.storage->data();
}

const Shape& Tensor::shape() const { return checked_impl().shape; }

int64_t Tensor::size(int d) const {
  const int dims = dim();
  const int index = d < 0 ? d + dims : d;
  NANODDP_CHECK(index >= 0 && index < dims, IndexError, "dimension ", d, " out of range for shape ", shape());
  return shape()[index];
}

size_t Tensor::nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype()); }
DType Tensor::dtype() const { return checked_impl().dtype; }
Device Tensor::device() const { return checked_impl().storage->device(); }

// ---- data ---------------------------------------------------------------------------------

float Tensor::item() const {
  NANODDP_CHECK(numel() == 1, ValueError, "item() needs a one-element tensor, got shape ", shape());
  const Tensor host = to(Device::cpu());
  switch (dtype()) {
    case DType::Float32: return *host.data<float>();
    case DType::Int64: return static_cast<float>(*host.data<int64_t>());
    case DType::UInt8: return static_cast<float>(*host.data<uint8_t>());
    case DType::Float16: return host.data<Float16>()->to_float();
    case DType::BFloat16: return host.data<BFloat16>()->to_float();
    case DType::Int32: return static_cast<float>(*host.data<int32_t>());
  }
  return 0.0f;
}

int64_t Tensor::item_int() const {
  NANODDP_CHECK(numel() == 1, ValueError, "item_int() needs a one-element tensor, got shape ", shape());
  const Tensor host = to(Device::cpu());
  switch (dtype()) {
    case DType::Int64:
      return *host.data<int64_t>();
    case DType::Int32:
      return *host.data<int32_t>();
    case DType::UInt8:
      return *host.data<uint8_t>();
    default:
      break;
  }
  NANODDP_THROW(ValueError, "item_int() of a ", dtype(), " tensor: use item()");
}

float Tensor::at(std::initializer_list<int64_t> index) const {
  NANODDP_CHECK(device().is_cpu(), DeviceError, "at() reads host memory; copy the ", device(),
                " tensor to the CPU first");
  const int64_t at = flat_index(shape(), index);
  if (dtype() == DType::Float16) return data<Float16>()[at].to_float();
  if (dtype() == DType::BFloat16) return data<BFloat16>()[at].to_float();
  return data<float>()[at];
}

int64_t Tensor::at_int(std::initializer_list<int64_t> index) const {
  NANODDP_CHECK(device().is_cpu(), DeviceError, "at_int() reads host memory; copy the ", device(),
                " tensor to the CPU first");
  return data<int64_t>()[flat_index(shape(), index)];
}

std::vector<float> Tensor::to_vector() const {
  Tensor host = to(Device::cpu());
  if (is_16bit_float(dtype())) host = cast(host, DType::Float32);  // exact: float32 holds both
  const float* p = host.data<float>();
  return std::vector<float>(p, p + numel());
}

std::vector<int64_t> Tensor::to_int_vector() const {
  const Tensor host = to(Device::cpu());
  const int64_t* p = host.data<int64_t>();
  return std::vector<int64_t>(p, p + numel());
}

// ---- shape and device ---------------------------------------------------------------------

Tensor Tensor::reshape(const Shape& new_shape) const { return reshape(new_shape.sizes()); }

Tensor Tensor::reshape(std::initializer_list<int64_t> sizes) const { return reshape(std::vector<int64_t>(sizes)); }

Tensor Tensor::reshape(const std::vector<int64_t>& requested) const {
  const TensorImpl& self = checked_impl();
  std::vector<int64_t> sizes = requested;
  auto requested_str = [&] {
    std::string text = "[";
    for (size_t d = 0; d < requested.size(); ++d) text += (d ? ", " : "") + std::to_string(requested[d]);
    return text + "]";
  };
  int inferred = -1;
  int64_t known = 1;
  for (int d = 0; d < static_cast<int>(sizes.size()); ++d) {
    if (sizes[d] == -1) {
      NANODDP_CHECK(inferred < 0, ShapeError, "reshape ", self.shape, " to ", requested_str(),
                    ": only one size may be -1");
      inferred = d;
    } else {
      NANODDP_CHECK(sizes[d] >= 0 && !__builtin_mul_overflow(known, sizes[d], &known), ShapeError, "reshape ",
                    self.shape, " to ", requested_str(), ": sizes must be >= 0 (or one -1) and multiply within int64");
    }
  }
  if (inferred >= 0) {
    NANODDP_CHECK(known > 0 && numel() % known == 0, ShapeError, "cannot reshape ", self.shape, " to ",
                  requested_str());
    sizes[inferred] = numel() / known;
  }
  const Shape target(sizes);
  NANODDP_CHECK(target.numel() == numel(), ShapeError, "cannot reshape ", self.shape, " (", numel(),
                " elements) to ", target);
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = self.storage;
  impl->shape = target;
  impl->dtype = self.dtype;
  auto node = std::make_shared<ReshapeBackward>();
  node->inputs = {*this};
  node->input_shape = self.shape;
  return make_result(Tensor(impl), node);
}


Tensor Tensor::to(Device target) const {
  if (device() == target) return *this;
  Tensor moved(new_impl(shape(), dtype(), target));
  copy_bytes(moved.impl()->storage->data(), target, data_ptr(), device(), nbytes());
  auto node = std::make_shared<ToDeviceBackward>();
  node->inputs = {*this};
  node->input_device = device();
  return make_result(moved, node);
}

Tensor Tensor::to(DType target) const {
  if (dtype() == target) return *this;
  NANODDP_CHECK(is_float_dtype(dtype()) && is_float_dtype(target), ValueError, "to: cannot cast a ", dtype(),
                " tensor (shape ", shape(), ") to ", target, ": casts are between float32, float16 and bfloat16");
  auto node = std::make_shared<ToDTypeBackward>();
  node->inputs = {*this};
  node->input_dtype = dtype();
  return make_result(cast(*this, target), node);
}

// ---- copies and in-place updates ----------------------------------------------------------

Tensor Tensor::clone() const {
  Tensor copy(new_impl(shape(), dtype(), device()));
  copy_bytes(copy.impl()->storage->data(), device(), data_ptr(), device(), nbytes());
  auto node = std::make_shared<CloneBackward>();
  node->inputs = {*this};
  return make_result(copy, node);
}

Tensor Tensor::detach() const {
  const TensorImpl& self = checked_impl();
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = self.storage;
  impl->shape = self.shape;
  impl->dtype = self.dtype;
  return Tensor(impl);
}

Tensor Tensor::slice_view(int64_t offset, const Shape& shape) const {
  const TensorImpl& self = checked_impl();
  const int64_t count = shape.numel();
  // The message names the range by its start and size: offset + count may overflow.
  NANODDP_CHECK(offset >= 0 && offset <= numel() && count <= numel() - offset, IndexError, "slice_view of ",
                count, " elements from element ", offset, " as ", shape, " of a tensor of ", numel(),
                " elements ", self.shape);
  const size_t item = dtype_size(self.dtype);
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = Storage::view(self.storage, static_cast<size_t>(offset) * item, static_cast<size_t>(count) * item);
  impl->shape = shape;
  impl->dtype = self.dtype;
  return Tensor(impl);
}

int64_t Tensor::storage_offset() const {
  const TensorImpl& self = checked_impl();
  return static_cast<int64_t>(self.storage->offset_bytes() / dtype_size(self.dtype));
}

bool Tensor::is_alias_of(const Tensor& other) const {
  if (!defined() || !other.defined()) return false;
  auto allocation = [](const Tensor& t) {
    const std::shared_ptr<Storage>& s = t.impl()->storage;
    return s->base() != nullptr ? s->base().get() : s.get();
  };
  return allocation(*this) == allocation(other);
}

namespace {
// Whether a and b share an element: views (slice_view, reshape) of one allocation whose
// element ranges intersect. Views are contiguous, and one allocation holds one dtype.
bool share_elements(const Tensor& a, const Tensor& b) {
  if (!a.is_alias_of(b) || a.numel() == 0 || b.numel() == 0) return false;
  const int64_t a_begin = a.storage_offset(), b_begin = b.storage_offset();
  return a_begin < b_begin + b.numel() && b_begin < a_begin + a.numel();
}
}  // namespace

void copy_values(const Tensor& dst, const Tensor& src) {
  NANODDP_CHECK(dst.shape() == src.shape() && dst.dtype() == src.dtype(), ShapeError, "copy_: destination ",
                dst.shape(), " ", dst.dtype(), " and source ", src.shape(), " ", src.dtype(), " differ");
  if (share_elements(dst, src)) {
    // The same elements copy to themselves; a partial overlap has no one answer (torch's
    // copy_ refuses it too).
    const int64_t to = dst.storage_offset(), from = src.storage_offset(), n = dst.numel();
    if (to == from) return;
    NANODDP_THROW(
        ValueError, "copy_: the destination (elements [", to, ", ", to + n, ")) and the source (elements [",
        from, ", ", from + n,
        ")) of one allocation overlap: some elements of the input and the written-to tensor refer to a "
        "single memory location; copy from src.clone()");
  }
  copy_bytes(dst.data_ptr(), dst.device(), src.data_ptr(), src.device(), dst.nbytes());
}

namespace {
// copy_ and fill_ are not recorded by autograd. Where torch would record them (grad mode on,
// and the destination made by an op or the source requiring grad), going on would give wrong
// gradients silently: refused instead. A leaf that requires grad may be changed (torch asks
// for no_grad there): no graph starts at it, and a backward that saved it sees the change
// through the version counter.
void check_in_place_outside_graph(const char* op, const Tensor& dst, const Tensor* src) {
  if (!is_grad_enabled()) return;
  NANODDP_CHECK(dst.is_leaf(), ValueError, op, " on a ", dst.shape(), " tensor that autograd made (",
                dst.grad_fn()->name(),
                "): in-place changes are not recorded by autograd, so its gradient "
                "would be wrong; compute a new tensor instead, or change it under NoGradGuard");
  NANODDP_CHECK(src == nullptr || !src->requires_grad(), ValueError, op, ": the source ", src->shape(),
                " requires grad, and copy_ is not recorded by autograd, so no gradient would reach it; copy "
                "src.detach(), or compute a new tensor instead");
}
}  // namespace

Tensor& Tensor::copy_(const Tensor& src) {
  check_in_place_outside_graph("copy_", *this, &src);
  copy_values(*this, src);
  checked_impl().storage->bump_version();
  return *this;
}

Tensor& Tensor::fill_(float value) {
  NANODDP_CHECK(dtype() == DType::Float32, ValueError, "fill_ needs a float32 tensor, got ", dtype());
  check_in_place_outside_graph("fill_", *this, nullptr);
  NANODDP_DISPATCH(device(), fill, data<float>(), value, numel());
  checked_impl().storage->bump_version();
  return *this;
}

void Tensor::set_data(const Tensor& other) {
  TensorImpl& self = checked_impl();
  NANODDP_CHECK(other.defined(), ValueError, "set_data with an undefined tensor");
  // torch: "data set to a tensor that requires gradients must be floating point or complex dtype".
  NANODDP_CHECK(!self.requires_grad || other.dtype() == DType::Float32 || is_16bit_float(other.dtype()),
                ValueError, "set_data: a tensor that requires grad cannot take ", other.dtype(),
                " data; its data must be floating point");
  self.storage = other.impl()->storage;
  self.shape = other.shape();
  self.dtype = other.dtype();
  if (self.grad) {
    // Keep the gradient next to its parameter (PyTorch moves .grad with module.to()).
    Tensor grad(self.grad);
    self.grad = grad.to(other.device()).impl_;
  }
}

// ---- autograd -----------------------------------------------------------------------------

bool Tensor::requires_grad() const { return checked_impl().requires_grad; }

Tensor& Tensor::set_requires_grad(bool requires_grad) {
  TensorImpl& self = checked_impl();
  // An op's output already requires grad: asking again is a no-op, as torch's requires_grad_().
  if (self.grad_fn != nullptr && requires_grad) return *this;
  NANODDP_CHECK(!requires_grad || self.dtype == DType::Float32, ValueError,
                "only float32 tensors can require grad, got ", self.dtype);
  NANODDP_CHECK(self.grad_fn == nullptr, ValueError,
                "set_requires_grad(false) on a non-leaf tensor (made by ", self.grad_fn->name(),
                "); use detach()");
  self.requires_grad = requires_grad;
  return *this;
}

bool Tensor::is_leaf() const { return checked_impl().grad_fn == nullptr; }
const std::shared_ptr<Node>& Tensor::grad_fn() const { return checked_impl().grad_fn; }
Tensor Tensor::grad() const { return Tensor(checked_impl().grad); }

void Tensor::set_grad(const Tensor& grad) {
  TensorImpl& self = checked_impl();
  if (grad.defined()) {
    // Its own gradient (or a view sharing its memory), the next backward would add into the
    // tensor's values (torch: "can't assign Variable as its own grad").
    NANODDP_CHECK(grad.impl_.get() != &self && !share_elements(grad, *this), ValueError,
                  "set_grad: a tensor ", self.shape,
                  " cannot be its own gradient, nor one that shares elements with it (a view of its "
                  "memory); give it a copy (clone())");
    NANODDP_CHECK(grad.shape() == self.shape && grad.device() == device(), ShapeError, "set_grad: gradient ",
                  grad.shape(), " on ", grad.device(), " for a tensor ", self.shape, " on ", device());
    // torch: "assigned grad has data of a different type"; the next backward's add would fail
    // half-way through the pass.
    NANODDP_CHECK(grad.dtype() == self.dtype, ValueError, "set_grad: a ", grad.dtype(), " gradient for a ",
                  self.dtype, " tensor ", self.shape);
  }
  self.grad = grad.impl_;
}

void Tensor::backward(const Tensor& grad, bool retain_graph) const { run_backward(*this, grad, retain_graph); }

int Tensor::register_post_accumulate_grad_hook(PostAccumulateGradHook hook) {
  TensorImpl& self = checked_impl();
  NANODDP_CHECK(self.grad_fn == nullptr && self.requires_grad, ValueError,
                "post-accumulate-grad hooks need a leaf that requires grad");
  const int id = self.next_hook_id++;
  self.post_accumulate_grad_hooks.emplace_back(id, std::make_shared<PostAccumulateGradHook>(std::move(hook)));
  return id;
}

void Tensor::remove_hook(int id) {
  auto& hooks = checked_impl().post_accumulate_grad_hooks;
  hooks.erase(std::remove_if(hooks.begin(), hooks.end(), [id](const auto& h) { return h.first == id; }),
              hooks.end());
}

// ---- printing -----------------------------------------------------------------------------

namespace {

// A float as torch prints it: 6 significant digits, and "nan" whatever the NaN's sign bit
// (0/0 on x86 gives a NaN with it set, which iostreams print as "-nan").
void write_float(std::ostream& out, float value) {
  if (std::isnan(value))
    out << "nan";
  else
    out << std::setprecision(6) << value;
}

}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  constexpr int64_t kMaxShown = 8;
  std::ostringstream out;
  out << "Tensor(shape=" << shape() << ", dtype=" << dtype() << ", device=" << device();
  if (requires_grad()) out << ", requires_grad";
  out << ", values=[";
  const Tensor host = to(Device::cpu());
  const int64_t shown = std::min(numel(), kMaxShown);
  for (int64_t i = 0; i < shown; ++i) {
    if (i > 0) out << ", ";
    switch (dtype()) {
      case DType::Float32: write_float(out, host.data<float>()[i]); break;
      case DType::Int64: out << host.data<int64_t>()[i]; break;
      case DType::UInt8: out << static_cast<int>(host.data<uint8_t>()[i]); break;
      case DType::Float16: write_float(out, host.data<Float16>()[i].to_float()); break;
      case DType::BFloat16: write_float(out, host.data<BFloat16>()[i].to_float()); break;
      case DType::Int32: out << host.data<int32_t>()[i]; break;
    }
  }
  if (numel() > shown) out << ", ... (" << numel() << " in all)";
  out << "])";
  return out.str();
}

std::ostream& operator<<(std::ostream& out, const Tensor& tensor) { return out << tensor.str(); }

}  // namespace nanoddp
