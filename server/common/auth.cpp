#include "common/auth.h"

namespace burst::server {

bool token_equal(const std::string& expected, const std::string& got) {
  // Every byte of `expected` is looked at whatever `got` holds; only the length (not secret:
  // 64 hex digits, or the operator's token) shows.
  volatile unsigned char diff = expected.size() != got.size() ? 1 : 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char g = i < got.size() ? static_cast<unsigned char>(got[i]) : 0;
    diff = static_cast<unsigned char>(diff | (static_cast<unsigned char>(expected[i]) ^ g));
  }
  return diff == 0;
}

}  // namespace burst::server
