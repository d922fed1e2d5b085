#!/usr/bin/env bash
# Guard for the docs and the source layout (CTest: docs_guard).
#  1. README.md and docs/*.md speak of the system, not of how or when the work
#     was done: no session talk, issue numbers, "run N" labels or lent machines.
#  2. No hand-written source file under src/ include/ cuda/ python/ tests/
#     bench/ tools/ is longer than MAX_LINES (generated files are exempt: a
#     "generated" / "do not edit" marker in their first 5 lines).
# Prints file:line for every finding and exits 1 if there is any.
#   scripts/check_docs.sh [REPO_ROOT]
set -euo pipefail
root=${1:-"$(cd "$(dirname "$0")/.." && pwd)"}
cd "$root"

MAX_LINES=1500
# Over the limit, being split by concern: reported as warnings until they are
# (none now; the mechanism stays for the next such split).
ALLOW_LONG=()

# History words, matched case-insensitively (grep -P). Each one is phrased so
# that ordinary prose does not hit it: "run 1.05x", "runs 16 vpdpwssd" and
# "issue 4 a cycle" are figures, "run 13", "runs 5 and 6" and "issue 8" are
# labels of the work; "a lent machine" is history, "tensors lent to a layer" is not.
HISTORY_PATTERNS=(
  '\bsessions?\b'
  '\bthis session\b'
  '\bissue #?[0-9]+\b(?! ?(?:a|an|per|instructions?|operations?|ops)\b)'
  '\bissues #?[0-9]+ ?(?:,|and|to|[–-])'
  '\(issue\b'
  '\brun [0-9]+\b(?![.,][0-9])(?! ?(?:ms|s|µs|us|ns|x|×|%|times?|tokens|threads|reps|rounds)\b)'
  '\bruns [0-9]+ ?(?:[–-]|and|to) ?[0-9]'
  '\blent (?:machines?|devices?|GPUs?|cards?|H[12]00s?)\b|\b(?:was|were|been|is|are|be) lent\b'
  '\byesterday\b'
)

fail=0
docs=(README.md)
for f in docs/*.md; do docs+=("$f"); done
for pat in "${HISTORY_PATTERNS[@]}"; do
  while IFS= read -r hit; do
    [ -n "$hit" ] || continue
    file=${hit%%:*}; rest=${hit#*:}; line=${rest%%:*}; text=${rest#*:}
    echo "check_docs: $file:$line: history word (/$pat/): ${text:0:120}" >&2
    fail=1
  done < <(grep -niP -- "$pat" "${docs[@]}" /dev/null || true)
done

is_allowed() {
  local f
  for f in "${ALLOW_LONG[@]}"; do [ "$1" = "$f" ] && return 0; done
  return 1
}

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t sources < <(git ls-files --cached --others --exclude-standard -- \
    src include cuda python tests bench tools)
else
  mapfile -t sources < <(find src include cuda python tests bench tools -type f 2>/dev/null)
fi
for f in "${sources[@]}"; do
  [ -f "$f" ] || continue
  case "$f" in
    *.h|*.hh|*.hpp|*.c|*.cc|*.cpp|*.cu|*.cuh|*.in|*.py|*.pyi|*.sh|*.cmake|*CMakeLists.txt) ;;
    *) continue ;;
  esac
  n=$(wc -l < "$f")
  [ "$n" -gt "$MAX_LINES" ] || continue
  if head -n 5 "$f" | grep -qiE 'generated|do not edit'; then continue; fi
  if is_allowed "$f"; then
    echo "check_docs: warning: $f:$n: $n lines (limit $MAX_LINES; allowlisted while it is split)" >&2
  else
    echo "check_docs: $f:$n: $n lines, over the $MAX_LINES-line limit for a hand-written source file" >&2
    fail=1
  fi
done

if [ "$fail" -ne 0 ]; then
  echo "check_docs: FAILED" >&2
  exit 1
fi
echo "check_docs: ok"
