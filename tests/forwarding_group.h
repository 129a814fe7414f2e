// Process groups that wrap another, for tests that watch what a caller does with a group:
// ForwardingGroup hands every call to the inner group (a wrapper overrides what it watches);
// SendCountingGroup counts the bytes handed to send(), what a ring all-reduce's traffic is
// measured by (tests/test_ring.cpp and the ring exercise's grader, exercises/grader.cpp).
//
//   auto counting = std::make_shared<testing::SendCountingGroup>(pg);
//   dist::ring_all_reduce(*counting, t);        // counting->sent_bytes: 2(N-1)/N of t's bytes
#pragma once

#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dist/process_group.h"

namespace nanoddp::testing {

class ForwardingGroup : public dist::ProcessGroup {
 public:
  explicit ForwardingGroup(std::shared_ptr<dist::ProcessGroup> inner)
      : dist::ProcessGroup(inner->rank(), inner->size()), inner_(std::move(inner)) {}
  std::string backend_name() const override { return inner_->backend_name(); }
  Device device() const override { return inner_->device(); }
  bool collectives_run_in_wait() const override { return inner_->collectives_run_in_wait(); }
  void issue_queued_point_to_point() override { inner_->issue_queued_point_to_point(); }
  std::string all_reduce_algorithm() const override { return inner_->all_reduce_algorithm(); }
  Tensor new_collective_buffer(int64_t numel, DType dtype, Device device) override {
    return inner_->new_collective_buffer(numel, dtype, device);
  }
  std::shared_ptr<dist::Work> all_reduce(Tensor& t, dist::ReduceOp op) override {
    return inner_->all_reduce(t, op);
  }
  std::shared_ptr<dist::Work> broadcast(Tensor& t, int root) override { return inner_->broadcast(t, root); }
  std::shared_ptr<dist::Work> all_gather(std::vector<Tensor>& outs, const Tensor& in) override {
    return inner_->all_gather(outs, in);
  }
  std::shared_ptr<dist::Work> reduce_scatter(Tensor& out, const std::vector<Tensor>& ins,
                                             dist::ReduceOp op) override {
    return inner_->reduce_scatter(out, ins, op);
  }
  std::shared_ptr<dist::Work> barrier() override { return inner_->barrier(); }
  std::shared_ptr<dist::Work> send(const Tensor& t, int dst, int tag) override {
    return inner_->send(t, dst, tag);
  }
  std::shared_ptr<dist::Work> recv(Tensor& t, int src, int tag) override { return inner_->recv(t, src, tag); }
  dist::Store& store() override { return inner_->store(); }

 protected:
  std::shared_ptr<dist::ProcessGroup> inner_;
};

class SendCountingGroup : public ForwardingGroup {
 public:
  using ForwardingGroup::ForwardingGroup;
  std::shared_ptr<dist::Work> send(const Tensor& t, int dst, int tag) override {
    sent_bytes += t.nbytes();
    destinations.insert(dst);
    return inner_->send(t, dst, tag);
  }

  size_t sent_bytes = 0;
  std::set<int> destinations;  // the ranks sent to: a ring's rank sends to one neighbour only
};

}  // namespace nanoddp::testing
