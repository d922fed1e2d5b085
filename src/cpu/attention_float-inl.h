// fp32 attention kernels, on every target (the scalar one included): keys
// (ScoreDecodedT, ScoreDenseRows, ScoreMseFast, ScoreSplitRows,
// ScoreCodecRows) and values (AccumDecodedT, AccumDenseRows, AccumMseFast,
// AccumSplitRows, AccumRotatedRows) of the formats and shapes the integer
// kernels do not take, and their entries in the kernel table
// (DecodedKeys, DecodedValues, KeysMseFast).

// Per-target include guard (Highway re-includes this file for every target).
#if defined(TQ_SRC_CPU_ATTENTION_FLOAT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_ATTENTION_FLOAT_INL_H_
#undef TQ_SRC_CPU_ATTENTION_FLOAT_INL_H_
#else
#define TQ_SRC_CPU_ATTENTION_FLOAT_INL_H_
#endif

#include "cpu/attention_kernel_table-inl.h"

HWY_BEFORE_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {
namespace attnk {

template <Fmt F, size_t NR>
HWY_NOINLINE void ScoreDecodedT(const DecodeInfo& info, const attn::Seg& s, size_t a, size_t b,
                             size_t d, const float* const* q, const float* koff, float* const* lg,
                             AScratch& scr) {
  const AF df;
  HWY_ALIGN AV parts[NR][kL];
  const size_t vec_end = d / kL * kL;
  const bool vec_ok = info.vec_ok;
  float bscale[kMaxBlocks];
  for (size_t t0 = a; t0 < b; t0 += kL) {
    const size_t nt = std::min(kL, b - t0);
    float tails[NR][kL] = {};
    for (size_t tt = 0; tt < kL; ++tt) {
      if (tt >= nt) {
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) parts[r][tt] = hn::Zero(df);
        continue;
      }
      const size_t t = t0 + tt;
      const RowDecoder dec = MakeDecoder(info, s.k + t * s.k_stride,
                                         s.km ? s.km + t * s.km_stride : nullptr, d,
                                         scr.idx.data(), bscale);
      Regs<NR> acc;
      TQ_FOR_R(TQ_REG(acc) = hn::Zero(df));
      size_t j = 0;
      if (vec_ok) {
        for (; j < vec_end; j += kL) {
          const AV kv = dec.template Chunk<F>(j);
          TQ_FOR_R(TQ_REG(acc) = hn::MulAdd(hn::LoadU(df, q[r] + j), kv, TQ_REG(acc)));
        }
      }
      for (; j < d; ++j) {
        const float x = dec.template Scalar<F>(j);
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) tails[r][tt] += q[r][j] * x;
      }
      TQ_FOR_R(parts[r][tt] = TQ_REG(acc));
    }
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      StoreLogits(hn::Add(hn::Add(ReduceVectors(parts[r]), hn::LoadU(df, tails[r])), hn::Set(df, koff[r])), lg[r] + (t0 - a),
                  nt);
    }
  }
}

// Rows ahead that the dense kernels prefetch while streaming K or V: the
// hardware prefetcher alone left dense fp16 decode 14-20% slower.
constexpr size_t kDenseAhead = 16;
// ScoreTok's key rows are 32-50 bytes: 16 rows ahead (one block) was too
// close (32K, one thread, 2 KV heads, five alternations: k3_v3 1.225 against
// 1.172 ms, k4_v4 1.250 against 1.225 ms with 64 ahead).
constexpr size_t kTokAhead = 64;

// Address of row t of one of segment s's streams (P: k, km, v or vm; S its
// stride), t counted from s's first row and possibly past its end: then
// the row of the following segments at that position (prefetch hints only).
// Without it the prefetches of a paged cache's 16-row pages had gone to
// other heads' rows of the same page (fp16 rows at 16-token pages, 4K
// tokens: paged decode at 0.62-0.68x of the dense baseline, 0.82-0.85x with).
template <const uint8_t* attn::Seg::*P, size_t attn::Seg::*S>
HWY_INLINE const uint8_t* Ahead(const attn::Seg& s, size_t t) {
  const attn::Seg* p = &s;
  while (t >= p->count && p->more && (p + 1)->*P != nullptr) {
    t -= p->count;
    ++p;
  }
  return p->*P + t * (p->*S);
}
// Whether a kernel over rows [.., b) of s can prefetch past s's end into a
// following segment (at most kMaxAhead rows ahead): computed once a call,
// so that the streams of long segments keep their one-add addresses.
constexpr size_t kMaxAhead = 128;
HWY_INLINE bool Follows(const attn::Seg& s, size_t b) { return s.more && b + kMaxAhead > s.count; }
HWY_INLINE const uint8_t* AheadK(const attn::Seg& s, size_t t) { return Ahead<&attn::Seg::k, &attn::Seg::k_stride>(s, t); }
HWY_INLINE const uint8_t* AheadKm(const attn::Seg& s, size_t t) { return Ahead<&attn::Seg::km, &attn::Seg::km_stride>(s, t); }
HWY_INLINE const uint8_t* AheadV(const attn::Seg& s, size_t t) { return Ahead<&attn::Seg::v, &attn::Seg::v_stride>(s, t); }
HWY_INLINE const uint8_t* AheadVm(const attn::Seg& s, size_t t) { return Ahead<&attn::Seg::vm, &attn::Seg::vm_stride>(s, t); }

