// Bucketed nearest-centroid search of the write kernel (host and device).
//
// The TurboQuant index of a value u is the number of codebook boundaries
// <= u (docs/FORMAT.md section 5). Instead of a binary search (three or four
// dependent compares and selects a value at 3-4 bits), the kernel maps u to
// a cell of a fine grid,
//
//   cell(u) = bits(fma(sat(fma(u, s, o)), n, 2^23)) - bits(2^23)  in 0..n,
//
// reads the cell's record and makes one compare. cell() is monotone
// non-decreasing in u (each step is a correctly rounded monotone function;
// sat sends NaN to 0), so for u in cell g every boundary whose own cell is
// below g is < u and every boundary whose cell is above g is > u. The grid
// is chosen on the host so that no two boundaries share a cell; then the
// record of cell g holds the count of boundaries in cells below g and the
// one boundary in g (or +inf), and `count + (u >= boundary)` is exactly the
// binary search's answer, ties included. The record also carries the two
// candidate centroids' squares (fp32 products, as the contract's sum of
// squares forms them), so the scale's sum needs no centroid lookup.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace tq::cuda::detail {

// n <= 64: n + 1 records of 16 bytes, which the write kernel keeps 8 times
// in shared memory (8.3 KiB a component at most).
inline constexpr int kMaxBucketCells = 64;

struct BucketRecord {
  float boundary;  // the one boundary in this cell, or +inf
  float sq_lo;     // c[count]^2
  float sq_hi;     // c[count + 1]^2 (= sq_lo without a boundary)
  uint32_t count;  // boundaries in lower cells
};

struct BucketGrid {
  float s = 0, o = 0, n = 0;  // cell(u) as above
  int cells = 0;              // n + 1 records
};

// The host's cell(); the device's is the same three operations as
// intrinsics (write.cu).
inline int BucketCellHost(float u, const BucketGrid& g) {
  float t = std::fma(u, g.s, g.o);
  t = (t > 0.0f) ? (t < 1.0f ? t : 1.0f) : 0.0f;  // sat: NaN and negatives to +0
  const float c = std::fma(t, g.n, 0x1p23f);
  uint32_t b;
  std::memcpy(&b, &c, 4);
  return static_cast<int>(b - 0x4b000000u);
}

// Builds the grid and records for sorted boundaries b[0..nb-1] and centroids
// c[0..nb]: the coarsest grid of 16, 32, ..., kMaxBucketCells cells that
// puts every boundary in a cell of its own (every library codebook of 1-4
// bits needs 16 or 32). Returns false (with `why`) when even the finest
// does not (boundaries closer than about 1/64 of their span, or unsorted).
inline bool BuildBuckets(const float* b, int nb, const float* c, BucketGrid* grid,
                         std::vector<BucketRecord>* records, std::string* why) {
  if (nb < 1) {
    *why = "a codebook needs at least one boundary";
    return false;
  }
  for (int k = 0; k + 1 < nb; ++k) {
    if (!(b[k] < b[k + 1])) {
      *why = "codebook boundaries are not strictly increasing";
      return false;
    }
  }
  const float lo = b[0], hi = b[nb - 1];
  const float span = hi > lo ? hi - lo : 1.0f;
  for (int n = 16; n <= kMaxBucketCells; n *= 2) {
    BucketGrid g;
    g.n = static_cast<float>(n);
    g.cells = n + 1;
    // t = (u - lo + m) / (span + 2m), m = span / n: the boundaries lie in
    // the grid's interior cells.
    const float m = span / static_cast<float>(n);
    g.s = 1.0f / (span + 2.0f * m);
    g.o = (m - lo) * g.s;
    std::vector<int> cell(nb);
    bool distinct = true;
    for (int k = 0; k < nb; ++k) {
      cell[k] = BucketCellHost(b[k], g);
      if (k > 0 && cell[k] <= cell[k - 1]) distinct = false;
    }
    if (!distinct) continue;
    records->assign(static_cast<size_t>(g.cells), BucketRecord{});
    int k = 0;
    for (int i = 0; i < g.cells; ++i) {
      while (k < nb && cell[k] < i) ++k;
      BucketRecord& r = (*records)[static_cast<size_t>(i)];
      r.count = static_cast<uint32_t>(k);
      r.sq_lo = c[k] * c[k];
      if (k < nb && cell[k] == i) {
        r.boundary = b[k];
        r.sq_hi = c[k + 1] * c[k + 1];
      } else {
        r.boundary = INFINITY;
        r.sq_hi = r.sq_lo;
      }
    }
    *grid = g;
    return true;
  }
  *why = "codebook boundaries closer than 1/" + std::to_string(kMaxBucketCells) +
         " of their span; the GPU write kernel's bucket grid cannot separate them";
  return false;
}

}  // namespace tq::cuda::detail
