// Integer TurboQuant kernels, the portable part: int16 codebooks (InitI16),
// int16 queries (PrepareQ16), 2- and 3-bit rows expanded in registers
// (IdxChunkVbmi, IdxChunkAvx2), the QJL sign term (AddQjl16), the generic
// key kernel ScoreMse16 and the value kernels' tile weights (TileWeights16,
// AsymG32Weights). On AVX3_DL the code from CpuHasVnni on is compiled with
// AVX-512 VNNI: each part up to attention_int16_values-inl.h reopens that
// attribute region.

// Per-target include guard (Highway re-includes this file for every target).
#if defined(TQ_SRC_CPU_ATTENTION_INT16_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_ATTENTION_INT16_INL_H_
#undef TQ_SRC_CPU_ATTENTION_INT16_INL_H_
#else
#define TQ_SRC_CPU_ATTENTION_INT16_INL_H_
#endif

#include "cpu/attention_float-inl.h"

HWY_BEFORE_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {
namespace attnk {

// ---------------------------------------------------------------------------
// Integer TurboQuant kernels: MSE keys and values of 2..4 bits with one
// rotation block. A score is sum_j q_j c[idx_j] and a value sum is
// sum_t w_t c[idx_tj]: both are integer dot products once the block's
// centroids are int16 (c * cscale, rounded) and the query or the tile's
// weights are int16 too. Index bytes go through two byte-table lookups (low
// and high byte of the int16 centroid, one 16-entry table per 128-bit block)
// and one byte interleave per vector; pairs of int16 products are summed into
// int32 lanes (vpmaddwd). This is twice the multiply-adds per instruction of
// fp32 FMA, and the decode is four shuffles per 64 coordinates.
//
// Rounding (bounds below keep every int32 sum exact, no overflow):
//  - keys: centroids and the query to <= 15 bits (14.5 at d = 128: KeyCmax),
//    so a score's relative error is about 2^-14: far below the NMSE 1e-6
//    contract;
//  - values: centroids to 12 bits (<= 4095), each tile's weights (softmax
//    weight x row scale) to 13 bits of the tile's largest (<= 8191); 64
//    tokens' products then fit an int32 lane (64 * 8191 * 4095 < 2^31).
//    (Flushing every 32 tokens with 13-bit centroids measured 5% slower for
//    a worst test NMSE of 8e-8 instead of 1.2e-7.)
// The accumulation order is fixed by the shuffles (I16KeyCoord /
// I16ValCoord give the coordinate of each lane), so queries are permuted on
// entry and value sums leave through a permutation at the end of a task.
#undef TQ_ATTN_I16  // per target: this file is compiled once per SIMD target
#if HWY_TARGET != HWY_SCALAR
#define TQ_ATTN_I16 1
using B8 = hn::Repartition<uint8_t, AF>;
using B16 = hn::Repartition<int16_t, AF>;
using B32 = hn::Repartition<int32_t, AF>;
constexpr size_t kN8 = hn::MaxLanes(B8());
constexpr size_t kN16 = kN8 / 2;
constexpr size_t kN32 = kN8 / 4;
// Keys: |c| <= kcmax and |q| <= qmax with 4 nvec_k kcmax qmax < 2^31: an
// int32 lane sums 2 nvec_k products, and the fixed-shape kernel adds two
// lanes of a token in int32 before converting (ScoreI16Fixed); both 11585
// (about 14.5 bits) at d = 128 on AVX-512, up to 16383 for smaller d.
HWY_INLINE long KeyCmax(size_t nvec_k) {
  const long prod = 2147483647L / (4L * static_cast<long>(nvec_k));
  // The largest c <= 16383 with c * c <= prod: the floating-point root,
  // corrected by a step either way where it rounded.
  long c = std::min<long>(16383, static_cast<long>(std::sqrt(static_cast<double>(prod))));
  while (c * c > prod) --c;
  while (c < 16383 && (c + 1) * (c + 1) <= prod) ++c;
  return c;
}
constexpr int kValCmax = 4095;
constexpr int kWmax = 8191;
static_assert(kTile <= 64, "AccumMse16's int32 bound assumes <= 64 tokens a tile");
static_assert(64L * 32767 * 8 < 2147483647L && 64L * kWmax * kValCmax < 2147483647L,
              "value sums of a tile fit an int32 lane");

// Two ways to get index bytes: 4-bit rows in registers (one load of kN8 code
// bytes gives the even and the odd coordinates of 2 kN8 as two nibble
// planes), other widths from rows unpacked to bytes first (chunks of kN8
// coordinates). The vectors a kernel produces are numbered v = 0, 1, ...;
// these give the coordinate of lane w (int16, keys) or j (int32, values).
HWY_INLINE size_t I16KeyCoord(bool nib, size_t v, size_t w) {
  const size_t blk = 16 * (w / 8), m = w % 8;
  if (nib) {  // v = 4 c + 2 e + s: load c, parity e, interleave half s
    const size_t c = v / 4, e = (v / 2) % 2, sh = v % 2;
    return 2 * (kN8 * c + blk + 8 * sh + m) + e;
  }
  return kN8 * (v / 2) + blk + 8 * (v % 2) + m;  // v = 2 c + h
}
HWY_INLINE size_t I16ValCoord(bool nib, size_t v, size_t j) {
  const size_t blk = 16 * (j / 4), m = j % 4;
  if (nib) {  // v = 8 c + 4 g + 2 e + s: load c, byte half g, parity e, half s
    const size_t c = v / 8, g = (v / 4) % 2, e = (v / 2) % 2, sh = v % 2;
    return 2 * (kN8 * c + blk + 8 * g + 4 * sh + m) + e;
  }
  const size_t c = v / 4, u = v % 4;  // v = 4 c + 2 h + s
  return kN8 * c + blk + 8 * (u / 2) + 4 * (u % 2) + m;
}
// Where each lane of an integer kernel's vectors maps to, worked out once a
// task (per element and row it showed in short decode calls): lane
// v * per + w -> pos(coord(v, w)), or UINT32_MAX for a coordinate past d.
template <class Coord, class Pos>
HWY_INLINE void LaneMap(size_t nvec, size_t per, size_t d, Coord coord, Pos pos, std::vector<uint32_t>& map) {
  map.resize(nvec * per);
  for (size_t v = 0; v < nvec; ++v) {
    for (size_t w = 0; w < per; ++w) {
      const size_t x = coord(v, w);
      map[v * per + w] = x < d ? static_cast<uint32_t>(pos(x)) : UINT32_MAX;
    }
  }
}
// Position of coordinate x in the driver's fast-MSE order (one block):
// position k * (d / 8) + i holds coordinate 8 i + k.
HWY_INLINE size_t FastPos(size_t x, size_t d) { return (x % 8) * (d / 8) + x / 8; }

// The integer kernels apply to TurboQuant-MSE keys or values of 2..4 bits
// with one rotation block (int16 centroids), and to int-asym values of 2..4
// bits with one group a row (u * scale + zero: the "centroids" are the
// levels 0 .. 2^bits - 1 and the zero's share is summed in float).
HWY_INLINE void InitI16(const attn::Comp* c, size_t d, bool keys, I16Book* z) {
  z->on = false;
  if (c == nullptr) return;
  int bits = 0;
  const float* cent = nullptr;
  z->qjl = 0;
  if ((c->fmt == Fmt::kMse || (keys && c->fmt == Fmt::kProd)) && c->fast_mse && c->num_groups == 1) {
    const CodecPlan& plan = *c->groups[0].plan;
    if (plan.num_blocks != 1 || plan.dim != d) return;
    bits = plan.mse_bits;
    cent = plan.blocks[0].centroids;
    z->nbytes = plan.index_bytes;
    z->asym = false;
    // Prod keys: the sign bits are read kN16 at a time as lane masks.
    if (c->fmt == Fmt::kProd) {
      z->qjl = plan.qjl_dim;
      if (z->qjl == 0 || z->qjl % kN16 != 0) return;  // kN16 >= 8 here: whole bytes
    }
  } else if (!keys && c->fmt == Fmt::kIntAsym && c->group_size == d && c->meta_bytes == 4) {
    bits = c->bits;
    z->nbytes = c->payload_bytes;
    z->asym = true;
  } else {
    return;
  }
  if (bits < 2 || bits > 4) return;
  z->nib = bits == 4;
  // nib: loads of kN8 code bytes; else chunks of kN8 coordinates.
  const size_t nch = z->nib ? (d + 2 * kN8 - 1) / (2 * kN8) : (d + kN8 - 1) / kN8;
  z->nvec_k = z->nib ? 4 * nch : 2 * nch;
  z->nvec_v = z->nib ? 8 * nch : 4 * nch;
  // int32 bound of the keys below: 2 * nvec_k products a lane.
  if (kN8 < 16 || 2 * z->nvec_k > 32) return;
  const size_t n = size_t{1} << bits;
  // Values: 64 tokens * wmax * max|c| < 2^31 (int-asym levels are <= 8 in
  // magnitude, so their weights keep 15 bits).
  z->wmax = z->asym ? 32767 : kWmax;
  if (z->asym) {
    z->cscale = 1.0f;  // levels exactly
  } else {
    float mx = 0.0f;
    for (size_t k = 0; k < n; ++k) mx = std::max(mx, std::fabs(cent[k]));
    if (!(mx > 0.0f) || !std::isfinite(mx)) return;
    z->cscale = static_cast<float>(keys ? KeyCmax(z->nvec_k) : kValCmax) / mx;
  }
  for (size_t k = 0; k < 16; ++k) {
    long v = 0;
    // int-asym levels centered (u - 2^(bits-1)): the rounding of the weights
    // then multiplies zero-mean integers; the offset joins the zero.
    if (k < n) v = z->asym ? static_cast<long>(k) - static_cast<long>(n / 2) : std::lrint(cent[k] * z->cscale);
    const uint16_t u = static_cast<uint16_t>(static_cast<int16_t>(v));
    z->lo[k] = static_cast<uint8_t>(u & 0xFF);
    z->hi[k] = static_cast<uint8_t>(u >> 8);
  }
  z->nch = nch;
  z->bits = bits;
  z->extent = z->nib ? nch * kN8 : 0;
  z->inreg = false;  // the target's InitBook may expand 2- and 3-bit rows in registers
  z->on = true;
}

// o[i] = f[i] rounded to nearest-even, a vector at a time (the same integers
// as lrint in the default rounding mode; lrint was a library call per
// element). len is a multiple of kL.
HWY_INLINE void RoundToI16(const float* f, size_t len, int16_t* o) {
  const hn::Rebind<int16_t, AF> dh;
  for (size_t i = 0; i < len; i += kL) {
    hn::StoreU(hn::DemoteTo(dh, hn::NearestInt(hn::LoadU(AF(), f + i))), dh, o + i);
  }
}

// Every task row's rotated query as int16 lanes: scaled so its largest
// |q_j| is qmax, placed into len float lanes by place(q, qs, f) (the kernel's
// lane order), rounded into out[r * len ..]; inv[r] = 1 / (qs * cscale).
// Rows without a query, or with a zero one, keep zeros (every score is koff).
template <class Place>
HWY_INLINE void QueriesToI16(const attn::Task& task, long qmax, float cscale, size_t len,
                             std::vector<int16_t>& out, std::vector<float>& inv, AScratch& scr,
                             const Place& place) {
  out.assign(task.num_rows * len, 0);
  inv.assign(task.num_rows, 0.0f);
  if (scr.tmp.size() < len) scr.tmp.resize(len);
  for (size_t r = 0; r < task.num_rows; ++r) {
    const float* q = task.rows[r].qrot;
    if (q == nullptr) continue;
    const AF df;
    AV mv = hn::Zero(df);
    size_t j = 0;
    for (; j + kL <= task.d; j += kL) mv = hn::Max(mv, hn::Abs(hn::LoadU(df, q + j)));
    float mx = hn::GetLane(hn::MaxOfLanes(df, mv));
    for (; j < task.d; ++j) mx = std::max(mx, std::fabs(q[j]));
    if (!(mx > 0.0f)) continue;
    const float qs = static_cast<float>(qmax) / mx;
    place(q, qs, scr.tmp.data());
    RoundToI16(scr.tmp.data(), len, out.data() + r * len);
    inv[r] = 1.0f / (qs * cscale);
  }
}

// Int16 queries of every task row (from the driver's permuted rotated query).
// Up to 4 nvec_k products are summed in int32 (KeyCmax), so
// |q| <= 2^31 / (4 nvec_k KeyCmax). With lanes false only the prod keys'
// QJL sketch is prepared (the token-lane kernel, ScoreTok, takes its own
// query pairs).
HWY_INLINE void PrepareQ16(const attn::Task& task, const I16Book& z, bool lanes, AScratch& scr) {
  const size_t d = task.d, len = z.nvec_k * kN16;
  const long qmax =
      std::min<long>(16383, 2147483647L / (4L * static_cast<long>(z.nvec_k) * KeyCmax(z.nvec_k)));
  if (lanes) {
    // Where each lane reads the permuted query.
    LaneMap(z.nvec_k, kN16, d, [&](size_t v, size_t w) { return I16KeyCoord(z.nib, v, w); },
            [&](size_t x) { return FastPos(x, d); }, scr.kmap);
    const uint32_t* map = scr.kmap.data();
    QueriesToI16(task, qmax, z.cscale, len, scr.q16, scr.qinv, scr, [&](const float* q, float qs, float* f) {
      for (size_t i = 0; i < len; ++i) f[i] = map[i] != UINT32_MAX ? q[map[i]] * qs : 0.0f;
    });
  }
  if (z.qjl == 0) return;
  // Prod keys: the QJL sketch S q' to int16 (|q| <= 16383; a lane sums
  // 2 m / kN16 products of |q| with 0 or -1, far inside int32).
  const size_t m = z.qjl;
  scr.qs16.assign(task.num_rows * m, 0);
  scr.qsinv.assign(task.num_rows, 0.0f);
  scr.qsall.assign(task.num_rows, 0.0f);
  if (scr.tmp.size() < m) scr.tmp.resize(m);
  for (size_t r = 0; r < task.num_rows; ++r) {
    const float* q = task.rows[r].qsk;
    if (q == nullptr) continue;
    float mx = 0.0f;
    for (size_t j = 0; j < m; ++j) mx = std::max(mx, std::fabs(q[j]));
    if (!(mx > 0.0f)) continue;  // zero sketch: the sign term is 0
    const float qs = 16383.0f / mx;
    float* f = scr.tmp.data();
    for (size_t j = 0; j < m; ++j) f[j] = q[j] * qs;
    int16_t* o = scr.qs16.data() + r * m;
    RoundToI16(f, m, o);
    long sum = 0;
    for (size_t j = 0; j < m; ++j) sum += o[j];
    scr.qsinv[r] = 1.0f / qs;
    scr.qsall[r] = static_cast<float>(sum);
  }
}

// The int16 queries of every task row for group-scaled integer keys (plain
// domain, softmax scale folded): nv vectors of `lanes` int16 a row, lane i
// of vector v holding coordinate coord(v, i) (none past d), |q| <= qmax.
template <class Coord>
inline void PrepareGroupQ16(const attn::Task& task, long qmax, size_t nv, size_t lanes, const Coord& coord,
                            AScratch& scr) {
  const size_t d = task.d, len = nv * lanes;
  scr.qg16.assign(task.num_rows * len, 0);
  scr.qginv.assign(task.num_rows, 0.0f);
  if (scr.tmp.size() < len) scr.tmp.resize(len);
  for (size_t r = 0; r < task.num_rows; ++r) {
    const float* q = task.rows[r].q;
    float mx = 0.0f;
    for (size_t j = 0; j < d; ++j) mx = std::max(mx, std::fabs(q[j]));
    if (!(mx > 0.0f)) continue;  // zero query: the key part of every score is 0
    const float qs = static_cast<float>(qmax) / mx;
    float* f = scr.tmp.data();
    for (size_t v = 0; v < nv; ++v) {
      for (size_t i = 0; i < lanes; ++i) {
        const size_t x = coord(v, i);
        f[v * lanes + i] = x < d ? q[x] * qs : 0.0f;
      }
    }
    RoundToI16(f, len, scr.qg16.data() + r * len);
    scr.qginv[r] = 1.0f / qs;
  }
}

// Marks rows rs[0..NR) as scored by an integer key kernel and points q[r]
// at each row's int16 query (len lanes a task row, in q16) and qi[r] at its
// inverse scale (inv).
template <size_t NR>
HWY_INLINE void IntKeyRows(const attn::Task& task, attn::Row* const* rs, const std::vector<int16_t>& q16,
                           size_t len, const std::vector<float>& inv, const int16_t** q, float* qi) {
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    rs[r]->int_keys = true;
    const size_t ri = static_cast<size_t>(rs[r] - task.rows);
    q[r] = q16.data() + ri * len;
    qi[r] = inv[ri];
  }
}

// Int16 centroids of index bytes ix (one 16-entry table per 128-bit block):
// c0 holds bytes 0..7 of every block, c1 bytes 8..15.
template <class V8>
HWY_INLINE void Centroids16(const V8& tlo, const V8& thi, const V8& ix, hn::Vec<B16>* c0,
                            hn::Vec<B16>* c1) {
  const B8 d8;
  const B16 d16;
  const auto lo = hn::TableLookupBytes(tlo, ix);
  const auto hi = hn::TableLookupBytes(thi, ix);
  *c0 = hn::BitCast(d16, hn::InterleaveLower(d8, lo, hi));
  *c1 = hn::BitCast(d16, hn::InterleaveUpper(d8, lo, hi));
}

// The component's TurboQuant plan (nullptr for int-asym values).
HWY_INLINE const CodecPlan* MsePlanOf(const KeyCtx& ctx) {
  return ctx.kc->fmt == Fmt::kMse ? ctx.kc->groups[0].plan : nullptr;
}

// kN8 code bytes at p + off of a row whose codes are n bytes. On AVX-512 a
// masked load: nothing past the codes is read, so rows are used in place
// (a padded copy would be read right after its narrower stores, which stalls
// store forwarding). Elsewhere a plain load from a row the caller padded.
constexpr bool kMaskedCodes = HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL;
HWY_INLINE hn::Vec<B8> LoadCodes(const uint8_t* p, size_t off, size_t n) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if (off + 64 <= n) return hn::Vec<B8>{_mm512_loadu_si512(p + off)};
  const uint64_t m = off < n ? (uint64_t{1} << (n - off)) - 1 : 0;  // n - off < 64
  return hn::Vec<B8>{_mm512_maskz_loadu_epi8(m, p + off)};
#else
  (void)n;
  return hn::LoadU(B8(), p + off);
#endif
}

