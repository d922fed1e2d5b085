// Per-target Highway kernels of the CPU codec (entry points: cpu/dispatch.h).
// cpu/codec.cc includes this file once per SIMD target through
// hwy/foreach_target.h; everything in tq::cpu::HWY_NAMESPACE is compiled for
// that target.
//
// Contract: every code byte equals what tq::ref (src/ref/kernels.cc) writes,
// whatever the vector width. That fixes the arithmetic, not just the math:
//   * products that round are followed by a separate add (never fused; the
//     library is built with -ffp-contract=off). The one MulAdd below
//     multiplies by exactly +1 or -1: that product is exact, so the fused and
//     unfused forms round once, identically, to a + b or a - b on every target
//     (SSE4 emulates MulAdd unfused, AVX2/AVX3 fuse it: same bits).
//   * sums of squares in the canonical 16-lane order of ref::SumSquares16:
//     vectors are CappedTag<float, 16>, so one vector is 16, 8 or 4 logical
//     lanes and 1, 2 or 4 accumulators emulate the 16 logical lanes; the
//     final fold is 8, 4, 2, 1 exactly as in the reference.
//   * Walsh-Hadamard stages in ascending stride, each element going through
//     the same a + b / a - b as in the reference (a + b may be evaluated as
//     b + a: the same value for every non-NaN input).
//   * MatTVec is vectorized across outputs j, so every output still
//     accumulates over i ascending from 0.0f.
//   * quantization counts the boundaries b with u >= b. With non-decreasing
//     boundaries (every Codebook's; checked per call) those boundaries are a
//     prefix, so a binary search finds the same count; a plan with unsorted or
//     NaN boundaries falls back to counting.
// Rows whose scale is NaN (non-finite input, or a rotation that overflows to
// Inf - Inf) are bad rows (EncodeRows reports them); the sign and payload of
// that NaN depend on operand order, which neither this code nor the compiled
// reference pins, so only those scale bytes may differ from ref.
//
// Decoded floats and scores need only agree with the reference to rounding:
// decode uses exact rewrites ((s * c)[idx] for s * c[idx], x * (s1 / n) for
// (x / n) * s1) and matches in practice; scores use vector accumulators.
//
// Layout of the work (the hot path: MSE codes, Hadamard blocks of 16 to
// 16 * lanes coordinates): rows go in batches of 16 through phases (rotate +
// sum of squares, vector sqrt/div, quantize + centroid norms, scales), two
// rows interleaved in registers, because within one row every step waits for
// the previous one. On AVX-512, blocks of >= 64 coordinates with <= 4 bits
// are bit-packed in registers; otherwise indices go through bytes and a
// pext/shift packer. Everything else (blocks < 16 or larger than the register
// kernels, Haar, prod codes) goes through a one-row path with scratch memory,
// still vectorized (MatTVec across outputs, FWHT in memory, vector quantizer).


// The building blocks (types, rotations, MatTVec, quantizer tables, packers)
// are in cpu/codec_kernels-inl.h; this file holds the entry points.

// ---------------------------------------------------------------------------
// Per-target part (Highway's per-target include guard).
#if defined(TQ_SRC_CPU_CODEC_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_CODEC_INL_H_
#undef TQ_SRC_CPU_CODEC_INL_H_
#else
#define TQ_SRC_CPU_CODEC_INL_H_
#endif

#include "cpu/codec_kernels-inl.h"

