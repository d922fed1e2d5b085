// Brute-force exact search (ground truth) and the recall measures.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <string>

#include "core/thread_pool.h"
#include "index/engine.h"
#include "tq/index.h"

namespace tq {

using index_internal::Cand;
using index_internal::TopK;

Result<SearchResult> ExactSearch(std::span<const float> base, std::span<const float> queries,
                                 size_t dim, size_t k, Metric metric, size_t threads) {
  if (dim == 0 || base.size() % dim != 0 || queries.size() % dim != 0) {
    return InvalidArgumentError("ExactSearch: base (" + std::to_string(base.size()) +
                                " floats) and queries (" + std::to_string(queries.size()) +
                                ") must be whole rows of dim " + std::to_string(dim));
  }
  if (k == 0) return InvalidArgumentError("ExactSearch: k must be >= 1");
  if (metric != Metric::kInnerProduct && metric != Metric::kCosine && metric != Metric::kL2) {
    return InvalidArgumentError("ExactSearch: unknown metric; accepted: ip, cosine, l2");
  }
  const size_t n = base.size() / dim, nq = queries.size() / dim;
  using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  // Cosine: normalized copies (zero rows stay zero).
  std::vector<float> bn, qn;
  auto normalized = [&](std::span<const float> x, std::vector<float>* out) {
    out->assign(x.begin(), x.end());
    for (size_t r = 0; r < out->size() / dim; ++r) {
      double ss = 0;
      for (size_t j = 0; j < dim; ++j) ss += static_cast<double>((*out)[r * dim + j]) * (*out)[r * dim + j];
      const double inv = ss > 0 ? 1.0 / std::sqrt(ss) : 0.0;
      for (size_t j = 0; j < dim; ++j) (*out)[r * dim + j] = static_cast<float>((*out)[r * dim + j] * inv);
    }
  };
  const float* B = base.data();
  const float* Q = queries.data();
  if (metric == Metric::kCosine) {
    normalized(base, &bn);
    normalized(queries, &qn);
    B = bn.data();
    Q = qn.data();
  }
  std::vector<float> bnorm2(n, 0.0f);
  if (metric == Metric::kL2) {
    for (size_t r = 0; r < n; ++r) {
      double ss = 0;
      for (size_t j = 0; j < dim; ++j) ss += static_cast<double>(B[r * dim + j]) * B[r * dim + j];
      bnorm2[r] = static_cast<float>(ss);
    }
  }
  // Candidates by float GEMM (with a margin for rounding), then exact in double.
  const size_t keep = std::min(n, k + 32);
  constexpr size_t kQBlock = 64, kBBlock = 4096;
  SearchResult res;
  res.queries = nq;
  res.k = k;
  res.ids.assign(nq * k, -1);
  res.scores.assign(nq * k, metric == Metric::kL2 ? INFINITY : -INFINITY);
  const size_t qblocks = (nq + kQBlock - 1) / kQBlock;
  ParallelFor(qblocks, threads, 1, [&](size_t begin, size_t end) {
    Mat s;
    for (size_t qb = begin; qb < end; ++qb) {
      const size_t q0 = qb * kQBlock, qm = std::min(kQBlock, nq - q0);
      Eigen::Map<const Mat> qmat(Q + q0 * dim, static_cast<Eigen::Index>(qm), static_cast<Eigen::Index>(dim));
      std::vector<TopK> heaps(qm, TopK(keep));
      for (size_t b0 = 0; b0 < n; b0 += kBBlock) {
        const size_t bm = std::min(kBBlock, n - b0);
        Eigen::Map<const Mat> bmat(B + b0 * dim, static_cast<Eigen::Index>(bm), static_cast<Eigen::Index>(dim));
        s.noalias() = qmat * bmat.transpose();
        for (size_t i = 0; i < qm; ++i) {
          TopK& h = heaps[i];
          float thr = h.threshold();
          for (size_t r = 0; r < bm; ++r) {
            float v = s(static_cast<Eigen::Index>(i), static_cast<Eigen::Index>(r));
            if (metric == Metric::kL2) v = 2.0f * v - bnorm2[b0 + r];
            if (v > thr || !h.full()) {
              h.Push({v, 0, b0 + r});
              thr = h.threshold();
            }
          }
        }
      }
      for (size_t i = 0; i < qm; ++i) {
        const float* q = Q + (q0 + i) * dim;
        std::vector<std::pair<double, uint64_t>> exact;
        for (const Cand& c : heaps[i].Take()) {
          double acc = 0;
          const float* x = B + c.pos * dim;
          for (size_t j = 0; j < dim; ++j) {
            if (metric == Metric::kL2) {
              const double t = static_cast<double>(q[j]) - x[j];
              acc -= t * t;
            } else {
              acc += static_cast<double>(q[j]) * x[j];
            }
          }
          exact.emplace_back(acc, c.pos);
        }
        std::sort(exact.begin(), exact.end(), [](const auto& a, const auto& b) {
          return a.first != b.first ? a.first > b.first : a.second < b.second;
        });
        for (size_t t = 0; t < k && t < exact.size(); ++t) {
          res.ids[(q0 + i) * k + t] = static_cast<int64_t>(exact[t].second);
          res.scores[(q0 + i) * k + t] =
              static_cast<float>(metric == Metric::kL2 ? -exact[t].first : exact[t].first);
        }
      }
    }
  });
  return res;
}

double RecallAt1(const SearchResult& result, std::span<const int32_t> gt, size_t gt_dim, size_t k) {
  if (result.queries == 0 || gt_dim == 0) return 0;
  size_t hits = 0;
  const size_t kk = std::min(k, result.k);
  for (size_t q = 0; q < result.queries && (q + 1) * gt_dim <= gt.size(); ++q) {
    const int64_t truth = gt[q * gt_dim];
    for (size_t i = 0; i < kk; ++i) {
      if (result.ids[q * result.k + i] == truth) {
        ++hits;
        break;
      }
    }
  }
  return static_cast<double>(hits) / static_cast<double>(result.queries);
}

double RecallAtK(const SearchResult& result, std::span<const int32_t> gt, size_t gt_dim, size_t k) {
  if (result.queries == 0 || gt_dim == 0 || k == 0) return 0;
  const size_t kk = std::min({k, result.k, gt_dim});
  double total = 0;
  for (size_t q = 0; q < result.queries && (q + 1) * gt_dim <= gt.size(); ++q) {
    size_t hits = 0;
    for (size_t t = 0; t < kk; ++t) {
      const int64_t truth = gt[q * gt_dim + t];
      for (size_t i = 0; i < kk; ++i) {
        if (result.ids[q * result.k + i] == truth) {
          ++hits;
          break;
        }
      }
    }
    total += static_cast<double>(hits) / static_cast<double>(kk);
  }
  return total / static_cast<double>(result.queries);
}

}  // namespace tq
