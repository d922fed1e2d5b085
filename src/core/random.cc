#include "tq/random.h"

#include <cmath>
#include <cstring>

namespace tq {

namespace {
// "turbquant" domain tag, so that our keys never coincide with a plain
// splitmix64 seeded with a user's number.
constexpr uint64_t kDomainTag = 0x7475726271756E74ULL;
}  // namespace

uint64_t DeriveKey(const StreamId& id, Purpose purpose) {
  uint64_t h = Absorb(0, kDomainTag);
  h = Absorb(h, id.seed);
  h = Absorb(h, id.layer);
  h = Absorb(h, id.head);
  h = Absorb(h, static_cast<uint32_t>(id.role));
  h = Absorb(h, id.group);
  h = Absorb(h, static_cast<uint32_t>(purpose));
  return h;
}

double DetLog(double x) {
  // x = m * 2^e with m in [sqrt(1/2), sqrt(2)); ln x = e ln2 + 2 atanh(t),
  // t = (m - 1) / (m + 1), |t| <= 0.1716, so t^2 <= 0.02944 and 13 odd terms
  // of the atanh series reach < 1e-20 relative error.
  if (!(x > 0) || x == HUGE_VAL) return x > 0 ? x : (x == 0 ? -HUGE_VAL : NAN);
  uint64_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  int e = 0;
  if ((bits >> 52) == 0) {  // subnormal: scale up exactly by 2^64
    x *= 0x1.0p64;
    std::memcpy(&bits, &x, sizeof(bits));
    e = -64;
  }
  e += static_cast<int>((bits >> 52) & 0x7FF) - 1023;
  bits = (bits & 0x000FFFFFFFFFFFFFULL) | (uint64_t{1023} << 52);  // m in [1, 2)
  double m;
  std::memcpy(&m, &bits, sizeof(m));
  if (m > 1.4142135623730951) {  // move m into [sqrt(1/2), sqrt(2))
    m *= 0.5;
    e += 1;
  }
  const double t = (m - 1.0) / (m + 1.0);
  const double t2 = t * t;
  // Horner over 1/(2k+1) for k = 13..0.
  double s = 1.0 / 27.0;
  for (int k = 12; k >= 0; --k) s = s * t2 + 1.0 / (2.0 * k + 1.0);
  // ln2 split into a high part with trailing zero bits and a low correction,
  // so that e * ln2_hi is exact for |e| < 2^11.
  constexpr double kLn2Hi = 6.93147180369123816490e-01;
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  const double de = static_cast<double>(e);
  return de * kLn2Hi + (de * kLn2Lo + 2.0 * t * s);
}

double GaussianStream::Next() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  for (;;) {
    const double u = 2.0 * bits_.NextDouble() - 1.0;
    const double v = 2.0 * bits_.NextDouble() - 1.0;
    const double s = u * u + v * v;
    if (s >= 1.0 || s == 0.0) continue;
    const double f = std::sqrt(-2.0 * DetLog(s) / s);
    spare_ = v * f;
    has_spare_ = true;
    return u * f;
  }
}

}  // namespace tq
