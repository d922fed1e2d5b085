// What an AVX2 core can do for the int16 attention kernels: vector-pipe
// throughput of the instructions they are made of; one 4-bit key token
// (head_dim 128, 4 query heads of a KV head: 32 vpmaddwd + 32 vpaddd, 8
// vpshufb, 8 unpacks) in three forms: its operations alone in registers
// (the port bound), a standalone token loop over real rows, and that loop
// with the kernel's tile epilogue (8 tokens' int32 sums converted, stored
// and reduced to one vector a query head); and, in registers, a 3-bit key
// token and a 4- and 3-bit value token (the value kernel's share of a
// token), so that k4_v4 and k3_v3 have a floor for a token and KV head.
// Rates are in cycles of the clock measured by a dependent scalar add chain
// in the same run; the 4-bit key figures are also given as a ratio to its
// port bound. docs/BENCHMARKS.md ("An AVX2 core's floor for the int16
// kernels") reads it.
//
//   build/release/bench/avx2_floor [--json]   (x86-64 builds only)
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// The value tokens' broadcast source (zeros; C linkage for the asm).
extern "C" {
alignas(64) int32_t tq_floor_w[16];
}

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Best of 5 of fn() (which runs `n` units), seconds a unit.
template <class F>
double Best(long n, F&& fn) {
  double best = 1e30;
  for (int k = 0; k < 5; ++k) {
    const double t0 = Now();
    fn();
    best = std::min(best, (Now() - t0) / static_cast<double>(n));
  }
  return best;
}

double ClockHz() {
  const long n = 400000000;
  const double s = Best(n, [&] {
    long x = 0;
    for (long i = 0; i < n; i += 8) {
      asm volatile("add $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0"
                   : "+r"(x));
    }
  });
  return 1.0 / s;
}

#define TQ_OP12(I)                                                                                            \
  I " %%ymm15,%%ymm0,%%ymm0\n\t" I " %%ymm15,%%ymm1,%%ymm1\n\t" I " %%ymm15,%%ymm2,%%ymm2\n\t" I              \
    " %%ymm15,%%ymm3,%%ymm3\n\t" I " %%ymm15,%%ymm4,%%ymm4\n\t" I " %%ymm15,%%ymm5,%%ymm5\n\t" I              \
    " %%ymm15,%%ymm6,%%ymm6\n\t" I " %%ymm15,%%ymm7,%%ymm7\n\t" I " %%ymm15,%%ymm8,%%ymm8\n\t" I              \
    " %%ymm15,%%ymm9,%%ymm9\n\t" I " %%ymm15,%%ymm10,%%ymm10\n\t" I " %%ymm15,%%ymm11,%%ymm11\n\t"
#define TQ_CLOBBER \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14"

// Seconds per iteration of an asm body (12 independent registers, ymm15 the
// shared operand; all zeroed first, so no float operand is a denormal).
#define TQ_ZERO                                                                                            \
  "vpxor %%xmm0,%%xmm0,%%xmm0\n\tvmovdqa %%ymm0,%%ymm1\n\tvmovdqa %%ymm0,%%ymm2\n\tvmovdqa %%ymm0,%%ymm3\n\t"   \
  "vmovdqa %%ymm0,%%ymm4\n\tvmovdqa %%ymm0,%%ymm5\n\tvmovdqa %%ymm0,%%ymm6\n\tvmovdqa %%ymm0,%%ymm7\n\t"           \
  "vmovdqa %%ymm0,%%ymm8\n\tvmovdqa %%ymm0,%%ymm9\n\tvmovdqa %%ymm0,%%ymm10\n\tvmovdqa %%ymm0,%%ymm11\n\t"         \
  "vmovdqa %%ymm0,%%ymm15\n\t"
#define TQ_TIME(BODY)                                                         \
  Best(20000000, [] {                                                         \
    asm volatile(TQ_ZERO ::: TQ_CLOBBER, "xmm15");                            \
    for (long i = 0; i < 20000000; ++i) asm volatile(BODY ::: TQ_CLOBBER); \
  })

