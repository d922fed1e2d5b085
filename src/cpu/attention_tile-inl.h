// The kernels of a call and the tile loop. PickKernels fills the call's
// kernel table once (CallKernels: for each count of query rows served at a
// time, the keys' and values' kernels of dense and of compressed rows):
// the portable choice for the call's formats first (PortableKeys,
// PortableValues), then the target's own kernels where they apply
// (TargetKernels<HWY_TARGET>::Pick: the fixed-shape AVX-512 and AVX2
// kernels). The tile loop (AttnRunImpl) runs a work item's query rows
// against its segments in 64-token tiles through that table (keys scored,
// one online softmax, values accumulated), prefill tiles decoded once for
// many rows, and ends the task (the integer kernels' lanes back to
// coordinate order). AttnKernelInfoImpl names the kernels for reports.

// Per-target include guard (Highway re-includes this file for every target).
#if defined(TQ_SRC_CPU_ATTENTION_TILE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_ATTENTION_TILE_INL_H_
#undef TQ_SRC_CPU_ATTENTION_TILE_INL_H_
#else
#define TQ_SRC_CPU_ATTENTION_TILE_INL_H_
#endif

#include "cpu/attention_int16_values-inl.h"
#include "cpu/dispatch.h"

HWY_BEFORE_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {
namespace attnk {

// ---------------------------------------------------------------------------
// The kernels of a call.

// A compressed segment's keys on every target: the integer kernels
// (one-block MSE and prod keys of 2..4 bits), the fast fp32 ones, split
// rows, the codec's scorer, or rows decoded per element.
template <size_t NR>
KeyFn PortableKeys(const attn::Comp& kc, [[maybe_unused]] const KeyCtx& kctx, size_t d) {
  switch (kc.fmt) {
    case Fmt::kMse:
#ifdef TQ_ATTN_I16
      if (kctx.i16.on) {
        return kctx.i16.vnni ? &KeysWithOffsets<NR, &ScoreMse16<NR, true>>
                             : &KeysWithOffsets<NR, &ScoreMse16<NR, false>>;
      }
#endif
      if (kc.fast_mse) return &KeysMseFast<NR, false>;
      return &KeysDecoded<Fmt::kMse, NR, KeyQuery::kRotated>;
    case Fmt::kProd:
#ifdef TQ_ATTN_I16
      if (kctx.i16.on) {  // (b-1)-bit MSE part and QJL signs, both as int16 dot products
        return kctx.i16.vnni ? &KeysWithOffsets<NR, &ScoreMse16<NR, true, true>>
                             : &KeysWithOffsets<NR, &ScoreMse16<NR, false, true>>;
      }
#endif
      if (kc.fast_mse) return &KeysMseFast<NR, true>;  // (b-1)-bit MSE part by the fast kernel, QJL signs on top
      return &ScoreCodecRows<NR>;
    case Fmt::kSplit:
      if (SplitRowsOk(kc)) return &KeysWithOffsets<NR, &ScoreSplitRows<NR>>;
      return &ScoreCodecRows<NR>;
    default:  // int8, int-asym and dense-format rows: sum_j q_j (s u_j + z) per group from the decoder
      return DecodedKeys<NR, KeyQuery::kPlain>(kc.fmt, d);
  }
}

// A compressed segment's values on every target: the integer kernels
// (one-block MSE values of 2..4 bits, int-asym values with one group a
// row), the fast fp32 ones, split rows, rows decoded per element, or
// TurboQuant rows of any other shape in the rotated domain.
template <size_t NR>
void PortableValues(const attn::Comp& vc, [[maybe_unused]] const KeyCtx& vctx, size_t d, RowKernels* k) {
#ifdef TQ_ATTN_I16
  if (vctx.i16.on) {
    k->value_parts = vctx.i16.vnni ? &AccumMse16<NR, true> : &AccumMse16<NR, false>;
    return;
  }
#endif
  switch (vc.fmt) {
    case Fmt::kMse:
      k->values = vc.fast_mse ? &AccumMseFast<NR> : &AccumRotatedRows<NR>;
      return;
    case Fmt::kSplit:
      k->values = SplitValuesOk(vc) ? &AccumSplitRows<NR> : &AccumRotatedRows<NR>;
      return;
    case Fmt::kF16:
    case Fmt::kBF16:
    case Fmt::kInt8:
    case Fmt::kIntAsym:
      k->values = DecodedValues<NR, false>(vc.fmt, d);
      return;
    default:
      k->values = &NoValues;
      return;
  }
}

template <size_t NR>
void PickRowKernels(const attn::Task& task, const KeyCtx& kctx, const KeyCtx& vctx, RowKernels* k) {
  const size_t d = task.d;
  k->dense_keys = DecodedKeys<NR, KeyQuery::kDense>(task.dense_fmt, d);
  k->dense_values = DecodedValues<NR, true>(task.dense_fmt, d);
  k->f32_values = DecodedValues<NR, true>(Fmt::kF32, d);
  k->keys = task.kc ? PortableKeys<NR>(*task.kc, kctx, d) : &NoKeys;
  k->values = &NoValues;
  if (task.vc) PortableValues<NR>(*task.vc, vctx, d, k);
  TargetKernels<HWY_TARGET>::template Pick<NR>(kctx, vctx, k);
}

// The call's kernels, once for each row count (kctx, vctx: prepared).
HWY_INLINE void PickKernels(const attn::Task& task, const KeyCtx& kctx, const KeyCtx& vctx, CallKernels* k) {
  PickRowKernels<1>(task, kctx, vctx, &k->rows[0]);
  PickRowKernels<2>(task, kctx, vctx, &k->rows[1]);
  PickRowKernels<3>(task, kctx, vctx, &k->rows[2]);
  PickRowKernels<4>(task, kctx, vctx, &k->rows[3]);
}

// Keys of rows [a, b) of segment s (counted from its first row) for rows
// rs[0..NR), through the call's kernels k: dense rows, or compressed rows
// by the parts kernel (one part) where there is one.
template <size_t NR>
HWY_INLINE void ScoreGroup(const RowKernels& k, const KeyCtx& kctx, const attn::Seg& s, size_t a, size_t b,
                           attn::Row* const* rs, float* const* lg, AScratch& scr) {
  if (!s.compressed) return k.dense_keys(kctx, s, a, b, rs, lg, scr);
  if (k.key_parts == nullptr) return k.keys(kctx, s, a, b, rs, lg, scr);
  float koff[NR];
  KeyOffsets<NR>(rs, koff);
  const SegPart part{&s, a, b};
  k.key_parts(kctx, &part, 1, rs, koff, lg, scr);
}
// Values likewise, weights w[r][t - a].
template <size_t NR>
HWY_INLINE void AccumGroup(const RowKernels& k, const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b,
                           attn::Row* const* rs, float* const* w, AScratch& scr) {
  if (!s.compressed) return k.dense_values(vctx, s, a, b, rs, w, scr);
  AddCompressedWeights<NR>(*vctx.kc, rs, w, b - a);
  if (k.value_parts == nullptr) return k.values(vctx, s, a, b, rs, w, scr);
  const SegPart part{&s, a, b};
  k.value_parts(vctx, &part, 1, rs, w, scr);
}

// ---------------------------------------------------------------------------
// The tile loop.

// Prefill tiles: when many query rows share a tile, its keys and values are
// decoded once into fp32 rows (bounded workspace: kTile rows) and every row
// group reads those. Dense rows are converted; fast-MSE rows become
// scale * centroid in the permuted rotated order (the order of the prepared
// queries and of the rotated value sums).
HWY_NOINLINE void DecodeMseTile(const CodecPlan& plan, const Lut* luts, const uint8_t* p0,
                                size_t stride, const uint8_t* m0, size_t mstride, size_t n,
                                float* out, AScratch& scr) {
  const AF df;
  const AI di;
  const AU du;
  const int bits = plan.mse_bits;
  const auto mask = hn::Set(du, (1u << bits) - 1u);
  const size_t d = plan.dim;
  const size_t extent = WordsExtent(plan);
  for (size_t t = 0; t < n; ++t) {
    const uint8_t* p = PadRow(p0 + t * stride, plan.index_bytes, extent, stride, scr.pad.data());
    float* o = out + t * d;
    for (size_t bl = 0; bl < plan.num_blocks; ++bl) {
      const BlockPlan& bp = plan.blocks[bl];
      const Lut& lut = luts[bl];
      const AV tab = hn::Load(df, lut.tab);
      const AV sc = hn::Set(df, Scale(plan, m0 + t * mstride + bl * plan.scale_bytes));
      const size_t groups = bp.size / 8;
      for (size_t i0 = 0; i0 < groups; i0 += kL) {
        const auto w = Words(p, bp.offset / 8 + i0, bits);
        const auto lanes = hn::FirstN(df, std::min(kL, groups - i0));
        for (int k = 0; k < 8; ++k) {
          const auto iv = hn::BitCast(di, hn::And(hn::ShiftRightSame(w, bits * k), mask));
          hn::BlendedStore(hn::Mul(LookupIdx(lut, tab, iv), sc), lanes, df,
                           o + bp.offset + static_cast<size_t>(k) * groups + i0);
        }
      }
    }
  }
}

HWY_NOINLINE void DecodeDenseTile(Fmt f, const uint8_t* p0, size_t stride, size_t n, size_t d,
                                  float* out) {
  const AF df;
  for (size_t t = 0; t < n; ++t) {
    const uint8_t* p = p0 + t * stride;
    size_t j = 0;
    for (; j + kL <= d; j += kL) hn::StoreU(LoadDense(f, p, j), df, out + t * d + j);
    for (; j < d; ++j) out[t * d + j] = DenseScalar(f, p, j);
  }
}

// Decodes rows [t, t + n) of one component of segment s into out ([n][d] fp32):
// fast-MSE rows (compressed) or dense rows.
HWY_INLINE void DecodeTile(const attn::Task& task, const attn::Comp* c, const Lut* luts,
                           const attn::Seg& s, bool keys, size_t t, size_t n, float* out,
                           AScratch& scr) {
  const uint8_t* p = keys ? s.k : s.v;
  const size_t stride = keys ? s.k_stride : s.v_stride;
  if (s.compressed) {
    const uint8_t* m = keys ? s.km : s.vm;
    const size_t mstride = keys ? s.km_stride : s.vm_stride;
    DecodeMseTile(*c->groups[0].plan, luts, p + t * stride, stride, m + t * mstride, mstride, n,
                  out, scr);
  } else {
    DecodeDenseTile(task.dense_fmt, p + t * stride, stride, n, task.d, out);
  }
}

// Prefill keys of a decoded fp32 tile held transposed (kt[j * kTile + t]):
// the scores of NR rows against its n tokens as a small matrix product with
// a vector of tokens per accumulator, so no horizontal sums: for each
// coordinate j, NC token vectors are loaded and each row's q_j broadcast.
template <size_t NR>
HWY_NOINLINE void ScoreTileT(const float* kt, size_t n, size_t d, const float* const* q,
                             const float* koff, float* const* lg) {
  const AF df;
  constexpr size_t NC = kL >= 16 ? 4 : kL >= 4 ? 2 : 1;  // token vectors a pass
  for (size_t t0 = 0; t0 < n; t0 += NC * kL) {
    AV acc[NR][NC];
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      HWY_UNROLL(4)
      for (size_t c = 0; c < NC; ++c) acc[r][c] = hn::Set(df, koff[r]);
    }
    for (size_t j = 0; j < d; ++j) {
      AV kv[NC];
      HWY_UNROLL(4)
      for (size_t c = 0; c < NC; ++c) kv[c] = hn::LoadU(df, kt + j * kTile + t0 + c * kL);
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) {
        const AV qv = hn::Set(df, q[r][j]);
        HWY_UNROLL(4)
        for (size_t c = 0; c < NC; ++c) acc[r][c] = hn::MulAdd(qv, kv[c], acc[r][c]);
      }
    }
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      HWY_UNROLL(4)
      for (size_t c = 0; c < NC; ++c) {
        const size_t t = t0 + c * kL;
        if (t >= n) break;
        if (t + kL <= n) {
          hn::StoreU(acc[r][c], df, lg[r] + t);
        } else {
          HWY_ALIGN float tmp[kL];
          hn::Store(acc[r][c], df, tmp);
          for (size_t i = 0; t + i < n; ++i) lg[r][t + i] = tmp[i];
        }
      }
    }
  }
}