// Dense rows (fp16, bf16, fp32; d a multiple of kL): two tokens at a time
// (2 NR independent sums), partial sums reduced kL tokens at a time.
template <Fmt F, size_t NR>
HWY_NOINLINE void ScoreDenseRows(const attn::Seg& s, size_t a, size_t b, size_t d,
                                 const float* const* q, const float* koff, float* const* lg) {
  const AF df;
  HWY_ALIGN AV parts[NR][kL];
  const bool fol = Follows(s, b);
  for (size_t t0 = a; t0 < b; t0 += kL) {
    const size_t nt = std::min(kL, b - t0);
    for (size_t tt = 0; tt < kL; tt += 2) {
      Regs<NR> x, y;
      TQ_FOR_R(TQ_REG(x) = hn::Zero(df); TQ_REG(y) = hn::Zero(df));
      if (tt < nt) {
        const uint8_t* p0 = s.k + (t0 + tt) * s.k_stride;
        // A missing second token reads the first again (its sums are dropped).
        const uint8_t* p1 = tt + 1 < nt ? p0 + s.k_stride : p0;
        // The stream kDenseAhead rows ahead (prefetch hint only: past
        // the segment's end is harmless).
        const uint8_t* f = fol ? AheadK(s, t0 + tt + kDenseAhead) : p0 + kDenseAhead * s.k_stride;
        for (size_t o = 0; o < 2 * d * (F == Fmt::kF32 ? 4 : 2); o += 64) hwy::Prefetch(f + o);
        for (size_t j = 0; j < d; j += kL) {
          const AV k0 = LoadDense(F, p0, j);
          const AV k1 = LoadDense(F, p1, j);
          TQ_FOR_R(const AV qv = hn::LoadU(df, q[r] + j); TQ_REG(x) = hn::MulAdd(qv, k0, TQ_REG(x));
                   TQ_REG(y) = hn::MulAdd(qv, k1, TQ_REG(y)));
        }
      }
      TQ_FOR_R(parts[r][tt] = TQ_REG(x); parts[r][tt + 1] = TQ_REG(y));
    }
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      StoreLogits(hn::Add(ReduceVectors(parts[r]), hn::Set(df, koff[r])), lg[r] + (t0 - a), nt);
    }
  }
}

// Which query and offset the fp32 key kernels read: a dense segment's
// (the plain query, offset 0), a compressed segment's in the plain domain
// (int8, int-asym and dense-format rows) or in the key codec's rotated
// domain (TurboQuant rows); compressed keys' offset is q · key mean.
enum class KeyQuery { kDense, kPlain, kRotated };
template <size_t NR, KeyQuery Q>
HWY_INLINE void RowQueries(attn::Row* const* rs, const float** q, float* koff) {
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    q[r] = Q == KeyQuery::kRotated ? rs[r]->qrot : rs[r]->q;
    koff[r] = Q == KeyQuery::kDense ? 0.0f : rs[r]->koff;
  }
}
// The entries of the two kernels above; a compressed segment's rows are
// decoded as ctx.info says, a dense segment's are rows of F.
template <Fmt F, size_t NR, KeyQuery Q>
void KeysDenseRows(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                   float* const* lg, AScratch&) {
  const float* q[NR];
  float koff[NR];
  RowQueries<NR, Q>(rs, q, koff);
  ScoreDenseRows<F, NR>(s, a, b, ctx.task->d, q, koff, lg);
}
template <Fmt F, size_t NR, KeyQuery Q>
void KeysDecoded(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                 float* const* lg, AScratch& scr) {
  const float* q[NR];
  float koff[NR];
  RowQueries<NR, Q>(rs, q, koff);
  const DecodeInfo info = Q == KeyQuery::kDense ? MakeInfo(F, nullptr, nullptr) : ctx.info;
  ScoreDecodedT<F, NR>(info, s, a, b, ctx.task->d, q, koff, lg, scr);
}
// Calls pick(F) with F the std::integral_constant of row format f, one of
// the formats decoded per element (dense, int8, int-asym), and returns its
// kernel; any other format: none.
template <class Fn, class Pick>
HWY_INLINE Fn ForDecodedFormat(Fmt f, Fn none, const Pick& pick) {
  switch (f) {
    case Fmt::kF16: return pick(std::integral_constant<Fmt, Fmt::kF16>());
    case Fmt::kBF16: return pick(std::integral_constant<Fmt, Fmt::kBF16>());
    case Fmt::kF32: return pick(std::integral_constant<Fmt, Fmt::kF32>());
    case Fmt::kInt8: return pick(std::integral_constant<Fmt, Fmt::kInt8>());
    case Fmt::kIntAsym: return pick(std::integral_constant<Fmt, Fmt::kIntAsym>());
    default: return none;
  }
}
constexpr bool IsDenseFmt(Fmt f) { return f == Fmt::kF16 || f == Fmt::kBF16 || f == Fmt::kF32; }

// The fp32 key kernel of rows of format f: dense rows whole where whole
// vectors tile them, else decoded per element.
template <size_t NR, KeyQuery Q>
KeyFn DecodedKeys(Fmt f, size_t d) {
  return ForDecodedFormat<KeyFn>(f, &NoKeys, [&](auto F) -> KeyFn {
    if constexpr (HWY_TARGET != HWY_SCALAR && IsDenseFmt(F())) {
      if (d % kL == 0 && kL % 2 == 0) return &KeysDenseRows<F(), NR, Q>;
    }
    return &KeysDecoded<F(), NR, Q>;
  });
}