HWY_BEFORE_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {

#if HWY_TARGET == HWY_SCALAR
// One-lane fallback (the static target of builds without an SSSE3 baseline):
// the scalar reference is this target's implementation.
HWY_NOINLINE size_t EncodeRowsImpl(const CodecPlan& plan, const float* x, size_t rows,
                                   uint8_t* out) {
  return ref::EncodeRows(plan, x, rows, out);
}
HWY_NOINLINE void DecodeRowsImpl(const CodecPlan& plan, const uint8_t* codes, size_t rows,
                                 float* out) {
  ref::DecodeRows(plan, codes, rows, out);
}
HWY_NOINLINE void ScoreRowsImpl(const CodecPlan& plan, const float* q_rot, const float* q_sketch,
                                const uint8_t* codes, size_t rows, float* scores) {
  ref::ScoreRows(plan, q_rot, q_sketch, codes, rows, scores);
}
#else  // HWY_TARGET != HWY_SCALAR

namespace hn = hwy::HWY_NAMESPACE;

// ---------------------------------------------------------------------------
// Encode.

struct EncodeCtx {
  const CodecPlan* plan = nullptr;
  bool need_residual = false;  // prod codes: r = y - s * chat
  BlockTables tables[kMaxBlocks];
};

// One row in flight: its input, index bytes, residual (prod), code row, and
// whether every scale so far is finite in the stored dtype.
struct EncodeRow {
  const float* x;
  uint8_t* idx;
  float* r;
  uint8_t* out;
  bool ok;
};

// Quantizes block b of one row already rotated into y[0, n) (any n), through
// scratch memory: Haar, Hadamard blocks < 16 or > kMaxRegVecs vectors, prod
// codes, the odd last row.
HWY_NOINLINE void QuantizeBlockMem(const EncodeCtx& ctx, size_t b, const float* y, size_t n,
                                   float* chat, EncodeRow& row) {
  const DF d;
  const CodecPlan& plan = *ctx.plan;
  const BlockTables& t = ctx.tables[b];
  const size_t off = plan.blocks[b].offset;
  uint8_t* idx = row.idx + off;
  const float norm = std::sqrt(SumSquaresMem(y, n));
  // Norms below FLT_MIN count as zero (1/norm would overflow), as in ref.
  const float inv = norm >= 0x1p-126f ? 1.0f / norm : 0.0f;
  const VF vinv = hn::Set(d, inv);
  size_t j = 0;
  const auto run = [&](const auto& q) {
    for (; j + kN <= n; j += kN) {
      const VI qi = q.Quantize(hn::Mul(hn::LoadU(d, y + j), vinv));
      StoreIndexBytes(qi, idx + j);
      hn::StoreU(q.Centroid(qi), d, chat + j);
    }
  };
  switch (t.mode) {
    case QMode::kTable1:
      // Compile-time widths where the search uses shifted tables (kN >= 2^bits).
      if (t.bits == 1) {
        run(VecQuantizer<QMode::kTable1, 1>(t));
      } else if (t.bits == 2) {
        run(VecQuantizer<QMode::kTable1, 2>(t));
      } else if constexpr (kN >= 16) {
        if (t.bits == 3) {
          run(VecQuantizer<QMode::kTable1, 3>(t));
        } else {
          run(VecQuantizer<QMode::kTable1, 4>(t));
        }
      } else {
        run(VecQuantizer<QMode::kTable1, 0>(t));
      }
      break;
    case QMode::kTable2: run(VecQuantizer<QMode::kTable2, 0>(t)); break;
    case QMode::kGather: run(VecQuantizer<QMode::kGather, 0>(t)); break;
    case QMode::kCount: run(VecQuantizer<QMode::kCount, 0>(t)); break;
  }
  for (; j < n; ++j) {
    const uint8_t q = detail::QuantizeScalar(y[j] * inv, t.boundaries, t.nlev - 1);
    idx[j] = q;
    chat[j] = t.centroids[q];
  }
  float scale = norm;
  if (plan.norm_correction) scale = norm / std::sqrt(SumSquaresMem(chat, n));
  uint8_t* sp = row.out + plan.scale_offset + b * plan.scale_bytes;
  row.ok = detail::StoreScale(plan, scale, sp) && row.ok;
  if (ctx.need_residual) {
    const float s = detail::LoadScale(plan, sp);  // what a decoder will see
    const VF vs = hn::Set(d, s);
    float* r = row.r + off;
    size_t i = 0;
    for (; i + kN <= n; i += kN) {
      hn::StoreU(hn::Sub(hn::LoadU(d, y + i), hn::Mul(vs, hn::LoadU(d, chat + i))), d, r + i);
    }
    for (; i < n; ++i) r[i] = y[i] - s * chat[i];
  }
}

// Rotates and quantizes Hadamard block b of one row through scratch memory.
HWY_NOINLINE void EncodeHadamardMem(const EncodeCtx& ctx, size_t b, EncodeRow& row) {
  const CodecPlan& plan = *ctx.plan;
  const BlockPlan& bp = plan.blocks[b];
  Scratch& s = ThreadScratch();
  float* y = Grow(s.y, bp.size);
  float* chat = Grow(s.chat, bp.size);
  const size_t off = bp.offset;
  HadamardForwardBlock(row.x + off, plan.signs1 + off, plan.signs2 + off, bp.size, y);
  QuantizeBlockMem(ctx, b, y, bp.size, chat, row);
}

// The hot path: MSE Hadamard blocks of kVecs * kN >= 16 coordinates, a batch
// of rows at a time, in phases. Within a row every step waits for the previous
// one (FWHT -> norm -> 1/norm -> quantize -> centroid norm -> scale: several
// hundred cycles of latency for ~150 of work), so each phase runs over all
// rows of the batch, two rows interleaved in registers, and only per-row
// scalars and the rotated rows (L1-resident) cross phases.
constexpr size_t kBatch = 16;

// Phase 1: rotates block b of rows x[0], x[1] into y[0], y[1] (kVecs * kN
// floats each) and returns their canonical sums of squares.
template <size_t kVecs>
HWY_NOINLINE void RotateRegs(const CodecPlan& plan, size_t b, const float* const* x,
                             float* const* y, float* sumsq) {
  const DF d;
  const size_t off = plan.blocks[b].offset;
  // Rows rotated together: both if their vectors fit the register file (32
  // on AVX-512, 16 otherwise, minus ~8 for constants), else one at a time.
  constexpr size_t kRegs = TQ_CPU_AVX512 ? 32 : 16;
  constexpr size_t R = kRows * kVecs + 8 <= kRegs ? kRows : 1;
  HWY_UNROLL(2)
  for (size_t r0 = 0; r0 < kRows; r0 += R) {
    VF v[R * kVecs];
    HadamardForwardRegs<kVecs, R>(x + r0, plan.signs1 + off, plan.signs2 + off, v);
    HWY_UNROLL(2)
    for (size_t r = 0; r < R; ++r) {
      VF acc[kAcc];
      HWY_UNROLL(4)
      for (size_t k = 0; k < kAcc; ++k) acc[k] = hn::Zero(d);
      HWY_UNROLL(16)
      for (size_t i = 0; i < kVecs; ++i) {
        const VF t = v[r * kVecs + i];
        acc[i % kAcc] = hn::Add(acc[i % kAcc], hn::Mul(t, t));
        hn::StoreU(t, d, y[r0 + r] + i * kN);
      }
      sumsq[r0 + r] = FoldAcc(acc);
    }
  }
}

// Whether QuantizeRegs<kVecs, kMode, kBits> writes the block's packed bits
// directly (AVX-512, whole groups of 64 indices of at most 4 bits) instead of
// index bytes for PackIndices. A block of size n at offset o (both multiples
// of 8) owns exactly bytes [o*B/8, (o+n)*B/8) of the index field.
template <size_t kVecs, QMode kMode, int kBits>
constexpr bool PacksDirectly() {
  return TQ_CPU_AVX512 && kN == 16 && kVecs % 4 == 0 && kMode == QMode::kTable1 && kBits >= 1 &&
         kBits <= 4;
}

// Phase 3: quantizes rotated rows y[0], y[1] scaled by inv[0], inv[1] into
// index bytes idx[0], idx[1] (or, if PacksDirectly, packed bits at idx[0],
// idx[1] = the rows' index field + o*B/8); returns the canonical sums of
// squares of their centroids (when norm_correction).
template <size_t kVecs, QMode kMode, int kBits>
HWY_NOINLINE void QuantizeRegs(const BlockTables& t, bool norm_correction,
                               const float* const* y, const float* inv, uint8_t* const* idx,
                               float* csumsq) {
  const DF d;
  const VecQuantizer<kMode, kBits> q(t);
  VF vinv[kRows];
  VF acc[kRows][kAcc];
  HWY_UNROLL(2)
  for (size_t r = 0; r < kRows; ++r) {
    vinv[r] = hn::Set(d, inv[r]);
    HWY_UNROLL(4)
    for (size_t k = 0; k < kAcc; ++k) acc[r][k] = hn::Zero(d);
  }
  constexpr bool kBy4 = kVecs % 4 == 0;
  VI pending[kRows][4];
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) {
    HWY_UNROLL(2)
    for (size_t r = 0; r < kRows; ++r) {
      const VI qi = q.Quantize(hn::Mul(hn::LoadU(d, y[r] + i * kN), vinv[r]));
      if constexpr (PacksDirectly<kVecs, kMode, kBits>()) {
#if TQ_CPU_AVX512
        pending[r][i % 4] = qi;
        if (i % 4 == 3) {
          PackBytes64<kBits>(IndexBytes4(pending[r]), idx[r] + (i - 3) * kN * kBits / 8);
        }
#endif
      } else if constexpr (kBy4) {
        pending[r][i % 4] = qi;
        if (i % 4 == 3) StoreIndexBytes4(pending[r], idx[r] + (i - 3) * kN);
      } else {
        StoreIndexBytes(qi, idx[r] + i * kN);
      }
      if (norm_correction) acc[r][i % kAcc] = hn::Add(acc[r][i % kAcc], q.CentroidSq(qi));
    }
  }
  HWY_UNROLL(2)
  for (size_t r = 0; r < kRows; ++r) csumsq[r] = norm_correction ? FoldAcc(acc[r]) : 0.0f;
}

