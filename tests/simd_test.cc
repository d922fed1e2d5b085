// SIMD kernels (src/cpu) against the scalar reference (src/ref), on every
// Highway target this build compiled and this CPU supports.
//
// Code bytes must be bit-identical: they are a persisted format and must not
// depend on the SIMD target. The only exception is the value of a scale that is
// NaN (a row whose input is not finite, or whose rotation overflows to Inf -
// Inf): the sign and payload of such a NaN depend on operand order, which
// neither the compiled reference nor the kernels pin down. EncodeRows reports
// such rows as bad, so only "both NaN" is required there.
//
// Decoded floats and scores need not be bit-identical. Tolerance derivation:
// both sides compute the same real-number expression with IEEE fp32 in a
// different order (vector accumulators, different association of sums). For
// a sum of n terms the difference between two orders is bounded by
// 2 * gamma_{n-1} * sum|term| with gamma_k = k u / (1 - k u), u = 2^-24. The
// longest sums here are n = 576 (QJL matrix-vector products and dots; the
// Hadamard path has only 2 log2(n) <= 20 additions per output), so the
// relative error of one output is at most ~2 * 576 * 6e-8 = 7e-5 in the worst
// case of total cancellation and ~sqrt(576) * 6e-8 = 1.4e-6 typically (random
// rounding errors add in quadrature). Measured as a normalized squared error
// (NMSE: squared error over the squared magnitude the terms can reach), the
// typical value is ~(1.4e-6)^2 = 2e-12 and even the worst case is
// (7e-5)^2 = 5e-9. So: NMSE over a batch <= 1e-5 (the acceptance bound, >= 3
// orders of magnitude of margin) and, to catch small systematic errors (e.g. a
// 0.1% error in one term), NMSE of every single row <= 1e-8, above the
// worst case. (Measured: decode 0, i.e. bit-identical; scores <= 1e-13.) For
// scores, the magnitude is |q| * |x_hat| (Cauchy-Schwarz: score = <q, x_hat>
// exactly in real arithmetic for both code kinds), so cancellation in a
// near-zero score cannot cause false failures.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/plan.h"
#include "cpu/cpu_features.h"
#include "cpu/dispatch.h"
#include "ref/kernels.h"
#include "simd_targets.h"
#include "tq/codec.h"
#include "tq/format.h"
#include "tq/random.h"
#include "tq/simd.h"

