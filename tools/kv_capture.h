// K/V capture files: per-layer, per-sequence attention inputs (Q, K, V per
// head) written by bench/minilm/minilm_kv.py from a real encoder and read by
// `tq bench attention-quality --capture` and `tq kv roundtrip`.
//
// Layout (all little-endian; docs/BENCHMARKS.md, "all-MiniLM-L6-v2"):
//   offset  0  char[8]  magic "TQKVCAP1"
//           8  uint32   version (1)
//          12  uint32   first_layer   model layer index of the file's layer 0
//          16  uint32   num_layers    layers in the file
//          20  uint32   num_q_heads   0: the file holds no Q
//          24  uint32   num_kv_heads
//          28  uint32   head_dim
//          32  uint32   num_seqs
//          36  uint32   reserved (0)
//          40  uint32   lengths[num_seqs]  tokens of each sequence (>= 1)
//   then for layer in [0, num_layers), for seq in [0, num_seqs):
//     Q  float32[len][num_q_heads][head_dim]   (absent when num_q_heads == 0)
//     K  float32[len][num_kv_heads][head_dim]
//     V  float32[len][num_kv_heads][head_dim]
// The file ends there (trailing bytes are an error).
#ifndef TQ_TOOLS_KV_CAPTURE_H_
#define TQ_TOOLS_KV_CAPTURE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tq/status.h"

namespace tq::tools {

struct KVCapture {
  uint32_t first_layer = 0;
  uint32_t num_q_heads = 0;  // 0: no Q
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  std::vector<uint32_t> lengths;                  // [seq]
  std::vector<std::vector<std::vector<float>>> Q;  // [layer][seq] -> [len][qh][d] (empty without Q)
  std::vector<std::vector<std::vector<float>>> K;  // [layer][seq] -> [len][kvh][d]
  std::vector<std::vector<std::vector<float>>> V;

  size_t num_layers() const { return K.size(); }
  size_t num_seqs() const { return lengths.size(); }
};

// Errors: unreadable file, wrong magic or version, a non-zero reserved field,
// zero shapes or lengths, a size that does not match the header exactly,
// non-finite values.
Result<KVCapture> ReadKVCapture(const std::string& path);
Status WriteKVCapture(const std::string& path, const KVCapture& capture);

}  // namespace tq::tools

#endif  // TQ_TOOLS_KV_CAPTURE_H_
