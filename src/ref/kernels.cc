// Scalar reference kernels: see kernels.h. Plain loops, one element at a time,
// in exactly the order docs/FORMAT.md specifies.
#include "ref/kernels.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "tq/format.h"
#include "tq/rotation.h"

namespace tq::ref {

void PackBits(const uint8_t* values, size_t count, int bits, uint8_t* out) {
  // count 0 writes nothing, and `out` may then be null (an empty vector's data()).
  if (count == 0) return;
  std::memset(out, 0, PackedBytes(count, bits));
  size_t bitpos = 0;
  for (size_t i = 0; i < count; ++i) {
    for (int k = 0; k < bits; ++k, ++bitpos) {
      if ((values[i] >> k) & 1u) out[bitpos >> 3] |= static_cast<uint8_t>(1u << (bitpos & 7));
    }
  }
}

void UnpackBits(const uint8_t* in, size_t count, int bits, uint8_t* values) {
  size_t bitpos = 0;
  for (size_t i = 0; i < count; ++i) {
    unsigned v = 0;
    for (int k = 0; k < bits; ++k, ++bitpos) {
      v |= ((in[bitpos >> 3] >> (bitpos & 7)) & 1u) << k;
    }
    values[i] = static_cast<uint8_t>(v);
  }
}

float SumSquares16(const float* x, size_t n) {
  float acc[16] = {};
  for (size_t i = 0; i < n; ++i) {
    const float sq = x[i] * x[i];
    acc[i % 16] = acc[i % 16] + sq;
  }
  for (size_t width = 8; width >= 1; width /= 2) {
    for (size_t l = 0; l < width; ++l) acc[l] = acc[l] + acc[l + width];
  }
  return acc[0];
}

void Fwht(float* x, size_t n) {
  size_t h0 = 1;
  if (n >= 8) {
    // Stages h = 1, 2, 4 of each block of 8 in registers: the same
    // butterflies on the same operands as the loop below (every output is
    // bit-identical), without three passes over memory. The attention
    // driver rotates every query and output with this (256-token decode:
    // 11% of the time before).
    for (size_t i = 0; i < n; i += 8) {
      float a[8];
      for (size_t k = 0; k < 8; ++k) a[k] = x[i + k];
      for (size_t h = 1; h < 8; h *= 2) {
        for (size_t k = 0; k < 8; ++k) {
          if ((k & h) == 0) {
            const float u = a[k], v = a[k + h];
            a[k] = u + v;
            a[k + h] = u - v;
          }
        }
      }
      for (size_t k = 0; k < 8; ++k) x[i + k] = a[k];
    }
    h0 = 8;
  }
  for (size_t h = h0; h < n; h *= 2) {
    for (size_t i = 0; i < n; i += 2 * h) {
      for (size_t j = i; j < i + h; ++j) {
        const float a = x[j];
        const float b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

void HadamardForward(const float* x, const float* s1, const float* s2, size_t n, float* y) {
  for (size_t i = 0; i < n; ++i) y[i] = x[i] * s1[i];
  Fwht(y, n);
  for (size_t i = 0; i < n; ++i) y[i] = y[i] * s2[i];
  Fwht(y, n);
  const float inv_n = 1.0f / static_cast<float>(n);  // exact: n is a power of two
  for (size_t i = 0; i < n; ++i) y[i] = y[i] * inv_n;
}

void HadamardInverse(const float* y, const float* s1, const float* s2, size_t n, float* x) {
  for (size_t i = 0; i < n; ++i) x[i] = y[i];
  Fwht(x, n);
  for (size_t i = 0; i < n; ++i) x[i] = x[i] * s2[i];
  Fwht(x, n);
  const float inv_n = 1.0f / static_cast<float>(n);
  for (size_t i = 0; i < n; ++i) x[i] = (x[i] * inv_n) * s1[i];
}

void MatTVec(const float* mt, const float* x, size_t rows, size_t cols, float* y) {
  for (size_t j = 0; j < cols; ++j) y[j] = 0.0f;
  for (size_t i = 0; i < rows; ++i) {
    const float xi = x[i];
    const float* row = mt + i * cols;
    for (size_t j = 0; j < cols; ++j) y[j] = y[j] + row[j] * xi;
  }
}

void Rotate(const CodecPlan& plan, const float* x, float* y) {
  if (plan.mix != nullptr) {
    plan.mix->Apply(x, y);
    return;
  }
  if (!plan.hadamard) {
    MatTVec(plan.haar_t, x, plan.dim, plan.dim, y);
    return;
  }
  for (size_t b = 0; b < plan.num_blocks; ++b) {
    const BlockPlan& bp = plan.blocks[b];
    HadamardForward(x + bp.offset, plan.signs1 + bp.offset, plan.signs2 + bp.offset, bp.size,
                    y + bp.offset);
  }
}

void RotateInverse(const CodecPlan& plan, const float* y, float* x) {
  if (plan.mix != nullptr) {
    plan.mix->ApplyInverse(y, x);
    return;
  }
  if (!plan.hadamard) {
    MatTVec(plan.haar, y, plan.dim, plan.dim, x);  // x = Q^T y: rows of Q scaled by y
    return;
  }
  for (size_t b = 0; b < plan.num_blocks; ++b) {
    const BlockPlan& bp = plan.blocks[b];
    HadamardInverse(y + bp.offset, plan.signs1 + bp.offset, plan.signs2 + bp.offset, bp.size,
                    x + bp.offset);
  }
}

namespace {

constexpr double kSqrtHalfPi = 1.2533141373155002512;  // sqrt(pi / 2)

}  // namespace

size_t EncodeRows(const CodecPlan& plan, const float* x, size_t rows, uint8_t* out) {
  const size_t d = plan.dim;
  std::vector<float> y(d), u(d), chat(d), r(d), z(plan.qjl_dim);
  std::vector<uint8_t> idx(d), sgn(plan.qjl_dim);
  size_t first_bad = rows;
  const size_t nlev = size_t{1} << plan.mse_bits;
  for (size_t row = 0; row < rows; ++row) {
    const float* xr = x + row * d;
    uint8_t* o = out + row * plan.row_bytes;
    bool ok = true;
    Rotate(plan, xr, y.data());
    if (plan.mse_bits > 0) {
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const BlockPlan& bp = plan.blocks[b];
        const float* yb = y.data() + bp.offset;
        const float norm = std::sqrt(SumSquares16(yb, bp.size));
        // Norms below FLT_MIN are treated as zero (1/norm would overflow).
        const float inv = norm >= 0x1p-126f ? 1.0f / norm : 0.0f;
        for (size_t j = 0; j < bp.size; ++j) {
          const uint8_t q = QuantizeValue(yb[j] * inv, bp.boundaries, nlev - 1);
          idx[bp.offset + j] = q;
          chat[bp.offset + j] = bp.centroids[q];
        }
        float scale = norm;
        if (plan.norm_correction) {
          scale = norm / std::sqrt(SumSquares16(chat.data() + bp.offset, bp.size));
        }
        uint8_t* sp = o + plan.scale_offset + b * plan.scale_bytes;
        ok = StoreScale(plan, scale, sp) && ok;
        if (plan.qjl_dim > 0) {
          const float s = LoadScale(plan, sp);  // what a decoder will see
          for (size_t j = 0; j < bp.size; ++j) {
            r[bp.offset + j] = yb[j] - s * chat[bp.offset + j];
          }
        }
      }
      PackBits(idx.data(), d, plan.mse_bits, o);
    } else {
      for (size_t j = 0; j < d; ++j) r[j] = y[j];
    }
    if (plan.qjl_dim > 0) {
      const float gamma = std::sqrt(SumSquares16(r.data(), d));
      ok = StoreScale(plan, gamma, o + plan.resid_offset) && ok;
      MatTVec(plan.qjl_t, r.data(), d, plan.qjl_dim, z.data());
      for (size_t k = 0; k < plan.qjl_dim; ++k) sgn[k] = z[k] >= 0.0f ? 1 : 0;
      PackBits(sgn.data(), plan.qjl_dim, 1, o + plan.sign_offset);
    }
    if (!ok && first_bad == rows) first_bad = row;
  }
  return first_bad;
}

void DecodeRows(const CodecPlan& plan, const uint8_t* codes, size_t rows, float* out) {
  const size_t d = plan.dim;
  std::vector<float> yhat(d);
  std::vector<uint8_t> idx(d), sgn(plan.qjl_dim);
  const double qjl_coef = plan.qjl_dim > 0 ? kSqrtHalfPi / static_cast<double>(plan.qjl_dim) : 0;
  for (size_t row = 0; row < rows; ++row) {
    const uint8_t* c = codes + row * plan.row_bytes;
    for (size_t j = 0; j < d; ++j) yhat[j] = 0.0f;
    if (plan.mse_bits > 0) {
      UnpackBits(c, d, plan.mse_bits, idx.data());
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const BlockPlan& bp = plan.blocks[b];
        const float s = LoadScale(plan, c + plan.scale_offset + b * plan.scale_bytes);
        for (size_t j = 0; j < bp.size; ++j) {
          yhat[bp.offset + j] = s * bp.centroids[idx[bp.offset + j]];
        }
      }
    }
    if (plan.qjl_dim > 0) {
      UnpackBits(c + plan.sign_offset, plan.qjl_dim, 1, sgn.data());
      const float g = static_cast<float>(qjl_coef * LoadScale(plan, c + plan.resid_offset));
      // yhat += g * S^T sign: rows of S scaled by ±g.
      for (size_t k = 0; k < plan.qjl_dim; ++k) {
        const float w = sgn[k] ? g : -g;
        const float* srow = plan.qjl + k * d;
        for (size_t j = 0; j < d; ++j) yhat[j] = yhat[j] + srow[j] * w;
      }
    }
    RotateInverse(plan, yhat.data(), out + row * d);
  }
}

void PrepareQuery(const CodecPlan& plan, const float* q, float* q_rot, float* q_sketch) {
  Rotate(plan, q, q_rot);
  if (plan.qjl_dim > 0) MatTVec(plan.qjl_t, q_rot, plan.dim, plan.qjl_dim, q_sketch);
}

void ScoreRows(const CodecPlan& plan, const float* q_rot, const float* q_sketch,
               const uint8_t* codes, size_t rows, float* scores) {
  const size_t d = plan.dim;
  std::vector<uint8_t> idx(d), sgn(plan.qjl_dim);
  const double qjl_coef = plan.qjl_dim > 0 ? kSqrtHalfPi / static_cast<double>(plan.qjl_dim) : 0;
  for (size_t row = 0; row < rows; ++row) {
    const uint8_t* c = codes + row * plan.row_bytes;
    float total = 0.0f;
    if (plan.mse_bits > 0) {
      UnpackBits(c, d, plan.mse_bits, idx.data());
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const BlockPlan& bp = plan.blocks[b];
        float dot = 0.0f;
        for (size_t j = 0; j < bp.size; ++j) {
          dot = dot + q_rot[bp.offset + j] * bp.centroids[idx[bp.offset + j]];
        }
        total = total + LoadScale(plan, c + plan.scale_offset + b * plan.scale_bytes) * dot;
      }
    }
    if (plan.qjl_dim > 0) {
      UnpackBits(c + plan.sign_offset, plan.qjl_dim, 1, sgn.data());
      float dot = 0.0f;
      for (size_t k = 0; k < plan.qjl_dim; ++k) dot = dot + (sgn[k] ? q_sketch[k] : -q_sketch[k]);
      total = total + static_cast<float>(qjl_coef * LoadScale(plan, c + plan.resid_offset)) * dot;
    }
    scores[row] = total;
  }
}

}  // namespace tq::ref