namespace tq {
namespace {

using testing::ForEachSimdTarget;

// Normalized squared error over a whole batch (the acceptance bound) and for
// any single row (above the worst case derived at the top of the file).
constexpr double kBatchNmse = 1e-5;
constexpr double kRowNmse = 1e-8;


// ---------------------------------------------------------------------------
// Test data.

enum class RowKind {
  kGaussian,      // N(0, s^2) with s log-uniform in [1e-3, 1e3]
  kWideRange,     // every value a Gaussian times 10^U(-30, 30)
  kTiny,          // ~1e-41: subnormal inputs, squares underflow to 0
  kSmall,         // ~1e-19: squares near the bottom of the normal range
  kZero,          // exact zeros
  kOneHot,        // a single nonzero (an outlier channel)
  kIntegers,      // small integers: exact FWHT, exact zeros -> ties at 0
  kHuge,          // ~1e18: fine for fp32 scales, not for fp16 ones
  kNearMax,       // ~1e37: sums of squares overflow, FWHT may overflow
};
constexpr RowKind kAllKinds[] = {RowKind::kGaussian, RowKind::kWideRange, RowKind::kTiny,
                                 RowKind::kSmall,    RowKind::kZero,      RowKind::kOneHot,
                                 RowKind::kIntegers, RowKind::kHuge,      RowKind::kNearMax};

void FillRow(RowKind kind, size_t dim, SplitMix64& bits, GaussianStream& gauss, float* row) {
  switch (kind) {
    case RowKind::kGaussian: {
      const double s = std::pow(10.0, -3.0 + 6.0 * bits.NextDouble());
      for (size_t j = 0; j < dim; ++j) row[j] = static_cast<float>(s * gauss.Next());
      break;
    }
    case RowKind::kWideRange:
      for (size_t j = 0; j < dim; ++j) {
        row[j] = static_cast<float>(gauss.Next() * std::pow(10.0, -30.0 + 60.0 * bits.NextDouble()));
      }
      break;
    case RowKind::kTiny:
      for (size_t j = 0; j < dim; ++j) row[j] = static_cast<float>(1e-41 * gauss.Next());
      break;
    case RowKind::kSmall:
      for (size_t j = 0; j < dim; ++j) row[j] = static_cast<float>(1e-19 * gauss.Next());
      break;
    case RowKind::kZero:
      for (size_t j = 0; j < dim; ++j) row[j] = 0.0f;
      break;
    case RowKind::kOneHot:
      for (size_t j = 0; j < dim; ++j) row[j] = 0.0f;
      row[bits.Next() % dim] = static_cast<float>(gauss.Next());
      break;
    case RowKind::kIntegers:
      for (size_t j = 0; j < dim; ++j) row[j] = static_cast<float>(static_cast<int>(bits.Next() % 5) - 2);
      break;
    case RowKind::kHuge:
      for (size_t j = 0; j < dim; ++j) row[j] = static_cast<float>(1e18 * gauss.Next());
      break;
    case RowKind::kNearMax:
      for (size_t j = 0; j < dim; ++j) row[j] = static_cast<float>(1e37 * gauss.Next());
      break;
  }
}

// rows x dim floats starting `misalign` floats into a larger buffer.
struct Rows {
  std::vector<float> storage;
  float* data = nullptr;
  std::vector<RowKind> kinds;
};
Rows MakeRows(size_t dim, size_t rows, uint64_t seed, size_t misalign) {
  Rows r;
  r.storage.assign(rows * dim + 16, 0.0f);
  r.data = r.storage.data() + misalign;
  SplitMix64 bits(seed);
  GaussianStream gauss(Mix64(seed ^ 0x5eed));
  for (size_t i = 0; i < rows; ++i) {
    // Mostly Gaussian rows, the special kinds interleaved at varying phases
    // so that they land in every position of a kernel's row batch.
    const RowKind kind = (bits.Next() % 3 == 0) ? kAllKinds[bits.Next() % std::size(kAllKinds)]
                                                : RowKind::kGaussian;
    r.kinds.push_back(kind);
    FillRow(kind, dim, bits, gauss, r.data + i * dim);
  }
  return r;
}

// ---------------------------------------------------------------------------
// Byte comparison.

float StoredScale(const CodecPlan& p, const uint8_t* q) {
  return p.scale_f16 ? HalfToFloat(LoadLE16(q)) : LoadFloatLE(q);
}

// Compares one code row; scale fields that are NaN in the reference only need
// to be NaN in the kernel's output too (see the top of the file).
void ExpectSameRow(const CodecPlan& p, const uint8_t* want, const uint8_t* got, size_t row,
                   const std::string& what) {
  std::vector<bool> nan_field(p.row_bytes, false);
  const size_t num_scales = p.mse_bits > 0 ? p.num_blocks : 0;
  std::vector<size_t> scale_offsets;
  for (size_t b = 0; b < num_scales; ++b) scale_offsets.push_back(p.scale_offset + b * p.scale_bytes);
  if (p.qjl_dim > 0) scale_offsets.push_back(p.resid_offset);
  for (const size_t off : scale_offsets) {
    if (std::isnan(StoredScale(p, want + off))) {
      EXPECT_TRUE(std::isnan(StoredScale(p, got + off))) << what << " row " << row << " scale at "
                                                         << off << " should be NaN";
      for (size_t k = 0; k < p.scale_bytes; ++k) nan_field[off + k] = true;
    }
  }
  for (size_t k = 0; k < p.row_bytes; ++k) {
    if (nan_field[k]) continue;
    if (want[k] != got[k]) {
      ADD_FAILURE() << what << ": row " << row << " byte " << k << " of " << p.row_bytes
                    << " differs: ref " << int{want[k]} << ", simd " << int{got[k]}
                    << " (index bytes " << p.index_bytes << ", sign bytes " << p.sign_bytes
                    << ", scales at " << p.scale_offset << ")";
      return;
    }
  }
}

constexpr size_t kGuard = 64;
constexpr uint8_t kGuardByte = 0xA5;

// Encodes with the kernels into a buffer surrounded by guard bytes, checks the
// guards, compares every row and the returned bad-row index with the reference.
void CheckEncode(const CodecPlan& p, const float* x, size_t rows, const std::string& what,
                 std::vector<uint8_t>* codes_out = nullptr) {
  std::vector<uint8_t> want(rows * p.row_bytes, 0);
  const size_t want_bad = ref::EncodeRows(p, x, rows, want.data());
  std::vector<uint8_t> buf(rows * p.row_bytes + 2 * kGuard, kGuardByte);
  uint8_t* got = buf.data() + kGuard;
  const size_t got_bad = cpu::EncodeRows(p, x, rows, got);
  EXPECT_EQ(want_bad, got_bad) << what << ": first bad row";
  for (size_t k = 0; k < kGuard; ++k) {
    ASSERT_EQ(buf[k], kGuardByte) << what << ": wrote " << (kGuard - k) << " bytes before the output";
    ASSERT_EQ(buf[kGuard + rows * p.row_bytes + k], kGuardByte)
        << what << ": wrote past the output (guard byte " << k << ")";
  }
  for (size_t r = 0; r < rows; ++r) {
    ExpectSameRow(p, want.data() + r * p.row_bytes, got + r * p.row_bytes, r, what);
    if (::testing::Test::HasFailure()) return;
  }
  if (codes_out != nullptr) *codes_out = want;
}

bool RowIsGood(const CodecPlan& p, const uint8_t* code) {
  const size_t num_scales = p.mse_bits > 0 ? p.num_blocks : 0;
  for (size_t b = 0; b < num_scales; ++b) {
    if (!std::isfinite(StoredScale(p, code + p.scale_offset + b * p.scale_bytes))) return false;
  }
  return p.qjl_dim == 0 || std::isfinite(StoredScale(p, code + p.resid_offset));
}

// Decodes and scores reference codes with the kernels and compares with the
// reference (rows with non-finite scales are skipped: their output is Inf/NaN).
void CheckDecodeAndScore(const CodecPlan& p, const std::vector<uint8_t>& codes, size_t rows,
                         uint64_t seed, const std::string& what) {
  const size_t d = p.dim;
  std::vector<uint8_t> good;
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* c = codes.data() + r * p.row_bytes;
    if (RowIsGood(p, c)) good.insert(good.end(), c, c + p.row_bytes);
  }
  const size_t n = good.size() / p.row_bytes;
  if (n == 0) return;

