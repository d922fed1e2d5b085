// Lloyd-Max scalar codebooks for the sphere-marginal and Gaussian densities.
//
// Math (all densities are symmetric about 0, so only the positive half is
// solved and the codebook is mirrored, which makes antisymmetry exact):
//
//   kSphere, d >= 2: f_d(t) = (1 - t^2)^((d-3)/2) / B(1/2, (d-1)/2) on [-1, 1].
//     With t = sin(theta), f_d(t) dt = cos^(d-2)(theta) dtheta / Z, where
//     Z = integral of cos^(d-2) over [-pi/2, pi/2] = B(1/2, (d-1)/2). The
//     integrand is analytic on [0, pi/2] for every integer d >= 2 (this removes
//     the arcsine singularity of d = 2) and, for large d, is close to a
//     Gaussian in theta of standard deviation 1/sqrt(d-2) radians.
//   kGaussian, d: N(0, 1/d) = N(0, 1) scaled by 1/sqrt(d). The N(0, 1) quantizer
//     is solved in the standardized variable s with weight exp(-s^2/2), and
//     its centroids are divided by sqrt(d) (Lloyd-Max optimality is scale
//     equivariant).
//
// Both cases are the same problem in a working variable x in [0, x_max]:
// t = T(x) increasing with T(0) = 0 and f(t) dt proportional to w(x) dx.
// Cell integrals of w, t*w and (t - c)^2*w are computed by composite 16-point
// Gauss-Legendre quadrature on a uniform x grid whose step resolves the peak
// of w, split exactly at the cell boundaries, so every integrand is analytic
// on every piece and quadrature is accurate to rounding. The integrands are
// nonnegative for x >= 0, so sums of pieces have no cancellation; conditional
// means are ratios of such sums and are accurate to a few ulps.
//
// Lloyd-Max conditions (Lloyd 1982, Max 1960): each centroid is the
// conditional mean of its cell and each boundary is the midpoint of adjacent
// centroids. They are solved by Newton's method on the tridiagonal system
// g_i(c) = c_i - m_i(c) = 0, started from the asymptotically optimal
// compander (point density proportional to f^(1/3); Panter & Dite 1951) after
// a few Lloyd steps, with backtracking and a Lloyd-step fallback.
#include "tq/codebook.h"

#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numbers>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace tq {
namespace {

// ---------------------------------------------------------------------------
// Gauss-Legendre rule.

constexpr size_t kGaussNodes = 16;

struct GaussLegendreRule {
  std::array<double, kGaussNodes> node;    // on [-1, 1], ascending
  std::array<double, kGaussNodes> weight;  // sum to 2
};

// Returns {P_n(x), P_n'(x)} for n = kGaussNodes, from the recurrence
// (k+1) P_{k+1} = (2k+1) x P_k - k P_{k-1} and
// (1 - x^2) P_n' = n (P_{n-1} - x P_n).
std::pair<double, double> Legendre(double x) {
  double p_prev = 1.0;  // P_0
  double p = x;         // P_1
  for (size_t k = 1; k < kGaussNodes; ++k) {
    const double kd = static_cast<double>(k);
    const double p_next = ((2 * kd + 1) * x * p - kd * p_prev) / (kd + 1);
    p_prev = p;
    p = p_next;
  }
  const double n = static_cast<double>(kGaussNodes);
  return {p, n * (p_prev - x * p) / (1 - x * x)};
}

// Nodes are the roots of the Legendre polynomial P_n, found by Newton's
// method from Tricomi's estimate cos(pi (i + 3/4) / (n + 1/2)). Weights:
// w = 2 / ((1 - x^2) P_n'(x)^2) (Abramowitz & Stegun 25.4.29). Nodes are
// computed in symmetric pairs so the rule is exactly symmetric.
GaussLegendreRule MakeGaussLegendreRule() {
  constexpr size_t n = kGaussNodes;
  GaussLegendreRule rule{};
  for (size_t i = 0; i < n / 2; ++i) {
    double x = std::cos(std::numbers::pi * (static_cast<double>(i) + 0.75) /
                        (static_cast<double>(n) + 0.5));
    for (int iter = 0; iter < 100; ++iter) {
      const auto [p, dp] = Legendre(x);
      const double dx = p / dp;
      x -= dx;
      if (std::fabs(dx) <= 1e-17) break;
    }
    const double dp = Legendre(x).second;
    const double w = 2 / ((1 - x * x) * dp * dp);
    rule.node[n - 1 - i] = x;  // x > 0: Tricomi's estimates descend in i
    rule.node[i] = -x;
    rule.weight[n - 1 - i] = w;
    rule.weight[i] = w;
  }
  return rule;
}

const GaussLegendreRule& Rule() {
  static const GaussLegendreRule rule = MakeGaussLegendreRule();
  return rule;
}

// ---------------------------------------------------------------------------
// The positive half of a symmetric density in its working variable x.

struct PointValue {
  double t;      // T(x)
  double w;      // unnormalized weight: f(t) dt = w(x) dx / Z
  double dt_dx;  // T'(x) > 0
};

// Double-double accumulator (value = hi + lo, |lo| <= ulp(hi)/2 roughly).
// Why: the Lloyd-Max system is ill-conditioned along its slowest mode (the
// Jacobian's smallest eigenvalue is ~(pi/2M)^2 for M positive cells), so
// rounding in the conditional means is amplified by up to ~1e4 in the
// centroids. Accumulating the quadrature sums without rounding error cuts the
// worst centroid error at 8 bits from ~1.6e-13 to ~1.6e-14 (measured on
// d = 3, whose exact answer is the uniform grid). Portable: TwoSum (Knuth)
// and TwoProduct via std::fma, which is exact on every IEEE platform.
struct DoubleDouble {
  double hi = 0;
  double lo = 0;

