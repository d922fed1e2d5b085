// The integer value kernel AccumMse16 (one-block TurboQuant-MSE values of
// 2..4 bits, and int-asym values with one group a row): the portable loop,
// whose inner passes are the target's fixed-shape ones where its kernel
// table picks them (TargetKernels::FixedValuePasses: AccumI16FixedInner on
// AVX3_DL, AccumI16Avx2Inner on AVX2). The last part compiled with
// AVX-512 VNNI on AVX3_DL.

// Per-target include guard (Highway re-includes this file for every target).
#if defined(TQ_SRC_CPU_ATTENTION_INT16_VALUES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_ATTENTION_INT16_VALUES_INL_H_
#undef TQ_SRC_CPU_ATTENTION_INT16_VALUES_INL_H_
#else
#define TQ_SRC_CPU_ATTENTION_INT16_VALUES_INL_H_
#endif

#include "cpu/attention_avx2-inl.h"

// HWY_BEFORE_NAMESPACE, with AVX-512 VNNI on AVX3_DL (attention_shared-inl.h).
TQ_ATTN_BEFORE_VNNI_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {
namespace attnk {

#ifdef TQ_ATTN_I16  // the integer kernels (attention_int16-inl.h)

// Accumulates the four int16 centroid-pair vectors cv into acc[r][0..3] with
// each row's weight pair.
template <size_t NR, bool kVnni>
HWY_INLINE void AccumPairs(const hn::Vec<B16>* cv, const int16_t* const* wps, size_t p,
                           hn::Vec<B32> (*acc)[4], hn::Vec<B32> (*acc2)[4]) {
  const B16 d16;
  const B32 d32;
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    int32_t pair;
    std::memcpy(&pair, wps[r] + 2 * p, 4);
    const auto wv = hn::BitCast(d16, hn::Set(d32, pair));
    HWY_UNROLL(4)
    for (size_t u = 0; u < 4; ++u) {
      acc[r][u] = MulAcc16<kVnni>(cv[u], wv, acc[r][u], acc2[r][u]);
    }
  }
}

// Value sums of rows rs over the tokens of parts sp[0..nsp) (runs of
// compressed rows, in position order: a tile of one segment, or of several
// pages, whose weights w[r] are contiguous): weights (softmax weight x row
// scale) of each row rounded to int16 against the tile's largest, tokens
// taken in pairs (one int32 lane = c_t w_t + c_t+1 w_t+1), int32 sums
// flushed once per call into the row's private float sums (scr.priv).
// FB > 0: the target's fixed-shape passes for FB-bit codes in
// FN chunks (see ScoreI16Fixed).
template <size_t NR, bool kVnni, int FB, size_t FN>
HWY_NOINLINE void AccumMse16(const KeyCtx& vctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                             float* const* w, AScratch& scr) {
  const AF df;
  const B8 d8;
  const B16 d16;
  const B32 d32;
  const attn::Task& task = *vctx.task;
  const CodecPlan* plan = MsePlanOf(vctx);
  const I16Book& z = vctx.i16;
  const size_t plen = z.nvec_v * kN32;
  size_t n = 0;
  for (size_t i = 0; i < nsp; ++i) n += sp[i].b - sp[i].a;
  const size_t npairs = (n + 1) / 2;
  // Code rows of the tile (nib, inreg: the rows themselves, or padded copies
  // where a plain load would leave the storage; else unpacked bytes); an odd
  // tile gets a zero twin.
  const size_t ulen = z.nch * kN8;
  const uint8_t* rows[kTile + 1];
  HWY_ALIGN float vs[kTile + kL];
  float zs[kTile];  // int-asym: the rows' zeros
  scr.tile.resize((2 * npairs) * ulen + 64);
  size_t o = 0;  // the part's first token in the tile
  for (size_t pi = 0; pi < nsp; ++pi) {
    const attn::Seg& s = *sp[pi].s;
    const size_t a = sp[pi].a, m = sp[pi].b - sp[pi].a;
    for (size_t t = o; t < o + m; ++t) {
      const uint8_t* src = s.v + (a + t - o) * s.v_stride;
      uint8_t* dst = scr.tile.data() + t * ulen;
      if (FB > 0 || z.nib || z.inreg) {
        if (FB > 0 || kMaskedCodes || z.extent <= s.v_stride) {
          rows[t] = src;
        } else {
          std::memcpy(dst, src, z.nbytes);
          std::memset(dst + z.nbytes, 0, ulen - z.nbytes);
          rows[t] = dst;
        }
      } else {
        Unpack(src, task.d, z.bits, dst, z.nbytes);
        rows[t] = dst;
      }
    }
    // Row scales (and int-asym zeros); consecutive fp16 scales a vector at a
    // time (Scales16 stores 16 lanes: past a part's end into the next part's,
    // which overwrites them, or into vs's tail, zeroed below).
    float* vso = vs + o;
    size_t t_sc = 0;
    if (!z.asym && plan->scale_f16 && s.vm_stride == 2) {
      const auto* h = reinterpret_cast<const hwy::float16_t*>(s.vm + a * 2);
      for (; t_sc + kL <= m; t_sc += kL) hn::StoreU(hn::PromoteTo(df, hn::LoadU(AH(), h + t_sc)), df, vso + t_sc);
    }
    if (!z.asym) {
      const bool vlead = MetaAfterCodes(s.v, s.vm, s.vm_stride);
      for (; t_sc < m; t_sc += 16) {
        Scales16(*plan, s.vm + (a + t_sc) * s.vm_stride, s.vm_stride, std::min<size_t>(16, m - t_sc), vso + t_sc, vlead);
      }
    }
    for (size_t t = t_sc; t < m; ++t) vso[t] = Half(s.vm + (a + t) * s.vm_stride);
    if (z.asym) {
      for (size_t t = 0; t < m; ++t) {
        zs[o + t] = Half(s.vm + (a + t) * s.vm_stride + 2) + static_cast<float>(1 << (z.bits - 1)) * vso[t];
      }
    }
    o += m;
  }
  if (n % 2) {
    std::memset(scr.tile.data() + n * ulen, 0, ulen);
    rows[n] = scr.tile.data() + n * ulen;
  }
  // Int16 weights (consecutive int16s: the pair of tokens 2p, 2p+1 is the
  // int32 at 2p); per row the factor back to float.
  for (size_t t = n; t < kTile + kL; ++t) vs[t] = 0.0f;
  HWY_ALIGN int16_t w16[NR][kTile + kL];
  float fac[NR];
  float* priv[NR];
  bool any = false;
  const hn::Rebind<int16_t, AF> dh;
  // In three stages over the rows (products and their maxima, the
  // reductions, the int16 weights), so that the rows' reductions and
  // divisions overlap instead of each waiting on its own.
  HWY_ALIGN float wt[NR][kTile + kL];
  AV mxv[NR];
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    rs[r]->int_values = true;
    priv[r] = scr.priv.data() + static_cast<size_t>(rs[r] - task.rows) * plen;
    mxv[r] = hn::Zero(df);
    for (size_t t = 0; t < n; t += kL) {
      const AV x = hn::IfThenElseZero(hn::FirstN(df, n - t),
                                      hn::Mul(hn::LoadU(df, w[r] + t), hn::Load(df, vs + t)));
      mxv[r] = hn::Max(mxv[r], x);
      hn::Store(x, df, wt[r] + t);
    }
  }
  float mxs[NR];
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) mxs[r] = hn::GetLane(hn::MaxOfLanes(df, mxv[r]));
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    const float mx = mxs[r];
    const AV f = hn::Set(df, mx > 0.0f ? static_cast<float>(z.wmax) / mx : 0.0f);
    fac[r] = mx > 0.0f ? mx / static_cast<float>(z.wmax) / z.cscale : 0.0f;
    any |= mx > 0.0f;
    for (size_t t = 0; t < n; t += kL) {
      hn::Store(hn::DemoteTo(dh, hn::NearestInt(hn::Mul(hn::Load(df, wt[r] + t), f))), dh, w16[r] + t);
    }
    w16[r][n] = 0;  // an odd tile's twin
    if (z.asym) {  // sum_t w_t z_t, added to every coordinate at the end of the task
      float zsum = 0.0f;
      for (size_t t = 0; t < n; ++t) zsum += w[r][t] * zs[t];
      scr.zsum[static_cast<size_t>(rs[r] - task.rows)] += zsum;
    }
  }
  if (!any) return;
  const auto tlo = hn::LoadDup128(d8, z.lo);
  const auto thi = hn::LoadDup128(d8, z.hi);
  const auto m4 = hn::Set(d8, uint8_t{0x0F});
  TQ_IDX_CHUNK_CONSTANTS(z);
  const int16_t* wps[NR];
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) wps[r] = w16[r];
  if constexpr (FB > 0) {
    TargetKernels<HWY_TARGET>::template FixedValuePasses<NR, FB, FN>(z, rows, npairs, wps, fac, priv);
    return;
  }
  // One pass a group of four accumulators per row (v0 .. v0 + 3).
  const size_t npass = z.nvec_v / 4;
  const size_t nb = z.nbytes;  // code bytes a row (the rest of a padded copy is zero)
  for (size_t pass = 0; pass < npass; ++pass) {
    hn::Vec<B32> acc[NR][4], acc2[NR][4];
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      for (size_t u = 0; u < 4; ++u) acc[r][u] = acc2[r][u] = hn::Zero(d32);
    }
    if (z.nib) {
      // pass = 2 c + g: code bytes of load c, byte half g of each block;
      // bytes of tokens t, t+1 interleaved, then the even and odd
      // coordinates' index pairs are the low and high nibbles.
      const size_t c = pass / 2, g = pass % 2;
      for (size_t p = 0; p < npairs; ++p) {
        const auto xa = LoadCodes(rows[2 * p], c * kN8, nb);
        const auto xb = LoadCodes(rows[2 * p + 1], c * kN8, nb);
        const auto r8 = g ? hn::InterleaveUpper(d8, xa, xb) : hn::InterleaveLower(d8, xa, xb);
        hn::Vec<B16> cv[4];
        Centroids16(tlo, thi, hn::And(r8, m4), &cv[0], &cv[1]);
        Centroids16(tlo, thi, hn::And(hn::BitCast(d8, hn::ShiftRight<4>(hn::BitCast(d16, r8))), m4),
                    &cv[2], &cv[3]);
        AccumPairs<NR, kVnni>(cv, wps, p, acc, acc2);
      }
    } else {
      const size_t c = pass;
      for (size_t p = 0; p < npairs; ++p) {
        const auto ia = TQ_IDX_CHUNK(z, rows[2 * p], nb, c);
        const auto ib = TQ_IDX_CHUNK(z, rows[2 * p + 1], nb, c);
        hn::Vec<B16> cv[4];
        Centroids16(tlo, thi, hn::InterleaveLower(d8, ia, ib), &cv[0], &cv[1]);
        Centroids16(tlo, thi, hn::InterleaveUpper(d8, ia, ib), &cv[2], &cv[3]);
        AccumPairs<NR, kVnni>(cv, wps, p, acc, acc2);
      }
    }
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      const AV fv = hn::Set(df, fac[r]);
      for (size_t u = 0; u < 4; ++u) {
        float* dst = priv[r] + (4 * pass + u) * kN32;
        const AV x = hn::ConvertTo(df, hn::RearrangeToOddPlusEven(acc[r][u], acc2[r][u]));
        hn::StoreU(hn::MulAdd(x, fv, hn::LoadU(df, dst)), df, dst);
      }
    }
  }
}

#endif  // TQ_ATTN_I16

}  // namespace attnk
}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