// The 4-bit key token's operations (32 vpmaddwd, 32 vpaddd, 8 vpshufb, 8
// unpacks, 4 vpand, 4 conversions: 88) in registers, four at a time on
// rotating registers so that no register's chain is long.
#define TQ_R(I, r) I " %%ymm15,%%ymm" #r ",%%ymm" #r "\n\t"
#define TQ_Q(I, a, b, c, d) TQ_R(I, a) TQ_R(I, b) TQ_R(I, c) TQ_R(I, d)
#define TQ_CV(a, b) "vcvtdq2ps %%ymm" #a ",%%ymm" #a "\n\tvcvtdq2ps %%ymm" #b ",%%ymm" #b "\n\t"
#define TQ_SIX                                                                                             \
  TQ_Q("vpmaddwd", 0, 1, 2, 3) TQ_Q("vpaddd", 4, 5, 6, 7) TQ_Q("vpmaddwd", 8, 9, 10, 11)                   \
      TQ_Q("vpaddd", 0, 1, 2, 3) TQ_Q("vpmaddwd", 4, 5, 6, 7) TQ_Q("vpaddd", 8, 9, 10, 11)
#define TQ_TOKEN                                                                                            \
  TQ_SIX TQ_Q("vpshufb", 0, 1, 2, 3) TQ_SIX TQ_Q("vpunpcklbw", 4, 5, 6, 7) TQ_Q("vpmaddwd", 0, 1, 2, 3)     \
      TQ_Q("vpshufb", 8, 9, 10, 11) TQ_Q("vpaddd", 4, 5, 6, 7) TQ_Q("vpunpckhbw", 0, 1, 2, 3)               \
          TQ_Q("vpmaddwd", 8, 9, 10, 11) TQ_Q("vpand", 4, 5, 6, 7) TQ_Q("vpaddd", 0, 1, 2, 3) TQ_CV(8, 9)   \
              TQ_CV(10, 11)

// Pieces of the 3-bit key token and the value tokens below: two operations,
// immediate shifts, and broadcasts from memory (tq_floor_w, L1-resident).
#define TQ_P(I, a, b) TQ_R(I, a) TQ_R(I, b)
#define TQ_SRL13(a, b, c, d)                                                                            \
  "vpsrlw $13,%%ymm" #a ",%%ymm" #a "\n\tvpsrlw $13,%%ymm" #b ",%%ymm" #b "\n\tvpsrlw $13,%%ymm" #c      \
  ",%%ymm" #c "\n\tvpsrlw $13,%%ymm" #d ",%%ymm" #d "\n\t"