  void Add(double x) {
    const double sum = hi + x;
    const double x_part = sum - hi;
    lo += (hi - (sum - x_part)) + (x - x_part);
    hi = sum;
  }
  void AddProduct(double a, double b) {
    const double product = a * b;
    Add(product);
    lo += std::fma(a, b, -product);
  }
  void Add(const DoubleDouble& other) {
    Add(other.hi);
    lo += other.lo;
  }
  double Value() const { return hi + lo; }
};

// num / den to nearly full double accuracy from double-double operands.
double Divide(const DoubleDouble& num, const DoubleDouble& den) {
  const double q = num.hi / den.hi;
  // fma gives num.hi - q*den.hi exactly (it is tiny and representable).
  double r = std::fma(-q, den.hi, num.hi);
  r += num.lo - q * den.lo;
  return q + r / den.hi;
}

// Zeroth and first moments of one cell: integral of w dx and of t*w dx.
struct Moments {
  DoubleDouble m0;
  DoubleDouble m1;
};

class HalfDensity {
 public:
  // Sphere marginal for d >= 2 in x = theta = asin(t).
  static HalfDensity Sphere(size_t dim) {
    HalfDensity h;
    h.sphere_ = true;
    h.exponent_ = static_cast<double>(dim) - 2;
    h.t_max_ = 1.0;
    // cos^(d-2)(theta) <= exp(-(d-2) theta^2 / 2): a Gaussian bump of
    // standard deviation sigma = 1/sqrt(d-2). Beyond 40 sigma it is below
    // exp(-800), i.e. 0 in double, so the grid stops there.
    const double half_pi = std::numbers::pi / 2;
    double x_max = half_pi;
    double step = half_pi / 32;
    if (dim > 2) {
      const double sigma = 1 / std::sqrt(h.exponent_);
      x_max = std::min(half_pi, 40 * sigma);
      step = std::min(step, sigma / 2);
    }
    h.BuildGrid(x_max, step);
    return h;
  }

  // N(0, 1) in x = s = t; weight exp(-s^2/2), which is 0 in double past 40.
  static HalfDensity StandardGaussian() {
    HalfDensity h;
    h.sphere_ = false;
    h.t_max_ = 40.0;
    h.BuildGrid(40.0, 0.5);
    return h;
  }

  PointValue Eval(double x) const {
    if (sphere_) {
      const double s = std::sin(x);
      const double c = std::cos(x);  // > 0 for x <= pi/2 in double
      // log cos(x) must be accurate relative to its own (small) size because
      // it is multiplied by d - 2 (up to 65534): near x = 0, cos(x) is 1 to
      // within an ulp and log(cos(x)) would carry an absolute error of 1e-16,
      // i.e. a relative error of 1e-16 / (x^2/2). log1p(-sin^2 x) / 2 has
      // full relative accuracy there; past pi/4 cos(x) itself is accurate.
      const double log_cos = x < std::numbers::pi / 4 ? 0.5 * std::log1p(-s * s)
                                                     : std::log(c);
      // exp((d-2) log cos) underflows harmlessly to 0 for large d and is
      // exactly 1 for d = 2.
      return {s, std::exp(exponent_ * log_cos), c};
    }
    return {x, std::exp(-0.5 * x * x), 1.0};
  }

