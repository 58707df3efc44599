// Host conversions between fp32 and the 16-bit float formats (round to nearest even), shared
// by the CPU backend, the weight loader and the tests.
#pragma once

#include <cstdint>
#include <cstring>

namespace burst::engine {

inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((man & 0x400u) == 0) {
        man <<= 1;
        --exp;
      }
      u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace burst::engine
