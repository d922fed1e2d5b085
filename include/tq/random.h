// The project's own random generator. Every random quantity (rotation signs,
// Haar and QJL Gaussian matrices, sampled test data) derives from a
// StreamId through this generator, so it is bit-identical on every compiler,
// CPU and GPU. Specified in docs/FORMAT.md ("Generator"). Never use <random>'s
// distributions for anything that affects stored bytes: they are
// implementation-defined.
#ifndef TQ_RANDOM_H_
#define TQ_RANDOM_H_

#include <cstdint>

namespace tq {

// What a stream is used for; part of the key derivation (docs/FORMAT.md).
enum class Purpose : uint32_t {
  kRotationSigns = 1,  // random signs of (block) Hadamard rotations
  kHaarGaussian = 2,   // Gaussian matrix whose QR gives a Haar rotation
  kQjlGaussian = 3,    // Gaussian projection S of QJL
  kSample = 4,         // test/benchmark data (never stored)
  kRotationPermutation = 5,  // coordinate permutations of the 'mix' rotation
};

// Role of the quantized tensor within a (layer, head).
enum class Role : uint32_t {
  kKey = 0,
  kValue = 1,
  kVector = 2,  // search vectors, weights, anything else
};

// Where a codec sits in a model: its seeds derive from all of these.
struct StreamId {
  uint64_t seed = 0;
  uint32_t layer = 0;
  uint32_t head = 0;
  Role role = Role::kVector;
  uint32_t group = 0;  // channel group of an outlier split (0 = regular, 1 = outlier)
};

inline constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ULL;

// splitmix64's output function (Steele, Lea, Flood 2014).
constexpr uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Absorb(h, v) = Mix64((h ^ v) + kGoldenGamma).
constexpr uint64_t Absorb(uint64_t h, uint64_t v) { return Mix64((h ^ v) + kGoldenGamma); }

// key = Absorb over (domain tag, seed, layer, head, role, group, purpose).
uint64_t DeriveKey(const StreamId& id, Purpose purpose);

// splitmix64: word i (i = 0, 1, ...) is Mix64(key + (i + 1) * kGoldenGamma).
// A stream holds its position: one thread at a time (each thread its own).
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t key) : state_(key) {}
  uint64_t Next() {
    state_ += kGoldenGamma;
    return Mix64(state_);
  }
  // Uniform in [0, 1): the top 53 bits of one word times 2^-53.
  double NextDouble() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

// Natural logarithm from IEEE add/sub/mul/div only (no libm), so that it is
// bit-identical everywhere. Accurate to ~1 ulp for finite x > 0.
double DetLog(double x);

// Standard normal samples by Marsaglia's polar method on SplitMix64 words
// (two uniforms in (-1, 1) from two words; rejection when s >= 1 or s == 0),
// using DetLog and IEEE sqrt: bit-identical on every platform. One thread at
// a time, as SplitMix64.
class GaussianStream {
 public:
  explicit GaussianStream(uint64_t key) : bits_(key) {}
  double Next();

 private:
  SplitMix64 bits_;
  double spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace tq

#endif  // TQ_RANDOM_H_
