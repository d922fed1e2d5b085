#include "options.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "common.h"
#include "tq/status.h"

namespace tq::tools {
namespace {

std::string RangeText(uint64_t lo, uint64_t hi, const std::string& what) {
  return std::to_string(lo) + ".." + std::to_string(hi) + (what.empty() ? "" : " (" + what + ")");
}

std::string Quoted(const std::string& s) {
  constexpr size_t kShown = 40;  // a pasted megabyte is not echoed back whole
  return "'" + (s.size() > kShown ? s.substr(0, kShown) + "..." : s) + "'";
}

}  // namespace

CLI::Validator IntegerIn(uint64_t lo, uint64_t hi, const std::string& what) {
  const std::string range = RangeText(lo, hi, what);
  return CLI::Validator(
      [lo, hi, range](std::string& s) -> std::string {
        const std::string wanted = "must be an integer in " + range + ", got " + Quoted(s);
        if (s.empty()) return wanted;
        uint64_t v = 0;
        for (char c : s) {
          if (c < '0' || c > '9') return wanted;
          if (__builtin_mul_overflow(v, uint64_t{10}, &v) ||
              __builtin_add_overflow(v, static_cast<uint64_t>(c - '0'), &v)) {
            return wanted;
          }
        }
        if (v < lo || v > hi) return wanted;
        s = std::to_string(v);
        return std::string();
      },
      "INT in " + std::to_string(lo) + ".." + std::to_string(hi));
}

CLI::Validator RealIn(double lo, double hi, const std::string& what) {
  const std::string range = Fmt(lo, 10) + ".." + Fmt(hi, 10);
  const std::string full = range + (what.empty() ? "" : " (" + what + ")");
  return CLI::Validator(
      [lo, hi, full](std::string& s) -> std::string {
        const std::string wanted = "must be a number in " + full + ", got " + Quoted(s);
        if (s.empty()) return wanted;
        char* end = nullptr;
        errno = 0;
        const double v = std::strtod(s.c_str(), &end);
        if (end != s.c_str() + s.size() || errno == ERANGE || !std::isfinite(v) || v < lo || v > hi) {
          return wanted;
        }
        return std::string();
      },
      "NUMBER in " + range);
}

uint64_t PhysicalMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

Status FitsInMemory(double bytes, const std::string& options, const std::string& how) {
  const uint64_t phys = PhysicalMemoryBytes();
  if (phys == 0 || bytes <= static_cast<double>(phys)) return Status::Ok();
  constexpr double kGiB = 1073741824.0;
  return InvalidArgumentError(options + " would need about " + Fmt(bytes / kGiB, 3) + " GiB (" + how +
                              "), more than this machine's " + Fmt(static_cast<double>(phys) / kGiB, 3) +
                              " GiB of memory; lower them");
}

void CheckFitsInMemory(double bytes, const std::string& options, const std::string& how) {
  if (Status s = FitsInMemory(bytes, options, how); !s.ok()) Fail(s);
}

}  // namespace tq::tools
