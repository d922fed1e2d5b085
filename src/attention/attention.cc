// Attention driver: validates inputs, describes every (sequence, KV head) as
// segments of dense or compressed rows, prepares the queries (scale, rotation
// into each key codec's domain, QJL sketches, mean offsets), splits the work
// into (sequence, KV head, query tile, token chunk) items run on the thread
// pool by the per-target kernel (src/cpu/attention-inl.h), merges token chunks
// with a log-sum-exp combine, and rotates TurboQuant value sums back once per
// query row.
//
// This file is also the kernels' Highway dispatch unit: Highway compiles
// cpu/attention-inl.h (and its parts) once per SIMD target here, and
// cpu::AttnRun / cpu::AttnKernels (cpu/dispatch.h) pick the target's
// instance at run time. The targets are the codec's (cpu/codec.cc), AVX3_DL
// included: the integer kernels use vpdpwssd there. The kernels call three
// of the codec's per-target kernels (UnpackIndices, SignDot,
// ScoreRowsImpl), which cpu/codec.cc compiles. Everything below HWY_ONCE is
// compiled once.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/attention.cc"  // relative to the src/ include dir
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "cpu/attention-inl.h"

#if HWY_ONCE

#include "tq/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "attention/internal.h"
#include "core/plan.h"
#include "core/thread_pool.h"
#include "cpu/dispatch.h"
#include "ref/kernels.h"
#include "tq/codec.h"
#include "tq/kv_format.h"