// Centroids of the indices in iv (int32 lanes).
HWY_INLINE AV LookupIdx(const Lut& t, const AV& tab, hn::Vec<AI> iv) {
  const AF df;
  if (t.in_register) return hn::TableLookupLanes(tab, hn::IndicesFromVec(df, iv));
  return hn::GatherIndex(df, t.c, iv);
}

using AU = hn::RebindToUnsigned<AF>;

// Index words: the 8 indices of group g (coordinates 8g..8g+7 of a row) are
// one little-endian word at byte g * bits. Words(p, g0) returns the words of
// groups g0 .. g0 + kL - 1 from a zero-padded copy p of the row's indices.
HWY_INLINE hn::Vec<AU> Words(const uint8_t* p, size_t g0, int bits) {
  const AU du;
  if (bits == 4) return hn::LoadU(du, reinterpret_cast<const uint32_t*>(p + 4 * g0));
  if (bits == 2) {
    const hn::Rebind<uint16_t, AU> d16;
    return hn::PromoteTo(du, hn::LoadU(d16, reinterpret_cast<const uint16_t*>(p + 2 * g0)));
  }
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  // 3 bits: four 16-byte loads at 12-byte steps, one byte shuffle per block.
  const uint8_t* q = p + 3 * g0;
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 12)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 24)), 2);
  // The last 12 bytes are read as bytes 32..47 shifted down, so nothing past
  // the 16 groups' 48 bytes is touched.
  v = _mm512_inserti32x4(
      v, _mm_srli_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32)), 4), 3);
  const __m512i shuf = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1));
  return hn::Vec<AU>{_mm512_shuffle_epi8(v, shuf)};
#else
  const AI di;
  HWY_ALIGN int32_t offs[kL];
  for (size_t i = 0; i < kL; ++i) offs[i] = static_cast<int32_t>(3 * (g0 + i));
  return hn::GatherOffset(du, reinterpret_cast<const uint32_t*>(p), hn::Load(di, offs));
#endif
}

// Bytes Words reads from the start of a row's indices, at most.
HWY_INLINE size_t WordsExtent(const CodecPlan& plan) {
  size_t ext = 0;
  const size_t bits = static_cast<size_t>(plan.mse_bits);
  for (size_t b = 0; b < plan.num_blocks; ++b) {
    const size_t groups = plan.blocks[b].size / 8;
    for (size_t i0 = 0; i0 < groups; i0 += kL) {
      const size_t g0 = plan.blocks[b].offset / 8 + i0;
      size_t len = bits * kL;  // bits 2 and 4: kL words of bits bytes' stride
      if (bits == 4) len = 4 * kL;
#if !(HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
      if (bits == 3) len = 3 * kL + 1;  // gathers of 4 bytes at 3-byte steps
#endif
      ext = std::max(ext, bits * g0 + len);
    }
  }
  return ext;
}

// The row itself when every read stays inside its storage (row_span bytes
// from its start), else a zero-padded copy of its indices.
HWY_INLINE const uint8_t* PadRow(const uint8_t* row, size_t index_bytes, size_t extent,
                                 size_t row_span, uint8_t* buf) {
  if (extent <= row_span) return row;
  std::memcpy(buf, row, index_bytes);
  return buf;
}

// sum_k (bit k ? q[k] : -q[k]) over m packed sign bits.
HWY_INLINE float SignDotAttn(const float* q, const uint8_t* bits, size_t m) {
#if HWY_TARGET == HWY_SCALAR
  float dot = 0.0f;
  for (size_t k = 0; k < m; ++k) dot += ((bits[k / 8] >> (k % 8)) & 1u) ? q[k] : -q[k];
  return dot;
#else
  return SignDot(q, bits, m);
#endif
}