#define TQ_SRL4P(a, b) "vpsrlw $4,%%ymm" #a ",%%ymm" #a "\n\tvpsrlw $4,%%ymm" #b ",%%ymm" #b "\n\t"
#define TQ_BC(r) "vpbroadcastd tq_floor_w(%%rip),%%ymm" #r "\n\t"
#define TQ_BC4(a, b, c, d) TQ_BC(a) TQ_BC(b) TQ_BC(c) TQ_BC(d)
// The 3-bit key token (112): per chunk of 32 codes two byte gathers
// (vpshufb), two vpmullw and two vpsrlw moving each code to the bottom of
// an int16 lane, a vpackuswb to bytes, then the 4-bit token's lookups and
// multiply-adds.
#define TQ_TOKEN3 \
  TQ_Q("vpaddd", 0, 1, 2, 3) TQ_Q("vpmaddwd", 4, 5, 6, 7) TQ_Q("vpshufb", 8, 9, 10, 11) \
  TQ_Q("vpaddd", 0, 1, 2, 3) TQ_Q("vpmaddwd", 4, 5, 6, 7) TQ_SRL13(8, 9, 10, 11) \
  TQ_Q("vpmullw", 0, 1, 2, 3) TQ_Q("vpaddd", 4, 5, 6, 7) TQ_Q("vpmaddwd", 8, 9, 10, 11) \
  TQ_Q("vpshufb", 0, 1, 2, 3) TQ_Q("vpaddd", 4, 5, 6, 7) TQ_Q("vpmaddwd", 8, 9, 10, 11) TQ_CV(0, 1) \
  TQ_CV(2, 3) TQ_Q("vpackuswb", 4, 5, 6, 7) TQ_Q("vpunpckhbw", 8, 9, 10, 11) \
  TQ_Q("vpunpcklbw", 0, 1, 2, 3) TQ_Q("vpaddd", 4, 5, 6, 7) TQ_Q("vpmaddwd", 8, 9, 10, 11) \
  TQ_Q("vpshufb", 0, 1, 2, 3) TQ_Q("vpaddd", 4, 5, 6, 7) TQ_Q("vpmaddwd", 8, 9, 10, 11) \
  TQ_SRL13(0, 1, 2, 3) TQ_Q("vpmullw", 4, 5, 6, 7) TQ_Q("vpaddd", 8, 9, 10, 11) \
  TQ_Q("vpmaddwd", 0, 1, 2, 3) TQ_Q("vpshufb", 4, 5, 6, 7) TQ_Q("vpaddd", 8, 9, 10, 11) \
  TQ_Q("vpmaddwd", 0, 1, 2, 3)
// A value token: half a pair of tokens of the value kernel's pair loops
// (an int32 lane sums c_t w_t + c_t+1 w_t+1) and its share of the staging
// loop that interleaves the pair's codes. Its 16 weight broadcasts
// (vpbroadcastd, one a query row, pass and pair) stay memory operands, read
// from an L1-resident buffer. 4-bit (88 and 16 broadcasts): 32 vpmaddwd,
// 32 vpaddd, 8 vpshufb and 8 unpacks of the pair loops, 6 nibble masks and
// shifts, 2 unpacks of the staging loop.
#define TQ_VTOKEN4 \
  TQ_Q("vpaddd", 0, 1, 2, 3) TQ_Q("vpmaddwd", 4, 5, 6, 7) TQ_BC4(12, 13, 14, 12) \
  TQ_Q("vpaddd", 8, 9, 10, 11) TQ_Q("vpmaddwd", 0, 1, 2, 3) TQ_Q("vpshufb", 4, 5, 6, 7) \
  TQ_Q("vpaddd", 8, 9, 10, 11) TQ_Q("vpmaddwd", 0, 1, 2, 3) TQ_BC4(12, 13, 14, 12) \
  TQ_Q("vpaddd", 4, 5, 6, 7) TQ_Q("vpmaddwd", 8, 9, 10, 11) TQ_Q("vpand", 0, 1, 2, 3) TQ_SRL4P(0, 1) \
  TQ_P("vpunpcklbw", 2, 3) TQ_Q("vpunpckhbw", 4, 5, 6, 7) TQ_Q("vpunpcklbw", 8, 9, 10, 11) \
  TQ_Q("vpaddd", 0, 1, 2, 3) TQ_Q("vpmaddwd", 4, 5, 6, 7) TQ_BC4(12, 13, 14, 12) \
  TQ_Q("vpaddd", 8, 9, 10, 11) TQ_Q("vpmaddwd", 0, 1, 2, 3) TQ_Q("vpshufb", 4, 5, 6, 7) \
  TQ_Q("vpaddd", 8, 9, 10, 11) TQ_Q("vpmaddwd", 0, 1, 2, 3) TQ_BC4(12, 13, 14, 12) \
  TQ_Q("vpaddd", 4, 5, 6, 7) TQ_Q("vpmaddwd", 8, 9, 10, 11)
