// Shared helpers of the libFuzzer targets whose loaders take a path: one
// scratch file (or directory) per process, rewritten with every input, and
// the seed-writing switch TQ_FUZZ_WRITE_SEEDS=DIR (docs/TESTING.md,
// "Fuzzing").
#ifndef TQ_FUZZ_FUZZ_UTIL_H_
#define TQ_FUZZ_FUZZ_UTIL_H_

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "core/file_io.h"

namespace tq::fuzz {

// A directory private to this process under /dev/shm (memory-backed, so
// inputs cost no disk writes) or $TMPDIR / /tmp; removed at exit.
inline const std::string& ScratchDir() {
  // Never freed, so that the exit handler below can still read it.
  static const std::string* dir = [] {
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::path base = fs::is_directory("/dev/shm", ec) ? fs::path("/dev/shm") : fs::temp_directory_path(ec);
    if (const char* t = std::getenv("TQ_FUZZ_SCRATCH")) base = t;
    fs::path d = base / ("tq_fuzz_" + std::to_string(::getpid()));
    fs::create_directories(d, ec);
    auto* s = new std::string(d.string());
    std::atexit([] { std::error_code e; std::filesystem::remove_all(ScratchDir(), e); });
    return s;
  }();
  return *dir;
}

// Writes bytes to `path` (truncating); aborts when the write fails, since a
// short scratch file would test the wrong input.
inline void WriteFileOrDie(const std::string& path, const uint8_t* data, size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size != 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  if (std::fclose(f) != 0) std::abort();
}

// The whole file at `path` (tq::ReadWholeFile); aborts when it cannot be
// read, since a round-trip check would compare against nothing.
inline std::vector<uint8_t> ReadFileOrDie(const std::string& path) {
  auto bytes = tq::ReadWholeFile(path);
  if (!bytes.ok()) std::abort();
  return std::move(*bytes);
}

// The scratch file `name` holding the input; returns its path.
inline std::string ScratchFile(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = ScratchDir() + "/" + name;
  WriteFileOrDie(path, data, size);
  return path;
}

// DIR of TQ_FUZZ_WRITE_SEEDS, or nullptr: when set, LLVMFuzzerInitialize
// writes valid files there to seed the corpus.
inline const char* SeedDir() { return std::getenv("TQ_FUZZ_WRITE_SEEDS"); }

inline void WriteSeed(const std::string& name, const std::vector<uint8_t>& bytes) {
  if (const char* dir = SeedDir()) WriteFileOrDie(std::string(dir) + "/" + name, bytes.data(), bytes.size());
}

inline void AppendLE32(std::vector<uint8_t>* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}

}  // namespace tq::fuzz

#endif  // TQ_FUZZ_FUZZ_UTIL_H_
