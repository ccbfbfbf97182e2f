#!/usr/bin/env bash
# The GPU check in one command, for one H200 (under 8 minutes): installs what it can, then runs
# bench/gpu_check.py. Its three steps (carried wheels, the gpu extra, the check) and settings: docs/gpu.md.
#
#     bash bench/gpu_check.sh [gpu_check.py options]          # e.g. --phases env,train
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false
if [ -z "${GPU_CHECK_INSTALL_LOG:-}" ]; then
    GPU_CHECK_INSTALL_LOG=$(mktemp /tmp/gpu_check_install.XXXXXX)
    trap 'rm -f "$GPU_CHECK_INSTALL_LOG"' EXIT
fi
export GPU_CHECK_INSTALL_LOG  # what this script installed, for the env phase's JSON
note() { echo "[gpu_check.sh] $*"; echo "$*" >> "$GPU_CHECK_INSTALL_LOG"; }

# 1. carried wheels
if compgen -G ".whl/*.whl" > /dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        note "carried wheels -> /tmp/site: $(cd .whl && ls *.whl | cut -d- -f1,2 | tr '\n' ' ')"
    else
        note "carried wheels: install FAILED"
    fi
fi

# 2. the gpu extra
online() {  # GPU_CHECK_OFFLINE=1 takes the offline path (to test it where the index answers)
    [ "${GPU_CHECK_OFFLINE:-0}" != 1 ] && "$PY" -c "import socket; socket.create_connection(('pypi.org', 443), timeout=3)" 2> /dev/null
}
has() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" = 1 ]; then
    note "gpu extra: install skipped (GPU_CHECK_SKIP_INSTALL=1)"
elif has flash_attn && has vllm; then
    note "gpu extra: flash-attn and vllm already installed"
elif online; then
    limit=${GPU_CHECK_INSTALL_TIMEOUT:-900}
    if timeout "$limit" "$PY" -m pip install -q -e '.[gpu]'; then
        note "gpu extra: pip install -e '.[gpu]' done"
    else
        note "gpu extra: pip install -e '.[gpu]' FAILED; trying the packages one by one"
        timeout "$limit" "$PY" -m pip install -q vllm && note "vllm: installed" || note "vllm: install FAILED"
        # flash-attn's setup imports torch: build it against the installed one.
        timeout "$limit" "$PY" -m pip install -q --no-build-isolation flash-attn \
            && note "flash-attn: installed" || note "flash-attn: install FAILED"
    fi
else
    note "no package index reachable: the gpu extra can only come from .whl/"
    if "$PY" -m pip install -q --no-index --find-links .whl -e '.[gpu]' > /dev/null 2>&1; then
        note "gpu extra: installed from .whl/"
    else
        for pkg in flash-attn vllm; do
            if "$PY" -m pip install -q --no-index --find-links .whl --target /tmp/site "$pkg" > /dev/null 2>&1; then
                note "$pkg: installed from .whl/"
            else
                note "$pkg: not installable offline (no wheel in .whl/)"
            fi
        done
    fi
fi

# 3. the check
timeout 470 "$PY" bench/gpu_check.py "$@"
status=$?
if [ "$status" = 124 ]; then
    echo "[gpu_check.sh] gpu_check.py ran past 470 s and was stopped; the JSON holds the phases it finished" >&2
fi
exit "$status"
