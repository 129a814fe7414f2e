// Collectives at the edges, on 2 and 4 ranks, on Gloo (forked ranks), shm (two cases: this file
// again with NANODDP_TEST_BACKEND=shm) and MPI (this file again under mpirun -np 2 and -np 4):
// NaN in Max/Min, completion order and barrier, ranks that call different collectives, and
// timeouts that end every wait.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "dist/host_fingerprints.h"
#include "tests/collectives_cases.h"
#include "tests/dist_ranks.h"
#include "tests/forwarding_group.h"

using namespace nanoddp;
using namespace nanoddp::dist;
using namespace std::chrono_literals;
using nanoddp::testing::expect;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

bool same(float a, double want) { return std::isnan(want) ? std::isnan(a) : static_cast<double>(a) == want; }

void expect_floats(const Tensor& t, const std::vector<double>& want, const std::string& what) {
  const std::vector<float> got = t.to_vector();
  expect(got.size() == want.size(), what, ": ", got.size(), " elements, want ", want.size());
  for (size_t i = 0; i < want.size(); ++i)
    expect(same(got[i], want[i]), what, ": element ", i, " is ", got[i], ", want ", want[i]);
}

double milliseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// Runs fn on 2 and on 4 ranks; a failure names the world size and every failed rank, and a
// rank killed by a signal (an abort, a segfault) is a failure too (tests/multiprocess.h).
void on_2_and_4_ranks(const std::function<void(int rank, int world, int port)>& fn) {
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) { fn(rank, world, port); });
    CHECK_MESSAGE(failures.find("signal") == std::string::npos, "a rank was killed by a signal:\n", failures);
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

// Calls issue(), which must throw a DistError (not a TimeoutError) on this rank, and checks
// its message contains every part.
void expect_mismatch(const std::function<void()>& issue, const std::vector<std::string>& parts, int rank) {
  try {
    issue();
  } catch (const TimeoutError& e) {
    expect(false, "rank ", rank, ": a timeout instead of a mismatch error: ", e.what());
  } catch (const DistError& e) {
    const std::string what = e.what();
    for (const std::string& part : parts)
      expect(what.find(part) != std::string::npos, "rank ", rank, ": the error lacks '", part, "': ", what);
    return;
  }
  expect(false, "rank ", rank, ": the mismatched collective returned without an error");
}

// This rank's client of the test's store on port, which rank 0 serves; 20 s timeouts.
std::shared_ptr<TCPStore> rank_store(int rank, int world, int port) {
  TCPStoreOptions options;
  options.port = port;
  options.is_server = rank == 0;
  options.world_size = world;
  options.rank = rank;
  options.timeout = 20s;
  return std::make_shared<TCPStore>(options);
}

// Work::wait's contract after a wait that failed with `first`: a second wait throws the same
// error at once, and the work counts as completed.
void expect_failed_for_good(Work& work, const std::string& first, int rank) {
  const auto again = std::chrono::steady_clock::now();
  try {
    work.wait();
    expect(false, "rank ", rank, ": a second wait returned");
  } catch (const TimeoutError& e) {
    expect(first == e.what(), "rank ", rank, ": the second wait threw another error: ", e.what());
  } catch (const std::exception& e) {
    expect(false, "rank ", rank, ": the second wait threw another kind of error: ", e.what());
  }
  expect(milliseconds_since(again) < 100, "rank ", rank, ": the second wait took ", milliseconds_since(again), " ms");
  expect(!first.empty() && work.is_completed(), "rank ", rank, ": not completed after its wait failed");
}

// A Gloo group of the test's ranks on port's store, its keys under prefix, with or without shm
// fingerprints of its own.
std::shared_ptr<ProcessGroup> gloo_group(const std::shared_ptr<TCPStore>& store, int rank, int world, int port,
                                         std::chrono::milliseconds timeout, const std::string& prefix = "",
                                         bool fingerprints_over_shm = false) {
  GlooOptions gloo;
  gloo.rank = rank;
  gloo.world_size = world;
  gloo.master_port = port;
  gloo.timeout = timeout;
  gloo.store_prefix = prefix;
  gloo.fingerprints_over_shm = fingerprints_over_shm;
  return make_gloo_process_group(store, gloo);
}

// A matching all_reduce gives the exact sum: the ranks are in step on pg.
void expect_in_step(ProcessGroup& pg, int rank, int world) {
  Tensor t = Tensor::full({3}, static_cast<float>(rank + 1));
  pg.all_reduce(t)->wait();
  expect_floats(t, std::vector<double>(3, world * (world + 1) / 2.0), "all_reduce after a mismatch");
}

}  // namespace

