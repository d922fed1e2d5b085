// Whole-file I/O shared by every persisted format: crash-safe writes and
// whole-file reads. Internal header.
#ifndef TQ_SRC_CORE_FILE_IO_H_
#define TQ_SRC_CORE_FILE_IO_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tq/status.h"

namespace tq {

// Writes a file so that a reader of `path` sees either the previous file or
// the complete new one, whatever happens meanwhile (the process killed, the
// machine losing power, the disk filling up):
//   1. the bytes go to a temporary file beside `path`, named
//      path.tmp.<pid>.<thread id>.<counter> and created with O_EXCL, so no two
//      writers (threads of one process or several processes) ever share one;
//   2. Commit() fsyncs it, renames it over `path`, then fsyncs the directory
//      so that the rename itself survives a power loss.
// Any error (ENOSPC, EFBIG, EIO, ...) removes the temporary file and leaves
// `path` as it was; the message names the file and the system's reason.
// Destroying a writer without Commit() also removes the temporary file. A
// process killed between steps may leave a temporary file behind, never a
// damaged `path`. Not thread-safe: one writer per thread.
class AtomicFileWriter {
 public:
  static Result<AtomicFileWriter> Open(const std::string& path);
  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&&) = delete;
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter();

  Status Write(std::span<const uint8_t> bytes);
  Status Commit();
  const std::string& temp_path() const { return tmp_; }

 private:
  AtomicFileWriter(std::string path, std::string tmp, int fd) : path_(std::move(path)), tmp_(std::move(tmp)), fd_(fd) {}
  Status Abandon(const std::string& what, int err);

  std::string path_, tmp_;
  int fd_ = -1;  // -1 once committed or abandoned
};

// One-shot form of AtomicFileWriter: Open, Write(bytes), Commit.
Status WriteFileAtomic(const std::string& path, std::span<const uint8_t> bytes);
Result<std::vector<uint8_t>> ReadWholeFile(const std::string& path);

}  // namespace tq

#endif  // TQ_SRC_CORE_FILE_IO_H_
