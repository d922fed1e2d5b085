// Kernel choice for one segment: ScoreFixed and AccumFixed pick a
// fixed-shape integer kernel by code width and chunk count; ScoreGroup (keys)
// and AccumGroup (values) pick the kernel for the segment's format on this
// target, falling back to the fp32 kernels.

// Per-target include guard (Highway re-includes this file for every target).
#if defined(TQ_SRC_CPU_ATTENTION_SELECT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_ATTENTION_SELECT_INL_H_
#undef TQ_SRC_CPU_ATTENTION_SELECT_INL_H_
#else
#define TQ_SRC_CPU_ATTENTION_SELECT_INL_H_
#endif

#include "cpu/attention_int16_values-inl.h"

HWY_BEFORE_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {
namespace attnk {

#ifdef TQ_ATTN_I16  // the integer kernels (attention_int16-inl.h)

#if HWY_TARGET == HWY_AVX3_DL
// Split keys as int16 where they apply (true: they ran).
template <size_t NR>
HWY_INLINE bool ScoreSplitAny(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                              attn::Row* const* rs, const float* koff, float* const* lg,
                              AScratch& scr) {
  const SplitKeys& k = ctx.sk;
  if (!k.on) return false;
  // The recipes' shapes at head_dim 128 and 256 (regular group 3/4 of the
  // channels: 3 or 6 QJL pieces, the outlier group 1 or 2).
  if (k.ne == 2 && k.nq0 == 3 && k.nq == 4 && k.nl == 1) {
    ScoreSplit16<2, 3, 1, 1, NR>(ctx, s, a, b, rs, koff, lg, scr);
    return true;
  }
  if (k.ne == 4 && k.nq0 == 6 && k.nq == 8 && k.nl == 2) {
    ScoreSplit16<4, 6, 2, 2, NR>(ctx, s, a, b, rs, koff, lg, scr);
    return true;
  }
  return false;
}
// Group-scaled integer keys where they apply (true: they ran).
template <size_t NR>
HWY_INLINE bool ScoreGKeysAny(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                              attn::Row* const* rs, const float* koff, float* const* lg,
                              AScratch& scr) {
  const GKeys& g = ctx.gk;
  if (!g.on) return false;
  switch (g.kind * 8 + static_cast<int>(g.nl)) {
    case 1: ScoreGKeys<0, 1, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    case 2: ScoreGKeys<0, 2, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    case 3: ScoreGKeys<0, 3, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    case 4: ScoreGKeys<0, 4, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    case 9: ScoreGKeys<1, 1, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    case 10: ScoreGKeys<1, 2, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    case 17: ScoreGKeys<2, 1, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    case 18: ScoreGKeys<2, 2, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    default: return false;
  }
}
#endif

// The fixed-shape kernels for the book's code width and chunk count, where
// one is compiled (true: it ran).
#define TQ_FIXED_SHAPES(X) X(2, 1) X(2, 2) X(2, 4) X(3, 1) X(3, 2) X(3, 4) X(4, 1) X(4, 2)
// kQjl (prod keys): on AVX2 the QJL term too (true: both ran); elsewhere
// the MSE part only, the caller adding the signs.
template <size_t NR, bool kQjl = false>
HWY_INLINE bool ScoreFixed(const KeyCtx& ctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                           const float* koff, float* const* lg, AScratch& scr) {
#if HWY_TARGET == HWY_AVX3_DL
  const I16Book& z = ctx.i16;
  if (!z.vnni || !(z.nib || z.inreg)) return false;
  if (TokOk(z, ctx.task->d)) {
    switch (z.bits) {
      case 2: ScoreTok<2, NR>(ctx, sp, nsp, rs, koff, lg, scr); return true;
      default: ScoreTok<3, NR>(ctx, sp, nsp, rs, koff, lg, scr); return true;
    }
  }
  switch (z.bits * 16 + static_cast<int>(z.nch)) {
#define TQ_FIXED_CASE(B, N) \
  case B * 16 + N: ScoreI16Fixed<B, N, NR>(ctx, sp, nsp, rs, koff, lg, scr); return true;
    TQ_FIXED_SHAPES(TQ_FIXED_CASE)
#undef TQ_FIXED_CASE
    default: break;
  }
#elif HWY_TARGET == HWY_AVX2
  const I16Book& z = ctx.i16;
  if (ctx.task->d == 128 && !z.asym && (z.nib || z.inreg)) {
    // Prod keys: the QJL term in the same pass (one segment, kQjl).
    if constexpr (kQjl) {
      if (nsp == 1 && z.qjl % 16 == 0) {
        switch (z.bits) {
          case 2: ScoreI16Avx2<2, NR, true>(ctx, sp, nsp, rs, koff, lg, scr); return true;
          case 3: ScoreI16Avx2<3, NR, true>(ctx, sp, nsp, rs, koff, lg, scr); return true;
          default: break;
        }
      }
      return false;
    }
    switch (z.bits) {
      case 2: ScoreI16Avx2<2, NR>(ctx, sp, nsp, rs, koff, lg, scr); return true;
      case 3: ScoreI16Avx2<3, NR>(ctx, sp, nsp, rs, koff, lg, scr); return true;
      case 4: ScoreI16Avx2<4, NR>(ctx, sp, nsp, rs, koff, lg, scr); return true;
      default: break;
    }
  }
#else
  (void)ctx, (void)sp, (void)nsp, (void)rs, (void)koff, (void)lg, (void)scr;
#endif
  return false;
}
template <size_t NR>
HWY_INLINE bool AccumFixed(const KeyCtx& vctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                           float* const* w, AScratch& scr) {
#if HWY_TARGET == HWY_AVX3_DL
  const I16Book& z = vctx.i16;
  if (!z.vnni || !(z.nib || z.inreg)) return false;
  switch (z.bits * 16 + static_cast<int>(z.nch)) {
#define TQ_FIXED_CASE(B, N) \
  case B * 16 + N: AccumMse16<NR, true, B, N>(vctx, sp, nsp, rs, w, scr); return true;
    TQ_FIXED_SHAPES(TQ_FIXED_CASE)
#undef TQ_FIXED_CASE
    default: break;
  }
#elif HWY_TARGET == HWY_AVX2
  const I16Book& z = vctx.i16;
  if (vctx.task->d == 128 && (z.nib || z.inreg)) {
    switch (z.bits) {
      case 2: AccumMse16<NR, false, 2, 4>(vctx, sp, nsp, rs, w, scr); return true;
      case 3: AccumMse16<NR, false, 3, 4>(vctx, sp, nsp, rs, w, scr); return true;
      case 4: AccumMse16<NR, false, 4, 2>(vctx, sp, nsp, rs, w, scr); return true;
      default: break;
    }
  }
#else
  (void)vctx, (void)sp, (void)nsp, (void)rs, (void)w, (void)scr;
#endif
  return false;
}
#undef TQ_FIXED_SHAPES
#endif  // TQ_ATTN_I16

// Scores of tokens [a, b) of segment s for rows rs[0..NR) into logits rows.
template <size_t NR>
HWY_INLINE void ScoreGroup(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                           attn::Row* const* rs, float* const* lg, AScratch& scr) {
  const attn::Task& task = *ctx.task;
  const size_t d = task.d;
  float koff[NR];
  const float* q[NR];
  if (!s.compressed) {
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      koff[r] = 0.0f;
      q[r] = rs[r]->q;
    }
    ScoreDecoded<NR>(MakeInfo(task.dense_fmt, nullptr, nullptr), s, a, b, d, q, koff, lg, scr);
    return;
  }
  const attn::Comp& kc = *ctx.kc;
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) koff[r] = rs[r]->koff;
  switch (kc.fmt) {
    case Fmt::kMse:
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) q[r] = rs[r]->qrot;
#ifdef TQ_ATTN_I16
      if (ctx.i16.on) {
        const SegPart part{&s, a, b};
        if (ScoreFixed<NR>(ctx, &part, 1, rs, koff, lg, scr)) return;
        if (ctx.i16.vnni) return ScoreMse16<NR, true>(ctx, s, a, b, rs, koff, lg, scr);
        return ScoreMse16<NR, false>(ctx, s, a, b, rs, koff, lg, scr);
      }
#endif
      if (kc.fast_mse) return ScoreMseFast<NR>(ctx, s, a, b, q, q, koff, lg, scr);
      return ScoreDecoded<NR>(MakeInfo(kc.fmt, &kc, ctx.luts[0]), s, a, b, d, q, koff, lg, scr);
    case Fmt::kProd:
#ifdef TQ_ATTN_I16
      if (ctx.i16.on) {  // (b-1)-bit MSE part and QJL signs, both as int16 dot products
        const SegPart part{&s, a, b};
#if HWY_TARGET == HWY_AVX2
        if (ScoreFixed<NR, true>(ctx, &part, 1, rs, koff, lg, scr)) return;  // MSE part and signs in one pass
#else
        if (ScoreFixed<NR>(ctx, &part, 1, rs, koff, lg, scr)) {  // AVX3_DL: MSE part, then the signs
          return AddQjl16<NR, true>(ctx, s, a, b, rs, lg, scr);
        }
#endif
        if (ctx.i16.vnni) return ScoreMse16<NR, true, true>(ctx, s, a, b, rs, koff, lg, scr);
        return ScoreMse16<NR, false, true>(ctx, s, a, b, rs, koff, lg, scr);
      }
#endif
      if (kc.fast_mse) {  // (b-1)-bit MSE part by the fast kernel, QJL signs on top
        const float* qs[NR];
        for (size_t r = 0; r < NR; ++r) {
          q[r] = rs[r]->qrot;
          qs[r] = rs[r]->qsk;
        }
        return ScoreMseFast<NR>(ctx, s, a, b, q, qs, koff, lg, scr);
      }
      [[fallthrough]];
    case Fmt::kSplit: {
#if HWY_TARGET == HWY_AVX3_DL
      if (ScoreSplitAny<NR>(ctx, s, a, b, rs, koff, lg, scr)) return;
#endif
#if HWY_TARGET == HWY_AVX2
      // The recipes' shape at head_dim 128 (3 + 1 MSE pieces, 3 + 1 QJL pieces).
      if (ctx.sk.on && ctx.sk.np == 4 && ctx.sk.nq0 == 3 && ctx.sk.nq == 4) {
        return ScoreSplitAvx2<4, 3, 4, NR>(ctx, s, a, b, rs, koff, lg, scr);
      }
#endif
      if (SplitRowsOk(kc)) return ScoreSplitRows<NR>(ctx, s, a, b, rs, koff, lg, scr);
      // Each TurboQuant group's codec rows of the tile are gathered into one
      // contiguous block (they may sit inside split rows or in two planes),
      // then scored for every query row in one call of the codec's scorer.
      const size_t n = b - a;
      for (size_t r = 0; r < NR; ++r) {
        for (size_t t = 0; t < n; ++t) lg[r][t] = koff[r];
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
          ScoreRowsImpl(plan, rs[r]->qrot + gr.rot_offset,
                        rs[r]->qsk ? rs[r]->qsk + gr.sketch_offset : nullptr, rows, n,
                        scr.tmp.data());
          for (size_t t = 0; t < n; ++t) lg[r][t] += scr.tmp[t];
        }
      }
      return;
    }
    case Fmt::kIntAsym: {
#if HWY_TARGET == HWY_AVX3_DL
      if (ScoreGKeysAny<NR>(ctx, s, a, b, rs, koff, lg, scr)) return;
#endif
#if HWY_TARGET == HWY_AVX2
      if (ctx.gk.on && ctx.gk.kind == 1) return ScoreGKeysAvx2<1, NR>(ctx, s, a, b, rs, koff, lg, scr);
      if (ctx.gk.on && ctx.gk.kind == 2) return ScoreGKeysAvx2<2, NR>(ctx, s, a, b, rs, koff, lg, scr);
#endif
      // sum_j q_j (s u_j + z) per group: the decoder yields s u + z directly.
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) q[r] = rs[r]->q;
      return ScoreDecoded<NR>(MakeInfo(kc.fmt, &kc, nullptr), s, a, b, d, q, koff, lg, scr);
    }
    default:
#if HWY_TARGET == HWY_AVX3_DL
      if (ScoreGKeysAny<NR>(ctx, s, a, b, rs, koff, lg, scr)) return;
#endif
#if HWY_TARGET == HWY_AVX2
      if (ctx.gk.on && ctx.gk.kind == 0) return ScoreGKeysAvx2<0, NR>(ctx, s, a, b, rs, koff, lg, scr);
#endif
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) q[r] = rs[r]->q;
      return ScoreDecoded<NR>(MakeInfo(kc.fmt, &kc, nullptr), s, a, b, d, q, koff, lg, scr);
  }
}

#ifdef TQ_ATTN_I16
// The integer value kernels over parts sp[0..nsp) of compressed rows.
template <size_t NR>
HWY_INLINE void AccumMse16Parts(const KeyCtx& vctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                                float* const* w, AScratch& scr) {
  if (AccumFixed<NR>(vctx, sp, nsp, rs, w, scr)) return;
  if (vctx.i16.vnni) return AccumMse16<NR, true>(vctx, sp, nsp, rs, w, scr);
  return AccumMse16<NR, false>(vctx, sp, nsp, rs, w, scr);
}

// A tile's values over several parts of compressed rows (a paged cache's
// pages) in one call of the integer kernels: their fixed cost a call (the
// weights' rounding to int16, the flush of the int32 sums) had been paid
// a page.
template <size_t NR>
HWY_INLINE void AccumGroupParts(const KeyCtx& vctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                                float* const* w, AScratch& scr) {
  size_t n = 0;
  for (size_t i = 0; i < nsp; ++i) n += sp[i].b - sp[i].a;
  AddCompressedWeights<NR>(*vctx.kc, rs, w, n);
  AccumMse16Parts<NR>(vctx, sp, nsp, rs, w, scr);
}
#endif