using RotateFn = void (*)(const CodecPlan& plan, size_t b, const float* const* x,
                          float* const* y, float* sumsq);
using QuantizeFn = void (*)(const BlockTables& t, bool norm_correction, const float* const* y,
                            const float* inv, uint8_t* const* idx, float* csumsq);
struct BlockKernels {
  RotateFn rotate = nullptr;  // nullptr: the one-row scratch path
  QuantizeFn quantize = nullptr;
  bool packs = false;  // quantize writes packed bits (PacksDirectly)
};

template <size_t kVecs, QMode kMode, int kBits>
void SetQuantize(BlockKernels* k) {
  k->quantize = &QuantizeRegs<kVecs, kMode, kBits>;
  k->packs = PacksDirectly<kVecs, kMode, kBits>();
}

template <size_t kVecs>
BlockKernels SelectKernels(const BlockTables& t) {
  BlockKernels k;
  k.rotate = &RotateRegs<kVecs>;
  switch (t.mode) {
    case QMode::kTable1:
      switch (t.bits) {
        case 1: SetQuantize<kVecs, QMode::kTable1, 1>(&k); break;
        case 2: SetQuantize<kVecs, QMode::kTable1, 2>(&k); break;
        case 3:
          if constexpr (kN >= 8) SetQuantize<kVecs, QMode::kTable1, 3>(&k);
          break;
        case 4:
          if constexpr (kN >= 16) SetQuantize<kVecs, QMode::kTable1, 4>(&k);
          break;
        default: break;
      }
      break;
    case QMode::kTable2: SetQuantize<kVecs, QMode::kTable2, 0>(&k); break;
    case QMode::kGather: SetQuantize<kVecs, QMode::kGather, 0>(&k); break;
    case QMode::kCount: SetQuantize<kVecs, QMode::kCount, 0>(&k); break;
  }
  return k;
}

BlockKernels SelectKernels(const BlockPlan& bp, const BlockTables& t) {
  if (bp.size >= 16) {
    switch (bp.size / kN) {
      case 1:
        if constexpr (kN >= 16) return SelectKernels<1>(t);
        break;
      case 2:
        if constexpr (kN >= 8) return SelectKernels<2>(t);
        break;
      case 4: return SelectKernels<4>(t);
      case 8: return SelectKernels<8>(t);
      case 16: return SelectKernels<16>(t);
      default: break;
    }
  }
  return BlockKernels();
}

// Encodes rows [0, n) (n <= kBatch) of io, MSE Hadamard codes, block by block
// through the phases above. Blocks without register kernels (< 16) take the
// one-row path.
// norm = sqrt(sumsq), inv = 1/norm (0 below FLT_MIN: 1/norm would overflow,
// as in ref) for n rows, vectorized: sqrt and division are correctly rounded,
// so each lane equals the reference's scalar result. At most 8 lanes: the
// callers pass groups of 8 rows, and 512-bit sqrt/div cost twice 256-bit.
HWY_INLINE void NormsAndInverses(const float* sumsq, size_t n, float* norm, float* inv) {
  const hn::CappedTag<float, 8> d;
  for (size_t r = 0; r < n; r += hn::Lanes(d)) {
    const auto nv = hn::Sqrt(hn::LoadU(d, sumsq + r));
    hn::StoreU(nv, d, norm + r);
    const auto normal = hn::Ge(nv, hn::Set(d, 0x1p-126f));
    hn::StoreU(hn::IfThenElseZero(normal, hn::Div(hn::Set(d, 1.0f), nv)), d, inv + r);
  }
}
// scale = norm / sqrt(csumsq) for n rows (the norm correction), vectorized.
HWY_INLINE void CorrectedScales(const float* norm, const float* csumsq, size_t n, float* scale) {
  const hn::CappedTag<float, 8> d;
  for (size_t r = 0; r < n; r += hn::Lanes(d)) {
    hn::StoreU(hn::Div(hn::LoadU(d, norm + r), hn::Sqrt(hn::LoadU(d, csumsq + r))), d, scale + r);
  }
}

