#include <cmath>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "tq/distortion.h"

namespace tq {

void SampleUnitVectors(uint64_t key, size_t rows, size_t dim, float* out, size_t threads) {
  ParallelFor(rows, threads, 256, [&](size_t begin, size_t end) {
    std::vector<double> g(dim);
    for (size_t r = begin; r < end; ++r) {
      GaussianStream gs(Absorb(key, r));
      double ss = 0;
      for (size_t j = 0; j < dim; ++j) {
        g[j] = gs.Next();
        ss += g[j] * g[j];
      }
      const double inv = 1.0 / std::sqrt(ss);
      for (size_t j = 0; j < dim; ++j) out[r * dim + j] = static_cast<float>(g[j] * inv);
    }
  });
}

Result<std::vector<DistortionRow>> MeasureDistortion(
    const DistortionOptions& o, const std::function<void(size_t, size_t)>& progress) {
  if (o.samples < 2) {
    return InvalidArgumentError("distortion needs at least 2 samples, got " +
                                std::to_string(o.samples));
  }
  if (o.bits.empty()) return InvalidArgumentError("distortion needs at least one bit width");
  for (int b : o.bits) {
    if (b < 1 || b > 8) {
      return InvalidArgumentError("distortion bits must be in 1..8, got " + std::to_string(b));
    }
  }
  const size_t n = o.samples, d = o.dim;
  if (d == 0 || d > 4096) {
    return InvalidArgumentError("distortion dim must be in 1..4096, got " + std::to_string(d));
  }
  StreamId sid{.seed = o.seed, .layer = 0, .head = 0, .role = Role::kVector, .group = 0};
  std::vector<float> x(n * d), y(n * d), xhat(n * d);
  SampleUnitVectors(DeriveKey(sid, Purpose::kSample), n, d, x.data(), o.threads);
  sid.group = 1;  // an independent stream for the queries
  SampleUnitVectors(DeriveKey(sid, Purpose::kSample), n, d, y.data(), o.threads);
  sid.group = 0;
  std::vector<double> ip(n);
  for (size_t i = 0; i < n; ++i) {
    double s = 0;
    for (size_t j = 0; j < d; ++j) s += static_cast<double>(x[i * d + j]) * y[i * d + j];
    ip[i] = s;
  }
  const BatchOptions batch{.threads = o.threads};
  std::vector<DistortionRow> rows;
  size_t step = 0;
  const size_t steps = o.bits.size();
  for (int b : o.bits) {
    if (progress) progress(step, steps);
    DistortionRow row;
    row.bits = b;
    CodecSpec spec{.dim = d, .bits = b, .kind = CodecKind::kMse, .rotation = o.rotation,
                   .codebook = o.codebook, .scale_dtype = o.scale_dtype,
                   .norm_correction = o.norm_correction, .qjl_dim = 0, .stream = sid};
    TQ_ASSIGN_OR_RETURN(Codec mse, Codec::Create(spec));
    row.mse_row_bytes = mse.row_bytes();
    std::vector<uint8_t> codes(n * mse.row_bytes());
    TQ_RETURN_IF_ERROR(mse.Encode(x, codes, batch));
    TQ_RETURN_IF_ERROR(mse.Decode(codes, xhat, batch));
    double err = 0, sxy = 0, sxx = 0;
    for (size_t i = 0; i < n; ++i) {
      double e = 0, yh = 0;
      for (size_t j = 0; j < d; ++j) {
        const double diff = static_cast<double>(x[i * d + j]) - xhat[i * d + j];
        e += diff * diff;
        yh += static_cast<double>(y[i * d + j]) * xhat[i * d + j];
      }
      err += e;
      sxy += ip[i] * yh;
      sxx += ip[i] * ip[i];
    }
    row.d_mse = err / static_cast<double>(n);
    row.ip_slope_mse = sxy / sxx;
    // Exact codebook distortion: each block of size s holds s/d of a uniform
    // vector's energy on average, and its direction is uniform on S^{s-1}.
    double cb = 0;
    const auto& sizes = mse.rotation().block_sizes();
    for (size_t blk = 0; blk < sizes.size(); ++blk) {
      cb += mse.codebook(blk)->total_mse() * static_cast<double>(sizes[blk]) /
            static_cast<double>(d);
    }
    row.codebook_mse = cb;

    spec.kind = CodecKind::kProd;
    TQ_ASSIGN_OR_RETURN(Codec prod, Codec::Create(spec));
    row.prod_row_bytes = prod.row_bytes();
    std::vector<uint8_t> pcodes(n * prod.row_bytes());
    TQ_RETURN_IF_ERROR(prod.Encode(x, pcodes, batch));
    std::vector<double> est(n);
    ParallelFor(n, o.threads, 512, [&](size_t begin, size_t end) {
      Codec::Query q;
      float score = 0;
      for (size_t i = begin; i < end; ++i) {
        Status st = prod.PrepareQuery(std::span<const float>(y.data() + i * d, d), &q);
        TQ_CHECK(st.ok());
        st = prod.InnerProducts(
            q, std::span<const uint8_t>(pcodes.data() + i * prod.row_bytes(), prod.row_bytes()),
            std::span<float>(&score, 1));
        TQ_CHECK(st.ok());
        est[i] = score;
      }
    });
    double perr = 0, pxy = 0;
    for (size_t i = 0; i < n; ++i) {
      perr += (ip[i] - est[i]) * (ip[i] - est[i]);
      pxy += ip[i] * est[i];
    }
    row.d_prod = perr / static_cast<double>(n);
    row.ip_slope_prod = pxy / sxx;
    const double q = std::pow(4.0, -b);
    row.lower = q;
    row.upper = std::sqrt(3.0) * M_PI / 2.0 * q;
    row.prod_lower = q / static_cast<double>(d);
    row.prod_upper = std::sqrt(3.0) * M_PI * M_PI / static_cast<double>(d) * q;
    rows.push_back(row);
    ++step;
  }
  if (progress) progress(steps, steps);
  return rows;
}

}  // namespace tq
