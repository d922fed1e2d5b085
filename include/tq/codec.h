// TurboQuant codecs: TurboQuant-MSE (paper Alg. 1), TurboQuant-prod (Alg. 2:
// (b-1)-bit MSE plus a 1-bit QJL sketch of the residual) and the outlier
// channel split (two channel groups at different bit widths).
//
// A Codec (and a SplitCodec) is immutable after Create and safe to use from
// many threads; copies share the same tables. Row layouts are specified in docs/FORMAT.md.
#ifndef TQ_CODEC_H_
#define TQ_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tq/codebook.h"
#include "tq/format.h"
#include "tq/random.h"
#include "tq/rotation.h"
#include "tq/status.h"

namespace tq {

struct CodecPlan;  // internal

enum class CodecKind : uint8_t {
  kMse = 0,   // b-bit indices + one scale per rotation block
  kProd = 1,  // (b-1)-bit MSE indices + qjl_dim sign bits + scales + residual norm
};
enum class ScaleDtype : uint8_t { kF16 = 0, kF32 = 1 };

const char* CodecKindName(CodecKind kind);  // "mse" / "prod"

struct CodecSpec {
  size_t dim = 0;
  // Bits per coordinate, 1..8. kMse: b-bit indices. kProd: (b-1)-bit MSE
  // indices plus one QJL sign bit per coordinate (b = 1 is pure QJL).
  int bits = 0;
  CodecKind kind = CodecKind::kMse;
  RotationKind rotation = RotationKind::kBlockHadamard;
  CodebookFamily codebook = CodebookFamily::kSphere;
  ScaleDtype scale_dtype = ScaleDtype::kF16;
  // Store ||x_block|| / ||c[idx]|| instead of ||x_block|| so that the decoded
  // block has exactly the input's norm (free at decode, lowers MSE).
  bool norm_correction = true;
  // kProd only: length m of the QJL sketch; 0 means dim. 1..65536.
  size_t qjl_dim = 0;
  StreamId stream;  // seed, layer, head, role, group: all randomness derives from it
};

std::string ToString(const CodecSpec& spec);

struct BatchOptions {
  size_t threads = 1;  // worker threads over rows; 0 = all hardware threads
};

class Codec {
 public:
  // Validates the spec; errors name the bad field and the accepted values.
  static Result<Codec> Create(const CodecSpec& spec);

  const CodecSpec& spec() const;
  size_t dim() const;
  size_t row_bytes() const;
  // Stored bits per coordinate, every byte of the row counted.
  double bits_per_value() const;
  const Rotation& rotation() const;
  // Codebook of rotation block b for the MSE part (nullptr for 1-bit prod).
  const Codebook* codebook(size_t block) const;

  // x: [rows, dim] fp32, must be finite; codes: [rows, row_bytes()].
  // Errors: sizes that do not match (names both), a non-finite value (names
  // row and column), a row whose norm overflows the scale dtype. On error the
  // contents of codes are unspecified.
  Status Encode(std::span<const float> x, std::span<uint8_t> codes,
                const BatchOptions& options = {}) const;
  // codes: [rows, row_bytes()] -> x: [rows, dim]. Codes are trusted to come
  // from this spec (check fingerprints in containers); any bytes decode
  // without undefined behaviour.
  Status Decode(std::span<const uint8_t> codes, std::span<float> x,
                const BatchOptions& options = {}) const;

  // A query prepared once and scored against many codes: its rotation Πq and,
  // for kProd, its sketch S Πq.
  struct Query {
    std::vector<float> rotated;
    std::vector<float> sketch;
  };
  Status PrepareQuery(std::span<const float> q, Query* out) const;
  // scores[r] = estimate of <q, x_r> straight from row r's code (no decode).
  // kProd estimates are unbiased (paper Thm 2); kMse ones are not.
  Status InnerProducts(const Query& query, std::span<const uint8_t> codes,
                       std::span<float> scores, const BatchOptions& options = {}) const;

  // Internal: the kernel plan (src/core/plan.h).
  const CodecPlan& plan() const;

 private:
  struct State;
  explicit Codec(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  std::shared_ptr<const State> state_;
};

// ---------------------------------------------------------------------------
// Outlier channel split: channels are divided into an outlier group (higher
// bits) and a regular group; each is an independent Codec over its channels
// (stream.group 1 and 0), rows are [regular row][outlier row].
// ---------------------------------------------------------------------------
struct SplitSpec {
  size_t dim = 0;
  std::vector<uint32_t> outlier_channels;  // strictly ascending, < dim, non-empty, != all
  int outlier_bits = 0;
  int regular_bits = 0;
  CodecKind kind = CodecKind::kProd;
  RotationKind rotation = RotationKind::kBlockHadamard;
  ScaleDtype scale_dtype = ScaleDtype::kF16;
  bool norm_correction = true;
  StreamId stream;
};

// Channels with the largest mean energy E[x_j^2] over calibration rows
// ([rows, dim]), ascending. Ties go to the lower channel index.
Result<std::vector<uint32_t>> ChooseOutlierChannels(std::span<const float> calibration,
                                                    size_t dim, size_t count);

// Named recipes (dim/4 outlier channels, the paper's 2.5/3.5-bit settings):
//   "turboquant25": outliers 3 bits, regular 2 bits, prod codes.
//   "turboquant35": outliers 4 bits, regular 3 bits, prod codes.
// Outlier channels: ChooseOutlierChannels(calibration) when calibration is
// non-empty, else channels [0, dim/4). dim must be >= 8 and divisible by 4.
Result<SplitSpec> SplitRecipe(std::string_view name, size_t dim,
                              std::span<const float> calibration = {},
                              const StreamId& stream = {});

class SplitCodec {
 public:
  static Result<SplitCodec> Create(const SplitSpec& spec);
  const SplitSpec& spec() const { return spec_; }
  size_t dim() const { return spec_.dim; }
  size_t row_bytes() const { return regular_.row_bytes() + outlier_.row_bytes(); }
  double bits_per_value() const {
    return 8.0 * static_cast<double>(row_bytes()) / static_cast<double>(dim());
  }
  const Codec& regular() const { return regular_; }
  const Codec& outlier() const { return outlier_; }
  const std::vector<uint32_t>& regular_channels() const { return regular_channels_; }

  Status Encode(std::span<const float> x, std::span<uint8_t> codes,
                const BatchOptions& options = {}) const;
  Status Decode(std::span<const uint8_t> codes, std::span<float> x,
                const BatchOptions& options = {}) const;
  // Per-group inner-product estimates (for slope checks) and their sum.
  Status InnerProducts(std::span<const float> q, std::span<const uint8_t> codes,
                       std::span<float> scores, std::span<float> regular_scores = {},
                       std::span<float> outlier_scores = {}) const;

 private:
  SplitCodec(SplitSpec spec, Codec regular, Codec outlier, std::vector<uint32_t> regular_channels)
      : spec_(std::move(spec)), regular_(std::move(regular)), outlier_(std::move(outlier)),
        regular_channels_(std::move(regular_channels)) {}
  SplitSpec spec_;
  Codec regular_;
  Codec outlier_;
  std::vector<uint32_t> regular_channels_;
};

}  // namespace tq

#endif  // TQ_CODEC_H_