  std::vector<float> want(n * d), got(n * d + 2, 0.0f);
  ref::DecodeRows(p, good.data(), n, want.data());
  cpu::DecodeRows(p, good.data(), n, got.data() + 1);  // misaligned output
  double total_err = 0, total_energy = 0;
  for (size_t r = 0; r < n; ++r) {
    double err = 0, energy = 0;
    for (size_t j = 0; j < d; ++j) {
      const double w = want[r * d + j], g = got[r * d + 1 + j];
      err += (w - g) * (w - g);
      energy += w * w;
    }
    total_err += err;
    total_energy += energy;
    if (energy == 0) {
      EXPECT_EQ(err, 0) << what << ": decoded row " << r << " should be zero";
    } else {
      EXPECT_LE(err / energy, kRowNmse) << what << ": decoded row " << r << " NMSE";
    }
    if (::testing::Test::HasFailure()) return;
  }
  if (total_energy > 0) {
    EXPECT_LE(total_err / total_energy, kBatchNmse) << what << ": decode NMSE";
  }

  // A random query, prepared by the reference.
  std::vector<float> q(d), q_rot(d), q_sketch(p.qjl_dim);
  GaussianStream gauss(seed);
  double q_norm2 = 0;
  for (auto& v : q) {
    v = static_cast<float>(gauss.Next());
    q_norm2 += double{v} * v;
  }
  ref::PrepareQuery(p, q.data(), q_rot.data(), q_sketch.data());
  std::vector<float> want_s(n), got_s(n + 1);
  ref::ScoreRows(p, q_rot.data(), q_sketch.data(), good.data(), n, want_s.data());
  cpu::ScoreRows(p, q_rot.data(), q_sketch.data(), good.data(), n, got_s.data() + 1);
  double score_err = 0, score_scale = 0;
  for (size_t r = 0; r < n; ++r) {
    double x_norm2 = 0;
    for (size_t j = 0; j < d; ++j) x_norm2 += double{want[r * d + j]} * want[r * d + j];
    const double diff = double{want_s[r]} - got_s[r + 1];
    const double scale2 = q_norm2 * x_norm2;
    if (scale2 == 0 || !std::isfinite(scale2)) {
      EXPECT_LE(std::abs(diff), 1e-30 + 1e-4 * std::abs(want_s[r])) << what << ": score " << r;
    } else {
      score_err += diff * diff;
      score_scale += scale2;
      EXPECT_LE(diff * diff / scale2, kRowNmse) << what << ": score " << r << " (ref "
                                                 << want_s[r] << ", simd " << got_s[r + 1] << ")";
    }
    if (::testing::Test::HasFailure()) return;
  }
  if (score_scale > 0) {
    EXPECT_LE(score_err / score_scale, kBatchNmse) << what << ": score NMSE";
  }
}

std::string Describe(const CodecSpec& s) { return ToString(s); }

Codec MustCreate(const CodecSpec& spec) {
  Result<Codec> c = Codec::Create(spec);
  TQ_CHECK(c.ok());
  return c.value();
}

// ---------------------------------------------------------------------------

TEST(SimdTest, TargetsAndNames) {
  const std::vector<int64_t> targets = cpu::AvailableTargets();
  ASSERT_FALSE(targets.empty());
  const std::string default_name = ActiveSimdTarget();
  EXPECT_EQ(default_name, cpu::TargetName(targets.front())) << "dispatch should pick the best";
  ForEachSimdTarget([&](int64_t target) {
    EXPECT_STREQ(ActiveSimdTarget(), cpu::TargetName(target));
    // Forcing must not shrink the list the tests iterate over.
    EXPECT_EQ(cpu::AvailableTargets(), targets);
  });
  EXPECT_EQ(default_name, ActiveSimdTarget());
}

// The CPU features detected in one place agree with what Highway found
// (its AVX3_DL target requires AVX-512 VNNI and VBMI), and the model string
// benchmarks print is readable text with the family and model numbers.
TEST(SimdTest, HostCpuAgreesWithHighway) {
  const cpu::CpuFeatures& f = cpu::HostCpu();
  bool avx3_dl = false;
  for (int64_t t : cpu::AvailableTargets()) avx3_dl |= std::string(cpu::TargetName(t)) == "AVX3_DL";
  if (avx3_dl) {
    EXPECT_TRUE(f.avx512_vnni);
    EXPECT_TRUE(f.avx512_vbmi);
  }
  const std::string m = CpuModel();
  ASSERT_FALSE(m.empty());
  EXPECT_EQ(m, f.model);
  for (char c : m) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "non-printable byte in the CPU model: " << m;
#if defined(__x86_64__) || defined(__i386__)
  EXPECT_NE(m.find("(family "), std::string::npos) << m;
#endif
}

// The public form (tq bench attention --simd): names in, clear errors out.
TEST(SimdTest, ForceSimdTargetByName) {
  const std::vector<std::string> names = SimdTargets();
  ASSERT_FALSE(names.empty());
  const std::string default_name = ActiveSimdTarget();
  EXPECT_EQ(names.front(), default_name);
  for (const std::string& n : names) {
    ASSERT_TRUE(ForceSimdTarget(n).ok()) << n;
    EXPECT_EQ(n, ActiveSimdTarget());
  }
  const Status bad = ForceSimdTarget("AVX9");
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("AVX9"), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find(names.front()), std::string::npos) << "lists the accepted names: " << bad.message();
  EXPECT_EQ(names.back(), ActiveSimdTarget()) << "a refused name leaves the forced target as it was";
  ASSERT_TRUE(ForceSimdTarget("").ok());
  EXPECT_EQ(default_name, ActiveSimdTarget());
}