#if HWY_TARGET == HWY_AVX3_DL
inline bool CpuHasVnni() {
  static const bool has = HostCpu().avx512_vnni;  // one guarded load a call, as before
  return has;
}
// AVX-512 VNNI (vpdpwssd: the pair products and the add in one instruction).
// Highway's AVX3_DL attributes name AVX-VNNI, not the AVX-512 form: these
// kernels leave Highway's attribute region for one that adds it, to the end
// of this file; the parts up to attention_int16_values-inl.h open theirs with
// it (TQ_ATTN_BEFORE_VNNI_NAMESPACE). InitI16 checks the CPU for it.
HWY_POP_ATTRIBUTES
HWY_PUSH_ATTRIBUTES(HWY_TARGET_STR ",avx512vnni")
#define TQ_I16_VNNI 1
#else
#undef TQ_I16_VNNI
#endif

#if HWY_TARGET == HWY_AVX3_DL
// Index bytes of chunk c (64 coordinates in order) of a 2- or 3-bit row:
// each group's bytes to one 64-bit lane, then one byte per coordinate at its
// bit offset.
HWY_INLINE hn::Vec<B8> IdxChunkVbmi(const uint8_t* row, size_t nbytes, size_t c, int bits,
                                   __m512i perm, __m512i ctrl, __m512i mask) {
  const __m512i x = LoadCodes(row, 8 * static_cast<size_t>(bits) * c, nbytes).raw;
  const __m512i g = _mm512_permutexvar_epi8(perm, x);
  return hn::Vec<B8>{_mm512_and_si512(_mm512_multishift_epi64_epi8(ctrl, g), mask)};
}
#endif