  // Density f(t) at t = T(x), in the same unnormalized units as w.
  double DensityAt(double x) const {
    const PointValue p = Eval(x);
    return p.w / p.dt_dx;
  }

  double XOfT(double t) const {
    if (t >= t_max_) return x_max_;
    return sphere_ ? std::asin(t) : t;
  }

  double t_max() const { return t_max_; }
  double x_max() const { return x_max_; }

  // Integral of w over the whole half line, i.e. Z / 2.
  double HalfMass() const { return half_mass_; }

  Moments CellMoments(double xa, double xb) const {
    Moments out;
    ForEachPiece(xa, xb, [&](double a, double b, size_t full_panel) {
      const Moments m =
          full_panel != kPartial ? panel_moments_[full_panel] : PieceMoments(a, b);
      out.m0.Add(m.m0);
      out.m1.Add(m.m1);
    });
    return out;
  }

  // Integral over x in [xa, xb] of (T(x) - c)^2 w(x) dx. Evaluated directly
  // (not as m2 - 2c m1 + c^2 m0) to avoid cancellation in narrow cells far
  // from 0.
  double CellSquaredError(double xa, double xb, double c) const {
    double sum = 0;
    ForEachPiece(xa, xb, [&](double a, double b, size_t /*full_panel*/) {
      sum += Integrate(a, b, [&](const PointValue& p) {
        const double e = p.t - c;
        return e * e * p.w;
      });
    });
    return sum;
  }

  // Integral over [xa, xb] of the compander density f(t)^(1/3) dt, i.e.
  // w^(1/3) T'^(2/3) dx, on one piece.
  double CompanderPiece(double xa, double xb) const {
    return Integrate(xa, xb, [&](const PointValue& p) {
      return std::cbrt(p.w * p.dt_dx * p.dt_dx);
    });
  }
  double CompanderDensity(double x) const {
    const PointValue p = Eval(x);
    return std::cbrt(p.w * p.dt_dx * p.dt_dx);
  }

  const std::vector<double>& grid() const { return grid_; }

 private:
  HalfDensity() = default;

  void BuildGrid(double x_max, double step) {
    x_max_ = x_max;
    const double count = std::ceil(x_max / step);
    TQ_CHECK(count >= 1 && count <= 1e6);
    const size_t panels = static_cast<size_t>(count);
    const double h = x_max / count;
    grid_.resize(panels + 1);
    for (size_t k = 0; k < panels; ++k) grid_[k] = static_cast<double>(k) * h;
    grid_[panels] = x_max;
    panel_moments_.resize(panels);
    half_mass_ = 0;
    for (size_t k = 0; k < panels; ++k) {
      panel_moments_[k] = PieceMoments(grid_[k], grid_[k + 1]);
      half_mass_ += panel_moments_[k].m0.Value();
    }
  }

  // Gauss-Legendre integral over [a, b] of g(Eval(x)).
  template <typename G>
  double Integrate(double a, double b, G g) const {
    if (!(b > a)) return 0;
    const GaussLegendreRule& rule = Rule();
    const double mid = 0.5 * (a + b);
    const double half = 0.5 * (b - a);
    double sum = 0;
    for (size_t i = 0; i < kGaussNodes; ++i) {
      sum += rule.weight[i] * g(Eval(mid + half * rule.node[i]));
    }
    return half * sum;
  }

  Moments PieceMoments(double a, double b) const {
    Moments out;
    if (!(b > a)) return out;
    const GaussLegendreRule& rule = Rule();
    const double mid = 0.5 * (a + b);
    const double half = 0.5 * (b - a);
    for (size_t i = 0; i < kGaussNodes; ++i) {
      const PointValue p = Eval(mid + half * rule.node[i]);
      const double weighted = half * rule.weight[i] * p.w;
      out.m0.Add(weighted);
      out.m1.AddProduct(weighted, p.t);
    }
    return out;
  }