constexpr size_t kDims[] = {1,  2,  3,   7,   8,   9,   15,  16,  17,  31,  32,  33,  63,
                            64, 65, 80,  96,  112, 127, 128, 129, 160, 192, 256, 576};

// Rows per configuration: several hundred for small dims, fewer for large ones
// (the reference is slow there), always more than two kernel batches.
size_t RowsFor(size_t dim, CodecKind kind) {
  const size_t budget = kind == CodecKind::kProd ? 12000 : 60000;
  return std::clamp<size_t>(budget / dim, 40, 300);
}

// Every kind x bits x dim x rotation; norm correction and scale dtype cycle
// through all four combinations across the configurations (CrossOptions
// below covers all four on a few dims).
TEST(SimdTest, EncodeMatchesReferenceBitForBit) {
  size_t counter = 0;
  for (const CodecKind kind : {CodecKind::kMse, CodecKind::kProd}) {
    for (int bits = 1; bits <= 8; ++bits) {
      for (const size_t dim : kDims) {
        for (const RotationKind rot : {RotationKind::kBlockHadamard, RotationKind::kHaar}) {
          if (rot == RotationKind::kHaar && dim > 256) continue;
          CodecSpec spec;
          spec.dim = dim;
          spec.bits = bits;
          spec.kind = kind;
          spec.rotation = rot;
          spec.norm_correction = (counter & 1) == 0;
          spec.scale_dtype = (counter & 2) == 0 ? ScaleDtype::kF16 : ScaleDtype::kF32;
          spec.stream.seed = 1000 + counter;
          const size_t rows = RowsFor(dim, kind);
          const Rows data = MakeRows(dim, rows, 77 + counter, counter % 4);
          const Codec codec = MustCreate(spec);
          const std::string what = Describe(spec);
          ForEachSimdTarget([&](int64_t) {
            std::vector<uint8_t> codes;
            CheckEncode(codec.plan(), data.data, rows, what, &codes);
            if (!::testing::Test::HasFailure()) CheckDecodeAndScore(codec.plan(), codes, rows, spec.stream.seed, what);
          });
          if (::testing::Test::HasFailure()) return;  // one failing configuration is enough to debug
          ++counter;
        }
      }
    }
  }
}

