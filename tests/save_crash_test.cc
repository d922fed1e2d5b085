// Crash-safe saves (src/core/file_io.{h,cc}, behind KVCache::Save,
// FlatIndex::Save and every other saved format):
//   - a child process saving two alternating contents in a loop, killed with
//     SIGKILL at a random point, 240 times: the file always loads and equals
//     one of the two contents (the previous one or the complete new one);
//   - threads saving to one path at once never share a temporary file;
//   - a full disk (a small tmpfs mounted in a private mount namespace) and a
//     file size limit (RLIMIT_FSIZE): a clear error naming the file and the
//     reason, the previous file intact, no temporary file left behind.
#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/file_io.h"
#include "tq/index.h"
#include "tq/kv_cache.h"
#include "tq/random.h"

namespace tq {
namespace {

using Clock = std::chrono::steady_clock;

// A fresh directory under TMPDIR (or /tmp), removed with its files at the end.
class ScratchDir {
 public:
  ScratchDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/tq_save_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) != nullptr) path_ = buf.data();
  }
  ~ScratchDir() {
    if (path_.empty()) return;
    for (const auto& f : Files()) ::unlink((path_ + "/" + f).c_str());
    ::rmdir(path_.c_str());
  }
  const std::string& path() const { return path_; }
  std::vector<std::string> Files() const {
    std::vector<std::string> out;
    DIR* d = ::opendir(path_.c_str());
    if (d == nullptr) return out;
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") out.push_back(name);
    }
    ::closedir(d);
    return out;
  }
  // Temporary files left by a save (names containing ".tmp.").
  std::vector<std::string> TempFiles() const {
    std::vector<std::string> out;
    for (const auto& f : Files()) {
      if (f.find(".tmp.") != std::string::npos) out.push_back(f);
    }
    return out;
  }

 private:
  std::string path_;
};

KVCache MakeCache(uint64_t seed, size_t tokens) {
  auto c = KVCache::Create({.shape = {2, 2, 64}, .max_sequences = 1, .preset = "k4_v4"});
  TQ_CHECK(c.ok());
  GaussianStream g(seed);
  std::vector<float> k(tokens * 2 * 64), v(k.size());
  for (auto& x : k) x = static_cast<float>(g.Next());
  for (auto& x : v) x = static_cast<float>(g.Next());
  for (size_t layer = 0; layer < 2; ++layer) TQ_CHECK(c->Append(layer, 0, k, v).ok());
  return std::move(*c);
}

FlatIndex MakeIndex(uint64_t seed, size_t n) {
  auto index = FlatIndex::Create({.dim = 96, .bits = 4, .seed = seed});
  TQ_CHECK(index.ok());
  GaussianStream g(seed);
  std::vector<float> x(n * 96);
  for (auto& e : x) e = static_cast<float>(g.Next());
  TQ_CHECK(index->Add(x).ok());
  return std::move(*index);
}

// The bytes now at `path` as its loader reads them back (empty when it does
// not load), and the loader's message.
template <typename T>
std::vector<uint8_t> LoadedBytes(const std::string& path, std::string* error) {
  auto loaded = T::Load(path);
  if (!loaded.ok()) {
    *error = loaded.status().ToString();
    return {};
  }
  return loaded->Serialize();
}

// Runs `body` in a child process; returns its exit code (-signal when killed).
int RunInChild(const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) _exit(body());
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

struct KillStats {
  size_t trials = 0, old_content = 0, new_content = 0, temp_left = 0;
};

