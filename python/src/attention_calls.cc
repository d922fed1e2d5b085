#include "attention_calls.h"

#include <span>
#include <string>
#include <vector>

#include "status_errors.h"
#include "tq/attention.h"

namespace tq_py {

F32Out KVCacheDecodeAttention(const PyKVCache& c, size_t layer, std::vector<size_t> seqs, AnyArray q,
                              float scale, float softcap, size_t window, size_t threads) {
  const auto& sh = c.cache.config().shape;
  const size_t nq = CheckTensor(q, "q", 3, sh.head_dim);
  if (q.shape(0) != seqs.size()) {
    throw nb::value_error(("q: first dimension must be len(seqs) = " + std::to_string(seqs.size()) +
                           ", got " + std::to_string(q.shape(0))).c_str());
  }
  auto out = NewArray<float>(1, nq, false);
  const std::span<const float> qs(static_cast<const float*>(q.data()), nq);
  const std::span<float> os(out.data(), nq);
  const size_t num_q_heads = q.shape(1);
  // The views point into the cache: taken and used under one lock.
  Check(ReadLocked(c, [&](const tq::KVCache& cache) -> tq::Status {
    std::vector<tq::KVLayerView> views;
    for (size_t s : seqs) {
      tq::Result<tq::KVLayerView> v = cache.View(layer, s);
      if (!v.ok()) return v.status();
      views.push_back(*v);
    }
    return tq::DecodeAttention(views, num_q_heads, qs, os,
                               {.scale = scale, .softcap = softcap, .window = window, .threads = threads});
  }));
  return out;
}

F32Out KVCachePrefillAttention(const PyKVCache& c, size_t layer, size_t seq, AnyArray q, size_t query_start,
                               float scale, float softcap, size_t window, size_t threads) {
  const auto& sh = c.cache.config().shape;
  const size_t nq = CheckTensor(q, "q", 3, sh.head_dim);
  auto out = NewArray<float>(1, nq, false);
  const std::span<const float> qs(static_cast<const float*>(q.data()), nq);
  const std::span<float> os(out.data(), nq);
  const size_t num_q_heads = q.shape(1);
  Check(ReadLocked(c, [&](const tq::KVCache& cache) -> tq::Status {
    tq::Result<tq::KVLayerView> view = cache.View(layer, seq);
    if (!view.ok()) return view.status();
    return tq::PrefillAttention(*view, num_q_heads, query_start, qs, os,
                                {.scale = scale, .softcap = softcap, .window = window, .threads = threads});
  }));
  return out;
}

F32Out PagedCacheDecodeAttention(const PyPagedKVCache& c, size_t layer, AnyArray q, AnyArray block_tables,
                                 AnyArray seq_lens, float scale, size_t threads) {
  const auto& sh = c.cache.config().shape;
  const size_t nq = CheckTensor(q, "q", 3, sh.head_dim);
  CheckInts<int32_t>(block_tables, "block_tables", 2);
  CheckInts<int32_t>(seq_lens, "seq_lens", 1);
  if (block_tables.shape(0) != q.shape(0) || seq_lens.shape(0) != q.shape(0)) {
    throw nb::value_error("q, block_tables and seq_lens must have the same batch size");
  }
  auto out = NewArray<float>(1, nq, false);
  const std::span<const float> qs(static_cast<const float*>(q.data()), nq);
  const std::span<float> os(out.data(), nq);
  const std::span<const int32_t> tables(static_cast<const int32_t*>(block_tables.data()), block_tables.size());
  const std::span<const int32_t> lens(static_cast<const int32_t*>(seq_lens.data()), seq_lens.size());
  const size_t max_blocks = block_tables.shape(1), num_q_heads = q.shape(1);
  Check(ReadLocked(c, [&](const tq::PagedKVCache& cache) -> tq::Status {
    tq::Result<tq::PagedLayerView> view = cache.View(layer);
    if (!view.ok()) return view.status();
    return tq::PagedDecodeAttention(*view, num_q_heads, tables, max_blocks, lens, qs, os,
                                    {.scale = scale, .threads = threads});
  }));
  return out;
}

}  // namespace tq_py