namespace tq {
namespace {

using attn::Comp;
using attn::Fmt;
using attn::Row;
using attn::Seg;
using attn::Task;

std::string Str(size_t v) { return std::to_string(v); }

constexpr size_t kMaxRowsPerItem = 64;

// One (sequence, KV head): its segments and compressed formats.
struct HeadWork {
  std::vector<Seg> segs;
  const Comp* kc = nullptr;
  const Comp* vc = nullptr;
  size_t length = 0;
};

// Appends a segment of the positions right after the head's last one.
void PushSeg(HeadWork* hw, const Seg& s) {
  if (!hw->segs.empty()) hw->segs.back().more = true;
  hw->segs.push_back(s);
}

struct CompStore {
  Comp comp;
  const KVRowCodec* codec = nullptr;
};

Status BuildComp(const KVRowCodec* codec, const float* mean, bool is_value, Comp* out) {
  const KVFormat& f = codec->format();
  Comp c;
  c.payload_bytes = codec->payload_bytes();
  c.meta_bytes = codec->meta_bytes();
  c.mean = mean;
  switch (f.kind) {
    case KVFormatKind::kDense16:
      c.fmt = f.half == Half16::kF16 ? Fmt::kF16 : Fmt::kBF16;
      break;
    case KVFormatKind::kInt8Sym:
      c.fmt = Fmt::kInt8;
      c.group_size = f.group_size;
      break;
    case KVFormatKind::kIntAsym:
      c.fmt = Fmt::kIntAsym;
      c.bits = f.bits;
      c.group_size = f.group_size;
      break;
    case KVFormatKind::kTurboMse:
      c.fmt = Fmt::kMse;
      c.num_groups = 1;
      c.groups[0].plan = &codec->codec()->plan();
      c.fast_mse = attn::FastMsePlan(*c.groups[0].plan);
      break;
    case KVFormatKind::kTurboProd:
      if (is_value) {
        return UnimplementedError(
            "attention: TurboQuant-prod values (" + ToString(f) +
            ") are not supported; value formats: f16, bf16, int8-sym, int-asym, tq-mse, split-mse");
      }
      c.fmt = Fmt::kProd;
      c.num_groups = 1;
      c.groups[0].plan = &codec->codec()->plan();
      c.fast_mse = attn::FastMsePlan(*c.groups[0].plan);
      break;
    case KVFormatKind::kTurboSplit: {
      const SplitCodec* sp = codec->split();
      if (is_value && sp->spec().kind != CodecKind::kMse) {
        return UnimplementedError("attention: split values with prod codes (" + ToString(f) +
                                  ") are not supported; split values must use mse codes");
      }
      c.fmt = Fmt::kSplit;
      c.num_groups = 2;
      c.groups[0].plan = &sp->regular().plan();
      c.groups[0].row_offset = 0;
      c.groups[0].rot_offset = 0;
      c.groups[0].sketch_offset = 0;
      c.groups[0].channels = sp->regular_channels().data();
      c.groups[1].plan = &sp->outlier().plan();
      c.groups[1].row_offset = sp->regular().row_bytes();
      c.groups[1].rot_offset = sp->regular().dim();
      c.groups[1].sketch_offset = sp->regular().plan().qjl_dim;
      c.groups[1].channels = sp->spec().outlier_channels.data();
      break;
    }
    default:
      return InternalError("attention: unknown KV format " + ToString(f));
  }
  *out = c;
  return Status::Ok();
}

// Floats of the QJL sketches of a query for rotated key format kc (all groups).
size_t SketchFloats(const Comp& kc) {
  size_t n = 0;
  for (int g = 0; g < kc.num_groups; ++g) n += kc.groups[g].plan->qjl_dim;
  return n;
}

// Floats of one row's query-side data for key format kc: the scaled query,
// its rotation, the QJL sketches, the int-asym group sums.
size_t RowPrepFloats(const Comp* kc, size_t d) {
  size_t n = d;
  if (kc == nullptr) return n;
  if (kc->fmt == Fmt::kMse || kc->fmt == Fmt::kProd || kc->fmt == Fmt::kSplit) n += d + SketchFloats(*kc);
  if (kc->fmt == Fmt::kIntAsym) n += d / kc->group_size;
  return n;
}

// Query-side data of one row: slices of one arena a call (a few vectors a
// row had been a malloc and a free each, per row and call).
struct RowPrep {
  float* q = nullptr;
  float* qrot = nullptr;
  float* qsk = nullptr;
  float* qgs = nullptr;
  float koff = 0.0f;
};

// Fills p from the RowPrepFloats(kc, d) floats at buf.
void PrepareRow(const float* q_in, size_t d, float scale, const Comp* kc, float* buf, RowPrep* p,
                std::vector<float>* tmp) {
  p->q = buf;
  buf += d;
  for (size_t j = 0; j < d; ++j) p->q[j] = q_in[j] * scale;
  p->koff = 0.0f;
  if (kc == nullptr) return;
  if (kc->mean) {
    // In double, four independent sums (one chain of dependent adds was
    // half of a short decode call's row preparation).
    double s4[4] = {0, 0, 0, 0};
    size_t j = 0;
    for (; j + 4 <= d; j += 4) {
      for (size_t u = 0; u < 4; ++u) s4[u] += static_cast<double>(p->q[j + u]) * kc->mean[j + u];
    }
    for (; j < d; ++j) s4[0] += static_cast<double>(p->q[j]) * kc->mean[j];
    p->koff = static_cast<float>((s4[0] + s4[1]) + (s4[2] + s4[3]));
  }
  if (kc->fmt == Fmt::kMse || kc->fmt == Fmt::kProd || kc->fmt == Fmt::kSplit) {
    p->qrot = buf;
    buf += d;
    std::fill(p->qrot, p->qrot + d, 0.0f);
    const size_t sk = SketchFloats(*kc);
    if (sk > 0) {
      p->qsk = buf;
      buf += sk;
      std::fill(p->qsk, p->qsk + sk, 0.0f);
    }
    for (int g = 0; g < kc->num_groups; ++g) {
      const attn::Group& gr = kc->groups[g];
      const CodecPlan& plan = *gr.plan;
      const float* src = p->q;
      if (gr.channels) {
        tmp->resize(plan.dim);
        for (size_t j = 0; j < plan.dim; ++j) (*tmp)[j] = p->q[gr.channels[j]];
        src = tmp->data();
      }
      cpu::PrepareQuery(plan, src, p->qrot + gr.rot_offset, plan.qjl_dim ? p->qsk + gr.sketch_offset : nullptr);
    }
    if (kc->fast_mse) {  // the fast key kernel reads the query permuted (AccumMseFast's layout)
      const CodecPlan& plan = *kc->groups[0].plan;
      tmp->assign(p->qrot, p->qrot + d);
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const BlockPlan& bp = plan.blocks[b];
        const size_t groups = bp.size / 8;
        for (size_t k = 0; k < 8; ++k) {
          for (size_t i = 0; i < groups; ++i) p->qrot[bp.offset + k * groups + i] = (*tmp)[bp.offset + 8 * i + k];
        }
      }
    }
  }
  if (kc->fmt == Fmt::kIntAsym) {
    const size_t gs = kc->group_size;
    p->qgs = buf;
    std::fill(p->qgs, p->qgs + d / gs, 0.0f);
    for (size_t j = 0; j < d; ++j) p->qgs[j / gs] += p->q[j];
  }
}

// Adds the rotated value sum of a row, rotated back, into out. accr is the
// caller's scratch: the inverse rotation clobbers it; tmp and natural_buf
// are the caller's buffers (kept across rows: no allocation a row).
void FinishRotated(const Comp& vc, float* accr, float* out, std::vector<float>* tmp,
                   std::vector<float>* natural_buf) {
  std::vector<float>& natural = *natural_buf;
  if (vc.fast_mse) {  // undo the kernel's permutation (src/cpu/attention-inl.h, AccumMseFast)
    const CodecPlan& plan = *vc.groups[0].plan;
    natural.resize(plan.dim);
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      const BlockPlan& bp = plan.blocks[b];
      const size_t groups = bp.size / 8;
      for (size_t k = 0; k < 8; ++k) {
        for (size_t i = 0; i < groups; ++i) natural[bp.offset + 8 * i + k] = accr[bp.offset + k * groups + i];
      }
    }
    accr = natural.data();
  }
  for (int g = 0; g < vc.num_groups; ++g) {
    const attn::Group& gr = vc.groups[g];
    const CodecPlan& plan = *gr.plan;
    tmp->resize(plan.dim);
    cpu::RotateInverse(plan, accr + gr.rot_offset, tmp->data());
    if (gr.channels) {
      for (size_t j = 0; j < plan.dim; ++j) out[gr.channels[j]] += (*tmp)[j];
    } else {
      for (size_t j = 0; j < plan.dim; ++j) out[j] += (*tmp)[j];
    }
  }
}

// The whole problem: B sequences x H KV heads, G query heads per KV head,
// nq queries per sequence at positions qpos0[b] + i.
struct Problem {
  size_t batch = 0, num_kv_heads = 0, group = 0, head_dim = 0, nq = 1;
  Fmt dense_fmt = Fmt::kF16;
  std::vector<HeadWork> heads;  // [b * H + h]
  std::vector<size_t> qpos0;    // [b]
  const float* q = nullptr;     // [b][nq][Hq][d]
  float* out = nullptr;
};

