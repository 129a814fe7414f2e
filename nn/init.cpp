#include "nn/init.h"

#include <cmath>

#include "core/error.h"

namespace nanoddp::nn::init {

Tensor uniform(const Shape& shape, double bound, Generator& gen) {
  NANODDP_CHECK(bound >= 0.0, ValueError, "init::uniform: bound must be >= 0, got ", bound);
  const auto limit = static_cast<float>(bound);
  Tensor t = Tensor::empty(shape);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = gen.uniform(-limit, limit);
  return t;
}

double kaiming_uniform_bound(int64_t fan_in) {
  if (fan_in <= 0) return 0.0;
  // The operations of torch.nn.init.calculate_gain('leaky_relu', math.sqrt(5)) and
  // kaiming_uniform_, in their order: another order rounds differently.
  const double a = std::sqrt(5.0);
  const double gain = std::sqrt(2.0 / (1.0 + std::pow(a, 2.0)));
  const double std_dev = gain / std::sqrt(static_cast<double>(fan_in));
  return std::sqrt(3.0) * std_dev;
}

double bias_bound(int64_t fan_in) { return fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0; }

}  // namespace nanoddp::nn::init
