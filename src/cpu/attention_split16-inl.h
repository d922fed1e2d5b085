// The split recipes' rows (turboquant25/35) as the int16 split kernels of
// AVX3_DL (ScoreSplit16, AccumSplit16; attention_avx512_groups-inl.h) and
// AVX2 (ScoreSplitAvx2, AccumSplitAvx2; attention_avx2-inl.h) read them:
// the shapes both targets' builders share (SplitKeyShape, SplitValShape),
// the extended int16 queries of split keys (PrepareSplitKeys) and a tile's
// int16 weights of split values (SplitValWeights).

// Per-target include guard (Highway re-includes this file for every target).
#if defined(TQ_SRC_CPU_ATTENTION_SPLIT16_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_ATTENTION_SPLIT16_INL_H_
#undef TQ_SRC_CPU_ATTENTION_SPLIT16_INL_H_
#else
#define TQ_SRC_CPU_ATTENTION_SPLIT16_INL_H_
#endif

#include "cpu/attention_int16-inl.h"

// HWY_BEFORE_NAMESPACE, with AVX-512 VNNI on AVX3_DL (attention_shared-inl.h).
TQ_ATTN_BEFORE_VNNI_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {
namespace attnk {

#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
// Split keys (turboquant25/35: a regular and an outlier group, each a prod
// code: (b-1)-bit MSE indices over rotation blocks with one fp16 scale each,
// then QJL sign bits with a residual norm) as int16 dot products. The MSE
// codes of every 32-coordinate piece and the sign bits of every 32 QJL
// coordinates become int16 vectors in the units of one per-token factor,
// so each query row sums a token in one int32 accumulator: per token, the
// terms' magnitudes (block scale x largest centroid; QJL coefficient x
// residual norm / lambda) give ratios to their largest (ScoreGKeys' idea),
// MSE codes are looked up as int16 centroids (15 bits) and brought to
// those units by vpmulhrsw, and sign bits become +-V by a masked blend.
// The query side is one int16 vector per row: the rotated query followed by
// the QJL sketch times lambda (per group, chosen per task so both halves
// use the int16 range), so the sign term sum_k sk_k sign_k is a plain
// product. The two targets differ in how a piece's codes are expanded
// (ScoreSplit16 on AVX3_DL, ScoreSplitAvx2 on AVX2).
// A split group's rotation block usable by the int16 split kernels (sizes
// and offsets in whole 32-coordinate pieces): the largest |centroid| of its
// codebook, or 0 when it does not qualify.
inline float SplitBlockCmax(const BlockPlan& bp, int bits) {
  if (bp.size % 32 != 0 || bp.offset % 32 != 0) return 0.0f;
  float cm = 0.0f;
  for (size_t e = 0; e < (size_t{1} << bits); ++e) cm = std::max(cm, std::fabs(bp.centroids[e]));
  return cm > 0.0f && std::isfinite(cm) ? cm : 0.0f;
}

// A split piece's int16 centroid e: cent[e] in units of cs.
inline uint16_t SplitCent16(const float* cent, float cs, size_t e) {
  return static_cast<uint16_t>(static_cast<int16_t>(std::lrint(cent[e] * cs)));
}

// An MSE piece of a split key row: 32 coordinates of one rotation block.
struct SplitPiece {
  size_t byte;   // first code byte in the split row
  int bits;
  size_t term;   // its block's scale term
  size_t xbase;  // extended query index of its first coordinate
  const float* cent;
  float cs;      // int16 units per centroid unit
};
// The shape of a split key row shared by the targets' builders: its MSE
// pieces (returned in pcs[0..*np)), and into k its QJL pieces, scale terms
// (term bytes, multipliers and ratio targets: the nm block scales, then +V
// of each group, then -V of each group), row bytes and the QJL pieces'
// query lanes (32 np + 32 q + i: the same on both targets). False: not a
// shape the int16 split kernels take.
inline bool SplitKeyShape(const attn::Comp* c, size_t d, SplitPiece* pcs, size_t* np_out, SplitKeys* k) {
  size_t np = 0, nm = 0, nq = 0, rowbytes = 0;
  size_t term_byte[8] = {};
  float term_mul[8] = {};
  for (int g = 0; g < 2; ++g) {
    const attn::Group& gr = c->groups[g];
    const CodecPlan& plan = *gr.plan;
    if (!plan.scale_f16 || plan.mse_bits < 1 || plan.mse_bits > 3 || plan.qjl_dim == 0 ||
        plan.qjl_dim % 32 != 0) {
      return false;
    }
    rowbytes = std::max(rowbytes, gr.row_offset + plan.row_bytes);
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      const BlockPlan& bp = plan.blocks[b];
      const float cm = SplitBlockCmax(bp, plan.mse_bits);
      if (cm == 0.0f || nm == 4) return false;
      const size_t term = nm++;
      term_byte[term] = gr.row_offset + plan.scale_offset + b * plan.scale_bytes;
      term_mul[term] = cm;
      for (size_t kk = 0; kk < bp.size / 32; ++kk) {
        if (np == 8) return false;
        pcs[np++] = {gr.row_offset + (bp.offset + 32 * kk) * static_cast<size_t>(plan.mse_bits) / 8,
                     plan.mse_bits, term, gr.rot_offset + bp.offset + 32 * kk, bp.centroids,
                     16383.0f / cm};
      }
    }
    for (size_t kk = 0; kk < plan.qjl_dim / 32; ++kk) {
      if (nq == 8) return false;
      k->sbyte[nq] = static_cast<uint16_t>(gr.row_offset + plan.sign_offset + 4 * kk);
      k->sgroup[nq] = static_cast<uint8_t>(g);
      ++nq;
    }
  }
  if (np == 0) return false;
  *np_out = np;
  k->nq = nq;
  k->nq0 = c->groups[0].plan->qjl_dim / 32;
  k->nm = nm;
  k->rowbytes = rowbytes;
  // QJL terms: +V of group g at nm + g, -V at nm + 2 + g.
  for (int g = 0; g < 2; ++g) {
    const attn::Group& gr = c->groups[g];
    term_byte[nm + g] = term_byte[nm + 2 + g] = gr.row_offset + gr.plan->resid_offset;
  }
  for (size_t t = 0; t < 16; ++t) {
    k->tmul[t] = t < nm ? term_mul[t] : 0.0f;  // QJL multipliers: PrepareSplitKeys (lambda)
    k->tgt[t] = t < nm ? 16383.5f : t < nm + 2 ? 8191.0f : t < nm + 4 ? -8191.0f : 0.0f;
    // Past the terms: term 0's bytes (read, times a zero multiplier).
    if (t < 8) k->tbyte[t] = static_cast<uint16_t>(term_byte[t < nm + 4 ? t : 0]);
  }
  for (size_t q = 0; q < nq; ++q) {
    const attn::Group& gr = c->groups[k->sgroup[q]];
    // The piece's index within its group, from its sign bytes.
    const size_t kk = (k->sbyte[q] - gr.row_offset - gr.plan->sign_offset) / 4;
    for (size_t L = 0; L < 32; ++L) {
      k->xmap[32 * np + 32 * q + L] = static_cast<uint16_t>(d + gr.sketch_offset + 32 * kk + L);
    }
  }
  return true;
}

// max_j |p[j]| over n floats (0 when n = 0).
HWY_INLINE float MaxAbsOf(const float* p, size_t n) {
  const AF df;
  AV mv = hn::Zero(df);
  size_t j = 0;
  for (; j + kL <= n; j += kL) mv = hn::Max(mv, hn::Abs(hn::LoadU(df, p + j)));
  float mx = hn::GetLane(hn::MaxOfLanes(df, mv));
  for (; j < n; ++j) mx = std::max(mx, std::fabs(p[j]));
  return mx;
}

// The extended int16 queries of every task row (k->nv vectors of k->lanes
// int16), and the QJL terms' multipliers (lambda is chosen here, from the
// task's queries). Vector loops and one gather a vector (scalar loops had
// been 12% of the samples of a 64-token turboquant35 decode); the values
// are the scalar form's: rounding is monotone, so max_j |fl(v_j lambda)| =
// |fl(lambda max_j |v_j|)|.
inline void PrepareSplitKeys(const attn::Task& task, const attn::Comp& c, SplitKeys* k, AScratch& scr) {
  const size_t d = task.d, len = k->nv * k->lanes;
  size_t msk = 0;
  for (int g = 0; g < 2; ++g) msk += c.groups[g].plan->qjl_dim;
  float qmx[2] = {0.0f, 0.0f}, smx[2] = {0.0f, 0.0f};
  const size_t nr = task.num_rows;
  // Per row and group: max |rotated query|, max |sketch|.
  auto row_max = [&](const attn::Row& row, int g, float* rq, float* rs) {
    const attn::Group& gr = c.groups[g];
    *rq = MaxAbsOf(row.qrot + gr.rot_offset, gr.plan->dim);
    *rs = MaxAbsOf(row.qsk + gr.sketch_offset, gr.plan->qjl_dim);
  };
  for (size_t r = 0; r < nr; ++r) {
    const attn::Row& row = task.rows[r];
    if (row.qrot == nullptr || row.qsk == nullptr) continue;
    for (int g = 0; g < 2; ++g) {
      float rq, rs;
      row_max(row, g, &rq, &rs);
      qmx[g] = std::max(qmx[g], rq);
      smx[g] = std::max(smx[g], rs);
    }
  }
  for (int g = 0; g < 2; ++g) {
    k->lambda[g] = qmx[g] > 0.0f && smx[g] > 0.0f ? qmx[g] / smx[g] : 1.0f;
    const float coef = static_cast<float>(1.2533141373155002512 / static_cast<double>(c.groups[g].plan->qjl_dim));
    k->tmul[k->nm + g] = k->tmul[k->nm + 2 + g] = coef / k->lambda[g];
  }
  scr.qs16x.assign(nr * len, 0);
  scr.qs16inv.assign(nr, 0.0f);
  if (scr.tmp.size() < d + msk + len) scr.tmp.resize(d + msk + len);
  float* x = scr.tmp.data();
  float* f = x + d + msk;
  const AF df;
  for (size_t r = 0; r < nr; ++r) {
    const attn::Row& row = task.rows[r];
    if (row.qrot == nullptr || row.qsk == nullptr) continue;
    float rq[2], rs[2];
    for (int g = 0; g < 2; ++g) row_max(row, g, &rq[g], &rs[g]);
    // The groups' rotated coordinates cover [0, d) (regular, then outlier).
    float mx = std::max(rq[0], rq[1]);
    std::memcpy(x, row.qrot, d * sizeof(float));
    for (int g = 0; g < 2; ++g) {
      const attn::Group& gr = c.groups[g];
      const size_t m = gr.plan->qjl_dim;
      const float lam = k->lambda[g];
      const float* src = row.qsk + gr.sketch_offset;
      float* dst = x + d + gr.sketch_offset;
      const AV vl = hn::Set(df, lam);
      size_t j = 0;
      for (; j + kL <= m; j += kL) hn::StoreU(hn::Mul(hn::LoadU(df, src + j), vl), df, dst + j);
      for (; j < m; ++j) dst[j] = src[j] * lam;
      mx = std::max(mx, std::fabs(rs[g] * lam));
    }
    if (!(mx > 0.0f)) continue;  // zero query: every score is koff
    const float qs = static_cast<float>(k->qmax) / mx;
    const AV vqs = hn::Set(df, qs);
    const hn::Rebind<uint16_t, AI> d16;
    for (size_t i = 0; i < len; i += kL) {
      const auto idx = hn::PromoteTo(AI(), hn::LoadU(d16, k->xmap + i));
      hn::StoreU(hn::Mul(hn::GatherIndex(df, x, idx), vqs), df, f + i);
    }
    RoundToI16(f, len, scr.qs16x.data() + r * len);
    scr.qs16inv[r] = 1.0f / qs;
  }
}

// Split values (two TurboQuant-MSE groups of 2..4 bits at head_dim 128, in
// 4 pieces of 32 coordinates) as int16 dot products: per pair of tokens and
// piece, the two tokens' int16 centroids (12 bits) as (a, b) pairs, each
// int32 lane summing c_a u_a + c_b u_b, u = weight x block scale rounded
// to 13 bits against the tile's largest per (row, block), as in AccumMse16.
// The shape shared by the targets' builders: v's terms (scale bytes, int16
// units per centroid unit), pieces' terms and output offsets and row bytes;
// pcs[p] = {first code byte, bits, centroids}. False: not a shape the
// kernels take.
struct SplitValPiece {
  size_t byte;
  size_t bits;
  const float* cent;
};
inline bool SplitValShape(const attn::Comp* c, size_t d, SplitVals* v, SplitValPiece* pcs) {
  v->on = false;
  if (c == nullptr || c->fmt != Fmt::kSplit || c->num_groups != 2 || d != 128) return false;
  size_t np = 0, nterm = 0, rowbytes = 0;
  for (int g = 0; g < 2; ++g) {
    const attn::Group& gr = c->groups[g];
    const CodecPlan& plan = *gr.plan;
    if (!plan.scale_f16 || plan.qjl_dim != 0 || plan.mse_bits < 2 || plan.mse_bits > 4) return false;
    rowbytes = std::max(rowbytes, gr.row_offset + plan.row_bytes);
    const size_t bb = static_cast<size_t>(plan.mse_bits);
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      const BlockPlan& bp = plan.blocks[b];
      const float cm = SplitBlockCmax(bp, plan.mse_bits);
      if (cm == 0.0f || nterm == 4) return false;
      const size_t term = nterm++;
      v->tbyte[term] = static_cast<uint16_t>(gr.row_offset + plan.scale_offset + b * plan.scale_bytes);
      v->cs[term] = static_cast<float>(kValCmax) / cm;
      for (size_t kk = 0; kk < bp.size / 32; ++kk) {
        if (np == 4) return false;
        const size_t p = np++;
        pcs[p] = {gr.row_offset + (bp.offset + 32 * kk) * bb / 8, bb, bp.centroids};
        v->term[p] = term;
        v->out[p] = gr.rot_offset + bp.offset + 32 * kk;
      }
    }
  }
  if (np != 4) return false;
  v->np = np;
  v->nterm = nterm;
  v->rowbytes = rowbytes;
  return true;
}
// A tile's int16 weights for split values (both targets): per row and
// scale term, weight x the tokens' block scale (sg: a term's scales of the
// tile's n tokens, zeroed here past n) rounded against the tile's largest
// (TileWeights16), and fac, their factors back to float.
template <size_t NR>
HWY_INLINE void SplitValWeights(const SplitVals& v, attn::Row* const* rs, float* const* w, size_t n,
                                float (*sg)[kTile + kL], int16_t (*w16)[4][kTile + kL], float (*fac)[4]) {
  for (size_t tm = 0; tm < v.nterm; ++tm) {
    for (size_t t = n; t < kTile + kL; ++t) sg[tm][t] = 0.0f;
  }
  for (size_t r = 0; r < NR; ++r) {
    rs[r]->int_values = true;
    HWY_ALIGN float wr[kTile + kL];
    PadWeights(w[r], n, wr);
    for (size_t tm = 0; tm < v.nterm; ++tm) {
      fac[r][tm] = TileWeights16(wr, sg[tm], n, kWmax, w16[r][tm]) / (static_cast<float>(kWmax) * v.cs[tm]);
    }
  }
}
#endif  // HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2

}  // namespace attnk
}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