  // Index k of the panel [grid_[k], grid_[k+1]) holding x, clamped to the
  // valid range (x == x_max belongs to the last panel).
  size_t PanelOf(double x) const {
    const size_t panels = grid_.size() - 1;
    const size_t above =
        static_cast<size_t>(std::upper_bound(grid_.begin(), grid_.end(), x) - grid_.begin());
    return std::clamp<size_t>(above, 1, panels) - 1;
  }

  // Splits [xa, min(xb, x_max)] at grid points and calls
  // fn(a, b, full_panel), where full_panel is the panel index when [a, b] is
  // exactly that whole panel and kPartial for a partial piece. Splitting at
  // the grid keeps every Gauss-Legendre piece no wider than one panel.
  template <typename Fn>
  void ForEachPiece(double xa, double xb, Fn fn) const {
    xb = std::min(xb, x_max_);
    if (!(xb > xa)) return;
    const size_t ka = PanelOf(xa);
    const size_t kb = PanelOf(xb);
    if (ka == kb) {
      fn(xa, xb, kPartial);
      return;
    }
    fn(xa, grid_[ka + 1], xa == grid_[ka] ? ka : kPartial);
    for (size_t k = ka + 1; k < kb; ++k) fn(grid_[k], grid_[k + 1], k);
    fn(grid_[kb], xb, xb == grid_[kb + 1] ? kb : kPartial);
  }

  static constexpr size_t kPartial = static_cast<size_t>(-1);