#if HWY_TARGET == HWY_AVX2
// Index bytes of chunk c (32 coordinates in order) of a 2- or 3-bit row of
// nbytes code bytes (the tables of TargetKernels<HWY_AVX2>::InitBook). Nothing past the codes is read: the
// chunk's 16-byte window is a plain load where it lies inside the codes, a
// masked dword load (or a copy) where it does not.
HWY_INLINE hn::Vec<B8> IdxChunkAvx2(const uint8_t* row, size_t nbytes, size_t c, const I16Book& z,
                                   __m128i shift) {
  const size_t off = 4 * static_cast<size_t>(z.bits) * c;
  __m256i v;
  if (off + 16 <= nbytes) {
    v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + off)));
  } else {
    const size_t n = nbytes > off ? nbytes - off : 0;
    __m128i x;
    if (n % 4 == 0) {
      const __m128i lanes = _mm_setr_epi32(0, 1, 2, 3);
      const __m128i m = _mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int>(n / 4)), lanes);
      x = _mm_maskload_epi32(reinterpret_cast<const int*>(row + off), m);
    } else {
      HWY_ALIGN uint8_t buf[16] = {};
      std::memcpy(buf, row + off, n);
      x = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
    }
    v = _mm256_broadcastsi128_si256(x);
  }
  const __m256i* pm = reinterpret_cast<const __m256i*>(z.perm);
  const __m256i* ml = reinterpret_cast<const __m256i*>(z.ctrl);
  const __m256i a = _mm256_srl_epi16(
      _mm256_mullo_epi16(_mm256_shuffle_epi8(v, _mm256_load_si256(pm)), _mm256_load_si256(ml)), shift);
  const __m256i b = _mm256_srl_epi16(
      _mm256_mullo_epi16(_mm256_shuffle_epi8(v, _mm256_load_si256(pm + 1)), _mm256_load_si256(ml + 1)),
      shift);
  return hn::Vec<B8>{_mm256_packus_epi16(a, b)};
}
#endif