// The shape part of a problem; callers add heads, positions and pointers.
Problem MakeProblem(size_t batch, size_t num_kv_heads, size_t num_q_heads, size_t head_dim,
                    size_t nq, Fmt dense_fmt) {
  Problem pb;
  pb.batch = batch;
  pb.num_kv_heads = num_kv_heads;
  pb.group = num_q_heads / num_kv_heads;
  pb.head_dim = head_dim;
  pb.nq = nq;
  pb.dense_fmt = dense_fmt;
  pb.heads.resize(batch * num_kv_heads);
  return pb;
}

Status Run(const Problem& pb, const AttentionOptions& opt, AttentionReport* report) {
  const size_t B = pb.batch, H = pb.num_kv_heads, G = pb.group, d = pb.head_dim, nq = pb.nq;
  const size_t Hq = H * G;
  if (!(opt.scale >= 0.0f) || !std::isfinite(opt.scale)) {
    return InvalidArgumentError("attention: scale must be finite and >= 0 (0 = 1/sqrt(head_dim)), got " +
                                std::to_string(opt.scale));
  }
  if (!(opt.softcap >= 0.0f) || !std::isfinite(opt.softcap)) {
    return InvalidArgumentError("attention: softcap must be finite and >= 0 (0 = off), got " +
                                std::to_string(opt.softcap));
  }
  if (!(opt.sparse_v_threshold >= 0.0f) || !(opt.sparse_v_threshold < 1.0f)) {
    return InvalidArgumentError("attention: sparse_v_threshold must be in [0, 1), got " +
                                std::to_string(opt.sparse_v_threshold));
  }
  const float scale = opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(d));
  const size_t threads = opt.threads == 0 ? HardwareThreads() : opt.threads;

  // Work items.
  struct Item {
    size_t b, h, q0, nqt, t0, t1, chunk;
  };
  const size_t q_tile = std::max<size_t>(1, kMaxRowsPerItem / G);
  std::vector<Item> items;
  std::vector<size_t> first_item(B * H * ((nq + q_tile - 1) / q_tile) + 1, 0);
  std::vector<size_t> nchunks_of;  // per (b, h, query tile)
  for (size_t b = 0; b < B; ++b) {
    for (size_t h = 0; h < H; ++h) {
      const HeadWork& hw = pb.heads[b * H + h];
      for (size_t q0 = 0; q0 < nq; q0 += q_tile) {
        const size_t nqt = std::min(q_tile, nq - q0);
        const size_t hi = pb.qpos0[b] + q0 + nqt;  // keys beyond the last query are never visible
        size_t lo = 0;
        if (opt.window > 0 && pb.qpos0[b] + q0 + 1 > opt.window) lo = pb.qpos0[b] + q0 + 1 - opt.window;
        const size_t span = hi - lo;
        size_t chunk = opt.split_tokens;
        if (chunk == 0) {
          const size_t base = B * H * ((nq + q_tile - 1) / q_tile);
          const size_t want = base >= 2 * threads ? 1 : (2 * threads + base - 1) / base;
          chunk = std::max<size_t>(256, (span + want - 1) / want);
        }
        const size_t nc = std::max<size_t>(1, (span + chunk - 1) / chunk);
        nchunks_of.push_back(nc);
        for (size_t c = 0; c < nc; ++c) {
          const size_t t0 = lo + c * chunk;
          const size_t t1 = std::min(hi, t0 + chunk);
          items.push_back({b, h, q0, nqt, t0, t1, c});
        }
        (void)hw;
      }
    }
  }

  // Row states: one per (item, query, query head in group).
  std::vector<size_t> row_base(items.size() + 1, 0);
  for (size_t i = 0; i < items.size(); ++i) row_base[i + 1] = row_base[i] + items[i].nqt * G;
  const size_t total_rows = row_base.back();
  std::vector<Row> rows(total_rows);
  // The rows' accumulators and query-side data live in buffers the calling
  // thread keeps between calls: allocated fresh, a megabyte-sized buffer
  // (batch 32: 1,024 rows) came from new pages every call, and their page
  // faults had cost batch-32 decode at 512 tokens about a sixth of its time.
  thread_local std::vector<float> tl_accs, tl_prep;
  if (tl_accs.size() < total_rows * 2 * d) tl_accs.resize(total_rows * 2 * d);
  float* const accs = tl_accs.data();
  std::fill(accs, accs + total_rows * 2 * d, 0.0f);
  std::vector<RowPrep> preps(total_rows);
  // One arena for every row's query-side data (rows of a head share a size).
  size_t prep_stride = d;
  for (const HeadWork& hw : pb.heads) prep_stride = std::max(prep_stride, RowPrepFloats(hw.kc, d));
  if (tl_prep.size() < total_rows * prep_stride) tl_prep.resize(total_rows * prep_stride);
  float* const prep_arena = tl_prep.data();  // PrepareRow writes what it reads
  std::vector<uint8_t> status_bad(1, 0);

  auto prep_item = [&](size_t i) {
    const Item& it = items[i];
    const HeadWork& hw = pb.heads[it.b * H + it.h];
    std::vector<float> tmp;
    for (size_t qi = 0; qi < it.nqt; ++qi) {
      const size_t qidx = it.q0 + qi;
      const size_t pos = pb.qpos0[it.b] + qidx;
      for (size_t g = 0; g < G; ++g) {
        const size_t r = row_base[i] + qi * G + g;
        const size_t hq = it.h * G + g;
        RowPrep& p = preps[r];
        // Rows of later chunks reuse the first chunk's preparation.
        if (it.chunk == 0) {
          PrepareRow(pb.q + ((it.b * nq + qidx) * Hq + hq) * d, d, scale, hw.kc,
                     prep_arena + r * prep_stride, &p, &tmp);
        }
        Row& row = rows[r];
        row.lo = opt.window > 0 && pos + 1 > opt.window ? pos + 1 - opt.window : 0;
        row.hi = pos + 1;
        row.m = -std::numeric_limits<float>::infinity();
        row.acc = accs + r * 2 * d;
        row.accr = row.acc + d;
      }
    }
  };
  // Prepare first chunks, then point later chunks at them.
  ParallelFor(items.size(), threads, 1, [&](size_t a, size_t e) {
    for (size_t i = a; i < e; ++i) prep_item(i);
  });
  for (size_t i = 0; i < items.size(); ++i) {
    const size_t first = i - items[i].chunk;
    for (size_t k = 0; k < items[i].nqt * G; ++k) {
      const RowPrep& p = preps[row_base[first] + k];
      Row& row = rows[row_base[i] + k];
      row.q = p.q;
      row.qrot = p.qrot;
      row.qsk = p.qsk;
      row.qgs = p.qgs;
      row.koff = p.koff;
    }
  }

  // Items differ in cost (a batch's sequences differ in length): each
  // thread takes the next item, not a fixed contiguous share (a ragged batch
  // of 16K/12K/8K/4K tokens, two threads: 1.2-1.9x faster, dense and
  // compressed alike; docs/BENCHMARKS.md).
  ParallelForDynamic(items.size(), threads, [&](size_t a, size_t e) {
    for (size_t i = a; i < e; ++i) {
      const Item& it = items[i];
      const HeadWork& hw = pb.heads[it.b * H + it.h];
      Task task;
      task.d = d;
      task.dense_fmt = pb.dense_fmt;
      task.kc = hw.kc;
      task.vc = hw.vc;
      task.segs = hw.segs.data();
      task.num_segs = hw.segs.size();
      task.t0 = it.t0;
      task.t1 = it.t1;
      task.rows = rows.data() + row_base[i];
      task.num_rows = it.nqt * G;
      task.softcap = opt.softcap;
      task.sparse_threshold = opt.sparse_v_threshold;
      cpu::AttnRun(task);
    }
  });

  // Merge chunks (log-sum-exp) and finish each row.
  size_t scored = 0, accumulated = 0, skipped = 0;
  bool int_keys = false, int_values = false;
  for (const Row& r : rows) {
    scored += r.scored;
    int_keys |= r.int_keys;
    int_values |= r.int_values;
    accumulated += r.accumulated;
    skipped += r.skipped;
  }
  std::vector<size_t> group_starts;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].chunk == 0) group_starts.push_back(i);
  }
  ParallelFor(group_starts.size(), threads, 1, [&](size_t a, size_t e) {
    std::vector<float> tmp, natural, acc(d), accr(d);
    for (size_t gi = a; gi < e; ++gi) {
      const size_t i0 = group_starts[gi];
      const Item& it = items[i0];
      size_t nc = 1;
      while (i0 + nc < items.size() && items[i0 + nc].chunk == nc &&
             items[i0 + nc].b == it.b && items[i0 + nc].h == it.h && items[i0 + nc].q0 == it.q0) {
        ++nc;
      }
      const HeadWork& hw = pb.heads[it.b * H + it.h];
      for (size_t k = 0; k < it.nqt * G; ++k) {
        float M = -std::numeric_limits<float>::infinity();
        for (size_t c = 0; c < nc; ++c) M = std::max(M, rows[row_base[i0 + c] + k].m);
        double l = 0, lc = 0;
        std::fill(acc.begin(), acc.end(), 0.0f);
        std::fill(accr.begin(), accr.end(), 0.0f);
        for (size_t c = 0; c < nc; ++c) {
          const Row& r = rows[row_base[i0 + c] + k];
          if (r.m == -std::numeric_limits<float>::infinity()) continue;
          const float f = std::exp(r.m - M);
          l += static_cast<double>(r.l) * f;
          lc += static_cast<double>(r.lc) * f;
          for (size_t j = 0; j < d; ++j) {
            acc[j] += f * r.acc[j];
            accr[j] += f * r.accr[j];
          }
        }
        const size_t qi = k / G, g = k % G;
        const size_t qidx = it.q0 + qi;
        float* o = pb.out + ((it.b * nq + qidx) * Hq + it.h * G + g) * d;
        for (size_t j = 0; j < d; ++j) o[j] = acc[j];
        if (hw.vc && (hw.vc->fmt == Fmt::kMse || hw.vc->fmt == Fmt::kSplit)) {
          FinishRotated(*hw.vc, accr.data(), o, &tmp, &natural);
        }
        if (hw.vc && hw.vc->mean) {
          for (size_t j = 0; j < d; ++j) o[j] += static_cast<float>(lc) * hw.vc->mean[j];
        }
        const float inv = l > 0 ? static_cast<float>(1.0 / l) : 0.0f;
        for (size_t j = 0; j < d; ++j) o[j] *= inv;
      }
    }
  });

  if (report) {
    report->scored = scored;
    report->values_accumulated = accumulated;
    report->values_skipped = skipped;
    // Row states and accumulators, plus each worker's scratch: logits of a
    // tile for its rows and the fp32 key/value tiles of prefill (64 tokens).
    // The integer kernels add per row an int16 query and value sums in their
    // lane order: at most 768 bytes per 64 coordinates (AVX-512).
    report->workspace_bytes =
        total_rows * (2 * d * sizeof(float) + sizeof(Row) + sizeof(RowPrep) + prep_stride * sizeof(float) +
                      768 * ((d + 63) / 64) + 2 * sizeof(float)) +
        std::min(threads, items.size()) * (kMaxRowsPerItem * 64 + 2 * 64 * d) * sizeof(float);
    const cpu::AttnKernelInfo kernels = cpu::AttnKernels();
    report->simd_target = kernels.target;
    report->kernel_set = kernels.set;
    report->keys = int_keys ? AttnArithmetic::kInt16 : AttnArithmetic::kFloat;
    report->values = int_values ? AttnArithmetic::kInt16 : AttnArithmetic::kFloat;
  }
  // Bounded retention: a call larger than this (a long prefill chunk) gives
  // its buffers back rather than holding them for the thread's lifetime.
  constexpr size_t kKeepFloats = size_t{4} << 20;  // 16 MB each
  for (std::vector<float>* v : {&tl_accs, &tl_prep}) {
    if (v->size() > kKeepFloats) {
      v->clear();
      v->shrink_to_fit();
    }
  }
  return Status::Ok();
}