// Fast MSE keys (bits 2..4, blocks of multiples of 8): for each row, the
// words of kL groups are loaded at once; shifts select index k of every group
// (coordinates 8i + k), the block's table gives the centroids, and the
// permuted rotated query (position offset + k * groups + i, prepared by the
// driver) multiplies them. Per-token partial sums are reduced kL tokens at a
// time.
template <size_t NR>
HWY_NOINLINE void ScoreMseFast(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                             const float* const* qperm, const float* const* qsk, const float* koff,
                             float* const* lg, AScratch& scr) {
  const AF df;
  const AI di;
  const AU du;
  const CodecPlan& plan = *ctx.kc->groups[0].plan;
  const int bits = plan.mse_bits;
  const auto mask = hn::Set(du, (1u << bits) - 1u);
  uint8_t* pad = scr.pad.data();
  const size_t extent = WordsExtent(plan);
  HWY_ALIGN AV parts[NR][kL];
  // Prod keys: the QJL term sqrt(pi/2)/m * gamma * sum_k (S q')_k (2 bit_k - 1).
  const size_t m = plan.qjl_dim;
  const float qjl_coef = m > 0 ? static_cast<float>(1.2533141373155002512 / static_cast<double>(m)) : 0.0f;
  float qjl[NR][kL] = {};
  for (size_t t0 = a; t0 < b; t0 += kL) {
    const size_t nt = std::min(kL, b - t0);
    for (size_t tt = 0; tt < kL; ++tt) {
      if (tt >= nt) {
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) parts[r][tt] = hn::Zero(df);
        continue;
      }
      const size_t t = t0 + tt;
      const uint8_t* p = PadRow(s.k + t * s.k_stride, plan.index_bytes, extent, s.k_stride, pad);
      const uint8_t* meta = s.km + t * s.km_stride;
      Regs<NR> tot;
      TQ_FOR_R(TQ_REG(tot) = hn::Zero(df));
      for (size_t bl = 0; bl < plan.num_blocks; ++bl) {
        const BlockPlan& bp = plan.blocks[bl];
        const Lut& lut = ctx.luts[0][bl];
        const AV tab = hn::Load(df, lut.tab);
        const size_t groups = bp.size / 8;
        Regs<NR> acc;
        TQ_FOR_R(TQ_REG(acc) = hn::Zero(df));
        for (size_t i0 = 0; i0 < groups; i0 += kL) {
          const auto w = Words(p, bp.offset / 8 + i0, bits);
          const auto lanes = hn::FirstN(df, std::min(kL, groups - i0));
          const bool full = groups - i0 >= kL;
          HWY_UNROLL(8)
          for (int k = 0; k < 8; ++k) {
            const auto iv = hn::BitCast(di, hn::And(hn::ShiftRightSame(w, bits * k), mask));
            const AV cv = LookupIdx(lut, tab, iv);
            const size_t pos = bp.offset + static_cast<size_t>(k) * groups + i0;
            if (full) {
              TQ_FOR_R(TQ_REG(acc) = hn::MulAdd(hn::LoadU(df, qperm[r] + pos), cv, TQ_REG(acc)));
            } else {
              TQ_FOR_R(TQ_REG(acc) = hn::MulAdd(hn::MaskedLoad(lanes, df, qperm[r] + pos), cv, TQ_REG(acc)));
            }
          }
        }
        const AV scv = hn::Set(df, Scale(plan, meta + bl * plan.scale_bytes));
        TQ_FOR_R(TQ_REG(tot) = hn::MulAdd(TQ_REG(acc), scv, TQ_REG(tot)));
      }
      TQ_FOR_R(parts[r][tt] = TQ_REG(tot));
      if (m > 0) {
        const float gamma = Scale(plan, meta + (plan.resid_offset - plan.scale_offset));
        const uint8_t* signs = s.k + t * s.k_stride + plan.sign_offset;
        for (size_t r = 0; r < NR; ++r) qjl[r][tt] = qjl_coef * gamma * SignDotAttn(qsk[r], signs, m);
      }
    }
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      StoreLogits(hn::Add(hn::Add(ReduceVectors(parts[r]), hn::LoadU(df, qjl[r])), hn::Set(df, koff[r])), lg[r] + (t0 - a),
                  nt);
    }
  }
}

// Its entry: the rows' rotated queries (kQjl, prod keys: and their QJL sketches).
template <size_t NR, bool kQjl>
void KeysMseFast(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                 float* const* lg, AScratch& scr) {
  const float* q[NR];
  const float* qs[NR];
  float koff[NR];
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    q[r] = rs[r]->qrot;
    qs[r] = kQjl ? rs[r]->qsk : rs[r]->qrot;
    koff[r] = rs[r]->koff;
  }
  ScoreMseFast<NR>(ctx, s, a, b, q, qs, koff, lg, scr);
}