TEST_CASE("Max and Min propagate a NaN whichever rank holds it (torch.maximum)") {
  on_2_and_4_ranks([](int rank, int world, int port) {
    auto pg = testing::join(rank, world, port);
    const int last = world - 1;
    // element 0: NaN on rank 0 only; 1: NaN on the last rank only; 2: rank + 1; 3: NaN everywhere;
    // 4: -inf on rank 0, +inf elsewhere.
    auto input = [&] {
      return Tensor::from_vector({rank == 0 ? kNaN : 1.0f, rank == last ? kNaN : 1.0f,
                                  static_cast<float>(rank + 1), kNaN, rank == 0 ? -INFINITY : INFINITY});
    };
    Tensor mx = input(), mn = input();
    pg->all_reduce(mx, ReduceOp::Max)->wait();
    pg->all_reduce(mn, ReduceOp::Min)->wait();
    expect_floats(mx, {NAN, NAN, double(world), NAN, INFINITY}, "max");
    expect_floats(mn, {NAN, NAN, 1.0, NAN, -INFINITY}, "min");

    // A long tensor goes through the backends' chunked paths: NaN only in the last element, on rank 1.
    const int64_t n = 65537;
    Tensor big = testing::make_tensor(DType::Float32, n, [&](int64_t i) {
      return rank == 1 && i == n - 1 ? std::numeric_limits<double>::quiet_NaN() : double(rank + 1);
    });
    pg->all_reduce(big, ReduceOp::Max)->wait();
    const std::vector<float> v = big.to_vector();
    for (int64_t i = 0; i < n - 1; ++i) expect(v[i] == world, "big max: element ", i, " is ", v[i]);
    expect(std::isnan(v[n - 1]), "big max: the NaN of rank 1 was lost: ", v[n - 1]);

    // reduce_scatter uses the same reduction: rank r's slice j is [NaN if r == j else r + 1].
    std::vector<Tensor> inputs;
    for (int j = 0; j < world; ++j)
      inputs.push_back(Tensor::from_vector({rank == j ? kNaN : float(rank + 1), 1.0f}));
    Tensor out = Tensor::zeros({2});
    pg->reduce_scatter(out, inputs, ReduceOp::Min)->wait();
    expect_floats(out, {NAN, 1.0}, "reduce_scatter(min)");
    testing::leave();
  });
}

TEST_CASE("works complete in issue order, and a barrier completes every earlier work") {
  for (bool check : {true, false}) {
    CAPTURE(check);
    on_2_and_4_ranks([check](int rank, int world, int port) {
      auto pg = testing::join(rank, world, port, 30s, check);
      const double sum = world * (world + 1) / 2.0;
      // Nobody waits on these two; the Works are dropped at once.
      Tensor avg = Tensor::full({1 << 16}, static_cast<float>(rank + 1));
      Tensor total = Tensor::full({5}, static_cast<float>(rank + 1));
      pg->all_reduce(avg, ReduceOp::Avg);
      pg->all_reduce(total, ReduceOp::Sum);
      pg->barrier()->wait();
      const std::vector<float> a = avg.to_vector();
      for (size_t i = 0; i < a.size(); ++i)
        expect(a[i] == (world + 1) / 2.0f, "after barrier: avg[", i, "] = ", a[i], ", want ",
               (world + 1) / 2.0);
      expect_floats(total, std::vector<double>(5, sum), "after barrier: sum");

      // Waiting on a later work completes the earlier one first.
      Tensor first = Tensor::full({1 << 18}, static_cast<float>(rank + 1));
      Tensor second = Tensor::full({2}, static_cast<float>(rank + 1));
      auto first_work = pg->all_reduce(first, ReduceOp::Avg);
      auto second_work = pg->all_reduce(second);
      second_work->wait();
      expect(first_work->is_completed(), "the later work completed before the earlier one");
      expect(first.to_vector()[12345] == (world + 1) / 2.0f,
             "the earlier avg is not final: ", first.to_vector()[12345]);

      // A collective call never waits for the peers, check or no check (Note [Deferred
      // check]): rank 0 issues three while the others are still 400 ms away, as DDP's hooks
      // issue bucket after bucket during backward. Polling alone then finishes them.
      if (rank != 0) std::this_thread::sleep_for(400ms);
      std::vector<Tensor> buckets;
      for (int b = 0; b < 3; ++b) buckets.push_back(Tensor::full({1000 * (b + 1)}, static_cast<float>(rank + 1)));
      const auto issued = std::chrono::steady_clock::now();
      std::vector<std::shared_ptr<Work>> works;
      for (Tensor& bucket : buckets) works.push_back(pg->all_reduce(bucket));
      const double issue_ms = milliseconds_since(issued);
      if (rank == 0) expect(issue_ms < 200, "issuing 3 all_reduces took ", issue_ms, " ms: a call waited for the peers");
      for (auto& work : works)
        while (!work->is_completed()) {
          expect(milliseconds_since(issued) < 20000, "polling is_completed() never finished the all_reduce");
          std::this_thread::yield();
        }
      for (const Tensor& bucket : buckets)
        expect_floats(bucket, std::vector<double>(bucket.numel(), sum), "polled all_reduce");
      testing::leave();
    });
  }
}

