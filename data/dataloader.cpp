#include "data/dataloader.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/trace.h"
#include "kernels/device_memory.h"
#include "kernels/kernels.h"

namespace nanoddp::data {

namespace {
// len(DataLoader): ceil(n / batch_size), or floor with drop_last. Formed without
// n + batch_size - 1, which wraps for a batch_size near 2^63.
int64_t batches_in(int64_t n, int64_t batch_size, bool drop_last) {
  return n / batch_size + (!drop_last && n % batch_size != 0 ? 1 : 0);
}
}  // namespace

// ---- Pass: one pass over the sampler's indices ------------------------------------------
//
// Without prefetch, next() collates on the calling thread. With prefetch, a worker thread
// collates batches in order into a queue of at most `depth`; next() pops them. A batch whose
// collation threw is queued as its exception, which next() rethrows in that batch's turn; the
// batches after it follow, as without prefetch and as torch's DataLoader (a loop that skips
// a bad batch still sees every other one). The worker stops at the end or when the pass is
// destroyed.
class DataLoader::Pass {
 public:
  Pass(std::shared_ptr<const Dataset> dataset, std::vector<int64_t> indices, int64_t batch_size,
       bool drop_last, bool prefetch, int depth)
      : dataset_(std::move(dataset)),
        indices_(std::move(indices)),
        batch_size_(batch_size),
        depth_(static_cast<size_t>(depth)) {
    const auto n = static_cast<int64_t>(indices_.size());
    num_batches_ = batches_in(n, batch_size_, drop_last);
    if (prefetch && num_batches_ > 0) worker_ = std::thread([this] { produce(); });
  }