// The generic integer kernels' reading of 2- and 3-bit rows in registers
// (I16Book::inreg): TQ_IDX_CHUNK_CONSTANTS(z) declares the constants of
// book z's chunk expansion, TQ_IDX_CHUNK(z, row, nbytes, c) is the index
// bytes of chunk c of a row (IdxChunkVbmi, IdxChunkAvx2). Other targets
// unpack rows to bytes first (kInRegCodes false; TQ_IDX_CHUNK reads chunk
// c of such a row).
#undef TQ_IDX_CHUNK_CONSTANTS
#undef TQ_IDX_CHUNK
#if HWY_TARGET == HWY_AVX3_DL
constexpr bool kInRegCodes = true;
#define TQ_IDX_CHUNK_CONSTANTS(z)                                                            \
  const __m512i vperm = _mm512_load_si512((z).perm), vctrl = _mm512_load_si512((z).ctrl); \
  const __m512i vmask = _mm512_set1_epi8(static_cast<char>((1 << (z).bits) - 1))
#define TQ_IDX_CHUNK(z, row, nbytes, c) IdxChunkVbmi(row, nbytes, c, (z).bits, vperm, vctrl, vmask)
#elif HWY_TARGET == HWY_AVX2
constexpr bool kInRegCodes = true;
#define TQ_IDX_CHUNK_CONSTANTS(z) const __m128i vshift = _mm_cvtsi32_si128(16 - (z).bits)
#define TQ_IDX_CHUNK(z, row, nbytes, c) IdxChunkAvx2(row, nbytes, c, z, vshift)
#else
constexpr bool kInRegCodes = false;
#define TQ_IDX_CHUNK_CONSTANTS(z) static_assert(true, "rows unpacked to bytes")
#define TQ_IDX_CHUNK(z, row, nbytes, c) hn::LoadU(B8(), (row) + (c) * kN8)
#endif

