// Shared helpers of the tq command-line tool: tables for people, progress on
// stderr, SVG line plots.
#ifndef TQ_TOOLS_COMMON_H_
#define TQ_TOOLS_COMMON_H_

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "tq/status.h"

namespace tq::tools {

// A text table: header, rows of cells, right-aligned columns.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void AddRow(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  void Print(std::FILE* out) const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

// Prints "tq: error: <status>" on stderr and exits with status 2.
[[noreturn]] void Fail(const Status& s);

// Parses "2,4,8" into integers in [lo, hi]; fails naming `flag` otherwise.
std::vector<int> ParseIntList(const std::string& s, const char* flag, int lo, int hi);

std::string Fmt(double v, int significant = 4);      // %.4g-style
std::string FmtFixed(double v, int decimals = 3);    // %.3f-style

// "progress: <what> 3/4 (75%), 1.2 s" on stderr, at most a few times a second.
class Progress {
 public:
  explicit Progress(std::string what) : what_(std::move(what)) {}
  void Update(size_t done, size_t total);
  void Done();

 private:
  std::string what_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_{};
};

struct Series {
  std::string name;
  std::vector<double> x;
  std::vector<double> y;
  bool dashed = false;
};

struct PlotSpec {
  std::string title;
  std::string x_label;
  std::string y_label;
  bool log_y = false;
  std::vector<Series> series;
};

// Writes an SVG line plot. Errors: a path not ending in .svg (lists what is
// accepted), an empty plot, non-positive values on a log axis, I/O failure.
Status WriteSvgPlot(const std::string& path, const PlotSpec& plot);

}  // namespace tq::tools

#endif  // TQ_TOOLS_COMMON_H_
