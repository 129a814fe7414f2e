// Tensor: a dense, row-major, contiguous n-d array (n <= 4) with autograd.
//
//   Generator gen(0);
//   Tensor w = Tensor::randn({3, 2}, gen).set_requires_grad(true);
//   Tensor loss = sum(relu(matmul(x, w)));  loss.backward();  w.grad();   // [3, 2]
//
// A Tensor is a value handle: copies share the same TensorImpl (data, grad, graph), as a
// Python reference to a torch.Tensor does. There are no strides; the only views are reshape,
// which shares storage, and slice_view, a contiguous range of another tensor's memory (a DDP
// gradient inside its bucket). float32 is the default dtype; int64 holds class labels;
// uint8 holds raw bytes (images). Float16 and BFloat16 hold what autocast's matrix products
// make (Note [Autocast] in core/autocast.h). Only float tensors take part in autograd, and only
// float32 ones can be leaves that require grad.
//
// Errors: ShapeError for shapes that do not fit, ValueError for bad arguments, DeviceError
// for a CUDA tensor where host data is needed (copy with .to(Device::cpu()) first) or for
// CUDA in a build without it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/shape.h"
#include "core/storage.h"

namespace nanoddp {

class Generator;
struct Node;
struct TensorImpl;

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() == false, as an empty .grad is
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- factories (torch.empty, zeros, ones, full, arange, rand, randn, tensor) ----------
  static Tensor empty(const Shape& shape, DType dtype = DType::Float32, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype = DType::Float32, Device device = Device::cpu());
  static Tensor ones(const Shape& shape, DType dtype = DType::Float32, Device device = Device::cpu());
  static Tensor full(const Shape& shape, float value, Device device = Device::cpu());
  // [n] float32 holding 0, 1, ..., n-1 (torch.arange(n)).
  static Tensor arange(int64_t n, Device device = Device::cpu());
  // Uniform in [0, 1) / standard normal, drawn from gen (torch.rand / torch.randn with a
  // generator). The same seed gives the same values on every machine.
  static Tensor rand(const Shape& shape, Generator& gen, Device device = Device::cpu());
  static Tensor randn(const Shape& shape, Generator& gen, Device device = Device::cpu());
  // Copies values into a new tensor (torch.tensor(values).reshape(shape)). An empty shape
  // means [values.size()] (use scalar() for a 0-dim tensor). Throws ShapeError when
  // shape.numel() != values.size().
  static Tensor from_vector(const std::vector<float>& values, const Shape& shape = {}, Device device = Device::cpu());
  static Tensor from_vector(const std::vector<int64_t>& values, const Shape& shape = {}, Device device = Device::cpu());
  // Tensor::from_vector({1, 2, 3, 4}, {2, 2}): a brace list is float32.
  static Tensor from_vector(std::initializer_list<float> values, const Shape& shape = {},
                            Device device = Device::cpu()) {
    return from_vector(std::vector<float>(values), shape, device);
  }

  // A 0-dim float32 tensor holding value (torch.tensor(value)).
  static Tensor scalar(float value, Device device = Device::cpu());

  // ---- metadata --------------------------------------------------------------------------
  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const;
  int dim() const { return shape().dim(); }
  int64_t size(int d) const;  // negative d counts from the end; throws IndexError
  int64_t numel() const { return shape().numel(); }
  size_t nbytes() const;
  DType dtype() const;
  Device device() const;