// Encodes rows [0, n) (n <= kBatch) of io (MSE Hadamard codes), block by
// block through the phases above, and packs their indices. Blocks without
// register kernels (< 16) take the one-row path. next/next_bytes: the
// following batch's input, prefetched during the rotation phase so that
// streaming from DRAM overlaps the arithmetic.
HWY_NOINLINE void EncodeBatch(const EncodeCtx& ctx, const BlockKernels* kernels, EncodeRow* io,
                              size_t n, float* ybuf, uint8_t* idx_dummy, const float* next,
                              size_t next_bytes) {
  const CodecPlan& plan = *ctx.plan;
  // Odd n: the last pair repeats row n-1 and writes to dummies. The per-row
  // arrays are padded to whole vectors (lanes past n are don't-care).
  const size_t pairs = (n + 1) / 2;
  constexpr size_t kPad = kBatch + kN;
  HWY_ALIGN float sumsq[kPad] = {}, norm[kPad], inv[kPad], csumsq[kPad] = {}, scale[kPad];
  const size_t lines = (next_bytes + 63) / 64;
  const size_t lines_per_pair = (lines + pairs - 1) / pairs;
  size_t prefetched = 0;
  for (size_t b = 0; b < plan.num_blocks; ++b) {
    const BlockKernels& k = kernels[b];
    if (k.rotate == nullptr) {
      for (size_t r = 0; r < n; ++r) EncodeHadamardMem(ctx, b, io[r]);
      continue;
    }
    const size_t size = plan.blocks[b].size;
    const size_t off = plan.blocks[b].offset;
    // Two groups of 8 rows, software-pipelined so that one group's sqrt and
    // division latency overlaps the other group's vector work:
    // rotate(0) norms(0) rotate(1) quantize(0) norms(1) scales(0) quantize(1)
    // scales(1). (The vector norm/scale helpers may also write lanes of the
    // next group; those are recomputed before use.)
    constexpr size_t kGroup = 8;
    const size_t groups = (n + kGroup - 1) / kGroup;
    const auto rotate = [&](size_t g) {
      for (size_t p = g * kGroup / 2; p < pairs && p < (g + 1) * kGroup / 2; ++p) {
        const size_t r0 = 2 * p;
        const size_t r1 = r0 + 1 < n ? r0 + 1 : r0;
        const float* x[kRows] = {io[r0].x + off, io[r1].x + off};
        float* y[kRows] = {ybuf + r0 * size, ybuf + (r0 + 1) * size};
        k.rotate(plan, b, x, y, sumsq + r0);
        for (size_t l = 0; l < lines_per_pair && prefetched < lines; ++l, ++prefetched) {
          hwy::Prefetch(reinterpret_cast<const uint8_t*>(next) + 64 * prefetched);
        }
      }
    };
    const auto norms = [&](size_t g) {
      const size_t r = g * kGroup;
      NormsAndInverses(sumsq + r, n - r < kGroup ? n - r : kGroup, norm + r, inv + r);
    };
    const auto quantize = [&](size_t g) {
      for (size_t p = g * kGroup / 2; p < pairs && p < (g + 1) * kGroup / 2; ++p) {
        const size_t r0 = 2 * p;
        const float* y[kRows] = {ybuf + r0 * size, ybuf + (r0 + 1) * size};
        // Index bytes at the block's offset, or for kernels that pack
        // directly the block's bytes of the index field.
        const size_t field_off = k.packs ? off * plan.mse_bits / 8 : off;
        uint8_t* ix[kRows] = {(k.packs ? io[r0].out : io[r0].idx) + field_off,
                              r0 + 1 < n ? (k.packs ? io[r0 + 1].out : io[r0 + 1].idx) + field_off
                                         : idx_dummy};
        k.quantize(ctx.tables[b], plan.norm_correction, y, inv + r0, ix, csumsq + r0);
      }
    };
    const auto scales = [&](size_t g) {
      const size_t r_begin = g * kGroup;
      const size_t r_end = n < r_begin + kGroup ? n : r_begin + kGroup;
      const float* s = norm;
      if (plan.norm_correction) {
        CorrectedScales(norm + r_begin, csumsq + r_begin, r_end - r_begin, scale + r_begin);
        s = scale;
      }
      for (size_t r = r_begin; r < r_end; ++r) {
        uint8_t* sp = io[r].out + plan.scale_offset + b * plan.scale_bytes;
        io[r].ok = detail::StoreScale(plan, s[r], sp) && io[r].ok;
      }
    };
    rotate(0);
    norms(0);
    for (size_t g = 0; g < groups; ++g) {
      if (g + 1 < groups) rotate(g + 1);
      quantize(g);
      if (g + 1 < groups) norms(g + 1);
      scales(g);
    }
  }
  // Packs the runs of blocks that left index bytes. Runs start at block
  // offsets, which are multiples of 8 (blocks are largest first), so each run
  // owns whole bytes of the index field.
  const int bits = plan.mse_bits;
  for (size_t b = 0; b < plan.num_blocks;) {
    if (kernels[b].packs) {
      ++b;
      continue;
    }
    size_t e = b;
    while (e < plan.num_blocks && !kernels[e].packs) ++e;
    const size_t start = plan.blocks[b].offset;
    const size_t end = e < plan.num_blocks ? plan.blocks[e].offset : plan.dim;
    const size_t byte0 = start * bits / 8;
    const size_t nbytes = e < plan.num_blocks ? (end - start) * bits / 8 : plan.index_bytes - byte0;
    for (size_t r = 0; r < n; ++r) {
      PackIndices(io[r].idx + start, end - start, bits, io[r].out + byte0, nbytes);
    }
    b = e;
  }
}

// Rows [0, nr) (nr <= kMatRows) of io through the general path (any plan):
// packed indices, scales and, for prod codes, the QJL part. io[k].r points
// at dim floats of scratch (the residual); y_buf holds kMatRows * dim floats
// (Haar only), z_buf kMatRows * qjl_dim.
HWY_NOINLINE void EncodeGroup(const EncodeCtx& ctx, EncodeRow* io, size_t nr, float* y_buf,
                              float* z_buf) {
  const CodecPlan& plan = *ctx.plan;
  const size_t dim = plan.dim;
  const size_t m = plan.qjl_dim;
  Scratch& s = ThreadScratch();
  const float* x[kMatRows];
  float* y[kMatRows];
  float* r[kMatRows];
  float* z[kMatRows];
  for (size_t k = 0; k < nr; ++k) {
    x[k] = io[k].x;
    // y_buf is null unless the rotation is Haar, z_buf unless qjl_dim > 0.
    y[k] = y_buf != nullptr ? y_buf + k * dim : nullptr;
    r[k] = io[k].r;
    z[k] = z_buf != nullptr ? z_buf + k * m : nullptr;
  }
  if (plan.mse_bits > 0) {
    if (plan.hadamard) {
      for (size_t k = 0; k < nr; ++k) {
        for (size_t b = 0; b < plan.num_blocks; ++b) EncodeHadamardMem(ctx, b, io[k]);
      }
    } else {
      float* chat = Grow(s.chat, dim);
      if (plan.mix != nullptr) {
        for (size_t k = 0; k < nr; ++k) plan.mix->Apply(x[k], y[k]);
      } else {
        MatTVec(plan.haar_t, x, nr, dim, dim, y, /*accumulate=*/false);
      }
      for (size_t k = 0; k < nr; ++k) QuantizeBlockMem(ctx, 0, y[k], dim, chat, io[k]);
    }
    for (size_t k = 0; k < nr; ++k) {
      PackIndices(io[k].idx, dim, plan.mse_bits, io[k].out, plan.index_bytes);
    }
  } else if (plan.hadamard) {  // pure QJL: the residual is the rotated row
    for (size_t k = 0; k < nr; ++k) {
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const BlockPlan& bp = plan.blocks[b];
        HadamardForwardBlock(io[k].x + bp.offset, plan.signs1 + bp.offset,
                             plan.signs2 + bp.offset, bp.size, io[k].r + bp.offset);
      }
    }
  } else if (plan.mix != nullptr) {
    for (size_t k = 0; k < nr; ++k) plan.mix->Apply(x[k], r[k]);
  } else {
    MatTVec(plan.haar_t, x, nr, dim, dim, r, /*accumulate=*/false);
  }
  if (m > 0) {
    for (size_t k = 0; k < nr; ++k) {
      const float gamma = std::sqrt(SumSquaresMem(r[k], dim));
      io[k].ok = detail::StoreScale(plan, gamma, io[k].out + plan.resid_offset) && io[k].ok;
    }
    MatTVec(plan.qjl_t, r, nr, dim, m, z, /*accumulate=*/false);
    for (size_t k = 0; k < nr; ++k) PackSigns(z[k], m, io[k].out + plan.sign_offset);
  }
}