// acc += pairwise products of a and b (int16 -> int32).
template <bool kVnni>
HWY_INLINE hn::Vec<B32> MulAcc16(hn::Vec<B16> a, hn::Vec<B16> b, hn::Vec<B32> acc,
                                 hn::Vec<B32>& acc2) {
#ifdef TQ_I16_VNNI
  if constexpr (kVnni) return hn::Vec<B32>{_mm512_dpwssd_epi32(acc.raw, a.raw, b.raw)};
#endif
  return hn::ReorderWidenMulAccumulate(B32(), a, b, acc, acc2);
}


// Prod keys' QJL term sqrt(pi/2)/m * gamma * sum_k (S q')_k (2 bit_k - 1)
// with the sketch in int16 (PrepareQ16): with the set bits as -1 lanes, one
// multiply-add a kN16 bits gives A = -sum_{bit set} q16, and the signed sum
// is -2A - sum_k q16 (exact integers).
template <size_t NR>
struct Qjl16 {
  const int16_t* qs[NR];
  float qsi[NR], qsa[NR];
  size_t m = 0;
  float coef = 0.0f;
};
template <size_t NR>
HWY_INLINE Qjl16<NR> MakeQjl16(const attn::Task& task, const I16Book& z, attn::Row* const* rs,
                               const AScratch& scr) {
  Qjl16<NR> c;
  c.m = z.qjl;
  c.coef = static_cast<float>(1.2533141373155002512 / static_cast<double>(c.m));
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    const size_t ri = static_cast<size_t>(rs[r] - task.rows);
    c.qs[r] = scr.qs16.data() + ri * c.m;
    c.qsi[r] = scr.qsinv[ri];
    c.qsa[r] = scr.qsall[ri];
  }
  return c;
}
// A of each row for one token's sign bits sg, as float lanes to be summed.
template <size_t NR, bool kVnni>
HWY_INLINE void QjlToken(const Qjl16<NR>& c, const uint8_t* sg, AV* out) {
  const B16 d16;
  const B32 d32;
  hn::Vec<B32> g[NR], h[NR];
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) g[r] = h[r] = hn::Zero(d32);
  for (size_t k = 0; k < c.m; k += kN16) {
    const auto vm = hn::VecFromMask(d16, hn::LoadMaskBits(d16, sg + k / 8));
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) g[r] = MulAcc16<kVnni>(vm, hn::LoadU(d16, c.qs[r] + k), g[r], h[r]);
  }
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) out[r] = hn::ConvertTo(AF(), hn::RearrangeToOddPlusEven(g[r], h[r]));
}
// sqrt(pi/2)/m * gamma of the nt tokens from t0 (zero past nt), once a tile.
template <size_t NR>
HWY_INLINE AV QjlFactors(const Qjl16<NR>& c, const CodecPlan& plan, const attn::Seg& s, size_t t0,
                         size_t nt) {
  HWY_ALIGN float gsc[kL] = {};
  const size_t go = plan.resid_offset - plan.scale_offset;
  // Scales16 (a vector, not kL scalar stores read back as one: a
  // store-forwarding stall a tile); the scale precedes gamma in the row.
  const bool lead = plan.resid_offset >= plan.scale_offset + 2 || MetaAfterCodes(s.k, s.km + go, s.km_stride);
  Scales16(plan, s.km + t0 * s.km_stride + go, s.km_stride, nt, gsc, lead);
  return hn::Mul(hn::Load(AF(), gsc), hn::Set(AF(), c.coef));
}
// The term of row r for a tile's tokens (parts: QjlToken's lanes per token,
// zero past the tile's end; fac: QjlFactors), lanes in token order.
template <size_t NR>
HWY_INLINE AV QjlTerms(const Qjl16<NR>& c, size_t r, AV* parts, AV fac) {
  const AF df;
  const AV sgn = hn::MulAdd(ReduceVectors(parts), hn::Set(df, -2.0f), hn::Set(df, -c.qsa[r]));
  return hn::Mul(hn::Mul(sgn, hn::Set(df, c.qsi[r])), fac);
}