  // ---- data ------------------------------------------------------------------------------
  // Raw pointer to the first element. Throws ValueError when T does not match dtype(), and
  // as data_ptr() does.
  template <typename T> T* data() const;
  // The first byte of the tensor's memory, any dtype (torch.Tensor.data_ptr()); what clone,
  // to and copy_ read. Throws ValueError when the memory is freed: an FSDP unit's parameters
  // between uses, or a graph edge (Note [Graph edges]), which has none.
  void* data_ptr() const;
  // The single value of a one-element tensor, as torch.Tensor.item(). Copies from the GPU.
  // ValueError unless numel() == 1. An integer beyond 2^24 rounds to float: item_int() is
  // exact for int64, int32 and uint8 tensors (torch's item() gives a Python int for those),
  // and throws ValueError for a floating-point one.
  float item() const;
  int64_t item_int() const;
  // One element by index, for tests: t.at({1, 2}). CPU only; throws IndexError when out of range.
  // float32, float16 and bfloat16 tensors (16-bit values widen exactly); at_int for int64.
  float at(std::initializer_list<int64_t> index) const;
  int64_t at_int(std::initializer_list<int64_t> index) const;
  // All elements, copied to the host in row-major order (torch.Tensor.tolist): float32,
  // float16 or bfloat16, widened exactly; to_int_vector for int64.
  std::vector<float> to_vector() const;
  std::vector<int64_t> to_int_vector() const;

  // ---- shape and device (differentiable) -----------------------------------------------
  // Same data, new shape (torch.reshape); one size may be -1. Throws ShapeError if numel differs.
  Tensor reshape(const Shape& shape) const;
  Tensor reshape(std::initializer_list<int64_t> sizes) const;
  Tensor reshape(const std::vector<int64_t>& sizes) const;
  // A copy on device; returns *this when already there (torch.Tensor.to).
  Tensor to(Device device) const;
  // A copy in dtype, among Float32, Float16 and BFloat16; returns *this when already so
  // (torch.Tensor.to(dtype)). Narrowing rounds to nearest, ties to even (core/half.h);
  // widening is exact. Recorded: backward casts the gradient back to this tensor's dtype,
  // which is how a float32 parameter cast for autocast gets a float32 .grad (Note [Autocast]
  // in core/autocast.h). Throws ValueError for Int64 or UInt8 on either side.
  Tensor to(DType dtype) const;

  // ---- views of a range (not recorded by autograd) ----------------------------------------
  // A tensor of `shape` whose elements are this tensor's elements [offset, offset +
  // shape.numel()) in row-major order, in the same memory: a write through either is seen by
  // the other. Detached (requires_grad false, as detach()): torch's
  // t.detach().flatten().narrow(0, offset, shape.numel()).view(shape). DDP's
  // gradient_as_bucket_view makes each .grad one of these over its bucket (Note [Storage views]
  // in core/storage.h). Throws IndexError when the range leaves this tensor.
  Tensor slice_view(int64_t offset, const Shape& shape) const;
  // Elements from the start of the allocation this tensor lives in to its first element
  // (torch.Tensor.storage_offset): 0 except for slice_view (and reshapes of one).
  int64_t storage_offset() const;
  // Whether both live in the same allocation, so a write to one may change the other
  // (torch.Tensor.is_alias_of). False when either is undefined.
  bool is_alias_of(const Tensor& other) const;

  // ---- copies and in-place updates ----------------------------------------------------------
  // A deep copy. Recorded by autograd as torch.clone: in grad mode, the copy of a tensor that
  // requires grad is an op's output whose gradient flows back unchanged (a model that keeps
  // x.clone() for a residual gets x's whole gradient). detach().clone() is a copy outside the
  // graph, as in torch.
  Tensor clone() const;
  Tensor detach() const;  // same storage, no graph, requires_grad false
  // Copies src's values into this tensor (any devices, same shape and dtype), as copy_().
  // copy_, fill_ and zero_ count as an in-place change (Note [Version counter] in
  // core/storage.h): a backward that saved this tensor, or a view of its memory, before the
  // change throws ValueError instead of using the new values, as torch's does. They are not
  // recorded by autograd, so in grad mode they throw ValueError where torch would record
  // them: on an op's output (it has a grad_fn) and, for copy_, from a source that requires
  // grad. A leaf that requires grad may be set in grad mode (initial weights; torch asks for
  // torch.no_grad() there), since no gradient flows through the change. copy_ between views
  // of one allocation that partly overlap is a ValueError (torch's copy_ refuses it too); the
  // same elements onto themselves change nothing.
  Tensor& copy_(const Tensor& src);
  Tensor& fill_(float value);
  Tensor& zero_() { return fill_(0.0f); }
  // Replaces this tensor's data (storage, shape, device) by other's, keeping identity,
  // grad and hooks: what `param.data = other` does in PyTorch. Used by Module::to. ValueError
  // for integer data on a tensor that requires grad, as torch. A leaf changed between a
  // forward and its backward gets a gradient of the shape it had: ShapeError there. Data of
  // the same shape does not reach what that forward saved: the backward reads the old values,
  // the gradient of the forward that ran (torch 1.13 reads the new ones).
  void set_data(const Tensor& other);

