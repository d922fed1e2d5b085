// Fast-scan layout, lookup tables and the scalar reference scan kernel
// (src/index/fastscan.h states the contract the Highway kernels follow).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "index/fastscan.h"
#include "tq/status.h"

namespace tq::index_internal {

ScanLayout MakeScanLayout(const CodecPlan& plan) {
  TQ_CHECK(plan.mse_bits >= 1 && plan.mse_bits <= 4 && plan.qjl_dim == 0);
  ScanLayout l;
  l.bits = plan.mse_bits;
  l.coords_per_slot = plan.mse_bits == 1 ? 4 : plan.mse_bits == 2 ? 2 : 1;
  l.dim = plan.dim;
  l.num_rblocks = plan.num_blocks;
  const size_t g = static_cast<size_t>(l.coords_per_slot);
  size_t slots = 0;
  for (size_t r = 0; r < plan.num_blocks; ++r) {
    l.coord_begin[r] = plan.blocks[r].offset;
    l.slot_begin[r] = slots;
    slots += (plan.blocks[r].size + g - 1) / g;
  }
  l.coord_begin[plan.num_blocks] = plan.dim;
  l.slot_begin[plan.num_blocks] = slots;
  l.slots = slots;
  l.group_bytes = 16 * slots;
  l.nibble_aligned = plan.mse_bits != 3;
  for (size_t r = 0; r < plan.num_blocks; ++r) {
    l.nibble_aligned = l.nibble_aligned && plan.blocks[r].size % g == 0;
  }
  if (g == 1 && plan.num_blocks == 1) {
    const float* c = plan.blocks[0].centroids;
    const unsigned n = 1u << plan.mse_bits;
    float lo = c[0], hi = c[0];
    for (unsigned v = 1; v < n; ++v) {
      lo = std::min(lo, c[v]);
      hi = std::max(hi, c[v]);
    }
    if (std::isfinite(lo) && std::isfinite(hi) && hi > lo) {
      l.dot_eligible = true;
      l.dot_min = lo;
      l.dot_step = (hi - lo) / 255.0f;
      for (unsigned v = 0; v < n; ++v) {
        const float x = std::floor((c[v] - lo) / l.dot_step + 0.5f);
        l.dot_cb[v] = static_cast<uint8_t>(std::clamp(x, 0.0f, 255.0f));
      }
      l.dot_dims = (plan.dim + 3) / 4 * 4;
    }
  }
  return l;
}

void IndicesToSlots(const ScanLayout& l, const uint8_t* idx, uint8_t* slots) {
  const size_t g = static_cast<size_t>(l.coords_per_slot);
  for (size_t r = 0; r < l.num_rblocks; ++r) {
    for (size_t s = l.slot_begin[r]; s < l.slot_begin[r + 1]; ++s) {
      const size_t j0 = l.coord_begin[r] + (s - l.slot_begin[r]) * g;
      unsigned v = 0;
      for (size_t t = 0; t < g && j0 + t < l.coord_begin[r + 1]; ++t) {
        v |= static_cast<unsigned>(idx[j0 + t]) << (l.bits * static_cast<int>(t));
      }
      slots[s] = static_cast<uint8_t>(v);
    }
  }
}

void SlotsToIndices(const ScanLayout& l, const uint8_t* slots, uint8_t* idx) {
  const size_t g = static_cast<size_t>(l.coords_per_slot);
  const unsigned mask = (1u << l.bits) - 1;
  for (size_t r = 0; r < l.num_rblocks; ++r) {
    for (size_t s = l.slot_begin[r]; s < l.slot_begin[r + 1]; ++s) {
      const size_t j0 = l.coord_begin[r] + (s - l.slot_begin[r]) * g;
      for (size_t t = 0; t < g && j0 + t < l.coord_begin[r + 1]; ++t) {
        idx[j0 + t] = static_cast<uint8_t>((slots[s] >> (l.bits * static_cast<int>(t))) & mask);
      }
    }
  }
}

void BuildTables(const ScanLayout& l, const CodecPlan& plan, const float* q, float* lut_f,
                 uint8_t* lut8, ScanQuery* query) {
  const size_t g = static_cast<size_t>(l.coords_per_slot);
  const unsigned mask = (1u << l.bits) - 1;
  const unsigned values = 1u << (l.bits * static_cast<int>(g));  // 16, or 8 at b = 3
  for (size_t r = 0; r < l.num_rblocks; ++r) {
    const float* c = plan.blocks[r].centroids;
    float max_range = 0.0f;
    float bias = 0.0f;
    for (size_t s = l.slot_begin[r]; s < l.slot_begin[r + 1]; ++s) {
      const size_t j0 = l.coord_begin[r] + (s - l.slot_begin[r]) * g;
      float* t = lut_f + 16 * s;
      float lo = INFINITY, hi = -INFINITY;
      for (unsigned v = 0; v < 16; ++v) {
        float sum = 0.0f;
        if (v < values) {
          for (size_t k = 0; k < g && j0 + k < l.coord_begin[r + 1]; ++k) {
            const float prod = q[j0 + k] * c[(v >> (l.bits * static_cast<int>(k))) & mask];
            sum = sum + prod;
          }
          lo = std::min(lo, sum);
          hi = std::max(hi, sum);
        }
        t[v] = sum;
      }
      max_range = std::max(max_range, hi - lo);
      bias = bias + lo;
      // Keep the minimum in the unused entries' place for the byte pass.
      for (unsigned v = values; v < 16; ++v) t[v] = lo;
    }
    const float a = max_range > 0.0f ? static_cast<float>(kLutMax) / max_range : 1.0f;
    for (size_t s = l.slot_begin[r]; s < l.slot_begin[r + 1]; ++s) {
      float* t = lut_f + 16 * s;
      float lo = t[0];
      for (unsigned v = 1; v < values; ++v) lo = std::min(lo, t[v]);
      for (unsigned v = 0; v < 16; ++v) {
        const float x = std::floor((t[v] - lo) * a + 0.5f);
        lut8[16 * s + v] = v < values ? static_cast<uint8_t>(std::clamp(x, 0.0f, static_cast<float>(kLutMax))) : 0;
        if (v >= values) t[v] = 0.0f;
      }
    }
    query->inv_a[r] = 1.0f / a;
    query->bias[r] = bias;
  }
  query->lut = lut8;
}

void BuildDotQuery(const ScanLayout& l, const float* q, int8_t* q8, ScanQuery* query) {
  TQ_CHECK(l.dot_eligible);
  float m = 0.0f, sum = 0.0f;
  for (size_t j = 0; j < l.dim; ++j) {
    m = std::max(m, std::fabs(q[j]));
    sum = sum + q[j];
  }
  const float a = m > 0.0f ? 127.0f / m : 1.0f;
  for (size_t j = 0; j < l.dot_dims; ++j) {
    const float x = j < l.dim ? std::floor(q[j] * a + 0.5f) : 0.0f;
    q8[j] = static_cast<int8_t>(std::clamp(x, -127.0f, 127.0f));
  }
  query->q8 = q8;
  query->inv_a[0] = l.dot_step / a;
  query->bias[0] = l.dot_min * sum;
}

float ScoreOneFloat(const ScanLayout& l, const float* lut_f, const uint8_t* group, size_t i,
                    const float* group_scales) {
  float score = 0.0f;
  for (size_t r = 0; r < l.num_rblocks; ++r) {
    float dot = 0.0f;
    for (size_t s = l.slot_begin[r]; s < l.slot_begin[r + 1]; ++s) {
      dot = dot + lut_f[16 * s + GroupNibble(group, s, i)];
    }
    if (group_scales != nullptr) dot = dot * group_scales[r * kGroup + i];
    score = score + dot;
  }
  return score;
}

void ComputeGroupBounds(const ScanLayout& l, const float* scales, const float* norms2, size_t g0,
                        size_t g1, float* scale_bounds, float* norm2_min) {
  for (size_t g = g0; g < g1; ++g) {
    for (size_t r = 0; r < l.num_rblocks && scales != nullptr; ++r) {
      const float* sc = scales + (g * l.num_rblocks + r) * kGroup;
      float lo = sc[0], hi = sc[0];
      for (size_t i = 1; i < kGroup; ++i) {
        lo = std::min(lo, sc[i]);
        hi = std::max(hi, sc[i]);
      }
      scale_bounds[(g * l.num_rblocks + r) * 2] = lo;
      scale_bounds[(g * l.num_rblocks + r) * 2 + 1] = hi;
    }
    if (norms2 != nullptr) {
      float lo = norms2[g * kGroup];
      for (size_t i = 1; i < kGroup; ++i) lo = std::min(lo, norms2[g * kGroup + i]);
      norm2_min[g] = lo;
    }
  }
}

namespace ref {

void ScanGroups(const ScanArgs& a, const ScanQuery* queries, size_t nq, float* const* scores) {
  const ScanLayout& l = *a.layout;
  for (size_t grp = 0; grp < a.groups; ++grp) {
    const uint8_t* codes = a.codes + grp * l.group_bytes;
    for (size_t q = 0; q < nq; ++q) {
      const ScanQuery& sq = queries[q];
      uint32_t mask = 0;
      for (size_t i = 0; i < kGroup; ++i) {
        float score = 0.0f;
        for (size_t r = 0; r < l.num_rblocks; ++r) {
          float t;
          if (a.dot) {  // one block, one coordinate a slot
            int32_t acc = 0;
            for (size_t s = 0; s < l.slots; ++s) {
              acc += static_cast<int32_t>(sq.q8[s]) * l.dot_cb[GroupNibble(codes, s, i)];
            }
            t = static_cast<float>(acc) * sq.inv_a[r];
          } else {
            uint32_t acc = 0;
            for (size_t s = l.slot_begin[r]; s < l.slot_begin[r + 1]; ++s) {
              acc += sq.lut[16 * s + GroupNibble(codes, s, i)];
            }
            t = static_cast<float>(acc) * sq.inv_a[r];
          }
          t = t + sq.bias[r];
          if (a.scales != nullptr) t = t * a.scales[(grp * l.num_rblocks + r) * kGroup + i];
          score = score + t;
        }
        if (a.norms2 != nullptr) score = score - a.norms2[grp * kGroup + i];
        scores[q][grp * kGroup + i] = score;
        if (a.thresholds != nullptr && score > a.thresholds[q]) mask |= 1u << i;
      }
      if (a.masks != nullptr) a.masks[q][grp] = mask;
    }
  }
}

}  // namespace ref
}  // namespace tq::index_internal
