// Entry points of the baseline weight products (fp16 and q4_0 GEMV over a
// range of rows, batch of activations), dispatched to the best SIMD target
// (src/weights/gemv-inl.h). Internal header.
#ifndef TQ_SRC_WEIGHTS_GEMV_H_
#define TQ_SRC_WEIGHTS_GEMV_H_

#include <cstddef>
#include <cstdint>

namespace tq::weights {

// One call's work: rows [row_begin, row_end) of a row-major matrix
// (row_bytes a row), activations x[b] = x + b * x_stride (b < batch),
// outputs y[b * rows + r].
struct GemvArgs {
  const uint8_t* w = nullptr;
  size_t rows = 0, cols = 0, row_bytes = 0;
  size_t row_begin = 0, row_end = 0;
  const float* x = nullptr;
  size_t x_stride = 0;
  size_t batch = 0;
  // q4_0 only: activations prepared by PrepareQ4Activations (x, x_stride
  // point at them) and their per-block sums.
  const float* x_sum = nullptr;
  size_t x_sum_stride = 0;
  float* y = nullptr;
};

// One input group of a tqB matrix (2, 3 or 4 bits, one rotation block of
// `width` channels, width a multiple of 32 (4 bits) or 64 (2, 3 bits) and
// <= kTqMaxIntWidth):
// for r < rows, b < batch, the kTqAccLanes fp32 lanes at
// acc + (r * batch + b) * kTqAccLanes += scale_r * step[b] * the lanes of
// sum_i c8[idx_ri] * xq[b][i]; y_rb is the sum of the lanes (in lane order)
// after the last group (src/weights/tq_gemv-inl.h).
inline constexpr size_t kTqMaxIntWidth = 512;  // int32 sums cannot overflow
inline constexpr size_t kTqAccLanes = 8;
struct TqGroupArgs {
  const uint8_t* codes = nullptr;  // [rows][row_bytes]: indices, then the fp16 scale
  size_t rows = 0, row_bytes = 0, index_bytes = 0, width = 0;
  int bits = 0;
  const int8_t* lut = nullptr;     // 16 int8 centroids (unused entries 0)
  const int16_t* xq = nullptr;     // [batch][xq_stride], the kernel's order (3 bits: 2 * width)
  size_t xq_stride = 0;
  const float* step = nullptr;     // [batch]: centroid step * activation step
  size_t batch = 0;
  float* acc = nullptr;  // [rows][batch][kTqAccLanes]
};
// The group's int8 table (lut[16]) and its step max|c| / 127.
float TqCentroidTable(const float* centroids, int bits, int8_t* lut);
// The group's activation x[width] as int16 in the kernel's order (width
// int16, or 2 * width at 3 bits); returns the step max|x| / 32767 (0 for a
// zero activation).
float PrepareTqActivations(const float* x, size_t width, int bits, int16_t* xq);
// False when this target has no such kernel (the caller scores otherwise).
bool TqGroupGemv(const TqGroupArgs& args);

// q4_0's activation layout: per full block of 32, the 16 even-index values
// then the 16 odd ones; the short last block (cols % 32) as it is. sums:
// one per full block. xp: cols floats, sums: cols / 32 floats.
void PrepareQ4Activations(const float* x, size_t cols, float* xp, float* sums);

void GemvF16(const GemvArgs& args);
void GemvQ4(const GemvArgs& args);

// Scalar routes (the SCALAR target) and the q4_0 short last block's dot
// product (0 when cols % 32 == 0), x in the prepared layout.
void GemvF16Scalar(const GemvArgs& args);
void GemvQ4Scalar(const GemvArgs& args);
float Q4TailDot(const GemvArgs& args, const uint8_t* row, const float* x);

}  // namespace tq::weights

#endif  // TQ_SRC_WEIGHTS_GEMV_H_