  // ---- autograd ------------------------------------------------------------------------
  bool requires_grad() const;
  // Marks a leaf as requiring grad (torch.Tensor.requires_grad_). Only float32 tensors. On an
  // op's output, true is a no-op and false a ValueError (use detach()), as in torch.
  Tensor& set_requires_grad(bool requires_grad = true);
  bool is_leaf() const;                         // no grad_fn
  const std::shared_ptr<Node>& grad_fn() const;
  Tensor grad() const;                          // undefined until a backward reaches it
  // Sets .grad (an undefined Tensor clears it). ShapeError unless it has this tensor's shape
  // and device; ValueError unless its dtype (torch: "assigned grad has data of a different
  // type"), and for the tensor itself or a view sharing its elements (torch: "can't assign
  // Variable as its own grad"): backward would add into the values.
  void set_grad(const Tensor& grad);
  // Runs backward from this tensor. grad defaults to 1 for a one-element tensor; any other
  // shape needs an explicit grad of the same shape (torch.Tensor.backward), on the same
  // device (DeviceError), of a float dtype (ValueError otherwise), cast to this tensor's dtype
  // as torch casts it (a float32 grad for a bfloat16 output is fine). The graph's saved tensors
  // are freed afterwards unless retain_graph: a second backward through a node that saved one
  // throws ValueError before any gradient moves (one through sums, adds and reshapes runs
  // again, as torch's). ShapeError, before any gradient moves, for a leaf whose .grad has
  // another shape, dtype or device than the leaf (set_data changed it).
  void backward(const Tensor& grad = Tensor(), bool retain_graph = false) const;
  // fn(param) runs after this leaf's .grad has been accumulated in a backward pass
  // (torch.Tensor.register_post_accumulate_grad_hook), with grad mode off, as torch's engine
  // runs it: what it computes is not recorded. Returns an id for remove_hook.
  using PostAccumulateGradHook = std::function<void(Tensor&)>;
  int register_post_accumulate_grad_hook(PostAccumulateGradHook hook);
  void remove_hook(int id);

  std::string str() const;  // shape, dtype, device and (up to a few) values
  TensorImpl* impl() const { return impl_.get(); }
  long use_count() const { return impl_.use_count(); }  // handles sharing this TensorImpl
  bool is_same(const Tensor& other) const { return impl_ == other.impl_; }

 private:
  TensorImpl& checked_impl() const;
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& out, const Tensor& tensor);

// What a Tensor handle shares. Fields are public for the autograd engine and ops; user code
// goes through Tensor.
struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  DType dtype = DType::Float32;
  bool requires_grad = false;
  // Registered as some module's parameter (torch's nn.Parameter class): registering it again
  // (tying) keeps its requires_grad. A detach() or copy is a new impl, not a parameter.
  bool is_parameter = false;
  std::shared_ptr<TensorImpl> grad;   // accumulated gradient of a leaf
  std::shared_ptr<Node> grad_fn;      // the op that produced this tensor (null for leaves)
  // Shared: backward runs them from a copy of this list (a hook may change it), and a hook's
  // own state (a mutable lambda's) must live on in the one that stays registered.
  std::vector<std::pair<int, std::shared_ptr<Tensor::PostAccumulateGradHook>>> post_accumulate_grad_hooks;
  int next_hook_id = 0;
};

template <typename T>
T* Tensor::data() const {
  const TensorImpl& self = checked_impl();
  NANODDP_CHECK(self.dtype == dtype_of<T>(), ValueError, "data<", dtype_name(dtype_of<T>()),
                ">() on a ", dtype_name(self.dtype), " tensor");
  return static_cast<T*>(data_ptr());
}

}  // namespace nanoddp
