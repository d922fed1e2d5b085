// CodecPlan: everything a row kernel needs, as plain values and pointers into
// storage owned by a Codec (rotation signs/matrices, codebooks, QJL matrix).
// The same struct drives the scalar reference, every Highway target and (later)
// the CUDA kernels. Internal header: not installed.
#ifndef TQ_SRC_CORE_PLAN_H_
#define TQ_SRC_CORE_PLAN_H_

#include <cstddef>
#include <cstdint>

namespace tq {

class Rotation;

inline constexpr size_t kMaxBlocks = 17;  // binary expansion of dims <= 65536

struct BlockPlan {
  size_t offset = 0;  // first coordinate of the block
  size_t size = 0;    // power of two for Hadamard kinds
  const float* centroids = nullptr;   // 2^mse_bits ascending (MSE part)
  const float* boundaries = nullptr;  // 2^mse_bits - 1
};

struct CodecPlan {
  size_t dim = 0;
  int mse_bits = 0;        // 0 only for 1-bit prod codes (pure QJL)
  bool hadamard = true;    // false: dense Haar
  bool norm_correction = true;
  bool scale_f16 = true;   // scales stored as fp16 (else fp32)
  size_t num_blocks = 0;
  BlockPlan blocks[kMaxBlocks];
  const float* signs1 = nullptr;  // [dim] ±1 (Hadamard)
  const float* signs2 = nullptr;  // [dim] ±1 (Hadamard)
  const float* haar = nullptr;    // Q  [dim][dim] row-major (y = Q x)
  const float* haar_t = nullptr;  // Q^T [dim][dim] row-major
  // kMix (hadamard false, haar null): the rotation, applied row by row with
  // its exact reference arithmetic (Rotation::Apply / ApplyInverse).
  const Rotation* mix = nullptr;
  // QJL (prod codes only; qjl_dim == 0 for MSE codes).
  size_t qjl_dim = 0;
  const float* qjl = nullptr;     // S   [qjl_dim][dim] row-major
  const float* qjl_t = nullptr;   // S^T [dim][qjl_dim] row-major
  // Row layout (docs/FORMAT.md): [indices][signs][block scales][residual norm].
  size_t index_bytes = 0;   // PackedBytes(dim, mse_bits)
  size_t sign_offset = 0;   // = index_bytes
  size_t sign_bytes = 0;    // PackedBytes(qjl_dim, 1)
  size_t scale_offset = 0;  // first block scale
  size_t scale_bytes = 2;   // 2 (fp16) or 4 (fp32) per scale
  size_t resid_offset = 0;  // residual norm (prod only)
  size_t row_bytes = 0;
};

}  // namespace tq

#endif  // TQ_SRC_CORE_PLAN_H_
