#include "attention_calls.h"

#include <string>

#include "status_errors.h"
#include "tq/attention.h"

namespace tq_py {

F32Out KVCacheDecodeAttention(const tq::KVCache& c, size_t layer, std::vector<size_t> seqs, AnyArray q,
                              float scale, float softcap, size_t window, size_t threads) {
  const auto& sh = c.config().shape;
  const size_t nq = CheckTensor(q, "q", 3, sh.head_dim);
  if (q.shape(0) != seqs.size()) {
    throw nb::value_error(("q: first dimension must be len(seqs) = " + std::to_string(seqs.size()) +
                           ", got " + std::to_string(q.shape(0))).c_str());
  }
  std::vector<tq::KVLayerView> views;
  for (size_t s : seqs) views.push_back(Take(c.View(layer, s)));
  auto out = NewArray<float>(1, nq, false);
  tq::Status st;
  {
    nb::gil_scoped_release release;
    st = tq::DecodeAttention(views, q.shape(1), {static_cast<const float*>(q.data()), nq},
                             {out.data(), nq},
                             {.scale = scale, .softcap = softcap, .window = window, .threads = threads});
  }
  Check(st);
  return out;
}

F32Out KVCachePrefillAttention(const tq::KVCache& c, size_t layer, size_t seq, AnyArray q, size_t query_start,
                               float scale, float softcap, size_t window, size_t threads) {
  const auto& sh = c.config().shape;
  const size_t nq = CheckTensor(q, "q", 3, sh.head_dim);
  tq::KVLayerView view = Take(c.View(layer, seq));
  auto out = NewArray<float>(1, nq, false);
  tq::Status st;
  {
    nb::gil_scoped_release release;
    st = tq::PrefillAttention(view, q.shape(1), query_start, {static_cast<const float*>(q.data()), nq},
                              {out.data(), nq},
                              {.scale = scale, .softcap = softcap, .window = window, .threads = threads});
  }
  Check(st);
  return out;
}

F32Out PagedCacheDecodeAttention(const tq::PagedKVCache& c, size_t layer, AnyArray q, AnyArray block_tables,
                                 AnyArray seq_lens, float scale, size_t threads) {
  const auto& sh = c.config().shape;
  const size_t nq = CheckTensor(q, "q", 3, sh.head_dim);
  CheckInts<int32_t>(block_tables, "block_tables", 2);
  CheckInts<int32_t>(seq_lens, "seq_lens", 1);
  if (block_tables.shape(0) != q.shape(0) || seq_lens.shape(0) != q.shape(0)) {
    throw nb::value_error("q, block_tables and seq_lens must have the same batch size");
  }
  tq::PagedLayerView view = Take(c.View(layer));
  auto out = NewArray<float>(1, nq, false);
  tq::Status st;
  {
    nb::gil_scoped_release release;
    st = tq::PagedDecodeAttention(
        view, q.shape(1), {static_cast<const int32_t*>(block_tables.data()), block_tables.size()},
        block_tables.shape(1), {static_cast<const int32_t*>(seq_lens.data()), seq_lens.size()},
        {static_cast<const float*>(q.data()), nq}, {out.data(), nq}, {.scale = scale, .threads = threads});
  }
  Check(st);
  return out;
}

}  // namespace tq_py