// 3-bit (112 and 16 broadcasts): the pair loops' 64 multiply-adds, 8
// vpshufb and 8 unpacks; the staging loop's gathers, vpmullw, vpsrlw and
// vpackuswb of 4 chunks (as the key token's) and its 4 unpacks.
#define TQ_VTOKEN3 \
  TQ_Q("vpaddd", 0, 1, 2, 3) TQ_Q("vpmaddwd", 4, 5, 6, 7) TQ_BC4(12, 13, 14, 12) \
  TQ_Q("vpshufb", 8, 9, 10, 11) TQ_Q("vpaddd", 0, 1, 2, 3) TQ_Q("vpmaddwd", 4, 5, 6, 7) \
  TQ_SRL13(8, 9, 10, 11) TQ_Q("vpmullw", 0, 1, 2, 3) TQ_Q("vpunpcklbw", 4, 5, 6, 7) \
  TQ_Q("vpaddd", 8, 9, 10, 11) TQ_Q("vpmaddwd", 0, 1, 2, 3) TQ_BC4(12, 13, 14, 12) \
  TQ_Q("vpshufb", 4, 5, 6, 7) TQ_Q("vpaddd", 8, 9, 10, 11) TQ_Q("vpmaddwd", 0, 1, 2, 3) \
  TQ_Q("vpackuswb", 4, 5, 6, 7) TQ_Q("vpunpckhbw", 8, 9, 10, 11) TQ_Q("vpaddd", 0, 1, 2, 3) \
  TQ_Q("vpmaddwd", 4, 5, 6, 7) TQ_BC4(12, 13, 14, 12) TQ_Q("vpshufb", 8, 9, 10, 11) \
  TQ_Q("vpaddd", 0, 1, 2, 3) TQ_Q("vpmaddwd", 4, 5, 6, 7) TQ_SRL13(8, 9, 10, 11) \
  TQ_Q("vpmullw", 0, 1, 2, 3) TQ_Q("vpunpcklbw", 4, 5, 6, 7) TQ_Q("vpaddd", 8, 9, 10, 11) \
  TQ_Q("vpmaddwd", 0, 1, 2, 3) TQ_BC4(12, 13, 14, 12) TQ_Q("vpshufb", 4, 5, 6, 7) \
  TQ_Q("vpaddd", 8, 9, 10, 11) TQ_Q("vpmaddwd", 0, 1, 2, 3)

alignas(64) int16_t g_q16[4][128];

#define TQ_MADD(acc, k, qp)                                                                     \
  asm("vpmaddwd %1, %2, %%ymm14\n\tvpaddd %%ymm14, %0, %0"                                     \
      : "+x"(acc)                                                                              \
      : "m"(*reinterpret_cast<const __m256i*>(qp)), "x"(k)                                     \
      : "xmm14")

inline __m256 Quad(const __m256* v) {
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
  const __m256 ce = _mm256_add_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(ab), _mm256_castps_pd(ce))),
                       _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(ab), _mm256_castps_pd(ce))));
}