// Adds prod keys' QJL term to scores already holding the MSE part (after
// the fixed-shape MSE kernel).
template <size_t NR, bool kVnni>
HWY_NOINLINE void AddQjl16(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                           attn::Row* const* rs, float* const* lg, AScratch& scr) {
  const AF df;
  const CodecPlan& plan = *ctx.kc->groups[0].plan;
  const Qjl16<NR> c = MakeQjl16<NR>(*ctx.task, ctx.i16, rs, scr);
  HWY_ALIGN AV parts[NR][kL];
  for (size_t t0 = a; t0 < b; t0 += kL) {
    const size_t nt = std::min(kL, b - t0);
    for (size_t tt = 0; tt < kL; ++tt) {
      AV out[NR];
      if (tt < nt) {
        QjlToken<NR, kVnni>(c, s.k + (t0 + tt) * s.k_stride + plan.sign_offset, out);
      } else {
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) out[r] = hn::Zero(df);
      }
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) parts[r][tt] = out[r];
    }
    const AV fac = QjlFactors<NR>(c, plan, s, t0, nt);
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      StoreLogits<true>(QjlTerms<NR>(c, r, parts[r], fac), lg[r] + (t0 - a), nt);
    }
  }
}

// kQjl (prod keys): the (b-1)-bit MSE part as for MSE keys plus the QJL
// term (Qjl16), in the same pass over the tokens.
template <size_t NR, bool kVnni, bool kQjl = false>
HWY_NOINLINE void ScoreMse16(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                             attn::Row* const* rs, const float* koff, float* const* lg,
                             AScratch& scr) {
  const AF df;
  const B8 d8;
  const B16 d16;
  const B32 d32;
  const attn::Task& task = *ctx.task;
  const CodecPlan& plan = *ctx.kc->groups[0].plan;
  const I16Book& z = ctx.i16;
  const size_t len = z.nvec_k * kN16;
  const auto tlo = hn::LoadDup128(d8, z.lo);
  const auto thi = hn::LoadDup128(d8, z.hi);
  const auto m4 = hn::Set(d8, uint8_t{0x0F});
  const int16_t* q[NR];
  float qi[NR];
  IntKeyRows<NR>(task, rs, scr.q16, len, scr.qinv, q, qi);
  Qjl16<NR> qc;
  if constexpr (kQjl) qc = MakeQjl16<NR>(task, z, rs, scr);
  HWY_ALIGN AV qparts[kQjl ? NR : 1][kL];
  // Non-nibble widths: a group's rows unpacked to bytes before they are read
  // (a load right after the unpacking's narrower stores would stall).
  const size_t ulen = z.nch * kN8;
  const bool unpack = !z.nib && !z.inreg;
  const bool vec_scales = plan.scale_f16 && s.km_stride == 2;
  if (unpack) scr.tile.resize(kL * ulen + 64);
  TQ_IDX_CHUNK_CONSTANTS(z);
  HWY_ALIGN AV parts[NR][kL];
  const bool fol = Follows(s, b);
  for (size_t t0 = a; t0 < b; t0 += kL) {
    const size_t nt = std::min(kL, b - t0);
    HWY_ALIGN float sc[kL] = {};
    // Prefetch hints (past a segment's end is harmless): the key rows
    // kDenseAhead tokens ahead, and this group's value rows, which
    // AccumMse16 reads after the tile's softmax (about 10% faster measured).
    for (size_t tt = 0; tt < kL; ++tt) {
      const uint8_t* fk =
          fol ? AheadK(s, t0 + tt + kDenseAhead) : s.k + (t0 + tt + kDenseAhead) * s.k_stride;
      const uint8_t* fv = s.v + (t0 + tt) * s.v_stride;
      for (size_t o = 0; o < plan.index_bytes; o += 64) {
        hwy::Prefetch(fk + o);
        hwy::Prefetch(fv + o);
      }
    }
    if (vec_scales && nt == kL) {  // kL consecutive fp16 scales
      hn::Store(hn::PromoteTo(df, hn::LoadU(AH(), reinterpret_cast<const hwy::float16_t*>(
                                                      s.km + t0 * s.km_stride))),
                df, sc);
    } else {
      for (size_t tt = 0; tt < nt; ++tt) sc[tt] = Scale(plan, s.km + (t0 + tt) * s.km_stride);
    }
    for (size_t tt = 0; tt < nt; ++tt) {
      if (unpack) {
        Unpack(s.k + (t0 + tt) * s.k_stride, plan.dim, plan.mse_bits, scr.tile.data() + tt * ulen,
               plan.index_bytes);
      }
    }
    for (size_t tt = 0; tt < kL; ++tt) {
      if (tt >= nt) {
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) {
          parts[r][tt] = hn::Zero(df);
          if constexpr (kQjl) qparts[r][tt] = hn::Zero(df);
        }
        continue;
      }
      if constexpr (kQjl) {
        AV out[NR];
        QjlToken<NR, kVnni>(qc, s.k + (t0 + tt) * s.k_stride + plan.sign_offset, out);
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) qparts[r][tt] = out[r];
      }
      hn::Vec<B32> a0 = hn::Zero(d32), a1 = a0, a2 = a0, a3 = a0;
      hn::Vec<B32> b0 = a0, b1 = a0, b2 = a0, b3 = a0;  // second sums (targets that reorder)
#define TQ_I16_KEY(R, A, B, V0, V1, O0, O1)                                        \
  if constexpr (NR > R) {                                                          \
    A = MulAcc16<kVnni>(V0, hn::LoadU(d16, q[R] + O0), A, B);                      \
    A = MulAcc16<kVnni>(V1, hn::LoadU(d16, q[R] + O1), A, B);                      \
  }
#define TQ_I16_KEYS(V0, V1, O0, O1)         \
  TQ_I16_KEY(0, a0, b0, V0, V1, O0, O1)     \
  TQ_I16_KEY(1, a1, b1, V0, V1, O0, O1)     \
  TQ_I16_KEY(2, a2, b2, V0, V1, O0, O1)     \
  TQ_I16_KEY(3, a3, b3, V0, V1, O0, O1)
      if (z.nib) {
        const uint8_t* row = s.k + (t0 + tt) * s.k_stride;
        if (!kMaskedCodes) row = PadRow(row, plan.index_bytes, z.extent, s.k_stride, scr.pad.data());
        for (size_t c = 0; c < z.nch; ++c) {
          const auto x = LoadCodes(row, c * kN8, plan.index_bytes);
          const auto ev = hn::And(x, m4);
          const auto od = hn::And(hn::BitCast(d8, hn::ShiftRight<4>(hn::BitCast(d16, x))), m4);
          hn::Vec<B16> c0, c1, c2, c3;
          Centroids16(tlo, thi, ev, &c0, &c1);
          Centroids16(tlo, thi, od, &c2, &c3);
          const size_t o = 4 * c * kN16;
          TQ_I16_KEYS(c0, c1, o, o + kN16)
          TQ_I16_KEYS(c2, c3, o + 2 * kN16, o + 3 * kN16)
        }
      } else if (!unpack) {
        if constexpr (kInRegCodes) {
          const uint8_t* row = s.k + (t0 + tt) * s.k_stride;
          for (size_t c = 0; c < z.nch; ++c) {
            hn::Vec<B16> c0, c1;
            Centroids16(tlo, thi, TQ_IDX_CHUNK(z, row, plan.index_bytes, c), &c0, &c1);
            const size_t o = 2 * c * kN16;
            TQ_I16_KEYS(c0, c1, o, o + kN16)
          }
        }
      } else {
        const uint8_t* idx = scr.tile.data() + tt * ulen;
        for (size_t c = 0; c < z.nch; ++c) {
          hn::Vec<B16> c0, c1;
          Centroids16(tlo, thi, hn::LoadU(d8, idx + c * kN8), &c0, &c1);
          const size_t o = 2 * c * kN16;
          TQ_I16_KEYS(c0, c1, o, o + kN16)
        }
      }
#undef TQ_I16_KEYS
#undef TQ_I16_KEY
      parts[0][tt] = hn::ConvertTo(df, hn::RearrangeToOddPlusEven(a0, b0));
      if constexpr (NR > 1) parts[1][tt] = hn::ConvertTo(df, hn::RearrangeToOddPlusEven(a1, b1));
      if constexpr (NR > 2) parts[2][tt] = hn::ConvertTo(df, hn::RearrangeToOddPlusEven(a2, b2));
      if constexpr (NR > 3) parts[3][tt] = hn::ConvertTo(df, hn::RearrangeToOddPlusEven(a3, b3));
    }
    const AV scv = hn::Load(df, sc);
    AV qfac = hn::Zero(df);
    if constexpr (kQjl) qfac = QjlFactors<NR>(qc, plan, s, t0, nt);
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      AV tot = hn::MulAdd(hn::Mul(ReduceVectors(parts[r]), scv), hn::Set(df, qi[r]), hn::Set(df, koff[r]));
      if constexpr (kQjl) tot = hn::Add(tot, QjlTerms<NR>(qc, r, qparts[r], qfac));
      StoreLogits(tot, lg[r] + (t0 - a), nt);
    }
  }
}

