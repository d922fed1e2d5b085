// KV row formats, presets, policy helpers and the automatic policy.
#include "tq/kv_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>

#include "core/plan.h"
#include "ref/kernels.h"
#include "tq/format.h"

namespace tq {

namespace {

std::string Str(size_t v) { return std::to_string(v); }

Status CheckFinite(std::span<const float> x, size_t dim) {
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) {
      return InvalidArgumentError("row " + Str(i / dim) + ", column " + Str(i % dim) +
                                  " is not finite; KV inputs must be finite");
    }
  }
  return Status::Ok();
}

// Rounds to nearest, ties away from zero (std::round), as int.
int RoundInt(float v) { return static_cast<int>(std::round(v)); }

std::string GroupName(size_t g) {
  if (g == kGroupAuto) return "g32";
  if (g == kGroupRow) return "row";
  return "g" + Str(g);
}

}  // namespace

std::string ToString(const KVFormat& f) {
  switch (f.kind) {
    case KVFormatKind::kDense16: return f.half == Half16::kBF16 ? "bf16" : "f16";
    case KVFormatKind::kInt8Sym: return "int8-sym/" + GroupName(f.group_size);
    case KVFormatKind::kIntAsym: return "int-asym" + std::to_string(f.bits) + "/" + GroupName(f.group_size);
    case KVFormatKind::kTurboMse: return "tq-mse" + std::to_string(f.bits);
    case KVFormatKind::kTurboProd: return "tq-prod" + std::to_string(f.bits);
    case KVFormatKind::kTurboSplit:
      return f.recipe + (f.split_kind == CodecKind::kProd ? "-prod" : "-mse");
  }
  return "unknown";
}

Result<KVRowCodec> KVRowCodec::Create(const KVFormat& f, size_t d, const StreamId& stream) {
  if (d == 0 || d > 4096) {
    return InvalidArgumentError("KV head_dim must be in 1..4096, got " + Str(d));
  }
  if (f.rotation == RotationKind::kMix) {
    // The attention kernels rotate queries and outputs through the Hadamard
    // and Haar paths only; 'mix' is a search-index rotation.
    return InvalidArgumentError(
        "KV formats accept rotations rht, block and haar; 'mix' is for vector indexes");
  }
  KVRowCodec c;
  c.format_ = f;
  c.head_dim_ = d;
  switch (f.kind) {
    case KVFormatKind::kDense16:
      if (f.half != Half16::kF16 && f.half != Half16::kBF16) {
        return InvalidArgumentError("dense KV format must be f16 or bf16");
      }
      c.payload_bytes_ = 2 * d;
      return c;
    case KVFormatKind::kInt8Sym:
    case KVFormatKind::kIntAsym: {
      if (f.group_size == kGroupAuto) c.format_.group_size = std::gcd(size_t{32}, d);
      if (f.group_size == kGroupRow) c.format_.group_size = d;
      if (d % c.format_.group_size != 0) {
        return InvalidArgumentError("group_size " + Str(f.group_size) +
                                    " must divide head_dim " + Str(d) + " (or be kGroupAuto / kGroupRow)");
      }
      if (f.kind == KVFormatKind::kInt8Sym) {
        if (f.bits != 8) return InvalidArgumentError("int8-sym format has 8 bits, got " + std::to_string(f.bits));
        c.payload_bytes_ = d;
        c.meta_bytes_ = 2 * (d / c.format_.group_size);
      } else {
        if (f.bits != 2 && f.bits != 3 && f.bits != 4 && f.bits != 8) {
          return InvalidArgumentError("int-asym bits must be 2, 3, 4 or 8, got " + std::to_string(f.bits));
        }
        c.payload_bytes_ = PackedBytes(d, f.bits);
        c.meta_bytes_ = 4 * (d / c.format_.group_size);
      }
      return c;
    }
    case KVFormatKind::kTurboMse:
    case KVFormatKind::kTurboProd: {
      CodecSpec spec{.dim = d, .bits = f.bits,
                     .kind = f.kind == KVFormatKind::kTurboProd ? CodecKind::kProd : CodecKind::kMse,
                     .rotation = f.rotation, .norm_correction = true, .stream = stream};
      TQ_ASSIGN_OR_RETURN(Codec codec, Codec::Create(spec));
      const CodecPlan& p = codec.plan();
      c.payload_bytes_ = p.index_bytes + p.sign_bytes;
      c.meta_bytes_ = p.row_bytes - c.payload_bytes_;
      c.codec_ = std::make_shared<const Codec>(std::move(codec));
      return c;
    }
    case KVFormatKind::kTurboSplit: {
      TQ_ASSIGN_OR_RETURN(SplitSpec spec, SplitRecipe(f.recipe, d, {}, stream));
      spec.kind = f.split_kind;
      spec.rotation = f.rotation;
      TQ_ASSIGN_OR_RETURN(SplitCodec split, SplitCodec::Create(spec));
      c.payload_bytes_ = split.row_bytes();
      c.split_ = std::make_shared<const SplitCodec>(std::move(split));
      return c;
    }
  }
  return InvalidArgumentError("unknown KV format kind " + std::to_string(static_cast<int>(f.kind)));
}