Status CheckQ(std::span<const float> q, std::span<float> out, size_t rows, size_t hq, size_t d,
              const char* what) {
  const size_t need = rows * hq * d;
  if (q.size() != need) {
    return InvalidArgumentError(std::string(what) + ": q has " + Str(q.size()) + " floats, expected " +
                                Str(rows) + " x " + Str(hq) + " heads x " + Str(d) + " = " + Str(need));
  }
  if (out.size() != need) {
    return InvalidArgumentError(std::string(what) + ": out has " + Str(out.size()) +
                                " floats, expected " + Str(need));
  }
  // A non-finite float has every exponent bit set: one branch-free pass
  // (the compiler vectorizes it; a branch per element cost 3% of a 128-token
  // decode), then the index for the message only when one is found.
  uint32_t bad = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &q[i], 4);
    bad |= static_cast<uint32_t>((bits & 0x7F800000u) == 0x7F800000u);
  }
  if (bad != 0) {
    for (size_t i = 0; i < q.size(); ++i) {
      if (!std::isfinite(q[i])) {
        return InvalidArgumentError(std::string(what) + ": q is not finite at index " + Str(i));
      }
    }
  }
  return Status::Ok();
}

// Number of prefill queries in q ([n][num_q_heads][head_dim]) after checking
// that they fit the `tokens` already stored (what names the caller, holder
// the storage in the message).
Result<size_t> PrefillQueries(std::span<const float> q, std::span<float> out, size_t num_q_heads,
                              size_t d, size_t query_start, size_t tokens, const char* what,
                              const std::string& holder, const std::string& hint) {
  const size_t per_query = num_q_heads * d;
  if (q.empty() || q.size() % per_query != 0) {
    return InvalidArgumentError(std::string(what) + ": q has " + Str(q.size()) +
                                " floats, not a positive multiple of num_q_heads x head_dim = " +
                                Str(per_query));
  }
  const size_t n = q.size() / per_query;
  // Written as two comparisons so that a query_start near 2^64 cannot wrap
  // query_start + n around to a small number.
  if (query_start > tokens || n > tokens - query_start) {
    return OutOfRangeError(std::string(what) + ": " + Str(n) + " queries from position " + Str(query_start) +
                           " (query_start) but " + holder + " " + Str(tokens) + " tokens; query_start + " +
                           "queries must be at most " + Str(tokens) + hint);
  }
  TQ_RETURN_IF_ERROR(CheckQ(q, out, n, num_q_heads, d, what));
  return n;
}

