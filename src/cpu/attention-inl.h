// Per-target attention kernels (entry point: AttnRunImpl, dispatched from
// attention/attention.cc, which includes this file once per SIMD target). One
// call runs one work item (attn::Task): a set of query
// rows of one KV head against the positions [t0, t1) of its segments, with an
// online softmax whose state lives in the rows.
//
// Keys are scored from their codes, up to four query rows at a time (GQA: one
// decode serves every query head of the group). One-block TurboQuant-MSE
// keys and values of 2..4 bits, and int-asym values with one group a row,
// take the integer kernels (ScoreMse16, AccumMse16: int16 centroids, int16
// queries and tile weights, int32 sums; on AVX3_DL fixed-shape forms of
// them, ScoreI16Fixed and AccumI16FixedInner, and for 2/3-bit keys at
// d = 128 ScoreTok with tokens in lanes); on AVX3_DL with VNNI so do int8-sym
// and int-asym keys and int-asym values in groups of 32 (ScoreGKeys,
// AccumAsymG32) and the split recipes' keys and values (ScoreSplit16,
// AccumSplit16), several scales a row brought to one unit per token; other
// TurboQuant rows take the fp32 kernels (centroid table in one register on
// AVX-512: TableLookupLanes).
// TurboQuant values are accumulated in the value codec's rotated domain
// (weight · scale · centroid); the driver rotates the sum back once per row.
// Other integer formats are decoded in registers. Results agree with the fp64
// reference to NMSE ~1e-7 (integer kernels) or float rounding (the rest);
// they are not bit-pinned like the codec bytes.
//
// A call picks its kernels once (PickKernels, attention_tile-inl.h): the
// portable ones for its formats, then the target's own (the x86 files'
// TargetKernels) where they apply; the tile loop calls through that table.
//
// The kernels live in parts, one concern each, included here in order (each
// part includes the one before it):
//   attention_shared-inl.h         types, tables, scratch, row decoders
//   attention_kernel_table-inl.h   the per-call kernel table: entry signatures,
//                                  adapters, the per-target hook TargetKernels
//   attention_float-inl.h          fp32 key and value kernels (every target)
//   attention_int16-inl.h          integer kernels: codebooks, queries, ScoreMse16
//   attention_split16-inl.h        split rows' int16 layouts (AVX3_DL and AVX2)
//   attention_avx512_groups-inl.h  AVX3_DL: shared reductions, group-scaled and split kernels
//   attention_avx512-inl.h         AVX3_DL: fixed-shape kernels (ScoreI16Fixed, ScoreTok)
//                                  and the AVX3_DL kernel table
//   attention_avx2-inl.h           AVX2: fixed-shape kernels (intrinsics and asm)
//                                  and the AVX2 kernel table
//   attention_int16_values-inl.h   the integer value kernel AccumMse16
//   attention_tile-inl.h           the call's kernels (PickKernels) and the
//                                  tile loop (AttnRunImpl)

// Per-target include guard (Highway re-includes this file for every target).
#if defined(TQ_SRC_CPU_ATTENTION_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_ATTENTION_INL_H_
#undef TQ_SRC_CPU_ATTENTION_INL_H_
#else
#define TQ_SRC_CPU_ATTENTION_INL_H_
#endif

#include "cpu/attention_shared-inl.h"
#include "cpu/attention_kernel_table-inl.h"
#include "cpu/attention_float-inl.h"
#include "cpu/attention_int16-inl.h"
#include "cpu/attention_split16-inl.h"
#include "cpu/attention_avx512_groups-inl.h"
#include "cpu/attention_avx512-inl.h"
#include "cpu/attention_avx2-inl.h"
#include "cpu/attention_int16_values-inl.h"
#include "cpu/attention_tile-inl.h"

#endif  // per-target include guard
