// The state behind tq::WeightMatrix and the helpers its files share.
// Internal header: not installed.
#ifndef TQ_SRC_WEIGHTS_INTERNAL_H_
#define TQ_SRC_WEIGHTS_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tq/codec.h"
#include "tq/weights.h"

namespace tq {

// Rows per tile of a tqB matrix.
inline constexpr size_t kWeightRowTile = 64;

// Layout (docs/FORMAT.md, "Weight matrices"):
//   tqB: tiles of kWeightRowTile rows (the last one shorter), one after the
//        other; inside a tile, group-major: group j (input channels
//        [col_offset[j], + group_width[j])) is a [tile rows][rb_j] block of
//        TurboQuant-MSE rows, rb_j = codecs[j].row_bytes(), at
//        tile start + tile rows * group_prefix[j] (the sum of rb over the
//        groups before j). row_bytes = the sum of rb_j over all groups.
//        A product streams the bytes in order.
//   qB_0, qB_1, f16: row-major, row_bytes bytes a row.
struct WeightMatrix::State {
  WeightSpec spec;
  size_t rows = 0;
  size_t cols = 0;
  std::vector<uint8_t> data;
  // tqB only, one entry per input group.
  std::vector<Codec> codecs;
  std::vector<size_t> col_offset;
  std::vector<size_t> group_width;
  std::vector<size_t> group_prefix;
  size_t row_bytes = 0;

  // tqB: the first byte of group j's block in the tile holding row r0
  // (r0 a multiple of kWeightRowTile); its rows follow with stride rb_j.
  size_t TileGroupOffset(size_t r0, size_t j) const {
    const size_t n = rows - r0 < kWeightRowTile ? rows - r0 : kWeightRowTile;
    return r0 * row_bytes + n * group_prefix[j];
  }
  size_t TileRows(size_t r0) const { return rows - r0 < kWeightRowTile ? rows - r0 : kWeightRowTile; }
};

namespace weights {

// Validates bits and group for the format (errors list the accepted values).
Status CheckSpec(const WeightSpec& spec);

// Integer baselines, one row of n = cols values (blocks of kBaselineBlock,
// the last one cols % 32 when not zero). Block layout: fp16 scale d,
// (qB_1: fp16 minimum m,) then the block's B-bit values as a bitstream.
size_t BaselineRowBytes(const WeightSpec& spec, size_t cols);
void QuantizeBaselineRow(const WeightSpec& spec, const float* w, size_t cols, uint8_t* out);
void DequantizeBaselineRow(const WeightSpec& spec, const uint8_t* in, size_t cols, float* w);

// tqB encoder (tq_encode.cc): w [rows][codec.dim()] -> out [rows][row_bytes]
// in the codec's row layout; per rotation block, the indices of u / alpha
// (u = the rotated block over its norm) for the grid alpha = 0.75, 0.775,
// ..., 1.25 whose least-squares scale gives the smallest squared error, and
// that scale (fp16). Errors: a scale that overflows fp16 (names the row).
Status EncodeTqGroup(const Codec& codec, const float* w, size_t rows, uint8_t* out, size_t threads);

// The (seed, layer, group) codec of a tqB matrix's input group of `width` channels.
Result<Codec> GroupCodec(const WeightSpec& spec, size_t group_index, size_t width);

}  // namespace weights
}  // namespace tq

#endif  // TQ_SRC_WEIGHTS_INTERNAL_H_