size_t KVRowCodec::state_bytes() const {
  auto codec_state = [](const Codec& c) {
    const CodecPlan& p = c.plan();
    size_t bytes = p.hadamard ? 2 * p.dim * sizeof(float) : 2 * p.dim * p.dim * sizeof(float);
    bytes += 2 * p.qjl_dim * p.dim * sizeof(float);
    for (size_t b = 0; b < p.num_blocks; ++b) {
      if (c.codebook(b) != nullptr) bytes += (2 * c.codebook(b)->size() - 1) * sizeof(float);
    }
    return bytes;
  };
  if (codec_) return codec_state(*codec_);
  if (split_) return codec_state(split_->regular()) + codec_state(split_->outlier());
  return 0;
}

Status KVRowCodec::Encode(std::span<const float> x, std::span<uint8_t> out) const {
  const size_t d = head_dim_;
  if (x.size() % d != 0 || out.size() != x.size() / d * row_bytes()) {
    return InvalidArgumentError("KV encode: " + Str(x.size()) + " floats (head_dim " + Str(d) +
                                ") do not match " + Str(out.size()) + " bytes (" +
                                Str(row_bytes()) + " per row)");
  }
  if (codec_) return codec_->Encode(x, out);
  if (split_) return split_->Encode(x, out);
  TQ_RETURN_IF_ERROR(CheckFinite(x, d));
  const size_t rows = x.size() / d;
  const size_t rb = row_bytes();
  const size_t g = format_.group_size;
  for (size_t r = 0; r < rows; ++r) {
    const float* xr = x.data() + r * d;
    uint8_t* o = out.data() + r * rb;
    switch (format_.kind) {
      case KVFormatKind::kDense16:
        for (size_t j = 0; j < d; ++j) {
          const uint16_t h = format_.half == Half16::kF16 ? FloatToHalf(xr[j]) : FloatToBFloat16(xr[j]);
          if (format_.half == Half16::kF16 && (h & 0x7C00u) == 0x7C00u) {
            return OutOfRangeError("KV row " + Str(r) + ", column " + Str(j) + " (" +
                                   std::to_string(xr[j]) + ") overflows fp16; use bf16");
          }
          StoreLE16(h, o + 2 * j);
        }
        break;
      case KVFormatKind::kInt8Sym:
        for (size_t g0 = 0; g0 < d; g0 += g) {
          float amax = 0;
          for (size_t j = g0; j < g0 + g; ++j) amax = std::max(amax, std::fabs(xr[j]));
          const uint16_t hs = FloatToHalf(amax / 127.0f);
          if ((hs & 0x7C00u) == 0x7C00u) {
            return OutOfRangeError("KV row " + Str(r) + ": int8 group scale overflows fp16");
          }
          StoreLE16(hs, o + d + 2 * (g0 / g));
          const float s = HalfToFloat(hs);
          for (size_t j = g0; j < g0 + g; ++j) {
            const int q = s > 0 ? std::clamp(RoundInt(xr[j] / s), -127, 127) : 0;
            o[j] = static_cast<uint8_t>(static_cast<int8_t>(q));
          }
        }
        break;
      case KVFormatKind::kIntAsym: {
        const int levels = (1 << format_.bits) - 1;
        std::vector<uint8_t> q(d);
        uint8_t* meta = o + payload_bytes_;
        for (size_t g0 = 0; g0 < d; g0 += g) {
          float mn = xr[g0], mx = xr[g0];
          for (size_t j = g0; j < g0 + g; ++j) {
            mn = std::min(mn, xr[j]);
            mx = std::max(mx, xr[j]);
          }
          const uint16_t hs = FloatToHalf((mx - mn) / static_cast<float>(levels));
          const uint16_t hz = FloatToHalf(mn);
          if ((hs & 0x7C00u) == 0x7C00u || (hz & 0x7C00u) == 0x7C00u) {
            return OutOfRangeError("KV row " + Str(r) + ": group scale or zero overflows fp16");
          }
          StoreLE16(hs, meta + 4 * (g0 / g));
          StoreLE16(hz, meta + 4 * (g0 / g) + 2);
          const float s = HalfToFloat(hs), z = HalfToFloat(hz);
          for (size_t j = g0; j < g0 + g; ++j) {
            q[j] = static_cast<uint8_t>(s > 0 ? std::clamp(RoundInt((xr[j] - z) / s), 0, levels) : 0);
          }
        }
        ref::PackBits(q.data(), d, format_.bits, o);
        break;
      }
      default:
        return InternalError("KV encode: no codec for " + ToString(format_));
    }
  }
  return Status::Ok();
}