TEST(SimdTest, CrossOptions) {
  size_t counter = 0;
  for (const size_t dim : {size_t{1}, size_t{17}, size_t{80}, size_t{128}, size_t{576}}) {
    for (const CodecKind kind : {CodecKind::kMse, CodecKind::kProd}) {
      for (const int bits : {1, 2, 3, 4, 5, 8}) {
        for (const bool nc : {false, true}) {
          for (const ScaleDtype sd : {ScaleDtype::kF16, ScaleDtype::kF32}) {
            for (const CodebookFamily fam : {CodebookFamily::kSphere, CodebookFamily::kGaussian}) {
              CodecSpec spec;
              spec.dim = dim;
              spec.bits = bits;
              spec.kind = kind;
              spec.norm_correction = nc;
              spec.scale_dtype = sd;
              spec.codebook = fam;
              spec.stream.seed = 5000 + counter;
              if (kind == CodecKind::kProd && (counter % 3) == 0) spec.qjl_dim = dim / 2 + 3;
              const Codec codec = MustCreate(spec);
              const size_t rows = std::min<size_t>(RowsFor(dim, kind), 64);
              const Rows data = MakeRows(dim, rows, 900 + counter, (counter + 1) % 4);
              ForEachSimdTarget([&](int64_t) {
                std::vector<uint8_t> codes;
                CheckEncode(codec.plan(), data.data, rows, Describe(spec), &codes);
                if (!::testing::Test::HasFailure()) {
                  CheckDecodeAndScore(codec.plan(), codes, rows, spec.stream.seed, Describe(spec));
                }
              });
              if (::testing::Test::HasFailure()) return;
              ++counter;
            }
          }
        }
      }
    }
  }
}