// One object type: `a` saved first, then `trials` times a child saves b, a,
// b, a, ... in a loop and is killed with SIGKILL after a random delay of 0
// to 3 save times; the file must load and equal a or b.
template <typename T>
KillStats KillDuringSaves(const T& a, const T& b, size_t trials, const std::string& path, const ScratchDir& dir,
                          uint64_t seed) {
  KillStats st;
  const std::vector<uint8_t> bytes_a = a.Serialize(), bytes_b = b.Serialize();
  EXPECT_NE(bytes_a, bytes_b);
  EXPECT_TRUE(a.Save(path).ok());
  const auto t0 = Clock::now();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE((i % 2 ? a : b).Save(path).ok());
  EXPECT_TRUE(a.Save(path).ok());
  const double save_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / 4;
  SplitMix64 rng(seed);
  for (size_t t = 0; t < trials; ++t) {
    int ready[2];
    EXPECT_EQ(::pipe(ready), 0);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(ready[0]);
      const char go = 1;
      if (::write(ready[1], &go, 1) != 1) _exit(3);
      for (;;) {
        if (!b.Save(path).ok() || !a.Save(path).ok()) _exit(4);
      }
    }
    ::close(ready[1]);
    char go = 0;
    EXPECT_EQ(::read(ready[0], &go, 1), 1);
    ::close(ready[0]);
    const auto delay = std::chrono::microseconds(static_cast<int64_t>(rng.NextDouble() * 3.0 * save_us));
    std::this_thread::sleep_for(delay);
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "the saving child failed on its own";
    std::string error;
    const std::vector<uint8_t> now = LoadedBytes<T>(path, &error);
    ++st.trials;
    if (now == bytes_a) {
      ++st.old_content;
    } else if (now == bytes_b) {
      ++st.new_content;
    } else {
      ADD_FAILURE() << "trial " << t << ": " << path << " is neither saved content: " << error;
    }
    const auto temps = dir.TempFiles();
    if (!temps.empty()) ++st.temp_left;
    for (const auto& f : temps) ::unlink((dir.path() + "/" + f).c_str());
  }
  return st;
}

TEST(SaveCrash, KillAtRandomPointsLeavesAWholeFile) {
  ScratchDir dir;
  ASSERT_FALSE(dir.path().empty());
  const auto t0 = Clock::now();
  const KVCache ca = MakeCache(1, 1500), cb = MakeCache(2, 2000);
  const KillStats kv = KillDuringSaves(ca, cb, 120, dir.path() + "/cache.tqkv", dir, 11);
  const FlatIndex ia = MakeIndex(3, 2000), ib = MakeIndex(4, 3000);
  const KillStats ix = KillDuringSaves(ia, ib, 120, dir.path() + "/index.tqi", dir, 12);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  for (const auto& [name, st] : {std::pair{"KVCache", kv}, std::pair{"FlatIndex", ix}}) {
    std::printf("%s: %zu kills: previous content %zu, new content %zu, temporary file left %zu\n", name,
                st.trials, st.old_content, st.new_content, st.temp_left);
    EXPECT_EQ(st.old_content + st.new_content, st.trials) << name;
  }
  std::printf("240 kills in %.1f s\n", secs);
  // The kills landed both between saves and inside them (a temporary file
  // was being written): the test exercised what it claims to.
  EXPECT_GT(kv.temp_left + ix.temp_left, 0u);
  EXPECT_GT(kv.new_content + ix.new_content, 0u);
}

TEST(SaveCrash, ThreadsSavingOnePathNeverShareATemporaryFile) {
  ScratchDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string path = dir.path() + "/cache.tqkv";
  std::vector<KVCache> caches;
  std::vector<std::vector<uint8_t>> bytes;
  for (uint64_t s = 0; s < 8; ++s) {
    caches.push_back(MakeCache(100 + s, 200 + 50 * s));
    bytes.push_back(caches.back().Serialize());
  }
  std::vector<std::thread> threads;
  std::vector<int> failures(8, 0);
  for (size_t t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) failures[t] += caches[t].Save(path).ok() ? 0 : 1;
    });
  }
  for (auto& th : threads) th.join();
  for (size_t t = 0; t < 8; ++t) EXPECT_EQ(failures[t], 0) << "thread " << t;
  std::string error;
  const std::vector<uint8_t> now = LoadedBytes<KVCache>(path, &error);
  bool one_of_them = false;
  for (const auto& b : bytes) one_of_them = one_of_them || now == b;
  EXPECT_TRUE(one_of_them) << error;
  EXPECT_TRUE(dir.TempFiles().empty());
}