HWY_NOINLINE size_t EncodeRowsImpl(const CodecPlan& plan, const float* x, size_t rows,
                                   uint8_t* out) {
  const size_t dim = plan.dim;
  const int bits = plan.mse_bits;
  const size_t m = plan.qjl_dim;
  Scratch& s = ThreadScratch();
  const size_t idx_len = IndexBufferLen(dim);
  // kBatch rows of index bytes plus one dummy row; padding stays zero.
  if (s.idx.size() < (kBatch + 1) * idx_len || s.idx_padded_dim != dim) {
    uint8_t* buf = Grow(s.idx, (kBatch + 1) * idx_len);
    for (size_t k = 0; k <= kBatch; ++k) std::memset(buf + k * idx_len + dim, 0, idx_len - dim);
    s.idx_padded_dim = dim;
  }
  uint8_t* idx = s.idx.data();

  EncodeCtx ctx;
  ctx.plan = &plan;
  ctx.need_residual = m > 0;
  BlockKernels kernels[kMaxBlocks];
  bool batched = bits > 0 && m == 0 && plan.hadamard;
  size_t max_block = 0;
  if (bits > 0) {
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      InitTables(plan.blocks[b], bits, &ctx.tables[b]);
      if (plan.hadamard) kernels[b] = SelectKernels(plan.blocks[b], ctx.tables[b]);
      if (kernels[b].rotate != nullptr && plan.blocks[b].size > max_block) {
        max_block = plan.blocks[b].size;
      }
    }
  }

  size_t first_bad = rows;
  if (batched) {
    float* ybuf = Grow(s.z, (kBatch + 1) * max_block);
    for (size_t row = 0; row < rows; row += kBatch) {
      const size_t n = rows - row < kBatch ? rows - row : kBatch;
      EncodeRow io[kBatch];
      for (size_t k = 0; k < n; ++k) {
        io[k] = EncodeRow{x + (row + k) * dim, idx + k * idx_len, nullptr,
                          out + (row + k) * plan.row_bytes, true};
      }
      const size_t next_rows =
          rows - row - n < kBatch ? rows - row - n : kBatch;  // rows of the next batch
      // The next batch's code rows, requested for writing (their read-for-
      // ownership misses would otherwise stall the stores).
      const uint8_t* next_out = out + (row + n) * plan.row_bytes;
      for (size_t l = 0; l < next_rows * plan.row_bytes; l += 64) {
        __builtin_prefetch(next_out + l, 1, 3);
      }
      EncodeBatch(ctx, kernels, io, n, ybuf, idx + kBatch * idx_len, x + (row + n) * dim,
                  next_rows * dim * sizeof(float));
      for (size_t k = 0; k < n; ++k) {
        if (!io[k].ok && first_bad == rows) first_bad = row + k;
      }
    }
    return first_bad;
  }

  // The general path, kMatRows rows at a time (they share matrix passes).
  float* r = Grow(s.r, kMatRows * dim);
  float* z = Grow(s.w, kMatRows * m);
  float* y = plan.hadamard ? nullptr : Grow(s.z, kMatRows * dim);
  for (size_t row = 0; row < rows; row += kMatRows) {
    const size_t nr = rows - row < kMatRows ? rows - row : kMatRows;
    EncodeRow io[kMatRows];
    for (size_t k = 0; k < nr; ++k) {
      io[k] = EncodeRow{x + (row + k) * dim, idx + k * idx_len, r + k * dim,
                        out + (row + k) * plan.row_bytes, true};
    }
    EncodeGroup(ctx, io, nr, y, z);
    for (size_t k = 0; k < nr; ++k) {
      if (!io[k].ok && first_bad == rows) first_bad = row + k;
    }
  }
  return first_bad;
}

// ---------------------------------------------------------------------------
// Decode.

struct DecodeCtx {
  const CodecPlan* plan = nullptr;
  const float* s1n = nullptr;  // signs1[j] / block size
  BlockTables tables[kMaxBlocks];
};

// yhat[j] = s * centroids[idx[j]] for j < n.
HWY_NOINLINE void Dequantize(const BlockTables& t, const uint8_t* idx, size_t n, float s,
                             float* yhat) {
  const DF d;
  const VF vs = hn::Set(d, s);
  size_t j = 0;
  const auto run = [&](const auto& q) {
    for (; j + kN <= n; j += kN) {
      hn::StoreU(hn::Mul(vs, q.Centroid(LoadIndexBytes(idx + j))), d, yhat + j);
    }
  };
  switch (t.mode) {
    case QMode::kTable1: run(VecQuantizer<QMode::kTable1, 0>(t)); break;
    case QMode::kTable2: run(VecQuantizer<QMode::kTable2, 0>(t)); break;
    default: run(VecQuantizer<QMode::kGather, 0>(t)); break;
  }
  for (; j < n; ++j) yhat[j] = s * t.centroids[idx[j]];
}

