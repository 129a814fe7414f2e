#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/storage.h"

using namespace nanoddp;

namespace {
// The message of the ValueError that backward of loss throws, or "" when it does not throw.
std::string backward_error(const Tensor& loss) {
  try {
    loss.backward();
  } catch (const ValueError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("gradients accumulate when a tensor feeds several ops") {
  // y = x*x + 3x -> dy/dx = 2x + 3
  Tensor x = Tensor::from_vector({1, -2, 0.5f}).set_requires_grad(true);
  sum(x * x + x * 3.0f).backward();
  CHECK(x.grad().to_vector() == std::vector<float>{5, -1, 4});
}

TEST_CASE("a graph edge keeps no memory: a tensor no backward reads is freed when forward lets it go") {
  // y = relu(x · w^T + b). Linear's output h feeds only the ReLU, which saves its own output
  // (Note [Graph edges]): once h's handle goes, nothing holds its memory.
  Tensor x = Tensor::from_vector({1, -2, 3, 0.5f}, {2, 2}).set_requires_grad(true);
  Tensor w = Tensor::from_vector({1, 1, -1, 2}, {2, 2}).set_requires_grad(true);
  Tensor b = Tensor::from_vector({0.5f, 10}).set_requires_grad(true);
  std::weak_ptr<Storage> h_memory;
  Tensor y;
  {
    const Tensor h = linear(x, w, b);  // [[-0.5, 5], [4, 8]]
    h_memory = h.impl()->storage;
    y = relu(h);
  }
  CHECK(h_memory.expired());
  CHECK(y.to_vector() == std::vector<float>{0, 5, 4, 8});
  sum(y).backward();
  // The ReLU's mask is [[0, 1], [1, 1]]: dw = mask^T · x, db = column sums, dx = mask · w.
  CHECK(w.grad().to_vector() == std::vector<float>{3, 0.5f, 4, -1.5f});
  CHECK(b.grad().to_vector() == std::vector<float>{1, 2});
  CHECK(x.grad().to_vector() == std::vector<float>{-1, 2, 0, 3});
}

TEST_CASE("a backward that reads an input's values through its edge gets an error naming the rule") {
  // The ways to read a tensor's memory: data<T>(), clone, to(dtype) from 16 bits (its raw
  // bits), copy_ from it.
  using Read = std::function<void(const Tensor&)>;
  const std::vector<std::pair<std::string, Read>> reads = {
      {"data", [](const Tensor& t) { (void)t.data<float>(); }},
      {"clone", [](const Tensor& t) { (void)t.clone(); }},
      {"to(float32) from bfloat16", [](const Tensor& t) { (void)t.to(DType::Float32); }},
      {"copy_", [](const Tensor& t) { Tensor::empty(t.shape(), t.dtype()).copy_(t); }},
  };
  struct ReadsItsEdge : Node {
    Read read;
    std::vector<Tensor> apply(const Tensor& dy) override {
      read(inputs[0]);
      return {dy};
    }
    const char* name() const override { return "ReadsItsEdgeBackward"; }
  };
  for (const auto& entry : reads) {
    const std::string& label = entry.first;
    CAPTURE(label);
    Tensor x = Tensor::from_vector({2.0f}).set_requires_grad(true);
    const bool low = label.find("bfloat16") != std::string::npos;
    const Tensor input = low ? (x * 2.0f).to(DType::BFloat16) : x * 2.0f;
    auto node = std::make_shared<ReadsItsEdge>();
    node->read = entry.second;
    node->inputs = {input};
    const Tensor y = make_result(input.to(DType::Float32) * 1.0f, node);
    std::string message;
    try {
      sum(y).backward();
    } catch (const ValueError& e) {
      message = e.what();
    }
    CHECK_MESSAGE(message.find("Note [Graph edges]") != std::string::npos, message);
    CHECK_MESSAGE(message.find("save_for_backward") != std::string::npos, message);
  }
}

TEST_CASE(
    "clone is recorded as torch.clone: its gradient flows back; detach().clone() is a copy outside the "
    "graph") {
  // sum(c * x), c = x.clone(): d/dx = c + x = 2x, as torch's. With c = x.detach().clone() the
  // product sees one use of x: d/dx = c = x.
  const std::vector<float> values{0.5f, -1.25f, 3.0f};
  Tensor x = Tensor::from_vector(values).set_requires_grad(true);
  Tensor c = x.clone();
  CHECK(c.requires_grad());
  sum(mul(c, x)).backward();
  CHECK(x.grad().to_vector() == std::vector<float>{1.0f, -2.5f, 6.0f});

  Tensor y = Tensor::from_vector(values).set_requires_grad(true);
  Tensor d = y.detach().clone();
  CHECK_FALSE(d.requires_grad());
  sum(mul(d, y)).backward();
  CHECK(y.grad().to_vector() == values);

  // Outside grad mode, or of a tensor that needs no gradient, a clone is a plain copy.
  NoGradGuard no_grad;
  CHECK_FALSE(x.clone().requires_grad());
}

TEST_CASE("gradients accumulate across backward calls until cleared") {
  Tensor w = Tensor::from_vector({2.0f}).set_requires_grad(true);
  sum(w * 4.0f).backward();
  sum(w * 4.0f).backward();
  CHECK(w.grad().item() == 8.0f);
  w.set_grad(Tensor());
  sum(w * w).backward();
  CHECK(w.grad().item() == 4.0f);
}

TEST_CASE("the graph is freed after backward unless retained") {
  Tensor x = Tensor::from_vector({3.0f}).set_requires_grad(true);
  Tensor y = sum(x * x);
  y.backward(Tensor(), /*retain_graph=*/true);
  y.backward();
  CHECK(x.grad().item() == 12.0f);
  CHECK_THROWS_AS(y.backward(), ValueError);
}

TEST_CASE("a second backward through nodes that saved nothing runs again, as torch's") {
  // torch 1.13: y = (x + w).sum(); y.backward(); y.backward() gives x.grad [2, 2, 2]. Only a
  // node whose saved tensors were freed refuses, before any gradient moves.
  Tensor x = Tensor::from_vector({1.0f, 2.0f, 3.0f}).set_requires_grad(true);
  Tensor w = Tensor::from_vector({4.0f, 5.0f, 6.0f}).set_requires_grad(true);
  Tensor y = sum((x + w).reshape({3, 1}));
  y.backward();
  y.backward();
  CHECK(x.grad().to_vector() == std::vector<float>{2, 2, 2});
  CHECK(w.grad().to_vector() == std::vector<float>{2, 2, 2});

  Tensor z = sum(x * x) + sum(w);  // MulBackward saved x
  z.backward();
  CHECK(x.grad().to_vector() == std::vector<float>{4, 6, 8});
  CHECK_THROWS_WITH_AS(z.backward(), doctest::Contains("its saved tensors were freed by the first backward"),
                       ValueError);
  CHECK(x.grad().to_vector() == std::vector<float>{4, 6, 8});
  CHECK(w.grad().to_vector() == std::vector<float>{3, 3, 3});
}

TEST_CASE("a .grad that set_data left at another shape is refused, not overrun") {
  // torch: x.data = torch.arange(8.) keeps x.grad at [2]; the next backward fails in its add
  // ("The size of tensor a (2) must match the size of tensor b (8)").
  Tensor x = Tensor::from_vector({1.0f, 2.0f}).set_requires_grad(true);
  Tensor w = Tensor::from_vector({3.0f}).set_requires_grad(true);
  sum(x).backward();
  sum(w).backward();
  x.set_data(Tensor::from_vector({0, 1, 2, 3, 4, 5, 6, 7}));
  // The walk over the graph refuses it before any gradient moves, so w's .grad keeps 1.
  CHECK_THROWS_WITH_AS((sum(w * w) + sum(x * x)).backward(), doctest::Contains("has a .grad of [2] float32"),
                       ShapeError);
  CHECK(x.grad().to_vector() == std::vector<float>{1, 1});
  CHECK(w.grad().to_vector() == std::vector<float>{1});
  x.set_grad(Tensor());
  sum(x * 2.0f).backward();
  CHECK(x.grad().to_vector() == std::vector<float>(8, 2.0f));
}

TEST_CASE(
    "set_data: integer data on a tensor that requires grad, and a leaf changed between forward and "
    "backward") {
  // torch: "data set to a tensor that requires gradients must be floating point or complex dtype".
  Tensor x = Tensor::from_vector({1.0f, 2.0f}).set_requires_grad(true);
  CHECK_THROWS_AS(x.set_data(Tensor::from_vector(std::vector<int64_t>{1, 2})), ValueError);
  CHECK(x.dtype() == DType::Float32);
  // A leaf given data of another shape after the forward used it: its gradient has the old
  // shape (torch fails in the add), a ShapeError naming the cause, not an internal assertion.
  Tensor y = sum(x * x);
  x.set_data(Tensor::from_vector({5.0f, 5.0f, 5.0f}));
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("set_data changed the tensor between the forward"),
                       ShapeError);
}

TEST_CASE(
    "adding into a .grad in place counts as a change of its memory: a forward that saved it refuses the "
    "backward") {
  // torch 1.13 raises "modified by an inplace operation" for both: AccumulateGrad bumps the
  // version of the .grad it adds into.
  SUBCASE(".grad is a tensor a product saved") {
    const Tensor g = Tensor::from_vector({1.0f, 1.0f}, {2, 1});
    Tensor w = Tensor::from_vector({0.0f, 0.0f}, {2, 1}).set_requires_grad(true);
    w.set_grad(g);
    Tensor z = Tensor::from_vector({1.0f, 1.0f}, {2, 1}).set_requires_grad(true);
    const Tensor y1 = sum(z * g);                                                 // saves g for z's gradient
    const Tensor y2 = sum(matmul(Tensor::from_vector({5.0f, 7.0f}, {1, 2}), w));  // w.grad (g) += [5, 7]
    const std::string m = backward_error(y1 + y2);
    CHECK_MESSAGE(m.find("was modified in place") != std::string::npos, m);
    CHECK(z.grad().defined() == false);  // not [6, 8]: g's new values never reached it
  }
  SUBCASE(".grad is another parameter's memory") {
    Tensor w2 = Tensor::from_vector({1.0f, 1.0f}, {2, 1}).set_requires_grad(true);
    Tensor w = Tensor::from_vector({0.0f, 0.0f}, {2, 1}).set_requires_grad(true);
    w.set_grad(w2.detach());
    Tensor z = Tensor::from_vector({1.0f, 1.0f}, {2, 1}).set_requires_grad(true);
    const Tensor y1 = sum(z * w2);  // saves w2 for z's gradient; runs after w's accumulation
    const Tensor y2 = sum(matmul(Tensor::from_vector({5.0f, 7.0f}, {1, 2}), w));  // w.grad (w2) += [5, 7]
    const std::string m = backward_error(y1 + y2);
    CHECK_MESSAGE(m.find("was modified in place") != std::string::npos, m);
    CHECK(z.grad().defined() == false);
  }
  SUBCASE("accumulating across passes, with nothing saved that aliases .grad, still works") {
    Tensor w = Tensor::from_vector({1.0f, 2.0f}).set_requires_grad(true);
    for (int pass = 0; pass < 3; ++pass) sum(w * 3.0f).backward();
    CHECK(w.grad().to_vector() == std::vector<float>{9, 9});
  }
}

TEST_CASE("backward passes on two threads that share a leaf lose no gradient (torch locks AccumulateGrad)") {
  Tensor a = Tensor::from_vector({1.0f, 2.0f}).set_requires_grad(true);
  Tensor w = Tensor::from_vector({1.0f, 2.0f, 3.0f, 4.0f}, {2, 2}).set_requires_grad(true);
  const auto job = [&] {
    for (int i = 0; i < 2000; ++i) {
      sum(a * 3.0f).backward();
      // linear's weight gradient adds straight into an existing .grad (Note [Accumulating into .grad])
      sum(matmul(Tensor::from_vector({1.0f, 1.0f}, {1, 2}), w)).backward();
    }
  };
  std::thread t1(job), t2(job);
  t1.join();
  t2.join();
  CHECK(a.grad().to_vector() == std::vector<float>{12000, 12000});
  CHECK(w.grad().to_vector() == std::vector<float>(4, 4000.0f));
}

TEST_CASE(
    "a tensor saved for backward and then changed in place: backward throws, as torch's version check") {
  // torch: "one of the variables needed for gradient computation has been modified by an
  // inplace operation". Without the check each case computes with the new values: weight.grad
  // all 0 for the zeroed input, the new targets' gradient, relu's gradient from the ones.
  Tensor w = Tensor::from_vector({1.0f, 2.0f}, {1, 2}).set_requires_grad(true);
  Tensor x = Tensor::from_vector({3.0f, 4.0f}, {1, 2});
  Tensor loss = sum(linear(x, w, Tensor()));
  x.fill_(0.0f);  // linear saved x for the weight's gradient
  std::string message = backward_error(loss);
  CHECK(message.find("saved tensor 0 ([1, 2] float32) was modified in place") != std::string::npos);
  CHECK(message.find("at version 1, the forward saved version 0") != std::string::npos);
  CHECK(!w.grad().defined());

  Tensor logits = Tensor::from_vector({1, 2, 3, 0, 1, 0}, {2, 3}).set_requires_grad(true);
  Tensor target = Tensor::from_vector(std::vector<int64_t>{0, 1});
  loss = cross_entropy(logits, target);
  target.copy_(Tensor::from_vector(std::vector<int64_t>{2, 2}));
  CHECK(backward_error(loss).find("modified in place") != std::string::npos);

  Tensor a = Tensor::from_vector({-1.0f, 2.0f}).set_requires_grad(true);
  Tensor y = relu(a);
  loss = sum(y * y);
  {
    NoGradGuard no_grad;  // in grad mode fill_ on an op's output is refused outright
    y.fill_(1.0f);        // relu and mul saved y
  }
  CHECK(backward_error(loss).find("modified in place") != std::string::npos);

  // A view of the saved memory shares its version, as torch's views do.
  Tensor v = Tensor::from_vector({1.0f, 2.0f, 3.0f, 4.0f});
  Tensor b = Tensor::from_vector({1.0f, 1.0f}).set_requires_grad(true);
  Tensor part = v.slice_view(2, Shape{2});
  loss = sum(part * b);
  v.slice_view(0, Shape{4}).fill_(0.0f);
  CHECK(backward_error(loss).find("modified in place") != std::string::npos);
}

TEST_CASE(
    "changes in place that no backward reads are allowed: after backward, unsaved tensors, under no_grad") {
  // w * x saves x for w's gradient: [3, 4]. Changing x after backward, or another tensor
  // before it, is fine.
  Tensor w = Tensor::from_vector({1.0f, 2.0f}).set_requires_grad(true);
  Tensor x = Tensor::from_vector({3.0f, 4.0f});
  Tensor other = Tensor::from_vector({5.0f, 6.0f});
  Tensor loss = sum(w * x);
  other.fill_(0.0f);
  loss.backward();
  CHECK(w.grad().to_vector() == std::vector<float>{3.0f, 4.0f});
  x.fill_(0.0f);
  // A saved tensor changed and then retained graph: the second backward throws, the first
  // already wrote its gradient.
  Tensor y = Tensor::from_vector({1.0f, 1.0f});
  Tensor loss2 = sum(w * y);
  loss2.backward(Tensor(), /*retain_graph=*/true);
  y.copy_(Tensor::from_vector({2.0f, 2.0f}));
  CHECK(backward_error(loss2).find("modified in place") != std::string::npos);
  CHECK(w.grad().to_vector() == std::vector<float>{4.0f, 5.0f});
  {
    NoGradGuard no_grad;
    Tensor z = w * x;  // records nothing, saves nothing
    x.fill_(1.0f);
    CHECK(z.to_vector() == std::vector<float>{0.0f, 0.0f});
  }
}

TEST_CASE("NoGradGuard records nothing") {
  Tensor x = Tensor::ones({2}).set_requires_grad(true);
  Tensor y;
  {
    NoGradGuard no_grad;
    CHECK_FALSE(is_grad_enabled());
    y = x * 2.0f;
  }
  CHECK(is_grad_enabled());
  CHECK_FALSE(y.requires_grad());
  CHECK(y.grad_fn() == nullptr);
  CHECK_THROWS_AS(y.backward(), ValueError);
}

TEST_CASE("backward of a non-scalar needs an explicit gradient of its shape") {
  Tensor x = Tensor::from_vector({1, 2}).set_requires_grad(true);
  Tensor y = x * 3.0f;
  CHECK_THROWS_AS(y.backward(), ValueError);
  CHECK_THROWS_AS(y.backward(Tensor::ones({3})), ShapeError);
  y.backward(Tensor::from_vector({1, 10}));
  CHECK(x.grad().to_vector() == std::vector<float>{3, 30});
}

TEST_CASE("post-accumulate-grad hooks fire once per backward, after the full gradient, last layer first") {
  Tensor w1 = Tensor::from_vector({2.0f}, {1, 1}).set_requires_grad(true);
  Tensor w2 = Tensor::from_vector({3.0f}, {1, 1}).set_requires_grad(true);
  std::vector<std::string> order;
  std::vector<float> seen;
  w1.register_post_accumulate_grad_hook([&](Tensor& p) {
    order.push_back("w1");
    seen.push_back(p.grad().item());
  });
  const int id = w2.register_post_accumulate_grad_hook([&](Tensor& p) {
    order.push_back("w2");
    seen.push_back(p.grad().item());
  });
  // out = (x w1 + x w1) w2 : w1 is used twice, its hook must see the sum of both uses.
  const Tensor x = Tensor::from_vector({1.0f}, {1, 1});
  const Tensor h = matmul(x, w1) + matmul(x, w1);
  sum(matmul(h, w2)).backward();
  CHECK(order == std::vector<std::string>{"w2", "w1"});
  CHECK(seen == std::vector<float>{4.0f, 6.0f});  // d/dw2 = 2 x w1 = 4, d/dw1 = 2 x w2 = 6
  w2.remove_hook(id);
  order.clear();
  sum(matmul(matmul(x, w1), w2)).backward();
  CHECK(order == std::vector<std::string>{"w1"});
}

TEST_CASE("a hook may remove itself or register more while the hooks run; the others still run, once") {
  // A one-shot hook (torch's handle.remove() inside the hook) removes itself while the hooks
  // run, and one that registers more grows the list being walked: neither may skip a hook or
  // run a freed one.
  Tensor w = Tensor::from_vector({2.0f}).set_requires_grad(true);
  std::vector<std::string> calls;
  int first = -1;
  first = w.register_post_accumulate_grad_hook([&](Tensor&) {
    calls.push_back("h1");
    w.remove_hook(first);
    for (int i = 0; i < 8; ++i)
      w.register_post_accumulate_grad_hook([&](Tensor&) { calls.push_back("late"); });
  });
  w.register_post_accumulate_grad_hook([&](Tensor&) { calls.push_back("h2"); });
  int third = -1;
  third = w.register_post_accumulate_grad_hook([&](Tensor&) { calls.push_back("h3"); });
  w.register_post_accumulate_grad_hook([&](Tensor&) {
    calls.push_back("h4");
    w.remove_hook(third);  // already ran: removing it changes the next backward only
  });
  sum(w * 3.0f).backward();
  CHECK(calls == std::vector<std::string>{"h1", "h2", "h3", "h4"});
  calls.clear();
  sum(w * 3.0f).backward();  // h1 and h3 gone; the 8 late ones run after h4, in order
  std::vector<std::string> expected = {"h2", "h4"};
  expected.insert(expected.end(), 8, "late");
  CHECK(calls == expected);
  // A hook's own state lives on from one backward to the next (it runs as registered, not a copy).
  std::vector<int> counted;
  w.register_post_accumulate_grad_hook([&counted, n = 0](Tensor&) mutable { counted.push_back(++n); });
  for (int i = 0; i < 3; ++i) sum(w * 3.0f).backward();
  CHECK(counted == std::vector<int>{1, 2, 3});
}

TEST_CASE("a tensor cannot be its own gradient (torch: \"can't assign Variable as its own grad\")") {
  Tensor p = Tensor::from_vector({1.0f, 2.0f}).set_requires_grad(true);
  CHECK_THROWS_WITH_AS(p.set_grad(p), doctest::Contains("cannot be its own gradient"), ValueError);
  CHECK_THROWS_WITH_AS(p.set_grad(p.detach()), doctest::Contains("cannot be its own gradient"), ValueError);
  // Nor a view that shares some of its elements.
  Tensor flat = Tensor::zeros({15});
  Tensor w = flat.slice_view(0, {10}).set_requires_grad(true);
  CHECK_THROWS_WITH_AS(w.set_grad(flat.slice_view(5, {10})), doctest::Contains("shares elements with it"),
                       ValueError);
  w.set_grad(Tensor::zeros({10}));  // its own memory: fine
  sum(p * 3.0f).backward();
  CHECK(p.to_vector() == std::vector<float>{1, 2});  // the values are untouched
  CHECK(p.grad().to_vector() == std::vector<float>{3, 3});
}

TEST_CASE("linear with only its bias requiring grad runs a second backward, as torch's") {
  // Only undefined placeholders were saved: nothing was freed. torch 1.13: b.grad [2, 2].
  const Tensor x = Tensor::from_vector({1.0f, 2.0f}, {1, 2});
  const Tensor w = Tensor::from_vector({1.0f, 0.0f, 0.0f, 1.0f}, {2, 2});
  Tensor b = Tensor::from_vector({0.5f, 0.5f}).set_requires_grad(true);
  const Tensor y = sum(linear(x, w, b));
  y.backward();
  y.backward();
  CHECK(b.grad().to_vector() == std::vector<float>{2, 2});
}

TEST_CASE("only leaves that require grad get .grad") {
  Tensor a = Tensor::from_vector({1.0f, 2.0f}).set_requires_grad(true);
  Tensor b = Tensor::from_vector({3.0f, 4.0f});
  Tensor c = a * b;
  sum(c).backward();
  CHECK(a.grad().to_vector() == std::vector<float>{3, 4});
  CHECK_FALSE(b.grad().defined());
  CHECK_FALSE(c.grad().defined());
  CHECK_THROWS_AS(c.set_requires_grad(false), ValueError);
  CHECK(c.set_requires_grad(true).requires_grad());  // already so: a no-op, as torch's requires_grad_()
  CHECK(a.to(DType::Float16).set_requires_grad(true).requires_grad());  // a 16-bit op output too
  CHECK_THROWS_AS(Tensor::zeros({1}, DType::Int64).set_requires_grad(true), ValueError);
}

TEST_CASE("a tensor whose only consumer gives no gradient does not stall its producers") {
  // a feeds b (through linear as the input of a first layer: no input gradient is computed
  // when the input does not require grad) and feeds the loss directly.
  Tensor a = Tensor::from_vector({1.0f, 2.0f}, {1, 2}).set_requires_grad(true);
  Tensor w = Tensor::from_vector({1.0f, 1.0f}, {1, 2}).set_requires_grad(true);
  Tensor h = a * 2.0f;
  Tensor out = sum(linear(h.detach(), w, Tensor())) + sum(h);
  out.backward();
  CHECK(a.grad().to_vector() == std::vector<float>{2, 2});
  CHECK(w.grad().to_vector() == std::vector<float>{2, 4});
}

TEST_CASE("queue_callback runs once at the end of backward, after every hook") {
  Tensor w = Tensor::from_vector({1.0f}).set_requires_grad(true);
  std::vector<std::string> events;
  w.register_post_accumulate_grad_hook([&](Tensor&) {
    events.push_back("hook");
    queue_callback([&] { events.push_back("callback"); });
  });
  sum(w * 2.0f + w).backward();
  CHECK(events == std::vector<std::string>{"hook", "callback"});
  CHECK_THROWS_AS(queue_callback([] {}), ValueError);
}

namespace {
// y = 3 w, recorded with a backward that notes whether w's .grad was offered (Note
// [Accumulating into .grad]) and, when take is set, adds into it and returns it.
Tensor triple_noting_offers(const Tensor& w, std::vector<bool>& offered, bool take) {
  Tensor y = Tensor::from_vector({3 * w.to_vector()[0], 3 * w.to_vector()[1]}, w.shape());
  return record("TripleBackward", y, {w}, {}, [&offered, take](const Node& node, const Tensor& dy) {
    const Tensor& into = node.accumulation_target(0);
    offered.push_back(into.defined());
    if (take && into.defined()) {
      Tensor grad = into;
      {
        NoGradGuard no_grad;
        grad.copy_(into + dy * 3.0f);
      }
      return std::vector<Tensor>{grad};
    }
    return std::vector<Tensor>{dy * 3.0f};
  });
}
}  // namespace

TEST_CASE("an existing .grad is offered to the node that gives its whole gradient, and taking it adds once") {
  for (const bool take : {true, false}) {
    CAPTURE(take);
    Tensor w = Tensor::from_vector({1.0f, 2.0f}).set_requires_grad(true);
    int hooks = 0;
    std::vector<float> seen;
    w.register_post_accumulate_grad_hook([&](Tensor& p) {
      ++hooks;
      seen = p.grad().to_vector();
    });
    std::vector<bool> offered;
    sum(triple_noting_offers(w, offered, take) * Tensor::from_vector({1.0f, 10.0f})).backward();
    CHECK(offered == std::vector<bool>{false});  // no .grad yet: nothing to add into
    const Tensor first = w.grad();
    CHECK(first.to_vector() == std::vector<float>{3, 30});

    offered.clear();
    sum(triple_noting_offers(w, offered, take) * Tensor::from_vector({2.0f, 5.0f})).backward();
    CHECK(offered == std::vector<bool>{true});
    CHECK(w.grad().is_same(first));  // in place, as before
    CHECK(w.grad().to_vector() == std::vector<float>{3 + 6, 30 + 15});
    CHECK(hooks == 2);
    CHECK(seen == std::vector<float>{9, 45});

    // Used twice: neither use has the whole gradient, so nothing is offered; the sum is added once.
    offered.clear();
    sum(triple_noting_offers(w, offered, take) + triple_noting_offers(w, offered, take)).backward();
    CHECK(offered == std::vector<bool>{false, false});
    CHECK(w.grad().to_vector() == std::vector<float>{9 + 6, 45 + 6});
    CHECK(hooks == 3);
  }
}

TEST_CASE("linear's weight gradient added straight into an existing .grad: exact values") {
  // x = [[1, 2], [3, 4]], dy = 1: dW[o][i] = sum_n x[n][i] = [4, 6] per output row; db = [2, 2].
  Tensor w = Tensor::from_vector({0.5f, -1.0f, 2.0f, 0.25f}, {2, 2}).set_requires_grad(true);
  Tensor b = Tensor::from_vector({0.0f, 1.0f}).set_requires_grad(true);
  const Tensor x = Tensor::from_vector({1, 2, 3, 4}, {2, 2});
  w.set_grad(Tensor::from_vector({100, 200, 300, 400}, {2, 2}));
  const Tensor grad_before = w.grad();
  sum(linear(x, w, b)).backward();
  CHECK(w.grad().is_same(grad_before));
  CHECK(w.grad().to_vector() == std::vector<float>{104, 206, 304, 406});
  CHECK(b.grad().to_vector() == std::vector<float>{2, 2});
  sum(linear(x, w, b)).backward();
  CHECK(w.grad().to_vector() == std::vector<float>{108, 212, 308, 412});
  CHECK(b.grad().to_vector() == std::vector<float>{4, 4});

  // A .grad that is the layer's own input is not written while the product reads it: the
  // gradient is computed from x as it was, then added (PyTorch gives the same).
  Tensor v = Tensor::from_vector({1, 0, 0, 1}, {2, 2}).set_requires_grad(true);
  Tensor x2 = Tensor::from_vector({1, 2, 3, 4}, {2, 2});
  v.set_grad(x2);
  sum(linear(x2, v, Tensor())).backward();  // dV = ones^T x2 = [[4, 6], [4, 6]]
  CHECK(v.grad().is_same(x2));
  CHECK(x2.to_vector() == std::vector<float>{5, 8, 7, 10});
  // Nor when .grad is the incoming gradient.
  Tensor u = Tensor::from_vector({2}, {1, 1}).set_requires_grad(true);
  Tensor seed = Tensor::from_vector({3}, {1, 1});
  u.set_grad(seed);
  linear(Tensor::from_vector({5}, {1, 1}), u, Tensor()).backward(seed);  // dU = seed^T [5] = 15
  CHECK(seed.item() == 18.0f);
}

TEST_CASE("a deep graph dropped without backward is freed without recursion") {
  // Summing losses for a log line without item(): 200000 nested nodes, each holding the last.
  // Freed one destructor inside the next, they overflowed the stack (Note [Graph teardown]).
  Tensor w = Tensor::from_vector({0.5f, 0.25f}).set_requires_grad(true);
  std::weak_ptr<Node> first;
  {
    Tensor total = w * 1.0f;
    first = total.grad_fn();
    for (int i = 0; i < 200000; ++i) total = total * 1.0f;
    CHECK(total.to_vector() == std::vector<float>{0.5f, 0.25f});
    CHECK_FALSE(first.expired());
  }
  CHECK(first.expired());  // the whole chain went, down to the first node
  // A graph that shares a node between two consumers is freed once, when the last one goes.
  Tensor shared = w * 2.0f;
  std::weak_ptr<Node> shared_node = shared.grad_fn();
  Tensor a = shared * 3.0f, b = shared * 5.0f;
  shared = Tensor();
  a = Tensor();
  CHECK_FALSE(shared_node.expired());
  sum(b).backward();
  CHECK(w.grad().to_vector() == std::vector<float>{10, 10});
}

TEST_CASE("copy_ and fill_ that autograd would have to record are refused in grad mode") {
  Tensor x = Tensor::from_vector({1, 2}).set_requires_grad(true);
  Tensor src = Tensor::from_vector({7, 8}).set_requires_grad(true);
  // torch records copy_ into an op's output (x.grad [0, 0], src.grad [3, 4] for sum((y = x 2,
  // y.copy_(src)) w)); not recording it gave x.grad [6, 8] and src none, silently.
  Tensor y = x * 2.0f;
  CHECK_THROWS_WITH_AS(y.copy_(src.detach()),
                       doctest::Contains("copy_ on a [2] tensor that autograd made (MulScalarBackward)"),
                       ValueError);
  CHECK_THROWS_WITH_AS(y.fill_(0), doctest::Contains("fill_ on a [2] tensor that autograd made"), ValueError);
  CHECK(y.to_vector() == std::vector<float>{2, 4});  // unchanged
  // So is a view of a leaf that requires grad (reshape records a node).
  CHECK_THROWS_AS(x.reshape({2, 1}).fill_(0), ValueError);
  // A source that requires grad would get no gradient.
  Tensor plain = Tensor::zeros({2});
  CHECK_THROWS_WITH_AS(plain.copy_(src * 2.0f), doctest::Contains("copy_: the source [2] requires grad"),
                       ValueError);
  CHECK(plain.to_vector() == std::vector<float>{0, 0});
  CHECK(x.to_vector() == std::vector<float>{1, 2});
  // Allowed: under no_grad, on tensors outside the graph, and on a leaf (initial weights):
  // no graph starts at a leaf's change.
  {
    NoGradGuard no_grad;
    x.copy_(src);
    CHECK(x.to_vector() == std::vector<float>{7, 8});
  }
  x.fill_(1);
  plain.copy_(src.detach());
  plain.fill_(5);
  CHECK(plain.to_vector() == std::vector<float>{5, 5});
  sum(x * 3.0f).backward();
  CHECK(x.grad().to_vector() == std::vector<float>{3, 3});
}

TEST_CASE("post-accumulate-grad hooks and queued callbacks run with grad mode off") {
  Tensor w = Tensor::from_vector({1.0f, 2.0f}).set_requires_grad(true);
  std::vector<bool> seen;
  w.register_post_accumulate_grad_hook([&](Tensor& p) {
    seen.push_back(is_grad_enabled());
    seen.push_back((p * 2.0f).requires_grad());  // torch: not recorded inside a hook
    queue_callback([&] { seen.push_back(is_grad_enabled()); });
  });
  sum(w * 3.0f).backward();
  CHECK(seen == std::vector<bool>{false, false, false});
  CHECK(is_grad_enabled());
}

TEST_CASE("set_grad refuses a gradient of another dtype, as torch's assigned-grad check") {
  Tensor x = Tensor::from_vector({1.0f, 2.0f}).set_requires_grad(true);
  x.set_grad(Tensor::from_vector({4.0f, 5.0f}));
  CHECK_THROWS_WITH_AS(x.set_grad(Tensor::from_vector({1.0f, 1.0f}).to(DType::Float16)),
                       doctest::Contains("set_grad: a float16 gradient for a float32 tensor [2]"),
                       ValueError);
  CHECK(x.grad().to_vector() == std::vector<float>{4, 5});
  sum(x * 2.0f).backward();  // still accumulates into the float32 gradient
  CHECK(x.grad().to_vector() == std::vector<float>{6, 7});
}

TEST_CASE("sum and mean nodes are named as torch's grad_fn, a mean over one element included") {
  const Tensor one = Tensor::from_vector({3.0f}).set_requires_grad(true);
  const Tensor two = Tensor::from_vector({3.0f, 4.0f}).set_requires_grad(true);
  CHECK(std::string(mean(one).grad_fn()->name()) == "MeanBackward");
  CHECK(std::string(mean(two).grad_fn()->name()) == "MeanBackward");
  CHECK(std::string(sum(one).grad_fn()->name()) == "SumBackward");
  CHECK(std::string(sum(two).grad_fn()->name()) == "SumBackward");
}