// Split keys (each group a TurboQuant codec row inside the split row, at its
// row_offset, with its own scales): per group and token the indices are
// unpacked once and every block's centroids looked up once for all NR query
// rows (GQA), then the QJL sign term per row. The codec's own scorer (the
// path below this one) took one query row at a time.
HWY_INLINE bool SplitRowsOk(const attn::Comp& kc) {
  if (kc.fmt != Fmt::kSplit) return false;
  for (int g = 0; g < kc.num_groups; ++g) {
    const CodecPlan& plan = *kc.groups[g].plan;
    if (plan.mix != nullptr || !plan.hadamard) return false;
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      if (plan.blocks[b].size % kL != 0) return false;
    }
  }
  return true;
}
template <size_t NR>
HWY_NOINLINE void ScoreSplitRows(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                                 attn::Row* const* rs, const float* koff, float* const* lg,
                                 AScratch& scr) {
  const AF df;
  const attn::Comp& kc = *ctx.kc;
  const size_t n = b - a;
  for (size_t r = 0; r < NR; ++r) {
    for (size_t t = 0; t < n; ++t) lg[r][t] = koff[r];
  }
  HWY_ALIGN AV parts[NR][kL];
  HWY_ALIGN AV sparts[NR][kL];  // QJL: per token, the lanes of sum_{bit set} (S q')_k
  float bscale[kMaxBlocks];
  for (int g = 0; g < kc.num_groups; ++g) {
    const attn::Group& gr = kc.groups[g];
    const CodecPlan& plan = *gr.plan;
    const size_t dg = plan.dim, m = plan.qjl_dim;
    const float* q[NR];
    const float* qs[NR];
    float qsum[NR] = {};  // sum_k (S q')_k: the signed sum is 2 * (set part) - qsum
    bool sketch = m > 0;
    for (size_t r = 0; r < NR; ++r) {
      q[r] = rs[r]->qrot + gr.rot_offset;
      qs[r] = rs[r]->qsk != nullptr ? rs[r]->qsk + gr.sketch_offset : nullptr;
      sketch = sketch && qs[r] != nullptr;
      if (qs[r] != nullptr) {
        for (size_t k = 0; k < m; ++k) qsum[r] += qs[r][k];
      }
    }
    // Whole bytes of sign bits a vector: the bits' lane masks are shared by the rows.
    const bool shared_signs = sketch && kL % 8 == 0 && m % kL == 0;
    DecodeInfo info;
    info.fmt = Fmt::kMse;
    info.plan = &plan;
    info.luts = ctx.luts[g];
    const float qjl_coef = m > 0 ? static_cast<float>(1.2533141373155002512 / static_cast<double>(m)) : 0.0f;
    for (size_t t0 = a; t0 < b; t0 += kL) {
      const size_t nt = std::min(kL, b - t0);
      float qjl[NR][kL] = {};
      HWY_ALIGN float gam[kL] = {};
      for (size_t tt = 0; tt < kL; ++tt) {
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) parts[r][tt] = sparts[r][tt] = hn::Zero(df);
        if (tt >= nt) continue;
        const uint8_t* row = s.k + (t0 + tt) * s.k_stride + gr.row_offset;
        if (plan.mse_bits > 0) {
          const RowDecoder dec = MakeDecoder(info, row, row + plan.scale_offset, dg, scr.idx.data(), bscale);
          Regs<NR> acc;
          TQ_FOR_R(TQ_REG(acc) = hn::Zero(df));
          for (size_t j = 0; j < dg; j += kL) {
            const AV kv = dec.template Chunk<Fmt::kMse>(j);
            TQ_FOR_R(TQ_REG(acc) = hn::MulAdd(hn::LoadU(df, q[r] + j), kv, TQ_REG(acc)));
          }
          TQ_FOR_R(parts[r][tt] = TQ_REG(acc));
        }
        if (m > 0) {
          const float gamma = qjl_coef * Scale(plan, row + plan.resid_offset);
          const uint8_t* signs = row + plan.sign_offset;
          if (shared_signs) {
            gam[tt] = gamma;
            Regs<NR> acc;
            TQ_FOR_R(TQ_REG(acc) = hn::Zero(df));
            for (size_t k = 0; k < m; k += kL) {
              const auto mk = hn::LoadMaskBits(df, signs + k / 8);
              TQ_FOR_R(TQ_REG(acc) = hn::Add(TQ_REG(acc), hn::IfThenElseZero(mk, hn::LoadU(df, qs[r] + k))));
            }
            TQ_FOR_R(sparts[r][tt] = TQ_REG(acc));
          } else {
            for (size_t r = 0; r < NR; ++r) {
              if (qs[r] != nullptr) qjl[r][tt] = gamma * SignDotAttn(qs[r], signs, m);
            }
          }
        }
      }
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) {
        AV tot = ReduceVectors(parts[r]);
        if (shared_signs) {
          const AV sgn = hn::MulAdd(ReduceVectors(sparts[r]), hn::Set(df, 2.0f), hn::Set(df, -qsum[r]));
          tot = hn::MulAdd(sgn, hn::Load(df, gam), tot);
        }
        StoreLogits<true>(hn::Add(tot, hn::LoadU(df, qjl[r])), lg[r] + (t0 - a), nt);
      }
    }
  }
}

// TurboQuant keys of any other shape (prod keys without the integer or
// fast kernels, split rows of other rotations): each group's codec rows of
// the tile gathered into one contiguous block (they may sit inside split
// rows or in two planes), then scored for every query row by the codec's
// own scorer.
template <size_t NR>
void ScoreCodecRows(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                    float* const* lg, AScratch& scr) {
  const attn::Comp& kc = *ctx.kc;
  const size_t n = b - a;
  for (size_t r = 0; r < NR; ++r) {
    for (size_t t = 0; t < n; ++t) lg[r][t] = rs[r]->koff;
  }
  scr.tmp.resize(n);
  for (int g = 0; g < kc.num_groups; ++g) {
    const attn::Group& gr = kc.groups[g];
    const CodecPlan& plan = *gr.plan;
    const uint8_t* rows = nullptr;
    if (kc.fmt == Fmt::kProd && kc.meta_bytes > 0 && s.km == s.k + kc.payload_bytes &&
        s.k_stride == plan.row_bytes && s.km_stride == plan.row_bytes) {
      rows = s.k + a * s.k_stride;  // KVCache rows: already contiguous codec rows
    } else {
      scr.tile.resize(n * plan.row_bytes);
      for (size_t t = 0; t < n; ++t) {
        uint8_t* dst = scr.tile.data() + t * plan.row_bytes;
        const uint8_t* src = s.k + (a + t) * s.k_stride + gr.row_offset;
        if (kc.fmt == Fmt::kProd) {
          std::memcpy(dst, src, kc.payload_bytes);
          std::memcpy(dst + kc.payload_bytes, s.km + (a + t) * s.km_stride, kc.meta_bytes);
        } else {
          std::memcpy(dst, src, plan.row_bytes);
        }
      }
      rows = scr.tile.data();
    }
    for (size_t r = 0; r < NR; ++r) {
      ScoreRowsImpl(plan, rs[r]->qrot + gr.rot_offset, rs[r]->qsk ? rs[r]->qsk + gr.sketch_offset : nullptr,
                    rows, n, scr.tmp.data());
      for (size_t t = 0; t < n; ++t) lg[r][t] += scr.tmp[t];
    }
  }
}

// ---------------------------------------------------------------------------
// Values: rows' accumulators += w[r][t] · v_t.

