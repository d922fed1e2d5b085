#include "core/file_io.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

namespace tq {
namespace {

// Distinguishes the temporary files of one thread: a thread saving twice
// (or a fork child inheriting the parent's thread id) never reuses a name.
std::atomic<uint64_t> temp_counter{0};

std::string TempName(const std::string& path) {
  const long tid = ::syscall(SYS_gettid);
  return path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(tid) + "." +
         std::to_string(temp_counter.fetch_add(1, std::memory_order_relaxed));
}

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

Result<AtomicFileWriter> AtomicFileWriter::Open(const std::string& path) {
  if (path.empty()) return InvalidArgumentError("cannot save to an empty path");
  std::string tmp = TempName(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    return IoError("cannot save " + path + ": cannot create the temporary file " + tmp + ": " +
                   std::strerror(errno));
  }
  return AtomicFileWriter(path, std::move(tmp), fd);
}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept
    : path_(std::move(other.path_)), tmp_(std::move(other.tmp_)), fd_(std::exchange(other.fd_, -1)) {}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

Status AtomicFileWriter::Abandon(const std::string& what, int err) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_.c_str());
  return IoError("cannot save " + path_ + ": " + what + " " + tmp_ + " failed: " + std::strerror(err) +
                 (err == ENOSPC || err == EFBIG || err == EDQUOT
                      ? " (no space or file size limit; the previous " + path_ + " is unchanged)"
                      : " (the previous " + path_ + " is unchanged)"));
}

Status AtomicFileWriter::Write(std::span<const uint8_t> bytes) {
  if (fd_ < 0) return FailedPreconditionError("cannot save " + path_ + ": the writer is already closed");
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Abandon("writing", errno);
    }
    done += static_cast<size_t>(w);
  }
  return Status::Ok();
}

Status AtomicFileWriter::Commit() {
  if (fd_ < 0) return FailedPreconditionError("cannot save " + path_ + ": the writer is already closed");
  if (::fsync(fd_) != 0) return Abandon("flushing", errno);
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    return IoError("cannot save " + path_ + ": closing " + tmp_ + " failed: " + std::strerror(err) +
                   " (the previous " + path_ + " is unchanged)");
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    return IoError("cannot save " + path_ + ": renaming " + tmp_ + " over it failed: " + std::strerror(err) +
                   " (the previous " + path_ + " is unchanged)");
  }
  // The new file is in place; make the rename durable. A file system that
  // cannot sync a directory (EINVAL) gives no stronger promise to ask for.
  const std::string dir = DirectoryOf(path_);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) {
    return IoError("saved " + path_ + " but cannot open its directory " + dir + " to sync it: " +
                   std::strerror(errno) + " (a power loss now may restore the previous file)");
  }
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  if (rc != 0 && err != EINVAL && err != EROFS) {
    return IoError("saved " + path_ + " but syncing its directory " + dir + " failed: " + std::strerror(err) +
                   " (a power loss now may restore the previous file)");
  }
  return Status::Ok();
}

Status WriteFileAtomic(const std::string& path, std::span<const uint8_t> bytes) {
  TQ_ASSIGN_OR_RETURN(AtomicFileWriter w, AtomicFileWriter::Open(path));
  TQ_RETURN_IF_ERROR(w.Write(bytes));
  return w.Commit();
}

Result<std::vector<uint8_t>> ReadWholeFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return IoError("cannot open " + path + ": " + std::strerror(errno));
  std::vector<uint8_t> out;
  uint8_t buf[1 << 16];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), f)) > 0) out.insert(out.end(), buf, buf + got);
  const bool err = std::ferror(f) != 0;
  std::fclose(f);
  if (err) return IoError("cannot read " + path);
  return out;
}

}  // namespace tq