  bool sphere_ = true;
  double exponent_ = 0;  // d - 2 (sphere only)
  double t_max_ = 1;
  double x_max_ = 0;
  std::vector<double> grid_;             // panel endpoints, grid_[0] = 0
  std::vector<Moments> panel_moments_;   // per-panel moments, reused by cells
  double half_mass_ = 0;
};

// ---------------------------------------------------------------------------
// Lloyd-Max solver on the positive half.
//
// Unknowns: the M = 2^(bits-1) positive centroids c_0 < ... < c_{M-1}. Cell j
// is [beta_j, beta_{j+1}] with beta_0 = 0 (the mirror boundary, fixed by
// symmetry), beta_j = (c_{j-1} + c_j)/2, beta_M = t_max.

struct HalfState {
  std::vector<double> c;       // centroids
  std::vector<double> beta;    // M + 1 boundaries in t
  std::vector<double> x_beta;  // the same boundaries in x
  std::vector<double> m;       // conditional means of the cells
  std::vector<double> mass;    // unnormalized cell masses (integral of w)
  double residual = 0;         // max_j |c_j - m_j| / c_j
};

bool IsValidHalf(const std::vector<double>& c, double t_max) {
  if (!(c[0] > 0)) return false;
  for (size_t j = 1; j < c.size(); ++j) {
    if (!(c[j] > c[j - 1])) return false;
  }
  return c.back() < t_max;
}

HalfState EvaluateHalf(const HalfDensity& density, std::vector<double> c) {
  const size_t m_cells = c.size();
  HalfState s;
  s.c = std::move(c);
  s.beta.resize(m_cells + 1);
  s.x_beta.resize(m_cells + 1);
  s.beta[0] = 0;
  s.x_beta[0] = 0;
  for (size_t j = 1; j < m_cells; ++j) {
    s.beta[j] = 0.5 * (s.c[j - 1] + s.c[j]);
    s.x_beta[j] = density.XOfT(s.beta[j]);
  }
  s.beta[m_cells] = density.t_max();
  s.x_beta[m_cells] = density.x_max();
  s.m.resize(m_cells);
  s.mass.resize(m_cells);
  s.residual = 0;
  for (size_t j = 0; j < m_cells; ++j) {
    const Moments mom = density.CellMoments(s.x_beta[j], s.x_beta[j + 1]);
    // Every cell lies where the density is representable (> 0); a zero mass
    // would mean the iteration left the support, which the callers exclude.
    TQ_CHECK(mom.m0.hi > 0);
    s.mass[j] = mom.m0.Value();
    s.m[j] = Divide(mom.m1, mom.m0);
    s.residual = std::max(s.residual, std::fabs(s.c[j] - s.m[j]) / s.c[j]);
  }
  return s;
}

// Newton step delta solving J delta = g for g = c - m, where
// J = I - dm/dc is tridiagonal. With A_j = dm_j/dbeta_j =
// f(beta_j)(m_j - beta_j)/P_j and B_j = dm_j/dbeta_{j+1} =
// f(beta_{j+1})(beta_{j+1} - m_j)/P_j and dbeta/dc = 1/2 for both neighbors:
//   J_{j,j-1} = -A_j/2, J_{j,j} = 1 - (A_j + B_j)/2, J_{j,j+1} = -B_j/2.
// (beta_0 and beta_M are fixed, so A_0 = B_{M-1} = 0.) Solved by the Thomas
// algorithm; returns false if a pivot is not safely positive.
bool NewtonStep(const HalfDensity& density, const HalfState& s,
                std::vector<double>* delta) {
  const size_t n = s.c.size();
  std::vector<double> f(n + 1, 0.0);  // density at interior boundaries
  for (size_t j = 1; j < n; ++j) f[j] = density.DensityAt(s.x_beta[j]);
  std::vector<double> lower(n, 0.0), diag(n), upper(n, 0.0), rhs(n);
  for (size_t j = 0; j < n; ++j) {
    const double a = j >= 1 ? f[j] * (s.m[j] - s.beta[j]) / s.mass[j] : 0.0;
    const double b =
        j + 1 < n ? f[j + 1] * (s.beta[j + 1] - s.m[j]) / s.mass[j] : 0.0;
    lower[j] = -0.5 * a;
    upper[j] = -0.5 * b;
    diag[j] = 1 - 0.5 * (a + b);
    rhs[j] = s.c[j] - s.m[j];
  }
  // Forward elimination.
  for (size_t j = 1; j < n; ++j) {
    if (!(std::fabs(diag[j - 1]) > 1e-300)) return false;
    const double factor = lower[j] / diag[j - 1];
    diag[j] -= factor * upper[j - 1];
    rhs[j] -= factor * rhs[j - 1];
  }
  if (!(std::fabs(diag[n - 1]) > 1e-300)) return false;
  delta->assign(n, 0.0);
  (*delta)[n - 1] = rhs[n - 1] / diag[n - 1];
  for (size_t j = n - 1; j-- > 0;) {
    (*delta)[j] = (rhs[j] - upper[j] * (*delta)[j + 1]) / diag[j];
  }
  for (double d : *delta) {
    if (!std::isfinite(d)) return false;
  }
  return true;
}

// Initial centroids from the compander: c_j is the point where the
// cumulative integral of f^(1/3) reaches (j + 1/2)/M of its half total.
std::vector<double> CompanderInit(const HalfDensity& density, size_t m_cells) {
  const std::vector<double>& grid = density.grid();
  const size_t panels = grid.size() - 1;
  std::vector<double> cum(panels + 1, 0.0);
  for (size_t k = 0; k < panels; ++k) {
    cum[k + 1] = cum[k] + density.CompanderPiece(grid[k], grid[k + 1]);
  }
  std::vector<double> c(m_cells);
  size_t k = 0;
  for (size_t j = 0; j < m_cells; ++j) {
    const double target =
        cum[panels] * (static_cast<double>(j) + 0.5) / static_cast<double>(m_cells);
    while (k + 1 < panels && cum[k + 1] <= target) ++k;
    // Solve cum[k] + integral_{grid[k]}^{x} = target in the panel: Newton
    // with bisection safeguard (the integrand is positive, so the integral
    // is increasing in x).
    double lo = grid[k], hi = grid[k + 1];
    const double span = cum[k + 1] - cum[k];
    double x = span > 0 ? lo + (hi - lo) * (target - cum[k]) / span : 0.5 * (lo + hi);
    for (int iter = 0; iter < 60; ++iter) {
      const double value = cum[k] + density.CompanderPiece(grid[k], x) - target;
      if (value > 0) {
        hi = x;
      } else {
        lo = x;
      }
      const double slope = density.CompanderDensity(x);
      double next = slope > 0 ? x - value / slope : 0.5 * (lo + hi);
      if (!(next > lo && next < hi)) next = 0.5 * (lo + hi);
      if (std::fabs(next - x) <= 1e-13 * (grid[k + 1] - grid[k])) {
        x = next;
        break;
      }
      x = next;
    }
    c[j] = density.Eval(x).t;
  }
  return c;
}

// Returns the M positive Lloyd-Max centroids of the half density.
std::vector<double> SolveHalf(const HalfDensity& density, size_t m_cells) {
  std::vector<double> c = CompanderInit(density, m_cells);
  TQ_CHECK(IsValidHalf(c, density.t_max()));
  HalfState s = EvaluateHalf(density, std::move(c));
  // A few Lloyd steps (c <- m) smooth the compander start; they always keep
  // the centroids ordered and inside their cells.
  for (int i = 0; i < 3; ++i) s = EvaluateHalf(density, s.m);

  constexpr int kMaxIterations = 500;
  // Newton converges quadratically here (measured: error after a step of
  // relative size e is about 2 e^2), so once a full step is below 1e-9 the
  // remaining error is below rounding and the step is taken unconditionally
  // as the last one. The noise floor of the step itself is ~1e-13 (rounding
  // in m amplified by the condition number of J, which grows with 2^bits),
  // so demanding a smaller step would never terminate reliably.
  constexpr double kStepTolerance = 1e-9;
  bool converged = false;
  std::vector<double> delta;
  for (int iter = 0; iter < kMaxIterations && !converged; ++iter) {
    bool accepted = false;
    if (NewtonStep(density, s, &delta)) {
      double step = 0;
      for (size_t j = 0; j < delta.size(); ++j) {
        step = std::max(step, std::fabs(delta[j]) / s.c[j]);
      }
      double lambda = 1;
      for (int tries = 0; tries < 10 && !accepted; ++tries, lambda *= 0.5) {
        std::vector<double> trial(s.c.size());
        for (size_t j = 0; j < trial.size(); ++j) trial[j] = s.c[j] - lambda * delta[j];
        if (!IsValidHalf(trial, density.t_max())) continue;
        HalfState t = EvaluateHalf(density, std::move(trial));
        const bool tiny = lambda == 1 && step < kStepTolerance;
        if (tiny || t.residual < s.residual) {
          s = std::move(t);
          accepted = true;
          converged = tiny;
        }
      }
    }
    if (!accepted) {
      // Lloyd fallback: always valid, never increases the distortion.
      if (s.residual == 0) {
        converged = true;
      } else {
        s = EvaluateHalf(density, s.m);
      }
    }
  }
  TQ_CHECK(converged);
  return s.c;
}

// Total per-coordinate MSE of the mirrored codebook: 2 * sum over positive
// cells of integral (t - c_j)^2 f dt, with f normalized by Z = 2 * HalfMass.
double HalfMse(const HalfDensity& density, const std::vector<double>& c) {
  const size_t n = c.size();
  double sum = 0;
  double x_lo = 0;
  for (size_t j = 0; j < n; ++j) {
    const double x_hi =
        j + 1 < n ? density.XOfT(0.5 * (c[j] + c[j + 1])) : density.x_max();
    sum += density.CellSquaredError(x_lo, x_hi, c[j]);
    x_lo = x_hi;
  }
  return sum / density.HalfMass();
}

// Appends the little-endian bytes of v's float32 bit patterns.
void AppendLittleEndian(const std::vector<float>& v, std::vector<unsigned char>* out) {
  for (float f : v) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    for (int i = 0; i < 4; ++i) out->push_back(static_cast<unsigned char>(bits >> (8 * i)));
  }
}