// acc[r][j] += sum_t w[r][t] v_t[j] over the whole vector chunks of [0, d)
// (decs: the tile's n rows), the rows' accumulators in registers over the
// tile. Two chunks a pass, so each weight is broadcast once for both (on
// AVX2 the broadcasts had been as many instructions as the multiply-adds).
// Returns the first coordinate not done (d rounded down to kL).
template <Fmt F, size_t NR>
HWY_INLINE size_t AccumChunks(const RowDecoder* decs, size_t n, size_t d, float* const* w,
                              float* const* accp) {
  const AF df;
  size_t j = 0;
  for (; j + 2 * kL <= d; j += 2 * kL) {
    Regs<NR> acc, acc2;
    TQ_FOR_R(TQ_REG(acc) = hn::LoadU(df, accp[r] + j));
    TQ_FOR_R(TQ_REG(acc2) = hn::LoadU(df, accp[r] + j + kL));
    for (size_t t = 0; t < n; ++t) {
      const AV v0 = decs[t].template Chunk<F>(j);
      const AV v1 = decs[t].template Chunk<F>(j + kL);
      TQ_FOR_R({
        const AV wv = hn::Set(df, w[r][t]);
        TQ_REG(acc) = hn::MulAdd(wv, v0, TQ_REG(acc));
        TQ_REG(acc2) = hn::MulAdd(wv, v1, TQ_REG(acc2));
      });
    }
    TQ_FOR_R(hn::StoreU(TQ_REG(acc), df, accp[r] + j));
    TQ_FOR_R(hn::StoreU(TQ_REG(acc2), df, accp[r] + j + kL));
  }
  for (; j + kL <= d; j += kL) {
    Regs<NR> acc;
    TQ_FOR_R(TQ_REG(acc) = hn::LoadU(df, accp[r] + j));
    for (size_t t = 0; t < n; ++t) {
      const AV vv = decs[t].template Chunk<F>(j);
      TQ_FOR_R(TQ_REG(acc) = hn::MulAdd(hn::Set(df, w[r][t]), vv, TQ_REG(acc)));
    }
    TQ_FOR_R(hn::StoreU(TQ_REG(acc), df, accp[r] + j));
  }
  return j;
}

// Formats decoded per element: the tile's rows decoded once, then
// AccumChunks (accumulators in registers over the tile), scalar tail.
template <Fmt F, size_t NR>
HWY_NOINLINE void AccumDecodedT(const DecodeInfo& info, const attn::Seg& s, size_t a, size_t b,
                             size_t d, attn::Row* const* rs, float* const* w, AScratch& scr) {
  const size_t n = b - a;
  const size_t stride = IdxLen(d);
  // Unpacked codes of the tile's rows (int-asym, MSE) and block scales.
  const bool unpack = info.fmt == Fmt::kIntAsym || info.fmt == Fmt::kMse;
  if (unpack) scr.tile.resize(n * stride);
  scr.bscales.resize(n * kMaxBlocks);
  std::vector<RowDecoder>& decs = scr.decs;
  decs.clear();
  for (size_t t = a; t < b; ++t) {
    decs.push_back(MakeDecoder(info, s.v + t * s.v_stride, s.vm ? s.vm + t * s.vm_stride : nullptr, d,
                               unpack ? scr.tile.data() + (t - a) * stride : nullptr,
                               scr.bscales.data() + (t - a) * kMaxBlocks));
  }
  size_t j = 0;
  if (info.vec_ok) {
    float* acc[NR];
    for (size_t r = 0; r < NR; ++r) acc[r] = rs[r]->acc;
    j = AccumChunks<F, NR>(decs.data(), n, d, w, acc);
  }
  for (; j < d; ++j) {
    for (size_t t = 0; t < n; ++t) {
      const float x = decs[t].template Scalar<F>(j);
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) rs[r]->acc[j] += w[r][t] * x;
    }
  }
}


// Dense rows (fp16, bf16, fp32; d a multiple of kL): rows taken in order,
// each read whole (up to 8 vectors) into two query rows' accumulators at a
// time, so the value stream is read sequentially (the hardware prefetcher
// follows it) instead of one vector column of the tile at a time.
template <Fmt F, size_t NR>
HWY_NOINLINE void AccumDenseRows(const attn::Seg& s, size_t a, size_t b, size_t d,
                                 attn::Row* const* rs, float* const* w) {
  const AF df;
  const bool fol = Follows(s, b);
  for (size_t r0 = 0; r0 < NR; r0 += 2) {
    const bool two = r0 + 1 < NR;
    float* acc0 = rs[r0]->acc;
    float* acc1 = two ? rs[r0 + 1]->acc : nullptr;
    const float* w0 = w[r0];
    const float* w1 = two ? w[r0 + 1] : w[r0];
    for (size_t j0 = 0; j0 < d; j0 += 8 * kL) {
      const size_t nc = std::min<size_t>(8, (d - j0) / kL);
      AV x0[8], x1[8];
      HWY_UNROLL(8)
      for (size_t c = 0; c < 8; ++c) {
        if (c < nc) {
          x0[c] = hn::LoadU(df, acc0 + j0 + c * kL);
          x1[c] = two ? hn::LoadU(df, acc1 + j0 + c * kL) : hn::Zero(df);
        }
      }
      const bool pf = r0 == 0 && j0 == 0;  // the first pass over the tile's rows
      const size_t rb = d * (F == Fmt::kF32 ? 4 : 2);
      for (size_t t = a; t < b; ++t) {
        const uint8_t* p = s.v + t * s.v_stride;
        if (pf) {
          const uint8_t* f = fol ? AheadV(s, t + kDenseAhead) : p + kDenseAhead * s.v_stride;
          for (size_t o = 0; o < rb; o += 64) hwy::Prefetch(f + o);
        }
        const AV wa = hn::Set(df, w0[t - a]);
        const AV wb = hn::Set(df, w1[t - a]);
        HWY_UNROLL(8)
        for (size_t c = 0; c < 8; ++c) {
          if (c < nc) {
            const AV v = LoadDense(F, p, j0 + c * kL);
            x0[c] = hn::MulAdd(wa, v, x0[c]);
            x1[c] = hn::MulAdd(wb, v, x1[c]);
          }
        }
      }
      HWY_UNROLL(8)
      for (size_t c = 0; c < 8; ++c) {
        if (c < nc) {
          hn::StoreU(x0[c], df, acc0 + j0 + c * kL);
          if (two) hn::StoreU(x1[c], df, acc1 + j0 + c * kL);
        }
      }
    }
  }
}