// MSE Hadamard block b of kRows rows, from index bytes straight to the
// output. idx[r] and code[r] are the rows' index bytes and code rows.
template <size_t kVecs, QMode kMode>
HWY_NOINLINE void DecodeHadamardRegs(const DecodeCtx& ctx, size_t b, const uint8_t* const* idx,
                                     const uint8_t* const* code, float* const* out) {
  // Rows decoded together: as in RotateRegs, both if their vectors fit.
  constexpr size_t kRegs = TQ_CPU_AVX512 ? 32 : 16;
  constexpr size_t R = kRows * kVecs + 8 <= kRegs ? kRows : 1;
  const DF d;
  const CodecPlan& plan = *ctx.plan;
  const size_t off = plan.blocks[b].offset;
  const BlockTables& t = ctx.tables[b];
  constexpr int kTables = kMode == QMode::kTable2 ? 2 : 1;
  HWY_UNROLL(2)
  for (size_t r0 = 0; r0 < kRows; r0 += R) {
    VF v[R * kVecs];
    VF table[R][kTables];  // s * centroids: the exact products ref computes
    HWY_UNROLL(2)
    for (size_t r = 0; r < R; ++r) {
      const float s =
          detail::LoadScale(plan, code[r0 + r] + plan.scale_offset + b * plan.scale_bytes);
      for (int k = 0; k < kTables; ++k) {
        if constexpr (kMode != QMode::kGather) {
          table[r][k] = hn::Mul(hn::Set(d, s), hn::Load(d, t.cen + k * kN));
        } else {
          table[r][k] = hn::Set(d, s);
        }
      }
    }
    HWY_UNROLL(16)
    for (size_t i = 0; i < kVecs; ++i) {
      HWY_UNROLL(2)
      for (size_t r = 0; r < R; ++r) {
        const VI qi = LoadIndexBytes(idx[r0 + r] + off + i * kN);
        if constexpr (kMode == QMode::kGather) {
          v[r * kVecs + i] = hn::Mul(table[r][0], hn::GatherIndex(d, t.centroids, qi));
        } else {
          v[r * kVecs + i] = Lookup<kTables>(table[r], qi);
        }
      }
    }
    float* o[R];
    for (size_t r = 0; r < R; ++r) o[r] = out[r0 + r] + off;
    HadamardInverseRegs<kVecs, R>(v, ctx.s1n + off, plan.signs2 + off, o);
  }
}

using DecodeBlockFn = void (*)(const DecodeCtx& ctx, size_t b, const uint8_t* const* idx,
                               const uint8_t* const* code, float* const* out);

template <size_t kVecs>
DecodeBlockFn SelectDecodeRegs(QMode mode) {
  switch (mode) {
    case QMode::kTable1: return &DecodeHadamardRegs<kVecs, QMode::kTable1>;
    case QMode::kTable2: return &DecodeHadamardRegs<kVecs, QMode::kTable2>;
    default: return &DecodeHadamardRegs<kVecs, QMode::kGather>;
  }
}

DecodeBlockFn SelectDecode(const BlockPlan& bp, const BlockTables& t) {
  if (bp.size < 16) return nullptr;
  switch (bp.size / kN) {
    case 1:
      if constexpr (kN >= 16) return SelectDecodeRegs<1>(t.mode);
      break;
    case 2:
      if constexpr (kN >= 8) return SelectDecodeRegs<2>(t.mode);
      break;
    case 4: return SelectDecodeRegs<4>(t.mode);
    case 8: return SelectDecodeRegs<8>(t.mode);
    case 16: return SelectDecodeRegs<16>(t.mode);
    default: break;
  }
  return nullptr;
}

constexpr double kSqrtHalfPi = 1.2533141373155002512;  // sqrt(pi / 2), as ref
// Rows ahead whose output lines DecodeRows prefetches for writing.
constexpr size_t kDecodeAhead = 8;

// w[i] = bit i ? g : -g for the m packed sign bits (branch-free: the bits
// are random, a branch per bit would mispredict half the time).
HWY_INLINE void SignedWeights(const uint8_t* bits, size_t m, float g, float* w) {
  const DF d;
  const DU du;
  const size_t nbytes = PackedBytes(m, 1);
  const auto lane_bit = hn::Load(du, detail::kLaneBit);
  const VF pos = hn::Set(d, g);
  const VF neg = hn::Set(d, -g);
  size_t i = 0;
  for (; i + kN <= m; i += kN) {
    const uint32_t word = ReadBits(bits, i, kN, nbytes);
    const auto set = hn::RebindMask(d, hn::TestBit(hn::Set(du, word), lane_bit));
    hn::StoreU(hn::IfThenElse(set, pos, neg), d, w + i);
  }
  const uint32_t g_bits = std::bit_cast<uint32_t>(g);
  for (; i < m; ++i) {
    const uint32_t flip = ((~bits[i / 8] >> (i % 8)) & 1u) << 31;  // -g: sign flipped
    w[i] = std::bit_cast<float>(g_bits ^ flip);
  }
}

// Rows c[0, nr) (nr <= kMatRows; idx[k]: row k's unpacked indices) through
// the general path: yhat (MSE part + QJL part) in scratch, then the inverse
// rotation into xo[k].
HWY_NOINLINE void DecodeGroup(const DecodeCtx& ctx, const uint8_t* const* c,
                              const uint8_t* const* idx, size_t nr, float* const* xo) {
  const CodecPlan& plan = *ctx.plan;
  const size_t dim = plan.dim;
  const size_t m = plan.qjl_dim;
  Scratch& s = ThreadScratch();
  float* yhat_buf = Grow(s.y, kMatRows * dim);
  float* w_buf = Grow(s.w, kMatRows * m);
  float* yhat[kMatRows];
  const float* yhat_c[kMatRows];
  const float* w[kMatRows];
  for (size_t k = 0; k < nr; ++k) {
    yhat[k] = yhat_buf + k * dim;
    yhat_c[k] = yhat[k];
    if (plan.mse_bits > 0) {
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const BlockPlan& bp = plan.blocks[b];
        const float sc = detail::LoadScale(plan, c[k] + plan.scale_offset + b * plan.scale_bytes);
        Dequantize(ctx.tables[b], idx[k] + bp.offset, bp.size, sc, yhat[k] + bp.offset);
      }
    } else {
      std::memset(yhat[k], 0, dim * sizeof(float));
    }
    if (m > 0) {
      // The weights of yhat += g * S^T sign: rows of S scaled by +-g.
      const double coef = kSqrtHalfPi / static_cast<double>(m);
      const float g = static_cast<float>(coef * detail::LoadScale(plan, c[k] + plan.resid_offset));
      float* wk = w_buf + k * m;
      SignedWeights(c[k] + plan.sign_offset, m, g, wk);
      w[k] = wk;
    }
  }
  // yhat[j] += sum_k S[k][j] * w[k], k ascending from the MSE part, as ref.
  if (m > 0) MatTVec(plan.qjl, w, nr, m, dim, yhat, /*accumulate=*/true);
  if (plan.hadamard) {
    for (size_t k = 0; k < nr; ++k) {
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const BlockPlan& bp = plan.blocks[b];
        const size_t off = bp.offset;
        HadamardInverseBlock(yhat[k] + off, plan.signs1 + off, ctx.s1n + off, plan.signs2 + off,
                             bp.size, xo[k] + off);
      }
    }
  } else if (plan.mix != nullptr) {
    for (size_t k = 0; k < nr; ++k) plan.mix->ApplyInverse(yhat_c[k], xo[k]);
  } else {
    MatTVec(plan.haar, yhat_c, nr, dim, dim, xo, /*accumulate=*/false);
  }
}