  ~Pass() {
    if (!worker_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    space_.notify_all();
    worker_.join();
  }

  Pass(const Pass&) = delete;
  Pass& operator=(const Pass&) = delete;

  bool next(Batch& out) {
    if (!worker_.joinable()) {
      if (consumed_ >= num_batches_) return false;
      out = collate(consumed_++);
      return true;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    // The worker posts every batch (or its error), then `finished_`, so this wait ends.
    ready_.wait(lock, [this] { return !queue_.empty() || finished_; });
    if (queue_.empty()) return false;
    Collated item = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    space_.notify_one();
    if (item.error) std::rethrow_exception(item.error);
    out = std::move(item.batch);
    return true;
  }

 private:
  Batch collate(int64_t b) const {
    const auto begin = indices_.begin() + b * batch_size_;
    const auto end = indices_.begin() + b * batch_size_ +
                     std::min<int64_t>(batch_size_, static_cast<int64_t>(indices_.size()) - b * batch_size_);
    return dataset_->get_batch(std::vector<int64_t>(begin, end));
  }

  // A batch, or the exception its collation threw.
  struct Collated {
    Batch batch;
    std::exception_ptr error;
  };

  void produce() {
    for (int64_t b = 0; b < num_batches_; ++b) {
      Collated item;
      try {
        item.batch = collate(b);
      } catch (...) {
        item.error = std::current_exception();
      }
      std::unique_lock<std::mutex> lock(mutex_);
      space_.wait(lock, [this] { return stop_ || queue_.size() < depth_; });
      if (stop_) return;
      queue_.push_back(std::move(item));
      ready_.notify_one();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    finished_ = true;
    ready_.notify_one();
  }

  std::shared_ptr<const Dataset> dataset_;
  std::vector<int64_t> indices_;
  int64_t batch_size_;
  size_t depth_;
  int64_t num_batches_ = 0;
  int64_t consumed_ = 0;  // without prefetch: batches handed out

  std::thread worker_;
  std::mutex mutex_;
  std::condition_variable ready_;  // worker -> consumer: a batch (or its error), or the end
  std::condition_variable space_;  // consumer -> worker: room in the queue, or stop
  std::deque<Collated> queue_;
  bool finished_ = false;
  bool stop_ = false;
};

// ---- PinnedStaging: page-locked buffers for asynchronous host-to-device copies -----------
//
// A copy_async reads its pinned source some time later, so a buffer may be reused only once
// the stream has passed the copy: each buffer's copy records an event (Note [Compute-stream
// events]), and a buffer is taken again once its event has passed. When none has, the host
// waits for the oldest copy only, not for the whole stream: with kSlots buffers (two per
// batch: input and target) the loader runs at most kSlots / 2 batches ahead of the device.
class DataLoader::PinnedStaging {
 public:
  static constexpr size_t kSlots = 8;

  explicit PinnedStaging(int device) : device_(device), slots_(kSlots) {}
  ~PinnedStaging() {
    try {
      kernels::cuda::set_device(device_);
      for (Slot& slot : slots_)
        if (slot.in_flight) kernels::cuda::wait_for_event(slot.copied);  // no copy may still read a buffer we free
    } catch (...) {
      // Destructors never throw; a failing CUDA runtime at exit leaks the buffers.
      return;
    }
    for (Slot& slot : slots_) {
      if (slot.data != nullptr) kernels::cuda::free_pinned(slot.data);
      kernels::cuda::destroy_event(slot.copied);
    }
  }
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;

  // Copies host (nbytes at src) to dst on the device, asynchronously on the compute stream.
  void copy_to_device(void* dst, const void* src, size_t nbytes) {
    kernels::cuda::set_device(device_);  // that GPU's compute stream, whichever GPU is current
    Slot& slot = acquire(nbytes);
    if (slot.copied == nullptr) slot.copied = kernels::cuda::create_event();  // before the copy: may throw
    std::memcpy(slot.data, src, nbytes);
    kernels::cuda::copy_async(dst, slot.data, nbytes, kernels::cuda::CopyKind::HostToDevice);
    slot.in_flight = true;
    try {
      kernels::cuda::record_event(slot.copied);
    } catch (...) {
      // Nothing tells when the copy has read the buffer: it is given up, never reused or freed.
      slot.data = nullptr;
      slot.capacity = 0;
      slot.in_flight = false;
      throw;
    }
    slot.order = next_order_++;
  }

 private:
  struct Slot {
    void* data = nullptr;
    size_t capacity = 0;
    void* copied = nullptr;  // recorded after the buffer's last copy
    bool in_flight = false;  // until copied has been seen to pass
    uint64_t order = 0;      // when the buffer's last copy was queued
  };

  Slot& acquire(size_t nbytes) {
    for (Slot& slot : slots_)
      if (slot.in_flight && kernels::cuda::event_passed(slot.copied)) slot.in_flight = false;
    auto it = std::find_if(slots_.begin(), slots_.end(), [](const Slot& s) { return !s.in_flight; });
    if (it == slots_.end()) {
      it = std::min_element(slots_.begin(), slots_.end(), [](const Slot& a, const Slot& b) { return a.order < b.order; });
      kernels::cuda::wait_for_event(it->copied);
      it->in_flight = false;
    }
    if (it->capacity < nbytes) {
      if (it->data != nullptr) kernels::cuda::free_pinned(it->data);
      it->data = nullptr;
      it->capacity = 0;
      it->data = kernels::cuda::allocate_pinned(nbytes);
      it->capacity = nbytes;
    }
    return *it;
  }

  int device_;
  std::vector<Slot> slots_;
  uint64_t next_order_ = 0;
};

// ---- DataLoader --------------------------------------------------------------------------

namespace {

int64_t dataset_size(const std::shared_ptr<const Dataset>& dataset) {
  NANODDP_CHECK(dataset != nullptr, ValueError, "DataLoader: dataset is null");
  return dataset->size();
}

}  // namespace

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, int64_t batch_size, DataLoaderOptions options)
    : DataLoader(dataset, batch_size,
                 DistributedSampler(dataset_size(dataset), 1, 0, options.shuffle, options.seed, false),
                 [&options] {
                   DataLoaderOptions o = options;
                   o.shuffle = false;  // now the sampler's job
                   return o;
                 }()) {
  advance_epoch_per_pass_ = options.shuffle;
  options_.shuffle = options.shuffle;
}

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, int64_t batch_size,
                       DistributedSampler&& sampler, DataLoaderOptions options)
    : DataLoader(std::move(dataset), batch_size, std::make_shared<DistributedSampler>(std::move(sampler)),
                 options) {}

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, int64_t batch_size,
                       std::shared_ptr<DistributedSampler> sampler, DataLoaderOptions options)
    : dataset_(std::move(dataset)),
      batch_size_(batch_size),
      sampler_(std::move(sampler)),
      options_(options),
      advance_epoch_per_pass_(false) {
  NANODDP_CHECK(sampler_ != nullptr, ValueError, "DataLoader: sampler is null");
  const int64_t N = dataset_size(dataset_);
  NANODDP_CHECK(batch_size >= 1, ValueError, "DataLoader: batch_size must be >= 1, got ", batch_size);
  NANODDP_CHECK(options.prefetch_depth >= 1, ValueError, "DataLoader: prefetch_depth must be >= 1, got ",
                options.prefetch_depth);
  NANODDP_CHECK(!options.shuffle, ValueError,
                "DataLoader: shuffle cannot be combined with a sampler (the sampler decides the order; "
                "use DistributedSampler's shuffle)");
  NANODDP_CHECK(sampler_->size() == N, ValueError, "DataLoader: the sampler covers ", sampler_->size(),
                " examples but the dataset has ", N);
  if (options.device.is_cuda()) {
    NANODDP_CHECK(kernels::cuda_built(), DeviceError, "DataLoader: device ", options.device,
                  " requested, but nanoddp was built without CUDA (meson -Dcuda=enabled)");
    const int count = kernels::cuda::device_count();
    NANODDP_CHECK(options.device.index < count, DeviceError, "DataLoader: device ", options.device,
                  " requested, but ", count, " GPU(s) are usable",
                  count == 0 ? " (" + kernels::cuda::unavailable_reason() + ")" : std::string());
    staging_ = std::make_unique<PinnedStaging>(options.device.index);
  }
}

DataLoader::~DataLoader() {
  pass_.reset();  // joins the worker before anything it reads goes away
}

int64_t DataLoader::size() const {
  const int64_t n = sampler_->num_samples();
  return batches_in(n, batch_size_, options_.drop_last);
}

DataLoader::Iterator DataLoader::begin() {
  pass_.reset();
  std::vector<int64_t> indices = sampler_->indices();
  if (advance_epoch_per_pass_) sampler_->set_epoch(sampler_->epoch() + 1);
  pass_ = std::make_unique<Pass>(dataset_, std::move(indices), batch_size_, options_.drop_last,
                                 options_.prefetch, options_.prefetch_depth);
  ++pass_id_;
  return Iterator(this);
}

bool DataLoader::next(Batch& out) {
  NANODDP_ASSERT(pass_ != nullptr);
  trace::Span span(trace::Lane::Data, "next batch");  // waiting for it, collating it, copying it
  Batch host;
  if (!pass_->next(host)) {
    pass_.reset();
    return false;
  }
  if (options_.device.is_cpu()) {
    out = std::move(host);
  } else {
    out.input = to_device(host.input);
    out.target = to_device(host.target);
  }
  return true;
}

Tensor DataLoader::to_device(const Tensor& host) {
  Tensor out = Tensor::empty(host.shape(), host.dtype(), options_.device);
  if (host.nbytes() > 0)
    staging_->copy_to_device(out.impl()->storage->data(), host.impl()->storage->data(), host.nbytes());
  return out;
}

DataLoader::Iterator::Iterator(DataLoader* loader) : loader_(loader), pass_id_(loader->pass_id_) { fetch(); }

void DataLoader::Iterator::fetch() {
  error_ = nullptr;
  try {
    if (!loader_->next(batch_)) {
      loader_ = nullptr;
      batch_ = Batch();
    }
  } catch (...) {
    error_ = std::current_exception();
    batch_ = Batch();
  }
}

const Batch& DataLoader::Iterator::batch() const {
  if (error_) std::rethrow_exception(error_);
  return batch_;
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  NANODDP_CHECK(loader_ != nullptr, ValueError, "DataLoader: ++ on an iterator past the end");
  NANODDP_CHECK(pass_id_ == loader_->pass_id_ && loader_->pass_ != nullptr, ValueError,
                "DataLoader: this iterator's pass has ended (begin() was called again)");
  fetch();
  return *this;
}

}  // namespace nanoddp::data
