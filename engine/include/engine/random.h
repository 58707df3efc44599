// The counter-based random numbers of kernels/random.h under the engine's name: random-weight
// presets and the CUDA fill kernel draw the same values.
#pragma once

#include "kernels/random.h"

namespace burst::engine {

using kernels::splitmix64;
using kernels::uniform_at;

}  // namespace burst::engine
