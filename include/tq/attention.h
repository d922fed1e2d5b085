// Attention over the compressed KV cache (CPU), and dense fp32/fp16
// baselines of our own.
//
// Keys stored as TurboQuant-MSE rows are scored straight from their packed
// indices in the rotated domain: q·k = q·μ + Σ_blocks scale·⟨(Πq)_block,
// c[idx]⟩, with the query rotated once per KV head. TurboQuant values are
// accumulated in the rotated domain (Σ_t p_t·scale_t·c[idx_t]) and rotated
// back once per head at the end; group-integer values are decoded in
// registers. Dense sinks and the dense recent window of a KVCache are read as
// they are (hybrid exact + compressed). Softmax is online (running max and
// sum) across all segments; GQA shares each key and value across the query
// heads of its group. Work is split across (sequence, KV head, token chunk)
// and the chunks are merged with a log-sum-exp combine.
//
// Thread-safety: every function here may run concurrently with any other
// call that only reads the same caches (their const methods); none may run
// while a view's cache is being appended to, forked, freed or written.
//
// Positions: a cache of length L holds tokens at positions 0..L-1. A decode
// query is the token at position L-1 (it must already be appended). Prefill
// queries q[i] are at positions query_start + i and see keys at positions
// <= their own (causal); with a window W they see (pos - W, pos].
//
// The fp64 reference (tq::ref::Attention) on the same keys and values decoded
// to fp32 is the oracle every fast path is tested against.
#ifndef TQ_ATTENTION_H_
#define TQ_ATTENTION_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "tq/dtype.h"
#include "tq/kv_cache.h"
#include "tq/paged_kv_cache.h"
#include "tq/status.h"