Status ValidateArgs(CodebookFamily family, size_t dim, int bits) {
  if (family != CodebookFamily::kSphere && family != CodebookFamily::kGaussian) {
    return InvalidArgumentError(
        "codebook family must be sphere (0) or gaussian (1), got " +
        std::to_string(static_cast<int>(family)));
  }
  if (dim < 1 || dim > kMaxCodebookDim) {
    return InvalidArgumentError("codebook dim must be in 1.." +
                                std::to_string(kMaxCodebookDim) + ", got " +
                                std::to_string(dim));
  }
  if (bits < kMinBits || bits > kMaxBits) {
    return InvalidArgumentError("codebook bits must be in " + std::to_string(kMinBits) +
                                ".." + std::to_string(kMaxBits) + ", got " +
                                std::to_string(bits));
  }
  return Status::Ok();
}

}  // namespace

const char* CodebookFamilyName(CodebookFamily family) {
  switch (family) {
    case CodebookFamily::kSphere:
      return "sphere";
    case CodebookFamily::kGaussian:
      return "gaussian";
  }
  return "unknown";
}

Result<Codebook> Codebook::Compute(CodebookFamily family, size_t dim, int bits) {
  TQ_RETURN_IF_ERROR(ValidateArgs(family, dim, bits));
  Codebook cb;
  cb.family_ = family;
  cb.dim_ = dim;
  cb.bits_ = bits;
  const size_t n = cb.size();
  const size_t half = n / 2;
  std::vector<double> positive(half);  // c_{half + j}, ascending
  double mse = 0;
  if (family == CodebookFamily::kSphere && dim == 1) {
    // Two-point law {-1, +1}: any codebook containing +-1 has MSE 0; the
    // format fixes the uniform grid c_i = -1 + 2i/(n-1). The integer
    // numerator 2i - (n-1) is antisymmetric, so the division is too.
    for (size_t j = 0; j < half; ++j) {
      const double i = static_cast<double>(half + j);
      positive[j] = (2 * i - static_cast<double>(n - 1)) / static_cast<double>(n - 1);
    }
    mse = 0;
  } else if (family == CodebookFamily::kSphere) {
    const HalfDensity density = HalfDensity::Sphere(dim);
    positive = SolveHalf(density, half);
    mse = HalfMse(density, positive);
  } else {
    // Solve N(0, 1) once in the standardized variable, then scale.
    const HalfDensity density = HalfDensity::StandardGaussian();
    const std::vector<double> standard = SolveHalf(density, half);
    const double sqrt_d = std::sqrt(static_cast<double>(dim));
    for (size_t j = 0; j < half; ++j) positive[j] = standard[j] / sqrt_d;
    mse = HalfMse(density, standard) / static_cast<double>(dim);
  }

  // Mirror: exact antisymmetry c[i] == -c[n-1-i].
  cb.centroids64_.resize(n);
  for (size_t j = 0; j < half; ++j) {
    cb.centroids64_[half + j] = positive[j];
    cb.centroids64_[half - 1 - j] = -positive[j];
  }
  cb.boundaries64_.resize(n - 1);
  for (size_t i = 0; i + 1 < n; ++i) {
    cb.boundaries64_[i] = 0.5 * (cb.centroids64_[i] + cb.centroids64_[i + 1]);
  }
  for (size_t i = 0; i < n; ++i) TQ_CHECK(i == 0 || cb.centroids64_[i] > cb.centroids64_[i - 1]);

  cb.centroids32_.resize(n);
  for (size_t i = 0; i < n; ++i) cb.centroids32_[i] = static_cast<float>(cb.centroids64_[i]);
  cb.boundaries32_.resize(n - 1);
  for (size_t i = 0; i + 1 < n; ++i) {
    cb.boundaries32_[i] = static_cast<float>(cb.boundaries64_[i]);
  }
  cb.mse_ = mse;

  std::vector<unsigned char> bytes;
  bytes.reserve(4 * (2 * n - 1));
  AppendLittleEndian(cb.centroids32_, &bytes);
  AppendLittleEndian(cb.boundaries32_, &bytes);
  cb.fingerprint_ = XXH64(bytes.data(), bytes.size(), 0);
  return cb;
}