// 4-bit rows of `stride` bytes (64 code bytes first): per token the 4 query
// heads' int32 sums; kTile: the kernel's epilogue every 8 tokens.
template <bool kTile>
__attribute__((noinline)) void KeyTokens(const uint8_t* rows, size_t stride, size_t n, float* out) {
  const __m256i m = _mm256_set1_epi8(15);
  const __m256i tlo = _mm256_setr_epi8(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                       10, 11, 12, 13, 14, 15, 16);
  const __m256i thi = _mm256_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3,
                                       -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  alignas(32) __m256 parts[4][8];
  for (size_t t = 0; t < n; ++t) {
    const uint8_t* r = rows + t * stride;
    _mm_prefetch(reinterpret_cast<const char*>(r + 64 * stride), _MM_HINT_T0);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int c = 0; c < 2; ++c) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 32 * c));
      const __m256i i0 = _mm256_and_si256(x, m), i1 = _mm256_and_si256(_mm256_srli_epi16(x, 4), m);
      const __m256i l0 = _mm256_shuffle_epi8(tlo, i0), h0 = _mm256_shuffle_epi8(thi, i0);
      const __m256i l1 = _mm256_shuffle_epi8(tlo, i1), h1 = _mm256_shuffle_epi8(thi, i1);
      const __m256i c0 = _mm256_unpacklo_epi8(l0, h0), c1 = _mm256_unpackhi_epi8(l0, h0);
      const __m256i c2 = _mm256_unpacklo_epi8(l1, h1), c3 = _mm256_unpackhi_epi8(l1, h1);
      const int16_t* q = g_q16[0] + 64 * c;
      TQ_MADD(a0, c0, q); TQ_MADD(a1, c0, q + 128); TQ_MADD(a2, c0, q + 256); TQ_MADD(a3, c0, q + 384);
      TQ_MADD(a0, c1, q + 16); TQ_MADD(a1, c1, q + 144); TQ_MADD(a2, c1, q + 272); TQ_MADD(a3, c1, q + 400);
      TQ_MADD(a0, c2, q + 32); TQ_MADD(a1, c2, q + 160); TQ_MADD(a2, c2, q + 288); TQ_MADD(a3, c2, q + 416);
      TQ_MADD(a0, c3, q + 48); TQ_MADD(a1, c3, q + 176); TQ_MADD(a2, c3, q + 304); TQ_MADD(a3, c3, q + 432);
    }
    if constexpr (kTile) {
      const size_t tt = t & 7;
      parts[0][tt] = _mm256_cvtepi32_ps(a0);
      parts[1][tt] = _mm256_cvtepi32_ps(a1);
      parts[2][tt] = _mm256_cvtepi32_ps(a2);
      parts[3][tt] = _mm256_cvtepi32_ps(a3);
      if (tt == 7) {
        for (int h = 0; h < 4; ++h) {
          const __m256 lo = Quad(parts[h]), hi = Quad(parts[h] + 4);
          const __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
          _mm256_storeu_ps(out + 8 * h + 32 * ((t >> 3) & 255), s);
        }
      }
    } else {
      float* o = out + 32 * (t & 255);
      _mm256_storeu_ps(o, _mm256_cvtepi32_ps(a0));
      _mm256_storeu_ps(o + 8, _mm256_cvtepi32_ps(a1));
      _mm256_storeu_ps(o + 16, _mm256_cvtepi32_ps(a2));
      _mm256_storeu_ps(o + 24, _mm256_cvtepi32_ps(a3));
    }
  }
}

