#include "dist/host_collectives.h"

namespace nanoddp::dist {

namespace {

std::vector<float> to_host(const Tensor& t, float) { return t.to_vector(); }
std::vector<int64_t> to_host(const Tensor& t, int64_t) { return t.to_int_vector(); }

template <typename T>
std::vector<T> all_reduce_values(ProcessGroup& pg, const std::vector<T>& values, ReduceOp op,
                                 std::chrono::milliseconds timeout) {
  Tensor tensor = Tensor::from_vector(values, {}, pg.device());
  pg.all_reduce(tensor, op)->wait(timeout);
  return to_host(tensor, T{});
}

}  // namespace

std::vector<float> all_reduce_host(ProcessGroup& pg, const std::vector<float>& values, ReduceOp op,
                                   std::chrono::milliseconds timeout) {
  return all_reduce_values(pg, values, op, timeout);
}

std::vector<int64_t> all_reduce_host(ProcessGroup& pg, const std::vector<int64_t>& values, ReduceOp op,
                                     std::chrono::milliseconds timeout) {
  return all_reduce_values(pg, values, op, timeout);
}

std::vector<std::vector<int64_t>> all_gather_host(ProcessGroup& pg, const std::vector<int64_t>& values,
                                                  std::chrono::milliseconds timeout) {
  const Tensor input = Tensor::from_vector(values, {}, pg.device());
  std::vector<Tensor> outputs;
  for (int r = 0; r < pg.size(); ++r) outputs.push_back(Tensor::empty(input.shape(), DType::Int64, pg.device()));
  pg.all_gather(outputs, input)->wait(timeout);
  std::vector<std::vector<int64_t>> gathered;
  for (const Tensor& output : outputs) gathered.push_back(output.to_int_vector());
  return gathered;
}

std::string ranks_that_failed(ProcessGroup& pg, bool failed_here, std::chrono::milliseconds timeout) {
  const std::vector<std::vector<int64_t>> failed = all_gather_host(pg, {failed_here ? 1 : 0}, timeout);
  std::string ranks;
  for (size_t r = 0; r < failed.size(); ++r)
    if (failed[r][0] != 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  return ranks;
}

}  // namespace nanoddp::dist