template <size_t NR>
HWY_INLINE void AccumGroup(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b,
                           attn::Row* const* rs, float* const* w, AScratch& scr) {
  const attn::Task& task = *vctx.task;
  const size_t d = task.d;
  const size_t n = b - a;
  if (!s.compressed) {
    return AccumDecoded<NR>(MakeInfo(task.dense_fmt, nullptr, nullptr), s, a, b, d, rs, w, scr);
  }
  const attn::Comp& vc = *vctx.kc;
  AddCompressedWeights<NR>(vc, rs, w, n);
#ifdef TQ_ATTN_I16
  if (vctx.i16.on) {  // one-block TurboQuant-MSE or one-group int-asym values
    const SegPart part{&s, a, b};
    return AccumMse16Parts<NR>(vctx, &part, 1, rs, w, scr);
  }
#endif
#if HWY_TARGET == HWY_AVX2
  if (vc.fmt == Fmt::kIntAsym && vc.group_size == 32 && d == 128 && vc.meta_bytes == 16 && s.vm != nullptr) {
    if (vc.bits == 8 && vc.payload_bytes == 128) return AccumAsymAvx2<8, NR>(s, a, b, rs, w);
    if (vc.bits == 4 && vc.payload_bytes == 64) return AccumAsymAvx2<4, NR>(s, a, b, rs, w);
    if (vc.bits == 2 && vc.payload_bytes == 32) return AccumAsymAvx2<2, NR>(s, a, b, rs, w);
  }
#endif
#if HWY_TARGET == HWY_AVX3_DL
  if (vc.fmt == Fmt::kIntAsym && vc.group_size == 32 && d % 32 == 0 && d <= 256 &&
      vc.meta_bytes == d / 8 && s.vm != nullptr && CpuHasVnni()) {
    switch (vc.bits) {
      case 8: return AccumAsymG32<8, NR>(s, a, b, d, rs, w);
      case 4: return AccumAsymG32<4, NR>(s, a, b, d, rs, w);
      case 2: return AccumAsymG32<2, NR>(s, a, b, d, rs, w);
      default: break;
    }
  }
#endif
  switch (vc.fmt) {
    case Fmt::kMse:
      if (vc.fast_mse) return AccumMseFast<NR>(vctx, s, a, b, rs, w, scr);
      break;  // below: rotated domain, one row at a time
    case Fmt::kSplit:
#if HWY_TARGET == HWY_AVX3_DL
      if (vctx.sv.on) return AccumSplit16<NR>(vctx, s, a, b, rs, w);
#endif
#if HWY_TARGET == HWY_AVX2
      if (vctx.sv.on) return AccumSplitAvx2<NR>(vctx, s, a, b, rs, w);
#endif
      if (SplitValuesOk(vc)) return AccumSplitRows<NR>(vctx, s, a, b, rs, w, scr);
      break;
    case Fmt::kF16:
    case Fmt::kBF16:
    case Fmt::kInt8:
    case Fmt::kIntAsym:
      return AccumDecoded<NR>(MakeInfo(vc.fmt, &vc, nullptr), s, a, b, d, rs, w, scr);
    default:
      return;
  }
  // Generic TurboQuant values (any bits/blocks, split groups): rotated domain.
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

}  // namespace attnk
}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