// The entries of the two kernels above (rows as DecodedKeys reads them).
template <Fmt F, size_t NR>
void ValuesDenseRows(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                     float* const* w, AScratch&) {
  AccumDenseRows<F, NR>(s, a, b, vctx.task->d, rs, w);
}
template <Fmt F, size_t NR, bool kDense>
void ValuesDecoded(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                   float* const* w, AScratch& scr) {
  AccumDecodedT<F, NR>(kDense ? MakeInfo(F, nullptr, nullptr) : vctx.info, s, a, b, vctx.task->d, rs, w, scr);
}
// The fp32 value kernel of rows of format f (kDense: a dense segment's,
// else a compressed segment's as vctx.info says). Dense formats read the
// same whether the segment is dense or the cache's compressed part
// (k16/bf16/f32 presets): rows in order, as the keys do.
template <size_t NR, bool kDense>
ValueFn DecodedValues(Fmt f, size_t d) {
  return ForDecodedFormat<ValueFn>(f, &NoValues, [&](auto F) -> ValueFn {
    if constexpr (HWY_TARGET != HWY_SCALAR && IsDenseFmt(F())) {
      if (d % kL == 0) return &ValuesDenseRows<F(), NR>;
    }
    return &ValuesDecoded<F(), NR, kDense>;
  });
}

// Fast MSE values: accumulators in the rotated domain, permuted so that
// position (block offset + k * groups + i) holds coordinate (offset + 8 i + k)
// (the driver undoes the permutation once per row).
template <size_t NR>
HWY_NOINLINE void AccumMseFast(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b,
                             attn::Row* const* rs, float* const* w, AScratch& scr) {
  const AF df;
  const AI di;
  const AU du;
  const CodecPlan& plan = *vctx.kc->groups[0].plan;
  const int bits = plan.mse_bits;
  const auto mask = hn::Set(du, (1u << bits) - 1u);
  const size_t n = b - a;
  const size_t groups_total = plan.dim / 8;
  // Rows padded so that a full vector load at any block's first group stays inside.
  const size_t wstride = (groups_total + kL - 1) / kL * kL + kL;
  scr.words.resize(n * wstride);
  scr.wscale.resize(NR * plan.num_blocks * n);
  uint8_t* pad = scr.pad.data();
  const size_t extent = WordsExtent(plan);
  for (size_t t = 0; t < n; ++t) {
    const uint8_t* p = PadRow(s.v + (a + t) * s.v_stride, plan.index_bytes, extent, s.v_stride, pad);
    for (size_t g0 = 0; g0 < groups_total; g0 += kL) {
      hn::StoreU(Words(p, g0, bits), du, scr.words.data() + t * wstride + g0);
    }
    const uint8_t* meta = s.vm + (a + t) * s.vm_stride;
    for (size_t bl = 0; bl < plan.num_blocks; ++bl) {
      const float sc = Scale(plan, meta + bl * plan.scale_bytes);
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) scr.wscale[(r * plan.num_blocks + bl) * n + t] = w[r][t] * sc;
    }
  }
  for (size_t bl = 0; bl < plan.num_blocks; ++bl) {
    const BlockPlan& bp = plan.blocks[bl];
    const Lut& lut = vctx.luts[0][bl];
    const AV tab = hn::Load(df, lut.tab);
    const size_t groups = bp.size / 8;
    const size_t g_base = bp.offset / 8;
    for (size_t i0 = 0; i0 < groups; i0 += kL) {
      const size_t nl = std::min(kL, groups - i0);
      const auto lanes = hn::FirstN(df, nl);
      for (int k = 0; k < 8; ++k) {
        const size_t pos = bp.offset + static_cast<size_t>(k) * groups + i0;
        Regs<NR> acc;
        TQ_FOR_R(TQ_REG(acc) = hn::MaskedLoad(lanes, df, rs[r]->accr + pos));
        const uint32_t* wp = scr.words.data() + g_base + i0;
        const float* ws[NR];
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) ws[r] = scr.wscale.data() + (r * plan.num_blocks + bl) * n;
        for (size_t t = 0; t < n; ++t) {
          const auto wv = hn::LoadU(du, wp + t * wstride);
          const auto iv = hn::BitCast(di, hn::And(hn::ShiftRightSame(wv, bits * k), mask));
          const AV cv = LookupIdx(lut, tab, iv);
          TQ_FOR_R(TQ_REG(acc) = hn::MulAdd(hn::Set(df, ws[r][t]), cv, TQ_REG(acc)));
        }
        TQ_FOR_R(hn::BlendedStore(TQ_REG(acc), lanes, df, rs[r]->accr + pos));
      }
    }
  }
}