namespace tq {

struct AttentionOptions {
  // logits = scale · q·k; 0 means 1/sqrt(head_dim).
  float scale = 0.0f;
  // > 0: logits = softcap · tanh(logits / softcap) (Gemma-2 style soft-cap).
  float softcap = 0.0f;
  // > 0: a query at position p sees keys at positions (p - window, p].
  size_t window = 0;
  // > 0: a token whose weight exp(logit - running max) is below this value
  // is kept in the softmax denominator but its value is not decoded (the
  // running max never exceeds the final max, so every skipped weight is
  // below threshold × the largest weight). Counted in the report. Off (0) by
  // default: results are then exact up to rounding.
  float sparse_v_threshold = 0.0f;
  // Worker threads over (sequence, KV head, token chunk); 0 = all hardware threads.
  size_t threads = 1;
  // Tokens per split-K chunk; 0 = automatic (enough chunks for the threads).
  size_t split_tokens = 0;
};

// The kernel set of the SIMD target an attention call ran on. The x86
// targets with fixed-shape integer kernels of their own are named; every
// other target (SSE4, AVX3, NEON, SVE, ...) runs Highway's portable kernels.
enum class AttnKernelSet : uint8_t {
  kScalar = 0,       // Highway's SCALAR target: fp32 kernels, no SIMD
  kPortable = 1,     // Highway's portable SIMD kernels, fp32 and int16
  kAvx2 = 2,         // AVX2: the portable kernels and fixed-shape int16 kernels at head_dim 128
                     // (intrinsics and asm)
  kAvx2AvxVnni = 3,  // the same on a CPU with AVX-VNNI (their VEX vpdpwssd forms)
  kAvx512Vnni = 4,   // AVX3_DL with AVX-512 VNNI: the portable kernels and fixed-shape AVX-512 kernels
};
// "scalar", "portable", "AVX2", "AVX2+AVX-VNNI", "AVX-512 VNNI".
const char* AttnKernelSetName(AttnKernelSet set);

// The arithmetic of a call's key scores or value sums.
enum class AttnArithmetic : uint8_t {
  kFloat = 0,  // fp32 throughout
  kInt16 = 1,  // the integer kernels (int16 products, int32 sums) ran for some rows or all
};
// "fp32", "int16".
const char* AttnArithmeticName(AttnArithmetic arithmetic);

struct AttentionReport {
  size_t scored = 0;            // (query head, key token) logits computed
  size_t values_accumulated = 0;  // (query head, token) value accumulations
  size_t values_skipped = 0;    // (query head, token) skipped by sparse_v_threshold
  size_t workspace_bytes = 0;   // largest workspace held at once (all threads)
  // The kernels that ran: the SIMD target (a name of tq::SimdTargets(),
  // e.g. "AVX3_DL"), its kernel set, and the keys' and values' arithmetic.
  std::string simd_target;
  AttnKernelSet kernel_set = AttnKernelSet::kPortable;
  AttnArithmetic keys = AttnArithmetic::kFloat;
  AttnArithmetic values = AttnArithmetic::kFloat;
};
// The report's kernels in one line: the target ("+AVX-VNNI" added for
// kAvx2AvxVnni), then " int16 keys+values" (or " int16 keys" / " int16
// values") where the integer kernels ran, e.g. "AVX3_DL int16 keys+values".
std::string AttnKernelName(const AttentionReport& report);

// ---------------------------------------------------------------------------
// Compressed decode over KVCache views: one query per sequence.
//   q, out: [batch][num_q_heads][head_dim] fp32, batch = views.size().
// num_q_heads must be a multiple of the views' KV heads (GQA). Every view
// must have the same head_dim and KV heads, and length >= 1.
Status DecodeAttention(std::span<const KVLayerView> views, size_t num_q_heads,
                       std::span<const float> q, std::span<float> out,
                       const AttentionOptions& options = {}, AttentionReport* report = nullptr);

// Compressed decode over a paged cache (vLLM-style):
//   block_tables: [batch][max_blocks_per_seq] page ids (int32),
//   seq_lens:     [batch] tokens of each sequence (>= 1),
//   q, out:       [batch][num_q_heads][head_dim].
// Page ids must be < the pool's num_blocks and every sequence must fit its
// row of the block table; violations are errors naming the sequence.
Status PagedDecodeAttention(const PagedLayerView& view, size_t num_q_heads,
                            std::span<const int32_t> block_tables, size_t max_blocks_per_seq,
                            std::span<const int32_t> seq_lens, std::span<const float> q,
                            std::span<float> out, const AttentionOptions& options = {},
                            AttentionReport* report = nullptr);

// Prefill / chunked prefill over a KVCache view: n queries at positions
// query_start .. query_start + n - 1 (their keys and values already
// appended, so query_start + n <= view.length()), each attending causally.
//   q, out: [n][num_q_heads][head_dim].
// Works tile by tile: the workspace depends on the tile sizes, never on the
// context length (reported in AttentionReport::workspace_bytes).
Status PrefillAttention(const KVLayerView& view, size_t num_q_heads, size_t query_start,
                        std::span<const float> q, std::span<float> out,
                        const AttentionOptions& options = {}, AttentionReport* report = nullptr);

// ---------------------------------------------------------------------------
// Dense baselines (our own kernels, same tiling and threading).
// K and V of one sequence, element type dtype (f16/bf16 as uint16_t bits).
// Element (token t, head h, channel j) is at k[t * token_stride + h *
// head_stride + j]. Strides 0 mean the packed [tokens][num_kv_heads][head_dim]
// layout (vLLM-like); HuggingFace's [heads][tokens][head_dim] is
// token_stride = head_dim, head_stride = tokens * head_dim. Rows of one head
// far apart in memory (the packed layout at long context) cost TLB misses:
// the head-major layout is the fast one.
struct DenseKVView {
  const void* k = nullptr;
  const void* v = nullptr;
  DType dtype = DType::kF16;
  size_t tokens = 0;
  size_t num_kv_heads = 0;
  size_t head_dim = 0;
  size_t token_stride = 0;  // elements; 0 = num_kv_heads * head_dim
  size_t head_stride = 0;   // elements; 0 = head_dim
};

Status DenseDecodeAttention(std::span<const DenseKVView> seqs, size_t num_q_heads,
                            std::span<const float> q, std::span<float> out,
                            const AttentionOptions& options = {}, AttentionReport* report = nullptr);
Status DensePrefillAttention(const DenseKVView& kv, size_t num_q_heads, size_t query_start,
                             std::span<const float> q, std::span<float> out,
                             const AttentionOptions& options = {},
                             AttentionReport* report = nullptr);

namespace ref {

// The oracle: dense attention in fp64 (GQA, causal from query_start, window,
// soft-cap; sparse_v_threshold and threads are ignored).
//   q:   [n][num_q_heads][head_dim]
//   k,v: [tokens][num_kv_heads][head_dim]
//   out: [n][num_q_heads][head_dim]
//   weights (optional): [n][num_q_heads][tokens] softmax weights (0 where masked).
Status Attention(std::span<const float> q, size_t n, size_t num_q_heads, std::span<const float> k,
                 std::span<const float> v, size_t tokens, size_t num_kv_heads, size_t head_dim,
                 size_t query_start, const AttentionOptions& options, std::span<double> out,
                 std::span<double> weights = {});

}  // namespace ref
}  // namespace tq

#endif  // TQ_ATTENTION_H_
