// DataLoader: a Dataset cut into batches, in the order of a sampler, on the device you train on.
//
//   DataLoader loader(dataset, /*batch_size=*/64, DistributedSampler(dataset->size(), world, rank));
//   loader.set_epoch(epoch);
//   for (const Batch& batch : loader) train_step(batch.input, batch.target);   // [64, ...]
//
// torch.utils.data.DataLoader with a batch_sampler built from (sampler, batch_size,
// drop_last) and default_collate: each batch takes the next batch_size indices of the
// sampler's list for the epoch and stacks those examples into contiguous [B, ...] tensors
// (Dataset::get_batch). The last batch of a pass is smaller unless drop_last drops it.
//
// Options beyond torch's single-process loader:
//  - prefetch: a background thread collates the next batches into a bounded queue while the
//    training thread computes; batches and their order are the same as without it. An
//    exception in the thread (a corrupt example, a bad index) is rethrown to the training
//    thread at the batch where it happened, and the batches after it follow (a loop that
//    catches it goes on, as torch's DataLoader). Ending a pass early (break) stops and joins the
//    thread; nothing outlives the loader.
//  - device: batches land on this device. For CUDA, each batch goes through a small ring of
//    page-locked (pinned) host buffers and an asynchronous host-to-device copy on the compute
//    stream, so the copy overlaps host work and orders itself before the step's kernels (what
//    pin_memory=True plus .to(device, non_blocking=True) do in PyTorch).
//
// One pass at a time: begin() ends any pass still running. Not thread-safe; iterate from one
// thread.
#pragma once

#include <cstdint>
#include <exception>
#include <iterator>
#include <memory>

#include "core/device.h"
#include "data/dataset.h"
#include "data/sampler.h"

namespace nanoddp::data {

struct DataLoaderOptions {
  // Without a sampler: a new permutation of the whole dataset at every pass, randperm(N, seed +
  // pass number) (data/sampler.h). torch's RandomSampler reshuffles every pass too; its first
  // pass with generator=torch.Generator().manual_seed(seed) is this order (its later passes go
  // on drawing from that generator, where ours reseed; torch's DataLoader draws a worker seed
  // from its generator first, so its order differs). Cannot be combined with a sampler (the
  // sampler decides the order).
  bool shuffle = false;
  uint64_t seed = 0;
  bool drop_last = false;  // drop the last batch of a pass when it is smaller than batch_size
  bool prefetch = false;   // collate on a background thread (see above)
  int prefetch_depth = 2;  // batches the thread may have ready ahead, >= 1
  Device device = Device::cpu();
};

class DataLoader {
 public:
  // Batches of the whole dataset, in order or shuffled (options.shuffle).
  // Throws ValueError when dataset is null, batch_size < 1 or prefetch_depth < 1;
  // DeviceError when options.device is CUDA and this build has no CUDA or no such GPU.
  DataLoader(std::shared_ptr<const Dataset> dataset, int64_t batch_size, DataLoaderOptions options = {});
  // Batches of sampler.indices() for the sampler's epoch (set it with set_epoch). Throws as
  // above, and ValueError when sampler.size() != dataset->size() or options.shuffle is set
  // (torch: "sampler option is mutually exclusive with shuffle").
  // Which sampler set_epoch must reach: the loader's own (a temporary or std::move'd sampler;
  // call loader.set_epoch), or one shared with the caller (shared_ptr: the caller's
  // sampler->set_epoch(epoch) is the loader's, as torch's DataLoader(sampler=sampler) keeps
  // the caller's object). A named sampler passed by value would be a copy that the caller's
  // set_epoch never reaches, so every epoch would silently repeat one order: that overload
  // is deleted, and it does not compile.
  DataLoader(std::shared_ptr<const Dataset> dataset, int64_t batch_size, DistributedSampler&& sampler,
             DataLoaderOptions options = {});
  // ValueError also when sampler is null.
  DataLoader(std::shared_ptr<const Dataset> dataset, int64_t batch_size,
             std::shared_ptr<DistributedSampler> sampler, DataLoaderOptions options = {});
  DataLoader(std::shared_ptr<const Dataset> dataset, int64_t batch_size, const DistributedSampler& sampler,
             DataLoaderOptions options = {}) = delete;
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Batches in one pass: ceil(num_samples / batch_size), or floor with drop_last (len(loader)).
  int64_t size() const;
  int64_t batch_size() const { return batch_size_; }
  const Dataset& dataset() const { return *dataset_; }
  const DataLoaderOptions& options() const { return options_; }

  // Sets the sampler's epoch for the next pass (DistributedSampler.set_epoch). With a
  // sampler, call it (or the shared sampler's) every epoch or each epoch repeats the same
  // order, as in PyTorch.
  void set_epoch(int64_t epoch) { sampler_->set_epoch(epoch); }
  DistributedSampler& sampler() { return *sampler_; }
  const DistributedSampler& sampler() const { return *sampler_; }

  // An input iterator over one pass. A batch that failed (whatever the dataset threw: IOError,
  // IndexError, ...; or DeviceError from the copy to the GPU) is still a position of the pass:
  // reading it (* or ->) rethrows its error, and ++ moves on to the next batch, as torch's
  // `next(it)` raises for that batch and the following `next(it)` gives the one after it. So
  // a range-for stops at the first bad batch, and a loop that catches the error around its
  // body sees every other batch, the first one included:
  //   for (auto it = loader.begin(); it != loader.end(); ++it)
  //     try { step(*it); } catch (const IOError& e) { log(e); }
  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = const Batch*;
    using reference = const Batch&;

    const Batch& operator*() const { return batch(); }
    const Batch* operator->() const { return &batch(); }
    Iterator& operator++();
    // Equal when both are past the end (only end() comparisons are meaningful).
    bool operator==(const Iterator& other) const { return loader_ == other.loader_; }
    bool operator!=(const Iterator& other) const { return !(*this == other); }

   private:
    friend class DataLoader;
    Iterator() = default;  // end()
    explicit Iterator(DataLoader* loader);
    const Batch& batch() const;
    void fetch();  // the pass's next batch, or its error; past the end after the last

    DataLoader* loader_ = nullptr;  // null once past the end
    uint64_t pass_id_ = 0;
    Batch batch_;
    std::exception_ptr error_;  // why this batch failed; null for a good one
  };

  // Starts a pass (ending any pass still running) and returns its first batch (which, like any
  // other, may hold an error); an empty pass returns end().
  Iterator begin();
  Iterator end() { return Iterator(); }

 private:
  class Pass;           // one pass: its batch list, and the prefetch thread if any
  class PinnedStaging;  // pinned host buffers for CUDA copies

  // Moves the next batch of the current pass into out; false at the end of the pass.
  bool next(Batch& out);
  Tensor to_device(const Tensor& host);

  std::shared_ptr<const Dataset> dataset_;
  int64_t batch_size_;
  std::shared_ptr<DistributedSampler> sampler_;  // never null
  DataLoaderOptions options_;
  bool advance_epoch_per_pass_;  // shuffle without a user sampler: reshuffle every pass
  std::unique_ptr<Pass> pass_;
  uint64_t pass_id_ = 0;
  std::unique_ptr<PinnedStaging> staging_;
};

}  // namespace nanoddp::data