Status CheckHeads(size_t num_q_heads, size_t num_kv_heads, const char* what) {
  if (num_kv_heads == 0) return InvalidArgumentError(std::string(what) + ": no KV heads");
  if (num_q_heads / num_kv_heads > 256) {
    return InvalidArgumentError(std::string(what) + ": " + Str(num_q_heads / num_kv_heads) +
                                " query heads per KV head; at most 256 are supported");
  }
  if (num_q_heads == 0 || num_q_heads % num_kv_heads != 0) {
    return InvalidArgumentError(std::string(what) + ": num_q_heads " + Str(num_q_heads) +
                                " must be a positive multiple of the " + Str(num_kv_heads) +
                                " KV heads (GQA)");
  }
  return Status::Ok();
}

// Segments of one KVCache head.
void KVHeadSegments(const KVLayerView& view, size_t h, const Comp* kc, const Comp* vc,
                    HeadWork* hw) {
  const KVHeadView& hv = view.heads[h];
  const size_t d = view.head_dim;
  size_t pos = 0;
  hw->segs.reserve(4);  // sinks, history, the recent ring's two parts
  auto dense = [&](const uint16_t* k, const uint16_t* v, size_t n) {
    if (n == 0) return;
    Seg s;
    s.pos0 = pos;
    s.count = n;
    s.compressed = false;
    s.k = reinterpret_cast<const uint8_t*>(k);
    s.v = reinterpret_cast<const uint8_t*>(v);
    s.k_stride = s.v_stride = 2 * d;
    PushSeg(hw, s);
    pos += n;
  };
  dense(hv.sink_k, hv.sink_v, hv.num_sinks);
  if (hv.num_compressed > 0) {
    Seg s;
    s.pos0 = pos;
    s.count = hv.num_compressed;
    s.compressed = true;
    const size_t krb = kc->payload_bytes + kc->meta_bytes;
    const size_t vrb = vc->payload_bytes + vc->meta_bytes;
    s.k = hv.k_codes;
    s.k_stride = krb;
    s.km = hv.k_codes + kc->payload_bytes;
    s.km_stride = krb;
    s.v = hv.v_codes;
    s.v_stride = vrb;
    s.vm = hv.v_codes + vc->payload_bytes;
    s.vm_stride = vrb;
    PushSeg(hw, s);
    pos += hv.num_compressed;
  }
  dense(hv.recent_k[0], hv.recent_v[0], hv.recent_count[0]);
  dense(hv.recent_k[1], hv.recent_v[1], hv.recent_count[1]);
  hw->length = pos;
}

