// The collective cases every CPU backend must pass, run inside each rank of a test job.
//
//   auto pg = dist::init_process_group(options);
//   check_collectives(*pg, sizes);      // throws std::runtime_error naming the first mismatch
//
// Inputs are small integers chosen so every result is exact in float32: rank r contributes
// (r + 1) * pattern(i), so a sum is world_size*(world_size+1)/2 * pattern(i), a max is
// world_size * pattern(i), a min is pattern(i). Expectations are computed in double.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "core/tensor.h"
#include "dist/process_group.h"
#include "tests/multiprocess.h"

namespace nanoddp::testing {

inline double pattern(int64_t i) { return static_cast<double>(i % 5 + 1); }

inline Tensor make_tensor(DType dtype, int64_t numel, const std::function<double(int64_t)>& f) {
  if (dtype == DType::Float32) {
    std::vector<float> v(static_cast<size_t>(numel));
    for (int64_t i = 0; i < numel; ++i) v[i] = static_cast<float>(f(i));
    return Tensor::from_vector(v, Shape{numel});
  }
  std::vector<int64_t> v(static_cast<size_t>(numel));
  for (int64_t i = 0; i < numel; ++i) v[i] = static_cast<int64_t>(f(i));
  return Tensor::from_vector(v, Shape{numel});
}

// Throws at the first element that differs from f(i), naming what and where.
inline void expect_values(const Tensor& t, const std::function<double(int64_t)>& f,
                          const std::string& what) {
  if (t.dtype() == DType::Float32) {
    auto v = t.to_vector();
    for (size_t i = 0; i < v.size(); ++i)
      expect(static_cast<double>(v[i]) == f(static_cast<int64_t>(i)), what, ": element ", i,
             " is ", v[i], ", expected ", f(static_cast<int64_t>(i)));
  } else {
    auto v = t.to_int_vector();
    for (size_t i = 0; i < v.size(); ++i)
      expect(static_cast<double>(v[i]) == f(static_cast<int64_t>(i)), what, ": element ", i,
             " is ", v[i], ", expected ", f(static_cast<int64_t>(i)));
  }
}

// numel elements of dtype whose bytes are a pattern of seed: (seed * 31 + 7 * k) mod 251.
inline Tensor bytes_tensor(DType dtype, int64_t numel, int seed) {
  Tensor t = Tensor::empty({numel}, dtype);
  auto* bytes = static_cast<uint8_t*>(t.impl()->storage->data());
  for (size_t k = 0; k < t.nbytes(); ++k) bytes[k] = static_cast<uint8_t>((seed * 31 + 7 * k) % 251);
  return t;
}

// Throws unless t's bytes are bytes_tensor's pattern of seed.
inline void expect_bytes(const Tensor& t, int seed, const std::string& what) {
  const Tensor host = t.to(Device::cpu());
  const auto* bytes = static_cast<const uint8_t*>(host.impl()->storage->data());
  for (size_t k = 0; k < host.nbytes(); ++k)
    expect(bytes[k] == static_cast<uint8_t>((seed * 31 + 7 * k) % 251), what, ": byte ", k, " is ", int(bytes[k]),
           ", expected ", (seed * 31 + 7 * k) % 251);
}

inline const char* short_name(DType dtype) { return dtype == DType::Float32 ? "float32" : "int64"; }

inline void check_collectives(dist::ProcessGroup& pg, const std::vector<int64_t>& sizes) {
  using dist::ReduceOp;
  const int n = pg.size();
  const int rank = pg.rank();
  const double s = n * (n + 1) / 2.0;
  const std::string where = "rank " + std::to_string(rank) + "/" + std::to_string(n) + " " +
                            pg.backend_name() + " ";

  // Reductions of other dtypes (uint8, int32) are refused by name before any backend reads
  // them (as int64).
  for (DType dtype : {DType::UInt8, DType::Int32}) {
    Tensor t = Tensor::ones({3}, dtype);
    std::string message;
    try {
      pg.all_reduce(t);
    } catch (const ValueError& e) {
      message = e.what();
    }
    expect(message.find("only float32, int64, float16 and bfloat16") != std::string::npos, where,
           dtype_name(dtype), " all_reduce: ", message.empty() ? "accepted" : message);
  }
  // A negative tag is refused before anything is sent, as torch.distributed's "Tag must be
  // nonnegative", on every backend.
  for (bool is_send : {true, false}) {
    Tensor t = Tensor::zeros({2});
    std::string message;
    try {
      if (is_send) pg.send(t, (rank + 1) % n, -1);
      else pg.recv(t, (rank + 1) % n, -1);
    } catch (const ValueError& e) {
      message = e.what();
    }
    expect(message.find("tag -1 must be >= 0") != std::string::npos, where, is_send ? "send" : "recv",
           " with tag -1: ", message.empty() ? "accepted" : message);
  }
  // Avg is float32's only; the message names the dtype given.
  for (DType dtype : {DType::Int64, DType::Float16, DType::BFloat16}) {
    Tensor t = Tensor::zeros({3}, dtype);
    std::string message;
    try {
      pg.all_reduce(t, ReduceOp::Avg);
    } catch (const ValueError& e) {
      message = e.what();
    }
    const std::string want = std::string("avg needs float32, not ") + dtype_name(dtype);
    expect(message.find(want) != std::string::npos, where, dtype_name(dtype),
           " all_reduce(avg): ", message.empty() ? "accepted" : message);
  }
  // Copies take every dtype, byte for byte (torch.distributed.broadcast / all_gather).
  for (DType dtype : {DType::UInt8, DType::Int32, DType::Float16, DType::BFloat16}) {
    const std::string what = where + dtype_name(dtype) + " ";
    for (int root = 0; root < n; ++root) {
      Tensor t = bytes_tensor(dtype, 37, rank);
      pg.broadcast(t, root)->wait();
      expect_bytes(t, root, what + "broadcast from " + std::to_string(root));
    }
    std::vector<Tensor> outputs;
    for (int r = 0; r < n; ++r) outputs.push_back(Tensor::zeros({37}, dtype));
    pg.all_gather(outputs, bytes_tensor(dtype, 37, rank))->wait();
    for (int r = 0; r < n; ++r) expect_bytes(outputs[r], r, what + "all_gather output " + std::to_string(r));
  }

  for (int64_t numel : sizes) {
    for (DType dtype : {DType::Float32, DType::Int64}) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
        std::string what = where + "all_reduce(" + dist::reduce_op_name(op) + ") " +
                           short_name(dtype) + " [" + std::to_string(numel) + "]";
        Tensor t = make_tensor(dtype, numel, [&](int64_t i) { return (rank + 1) * pattern(i); });
        if (op == ReduceOp::Avg && dtype == DType::Int64) {
          bool threw = false;
          try {
            pg.all_reduce(t, op);
          } catch (const ValueError&) {
            threw = true;
          }
          expect(threw, what, ": an int64 average was accepted");
          continue;
        }
        pg.all_reduce(t, op)->wait();
        double factor = op == ReduceOp::Sum   ? s
                        : op == ReduceOp::Avg ? (n + 1) / 2.0
                        : op == ReduceOp::Max ? n
                                              : 1.0;
        expect_values(t, [&](int64_t i) { return factor * pattern(i); }, what);
      }
    }
    // broadcast from every root
    for (int root = 0; root < n; ++root) {
      Tensor t = make_tensor(DType::Float32, numel,
                             [&](int64_t i) { return (rank + 1) * 1000.0 + (i % 7); });
      pg.broadcast(t, root)->wait();
      expect_values(t, [&](int64_t i) { return (root + 1) * 1000.0 + (i % 7); },
                    where + "broadcast from " + std::to_string(root));
    }
    // all_gather: outputs[r] is rank r's input
    for (DType dtype : {DType::Float32, DType::Int64}) {
      Tensor input = make_tensor(dtype, numel, [&](int64_t i) { return (rank + 1) * pattern(i); });
      std::vector<Tensor> outputs;
      for (int r = 0; r < n; ++r) outputs.push_back(Tensor::zeros({numel}, dtype));
      pg.all_gather(outputs, input)->wait();
      for (int r = 0; r < n; ++r)
        expect_values(outputs[r], [&](int64_t i) { return (r + 1) * pattern(i); },
                      where + "all_gather " + short_name(dtype) + " output " + std::to_string(r));
    }
    // The same into views of one flat buffer (FSDP's layout, which backends may gather into
    // directly), and in place (the input is this rank's view).
    for (bool in_place : {false, true}) {
      const std::string how = in_place ? " in place" : " into one buffer";
      Tensor flat = Tensor::zeros({numel * n});
      std::vector<Tensor> views;
      for (int r = 0; r < n; ++r) views.push_back(flat.slice_view(r * numel, {numel}));
      Tensor input = make_tensor(DType::Float32, numel, [&](int64_t i) { return (rank + 1) * pattern(i); });
      if (in_place) {
        views[rank].copy_(input);
        input = views[rank];
      }
      pg.all_gather(views, input)->wait();
      for (int r = 0; r < n; ++r)
        expect_values(views[r], [&](int64_t i) { return (r + 1) * pattern(i); },
                      where + "all_gather" + how + " [" + std::to_string(numel) + "] output " + std::to_string(r));
      // reduce_scatter from views of one buffer; in place: the output is this rank's input view.
      Tensor grads = make_tensor(DType::Float32, numel * n,
                                 [&](int64_t k) { return (rank + 1) * (10.0 * (k / numel) + pattern(k % numel)); });
      const Tensor before = grads.clone();
      std::vector<Tensor> inputs;
      for (int r = 0; r < n; ++r) inputs.push_back(grads.slice_view(r * numel, {numel}));
      Tensor output = in_place ? inputs[rank] : Tensor::zeros({numel});
      pg.reduce_scatter(output, inputs, ReduceOp::Sum)->wait();
      expect_values(output, [&](int64_t i) { return s * (10.0 * rank + pattern(i)); },
                    where + "reduce_scatter" + (in_place ? " in place" : " from one buffer") + " [" +
                        std::to_string(numel) + "]");
      for (int r = 0; r < n && !in_place; ++r)
        expect_values(inputs[r], [&](int64_t i) { return before.data<float>()[r * numel + i]; },
                      where + "reduce_scatter from one buffer: input " + std::to_string(r) + " changed");
    }
    // reduce_scatter: inputs[j] on rank r is (r + 1) * (10 j + pattern(i))
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
      std::vector<Tensor> inputs;
      for (int j = 0; j < n; ++j)
        inputs.push_back(make_tensor(DType::Float32, numel,
                                     [&](int64_t i) { return (rank + 1) * (10.0 * j + pattern(i)); }));
      Tensor output = Tensor::zeros({numel});
      pg.reduce_scatter(output, inputs, op)->wait();
      double factor = op == ReduceOp::Sum ? s : n;
      expect_values(output, [&](int64_t i) { return factor * (10.0 * rank + pattern(i)); },
                    where + "reduce_scatter(" + dist::reduce_op_name(op) + ") [" +
                        std::to_string(numel) + "]");
    }
  }

  // Max and Min: a NaN wins whichever rank holds it, and -0 < +0 whichever rank holds which
  // zero (Note [Max and Min]), so every backend gives the same bits.
  if (n >= 2) {
    const float nan = std::numeric_limits<float>::quiet_NaN(), zero = rank % 2 == 0 ? -0.0f : 0.0f;
    for (ReduceOp op : {ReduceOp::Max, ReduceOp::Min}) {
      Tensor t = Tensor::from_vector({zero, -zero, rank == 0 ? nan : 1.0f, rank == n - 1 ? nan : 1.0f});
      pg.all_reduce(t, op)->wait();
      const auto out = t.to_vector();
      const bool negative = op == ReduceOp::Min;
      for (int i = 0; i < 2; ++i)
        expect(out[i] == 0.0f && std::signbit(out[i]) == negative, where, dist::reduce_op_name(op),
               " of -0 and +0: element ", i, " is ", std::signbit(out[i]) ? "-" : "+", out[i], ", expected ",
               negative ? "-0" : "+0");
      expect(std::isnan(out[2]) && std::isnan(out[3]), where, dist::reduce_op_name(op),
             " dropped a NaN: ", out[2], ", ", out[3]);
    }
  }

  // wait(0ms) sets no limit of its own: the group's timeout applies (torch's
  // Work.wait(timeout=timedelta(0))), so it waits for the peers.
  {
    Tensor t = make_tensor(DType::Float32, 5, [&](int64_t i) { return (rank + 1) * pattern(i); });
    if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    pg.all_reduce(t)->wait(std::chrono::milliseconds(0));
    expect_values(
        t, [&](int64_t i) { return s * pattern(i); }, where + "all_reduce waited with 0 ms");
  }

  // Works complete in the order issued: after barrier()->wait() (or a broadcast's wait) an
  // all_reduce nobody waited on is final.
  for (bool by_barrier : {true, false}) {
    Tensor t = make_tensor(DType::Float32, 3, [&](int64_t i) { return (rank + 1) * pattern(i); });
    auto work = pg.all_reduce(t, ReduceOp::Avg);
    Tensor root_value = Tensor::zeros({1});
    if (by_barrier)
      pg.barrier()->wait();
    else
      pg.broadcast(root_value, 0)->wait();
    expect_values(
        t, [&](int64_t i) { return (n + 1) / 2.0 * pattern(i); },
        where + "all_reduce(avg) after a later " + (by_barrier ? "barrier" : "broadcast") + "'s wait");
    work->wait();
  }

  // Several works in flight, waited in reverse: each still gets its own result.
  std::vector<Tensor> tensors;
  std::vector<std::shared_ptr<dist::Work>> works;
  for (int k = 0; k < 4; ++k) {
    tensors.push_back(make_tensor(DType::Float32, 1000 + k, [&](int64_t i) {
      return (rank + 1) * (k + pattern(i));
    }));
    works.push_back(pg.all_reduce(tensors.back()));
  }
  for (int k = 3; k >= 0; --k) {
    works[k]->wait();
    expect(works[k]->is_completed(), where, "work ", k, " not completed after wait");
    expect_values(tensors[k], [&](int64_t i) { return s * (k + pattern(i)); },
                  where + "in-flight all_reduce " + std::to_string(k));
  }

  // A 2-D tensor keeps its shape.
  Tensor matrix = make_tensor(DType::Float32, 15, [&](int64_t i) { return (rank + 1) * pattern(i); })
                      .reshape({3, 5});
  pg.all_reduce(matrix)->wait();
  expect(matrix.shape() == Shape{3, 5}, where, "all_reduce changed the shape");
  expect_values(matrix, [&](int64_t i) { return s * pattern(i); }, where + "2-D all_reduce");

  // Bad arguments are refused with the collective named.
  std::vector<Tensor> too_few(static_cast<size_t>(n + 1), Tensor::zeros({2}));
  bool threw = false;
  try {
    Tensor in = Tensor::zeros({2});
    pg.all_gather(too_few, in);
  } catch (const ValueError& e) {
    threw = std::string(e.what()).find("all_gather") != std::string::npos;
  }
  expect(threw, where, "all_gather accepted a list of the wrong length");
  threw = false;
  try {
    Tensor t = Tensor::zeros({2});
    pg.broadcast(t, n);
  } catch (const ValueError&) {
    threw = true;
  }
  expect(threw, where, "broadcast accepted root ", n);

  pg.barrier()->wait();
}