Result<const Codebook*> Codebook::Get(CodebookFamily family, size_t dim, int bits) {
  TQ_RETURN_IF_ERROR(ValidateArgs(family, dim, bits));
  // One entry per key; the map lock is held only to find or create the entry,
  // and std::call_once computes each codebook exactly once while letting
  // different codebooks compute concurrently. Entries are never erased, so
  // returned pointers stay valid for the life of the process.
  struct Entry {
    std::once_flag once;
    std::unique_ptr<const Codebook> codebook;
  };
  using Key = std::tuple<int, size_t, int>;
  struct Cache {
    std::mutex mu;
    std::map<Key, std::unique_ptr<Entry>> entries;
  };
  static Cache* const cache = new Cache();  // intentionally leaked

  Entry* entry;
  {
    std::lock_guard<std::mutex> lock(cache->mu);
    std::unique_ptr<Entry>& slot =
        cache->entries[Key(static_cast<int>(family), dim, bits)];
    if (!slot) slot = std::make_unique<Entry>();
    entry = slot.get();
  }
  std::call_once(entry->once, [&] {
    Result<Codebook> computed = Compute(family, dim, bits);
    TQ_CHECK(computed.ok());  // arguments were validated above
    entry->codebook.reset(new Codebook(std::move(computed).value()));
  });
  return entry->codebook.get();
}

int Codebook::Quantize(float u) const {
  if (std::isnan(u)) return 0;
  // upper_bound finds the first boundary > u; its index counts the
  // boundaries b with u >= b.
  const float* begin = boundaries32_.data();
  const float* end = begin + boundaries32_.size();
  return static_cast<int>(std::upper_bound(begin, end, u) - begin);
}

}  // namespace tq