namespace {

// Every way ranks can call different collectives, each on a fresh checked group (fresh()) over
// one backend: the call fails on every rank with the same DistError, the group refuses every
// later collective (Note [Out of step]), and the backend, which started none of them, is still
// in step: a last fresh group's all_reduce gives the exact sum.
void expect_every_mismatch_caught(const std::function<std::shared_ptr<ProcessGroup>()>& fresh, int rank,
                                  int world) {
  // Runs mismatch on a fresh group, whose first collective is #1, then a refused all_reduce.
  const auto mismatched = [&](const std::function<void(ProcessGroup&)>& mismatch) {
    const std::shared_ptr<ProcessGroup> pg = fresh();
    mismatch(*pg);
    testing::expect_out_of_step(*pg, rank, "#1 (rank 0: ");
  };
  // 1. Sizes (Gloo by itself would abort the process): rank 0 reduces 64000 floats, the others
  // 32000.
  mismatched([&](ProcessGroup& pg) {
    Tensor t = Tensor::zeros({rank == 0 ? 64000 : 32000});
    expect_mismatch(
        [&] { pg.all_reduce(t)->wait(); },
        {"all_reduce(sum) #1", "rank 0: all_reduce(sum) #1, 64000 float32",
         "rank 1: all_reduce(sum) #1, 32000 float32", "rank " + std::to_string(world - 1) + ": all_reduce"},
        rank);
  });
  // 2. 3 vs 2 elements (Gloo by itself would report half-reduced data as success).
  mismatched([&](ProcessGroup& pg) {
    Tensor small = Tensor::ones({rank == 0 ? 3 : 2});
    expect_mismatch([&] { pg.all_reduce(small)->wait(); },
                    {"rank 0: all_reduce(sum) #1, 3 float32", "rank 1: all_reduce(sum) #1, 2 float32"}, rank);
    expect(small.to_vector() == std::vector<float>(small.numel(), 1.0f), "rank ", rank, ": data changed");
  });
  // 3. dtypes, 4. ops, 5. collectives, 6. broadcast roots.
  mismatched([&](ProcessGroup& pg) {
    Tensor typed = rank == 0 ? Tensor::zeros({4}, DType::Int64) : Tensor::zeros({4});
    expect_mismatch([&] { pg.all_reduce(typed)->wait(); },
                    {"rank 0: all_reduce(sum) #1, 4 int64", "rank 1: all_reduce(sum) #1, 4 float32"}, rank);
  });
  Tensor x = Tensor::ones({4});
  mismatched([&](ProcessGroup& pg) {
    expect_mismatch([&] { pg.all_reduce(x, rank == 0 ? ReduceOp::Max : ReduceOp::Sum)->wait(); },
                    {"rank 0: all_reduce(max) #1, 4 float32", "rank 1: all_reduce(sum) #1, 4 float32"}, rank);
  });
  mismatched([&](ProcessGroup& pg) {
    expect_mismatch(
        [&] {
          if (rank == 0)
            pg.barrier()->wait();
          else
            pg.all_reduce(x)->wait();
        },
        {"rank 0: barrier #1", "rank 1: all_reduce(sum) #1, 4 float32"}, rank);
  });
  mismatched([&](ProcessGroup& pg) {
    expect_mismatch([&] { pg.broadcast(x, rank == 0 ? 0 : 1)->wait(); },
                    {"rank 0: broadcast from rank 0 #1", "rank 1: broadcast from rank 1 #1"}, rank);
  });
  // 7. The last rank ran out of batches and reaches its next, smaller collective (a metric)
  // while the others still reduce gradients; and it makes one call fewer than they do: their
  // next all_reduce, of 2 floats as its metric, would otherwise pair with it.
  mismatched([&](ProcessGroup& pg) {
    Tensor grads = Tensor::ones({1000});
    if (rank == world - 1) {
      Tensor metric = Tensor::ones({2});
      expect_mismatch([&] { pg.all_reduce(metric)->wait(); },
                      {"rank 0: all_reduce(sum) #1, 1000 float32",
                       "rank " + std::to_string(world - 1) + ": all_reduce(sum) #1, 2 float32"},
                      rank);
    } else {
      expect_mismatch([&] { pg.all_reduce(grads)->wait(); }, {"all_reduce(sum) #1", "2 float32"}, rank);
    }
  });
  expect_in_step(*fresh(), rank, world);
}

}  // namespace

TEST_CASE(
    "ranks that call different collectives all get a DistError naming each call, and the group no more") {
  on_2_and_4_ranks([](int rank, int world, int port) {
    // On Gloo with every rank on this machine, the fingerprints travel through shared memory
    // (Note [Shared-memory fingerprints] in dist/host_fingerprints.cpp); a file's rerun on shm
    // or under mpirun checks that backend.
    const bool joined = testing::under_mpirun() || std::getenv("NANODDP_TEST_BACKEND") != nullptr;
    std::shared_ptr<ProcessGroup> backend;
    if (joined) {
      backend = testing::join(rank, world, port, 20s, /*check_collectives=*/false);
    } else {
      backend = gloo_group(rank_store(rank, world, port), rank, world, port, 20s, "",
                           /*fingerprints_over_shm=*/true);
    }
    expect_every_mismatch_caught([&] { return make_checked_process_group(backend, 20s); }, rank, world);
    backend.reset();
    if (joined) testing::leave();
  });
}

TEST_CASE("gloo: the same with the fingerprints over Gloo's sockets, as between machines") {
  on_2_and_4_ranks([](int rank, int world, int port) {
    if (testing::under_mpirun()) return;
    auto backend = gloo_group(rank_store(rank, world, port), rank, world, port, 20s);
    expect_every_mismatch_caught([&] { return make_checked_process_group(backend, 20s); }, rank, world);
  });
}

namespace {

// Throws from the next all_reduce on the ranks where `fails` is set, as a backend refusing its
// tensor does, after every rank agreed on the call.
class FailingStartGroup : public testing::ForwardingGroup {
 public:
  using ForwardingGroup::ForwardingGroup;
  std::shared_ptr<Work> all_reduce(Tensor& t, ReduceOp op) override {
    if (!fails) return inner_->all_reduce(t, op);
    fails = false;
    NANODDP_THROW(DistError, "all_reduce: injected refusal of the tensor");
  }
  bool fails = false;
};

}  // namespace

