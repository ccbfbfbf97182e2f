#!/usr/bin/env bash
# Install the peer DFlash implementations that tests/test_peers.py compares against, one folder
# each, outside the venv (they are never project dependencies):
#
#   bash tests/peers_install.sh [DIR]          # DIR defaults to /tmp/dflash-peers
#   export DFLASH_PEERS=...                    # the line it prints at the end
#   .venv/bin/python -m pytest -q tests/test_peers.py tests/test_peers_variants.py
#
# Every package goes in with `pip install --no-deps --target`: the peers run on the venv's torch,
# transformers, safetensors and pydantic, never on copies of their own. PYTHON picks the interpreter
# whose pip and wheel tags are used (default .venv/bin/python).
set -euo pipefail

DIR=${1:-/tmp/dflash-peers}
PYTHON=${PYTHON:-.venv/bin/python}

ZLAB=(dflash==0.1.0)              # z-lab's PyPI wheel (newer than its GitHub HEAD: builds the sliding mask)
SPECFORGE=(specforge==0.2.0)      # = SpecForge PR #731 (per-layer-type training masks)
# speculators 0.9.0 and what its import chain needs beyond the venv, each checked by removing it:
# `import speculators` needs openai, datasets (-> multiprocess, dill, pandas) and hs_connectors (its
# pinned sibling package); loading a checkpoint needs loguru (utils/loading.py).
SPECULATORS=(
    speculators==0.9.0
    openai==3.57.0
    datasets==5.1.0
    multiprocess==0.70.19
    dill==0.4.1
    pandas==3.1.1
    hs-connectors==0.9.0
    loguru==0.7.3
)

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "peers_install: no interpreter at PYTHON=$PYTHON (run from the repository root, or set PYTHON)" >&2
    exit 1
fi
# Resolved (symlinks too) before anything is created, so a folder inside the venv is refused untouched.
DIR=$("$PYTHON" -c 'import os, sys; print(os.path.realpath(sys.argv[1]))' "$DIR")
PREFIX=$("$PYTHON" -c 'import os, sys; print(os.path.realpath(sys.prefix))')
case "$DIR/" in
    "$PREFIX"/*)
        echo "peers_install: $DIR lies inside the interpreter's environment ($PREFIX); pick a folder outside it" >&2
        exit 1
        ;;
esac
mkdir -p "$DIR"

install() {  # install FOLDER PACKAGE...
    local target="$DIR/$1"
    shift
    echo "== $target: $*"
    # --upgrade replaces what an earlier run left there; wheels only, so nothing is built.
    "$PYTHON" -m pip install --disable-pip-version-check --no-deps --only-binary=:all: --upgrade \
        --target "$target" "$@"
}

install zlab "${ZLAB[@]}"
install specforge "${SPECFORGE[@]}"
install speculators "${SPECULATORS[@]}"

echo
echo "export DFLASH_PEERS=$DIR/zlab:$DIR/specforge:$DIR/speculators"