// Split values (each group a TurboQuant-MSE codec row inside the split row,
// scales in it): per group, the tile's rows decoded once (indices unpacked,
// block scales), then AccumChunks with the query rows' accumulators in
// registers over the tile (as AccumDecodedT), into the rotated
// domain at the group's offset. The generic loop below reads and writes the
// accumulators in memory for every token and chunk.
HWY_INLINE bool SplitValuesOk(const attn::Comp& vc) {
  if (vc.fmt != Fmt::kSplit) return false;
  for (int g = 0; g < vc.num_groups; ++g) {
    const CodecPlan& plan = *vc.groups[g].plan;
    if (plan.mse_bits == 0) return false;  // a prod group's QJL bits are not part of a value
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      if (plan.blocks[b].size % kL != 0) return false;
    }
  }
  return true;
}
template <size_t NR>
HWY_NOINLINE void AccumSplitRows(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b,
                                 attn::Row* const* rs, float* const* w, AScratch& scr) {
  const attn::Comp& vc = *vctx.kc;
  const size_t n = b - a;
  for (int g = 0; g < vc.num_groups; ++g) {
    const attn::Group& gr = vc.groups[g];
    const CodecPlan& plan = *gr.plan;
    const size_t dg = plan.dim, stride = IdxLen(dg);
    DecodeInfo info;
    info.fmt = Fmt::kMse;
    info.plan = &plan;
    info.luts = vctx.luts[g];
    scr.tile.resize(n * stride);
    scr.bscales.resize(n * kMaxBlocks);
    std::vector<RowDecoder>& decs = scr.decs;
    decs.clear();
    for (size_t t = 0; t < n; ++t) {
      const uint8_t* row = s.v + (a + t) * s.v_stride + gr.row_offset;
      decs.push_back(MakeDecoder(info, row, row + plan.scale_offset, dg, scr.tile.data() + t * stride,
                                 scr.bscales.data() + t * kMaxBlocks));
    }
    float* acc[NR];
    for (size_t r = 0; r < NR; ++r) acc[r] = rs[r]->accr + gr.rot_offset;
    AccumChunks<Fmt::kMse, NR>(decs.data(), n, dg, w, acc);  // dg is whole chunks (SplitValuesOk)
  }
}

// TurboQuant values of any other shape (bits, blocks, split groups): per
// token with a weight, each group's indices unpacked and every block's
// centroids added into the rows' rotated accumulators at the group's
// offset.
template <size_t NR>
void AccumRotatedRows(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                      float* const* w, AScratch& scr) {
  const attn::Comp& vc = *vctx.kc;
  const AF df;
  for (size_t t = a; t < b; ++t) {
    float wt[NR];
    bool any = false;
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      wt[r] = w[r][t - a];
      any |= wt[r] != 0.0f;
    }
    if (!any) continue;
    const uint8_t* prow = s.v + t * s.v_stride;
    for (int g = 0; g < vc.num_groups; ++g) {
      const attn::Group& gr = vc.groups[g];
      const CodecPlan& plan = *gr.plan;
      const uint8_t* row = prow + gr.row_offset;
      const uint8_t* scales = vc.fmt == Fmt::kMse ? s.vm + t * s.vm_stride : row + plan.scale_offset;
      uint8_t* idx = scr.idx.data();
      Unpack(row, plan.dim, plan.mse_bits, idx, plan.index_bytes);
      for (size_t bl = 0; bl < plan.num_blocks; ++bl) {
        const BlockPlan& bp = plan.blocks[bl];
        const Lut& lut = vctx.luts[g][bl];
        const AV tab = hn::Load(df, lut.tab);
        const float scale = Scale(plan, scales + bl * plan.scale_bytes);
        AV wv[NR];
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) wv[r] = hn::Set(df, wt[r] * scale);
        const size_t base = gr.rot_offset + bp.offset;
        size_t j = 0;
        for (; j + kL <= bp.size; j += kL) {
          const AV cv = Lookup(lut, tab, idx + bp.offset + j);
          HWY_UNROLL(4)
          for (size_t r = 0; r < NR; ++r) {
            float* acc = rs[r]->accr + base + j;
            hn::StoreU(hn::MulAdd(wv[r], cv, hn::LoadU(df, acc)), df, acc);
          }
        }
        for (; j < bp.size; ++j) {
          const float c = lut.c[idx[bp.offset + j]] * scale;
          HWY_UNROLL(4)
          for (size_t r = 0; r < NR; ++r) rs[r]->accr[base + j] += wt[r] * c;
        }
      }
    }
  }
}

// Whether the rows' sums of compressed values' weights (Row::lc) are read:
// lc only scales the value mean back in (attention.cc's merge); without one
// (the default policy centers keys only) the sums are not needed.
HWY_INLINE bool NeedsWeightSums(const attn::Comp& vc) { return vc.mean != nullptr; }

// Rows' softmax sums over the n weights of compressed values (for the
// value mean: Row::lc).
template <size_t NR>
HWY_INLINE void AddCompressedWeights(const attn::Comp& vc, attn::Row* const* rs, const float* const* w,
                                     size_t n) {
  if (!NeedsWeightSums(vc)) return;
  const AF df;
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    size_t t = 0;
    AV sv = hn::Zero(df);
    for (; t + kL <= n; t += kL) sv = hn::Add(sv, hn::LoadU(df, w[r] + t));
    float sum = hn::GetLane(hn::SumOfLanes(df, sv));
    for (; t < n; ++t) sum += w[r][t];
    rs[r]->lc += sum;
  }
}

}  // namespace attnk
}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