Status BuildKVHeads(const KVLayerView& view, size_t b, std::vector<std::unique_ptr<Comp>>* comps,
                    Problem* pb) {
  const size_t H = view.heads.size();
  for (size_t h = 0; h < H; ++h) {
    auto kc = std::make_unique<Comp>();
    auto vc = std::make_unique<Comp>();
    TQ_RETURN_IF_ERROR(BuildComp(view.key_codecs[h], view.heads[h].k_mean, false, kc.get()));
    TQ_RETURN_IF_ERROR(BuildComp(view.value_codecs[h], view.heads[h].v_mean, true, vc.get()));
    HeadWork& hw = pb->heads[b * H + h];
    hw.kc = kc.get();
    hw.vc = vc.get();
    KVHeadSegments(view, h, kc.get(), vc.get(), &hw);
    comps->push_back(std::move(kc));
    comps->push_back(std::move(vc));
  }
  return Status::Ok();
}

// Runs pb (heads and positions built) on the queries q, results into out.
Status Run(std::span<const float> q, std::span<float> out, const AttentionOptions& opt,
           AttentionReport* report, Problem* pb) {
  pb->q = q.data();
  pb->out = out.data();
  return Run(*pb, opt, report);
}

Fmt DenseFmtOf(Half16 h) { return h == Half16::kF16 ? Fmt::kF16 : Fmt::kBF16; }

}  // namespace

const char* AttnKernelSetName(AttnKernelSet set) {
  switch (set) {
    case AttnKernelSet::kScalar: return "scalar";
    case AttnKernelSet::kPortable: return "portable";
    case AttnKernelSet::kAvx2: return "AVX2";
    case AttnKernelSet::kAvx2AvxVnni: return "AVX2+AVX-VNNI";
    case AttnKernelSet::kAvx512Vnni: return "AVX-512 VNNI";
  }
  return "unknown";
}

const char* AttnArithmeticName(AttnArithmetic arithmetic) {
  return arithmetic == AttnArithmetic::kInt16 ? "int16" : "fp32";
}

std::string AttnKernelName(const AttentionReport& report) {
  std::string name = report.simd_target;
  if (report.kernel_set == AttnKernelSet::kAvx2AvxVnni) name += "+AVX-VNNI";
  const bool keys = report.keys == AttnArithmetic::kInt16, values = report.values == AttnArithmetic::kInt16;
  if (keys || values) name += keys && values ? " int16 keys+values" : keys ? " int16 keys" : " int16 values";
  return name;
}

Status DecodeAttention(std::span<const KVLayerView> views, size_t num_q_heads,
                       std::span<const float> q, std::span<float> out,
                       const AttentionOptions& options, AttentionReport* report) {
  if (views.empty()) return InvalidArgumentError("DecodeAttention: no sequences (views is empty)");
  const size_t H = views[0].heads.size();
  const size_t d = views[0].head_dim;
  TQ_RETURN_IF_ERROR(CheckHeads(num_q_heads, H, "DecodeAttention"));
  if (d == 0) return InvalidArgumentError("DecodeAttention: head_dim is 0");
  for (size_t b = 0; b < views.size(); ++b) {
    const KVLayerView& v = views[b];
    if (v.heads.size() != H || v.head_dim != d) {
      return InvalidArgumentError("DecodeAttention: view " + Str(b) + " has " + Str(v.heads.size()) +
                                  " KV heads of dim " + Str(v.head_dim) + ", view 0 has " + Str(H) +
                                  " of dim " + Str(d));
    }
    if (v.key_codecs.size() != H || v.value_codecs.size() != H) {
      return InvalidArgumentError("DecodeAttention: view " + Str(b) + " lacks codecs for its heads");
    }
    if (v.length() == 0) {
      return InvalidArgumentError("DecodeAttention: sequence " + Str(b) +
                                  " is empty (append the query's own key and value first)");
    }
    for (size_t h = 0; h < H; ++h) {
      if (v.heads[h].length() != v.length()) {
        return InvalidArgumentError("DecodeAttention: view " + Str(b) + " heads have different lengths");
      }
    }
    if (v.dense_type != views[0].dense_type) {
      return InvalidArgumentError("DecodeAttention: views differ in dense type");
    }
  }
  TQ_RETURN_IF_ERROR(CheckQ(q, out, views.size(), num_q_heads, d, "DecodeAttention"));
  Problem pb = MakeProblem(views.size(), H, num_q_heads, d, 1, DenseFmtOf(views[0].dense_type));
  std::vector<std::unique_ptr<Comp>> comps;
  comps.reserve(2 * H * views.size());
  for (size_t b = 0; b < views.size(); ++b) {
    TQ_RETURN_IF_ERROR(BuildKVHeads(views[b], b, &comps, &pb));
    pb.qpos0.push_back(views[b].length() - 1);
  }
  return Run(q, out, options, report, &pb);
}