// The int16 weights of one query row and one scale group of a tile (the
// integer value kernels): u_t = round(w_t s_t wmax / m) for t < n + 1 (wr and
// sc are zero past n), m = max_t |w_t s_t|, which it returns (0: all zero).
HWY_INLINE float TileWeights16(const float* wr, const float* sc, size_t n, int wmax, int16_t* out) {
  const AF df;
  const hn::Rebind<int16_t, AF> dh;
  AV mxv = hn::Zero(df);
  for (size_t u = 0; u < n; u += kL) mxv = hn::Max(mxv, hn::Abs(hn::Mul(hn::Load(df, wr + u), hn::Load(df, sc + u))));
  const float mx = hn::GetLane(hn::MaxOfLanes(df, mxv));
  const AV f = hn::Set(df, mx > 0.0f ? static_cast<float>(wmax) / mx : 0.0f);
  for (size_t u = 0; u < n + 1; u += kL) {
    hn::Store(hn::DemoteTo(dh, hn::NearestInt(hn::Mul(hn::Mul(hn::Load(df, wr + u), hn::Load(df, sc + u)), f))), dh,
              out + u);
  }
  return mx;
}

// Row r's weights of a tile of n tokens, zero-padded to kTile + kL.
HWY_INLINE void PadWeights(const float* w, size_t n, float* wr) {
  size_t t = 0;
  for (; t < n; ++t) wr[t] = w[t];
  for (; t < kTile + kL; ++t) wr[t] = 0.0f;
}