// The 2^20 + 3 element cases (every backend's large-message path): a float32 sum, an int64
// max and min, a float32 broadcast from the last rank. Rank r contributes r + 1.
inline void check_large_collectives(dist::ProcessGroup& pg) {
  const int world_size = pg.size(), rank = pg.rank();
  const int64_t numel = (int64_t(1) << 20) + 3;
  const double s = world_size * (world_size + 1) / 2.0;
  Tensor f = make_tensor(DType::Float32, numel, [&](int64_t i) { return (rank + 1) * pattern(i); });
  pg.all_reduce(f, dist::ReduceOp::Sum)->wait();
  expect_values(f, [&](int64_t i) { return s * pattern(i); }, "big sum");
  Tensor l = make_tensor(DType::Int64, numel, [&](int64_t i) { return (rank + 1) * (i % 1000); });
  pg.all_reduce(l, dist::ReduceOp::Max)->wait();
  expect_values(l, [&](int64_t i) { return world_size * double(i % 1000); }, "big max");
  Tensor m = make_tensor(DType::Int64, numel, [&](int64_t i) { return (rank + 1) * (i % 1000); });
  pg.all_reduce(m, dist::ReduceOp::Min)->wait();
  expect_values(m, [&](int64_t i) { return double(i % 1000); }, "big min");
  Tensor b = make_tensor(DType::Float32, numel, [&](int64_t i) { return rank * 10.0 + (i % 3); });
  pg.broadcast(b, world_size - 1)->wait();
  expect_values(b, [&](int64_t i) { return (world_size - 1) * 10.0 + (i % 3); }, "big broadcast");
}

}  // namespace nanoddp::testing
