// Whole-file I/O shared by every persisted format: atomic writes (temp file,
// fsync, rename, fsync of the directory) and whole-file reads. Internal header.
#ifndef TQ_SRC_CORE_FILE_IO_H_
#define TQ_SRC_CORE_FILE_IO_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tq/status.h"

namespace tq {

// Writes `bytes` to `path` so that a reader sees either the old file or the
// complete new one: path.tmp.<pid>, fsync, rename over path, fsync the directory.
Status WriteFileAtomic(const std::string& path, std::span<const uint8_t> bytes);
Result<std::vector<uint8_t>> ReadWholeFile(const std::string& path);

}  // namespace tq

#endif  // TQ_SRC_CORE_FILE_IO_H_
