// Weight compression: a linear layer's matrix W [rows = outputs][cols =
// inputs] stored compressed, and matrix-vector products (GEMV, and small
// batches: GEMM with batch 1..16 typical) computed straight from the codes.
// Separate from the KV-cache path. Layouts: docs/FORMAT.md ("Weight
// matrices").
//
// Formats:
//   tqB   TurboQuant (B = 2..8 bits): each row is cut into groups of `group`
//         input channels (default 128; the last group is cols % group when
//         that is not zero, and a matrix narrower than `group` is one group
//         of cols). Group j of every row is stored in the TurboQuant-MSE row
//         layout (tq::Codec, kind mse, block-Hadamard rotation, sphere
//         codebook, fp16 scale per rotation block; the encoder picks the
//         indices and a least-squares scale by a scale search) with the rotation
//         seeded by (seed, layer, head = j): one rotation per (layer, input
//         group), shared by all rows, so a product rotates the activation
//         once per group and then reads centroid x activation sums straight
//         from the packed indices. Data-free: no calibration.
//   qB_0  symmetric absmax integers per 32 input channels with an fp16
//         scale (llama.cpp's q4_0 / q8_0 class; B + 0.5 bits a weight).
//   qB_1  asymmetric integers per 32 with an fp16 scale and an fp16 minimum
//         (q4_1 class; B + 1 bits a weight).
//   f16   IEEE half precision (the 16-bit baseline).
//
// A WeightMatrix is immutable after creation and safe to use from many
// threads at once.
#ifndef TQ_WEIGHTS_H_
#define TQ_WEIGHTS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tq/status.h"

namespace tq {

enum class WeightFormat : uint8_t {
  kTurboQuant = 0,  // "tqB"
  kAbsmax = 1,      // "qB_0"
  kAsymmetric = 2,  // "qB_1"
  kF16 = 3,         // "f16"
};

// Channels per block of the integer baselines (qB_0, qB_1).
inline constexpr size_t kBaselineBlock = 32;
// Default TurboQuant group (input channels per rotation and scale).
inline constexpr size_t kDefaultWeightGroup = 128;
// Accepted TurboQuant groups: powers of two in [kMinWeightGroup, kMaxWeightGroup].
inline constexpr size_t kMinWeightGroup = 8;
inline constexpr size_t kMaxWeightGroup = 4096;

struct WeightSpec {
  WeightFormat format = WeightFormat::kTurboQuant;
  // tqB, qB_0, qB_1: 2..8. f16: 16.
  int bits = 4;
  // tqB only: input channels per group, a power of two in 8..4096.
  size_t group = kDefaultWeightGroup;
  // tqB only: the rotations derive from (seed, layer, input group).
  uint64_t seed = 0;
  uint32_t layer = 0;
};

// "tq4" (group 128), "tq3g64" (group 64), "q4_0", "q8_0", "q3_1", "f16".
// Errors name the string and list the accepted forms.
Result<WeightSpec> ParseWeightSpec(std::string_view name);
// The name ParseWeightSpec reads back ("tq4", "tq4g64" when group != 128).
std::string WeightSpecName(const WeightSpec& spec);

struct WeightOptions {
  size_t threads = 1;  // worker threads over rows; 0 = all hardware threads
};

class WeightMatrix {
 public:
  // Compresses w [rows][cols] (row-major, finite). Errors: rows or cols 0,
  // w.size() != rows * cols, bits or group outside the format's accepted
  // values, a non-finite weight (names row and column), a scale that
  // overflows fp16.
  static Result<WeightMatrix> Quantize(std::span<const float> w, size_t rows, size_t cols,
                                       const WeightSpec& spec, const WeightOptions& options = {});
  // Wraps stored bytes (as bytes() returns them). Errors: the spec's, and
  // data.size() != ByteSize(spec, rows, cols). Any bytes of the right size
  // give finite or non-finite outputs without undefined behaviour.
  static Result<WeightMatrix> FromBytes(const WeightSpec& spec, size_t rows, size_t cols,
                                        std::span<const uint8_t> data);
  // Stored bytes of a rows x cols matrix in this spec.
  static Result<size_t> ByteSize(const WeightSpec& spec, size_t rows, size_t cols);

  const WeightSpec& spec() const;
  size_t rows() const;
  size_t cols() const;
  // Input groups of a tqB matrix (1 for the other formats) and their widths.
  size_t num_groups() const;
  size_t group_cols(size_t group) const;
  std::span<const uint8_t> bytes() const;
  // Stored bits per weight: 8 * bytes().size() / (rows * cols), every scale counted.
  double bits_per_weight() const;

  // w [rows][cols]: the weights the codes stand for.
  Status Dequantize(std::span<float> w, const WeightOptions& options = {}) const;
  // y[b][r] = sum_c W[r][c] * x[b][c] for b < batch: x [batch][cols],
  // y [batch][rows], fp32. The fast CPU kernels (Highway, threads over
  // rows). Errors: batch 0, sizes that do not match (names both), a
  // non-finite activation (names batch row and column).
  Status Multiply(std::span<const float> x, size_t batch, std::span<float> y,
                  const WeightOptions& options = {}) const;

  struct State;  // internal
  const State& state() const { return *state_; }

 private:
  explicit WeightMatrix(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  std::shared_ptr<const State> state_;
};

}  // namespace tq

#endif  // TQ_WEIGHTS_H_
