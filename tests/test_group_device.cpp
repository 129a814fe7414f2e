// Code that issues collectives must use the group's device, and ops must keep all their
// operands on one device. Without a GPU, a second host device, cpu:1, stands in for one: the
// CPU kernels run on it, but it is not Device::cpu(), so a host tensor handed to a group that
// takes only cpu:1 tensors (as NCCL takes only cuda:N ones) is refused, as are ops that mix
// the two.
#include <doctest/doctest.h>

#include <cmath>

#include "core/ops.h"
#include "dist/ddp.h"
#include "dist/host_collectives.h"
#include "nn/layers.h"
#include "nn/optim.h"

using namespace nanoddp;

namespace {

const Device kStandIn{Device::Type::CPU, 1};

// Two ranks that always hold the same values, in one process: every collective behaves as if
// a peer had passed exactly this rank's tensors. Like the NCCL group, it refuses tensors that
// are not on its device.
class StandInGroup : public dist::ProcessGroup {
 public:
  StandInGroup() : ProcessGroup(/*rank=*/0, /*world_size=*/2) {}
  std::string backend_name() const override { return "stand-in"; }
  Device device() const override { return kStandIn; }
  int collectives = 0;

  std::shared_ptr<dist::Work> all_reduce(Tensor& tensor, dist::ReduceOp op) override {
    check_tensor("all_reduce", tensor, kStandIn);
    check_reduce("all_reduce", tensor, op);
    ++collectives;
    if (op == dist::ReduceOp::Sum) {  // x + x
      if (tensor.dtype() == DType::Float32) {
        float* p = tensor.data<float>();
        for (int64_t i = 0; i < tensor.numel(); ++i) p[i] *= 2;
      } else {
        int64_t* p = tensor.data<int64_t>();
        for (int64_t i = 0; i < tensor.numel(); ++i) p[i] *= 2;
      }
    }
    return std::make_shared<dist::CompletedWork>();  // avg, max, min of equal values: unchanged
  }
  std::shared_ptr<dist::Work> broadcast(Tensor& tensor, int) override {
    check_tensor("broadcast", tensor, kStandIn);
    ++collectives;
    return std::make_shared<dist::CompletedWork>();
  }
  std::shared_ptr<dist::Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override {
    check_tensor("all_gather", input, kStandIn);
    check_list("all_gather", outputs, input);
    ++collectives;
    for (Tensor& out : outputs) out.copy_(input);
    return std::make_shared<dist::CompletedWork>();
  }
  std::shared_ptr<dist::Work> reduce_scatter(Tensor&, const std::vector<Tensor>&, dist::ReduceOp) override {
    NANODDP_THROW(DistError, "the stand-in has no reduce_scatter");
  }
  std::shared_ptr<dist::Work> barrier() override { return std::make_shared<dist::CompletedWork>(); }
};

std::shared_ptr<nn::Sequential> mlp() {
  Generator gen(5);
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Linear(4, 6, gen));
  model->add(nn::ReLU());
  model->add(nn::Linear(6, 3, gen));
  return model;
}

}  // namespace

TEST_CASE("the stand-in group refuses host tensors, as NCCL refuses them") {
  StandInGroup pg;
  Tensor host = Tensor::ones({3}, DType::Int64);
  CHECK_THROWS_AS(pg.all_reduce(host, dist::ReduceOp::Sum), DeviceError);
  Tensor there = host.to(kStandIn);
  pg.all_reduce(there, dist::ReduceOp::Sum)->wait();
  CHECK(there.to_int_vector() == std::vector<int64_t>{2, 2, 2});
  CHECK(kStandIn.str() == "cpu:1");
}

TEST_CASE("host values are reduced and gathered through the group's device") {
  StandInGroup pg;
  CHECK(dist::all_reduce_host(pg, std::vector<int64_t>{7, 1000}, dist::ReduceOp::Sum) ==
        std::vector<int64_t>{14, 2000});
  CHECK(dist::all_reduce_host(pg, std::vector<float>{0.25f, -3.0f}, dist::ReduceOp::Sum) ==
        std::vector<float>{0.5f, -6.0f});
  CHECK(dist::all_reduce_host(pg, std::vector<float>{1.5f}, dist::ReduceOp::Max) == std::vector<float>{1.5f});
  const auto gathered = dist::all_gather_host(pg, {4, -5});
  REQUIRE(gathered.size() == 2);
  CHECK(gathered[0] == std::vector<int64_t>{4, -5});
  CHECK(gathered[1] == std::vector<int64_t>{4, -5});
  CHECK(pg.collectives == 4);
}

TEST_CASE("DDP builds and reduces on a group that takes only its own device's tensors") {
  // Two identical ranks: the mean gradient is this rank's own, so DDP must leave every
  // gradient exactly as a plain backward computes it.
  auto pg = std::make_shared<StandInGroup>();
  auto reference = mlp();
  auto model = mlp();
  model->to(kStandIn);
  dist::DistributedDataParallel ddp(model, pg);  // its checks all-gather on the group's device
  CHECK(pg->collectives >= 2 + 4);               // two all-gathers, one broadcast per parameter

  Generator gen(9);
  const Tensor x = Tensor::randn({8, 4}, gen);
  const Tensor y = Tensor::from_vector(std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1});
  cross_entropy((*reference)(x), y).backward();
  cross_entropy(ddp(x.to(kStandIn)), y.to(kStandIn)).backward();
  const auto want = reference->named_parameters(), got = model->named_parameters();
  REQUIRE(want.size() == got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    CAPTURE(want[i].first);
    CHECK(got[i].second.grad().device() == kStandIn);
    const std::vector<float> a = want[i].second.grad().to_vector(), b = got[i].second.grad().to_vector();
    REQUIRE(a.size() == b.size());
    for (size_t j = 0; j < a.size(); ++j) CHECK(a[j] == b[j]);
  }
}

TEST_CASE("ops refuse operands on two devices") {
  const Tensor a = Tensor::ones({2, 3});
  const Tensor b = Tensor::ones({2, 3}, DType::Float32, kStandIn);
  CHECK_THROWS_AS(add(a, b), DeviceError);
  CHECK_THROWS_AS(matmul(a, Tensor::ones({3, 2}, DType::Float32, kStandIn)), DeviceError);
  CHECK_THROWS_AS(mse_loss(a, b), DeviceError);
  CHECK_THROWS_AS(cross_entropy(a, Tensor::zeros({2}, DType::Int64, kStandIn)), DeviceError);
  CHECK(add(b, b).device() == kStandIn);
}

TEST_CASE("backward refuses a gradient on another device than its output") {
  Tensor w = Tensor::ones({3}, DType::Float32, kStandIn).set_requires_grad(true);
  Tensor out = w * 2.0f;
  CHECK_THROWS_AS(out.backward(Tensor::ones({3})), DeviceError);  // a host gradient
  CHECK(!w.grad().defined());
  out.backward(Tensor::ones({3}, DType::Float32, kStandIn));
  CHECK(w.grad().to_vector() == std::vector<float>{2, 2, 2});
}