Status PrefillAttention(const KVLayerView& view, size_t num_q_heads, size_t query_start,
                        std::span<const float> q, std::span<float> out,
                        const AttentionOptions& options, AttentionReport* report) {
  const size_t H = view.heads.size();
  const size_t d = view.head_dim;
  TQ_RETURN_IF_ERROR(CheckHeads(num_q_heads, H, "PrefillAttention"));
  if (d == 0) return InvalidArgumentError("PrefillAttention: head_dim is 0");
  if (view.key_codecs.size() != H || view.value_codecs.size() != H) {
    return InvalidArgumentError("PrefillAttention: view lacks codecs for its heads");
  }
  TQ_ASSIGN_OR_RETURN(const size_t n,
                      PrefillQueries(q, out, num_q_heads, d, query_start, view.length(),
                                     "PrefillAttention", "the cache holds",
                                     " (append the chunk's keys and values first)"));
  Problem pb = MakeProblem(1, H, num_q_heads, d, n, DenseFmtOf(view.dense_type));
  std::vector<std::unique_ptr<Comp>> comps;
  TQ_RETURN_IF_ERROR(BuildKVHeads(view, 0, &comps, &pb));
  pb.qpos0.push_back(query_start);
  return Run(q, out, options, report, &pb);
}

Status PagedDecodeAttention(const PagedLayerView& view, size_t num_q_heads,
                            std::span<const int32_t> block_tables, size_t max_blocks_per_seq,
                            std::span<const int32_t> seq_lens, std::span<const float> q,
                            std::span<float> out, const AttentionOptions& options,
                            AttentionReport* report) {
  const size_t H = view.num_kv_heads, d = view.head_dim, bs = view.block_size;
  TQ_RETURN_IF_ERROR(CheckHeads(num_q_heads, H, "PagedDecodeAttention"));
  if (d == 0 || bs == 0) return InvalidArgumentError("PagedDecodeAttention: empty page geometry");
  const size_t B = seq_lens.size();
  if (B == 0) return InvalidArgumentError("PagedDecodeAttention: no sequences (seq_lens is empty)");
  if (max_blocks_per_seq == 0 || block_tables.size() != B * max_blocks_per_seq) {
    return InvalidArgumentError("PagedDecodeAttention: block_tables has " + Str(block_tables.size()) +
                                " entries, expected batch " + Str(B) + " x max_blocks_per_seq " +
                                Str(max_blocks_per_seq));
  }
  if (view.k.codecs.size() != H || view.v.codecs.size() != H) {
    return InvalidArgumentError("PagedDecodeAttention: view lacks codecs for its heads");
  }
  // The pool size is not in the view; the largest page id any row of the
  // planes can address is bounded by the caller's cache. Page ids must be >= 0.
  TQ_RETURN_IF_ERROR(CheckQ(q, out, B, num_q_heads, d, "PagedDecodeAttention"));
  Problem pb = MakeProblem(B, H, num_q_heads, d, 1, Fmt::kF16);
  std::vector<std::unique_ptr<Comp>> comps;
  std::vector<const Comp*> kcs(H), vcs(H);
  for (size_t h = 0; h < H; ++h) {
    auto kc = std::make_unique<Comp>();
    auto vc = std::make_unique<Comp>();
    TQ_RETURN_IF_ERROR(BuildComp(view.k.codecs[h], view.k.mean ? view.k.mean + h * d : nullptr, false, kc.get()));
    TQ_RETURN_IF_ERROR(BuildComp(view.v.codecs[h], view.v.mean ? view.v.mean + h * d : nullptr, true, vc.get()));
    kcs[h] = kc.get();
    vcs[h] = vc.get();
    comps.push_back(std::move(kc));
    comps.push_back(std::move(vc));
  }
  for (size_t b = 0; b < B; ++b) {
    const int32_t len = seq_lens[b];
    if (len <= 0) {
      return InvalidArgumentError("PagedDecodeAttention: sequence " + Str(b) + " has length " +
                                  std::to_string(len) + " (must be >= 1)");
    }
    const size_t pages = (static_cast<size_t>(len) + bs - 1) / bs;
    if (pages > max_blocks_per_seq) {
      return OutOfRangeError("PagedDecodeAttention: sequence " + Str(b) + " of " + std::to_string(len) +
                             " tokens needs " + Str(pages) + " pages, its block table row holds " +
                             Str(max_blocks_per_seq));
    }
    for (size_t p = 0; p < pages; ++p) {
      const int32_t page = block_tables[b * max_blocks_per_seq + p];
      if (page < 0 || (view.num_blocks > 0 && static_cast<size_t>(page) >= view.num_blocks)) {
        return OutOfRangeError("PagedDecodeAttention: sequence " + Str(b) + " block " + Str(p) +
                               " is page " + std::to_string(page) + ", pages are 0.." +
                               Str(view.num_blocks - 1));
      }
    }
    for (size_t h = 0; h < H; ++h) {
      HeadWork& hw = pb.heads[b * H + h];
      hw.kc = kcs[h];
      hw.vc = vcs[h];
      hw.segs.reserve(pages);  // a segment a page: no regrowth (2,048 a head at 32K, 16-token pages)
      for (size_t p = 0; p < pages; ++p) {
        const size_t page = static_cast<size_t>(block_tables[b * max_blocks_per_seq + p]);
        const size_t row0 = (page * H + h) * bs;
        Seg s;
        s.pos0 = p * bs;
        s.count = std::min(bs, static_cast<size_t>(len) - p * bs);
        s.compressed = true;
        s.k = view.k.codes + row0 * view.k.payload_stride;
        s.k_stride = view.k.payload_stride;
        s.km = view.k.meta ? view.k.meta + row0 * view.k.meta_bytes : nullptr;
        s.km_stride = view.k.meta_bytes;
        s.v = view.v.codes + row0 * view.v.payload_stride;
        s.v_stride = view.v.payload_stride;
        s.vm = view.v.meta ? view.v.meta + row0 * view.v.meta_bytes : nullptr;
        s.vm_stride = view.v.meta_bytes;
        PushSeg(&hw, s);
      }
      hw.length = static_cast<size_t>(len);
    }
    pb.qpos0.push_back(static_cast<size_t>(len) - 1);
  }
  return Run(q, out, options, report, &pb);
}

