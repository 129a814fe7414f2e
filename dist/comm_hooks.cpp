#include "dist/comm_hooks.h"

#include "kernels/kernels.h"

namespace nanoddp::dist {

Future::Future(std::shared_ptr<Work> work, Tensor value) : work_(std::move(work)), value_(std::move(value)) {
  NANODDP_CHECK(work_ != nullptr, ValueError, "Future: no work given (use Future::completed for a final value)");
}

std::shared_ptr<Future> Future::completed(Tensor value) {
  std::shared_ptr<Future> future(new Future());
  future->value_ = std::move(value);
  future->done_ = true;
  return future;
}

std::shared_ptr<Future> Future::then(std::function<Tensor(const Tensor&)> fn) {
  NANODDP_CHECK(fn != nullptr, ValueError, "Future::then: no continuation given");
  std::shared_ptr<Future> next(new Future());
  next->parent_ = shared_from_this();
  next->then_ = std::move(fn);
  return next;
}

Tensor Future::wait(std::chrono::milliseconds timeout) {
  if (done_) return value_;
  if (parent_) {
    value_ = then_(parent_->wait(timeout));
  } else {
    work_->wait(timeout);
  }
  done_ = true;
  return value_;
}

bool Future::is_completed() {
  if (done_) return true;
  return parent_ ? parent_->is_completed() : work_->is_completed();
}

namespace {

ProcessGroup& group_of(const std::shared_ptr<ProcessGroup>& process_group, const char* hook) {
  NANODDP_CHECK(process_group != nullptr, ValueError, hook,
                ": no process group (register it through DistributedDataParallel::register_comm_hook, which "
                "passes its own group for nullptr)");
  return *process_group;
}

// default_hooks' fp16/bf16_compress_hook: round, divide and reduce in 16 bits, then write
// the mean back into the bucket as float32.
std::shared_ptr<Future> compress_hook(ProcessGroup& pg, GradBucket& bucket, DType format) {
  Tensor buffer = bucket.buffer();
  const Device device = buffer.device();
  Tensor compressed = Tensor::empty(buffer.shape(), format, device);
  auto* bits = static_cast<uint16_t*>(compressed.impl()->storage->data());
  NANODDP_DISPATCH(device, float_to_16bit, bits, buffer.data<float>(), format, static_cast<float>(pg.size()),
                   buffer.numel());
  auto reduced = std::make_shared<Future>(pg.all_reduce(compressed, ReduceOp::Sum), compressed);
  return reduced->then([buffer, format](const Tensor& sum) mutable {
    NANODDP_DISPATCH(buffer.device(), float_from_16bit, buffer.data<float>(),
                     static_cast<const uint16_t*>(sum.impl()->storage->data()), format, buffer.numel());
    return buffer;
  });
}

}  // namespace

std::shared_ptr<Future> allreduce_hook(std::shared_ptr<ProcessGroup>& process_group, GradBucket& bucket) {
  ProcessGroup& pg = group_of(process_group, "allreduce_hook");
  Tensor buffer = bucket.buffer();
  // Divide first, then sum: the same operations, in the same order, as DDP without a hook
  // (Note [Averaging in the copy] in reducer.cpp), so the results are equal bit for bit.
  NANODDP_DISPATCH(buffer.device(), scalar_forward, buffer.data<float>(), buffer.data<float>(),
                   kernels::ScalarOp::Div, static_cast<float>(pg.size()), buffer.numel());
  return std::make_shared<Future>(pg.all_reduce(buffer, ReduceOp::Sum), buffer);
}

std::shared_ptr<Future> fp16_compress_hook(std::shared_ptr<ProcessGroup>& process_group, GradBucket& bucket) {
  return compress_hook(group_of(process_group, "fp16_compress_hook"), bucket, DType::Float16);
}

std::shared_ptr<Future> bf16_compress_hook(std::shared_ptr<ProcessGroup>& process_group, GradBucket& bucket) {
  return compress_hook(group_of(process_group, "bf16_compress_hook"), bucket, DType::BFloat16);
}

}  // namespace nanoddp::dist