HWY_NOINLINE void DecodeRowsImpl(const CodecPlan& plan, const uint8_t* codes, size_t rows,
                                 float* out) {
  const size_t dim = plan.dim;
  const int bits = plan.mse_bits;
  Scratch& s = ThreadScratch();
  const size_t idx_len = IndexBufferLen(dim);
  uint8_t* idx = Grow(s.idx, kMatRows * idx_len);
  s.idx_padded_dim = 0;  // UnpackIndices writes whole groups of 8

  DecodeCtx ctx;
  ctx.plan = &plan;
  if (plan.hadamard) {
    float* s1n = Grow(s.s1n, dim);
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      const BlockPlan& bp = plan.blocks[b];
      const float inv_n = 1.0f / static_cast<float>(bp.size);
      for (size_t j = bp.offset; j < bp.offset + bp.size; ++j) s1n[j] = plan.signs1[j] * inv_n;
    }
    ctx.s1n = s1n;
  }
  DecodeBlockFn fns[kMaxBlocks] = {};
  bool paired = bits > 0 && plan.qjl_dim == 0 && plan.hadamard;
  if (bits > 0) {
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      InitTables(plan.blocks[b], bits, &ctx.tables[b]);
      fns[b] = SelectDecode(plan.blocks[b], ctx.tables[b]);
      if (fns[b] == nullptr && plan.blocks[b].size >= 16) paired = false;
    }
  }

  size_t row = 0;
  if (paired) {
    float* yhat = Grow(s.r, dim);  // blocks < 16
    for (; row + kRows <= rows; row += kRows) {
      const uint8_t* code[kRows];
      const uint8_t* ix[kRows];
      float* o[kRows];
      for (size_t k = 0; k < kRows; ++k) {
        code[k] = codes + (row + k) * plan.row_bytes;
        ix[k] = idx + k * idx_len;
        o[k] = out + (row + k) * dim;
        UnpackIndices(code[k], dim, bits, idx + k * idx_len, plan.index_bytes);
      }
      // Output rows a few pairs ahead: request their cache lines for writing
      // now, so that the read-for-ownership misses of a large output overlap
      // the arithmetic instead of stalling the stores.
      if (row + kDecodeAhead + kRows <= rows) {
        const uint8_t* ahead = reinterpret_cast<const uint8_t*>(out + (row + kDecodeAhead) * dim);
        for (size_t l = 0; l < kRows * dim * sizeof(float); l += 64) {
          __builtin_prefetch(ahead + l, 1, 3);
        }
      }
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        if (fns[b] != nullptr) {
          fns[b](ctx, b, ix, code, o);
          continue;
        }
        const BlockPlan& bp = plan.blocks[b];
        const size_t off = bp.offset;
        for (size_t k = 0; k < kRows; ++k) {
          const float sc =
              detail::LoadScale(plan, code[k] + plan.scale_offset + b * plan.scale_bytes);
          Dequantize(ctx.tables[b], ix[k] + off, bp.size, sc, yhat + off);
          HadamardInverseBlock(yhat + off, plan.signs1 + off, ctx.s1n + off, plan.signs2 + off,
                               bp.size, o[k] + off);
        }
      }
    }
  }
  for (; row < rows; row += kMatRows) {
    const size_t nr = rows - row < kMatRows ? rows - row : kMatRows;
    const uint8_t* c[kMatRows];
    const uint8_t* ix[kMatRows];
    float* o[kMatRows];
    for (size_t k = 0; k < nr; ++k) {
      c[k] = codes + (row + k) * plan.row_bytes;
      ix[k] = idx + k * idx_len;
      o[k] = out + (row + k) * dim;
      if (bits > 0) UnpackIndices(c[k], dim, bits, idx + k * idx_len, plan.index_bytes);
    }
    DecodeGroup(ctx, c, ix, nr, o);
  }
}

// ---------------------------------------------------------------------------
// Scores.

// Rows scored together: four independent accumulation chains (and
// reductions) per call keep the core busy; one row at a time is latency-bound.
constexpr size_t kScoreRows = 4;

// dots[r] = sum_j q[j] * centroids[idx[r][j]] over one block (any n), for
// kScoreRows rows.
template <QMode kMode>
HWY_NOINLINE void DotBlock(const BlockTables& t, const float* q, const uint8_t* const* idx,
                           size_t n, float* dots) {
  const DF d;
  const VecQuantizer<kMode, 0> quant(t);
  VF acc[kScoreRows];
  for (size_t r = 0; r < kScoreRows; ++r) acc[r] = hn::Zero(d);
  size_t j = 0;
  for (; j + kN <= n; j += kN) {
    const VF qv = hn::LoadU(d, q + j);
    HWY_UNROLL(4)
    for (size_t r = 0; r < kScoreRows; ++r) {
      acc[r] = hn::Add(acc[r], hn::Mul(qv, quant.Centroid(LoadIndexBytes(idx[r] + j))));
    }
  }
  for (size_t r = 0; r < kScoreRows; ++r) {
    float dot = hn::GetLane(hn::SumOfLanes(d, acc[r]));
    for (size_t k = j; k < n; ++k) dot = dot + q[k] * t.centroids[idx[r][k]];
    dots[r] = dot;
  }
}