// Rows with NaN, Inf or norms beyond the fp16 range: EncodeRows must return
// the reference's first bad row, wherever it falls in the kernels' batches.
TEST(SimdTest, FirstBadRowMatchesReference) {
  for (const size_t dim : {size_t{7}, size_t{64}, size_t{80}, size_t{128}, size_t{256}}) {
    for (const CodecKind kind : {CodecKind::kMse, CodecKind::kProd}) {
      for (const ScaleDtype sd : {ScaleDtype::kF16, ScaleDtype::kF32}) {
        CodecSpec spec;
        spec.dim = dim;
        spec.bits = 3;
        spec.kind = kind;
        spec.scale_dtype = sd;
        const Codec codec = MustCreate(spec);
        const CodecPlan& p = codec.plan();
        constexpr size_t kRowsN = 53;  // several batches and an odd tail
        for (const size_t bad_row : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17},
                                     size_t{33}, size_t{52}}) {
          for (int what = 0; what < 5; ++what) {
            Rows data = MakeRows(dim, kRowsN, 31 * bad_row + what, bad_row % 3);
            float* row = data.data + bad_row * dim;
            switch (what) {
              case 0: row[dim / 2] = std::numeric_limits<float>::quiet_NaN(); break;
              case 1: row[0] = std::numeric_limits<float>::infinity(); break;
              case 2: row[dim - 1] = -std::numeric_limits<float>::infinity(); break;
              case 3:  // norm ~1e5 > 65504: bad for fp16 scales only
                for (size_t j = 0; j < dim; ++j) row[j] = (j % 2 ? 1e5f : -1e5f) / std::sqrt(1.0f * dim) * 1.5f;
                break;
              case 4:  // a later row also bad: the first one must be reported
                row[0] = std::numeric_limits<float>::quiet_NaN();
                if (bad_row + 5 < kRowsN) data.data[(bad_row + 5) * dim] = 1e30f;
                break;
            }
            // Keep the other rows good (the generator also makes huge rows).
            for (size_t r = 0; r < kRowsN; ++r) {
              if (r == bad_row || (what == 4 && r == bad_row + 5)) continue;
              if (data.kinds[r] == RowKind::kHuge || data.kinds[r] == RowKind::kNearMax ||
                  data.kinds[r] == RowKind::kWideRange) {
                for (size_t j = 0; j < dim; ++j) data.data[r * dim + j] = 0.5f;
              }
            }
            const std::string label = Describe(spec) + " bad row " + std::to_string(bad_row) +
                                      " case " + std::to_string(what);
            ForEachSimdTarget([&](int64_t) {
              std::vector<uint8_t> ref_codes(kRowsN * p.row_bytes);
              const size_t want = ref::EncodeRows(p, data.data, kRowsN, ref_codes.data());
              if (what != 3 || sd == ScaleDtype::kF16) {
                EXPECT_EQ(want, bad_row) << label << ": test premise";
              }
              CheckEncode(p, data.data, kRowsN, label);
            });
            if (::testing::Test::HasFailure()) return;
          }
        }
      }
    }
  }
}