TEST_CASE("a call every rank agreed on that could not start on one rank: that rank takes no more collectives") {
  // The others started it and wait for this rank, which must not go on to pair its next call
  // with theirs (Note [Out of step]): they fail (a timeout, or the rank gone), it refuses.
  if (testing::under_mpirun()) return;
  const int port = testing::free_port();
  const std::string result = testing::on_ranks(2, [&](int rank) {
    auto failing = std::make_shared<FailingStartGroup>(gloo_group(rank_store(rank, 2, port), rank, 2, port, 2s));
    auto pg = make_checked_process_group(failing, 2s);
    failing->fails = rank == 1;
    Tensor t = Tensor::ones({4});
    std::string first;
    try {
      pg->all_reduce(t)->wait();
    } catch (const TimeoutError& e) {
      first = std::string("timeout: ") + e.what();
    } catch (const DistError& e) {
      first = e.what();
    }
    if (rank == 1) {
      expect(first.find("injected refusal") != std::string::npos, "rank 1: ", first);
      Tensor next = Tensor::ones({4});
      std::string refused;
      try {
        pg->all_reduce(next)->wait();
      } catch (const DistError& e) {
        refused = e.what();
      }
      expect(refused.find("takes no more collectives since this rank could not start all_reduce(sum) #1, 4 "
                          "float32, which every rank agreed on and the others started") != std::string::npos,
             "rank 1: ", refused);
    } else {  // a timeout, or rank 1 named as lost once it has gone: an error, never a result
      expect(!first.empty(), "rank 0: the all_reduce returned, though rank 1 never started it");
    }
  });
  CHECK_MESSAGE(result.empty(), result);
}

namespace {

// The backend, as the check sees it: counts the calls that ask it to issue held-back send/recv.
class FlushCountingGroup : public testing::ForwardingGroup {
 public:
  using ForwardingGroup::ForwardingGroup;
  void issue_queued_point_to_point() override { ++flushes; }
  std::atomic<int> flushes{0};
};

// Holds send/recv back and issues them as one group, as NCCL's group does (Note [NCCL
// point-to-point]): at issue_queued_point_to_point(), and first thing in a collective unless
// the collective check's worker starts it later than its call (CollectiveCalledEarlier). The
// send/recv themselves go nowhere: the test looks at how they were grouped.
class GroupingGroup : public testing::ForwardingGroup {
 public:
  using ForwardingGroup::ForwardingGroup;
  std::shared_ptr<Work> send(const Tensor&, int, int) override { return queue(); }
  std::shared_ptr<Work> recv(Tensor&, int, int) override { return queue(); }
  void issue_queued_point_to_point() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (queued_ > 0) groups_.push_back(queued_);
    queued_ = 0;
  }
  std::shared_ptr<Work> all_reduce(Tensor& t, ReduceOp op) override {
    if (!dist::detail::CollectiveCalledEarlier::active()) issue_queued_point_to_point();
    return inner_->all_reduce(t, op);
  }
  std::vector<int> groups() {
    std::lock_guard<std::mutex> lock(mutex_);
    return groups_;
  }

 private:
  std::shared_ptr<Work> queue() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++queued_;
    return std::make_shared<CompletedWork>();
  }
  std::mutex mutex_;
  int queued_ = 0;
  std::vector<int> groups_;  // the size of each group issued
};

// A checked Gloo group whose fingerprints travel through a CPU group of their own, as init
// gives an NCCL group (Note [Host fingerprints] in dist/process_group_checked.cpp): Gloo, like
// NCCL, runs its collectives on its own and apart from send/recv. The fingerprint group is shm
// when fingerprints_over_gloo is false (one machine), else Gloo's sockets (across machines).
struct BesideChecked {
  std::shared_ptr<ProcessGroup> inner, fingerprints, checked;
  std::shared_ptr<FlushCountingGroup> backend;  // inner, watched
};
BesideChecked checked_beside(std::shared_ptr<TCPStore> store, int rank, int world, int port,
                             std::chrono::milliseconds timeout, bool fingerprints_over_gloo) {
  BesideChecked groups;
  groups.inner = gloo_group(store, rank, world, port, timeout, "inner/");
  if (fingerprints_over_gloo) {
    groups.fingerprints = gloo_group(store, rank, world, port, timeout, "fingerprints/gloo/");
  } else {
    groups.fingerprints = make_host_fingerprint_group(store, "fingerprints/", rank, world, "127.0.0.1", port, timeout);
  }
  groups.backend = std::make_shared<FlushCountingGroup>(groups.inner);
  groups.checked = make_checked_process_group(groups.backend, timeout, groups.fingerprints);
  return groups;
}

}  // namespace

TEST_CASE("with the fingerprints in a CPU group beside the backend (as on NCCL), every mismatch is caught the same") {
  for (const bool over_gloo : {false, true}) {
    CAPTURE(over_gloo);
    on_2_and_4_ranks([over_gloo](int rank, int world, int port) {
      if (testing::under_mpirun()) return;
      auto store = rank_store(rank, world, port);
      const BesideChecked groups = checked_beside(store, rank, world, port, 20s, over_gloo);
      expect(groups.fingerprints != nullptr && groups.fingerprints->backend_name() == (over_gloo ? "gloo" : "shm"),
             "rank ", rank, ": no fingerprint group of the kind asked for");
      expect_every_mismatch_caught(
          [&] { return make_checked_process_group(groups.backend, 20s, groups.fingerprints); }, rank, world);
      // The backend saw only the collective that ran (the last all_reduce); the eight exchanges
      // (seven mismatches, that all_reduce) went through the fingerprint group, and the refused
      // calls made none.
      const CollectiveCount gathered = groups.inner->count(Collective::AllGather),
                            reduced = groups.inner->count(Collective::AllReduce),
                            exchanged = groups.fingerprints->count(Collective::AllGather);
      expect(gathered.calls == 0 && reduced.calls == 1 && exchanged.calls == 8, "rank ", rank,
             ": the backend ran ", gathered.calls, " all_gathers and ", reduced.calls,
             " all_reduces (want 0 and 1); the fingerprint group ", exchanged.calls, " all_gathers (want 8)");
    });
  }
}