// sum_k (bit k ? q[k] : -q[k]) over m packed sign bits.
HWY_NOINLINE float SignDot(const float* q, const uint8_t* bits, size_t m) {
  const DF d;
  const DU du;
  const size_t nbytes = PackedBytes(m, 1);
  const auto lane_bit = hn::Load(du, detail::kLaneBit);
  VF acc = hn::Zero(d);
  size_t k = 0;
  for (; k + kN <= m; k += kN) {
    const uint32_t w = ReadBits(bits, k, kN, nbytes);
    const auto set = hn::RebindMask(d, hn::TestBit(hn::Set(du, w), lane_bit));
    const VF v = hn::LoadU(d, q + k);
    acc = hn::Add(acc, hn::IfThenElse(set, v, hn::Neg(v)));
  }
  float dot = hn::GetLane(hn::SumOfLanes(d, acc));
  for (; k < m; ++k) dot = dot + (((bits[k / 8] >> (k % 8)) & 1u) ? q[k] : -q[k]);
  return dot;
}

HWY_NOINLINE void ScoreRowsImpl(const CodecPlan& plan, const float* q_rot, const float* q_sketch,
                                const uint8_t* codes, size_t rows, float* scores) {
  const size_t dim = plan.dim;
  const int bits = plan.mse_bits;
  const size_t m = plan.qjl_dim;
  const size_t idx_len = IndexBufferLen(dim);
  Scratch& s = ThreadScratch();
  uint8_t* idx = Grow(s.idx, kScoreRows * idx_len);
  s.idx_padded_dim = 0;  // UnpackIndices writes whole groups of 8
  const double qjl_coef = m > 0 ? kSqrtHalfPi / static_cast<double>(m) : 0;
  using DotFn = void (*)(const BlockTables&, const float*, const uint8_t* const*, size_t, float*);
  BlockTables tables[kMaxBlocks];
  DotFn fns[kMaxBlocks] = {};
  if (bits > 0) {
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      InitTables(plan.blocks[b], bits, &tables[b]);
      switch (tables[b].mode) {
        case QMode::kTable1: fns[b] = &DotBlock<QMode::kTable1>; break;
        case QMode::kTable2: fns[b] = &DotBlock<QMode::kTable2>; break;
        default: fns[b] = &DotBlock<QMode::kGather>; break;
      }
    }
  }
  for (size_t row = 0; row < rows; row += kScoreRows) {
    // A short last group repeats its last row (results discarded).
    const size_t n = rows - row < kScoreRows ? rows - row : kScoreRows;
    const uint8_t* c[kScoreRows];
    float total[kScoreRows];
    for (size_t r = 0; r < kScoreRows; ++r) {
      c[r] = codes + (row + (r < n ? r : n - 1)) * plan.row_bytes;
      total[r] = 0.0f;
    }
    if (bits > 0) {
      for (size_t r = 0; r < n; ++r) {
        UnpackIndices(c[r], dim, bits, idx + r * idx_len, plan.index_bytes);
      }
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const size_t off = plan.blocks[b].offset;
        const uint8_t* ix[kScoreRows];
        for (size_t r = 0; r < kScoreRows; ++r) ix[r] = idx + (r < n ? r : n - 1) * idx_len + off;
        float dots[kScoreRows];
        fns[b](tables[b], q_rot + off, ix, plan.blocks[b].size, dots);
        for (size_t r = 0; r < n; ++r) {
          const float s = detail::LoadScale(plan, c[r] + plan.scale_offset + b * plan.scale_bytes);
          total[r] = total[r] + s * dots[r];
        }
      }
    }
    for (size_t r = 0; r < n; ++r) {
      if (m > 0) {
        const float dot = SignDot(q_sketch, c[r] + plan.sign_offset, m);
        const float g =
            static_cast<float>(qjl_coef * detail::LoadScale(plan, c[r] + plan.resid_offset));
        total[r] = total[r] + g * dot;
      }
      scores[row + r] = total[r];
    }
  }
}

#endif  // HWY_TARGET != HWY_SCALAR


// The attention driver's query rotation and QJL sketch (ref::PrepareQuery)
// and output rotation (ref::RotateInverse) with the codec's SIMD kernels:
// the same results bit for bit (golden_test holds those kernels to the
// reference), at a fraction of the scalar reference's time (the sketch's
// dense m x dim product was 17% of a 256-token turboquant35 decode).
HWY_NOINLINE void PrepareQueryImpl(const CodecPlan& plan, const float* q, float* q_rot, float* q_sketch) {
#if HWY_TARGET == HWY_SCALAR
  ref::PrepareQuery(plan, q, q_rot, q_sketch);
#else
  if (plan.mix != nullptr || !plan.hadamard) {
    ref::Rotate(plan, q, q_rot);
  } else {
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      const BlockPlan& bp = plan.blocks[b];
      HadamardForwardBlock(q + bp.offset, plan.signs1 + bp.offset, plan.signs2 + bp.offset, bp.size,
                           q_rot + bp.offset);
    }
  }
  if (plan.qjl_dim > 0 && q_sketch != nullptr) {
    const float* x[1] = {q_rot};
    float* y[1] = {q_sketch};
    MatTVec(plan.qjl_t, x, 1, plan.dim, plan.qjl_dim, y, /*accumulate=*/false);
  }
#endif
}

// x = the inverse rotation of y; y is clobbered.
HWY_NOINLINE void RotateInverseImpl(const CodecPlan& plan, float* y, float* x) {
#if HWY_TARGET == HWY_SCALAR
  ref::RotateInverse(plan, y, x);
#else
  if (plan.mix != nullptr || !plan.hadamard) {
    ref::RotateInverse(plan, y, x);
    return;
  }
  HWY_ALIGN float s1n[256];
  for (size_t b = 0; b < plan.num_blocks; ++b) {
    const BlockPlan& bp = plan.blocks[b];
    if (bp.size > 256) {  // beyond the stack buffer: the reference
      ref::HadamardInverse(y + bp.offset, plan.signs1 + bp.offset, plan.signs2 + bp.offset, bp.size,
                           x + bp.offset);
      continue;
    }
    const float inv_n = 1.0f / static_cast<float>(bp.size);
    for (size_t i = 0; i < bp.size; ++i) s1n[i] = inv_n * plan.signs1[bp.offset + i];
    HadamardInverseBlock(y + bp.offset, plan.signs1 + bp.offset, s1n, plan.signs2 + bp.offset, bp.size,
                         x + bp.offset);
  }
#endif
}

const char* TargetNameImpl() { return hwy::TargetName(HWY_TARGET); }

}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#undef TQ_CPU_AVX512

#endif  // per-target include guard