TEST(SaveCrash, UnfinishedWriterRemovesItsTemporaryFile) {
  ScratchDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string path = dir.path() + "/f.bin";
  ASSERT_TRUE(WriteFileAtomic(path, std::vector<uint8_t>{1, 2, 3}).ok());
  std::string tmp;
  {
    auto w = AtomicFileWriter::Open(path);
    ASSERT_TRUE(w.ok());
    tmp = w->temp_path();
    EXPECT_NE(tmp.find(path + ".tmp." + std::to_string(::getpid()) + "."), std::string::npos) << tmp;
    ASSERT_TRUE(w->Write(std::vector<uint8_t>{9, 9}).ok());
    EXPECT_EQ(::access(tmp.c_str(), F_OK), 0);
  }  // destroyed without Commit
  EXPECT_NE(::access(tmp.c_str(), F_OK), 0);
  auto back = ReadWholeFile(path);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, (std::vector<uint8_t>{1, 2, 3}));
  // Two writers of one thread get different names.
  auto w1 = AtomicFileWriter::Open(path);
  auto w2 = AtomicFileWriter::Open(path);
  ASSERT_TRUE(w1.ok() && w2.ok());
  EXPECT_NE(w1->temp_path(), w2->temp_path());
  EXPECT_TRUE(w1->Commit().ok());
  EXPECT_EQ(w1->Commit().code(), StatusCode::kFailedPrecondition);
  // A directory that does not exist: a clear error.
  const Status missing = WriteFileAtomic(dir.path() + "/no/such/dir/f.bin", std::vector<uint8_t>{1});
  EXPECT_EQ(missing.code(), StatusCode::kIoError);
  EXPECT_NE(missing.message().find("No such file or directory"), std::string::npos) << missing.ToString();
}

// Checks, in the process that hit the limit, that `save` failed clearly and
// that `path` still holds `old_bytes`; returns 0 when all holds, else prints
// why and returns 1.
int CheckRefusedSave(const Status& save, const std::string& reason, const std::string& path,
                     const std::vector<uint8_t>& old_bytes, const ScratchDir& dir) {
  if (save.ok()) {
    std::fprintf(stderr, "the save succeeded past the limit\n");
    return 1;
  }
  const std::string m = save.ToString();
  if (m.find(reason) == std::string::npos || m.find(path) == std::string::npos ||
      m.find("unchanged") == std::string::npos) {
    std::fprintf(stderr, "unclear error: %s\n", m.c_str());
    return 1;
  }
  std::string error;
  if (LoadedBytes<KVCache>(path, &error) != old_bytes) {
    std::fprintf(stderr, "the previous file did not survive: %s\n", error.c_str());
    return 1;
  }
  if (!dir.TempFiles().empty()) {
    std::fprintf(stderr, "a temporary file was left: %s\n", dir.TempFiles()[0].c_str());
    return 1;
  }
  std::fprintf(stderr, "refused as expected: %s\n", m.c_str());
  return 0;
}

TEST(SaveCrash, FileSizeLimitGivesAClearErrorAndKeepsTheOldFile) {
  // RLIMIT_FSIZE (what `ulimit -f` sets) needs no privilege: writes past it
  // fail with EFBIG once SIGXFSZ is ignored.
  ScratchDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string path = dir.path() + "/cache.tqkv";
  const KVCache small = MakeCache(5, 300), large = MakeCache(6, 3000);
  const std::vector<uint8_t> small_bytes = small.Serialize();
  ASSERT_LT(small_bytes.size() + 4096, large.Serialize().size());
  ASSERT_TRUE(small.Save(path).ok());
  const int rc = RunInChild([&] {
    ::signal(SIGXFSZ, SIG_IGN);
    const rlim_t limit = small_bytes.size() + 4096;
    const rlimit r{limit, limit};
    if (::setrlimit(RLIMIT_FSIZE, &r) != 0) return 2;
    return CheckRefusedSave(large.Save(path), "File too large", path, small_bytes, dir);
  });
  EXPECT_EQ(rc, 0);
  std::string error;
  EXPECT_EQ(LoadedBytes<KVCache>(path, &error), small_bytes) << error;
}

