// KV-cache row formats, presets and policy.
//
// A row is one token of one KV head: head_dim values of a key or a value.
// Every format encodes rows to a fixed number of bytes, laid out as
// [payload][metadata] (docs/FORMAT.md, "KV rows"): the payload (packed
// indices, sign bits or dense halves) first, then the per-row metadata
// (norms, scales, zeros). Paged caches store the two parts in separate planes.
#ifndef TQ_KV_FORMAT_H_
#define TQ_KV_FORMAT_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tq/codec.h"
#include "tq/status.h"

namespace tq {

enum class KVFormatKind : uint8_t {
  kDense16 = 0,   // fp16 or bf16 per value
  kInt8Sym = 1,   // int8, per-group symmetric fp16 scale (keys: "k8")
  kIntAsym = 2,   // b-bit unsigned, per-group fp16 scale and zero (KIVI-style values)
  kTurboMse = 3,  // TurboQuant-MSE, norm correction on
  kTurboProd = 4, // TurboQuant-prod: (b-1)-bit MSE + QJL (explicit opt-in)
  kTurboSplit = 5 // outlier split recipe (turboquant25 / turboquant35)
};

enum class Half16 : uint8_t { kF16 = 0, kBF16 = 1 };

inline constexpr size_t kGroupAuto = 0;
inline constexpr size_t kGroupRow = static_cast<size_t>(-1);

// One component (keys or values) of a KV format.
struct KVFormat {
  KVFormatKind kind = KVFormatKind::kTurboMse;
  int bits = 4;            // kIntAsym: 2, 3, 4, 8; kTurbo*: 1..8; kInt8Sym: 8; kDense16: 16
  Half16 half = Half16::kF16;  // kDense16 only
  // kInt8Sym / kIntAsym: channels per scale; must divide head_dim, or be
  // kGroupAuto (gcd(32, head_dim): 32 for the usual head dims) or kGroupRow.
  size_t group_size = kGroupAuto;
  std::string recipe;      // kTurboSplit: "turboquant25" or "turboquant35"
  CodecKind split_kind = CodecKind::kProd;  // kTurboSplit: prod for keys, mse for values
  RotationKind rotation = RotationKind::kBlockHadamard;  // kTurbo*
};

std::string ToString(const KVFormat& f);  // e.g. "tq-mse4", "int-asym4/g32", "f16"

// Encodes and decodes rows of one component for one (layer, head, role).
// Immutable after Create; thread-safe.
class KVRowCodec {
 public:
  static Result<KVRowCodec> Create(const KVFormat& format, size_t head_dim, const StreamId& stream);

  const KVFormat& format() const { return format_; }
  size_t head_dim() const { return head_dim_; }
  size_t row_bytes() const { return payload_bytes_ + meta_bytes_; }
  size_t payload_bytes() const { return payload_bytes_; }
  size_t meta_bytes() const { return meta_bytes_; }
  // Bytes of tables this codec needs at run time (rotation signs/matrices,
  // QJL matrix, codebook tables), for the byte ledger.
  size_t state_bytes() const;
  const Codec* codec() const { return codec_.get(); }          // kTurboMse/kTurboProd
  const SplitCodec* split() const { return split_.get(); }     // kTurboSplit

  // rows x head_dim floats (finite) -> rows x row_bytes(). Errors name the row.
  Status Encode(std::span<const float> x, std::span<uint8_t> out) const;
  Status Decode(std::span<const uint8_t> in, std::span<float> x) const;

 private:
  KVFormat format_;
  size_t head_dim_ = 0;
  size_t payload_bytes_ = 0;
  size_t meta_bytes_ = 0;
  std::shared_ptr<const Codec> codec_;
  std::shared_ptr<const SplitCodec> split_;
};

// A named pair of key and value formats.
struct KVPreset {
  std::string name;
  KVFormat key;
  KVFormat value;
  std::string description;
};

// Known preset names, in the order `tq bench kv` reports them.
std::vector<std::string> KVPresetNames();
// Unknown names fail and list the known ones.
Result<KVPreset> GetKVPreset(std::string_view name);
// Bytes of one (token, KV head) for keys + values, including every row's
// metadata, at this head_dim; and the same as bits per value.
Result<size_t> PresetBytesPerTokenHead(const KVPreset& preset, size_t head_dim);
Result<double> PresetBitsPerValue(const KVPreset& preset, size_t head_dim);

// Where dense tokens are kept, and which layers get which preset.
struct KVPolicy {
  size_t recent_window = 128;  // newest tokens kept dense
  size_t sink_tokens = 4;      // first tokens kept dense
  size_t compress_chunk = 32;  // history is encoded this many tokens at a time
  Half16 dense_type = Half16::kF16;  // storage of sinks and the recent window
  size_t dense_first_layers = 0;     // these layers use boundary_preset
  size_t dense_last_layers = 0;
  std::string boundary_preset = "k16_v16";
  std::map<size_t, std::string> layer_presets;  // per-layer overrides (highest priority)
  bool center_keys = true;     // subtract a per-(layer, sequence, head) key mean
  bool center_values = false;  // same for values
  uint64_t seed = 0;
};

// Preset that layer `layer` of `num_layers` uses under this policy.
std::string PresetForLayer(const KVPolicy& policy, const std::string& preset, size_t layer,
                           size_t num_layers);

struct ModelShape {
  size_t num_layers = 0;
  size_t num_kv_heads = 0;
  size_t head_dim = 0;
};

struct AutoPolicyResult {
  std::string preset;
  KVPolicy policy;
  size_t bytes = 0;        // predicted cache bytes at (batch, context)
  std::string reason;      // why this preset (and why not the better ones)
};

// Picks the highest-quality preset whose cache for `batch` sequences of
// `context` tokens fits `budget_bytes`, keeping 2 boundary layers at 8 bits
// when the budget allows. Fails (listing the smallest need) if none fits.
Result<AutoPolicyResult> AutoPolicy(const ModelShape& shape, size_t batch, size_t context,
                                    size_t budget_bytes, const KVPolicy& base = {});

}  // namespace tq

#endif  // TQ_KV_FORMAT_H_