Status KVRowCodec::Decode(std::span<const uint8_t> in, std::span<float> x) const {
  const size_t d = head_dim_;
  if (in.size() % row_bytes() != 0 || x.size() != in.size() / row_bytes() * d) {
    return InvalidArgumentError("KV decode: " + Str(in.size()) + " bytes (" + Str(row_bytes()) +
                                " per row) do not match " + Str(x.size()) + " floats");
  }
  if (codec_) return codec_->Decode(in, x);
  if (split_) return split_->Decode(in, x);
  const size_t rows = in.size() / row_bytes();
  const size_t rb = row_bytes();
  const size_t g = format_.group_size;
  std::vector<uint8_t> q(d);
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* c = in.data() + r * rb;
    float* xr = x.data() + r * d;
    switch (format_.kind) {
      case KVFormatKind::kDense16:
        for (size_t j = 0; j < d; ++j) {
          const uint16_t h = LoadLE16(c + 2 * j);
          xr[j] = format_.half == Half16::kF16 ? HalfToFloat(h) : BFloat16ToFloat(h);
        }
        break;
      case KVFormatKind::kInt8Sym:
        for (size_t j = 0; j < d; ++j) {
          const float s = HalfToFloat(LoadLE16(c + d + 2 * (j / g)));
          xr[j] = static_cast<float>(static_cast<int8_t>(c[j])) * s;
        }
        break;
      case KVFormatKind::kIntAsym: {
        ref::UnpackBits(c, d, format_.bits, q.data());
        const uint8_t* meta = c + payload_bytes_;
        for (size_t j = 0; j < d; ++j) {
          const float s = HalfToFloat(LoadLE16(meta + 4 * (j / g)));
          const float z = HalfToFloat(LoadLE16(meta + 4 * (j / g) + 2));
          xr[j] = static_cast<float>(q[j]) * s + z;
        }
        break;
      }
      default:
        return InternalError("KV decode: no codec for " + ToString(format_));
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Presets.
// ---------------------------------------------------------------------------
namespace {

KVFormat KeyBits(int k) {
  if (k == 16) return {.kind = KVFormatKind::kDense16, .bits = 16};
  if (k == 8) return {.kind = KVFormatKind::kInt8Sym, .bits = 8, .group_size = kGroupAuto};
  return {.kind = KVFormatKind::kTurboMse, .bits = k};
}

KVFormat ValueBits(int v) {
  if (v == 16) return {.kind = KVFormatKind::kDense16, .bits = 16};
  if (v == 8) return {.kind = KVFormatKind::kIntAsym, .bits = 8, .group_size = kGroupAuto};
  return {.kind = KVFormatKind::kTurboMse, .bits = v};
}

std::vector<KVPreset> BuildPresets() {
  std::vector<KVPreset> p;
  const int widths[] = {16, 8, 4, 3, 2};
  for (int k : widths) {
    for (int v : widths) {
      KVPreset preset{"k" + std::to_string(k) + "_v" + std::to_string(v), KeyBits(k), ValueBits(v),
                      ""};
      preset.description = "keys " + ToString(preset.key) + ", values " + ToString(preset.value);
      p.push_back(preset);
    }
  }
  // QJL keys: explicit opt-in (practitioners report QJL variance hurts softmax).
  for (int k : {4, 3}) {
    KVPreset preset{"kp" + std::to_string(k) + "_v" + std::to_string(k),
                    {.kind = KVFormatKind::kTurboProd, .bits = k}, ValueBits(k), ""};
    preset.description = "keys " + ToString(preset.key) + " (unbiased, higher variance), values " +
                         ToString(preset.value);
    p.push_back(preset);
  }
  for (const char* recipe : {"turboquant25", "turboquant35"}) {
    KVPreset preset{recipe,
                    {.kind = KVFormatKind::kTurboSplit, .recipe = recipe, .split_kind = CodecKind::kProd},
                    {.kind = KVFormatKind::kTurboSplit, .recipe = recipe, .split_kind = CodecKind::kMse},
                    ""};
    preset.description = std::string("outlier split (paper Sec. 4.3): keys ") +
                         ToString(preset.key) + ", values " + ToString(preset.value);
    p.push_back(preset);
  }
  // KIVI-class group-integer baselines and an 8-bit baseline.
  for (int b : {4, 2}) {
    KVFormat f{.kind = KVFormatKind::kIntAsym, .bits = b, .group_size = kGroupAuto};
    p.push_back({"kivi" + std::to_string(b), f, f,
                 "group-integer baseline: keys and values " + ToString(f) + " (per token)"});
  }
  p.push_back({"q8", KeyBits(8), ValueBits(8), "8-bit baseline: keys int8-sym/g32, values int-asym8/g32"});
  // vLLM upstream cache dtypes, mapped to our closest equivalents: FP8 keys
  // become int8 per-group keys; "v4"/"v3" are uniform integer values with one
  // scale and zero per row (group = head_dim, set when the codec is built).
  const KVFormat row_int4{.kind = KVFormatKind::kIntAsym, .bits = 4, .group_size = kGroupRow};
  const KVFormat row_int3{.kind = KVFormatKind::kIntAsym, .bits = 3, .group_size = kGroupRow};
  p.push_back({"turboquant_k8v4", KeyBits(8), row_int4, "vLLM alias: int8 keys, 4-bit uniform values"});
  p.push_back({"turboquant_4bit_nc", KeyBits(4), row_int4,
               "vLLM alias: tq-mse4 keys (norm-corrected), 4-bit uniform values"});
  p.push_back({"turboquant_k3v4_nc", KeyBits(3), row_int4,
               "vLLM alias: tq-mse3 keys (norm-corrected), 4-bit uniform values"});
  p.push_back({"turboquant_3bit_nc", KeyBits(3), row_int3,
               "vLLM alias: tq-mse3 keys (norm-corrected), 3-bit uniform values"});
  return p;
}

const std::vector<KVPreset>& Presets() {
  static const std::vector<KVPreset>* presets = new std::vector<KVPreset>(BuildPresets());
  return *presets;
}

}  // namespace

std::vector<std::string> KVPresetNames() {
  std::vector<std::string> names;
  for (const auto& p : Presets()) names.push_back(p.name);
  return names;
}

Result<KVPreset> GetKVPreset(std::string_view name) {
  for (const auto& p : Presets()) {
    if (p.name == name) return p;
  }
  std::string known;
  for (const auto& p : Presets()) known += (known.empty() ? "" : ", ") + p.name;
  return InvalidArgumentError("unknown KV preset '" + std::string(name) + "'; known presets: " + known);
}

Result<size_t> PresetBytesPerTokenHead(const KVPreset& preset, size_t head_dim) {
  TQ_ASSIGN_OR_RETURN(KVRowCodec k, KVRowCodec::Create(preset.key, head_dim, {}));
  TQ_ASSIGN_OR_RETURN(KVRowCodec v, KVRowCodec::Create(preset.value, head_dim, {}));
  return k.row_bytes() + v.row_bytes();
}

Result<double> PresetBitsPerValue(const KVPreset& preset, size_t head_dim) {
  TQ_ASSIGN_OR_RETURN(size_t bytes, PresetBytesPerTokenHead(preset, head_dim));
  return 8.0 * static_cast<double>(bytes) / (2.0 * static_cast<double>(head_dim));
}

std::string PresetForLayer(const KVPolicy& policy, const std::string& preset, size_t layer,
                           size_t num_layers) {
  auto it = policy.layer_presets.find(layer);
  if (it != policy.layer_presets.end()) return it->second;
  if (layer < policy.dense_first_layers || layer + policy.dense_last_layers >= num_layers) {
    return policy.boundary_preset;
  }
  return preset;
}

Result<AutoPolicyResult> AutoPolicy(const ModelShape& shape, size_t batch, size_t context,
                                    size_t budget_bytes, const KVPolicy& base) {
  if (shape.num_layers == 0 || shape.num_kv_heads == 0 || shape.head_dim == 0 || batch == 0 ||
      context == 0) {
    return InvalidArgumentError("AutoPolicy needs layers, kv_heads, head_dim, batch and context >= 1");
  }
  // Best quality first (measured order of key/value error; keys matter most).
  static const char* kOrder[] = {"k16_v16", "k8_v8", "k8_v4", "k4_v8", "k4_v4", "turboquant35",
                                 "k4_v3", "k3_v4", "k3_v3", "turboquant25", "k4_v2", "k3_v2",
                                 "k2_v3", "k2_v2"};
  const size_t d = shape.head_dim;
  const size_t dense_tokens = std::min(context, base.sink_tokens + base.recent_window + base.compress_chunk);
  const size_t dense_bytes_per_tok = 2 * 2 * d;  // K and V in 16-bit
  auto layer_bytes = [&](const std::string& name) -> Result<size_t> {
    TQ_ASSIGN_OR_RETURN(KVPreset p, GetKVPreset(name));
    TQ_ASSIGN_OR_RETURN(size_t row, PresetBytesPerTokenHead(p, d));
    const size_t compressed = context - dense_tokens;
    return batch * shape.num_kv_heads * (compressed * row + dense_tokens * dense_bytes_per_tok);
  };
  std::string rejected;
  for (int boundary : {2, 0}) {
    if (boundary == 2 && shape.num_layers < 6) continue;
    for (const char* name : kOrder) {
      size_t total = 0;
      KVPolicy pol = base;
      pol.dense_first_layers = boundary / 2;
      pol.dense_last_layers = boundary / 2;
      pol.boundary_preset = "k8_v8";
      for (size_t l = 0; l < shape.num_layers; ++l) {
        TQ_ASSIGN_OR_RETURN(size_t lb, layer_bytes(PresetForLayer(pol, name, l, shape.num_layers)));
        total += lb;
      }
      if (total <= budget_bytes) {
        AutoPolicyResult r{name, pol, total, ""};
        r.reason = "chose " + std::string(name) + " (" + Str(total) + " bytes for " + Str(batch) +
                   " x " + Str(context) + " tokens, budget " + Str(budget_bytes) + ")" +
                   (boundary ? ", first and last layer at k8_v8" : ", no boundary layers") +
                   (rejected.empty() ? "" : "; better presets that did not fit: " + rejected);
        return r;
      }
      if (boundary == 0 || rejected.find(name) == std::string::npos) {
        rejected += (rejected.empty() ? "" : ", ") + std::string(name) + " needs " + Str(total);
      }
    }
  }
  return OutOfRangeError("no preset fits " + Str(budget_bytes) + " bytes for " + Str(batch) + " x " +
                         Str(context) + " tokens; " + rejected);
}

}  // namespace tq
