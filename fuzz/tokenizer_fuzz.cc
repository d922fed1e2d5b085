// libFuzzer target: the llama2.c tokenizer (Tokenizer::Parse: uint32
// max_token_length, then per token a float score, a uint32 length and the
// piece) must reject or accept any bytes without crashing, leaking or reading
// out of bounds; a vocabulary that loads must encode text (BPE merges) and
// decode ids, and decoding what it encoded must give the text back.
// Seed: a small valid vocabulary (specials, 256 byte tokens, merges) written
// by TQ_FUZZ_WRITE_SEEDS=DIR (docs/TESTING.md, "Fuzzing").
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "tq/model.h"

namespace {

void AddToken(std::vector<uint8_t>* out, float score, const std::string& piece) {
  uint32_t u;
  std::memcpy(&u, &score, 4);
  tq::fuzz::AppendLE32(out, u);
  tq::fuzz::AppendLE32(out, static_cast<uint32_t>(piece.size()));
  out->insert(out->end(), piece.begin(), piece.end());
}

std::vector<uint8_t> SeedVocabulary() {
  std::vector<uint8_t> out;
  tq::fuzz::AppendLE32(&out, 8);
  AddToken(&out, 0.0f, "<unk>");
  AddToken(&out, 0.0f, "\n<s>\n");
  AddToken(&out, 0.0f, "\n</s>\n");
  for (int b = 0; b < 256; ++b) {
    char piece[8];
    std::snprintf(piece, sizeof(piece), "<0x%02X>", b);
    AddToken(&out, 0.0f, piece);
  }
  const char* merges[] = {" ", "e", "t", "h", "th", " t", "he", "the", " the", "a", "n", "an", " a", "in", "ing"};
  float score = -1.0f;
  for (const char* m : merges) AddToken(&out, score -= 0.5f, m);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tq::fuzz::WriteSeed("seed_vocab.bin", SeedVocabulary());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  auto tok = tq::Tokenizer::Parse(bytes);
  (void)tq::Tokenizer::Parse(bytes, 300);
  if (!tok.ok()) return 0;
  // The input's own bytes as text: arbitrary UTF-8 (or not), byte fallback.
  const std::string_view text(reinterpret_cast<const char*>(data), size < 512 ? size : 512);
  for (std::string_view t : {std::string_view("the thing in a hat\n\xe2\x82\xac\xff"), text}) {
    auto ids = tok->Encode(t, /*bos=*/true, /*eos=*/false);
    if (!ids.ok()) continue;
    auto back = tok->Decode(std::span<const int32_t>(ids->data() + 1, ids->size() - 1));
    if (!back.ok()) std::abort();
  }
  std::vector<int32_t> ids;
  for (size_t i = 0; i < 64 && i < size; ++i) ids.push_back(static_cast<int32_t>(data[i]) * 7 - 3);
  (void)tok->Decode(ids);
  return 0;
}
