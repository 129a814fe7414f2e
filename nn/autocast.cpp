#include "nn/autocast.h"

namespace nanoddp::nn {

autocast::autocast(DType dtype, bool enabled) : previous_(autocast_state()) {
  set_autocast_state({enabled, dtype});
}

autocast::~autocast() { set_autocast_state(previous_); }

}  // namespace nanoddp::nn