// Calls f(std::integral_constant<size_t, NR>) for NR = nr (1..kGroup).
template <class F>
HWY_INLINE void WithRows(size_t nr, F&& f) {
  switch (nr) {
    case 4: return f(std::integral_constant<size_t, 4>());
    case 3: return f(std::integral_constant<size_t, 3>());
    case 2: return f(std::integral_constant<size_t, 2>());
    default: return f(std::integral_constant<size_t, 1>());
  }
}

HWY_INLINE void InitCtx(const attn::Task& task, const attn::Comp* c, KeyCtx* ctx) {
  ctx->task = &task;
  ctx->kc = c;
  if (c == nullptr) return;
  for (int g = 0; g < c->num_groups; ++g) {
    const CodecPlan& plan = *c->groups[g].plan;
    if (plan.mse_bits == 0) continue;
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      InitLut(plan.blocks[b].centroids, plan.mse_bits, &ctx->luts[g][b]);
    }
  }
  ctx->info = MakeInfo(c->fmt, c, c->fmt == Fmt::kMse ? ctx->luts[0] : nullptr);
}
}  // namespace attnk

// The attention kernels of this target, for reports.
HWY_NOINLINE AttnKernelInfo AttnKernelInfoImpl() {
  return {hwy::TargetName(HWY_TARGET), attnk::TargetKernels<HWY_TARGET>::Set()};
}

