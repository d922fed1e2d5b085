// Scalar reference kernels (tq::ref): the definition of every byte the codec
// writes and the oracle of the SIMD and CUDA kernels. The arithmetic order of
// each function is part of docs/FORMAT.md; change it only with a format bump.
// Internal header: not installed.
#ifndef TQ_SRC_REF_KERNELS_H_
#define TQ_SRC_REF_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include <cmath>

#include "core/plan.h"
#include "tq/format.h"

namespace tq::ref {

// Bitstreams (format.h); no validation: values < 2^bits, out sized exactly.
void PackBits(const uint8_t* values, size_t count, int bits, uint8_t* out);
void UnpackBits(const uint8_t* in, size_t count, int bits, uint8_t* values);

// Stores a row scale in the plan's dtype; false if it is not finite there
// (such rows are rejected by the encoders).
inline bool StoreScale(const CodecPlan& plan, float s, uint8_t* p) {
  if (plan.scale_f16) {
    const uint16_t h = FloatToHalf(s);
    StoreLE16(h, p);
    return (h & 0x7C00u) != 0x7C00u;
  }
  StoreFloatLE(s, p);
  return std::isfinite(s);
}
inline float LoadScale(const CodecPlan& plan, const uint8_t* p) {
  return plan.scale_f16 ? HalfToFloat(LoadLE16(p)) : LoadFloatLE(p);
}
// The quantization rule: the number of boundaries b with u >= b.
inline uint8_t QuantizeValue(float u, const float* boundaries, size_t num_boundaries) {
  unsigned idx = 0;
  for (size_t k = 0; k < num_boundaries; ++k) idx += (u >= boundaries[k]) ? 1u : 0u;
  return static_cast<uint8_t>(idx);
}

// Sum of squares in the canonical 16-lane order: acc[i % 16] += x[i] * x[i]
// (fp32, multiply then add), then acc[l] += acc[l + 8], then + 4, + 2, + 1 for
// the low lanes; returns acc[0].
float SumSquares16(const float* x, size_t n);

// In-place unnormalized Walsh–Hadamard transform of n = 2^k floats, stages in
// ascending stride h = 1, 2, ..., n/2: (a, b) -> (a + b, a - b).
void Fwht(float* x, size_t n);

// y = (1/n) H D2 H D1 x for one power-of-two block (s1, s2: ±1 signs).
void HadamardForward(const float* x, const float* s1, const float* s2, size_t n, float* y);
// x = D1 H D2 H y / n.
void HadamardInverse(const float* y, const float* s1, const float* s2, size_t n, float* x);

// y[j] = sum_i (mt[i * cols + j] * x[i]), accumulated in ascending i from 0.
void MatTVec(const float* mt, const float* x, size_t rows, size_t cols, float* y);

// Rotates one row into the rotated domain (all blocks).
void Rotate(const CodecPlan& plan, const float* x, float* y);
void RotateInverse(const CodecPlan& plan, const float* y, float* x);

// Encodes rows [0, rows) of x (stride plan.dim) into out (stride
// plan.row_bytes). Returns the index of the first row whose scale does not fit
// the scale dtype, or rows if all are fine (such rows are still written).
size_t EncodeRows(const CodecPlan& plan, const float* x, size_t rows, uint8_t* out);
void DecodeRows(const CodecPlan& plan, const uint8_t* codes, size_t rows, float* out);

// Prepared query: rotated query (dim) and, for prod codes, S·Πq (qjl_dim).
void PrepareQuery(const CodecPlan& plan, const float* q, float* q_rot, float* q_sketch);
// scores[r] = estimate of <q, x_r> from row r's code.
void ScoreRows(const CodecPlan& plan, const float* q_rot, const float* q_sketch,
               const uint8_t* codes, size_t rows, float* scores);

}  // namespace tq::ref

#endif  // TQ_SRC_REF_KERNELS_H_