TEST(SaveCrash, FullDiskGivesAClearErrorAndKeepsTheOldFile) {
  // A tmpfs of both files' size + 512 KiB in a private mount namespace of a
  // child process (root, or an unprivileged user namespace where the kernel
  // allows one), filled up but for 64 KiB before a larger save.
  ScratchDir dir;
  ASSERT_FALSE(dir.path().empty());
  const KVCache small = MakeCache(7, 300), large = MakeCache(8, 3000);
  const std::vector<uint8_t> small_bytes = small.Serialize(), large_bytes = large.Serialize();
  ASSERT_GT(large_bytes.size(), size_t{128} << 10);
  // Room for both files and some: the large save fits once the filler is gone.
  const size_t fs_kib = (small_bytes.size() + large_bytes.size()) / 1024 + 512;
  int why[2];
  ASSERT_EQ(::pipe(why), 0);
  const int rc = RunInChild([&] {
    ::close(why[0]);
    auto skip = [&](const std::string& reason) {
      const std::string m = reason + ": " + std::strerror(errno);
      (void)!::write(why[1], m.data(), m.size());
      return 77;
    };
    const uid_t uid = ::geteuid();
    const gid_t gid = ::getegid();
    if (uid != 0) {
      if (::unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) return skip("unshare(CLONE_NEWUSER | CLONE_NEWNS)");
      auto write_file = [](const char* f, const std::string& s) {
        const int fd = ::open(f, O_WRONLY);
        const bool ok = fd >= 0 && ::write(fd, s.data(), s.size()) == static_cast<ssize_t>(s.size());
        if (fd >= 0) ::close(fd);
        return ok;
      };
      write_file("/proc/self/setgroups", "deny");
      if (!write_file("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1") ||
          !write_file("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1")) {
        return skip("writing the user namespace's uid_map");
      }
    } else if (::unshare(CLONE_NEWNS) != 0) {
      return skip("unshare(CLONE_NEWNS)");
    }
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return skip("making mounts private");
    const std::string size = "size=" + std::to_string(fs_kib) + "k";
    if (::mount("tmpfs", dir.path().c_str(), "tmpfs", 0, size.c_str()) != 0) return skip("mounting a tmpfs");
    const std::string path = dir.path() + "/cache.tqkv";
    if (!small.Save(path).ok()) return 2;
    struct statvfs fs {};
    if (::statvfs(dir.path().c_str(), &fs) != 0) return 2;
    const size_t free_bytes = fs.f_bavail * fs.f_frsize;
    const size_t fill = free_bytes > (size_t{64} << 10) ? free_bytes - (size_t{64} << 10) : 0;
    {
      const std::vector<uint8_t> filler(fill, 0xAB);
      const int fd = ::open((dir.path() + "/filler").c_str(), O_WRONLY | O_CREAT, 0644);
      if (fd < 0 || ::write(fd, filler.data(), filler.size()) != static_cast<ssize_t>(filler.size())) return 2;
      ::close(fd);
    }
    int result = CheckRefusedSave(large.Save(path), "No space left on device", path, small_bytes, dir);
    // Space freed: the same save now succeeds.
    ::unlink((dir.path() + "/filler").c_str());
    if (result == 0) {
      const Status again = large.Save(path);
      std::string error;
      if (!again.ok() || LoadedBytes<KVCache>(path, &error) != large_bytes) {
        std::fprintf(stderr, "saving after the space was freed: %s %s\n", again.ToString().c_str(), error.c_str());
        result = 1;
      }
    }
    ::umount(dir.path().c_str());
    return result;
  });
  ::close(why[1]);
  char buf[512] = {};
  const ssize_t got = ::read(why[0], buf, sizeof(buf) - 1);
  ::close(why[0]);
  if (rc == 77) GTEST_SKIP() << "no tmpfs can be mounted here (" << std::string(buf, got > 0 ? got : 0)
                             << "); FileSizeLimitGivesAClearErrorAndKeepsTheOldFile covers a refused write";
  EXPECT_EQ(rc, 0);
}

}  // namespace
}  // namespace tq
