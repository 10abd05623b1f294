// 8-float GCC vectors for the CPU kernels, with unaligned loads and stores (memcpy keeps any row
// legal). Always inlined: callers compiled for several targets (target_clones) get the
// instructions of their own target.
#pragma once

#include <cstdint>
#include <cstring>

namespace attention::cpu {

using Vec8 = float __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;  // floats per Vec8

inline __attribute__((always_inline)) Vec8 Load(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline __attribute__((always_inline)) void Store(float* p, Vec8 v) {
  std::memcpy(p, &v, sizeof(v));
}

}  // namespace attention::cpu
