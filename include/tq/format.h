// Byte layouts that turboquant persists or exchanges. Every layout here is
// specified in docs/FORMAT.md and covered by golden byte tests; bytes never
// depend on the SIMD target, the compiler, or CPU vs GPU.
#ifndef TQ_FORMAT_H_
#define TQ_FORMAT_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "tq/status.h"

namespace tq {

// Version of every layout in this header. Bumped on any byte change.
inline constexpr uint32_t kFormatVersion = 1;

// ---------------------------------------------------------------------------
// Bitstreams of b-bit unsigned values, 1 <= b <= 8.
// Bit k (LSB = 0) of value i is stream bit i*b + k; stream bit j is bit (j % 8)
// of byte j / 8. Unused high bits of the last byte are zero.
// ---------------------------------------------------------------------------
constexpr size_t PackedBytes(size_t count, int bits) {
  return (count * static_cast<size_t>(bits) + 7) / 8;
}

// Packs values[0..count) (each < 2^bits) into out (PackedBytes(count, bits)
// bytes exactly). Errors: bits outside 1..8, a value >= 2^bits (names its
// index), out.size() != PackedBytes(count, bits).
Status PackBits(std::span<const uint8_t> values, int bits, std::span<uint8_t> out);
// Inverse of PackBits: values.size() values from in (PackedBytes bytes).
// Errors: bits outside 1..8, in.size() != PackedBytes(values.size(), bits),
// nonzero padding bits in the last byte (corrupt input).
Status UnpackBits(std::span<const uint8_t> in, int bits, std::span<uint8_t> values);

// ---------------------------------------------------------------------------
// Half precision (IEEE 754 binary16), round to nearest even, used for stored
// norms/scales. Our own conversion so that it is identical everywhere.
// ---------------------------------------------------------------------------
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);
inline constexpr float kHalfMax = 65504.0f;
// bfloat16: the high half of a float32, round to nearest even (NaN stays NaN).
uint16_t FloatToBFloat16(float f);
float BFloat16ToFloat(uint16_t h);

// Little-endian scalar stores/loads at any byte offset.
void StoreLE16(uint16_t v, uint8_t* p);
void StoreLE32(uint32_t v, uint8_t* p);
void StoreLE64(uint64_t v, uint8_t* p);
uint16_t LoadLE16(const uint8_t* p);
uint32_t LoadLE32(const uint8_t* p);
uint64_t LoadLE64(const uint8_t* p);
void StoreFloatLE(float v, uint8_t* p);
float LoadFloatLE(const uint8_t* p);

}  // namespace tq

#endif  // TQ_FORMAT_H_
