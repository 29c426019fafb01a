#!/usr/bin/env bash
# A two-domain corpus from files the built-in corpus never reads (issue 25: does per-layer
# control hold on data the project was not tuned on?): 400 Python files of the installed
# `transformers` package (domain pkgcode) and 600 Markdown/reST files from site-packages
# (domain pkgdocs), copied as .txt into DIR (default /tmp/unseen). The built-in `code` domain
# reads only the CPython standard library, which skips site-packages.
set -eu  # no pipefail: `head` closes the pipe of `sort` on purpose
OUT=${1:-/tmp/unseen}
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
rm -rf "$OUT"; mkdir -p "$OUT/pkgcode" "$OUT/pkgdocs"
find "$SP/transformers" -name "*.py" | sort | head -400 | while read -r f; do
  cp "$f" "$OUT/pkgcode/$(echo "$f" | md5sum | cut -c1-12).txt"; done
find "$SP" \( -name "*.md" -o -name "*.rst" \) | sort | head -600 | while read -r f; do
  cp "$f" "$OUT/pkgdocs/$(echo "$f" | md5sum | cut -c1-12).txt"; done
du -sh "$OUT"/*
