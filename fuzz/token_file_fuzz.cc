// libFuzzer target: token files (ReadTokenFile / ParseTokenIds: decimal ids
// separated by spaces or commas, '#' comments) must reject or accept any
// bytes without crashing or reading out of bounds; ids that parse must write
// back (WriteTokenFile) to a file that parses to the same ids. Seed: a token
// file written by TQ_FUZZ_WRITE_SEEDS=DIR (docs/TESTING.md, "Fuzzing").
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "tq/model.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = tq::fuzz::SeedDir()) {
    std::vector<int32_t> ids;
    for (int32_t i = 0; i < 45; ++i) ids.push_back(i * 97 % 512);
    if (!tq::WriteTokenFile(std::string(dir) + "/seed_tokens.txt", ids).ok()) std::abort();
    const std::string commented = "# prompt\n1, 22,333\t4444 # ids\r\n0\n";
    tq::fuzz::WriteSeed("seed_comments.txt", std::vector<uint8_t>(commented.begin(), commented.end()));
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = tq::fuzz::ScratchFile("tokens.txt", data, size);
  auto ids = tq::ReadTokenFile(path);
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto direct = tq::ParseTokenIds(text, 512);
  if (direct.ok() && (!ids.ok() || *ids != *direct)) std::abort();  // a bound only removes files
  if (!ids.ok()) return 0;
  const std::string again = tq::fuzz::ScratchDir() + "/again.txt";
  if (!tq::WriteTokenFile(again, *ids).ok()) std::abort();
  auto back = tq::ReadTokenFile(again);
  if (!back.ok() || *back != *ids) std::abort();
  return 0;
}
