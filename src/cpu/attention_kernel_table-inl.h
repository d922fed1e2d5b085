// The per-call kernel table of the attention kernels. A call (one work
// item, attn::Task) picks its kernels once (PickKernels, in
// attention_tile-inl.h), for each count NR of query rows a kernel serves at
// a time, and the tile loop calls through them: RowKernels holds the
// entries, the aliases below their signatures, and the adapters give a
// kernel of another signature an entry's. TargetKernels is how a target
// adds kernels of its own: the x86 targets with fixed-shape kernels
// specialize it in their files (AVX3_DL in attention_avx512-inl.h, AVX2 in
// attention_avx2-inl.h); every other target keeps the portable choices.

// Per-target include guard (Highway re-includes this file for every target).
#if defined(TQ_SRC_CPU_ATTENTION_KERNEL_TABLE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_ATTENTION_KERNEL_TABLE_INL_H_
#undef TQ_SRC_CPU_ATTENTION_KERNEL_TABLE_INL_H_
#else
#define TQ_SRC_CPU_ATTENTION_KERNEL_TABLE_INL_H_
#endif

#include <type_traits>

#include "cpu/attention_shared-inl.h"
#include "tq/attention.h"

HWY_BEFORE_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {
namespace attnk {

// Keys of rows [a, b) of segment s (counted from its first row) for query
// rows rs[0..NR): logits into lg[r][0 .. b - a).
using KeyFn = void (*)(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                       float* const* lg, AScratch& scr);
// Keys of compressed parts sp[0..nsp) (runs of rows in position order, each
// part's logits right after the previous part's in lg[r]); koff[r] is row
// r's offset (q · key mean).
using KeyPartsFn = void (*)(const KeyCtx& ctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                            const float* koff, float* const* lg, AScratch& scr);
// The kernels of one segment that take the rows' offsets koff[0..NR).
using KeyOffsetFn = void (*)(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                             const float* koff, float* const* lg, AScratch& scr);
// Values: rows' accumulators += w[r][t - a] · v_t over rows [a, b) of s.
using ValueFn = void (*)(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                         float* const* w, AScratch& scr);
// Values of compressed parts sp[0..nsp) (the weights of the parts in order).
using ValuePartsFn = void (*)(const KeyCtx& vctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                              float* const* w, AScratch& scr);

// A kernel's address as a type (for the adapters' template arguments).
template <class F, F kFn>
using Kernel = std::integral_constant<F, kFn>;

// The kernels of one call that serve NR query rows at a time (each entry
// the instance for that NR; CallKernels::For<NR>). Every entry is set (a
// no-op where no rows of its kind can occur) but key_parts and
// value_parts, which are nullptr where no parts kernel applies. Compressed
// values' entries run after the tile loop's AddCompressedWeights.
struct RowKernels {
  KeyFn dense_keys = nullptr;      // a dense segment's rows
  KeyPartsFn key_parts = nullptr;  // compressed rows in parts: one segment's, or a tile's pages at once
  KeyFn keys = nullptr;            // compressed rows, where key_parts is nullptr
  ValueFn dense_values = nullptr;
  ValuePartsFn value_parts = nullptr;
  ValueFn values = nullptr;        // compressed rows, where value_parts is nullptr
  ValueFn f32_values = nullptr;    // a prefill tile decoded to fp32 rows (Fmt::kF32)
};
struct CallKernels {
  RowKernels rows[kGroup];  // [NR - 1]
  template <size_t NR>
  HWY_INLINE const RowKernels& For() const {
    return rows[NR - 1];
  }
};

// ---------------------------------------------------------------------------
// Adapters to the entries' signatures.

template <size_t NR>
HWY_INLINE void KeyOffsets(attn::Row* const* rs, float* koff) {
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) koff[r] = rs[r]->koff;
}
// K with the rows' key offsets.
template <size_t NR, KeyOffsetFn K>
void KeysWithOffsets(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                     float* const* lg, AScratch& scr) {
  float koff[NR];
  KeyOffsets<NR>(rs, koff);
  K(ctx, s, a, b, rs, koff, lg, scr);
}
// K over one segment's rows as one part.
template <size_t NR, KeyPartsFn K>
void KeysOnePart(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                 float* const* lg, AScratch& scr) {
  float koff[NR];
  KeyOffsets<NR>(rs, koff);
  const SegPart part{&s, a, b};
  K(ctx, &part, 1, rs, koff, lg, scr);
}
// A value kernel that needs no scratch.
template <void (*K)(const KeyCtx&, const attn::Seg&, size_t, size_t, attn::Row* const*, float* const*)>
void ValuesWithoutScratch(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                          float* const* w, AScratch&) {
  K(vctx, s, a, b, rs, w);
}
inline void NoKeys(const KeyCtx&, const attn::Seg&, size_t, size_t, attn::Row* const*, float* const*, AScratch&) {}
inline void NoValues(const KeyCtx&, const attn::Seg&, size_t, size_t, attn::Row* const*, float* const*, AScratch&) {}

// ---------------------------------------------------------------------------
// A target's kernels of its own (the primary template: none). A target
// that has some specializes TargetKernels<its HWY_TARGET> with the same
// members.
template <int64_t kTarget>
struct TargetKernels {
  // The kernel set the report names.
  static AttnKernelSet Set() { return kTarget == HWY_SCALAR ? AttnKernelSet::kScalar : AttnKernelSet::kPortable; }
  // The target's tables of an int16 codebook (I16Book), once InitI16 has
  // turned it on.
  static void InitBook(I16Book*) {}
  // The call's layouts and int16 queries of the target's kernels (kctx:
  // keys, vctx: values). Returns whether the integer key kernels' int16
  // query lanes (PrepareQ16) are read.
  static bool Prepare(const attn::Task&, KeyCtx*, KeyCtx*, AScratch&) { return true; }
  // Replaces entries of k (the portable choices) with the target's kernels
  // where they apply.
  template <size_t NR>
  static void Pick(const KeyCtx&, const KeyCtx&, RowKernels*) {}
  // AccumMse16's passes for FB-bit codes in FN chunks (the fixed-shape
  // value kernels; only targets that pick them define it).
  template <size_t NR, int FB, size_t FN>
  static void FixedValuePasses(const I16Book& z, const uint8_t* const* rows, size_t npairs,
                               const int16_t* const* wps, const float* fac, float* const* priv);
};

}  // namespace attnk
}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
