// Probability mass as an unsigned fixed-point number of 2^-96 units, for the samplers on the
// host (engine/sampler.cpp) and on the GPU (kernels/cuda/sampling.cu). A mass p = exp(s - max)
// is in [0, 1], so it needs 97 bits, and 2^31 of them sum in 128 bits without overflow: prefix
// sums are exact, hence the same in any summation order (the GPU's tree, the host's running
// sum). Masses below 2^-96 of the top one truncate to nothing; no 53-bit uniform could reach
// them.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/random.h"  // BURST_HD

namespace burst::kernels {

using Mass = unsigned __int128;

// Truncates p (finite, in [0, 1]) to whole units.
BURST_HD inline Mass to_mass(double p) {
#if defined(__CUDA_ARCH__)
  const auto b = static_cast<uint64_t>(__double_as_longlong(p));
#else
  uint64_t b;
  std::memcpy(&b, &p, sizeof b);
#endif
  const int e = static_cast<int>((b >> 52) & 0x7ff);
  if (e == 0) return 0;  // zero or subnormal: far below one unit
  const uint64_t m = (b & ((uint64_t{1} << 52) - 1)) | (uint64_t{1} << 52);
  const int shift = e - 979;  // p = m * 2^(e - 1075) = m * 2^(e - 979) units
  if (shift >= 0) return Mass{m} << shift;
  return -shift >= 64 ? Mass{0} : Mass{m >> -shift};
}

// Each 64-bit half rounded to nearest, then one rounded add (the product by 2^64 is exact, so
// a fused multiply-add rounds the same): the same double on the host and the GPU for a mass.
BURST_HD inline double to_double(Mass q) {
  return static_cast<double>(static_cast<uint64_t>(q >> 64)) * 0x1p64 +
         static_cast<double>(static_cast<uint64_t>(q));
}

}  // namespace burst::kernels