TEST_CASE("with the fingerprints in a CPU group beside the backend, collectives start without anyone waiting") {
  // Note [Host fingerprints]: the check's worker starts each collective once the fingerprints
  // agree (an NCCL bucket's all_reduce is launched while backward goes on), and held-back
  // send/recv go out at the call.
  on_2_and_4_ranks([](int rank, int world, int port) {
    if (testing::under_mpirun()) return;
    auto store = rank_store(rank, world, port);
    const BesideChecked groups = checked_beside(store, rank, world, port, 20s, /*fingerprints_over_gloo=*/false);
    Tensor a = Tensor::full({3}, static_cast<float>(rank + 1)), b = Tensor::full({4}, 1.0f);
    auto first = groups.checked->all_reduce(a);
    auto second = groups.checked->all_reduce(b);
    expect(groups.backend->flushes == 2, "rank ", rank, ": the backend was asked to issue its held-back send/recv ",
           groups.backend->flushes.load(), " times at 2 calls");
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (groups.inner->count(Collective::AllReduce).calls < 2 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(1ms);
    expect(groups.inner->count(Collective::AllReduce).calls == 2, "rank ", rank, ": ",
           groups.inner->count(Collective::AllReduce).calls, " of 2 all_reduces started before any wait");
    first->wait();
    second->wait();
    expect_floats(a, std::vector<double>(3, world * (world + 1) / 2.0), "first all_reduce");
    expect_floats(b, std::vector<double>(4, world), "second all_reduce");
  });
}

TEST_CASE("with the fingerprints beside the backend, send/recv called after a collective go out as one group") {
  // The worker starts the all_reduce while this rank is between its send and its recv; the
  // two must still go out together (were they split, both ranks' sends would wait for recvs
  // queued behind them: Note [NCCL point-to-point]).
  on_2_and_4_ranks([](int rank, int world, int port) {
    if (testing::under_mpirun()) return;
    auto store = rank_store(rank, world, port);
    const auto inner = gloo_group(store, rank, world, port, 20s);
    auto grouping = std::make_shared<GroupingGroup>(inner);
    auto checked = make_checked_process_group(
        grouping, 20s, make_host_fingerprint_group(store, "fingerprints/", rank, world, "127.0.0.1", port, 20s));
    Tensor a = Tensor::ones({3}), out = Tensor::ones({4}), in = Tensor::zeros({4});
    const int peer = (rank + 1) % world;
    if (rank == world - 1) std::this_thread::sleep_for(100ms);  // the last to call: the others wait for it
    auto reduced = checked->all_reduce(a);
    checked->send(out, peer);
    // Host work between the two calls, during which the worker starts the all_reduce.
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (inner->count(Collective::AllReduce).calls == 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(1ms);
    expect(inner->count(Collective::AllReduce).calls == 1, "rank ", rank, ": the all_reduce never started");
    checked->recv(in, (rank + world - 1) % world);
    grouping->issue_queued_point_to_point();  // what a wait on them does
    reduced->wait();
    expect_floats(a, std::vector<double>(3, world), "all_reduce");
    const std::vector<int> sizes = grouping->groups();
    std::string seen;
    for (int n : sizes) seen += std::to_string(n) + " ";
    expect(sizes == std::vector<int>{2}, "rank ", rank, ": send and recv went out in groups of sizes ", seen);
  });
}

TEST_CASE("with the fingerprints beside the backend, destroying the group does not wait for an exchange under way") {
  on_2_and_4_ranks([](int rank, int world, int port) {
    if (testing::under_mpirun()) return;
    auto store = rank_store(rank, world, port);
    BesideChecked groups = checked_beside(store, rank, world, port, 3s, /*fingerprints_over_gloo=*/false);
    if (rank != 0) {
      std::this_thread::sleep_for(1500ms);  // alive, but never calls the all_reduce
      return;
    }
    Tensor a = Tensor::ones({3});
    auto never_matched = groups.checked->all_reduce(a);
    // The worker is in the exchange once it has issued its all_gather there.
    const auto in_exchange = std::chrono::steady_clock::now() + 10s;
    while (groups.fingerprints->count(Collective::AllGather).calls == 0 && std::chrono::steady_clock::now() < in_exchange)
      std::this_thread::sleep_for(1ms);
    expect(groups.fingerprints->count(Collective::AllGather).calls == 1, "rank 0: the exchange never began");
    const auto start = std::chrono::steady_clock::now();
    groups.checked.reset();
    expect(milliseconds_since(start) < 500, "rank 0: destroying the group took ", milliseconds_since(start), " ms");
    // The exchange ends when the peers exit (or by the timeout), and the call is never started.
    try {
      never_matched->wait();
      expect(false, "rank 0: a call no peer made completed");
    } catch (const DistError&) {
    }
    expect(groups.inner->count(Collective::AllReduce).calls == 0, "rank 0: the backend started the all_reduce");
  });
}

TEST_CASE("a fingerprint group beside shm is refused: shm runs collectives and send/recv in one order") {
  if (testing::under_mpirun()) return;
  TCPStoreOptions options;
  options.port = 0;  // a free one
  options.is_server = true;
  options.world_size = 1;
  options.rank = 0;
  auto store = std::make_shared<TCPStore>(options);
  ShmOptions inner, beside;
  inner.store_prefix = "inner/";
  beside.store_prefix = "beside/";
  try {
    make_checked_process_group(make_shm_process_group(store, inner), 1s, make_shm_process_group(store, beside));
    FAIL("accepted");
  } catch (const ValueError& e) {
    CHECK_MESSAGE(std::string(e.what()).find("a shm group runs its collectives and send/recv in one order") !=
                      std::string::npos,
                  e.what());
  }
}

TEST_CASE("with the fingerprints in a CPU group beside the backend, a lost peer is named in the check's words") {
  on_2_and_4_ranks([](int rank, int world, int port) {
    if (testing::under_mpirun()) return;
    auto store = rank_store(rank, world, port);
    const BesideChecked groups = checked_beside(store, rank, world, port, 20s, /*fingerprints_over_gloo=*/false);
    groups.checked->barrier()->wait();
    if (rank == world - 1) std::_Exit(0);  // gone without a word, as a killed rank
    Tensor t = Tensor::ones({4});
    try {
      groups.checked->all_reduce(t)->wait();
      expect(false, "rank ", rank, ": the all_reduce returned without rank ", world - 1);
    } catch (const DistError& e) {
      const std::string what = e.what();
      expect(what.find("all_reduce(sum) of [4] float32") != std::string::npos &&
                 what.find("the collective check's fingerprint exchange (through shared memory) failed") !=
                     std::string::npos &&
                 what.find("shm all_gather") == std::string::npos,
             "rank ", rank, ": the error does not read as the check's exchange for the all_reduce: ", what);
    }
  });
}

TEST_CASE("with the fingerprints in a CPU group beside the backend, a peer that never calls is named by the timeout") {
  on_2_and_4_ranks([](int rank, int world, int port) {
    if (testing::under_mpirun()) return;
    auto store = rank_store(rank, world, port);
    const BesideChecked groups = checked_beside(store, rank, world, port, 1500ms, /*fingerprints_over_gloo=*/false);
    // A fingerprint group of other ranks is refused, naming both.
    ShmOptions solo;
    solo.store_prefix = "solo/" + std::to_string(rank) + "/";
    bool refused = false;
    try {
      make_checked_process_group(groups.inner, 1500ms, make_shm_process_group(store, solo));
    } catch (const ValueError& e) {
      refused = std::string(e.what()).find("rank 0/1 on cpu) is not a CPU group of the checked group's ranks (rank " +
                                           std::to_string(rank) + "/" + std::to_string(world)) != std::string::npos;
      expect(refused, "rank ", rank, ": the refusal does not name both groups: ", e.what());
    }
    expect(refused, "rank ", rank, ": a fingerprint group of one rank was accepted for a group of ", world);
    if (rank == 1) {
      std::this_thread::sleep_for(4s);  // alive, but never calls all_reduce
      return;
    }
    Tensor t = Tensor::ones({4});
    const auto start = std::chrono::steady_clock::now();
    const std::shared_ptr<Work> work = groups.checked->all_reduce(t);
    std::string first;
    try {
      work->wait();
      expect(false, "rank ", rank, ": wait returned without rank 1");
    } catch (const TimeoutError& e) {
      first = e.what();
      const double ms = milliseconds_since(start);
      expect(ms >= 1400 && ms < 3500, "rank ", rank, ": the wait ended after ", ms, " ms, want ~1500: ", e.what());
      expect(first.find("straggler: rank 1 never reached all_reduce(sum) #1") != std::string::npos, "rank ", rank,
             ": the error does not name rank 1 as the straggler: ", e.what());
    }
    expect(t.to_vector() == std::vector<float>(4, 1.0f), "rank ", rank, ": the data changed");
    expect_failed_for_good(*work, first, rank);
  });
}

TEST_CASE("a peer that never calls the collective ends every wait by the group's timeout, and is named") {
  // wait() with no argument (default 5 minutes) must end by the group's 1.5 s (plus the
  // second in which the waiting ranks find who never came: Note [Naming the straggler]).
  on_2_and_4_ranks([](int rank, int world, int port) {
    if (testing::under_mpirun()) return;  // MPI: the case below, in a job of its own
    auto pg = testing::join(rank, world, port, 1500ms);
    if (rank == 1) {
      std::this_thread::sleep_for(4s);  // alive, but never calls all_reduce
      return;
    }
    Tensor t = Tensor::ones({4});
    const auto start = std::chrono::steady_clock::now();
    const std::shared_ptr<dist::Work> work = pg->all_reduce(t);
    try {
      work->wait();
      expect(false, "rank ", rank, ": wait returned without rank 1");
    } catch (const DistError& e) {
      const double ms = milliseconds_since(start);
      expect(ms >= 1400 && ms < 3500, "rank ", rank, ": the wait ended after ", ms,
             " ms, want ~1500: ", e.what());
      expect(dynamic_cast<const TimeoutError*>(&e) != nullptr, "rank ", rank, ": not a TimeoutError: ", e.what());
      expect(std::string(e.what()).find("straggler: rank 1 never reached all_reduce(sum) #1") != std::string::npos,
             "rank ", rank, ": the error does not name rank 1 as the straggler: ", e.what());
    }
    // Work::wait's contract: a second wait throws the same error at once, and the work is
    // completed (it had waited another timeout on MPI, returned success on Gloo).
    std::string first;
    try {
      work->wait();
    } catch (const TimeoutError& e) {
      first = e.what();
    }
    expect_failed_for_good(*work, first, rank);
  });
}

TEST_CASE("a timeout of milliseconds::max() means none: the group, its waits and the store work as usual") {
  // Note [Long timeouts]: added to a clock's nanoseconds such a timeout is a deadline in the
  // past, and as poll's int milliseconds it wraps; every deadline and poll must saturate.
  on_2_and_4_ranks([](int rank, int world, int port) {
    constexpr auto kNever = std::chrono::milliseconds::max();
    auto pg = testing::join(rank, world, port, kNever);
    if (rank == 1) std::this_thread::sleep_for(300ms);  // the others wait for it, and keep waiting
    Tensor t = Tensor::full({5}, static_cast<float>(rank + 1));
    pg->all_reduce(t)->wait(kNever);
    expect_floats(t, std::vector<double>(5, world * (world + 1) / 2.0), "all_reduce with no timeout");
    pg->barrier()->wait();
    if (!testing::under_mpirun()) {  // MPI's group has no store
      Store& store = pg->store();
      if (rank == 0) {
        std::this_thread::sleep_for(200ms);
        store.set("late", std::string("1"));
      }
      store.wait({"late"}, kNever);
      expect(store.get_string("late") == "1", "rank ", rank, ": the store's value");
    }
    pg->barrier()->wait(kNever);
    testing::leave();
  });
}

TEST_CASE(
    "the counters count each call once, with the collective check off too; a call refused for its arguments "
    "is not counted") {
  for (const bool check : {true, false}) {
    CAPTURE(check);
    on_2_and_4_ranks([check](int rank, int world, int port) {
      if (testing::under_mpirun()) return;
      auto pg = testing::join(rank, world, port, 30s, check);
      Tensor floats = Tensor::ones({10});
      Tensor ints = Tensor::zeros({3}, DType::Int64);
      pg->all_reduce(floats)->wait();
      pg->broadcast(ints, 0)->wait();
      bool refused = false;
      try {
        pg->broadcast(ints, world + 5);
      } catch (const ValueError&) {
        refused = true;
      }
      expect(refused, "rank ", rank, ": a broadcast from rank ", world + 5, " was not refused");
      pg->barrier()->wait();
      const dist::CollectiveCount all_reduce = pg->count(dist::Collective::AllReduce),
                                  broadcast = pg->count(dist::Collective::Broadcast),
                                  barrier = pg->count(dist::Collective::Barrier);
      expect(all_reduce.calls == 1 && all_reduce.bytes == 40, "rank ", rank, ": all_reduce counted ",
             all_reduce.calls, " calls, ", all_reduce.bytes, " bytes; want 1, 40");
      expect(broadcast.calls == 1 && broadcast.bytes == 24, "rank ", rank, ": broadcast counted ",
             broadcast.calls, " calls, ", broadcast.bytes, " bytes; want 1, 24");
      expect(barrier.calls == 1, "rank ", rank, ": barrier counted ", barrier.calls, " calls");
      pg->reset_counts();
      expect(pg->count(dist::Collective::AllReduce).calls == 0, "rank ", rank, ": reset_counts left calls");
    });
  }
}

TEST_CASE("the mismatch and timeout cases pass on the shm backend too (this file with NANODDP_TEST_BACKEND=shm)") {
  // On shm a wait that times out aborts the segment for every rank; the ranks it wakes must
  // still fail with a TimeoutError, for the check to name the rank that never came.
  if (testing::under_mpirun() || std::getenv("NANODDP_TEST_BACKEND") != nullptr) return;
  const testing::RunResult r = testing::rerun_with_backend(
      "tests/test_collective_edges", "shm",
      "'--test-case=ranks that call different*,a peer that never calls*,the counters count*,a timeout of*'",
      std::chrono::seconds(120));
  CHECK_MESSAGE(r.code() == 0, "shm run failed:\n", r.out, r.err);
}

TEST_CASE("gloo: ranks that disagree on the collective check are told to run with the same setting") {
  if (testing::under_mpirun()) return;
  const int port = testing::free_port();
  const std::string failures = testing::on_ranks(2, [&](int rank) {
    if (rank == 1) {  // unchecked: it makes no shared-memory channel for the fingerprints
      auto pg = testing::join(rank, 2, port, 1500ms, /*check_collectives=*/false);
      std::this_thread::sleep_for(2500ms);  // keeps the store's clients company while rank 0 waits
      return;
    }
    try {
      testing::join(rank, 2, port, 1500ms, /*check_collectives=*/true);
      expect(false, "rank 0: init_process_group returned with rank 1 unchecked");
    } catch (const TimeoutError& e) {
      expect(std::string(e.what()).find("every rank must run with the same NANODDP_CHECK_COLLECTIVES") !=
                 std::string::npos,
             "rank 0: the timeout does not name the setting: ", e.what());
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("gloo: a rank that never joins ends init_process_group by the timeout") {
  if (testing::under_mpirun()) return;
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::run_ranks(world, [&](int rank) {
      if (rank == world - 1) return;  // never joins
      const auto start = std::chrono::steady_clock::now();
      try {
        testing::join(rank, world, port, 1500ms);
        expect(false, "rank ", rank, ": init_process_group returned without the last rank");
      } catch (const DistError& e) {
        const double ms = milliseconds_since(start);
        expect(ms < 4000, "rank ", rank, ": init took ", ms, " ms with a 1.5 s timeout: ", e.what());
      }
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("a rank that starts late, within the timeout, still joins the group") {
  // Gloo's mesh connect once waited only a fifth of the timeout for the peers' addresses.
  if (testing::under_mpirun()) return;
  const int port = testing::free_port();
  const std::string failures = testing::run_ranks(2, [&](int rank) {
    if (rank == 1) std::this_thread::sleep_for(1200ms);  // 3/5 of the timeout
    auto pg = testing::join(rank, 2, port, 2000ms);
    Tensor t = Tensor::full({3}, static_cast<float>(rank + 1));
    pg->all_reduce(t)->wait();
    expect(t.to_vector() == std::vector<float>{3, 3, 3}, "rank ", rank, ": the sum after a late join is wrong");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

// Started by the case below inside `mpirun -np N`: rank 1 never calls the all_reduce.
TEST_CASE("mpi timeout child: a peer that never calls the collective") {
  if (std::getenv("NANODDP_EDGE_TIMEOUT_CHILD") == nullptr) return;
  auto pg = testing::join(0, 0, 0, 2000ms);
  if (pg->rank() == 1) {
    // Then exit, MPI_Finalize included. Long past the others' 2 s timeout: a rank slowed down
    // (ASan on a busy machine) must still report it before this exit ends the job.
    std::this_thread::sleep_for(6s);
    return;
  }
  Tensor t = Tensor::ones({4});
  const auto start = std::chrono::steady_clock::now();
  try {
    pg->all_reduce(t)->wait();  // default argument: 5 minutes; the group says 2 s
    std::printf("rank %d: no error\n", pg->rank());
  } catch (const TimeoutError& e) {
    std::printf("rank %d: TimeoutError after %.0f ms: %s\n", pg->rank(), milliseconds_since(start), e.what());
  } catch (const DistError& e) {
    std::printf("rank %d: DistError after %.0f ms: %s\n", pg->rank(), milliseconds_since(start), e.what());
  }
  std::fflush(stdout);
  // The first rank to exit without MPI_Finalize makes mpirun stop the others: give every
  // rank time to report first.
  std::this_thread::sleep_for(2s);
}

TEST_CASE("the collective edge cases pass on MPI too (this file under mpirun -np 2 and -np 4)") {
  if (testing::under_mpirun()) return;
  if (!testing::have_mpirun()) {
    MESSAGE("mpirun not found: the MPI half of this file did not run");
    return;
  }
  for (int np : {2, 4}) {
    CAPTURE(np);
    const testing::RunResult r =
        testing::mpirun_self("tests/test_collective_edges", np, "--test-case-exclude='*mpirun*,*child*'");
    CHECK_MESSAGE(r.code() == 0, "mpirun -np ", np, " failed (every rank must exit 0, none by a signal):\n",
                  r.out, r.err);
  }
  // Timeouts: every rank other than 1 must give up by the group's 2 s, and the job must end
  // soon after (no rank stuck in MPI_Finalize). mpirun reports failure: a rank timed out.
  for (int np : {2, 4}) {
    CAPTURE(np);
    ::setenv("NANODDP_EDGE_TIMEOUT_CHILD", "1", 1);
    const testing::RunResult r =
        testing::mpirun_self("tests/test_collective_edges", np, "--test-case='*timeout child*'", 60s);
    ::unsetenv("NANODDP_EDGE_TIMEOUT_CHILD");
    CHECK_MESSAGE(r.seconds < 30, "the job took ", r.seconds, " s to end after a 2 s timeout:\n", r.out,
                  r.err);
    for (int rank = 0; rank < np; ++rank) {
      if (rank == 1) continue;
      const std::string prefix = "rank " + std::to_string(rank) + ": TimeoutError after ";
      const size_t at = r.out.find(prefix);
      REQUIRE_MESSAGE(at != std::string::npos, "rank ", rank, " reported no TimeoutError:\n", r.out, r.err);
      const double ms = std::atof(r.out.c_str() + at + prefix.size());
      CHECK_MESSAGE((ms >= 1900 && ms < 5000), "rank ", rank, " timed out after ", ms, " ms, want ~2000");
    }
  }
}

TEST_CASE("ranks that chose different backends are told at once, on every rank, instead of timing out") {
  // Rank 0 Gloo, the others shm: each would wait for its own backend's rendezvous keys.
  if (testing::under_mpirun() || std::getenv("NANODDP_TEST_BACKEND") != nullptr) return;  // chooses its own
  for (int world : {2, 3}) {
    CAPTURE(world);
    const int port = testing::free_port();
    const std::string failures = testing::on_ranks(world, [&](int rank) {
      dist::InitOptions options;
      options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
      options.rank = rank;
      options.world_size = world;
      options.timeout = 30s;
      options.backend = rank == 0 ? dist::Backend::Gloo : dist::Backend::Shm;
      const auto start = std::chrono::steady_clock::now();
      std::string what;
      try {
        dist::init_process_group(options);
      } catch (const TimeoutError& e) {
        what = std::string("a timeout: ") + e.what();
      } catch (const DistError& e) {
        what = e.what();
      }
      expect(milliseconds_since(start) < 10000, "rank ", rank, " took ", milliseconds_since(start), " ms");
      const std::string told = "chose backend shm where rank 0 chose gloo: every rank must use one backend";
      if (rank == 0)
        expect(what.find("cannot end: the store refused rank ") != std::string::npos &&
                   what.find(told) != std::string::npos,
               "rank 0: ", what);
      else
        expect(what.find("this rank chose backend shm, but rank 0 chose gloo") != std::string::npos ||
                   what.find(told) != std::string::npos,
               "rank ", rank, ": ", what);
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}