struct Result {
  std::string name;
  double cycles;     // cycles per unit
  double per_cycle;  // operations per cycle (instruction tests) or 0
  double vs_bound;   // cycles / the token's port bound (token tests) or 0
};

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else {
      std::fprintf(stderr, "avx2_floor: unknown argument '%s' (accepted: --json)\n", argv[i]);
      return 2;
    }
  }
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    std::fprintf(stderr, "avx2_floor: this CPU has no AVX2/FMA; nothing to measure\n");
    return 2;
  }
  std::fprintf(stderr, "avx2_floor: measuring (about 9 s)\n");
  const double hz = ClockHz();
  std::vector<Result> res;
  auto instr = [&](const char* name, double s, int ops) {
    res.push_back({name, s * hz, ops / (s * hz), 0.0});
  };
  instr("vpmaddwd", TQ_TIME(TQ_OP12("vpmaddwd")), 12);
  instr("vpaddd", TQ_TIME(TQ_OP12("vpaddd")), 12);
  instr("vpshufb", TQ_TIME(TQ_OP12("vpshufb")), 12);
  instr("vfmadd231ps", TQ_TIME(TQ_OP12("vfmadd231ps")), 12);
  instr("vpmaddwd+vpaddd", TQ_TIME(TQ_OP12("vpmaddwd") TQ_OP12("vpaddd")), 24);
  instr("vpmullw", TQ_TIME(TQ_OP12("vpmullw")), 12);
  instr("vpbroadcastd from memory", TQ_TIME(TQ_BC4(0, 1, 2, 3) TQ_BC4(4, 5, 6, 7) TQ_BC4(8, 9, 10, 11)), 12);
  const double bound = TQ_TIME(TQ_TOKEN) * hz;
  res.push_back({"4-bit key token, operations in registers (port bound)", bound, 88.0 / bound, 1.0});
  const double k3 = TQ_TIME(TQ_TOKEN3) * hz;
  res.push_back({"3-bit key token, in registers", k3, 112.0 / k3, 0.0});
  const double v4 = TQ_TIME(TQ_VTOKEN4) * hz;
  res.push_back({"4-bit value token, in registers (+16 broadcasts)", v4, 88.0 / v4, 0.0});
  const double v3 = TQ_TIME(TQ_VTOKEN3) * hz;
  res.push_back({"3-bit value token, in registers (+16 broadcasts)", v3, 112.0 / v3, 0.0});
  res.push_back({"k4_v4 token and KV head (key + value tokens)", bound + v4, 0.0, 0.0});
  res.push_back({"k3_v3 token and KV head (key + value tokens)", k3 + v3, 0.0, 0.0});

  std::srand(1);
  for (auto& row : g_q16) {
    for (int16_t& v : row) v = static_cast<int16_t>(std::rand() % 2000 - 1000);
  }
  std::vector<float> out(8192);
  const size_t stride = 66;  // a 4-bit row at head_dim 128: 64 code bytes and an fp16 scale
  for (size_t ntok : {size_t{512}, size_t{262144}}) {
    std::vector<uint8_t> rows(ntok * stride + 64 * stride + 64);
    for (auto& b : rows) b = static_cast<uint8_t>(std::rand());
    const size_t reps = std::max<size_t>(1, (size_t{1} << 24) / ntok);
    const long n = static_cast<long>(reps * ntok);
    const std::string where = ntok == 512 ? "L1-resident rows" : "17 MB of rows";
    const double loop = Best(n, [&] {
      for (size_t r = 0; r < reps; ++r) KeyTokens<false>(rows.data(), stride, ntok, out.data());
    }) * hz;
    res.push_back({"4-bit key token loop, " + where, loop, 0.0, loop / bound});
    const double tile = Best(n, [&] {
      for (size_t r = 0; r < reps; ++r) KeyTokens<true>(rows.data(), stride, ntok, out.data());
    }) * hz;
    res.push_back({"4-bit key token loop + tile reduction, " + where, tile, 0.0, tile / bound});
  }

  if (json) {
    std::printf("{\"clock_ghz\":%.3f,\"results\":[", hz * 1e-9);
    for (size_t i = 0; i < res.size(); ++i) {
      // Fields that do not apply to a test are null.
      auto num = [](double v) { return v > 0 ? std::to_string(v) : std::string("null"); };
      std::printf("%s{\"name\":\"%s\",\"cycles\":%.2f,\"per_cycle\":%s,\"vs_port_bound\":%s}", i ? "," : "",
                  res[i].name.c_str(), res[i].cycles, num(res[i].per_cycle).c_str(), num(res[i].vs_bound).c_str());
    }
    std::printf("]}\n");
  } else {
    std::printf("clock (dependent adds): %.3f GHz\n", hz * 1e-9);
    std::printf("%-58s %10s %12s %14s\n", "test", "cycles", "ops/cycle", "x port bound");
    for (const Result& r : res) {
      std::printf("%-58s %10.2f %12s %14s\n", r.name.c_str(), r.cycles,
                  r.per_cycle > 0 ? std::to_string(r.per_cycle).substr(0, 5).c_str() : "-",
                  r.vs_bound > 0 ? std::to_string(r.vs_bound).substr(0, 5).c_str() : "-");
    }
  }
  return 0;
}
