// Numeric command-line options of the tq tool, checked before any command
// runs, and the memory check of commands whose sizes multiply.
//
// CLI11 alone parses "-1" into a size_t as 2^64 - 1 (strtoull wraps),
// "010" as octal and "1e3" as an error only for some types; these options
// accept exactly a plain decimal number within [lo, hi] and refuse anything
// else before the command's callback, so before any allocation:
//   tq distortion --samples -1
//   --samples: must be an integer in 2..100000000 (samples), got '-1'
// (CLI11 prints the message on stderr and exits with its code 105).
#ifndef TQ_TOOLS_OPTIONS_H_
#define TQ_TOOLS_OPTIONS_H_

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include <CLI/CLI.hpp>

#include "tq/status.h"

namespace tq::tools {

// Bounds shared by several commands.
inline constexpr uint64_t kMaxThreads = 1024;          // --threads (0 = every hardware thread)
inline constexpr uint64_t kMaxTokens = uint64_t{1} << 24;  // token counts and contexts: 16.8 million
inline constexpr uint64_t kMaxHeads = 4096;            // KV heads and layers (KVCache's limit)
inline constexpr uint64_t kMaxHeadDim = 4096;          // head dims of the KV benches
inline constexpr uint64_t kMaxReps = 100000;           // timed repetitions
inline constexpr uint64_t kMaxSeed = std::numeric_limits<uint64_t>::max();

// A validator accepting a plain decimal integer in [lo, hi] (no sign, no
// spaces, no exponent, no hex); it rewrites the value without leading zeros
// so that CLI11's own conversion (base 0: "010" is octal) reads the same
// number. `what` (may be empty) explains the bound in the message.
CLI::Validator IntegerIn(uint64_t lo, uint64_t hi, const std::string& what = "");

// A validator accepting a finite decimal number in [lo, hi] (strtod syntax,
// no NaN or infinity).
CLI::Validator RealIn(double lo, double hi, const std::string& what = "");

// add_option with IntegerIn(lo, hi) and the default shown in --help.
template <typename T>
CLI::Option* AddInteger(CLI::App* cmd, const std::string& name, T* value, const std::string& help, uint64_t lo,
                        uint64_t hi, const std::string& what = "") {
  static_assert(std::is_integral_v<T>);
  return cmd->add_option(name, *value, help)->transform(IntegerIn(lo, hi, what))->capture_default_str();
}

inline CLI::Option* AddReal(CLI::App* cmd, const std::string& name, double* value, const std::string& help,
                            double lo, double hi, const std::string& what = "") {
  return cmd->add_option(name, *value, help)->transform(RealIn(lo, hi, what))->capture_default_str();
}

// Physical memory of this machine in bytes (0 when unknown).
uint64_t PhysicalMemoryBytes();

// InvalidArgument when a command would need more than this machine's
// physical memory: "<options> would need about X GiB (<how>), more than this
// machine's Y GiB; lower them". `bytes` is an estimate in double so that the
// product of huge options cannot wrap.
Status FitsInMemory(double bytes, const std::string& options, const std::string& how);
// The same, failing the command (exit 2).
void CheckFitsInMemory(double bytes, const std::string& options, const std::string& how);

}  // namespace tq::tools

#endif  // TQ_TOOLS_OPTIONS_H_
