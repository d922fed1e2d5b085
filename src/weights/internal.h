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

// Layout (docs/FORMAT.md, "Weight matrices"):
//   tqB: group-major. Group j (input channels [col_offset[j], +cols[j]))
//        is a [rows][codecs[j].row_bytes()] block of TurboQuant-MSE rows
//        starting at byte byte_offset[j].
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
  std::vector<size_t> byte_offset;
  // qB_0, qB_1, f16.
  size_t row_bytes = 0;
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

// The (seed, layer, group) codec of a tqB matrix's input group of `width` channels.
Result<Codec> GroupCodec(const WeightSpec& spec, size_t group_index, size_t width);

}  // namespace weights
}  // namespace tq

#endif  // TQ_SRC_WEIGHTS_INTERNAL_H_
