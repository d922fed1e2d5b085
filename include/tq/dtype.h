// Element types of the tensors the library reads and writes: queries and
// outputs of attention, dense K/V views, GPU inputs. f16 and bf16 values
// travel as their 16-bit patterns (uint16_t). Stored formats name their own
// narrower fields (Half16 for a cache's dense windows, ScaleDtype for code
// scales): those values are part of the byte format.
#ifndef TQ_DTYPE_H_
#define TQ_DTYPE_H_

#include <cstddef>
#include <cstdint>

namespace tq {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// "f32", "f16", "bf16" ("unknown" for other values).
constexpr const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
  }
  return "unknown";
}

// Bytes of one element: 4, 2, 2 (0 for other values).
constexpr size_t DTypeBytes(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16:
    case DType::kBF16: return 2;
  }
  return 0;
}

}  // namespace tq

#endif  // TQ_DTYPE_H_