namespace {

Status BuildDense(const DenseKVView& kv, size_t b, Problem* pb, const char* what) {
  if (kv.k == nullptr || kv.v == nullptr) {
    return InvalidArgumentError(std::string(what) + ": sequence " + Str(b) + " has null K or V");
  }
  if (kv.tokens == 0) return InvalidArgumentError(std::string(what) + ": sequence " + Str(b) + " is empty");
  if ((kv.token_stride != 0 && kv.token_stride < kv.head_dim) || (kv.head_stride != 0 && kv.head_stride < kv.head_dim)) {
    return InvalidArgumentError(std::string(what) + ": sequence " + Str(b) + " strides (token " +
                                Str(kv.token_stride) + ", head " + Str(kv.head_stride) +
                                ") are smaller than head_dim " + Str(kv.head_dim));
  }
  const size_t H = kv.num_kv_heads, d = kv.head_dim;
  const size_t elem = kv.dtype == DType::kF32 ? 4 : 2;
  for (size_t h = 0; h < H; ++h) {
    HeadWork& hw = pb->heads[b * H + h];
    Seg s;
    s.pos0 = 0;
    s.count = kv.tokens;
    const size_t ts = kv.token_stride ? kv.token_stride : H * d;
    const size_t hs = kv.head_stride ? kv.head_stride : d;
    s.k = static_cast<const uint8_t*>(kv.k) + h * hs * elem;
    s.v = static_cast<const uint8_t*>(kv.v) + h * hs * elem;
    s.k_stride = s.v_stride = ts * elem;
    PushSeg(&hw, s);
    hw.length = kv.tokens;
  }
  return Status::Ok();
}

Fmt DenseFmt(DType t) {
  switch (t) {
    case DType::kF32: return Fmt::kF32;
    case DType::kBF16: return Fmt::kBF16;
    default: return Fmt::kF16;
  }
}

}  // namespace

Status DenseDecodeAttention(std::span<const DenseKVView> seqs, size_t num_q_heads,
                            std::span<const float> q, std::span<float> out,
                            const AttentionOptions& options, AttentionReport* report) {
  if (seqs.empty()) return InvalidArgumentError("DenseDecodeAttention: no sequences");
  const size_t H = seqs[0].num_kv_heads, d = seqs[0].head_dim;
  TQ_RETURN_IF_ERROR(CheckHeads(num_q_heads, H, "DenseDecodeAttention"));
  if (d == 0) return InvalidArgumentError("DenseDecodeAttention: head_dim is 0");
  for (size_t b = 0; b < seqs.size(); ++b) {
    if (seqs[b].num_kv_heads != H || seqs[b].head_dim != d || seqs[b].dtype != seqs[0].dtype) {
      return InvalidArgumentError("DenseDecodeAttention: sequence " + Str(b) +
                                  " differs from sequence 0 in KV heads, head_dim or dtype");
    }
  }
  TQ_RETURN_IF_ERROR(CheckQ(q, out, seqs.size(), num_q_heads, d, "DenseDecodeAttention"));
  Problem pb = MakeProblem(seqs.size(), H, num_q_heads, d, 1, DenseFmt(seqs[0].dtype));
  for (size_t b = 0; b < seqs.size(); ++b) {
    TQ_RETURN_IF_ERROR(BuildDense(seqs[b], b, &pb, "DenseDecodeAttention"));
    pb.qpos0.push_back(seqs[b].tokens - 1);
  }
  return Run(q, out, options, report, &pb);
}

Status DensePrefillAttention(const DenseKVView& kv, size_t num_q_heads, size_t query_start,
                             std::span<const float> q, std::span<float> out,
                             const AttentionOptions& options, AttentionReport* report) {
  const size_t H = kv.num_kv_heads, d = kv.head_dim;
  TQ_RETURN_IF_ERROR(CheckHeads(num_q_heads, H, "DensePrefillAttention"));
  if (d == 0) return InvalidArgumentError("DensePrefillAttention: head_dim is 0");
  TQ_ASSIGN_OR_RETURN(const size_t n, PrefillQueries(q, out, num_q_heads, d, query_start, kv.tokens,
                                                     "DensePrefillAttention", "K/V hold", ""));
  Problem pb = MakeProblem(1, H, num_q_heads, d, n, DenseFmt(kv.dtype));
  TQ_RETURN_IF_ERROR(BuildDense(kv, 0, &pb, "DensePrefillAttention"));
  pb.qpos0.push_back(query_start);
  return Run(q, out, options, report, &pb);
}

}  // namespace tq

namespace tq::cpu {

HWY_EXPORT(AttnRunImpl);
HWY_EXPORT(AttnKernelInfoImpl);

void AttnRun(const attn::Task& task) { HWY_DYNAMIC_DISPATCH(AttnRunImpl)(task); }

AttnKernelInfo AttnKernels() { return HWY_DYNAMIC_DISPATCH(AttnKernelInfoImpl)(); }

}  // namespace tq::cpu

#endif  // HWY_ONCE
