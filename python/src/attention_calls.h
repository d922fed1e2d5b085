// The attention entry points of tq/attention.h over the caches' layers,
// bound as methods of KVCache and PagedKVCache (kv_caches.cc). Each checks
// its arrays (ValueError naming the argument), runs the kernel under the
// cache's shared lock with the GIL released (locked_caches.h) and returns a new flat float32 array of q's size.
#pragma once

#include <cstddef>
#include <vector>

#include "array_checks.h"
#include "locked_caches.h"
#include "tq/kv_cache.h"
#include "tq/paged_kv_cache.h"

namespace tq_py {

// KVCache.decode_attention: q [len(seqs), num_q_heads, head_dim], one query
// token per sequence, through tq::DecodeAttention.
F32Out KVCacheDecodeAttention(const PyKVCache& c, size_t layer, std::vector<size_t> seqs, AnyArray q,
                              float scale, float softcap, size_t window, size_t threads);

// KVCache.prefill_attention: q [n, num_q_heads, head_dim] at positions
// query_start .. query_start+n-1 of sequence seq (already appended), causal,
// through tq::PrefillAttention.
F32Out KVCachePrefillAttention(const PyKVCache& c, size_t layer, size_t seq, AnyArray q, size_t query_start,
                               float scale, float softcap, size_t window, size_t threads);

// PagedKVCache.decode_attention: q [batch, num_q_heads, head_dim] over int32
// block_tables [batch, max_blocks] and seq_lens [batch], through
// tq::PagedDecodeAttention.
F32Out PagedCacheDecodeAttention(const PyPagedKVCache& c, size_t layer, AnyArray q, AnyArray block_tables,
                                 AnyArray seq_lens, float scale, size_t threads);

}  // namespace tq_py