HWY_NOINLINE void AttnRunImpl(const attn::Task& task) {
  using namespace attnk;  // NOLINT
  const AF df;
  AScratch& scr = AttnScratch();
  const size_t d = task.d;
  scr.logits.resize(task.num_rows * kTile);
  scr.idx.resize(IdxLen(d) + 64);
  size_t row_bytes = 0;
  if (task.kc) row_bytes = std::max(row_bytes, task.kc->payload_bytes + task.kc->meta_bytes);
  if (task.vc) row_bytes = std::max(row_bytes, task.vc->payload_bytes + task.vc->meta_bytes);
  scr.row.resize(row_bytes + 64);
  if (scr.pad.size() < row_bytes + 128) scr.pad.assign(row_bytes + 128, 0);
  KeyCtx kctx, vctx;
  InitCtx(task, task.kc, &kctx);
  InitCtx(task, task.vc, &vctx);
#ifdef TQ_ATTN_I16
  InitI16(task.kc, d, true, &kctx.i16);
  InitI16(task.vc, d, false, &vctx.i16);
  if (kctx.i16.on) TargetKernels<HWY_TARGET>::InitBook(&kctx.i16);
  if (vctx.i16.on) TargetKernels<HWY_TARGET>::InitBook(&vctx.i16);
#endif
  const bool q16_lanes = TargetKernels<HWY_TARGET>::Prepare(task, &kctx, &vctx, scr);
#ifdef TQ_ATTN_I16
  if (kctx.i16.on) PrepareQ16(task, kctx.i16, q16_lanes, scr);
  const size_t priv_len = vctx.i16.on ? vctx.i16.nvec_v * kN32 : 0;
  if (vctx.i16.on) {
    scr.priv.assign(task.num_rows * priv_len, 0.0f);
    scr.zsum.assign(task.num_rows, 0.0f);
  }
#else
  (void)q16_lanes;
#endif
  CallKernels kern;
  PickKernels(task, kctx, vctx, &kern);

  scr.lsum.assign(task.num_rows * kL, 0.0f);
  // Tiles are kTile positions of the task's range [t0, t1), whatever the
  // segments: a tile that spans segments (sinks, compressed history, the
  // recent window's two parts, or the paged cache's pages) is scored part
  // by part into one logits row, goes through the online softmax once and
  // is accumulated part by part. (One tile a segment had cost k16_v16, whose
  // four segments are read by the dense kernels, 1-4% against one dense
  // segment at 4K tokens, and a page a tile for small pages.) The segments
  // are sorted and contiguous from position 0 (every builder makes them so),
  // so the parts cover the tile. Kernels write and read a part's logits at
  // lg[r] + (part start - tile start); the row stride leaves kL floats past
  // the tile for their masked tail loads.
  constexpr size_t kLgStride = kTile + kL;
  scr.logits.resize(task.num_rows * kLgStride + kL);
  size_t seg0 = 0;  // the first segment that ends after the tile's start
  for (size_t pa = task.t0; pa < task.t1; pa += kTile) {
    const size_t pb = std::min(pa + kTile, task.t1);
    const size_t n = pb - pa;
    while (seg0 < task.num_segs && task.segs[seg0].pos0 + task.segs[seg0].count <= pa) ++seg0;
    if (seg0 == task.num_segs) break;
    // Rows that see any position of this tile.
    attn::Row* act[256];
    float* lg[256];
    size_t nact = 0;
    for (size_t r = 0; r < task.num_rows; ++r) {
      attn::Row& row = task.rows[r];
      if (row.lo < pb && row.hi > pa) {
        act[nact] = &row;
        lg[nact] = scr.logits.data() + nact * kLgStride;
        ++nact;
        if (nact == 256) break;
      }
    }
    if (nact == 0) continue;
    // Calls f(segment, part start, part end, logits rows at the part) for
    // the parts of the tile, in position order.
    auto parts = [&](auto&& f) {
      for (size_t si = seg0; si < task.num_segs && task.segs[si].pos0 < pb; ++si) {
        const attn::Seg& s = task.segs[si];
        const size_t a = std::max(pa, s.pos0), b = std::min(pb, s.pos0 + s.count);
        if (a >= b) continue;
        float* lgp[256];
        for (size_t r = 0; r < nact; ++r) lgp[r] = lg[r] + (a - pa);
        f(s, a, b, lgp);
      }
    };
    // No bulk prefetch of a tile's rows here (it stalled on full miss
    // queues; dense fp16 measured 9-17% slower with it): the kernels prefetch their
    // streams a fixed distance ahead as they read them.
    // Up to two row groups (GQA 8 decode) read the rows directly, twice;
    // more rows share one decoded fp32 tile. Measured at GQA 8 (64 query
    // heads over 8, 32K tokens, 2 threads): direct reads were faster for
    // dense fp16 (13.4-13.9 vs 18.3-21.2 ms) and for k4_v4 (9.9-10.6 vs
    // 15.4-19.6 ms) than the tile.
    const bool many = nact > 2 * kGroup;
    // With VNNI the integer kernels read the codes of every row group
    // faster than the fp32 kernels read a decoded tile (chunked prefill
    // 512 x 32K, k4_v4: 1.04x -> 2.16x of dense on the Zen 4 VM); without
    // it an int16 product costs what an fp32 FMA does, and the tile stays.
    const bool k_int = kctx.i16.on && kctx.i16.vnni;
    const bool v_int = vctx.i16.on && vctx.i16.vnni;
    // The tile's runs as parts, and whether all are compressed rows (a
    // tile of a paged cache's pages): the integer key and value kernels
    // then take the tile in one call each, rows gathered from the runs
    // (their fixed cost a call had been paid a page).
    SegPart sp[kTile];
    size_t nsp = 0;
    bool all_comp = true;
    parts([&](const attn::Seg& s, size_t a, size_t b, float* const*) {
      all_comp = all_comp && s.compressed;
      sp[nsp++] = {&s, a - s.pos0, b - s.pos0};
    });
    const bool multi = all_comp && nsp > 1;
    // Many row groups read fast-MSE keys from a decoded fp32 tile (unless
    // the integer kernels take them with VNNI).
    const bool mse_key_tile = many && task.kc != nullptr && task.kc->fmt == Fmt::kMse && task.kc->fast_mse && !k_int;
    if (multi && kern.rows[0].key_parts != nullptr && !mse_key_tile) {
      for (size_t g0 = 0; g0 < nact; g0 += kGroup) {
        const size_t nr = std::min(kGroup, nact - g0);
        float koff[kGroup];
        for (size_t r = 0; r < nr; ++r) koff[r] = act[g0 + r]->koff;
        WithRows(nr, [&](auto NR) { kern.For<NR()>().key_parts(kctx, sp, nsp, act + g0, koff, lg + g0, scr); });
      }
    } else parts([&](const attn::Seg& s, size_t a, size_t b, float* const* lgp) {
      const size_t np = b - a;
      const bool k_tile = s.compressed ? mse_key_tile : many;
      if (k_tile) {
        scr.ktile.resize(np * d);
        DecodeTile(task, task.kc, kctx.luts[0], s, true, a - s.pos0, np, scr.ktile.data(), scr);
        // Transposed once (coordinate-major, kTile tokens a row) for every
        // row group's small matrix product.
        scr.ktileT.resize(d * kTile + kL);
        float* kt = scr.ktileT.data();
        for (size_t t = 0; t < np; ++t) {
          const float* src = scr.ktile.data() + t * d;
          for (size_t j = 0; j < d; ++j) kt[j * kTile + t] = src[j];
        }
        for (size_t j = 0; j < d; ++j) {
          for (size_t t = np; t < kTile; ++t) kt[j * kTile + t] = 0.0f;
        }
        for (size_t g0 = 0; g0 < nact; g0 += kGroup) {
          const size_t nr = std::min(kGroup, nact - g0);
          const float* q[kGroup];
          float koff[kGroup];
          for (size_t r = 0; r < nr; ++r) {
            q[r] = s.compressed ? act[g0 + r]->qrot : act[g0 + r]->q;
            koff[r] = s.compressed ? act[g0 + r]->koff : 0.0f;
          }
          WithRows(nr, [&](auto NR) { ScoreTileT<NR()>(kt, np, d, q, koff, lgp + g0); });
        }
      } else {
        for (size_t g0 = 0; g0 < nact; g0 += kGroup) {
          const size_t nr = std::min(kGroup, nact - g0);
          WithRows(nr, [&](auto NR) {
            ScoreGroup<NR()>(kern.For<NR()>(), kctx, s, a - s.pos0, b - s.pos0, act + g0, lgp + g0, scr);
          });
        }
      }
    });
    // Mask, soft-cap, online softmax.
    for (size_t r = 0; r < nact; ++r) {
      attn::Row& row = *act[r];
      float* x = lg[r];
      if (task.softcap > 0.0f) {
        const AV cap = hn::Set(df, task.softcap);
        const AV inv = hn::Set(df, 1.0f / task.softcap);
        size_t t = 0;
        for (; t + kL <= n; t += kL) {
          hn::StoreU(hn::Mul(cap, hn::Tanh(df, hn::Mul(hn::LoadU(df, x + t), inv))), df, x + t);
        }
        for (; t < n; ++t) x[t] = task.softcap * std::tanh(x[t] / task.softcap);
      }
      size_t vis_a = row.lo > pa ? row.lo - pa : 0;
      size_t vis_b = std::min(row.hi, pb) - pa;
      for (size_t t = 0; t < vis_a; ++t) x[t] = kMasked;
      for (size_t t = vis_b; t < n; ++t) x[t] = kMasked;
      // Masked logits are -1e30, so the max over the whole tile is the max
      // over the visible part (which is never empty here). The running
      // max changes only when a lane of the tile exceeds it: one vector
      // compare decides, and the reduction to the exact maximum runs only
      // then (results as before: the new max is max(row.m, tile max)).
      // The row's exponentials sum into a vector (lsum), reduced once
      // at the end of the task: the two horizontal reductions a row and
      // tile had been the driver's critical path.
      const size_t ri = static_cast<size_t>(&row - task.rows);
      float* lsv = scr.lsum.data() + ri * kL;
      {
        size_t t = 0;
        AV mv = hn::Set(df, kMasked);
        for (; t + kL <= n; t += kL) mv = hn::Max(mv, hn::LoadU(df, x + t));
        bool up = !hn::AllFalse(df, hn::Gt(mv, hn::Set(df, row.m)));
        float tail = kMasked;
        for (size_t u = t; u < n; ++u) tail = std::max(tail, x[u]);
        up |= tail > row.m;
        if (up) {
          const float mx = std::max(tail, hn::GetLane(hn::MaxOfLanes(df, mv)));
          const float corr = row.m == kNegInf ? 0.0f : std::exp(row.m - mx);
          row.lc *= corr;  // (row.l stays 0 until the task's end: its sum is in lsum)
          if (corr != 1.0f) {
            const AV cv = hn::Set(df, corr);
            hn::StoreU(hn::Mul(cv, hn::LoadU(df, lsv)), df, lsv);
            for (float* acc : {row.acc, row.accr}) {
              size_t j = 0;
              for (; j + kL <= d; j += kL) hn::StoreU(hn::Mul(cv, hn::LoadU(df, acc + j)), df, acc + j);
              for (; j < d; ++j) acc[j] *= corr;
            }
#ifdef TQ_ATTN_I16
            if (priv_len > 0) {
              float* pv = scr.priv.data() + ri * priv_len;
              for (size_t j = 0; j < priv_len; j += kL) hn::StoreU(hn::Mul(cv, hn::LoadU(df, pv + j)), df, pv + j);
              scr.zsum[ri] *= corr;
            }
#endif
          }
          row.m = mx;
        }
      }
      row.scored += vis_b - vis_a;
      const AV mv = hn::Set(df, -row.m * 1.44269504089f);
      size_t t = 0;
      AV sv = hn::LoadU(df, lsv);
      for (; t + kL <= n; t += kL) {
        const AV e = SoftmaxExp(df, hn::LoadU(df, x + t), mv);
        sv = hn::Add(sv, e);
        hn::StoreU(e, df, x + t);
      }
      if (t < n) {  // a partial tile's last lanes, masked (was a libm exp each)
        const auto m = hn::FirstN(df, n - t);
        const AV e = hn::IfThenElseZero(m, SoftmaxExp(df, hn::MaskedLoad(m, df, x + t), mv));
        sv = hn::Add(sv, e);
        hn::BlendedStore(e, m, df, x + t);
      }
      hn::StoreU(sv, df, lsv);
      for (size_t tt = 0; tt < vis_a; ++tt) x[tt] = 0.0f;
      for (size_t tt = vis_b; tt < n; ++tt) x[tt] = 0.0f;
      size_t acc_n = vis_b - vis_a;
      if (task.sparse_threshold > 0.0f) {
        for (size_t tt = vis_a; tt < vis_b; ++tt) {
          if (x[tt] < task.sparse_threshold) {
            x[tt] = 0.0f;
            ++row.skipped;
            --acc_n;
          }
        }
      }
      row.accumulated += acc_n;
    }
    if (multi && kern.rows[0].value_parts != nullptr && !(many && task.vc->fast_mse && !v_int)) {
      // A tile's values over its parts in one call of the integer kernels:
      // their fixed cost a call (the weights' rounding to int16, the flush
      // of the int32 sums) had been paid a page.
      size_t part_tokens = 0;
      for (size_t i = 0; i < nsp; ++i) part_tokens += sp[i].b - sp[i].a;
      for (size_t g0 = 0; g0 < nact; g0 += kGroup) {
        const size_t nr = std::min(kGroup, nact - g0);
        WithRows(nr, [&](auto NR) {
          AddCompressedWeights<NR()>(*vctx.kc, act + g0, lg + g0, part_tokens);
          kern.For<NR()>().value_parts(vctx, sp, nsp, act + g0, lg + g0, scr);
        });
      }
      continue;
    }
    parts([&](const attn::Seg& s, size_t a, size_t b, float* const* lgp) {
      const size_t np = b - a;
      const bool v_tile = many && (!s.compressed || (task.vc->fast_mse && !v_int));
      if (v_tile) {
        scr.vtile.resize(np * d);
        DecodeTile(task, task.vc, vctx.luts[0], s, false, a - s.pos0, np, scr.vtile.data(), scr);
        attn::Seg ts;
        ts.count = np;
        ts.v = reinterpret_cast<const uint8_t*>(scr.vtile.data());
        ts.v_stride = d * sizeof(float);
        for (size_t r = 0; r < nact; ++r) {
          attn::Row& row = *act[r];
          if (s.compressed) {
            if (NeedsWeightSums(*task.vc)) {
              float sum = 0.0f;
              for (size_t t = 0; t < np; ++t) sum += lgp[r][t];
              row.lc += sum;
            }
            std::swap(row.acc, row.accr);  // decoded MSE values sum into the rotated accumulator
          }
        }
        for (size_t g0 = 0; g0 < nact; g0 += kGroup) {
          const size_t nr = std::min(kGroup, nact - g0);
          WithRows(nr, [&](auto NR) { kern.For<NR()>().f32_values(vctx, ts, 0, np, act + g0, lgp + g0, scr); });
        }
        if (s.compressed) {
          for (size_t r = 0; r < nact; ++r) std::swap(act[r]->acc, act[r]->accr);
        }
      } else {
        for (size_t g0 = 0; g0 < nact; g0 += kGroup) {
          const size_t nr = std::min(kGroup, nact - g0);
          WithRows(nr, [&](auto NR) {
            AccumGroup<NR()>(kern.For<NR()>(), vctx, s, a - s.pos0, b - s.pos0, act + g0, lgp + g0, scr);
          });
        }
      }
    });
  }
  // The softmax denominators (row.l had nothing else added during the task).
  for (size_t r = 0; r < task.num_rows; ++r) {
    task.rows[r].l += hn::GetLane(hn::SumOfLanes(df, hn::LoadU(df, scr.lsum.data() + r * kL)));
  }
#ifdef TQ_ATTN_I16
  // Integer value sums back into the rows' accumulators.
  if (priv_len > 0) {
    // int-asym values: plain domain, natural order, plus the zeros' share;
    // TurboQuant values: the rotated accumulator in fast-MSE order (per
    // element and row the lane map had been a tenth of a 256-token call).
    const bool plain = vctx.i16.asym;
    LaneMap(vctx.i16.nvec_v, kN32, d, [&](size_t v, size_t j) { return I16ValCoord(vctx.i16.nib, v, j); },
            [&](size_t x) { return plain ? x : FastPos(x, d); }, scr.vmap);
    const uint32_t* map = scr.vmap.data();
    for (size_t r = 0; r < task.num_rows; ++r) {
      const float* pv = scr.priv.data() + r * priv_len;
      float* dst = plain ? task.rows[r].acc : task.rows[r].accr;
      for (size_t i = 0; i < priv_len; ++i) {
        if (map[i] != UINT32_MAX) dst[map[i]] += pv[i];
      }
      if (plain) {
        for (size_t x = 0; x < d; ++x) dst[x] += scr.zsum[r];
      }
    }
  }
#endif
}

}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
