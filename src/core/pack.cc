// Bitstream packing and the scalar byte helpers of format.h.
#include <bit>
#include <cstring>
#include <string>

#include "tq/format.h"
#include "ref/kernels.h"

namespace tq {

namespace {
Status CheckBits(int bits) {
  if (bits < 1 || bits > 8) {
    return InvalidArgumentError("bits must be in 1..8, got " + std::to_string(bits));
  }
  return Status::Ok();
}
}  // namespace

Status PackBits(std::span<const uint8_t> values, int bits, std::span<uint8_t> out) {
  TQ_RETURN_IF_ERROR(CheckBits(bits));
  const size_t need = PackedBytes(values.size(), bits);
  if (out.size() != need) {
    return InvalidArgumentError("PackBits: output has " + std::to_string(out.size()) +
                                " bytes, " + std::to_string(values.size()) + " values of " +
                                std::to_string(bits) + " bits need exactly " +
                                std::to_string(need));
  }
  const unsigned limit = 1u << bits;
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] >= limit) {
      return InvalidArgumentError("PackBits: value " + std::to_string(values[i]) + " at index " +
                                  std::to_string(i) + " does not fit in " +
                                  std::to_string(bits) + " bits (accepted 0.." +
                                  std::to_string(limit - 1) + ")");
    }
  }
  ref::PackBits(values.data(), values.size(), bits, out.data());
  return Status::Ok();
}

Status UnpackBits(std::span<const uint8_t> in, int bits, std::span<uint8_t> values) {
  TQ_RETURN_IF_ERROR(CheckBits(bits));
  const size_t need = PackedBytes(values.size(), bits);
  if (in.size() != need) {
    return InvalidArgumentError("UnpackBits: input has " + std::to_string(in.size()) +
                                " bytes, " + std::to_string(values.size()) + " values of " +
                                std::to_string(bits) + " bits need exactly " +
                                std::to_string(need));
  }
  const size_t used_bits = values.size() * static_cast<size_t>(bits);
  if (used_bits % 8 != 0 && (in.back() >> (used_bits % 8)) != 0) {
    return DataLossError("UnpackBits: nonzero padding bits in the last byte (corrupt stream)");
  }
  ref::UnpackBits(in.data(), values.size(), bits, values.data());
  return Status::Ok();
}

uint16_t FloatToHalf(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) {  // Inf or NaN (NaN keeps a quiet payload bit)
    return static_cast<uint16_t>(sign | 0x7C00u | (x > 0x7F800000u ? 0x0200u : 0u));
  }
  if (x >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to Inf
  if (x < 0x38800000u) {
    // Result is subnormal or zero: value = x * 2^24 in units of 2^-24.
    if (x < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to 0
    const uint32_t mant = (x & 0x007FFFFFu) | 0x00800000u;
    const int shift = 126 - static_cast<int>(x >> 23);  // 14..24
    const uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    const uint32_t r = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
    return static_cast<uint16_t>(sign | r);
  }
  // Normal: rebias exponent 127 -> 15 and round the mantissa 23 -> 10 bits.
  const uint32_t base = x - 0x38000000u;  // exponent rebias
  const uint32_t q = base >> 13;
  const uint32_t rem = base & 0x1FFFu;
  const uint32_t r = q + ((rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ? 1u : 0u);
  return static_cast<uint16_t>(sign | r);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  uint32_t out;
  if (exp == 0) {
    if (mant == 0) {
      out = sign;
    } else {  // subnormal: mant * 2^-24, exact in float
      const float v = static_cast<float>(mant) * 0x1.0p-24f;
      out = sign | std::bit_cast<uint32_t>(v);
    }
  } else if (exp == 31) {
    out = sign | 0x7F800000u | (mant << 13);
  } else {
    out = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(out);
}

uint16_t FloatToBFloat16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  const uint32_t rounded = x + 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

float BFloat16ToFloat(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

void StoreLE16(uint16_t v, uint8_t* p) { p[0] = v & 0xFF; p[1] = v >> 8; }
void StoreLE32(uint32_t v, uint8_t* p) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void StoreLE64(uint64_t v, uint8_t* p) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint16_t LoadLE16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t LoadLE32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t LoadLE64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
void StoreFloatLE(float v, uint8_t* p) { StoreLE32(std::bit_cast<uint32_t>(v), p); }
float LoadFloatLE(const uint8_t* p) { return std::bit_cast<float>(LoadLE32(p)); }

}  // namespace tq
