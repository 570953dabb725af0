// The element types every kernel family dispatches on, in plain C++ (no torch, no CUDA headers needed).
#pragma once

#include <cstdint>

namespace bem {

// 16-byte loads and stores need 16-byte aligned addresses.
inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

enum class DType { kHalf, kBFloat16, kFloat, kDouble };

}  // namespace bem