// Quantization ties: values exactly on a boundary take the upper cell. Real
// codebooks are hit at 0 by integer rows (see RowKind::kIntegers); here the
// boundaries are made of the row's own normalized coordinates, so that every
// boundary is hit exactly, including repeated boundaries. Also unsorted and
// NaN boundary tables, which the kernels must handle by counting.
TEST(SimdTest, CraftedTies) {
  for (const size_t dim : {size_t{16}, size_t{33}, size_t{64}, size_t{80}, size_t{128},
                           size_t{256}, size_t{576}}) {
    for (const int bits : {1, 2, 3, 4, 5, 6, 8}) {
      for (int variant = 0; variant < 4; ++variant) {
        CodecSpec spec;
        spec.dim = dim;
        spec.bits = bits;
        spec.stream.seed = 17 * dim + bits;
        const Codec codec = MustCreate(spec);
        CodecPlan p = codec.plan();  // a copy whose tables we replace
        const Rows data = MakeRows(dim, 1, 4242 + dim * 10 + bits, 3);
        // What the reference computes for u = y / ||y_block|| (ref::EncodeRows'
        // exact arithmetic, reproduced step by step).
        std::vector<float> y(dim);
        ref::Rotate(p, data.data, y.data());
        const size_t nlev = size_t{1} << bits;
        std::vector<std::vector<float>> bnd(p.num_blocks), cen(p.num_blocks);
        SplitMix64 pick(variant * 1000 + dim + bits);
        for (size_t b = 0; b < p.num_blocks; ++b) {
          const BlockPlan& bp = p.blocks[b];
          const float norm = std::sqrt(ref::SumSquares16(y.data() + bp.offset, bp.size));
          const float inv = norm >= 0x1p-126f ? 1.0f / norm : 0.0f;
          std::vector<float> u(bp.size);
          for (size_t j = 0; j < bp.size; ++j) u[j] = y[bp.offset + j] * inv;
          std::vector<float>& t = bnd[b];
          for (size_t k = 0; k + 1 < nlev; ++k) t.push_back(u[pick.Next() % bp.size]);
          if (variant == 1 && t.size() >= 3) t[1] = t[2];  // repeated boundary
          if (variant != 2) std::sort(t.begin(), t.end());
          if (variant == 3) t[t.size() / 2] = std::numeric_limits<float>::quiet_NaN();
          cen[b].resize(nlev);
          for (size_t k = 0; k < nlev; ++k) cen[b][k] = -1.0f + 2.0f * k / (nlev - 1) + 0.01f * k;
          p.blocks[b].boundaries = t.data();
          p.blocks[b].centroids = cen[b].data();
        }
        const std::string label = "ties dim " + std::to_string(dim) + " bits " +
                                  std::to_string(bits) + " variant " + std::to_string(variant);
        ForEachSimdTarget([&](int64_t) {
          // One row alone, and the same row twice plus others (batch paths).
          CheckEncode(p, data.data, 1, label);
          std::vector<float> three(3 * dim);
          std::copy(data.data, data.data + dim, three.begin());
          std::copy(data.data, data.data + dim, three.begin() + dim);
          for (size_t j = 0; j < dim; ++j) three[2 * dim + j] = data.data[j] * 0.5f;
          CheckEncode(p, three.data(), 3, label + " x3");
        });
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
}

// Encode, decode and score run concurrently from several threads
// (Codec::Encode's thread pool); the kernels must be reentrant.
TEST(SimdTest, ConcurrentCallsAreIndependent) {
  CodecSpec spec;
  spec.dim = 80;
  spec.bits = 3;
  const Codec mse = MustCreate(spec);
  spec.kind = CodecKind::kProd;
  spec.dim = 96;
  const Codec prod = MustCreate(spec);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const Codec& codec = (t % 2) ? prod : mse;
      const CodecPlan& p = codec.plan();
      const size_t rows = 37 + 5 * t;
      const Rows data = MakeRows(p.dim, rows, 100 + t, t % 4);
      std::vector<uint8_t> want(rows * p.row_bytes), got(rows * p.row_bytes);
      std::vector<float> dec_want(rows * p.dim), dec_got(rows * p.dim);
      for (int iter = 0; iter < 200; ++iter) {
        const size_t bad_want = ref::EncodeRows(p, data.data, rows, want.data());
        const size_t bad_got = cpu::EncodeRows(p, data.data, rows, got.data());
        if (bad_want != bad_got) ++failures;
        for (size_t r = 0; r < rows; ++r) {
          const uint8_t* w = want.data() + r * p.row_bytes;
          if (RowIsGood(p, w) && std::memcmp(w, got.data() + r * p.row_bytes, p.row_bytes) != 0) {
            ++failures;
          }
        }
        cpu::DecodeRows(p, want.data(), rows, dec_got.data());
        ref::DecodeRows(p, want.data(), rows, dec_want.data());
        for (size_t r = 0; r < rows; ++r) {
          if (!RowIsGood(p, want.data() + r * p.row_bytes)) continue;
          double err = 0, energy = 0;
          for (size_t j = 0; j < p.dim; ++j) {
            const double a = dec_want[r * p.dim + j], b = dec_got[r * p.dim + j];
            err += (a - b) * (a - b);
            energy += a * a;
          }
          if (err > kRowNmse * energy) ++failures;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

// The public API on top of the kernels: Codec::Encode (thread pool, chunks)
// writes the reference's bytes.
TEST(SimdTest, CodecEncodeMatchesReference) {
  CodecSpec spec;
  spec.dim = 128;
  spec.bits = 3;
  const Codec codec = MustCreate(spec);
  const CodecPlan& p = codec.plan();
  const size_t rows = 1000;
  Rows data = MakeRows(128, rows, 9, 0);
  for (size_t r = 0; r < rows; ++r) {  // only good rows: Encode fails otherwise
    if (data.kinds[r] == RowKind::kHuge || data.kinds[r] == RowKind::kNearMax ||
        data.kinds[r] == RowKind::kWideRange) {
      for (size_t j = 0; j < 128; ++j) data.data[r * 128 + j] = 1.0f;
    }
  }
  std::vector<uint8_t> want(rows * p.row_bytes), got(rows * p.row_bytes);
  ASSERT_EQ(ref::EncodeRows(p, data.data, rows, want.data()), rows);
  for (const size_t threads : {size_t{1}, size_t{3}}) {
    BatchOptions opt;
    opt.threads = threads;
    ASSERT_TRUE(codec.Encode({data.data, rows * 128}, got, opt).ok());
    EXPECT_EQ(want, got) << threads << " threads";
  }
}

// The attention driver's query preparation and output rotation
// (cpu::PrepareQuery, cpu::RotateInverse) equal the reference bit for bit on
// every target: prod codes with one and several Hadamard blocks (d 128, 96,
// 48), an MSE code, a Haar code.
TEST(SimdTest, AttentionRotationsMatchReferenceBitForBit) {
  struct Case {
    size_t dim;
    int bits;
    CodecKind kind;
    RotationKind rotation;
  };
  const Case cases[] = {{128, 4, CodecKind::kProd, RotationKind::kBlockHadamard},
                        {96, 3, CodecKind::kProd, RotationKind::kBlockHadamard},
                        {48, 3, CodecKind::kMse, RotationKind::kBlockHadamard},
                        {256, 2, CodecKind::kMse, RotationKind::kHadamard},
                        {40, 3, CodecKind::kProd, RotationKind::kHaar}};
  for (const Case& c : cases) {
    CodecSpec spec;
    spec.dim = c.dim;
    spec.bits = c.bits;
    spec.kind = c.kind;
    spec.rotation = c.rotation;
    const Codec codec = MustCreate(spec);
    const CodecPlan& p = codec.plan();
    Rows data = MakeRows(c.dim, 20, 11, 0);
    for (size_t r = 0; r < 20; ++r) {
      if (data.kinds[r] != RowKind::kGaussian) continue;
      const float* q = data.data + r * c.dim;
      std::vector<float> rot_want(c.dim), sk_want(p.qjl_dim), back_want(c.dim);
      ref::PrepareQuery(p, q, rot_want.data(), p.qjl_dim ? sk_want.data() : nullptr);
      ref::RotateInverse(p, rot_want.data(), back_want.data());
      ForEachSimdTarget([&](int64_t) {
        std::vector<float> rot(c.dim), sk(p.qjl_dim), back(c.dim);
        cpu::PrepareQuery(p, q, rot.data(), p.qjl_dim ? sk.data() : nullptr);
        EXPECT_EQ(0, std::memcmp(rot.data(), rot_want.data(), c.dim * 4)) << c.dim << " rotation";
        // mse codecs have no sketch (qjl_dim 0: both vectors empty, data() may be null).
        if (p.qjl_dim > 0) EXPECT_EQ(0, std::memcmp(sk.data(), sk_want.data(), p.qjl_dim * 4)) << c.dim << " sketch";
        std::vector<float> work = rot;
        cpu::RotateInverse(p, work.data(), back.data());
        EXPECT_EQ(0, std::memcmp(back.data(), back_want.data(), c.dim * 4)) << c.dim << " inverse";
      });
    }
  }
}

}  // namespace
}  // namespace tq