inline const uint8_t* ZeroRow() {
  alignas(64) static const uint8_t z[256] = {};
  return z;
}
constexpr int kAsymWmax = 32767;

// The int16 weights of int-asym values in groups of 32 (AccumAsymG32,
// AccumAsymAvx2): for row r and group g, u_t = round(w_t s_tg wmax / B)
// against the bound B = max_t w_t x max_t |s_tg| (fac[r][g] = B / wmax;
// wmax = kAsymWmax), and zsum[r][g] = sum_t w_t z_tg (the zeros' share);
// sg and zg hold the tile's scales and zeros a group (zeroed here past n,
// to kTile + kL). One max a row and one a group, not one a (row, group)
// pair as TileWeights16 takes (that pass was a sixth of AccumAsymG32's work
// at 4 rows and 4 groups): the products lose only the bits by which the
// tile's largest weight and largest scale miss each other, and a group's
// scales vary little between tokens.
template <size_t NR>
HWY_INLINE void AsymG32Weights(attn::Row* const* rs, float* const* w, size_t n, size_t ng,
                               float (*sg)[kTile + kL], float (*zg)[kTile + kL],
                               int16_t (*w16)[8][kTile + kL], float (*fac)[8], float (*zsum)[8]) {
  const AF df;
  const hn::Rebind<int16_t, AF> dh;
  for (size_t g = 0; g < ng; ++g) {
    for (size_t t = n; t < kTile + kL; ++t) sg[g][t] = zg[g][t] = 0.0f;
  }
  float smax[8];
  for (size_t g = 0; g < ng; ++g) {
    AV m = hn::Zero(df);
    for (size_t u = 0; u < n; u += kL) m = hn::Max(m, hn::Abs(hn::Load(df, sg[g] + u)));
    smax[g] = hn::GetLane(hn::MaxOfLanes(df, m));
  }
  for (size_t r = 0; r < NR; ++r) {
    rs[r]->int_values = true;
    HWY_ALIGN float wr[kTile + kL];
    PadWeights(w[r], n, wr);
    AV m = hn::Zero(df);
    for (size_t u = 0; u < n; u += kL) m = hn::Max(m, hn::Load(df, wr + u));
    const float wm = hn::GetLane(hn::MaxOfLanes(df, m));
    for (size_t g = 0; g < ng; ++g) {
      const float bound = wm * smax[g];
      const AV f = hn::Set(df, bound > 0.0f ? static_cast<float>(kAsymWmax) / bound : 0.0f);
      AV zv = hn::Zero(df);
      for (size_t u = 0; u < n + 1; u += kL) {
        const AV wv = hn::Load(df, wr + u);
        zv = hn::MulAdd(wv, hn::Load(df, zg[g] + u), zv);
        hn::Store(hn::DemoteTo(dh, hn::NearestInt(hn::Mul(hn::Mul(wv, hn::Load(df, sg[g] + u)), f))), dh,
                  w16[r][g] + u);
      }
      zsum[r][g] = hn::GetLane(hn::SumOfLanes(df, zv));
      fac[r][g] = bound / static_cast<float>(kAsymWmax);
    }
  }
}
// The integer value kernel (attention_int16_values-inl.h), declared here
// for the targets' kernel tables: value sums of a tile's compressed parts;
// FB > 0: the fixed-shape passes for FB-bit codes in FN chunks
// (TargetKernels::FixedValuePasses).
template <size_t NR, bool kVnni, int FB = 0, size_t FN = 0>
HWY_NOINLINE void AccumMse16(const KeyCtx& vctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                             float* const* w, AScratch& scr);
#endif  // HWY_TARGET != HWY_SCALAR

}  // namespace attnk
}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
