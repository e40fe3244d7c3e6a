#!/usr/bin/env bash
# The GPU check: the default pair and the real 1.5B pair on MLX's CUDA backend (or whatever
# backend this machine's MLX has), on a machine with no network.
#
#   scripts/gpu_check.sh [--wheels DIR] [--home DIR] [--out DIR] [--pairs LIST]
#                        [--max-tokens N] [--repeats N]
#
# Bring along, from a machine with network:
#   --wheels DIR  pip wheels of macspec and everything it needs, plus mlx-cuda-13 (or -12):
#                 `pip download . "mlx[cuda13]" -d DIR` in a clone. Left out: use what is installed.
#   --home DIR    a MACSPEC_HOME holding the converted models: `macspec chat` (the default pair)
#                 and `macspec chat --pair qwen2.5-coder-1.5b` fill ~/.cache/macspec; copy it.
# For each pair present it writes to --out (default ./gpu-check):
#   doctor-<pair>.json  one target pass over 1, 2, 3, 5, 8 rows (`macspec doctor --model`);
#   bench-<pair>/       macspec plain vs default (adaptive) vs mlx-lm's plain and speculative
#                       decoding on the 6 code prompts, greedy (`macspec bench`).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
wheels="" home="" out="gpu-check" pairs="default,qwen2.5-coder-1.5b" max_tokens=128 repeats=2
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) wheels="$2"; shift 2 ;;
        --home) home="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --pairs) pairs="$2"; shift 2 ;;
        --max-tokens) max_tokens="$2"; shift 2 ;;
        --repeats) repeats="$2"; shift 2 ;;
        *) echo "gpu_check: unknown argument $1 (see the comment at the top of $0)" >&2; exit 2 ;;
    esac
done
py="${PYTHON:-python3}"
if [ -n "$wheels" ]; then
    "$py" -m venv /tmp/macspec-gpu-venv
    py=/tmp/macspec-gpu-venv/bin/python
    "$py" -m pip install -q --no-index --find-links "$wheels" macspec mlx-cuda-13 ||
        "$py" -m pip install -q --no-index --find-links "$wheels" macspec mlx-cuda-12
fi
[ -n "$home" ] && export MACSPEC_HOME="$home"
mkdir -p "$out"
"$py" -c 'import mlx.core as mx, platform; print("device:", mx.default_device(), platform.node())' |
    tee "$out/device.txt"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader |
    tee -a "$out/device.txt"

check() {  # pair name, target, draft (no target: the embedded default pair)
    local name="$1" target="${2:-}" draft="${3:-}" flags=()
    [ -n "$target" ] && flags=(--target "$target" --draft "$draft")
    [ -n "$target" ] ||
        target="$("$py" -c 'from macspec.models.default import default_target; print(default_target())')"
    echo "== $name: verification cost by rows"
    "$py" -m macspec doctor --json --model "$target" >"$out/doctor-$name.json"
    "$py" - "$out/doctor-$name.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))["verify_cost"]
print("  rows:", "  ".join(f"{n}: {c['ms'][n]} ms ({c['ratio'][n]}x)" for n in c["ms"]))
EOF
    echo "== $name: plain vs default vs mlx-lm"
    "$py" -m macspec bench "${flags[@]}" --prompts "$here/code_prompts.jsonl" \
        --methods mlx_lm,mlx_lm_spec,macspec_plain,macspec_adaptive --num-draft 4 \
        --temperature 0 --max-tokens "$max_tokens" --repeats "$repeats" --no-charts \
        --output "$out/bench-$name"
}

case ",$pairs," in *,default,*) check default ;; esac
case ",$pairs," in *,qwen2.5-coder-1.5b,*) ;; *) echo "written: $out"; exit 0 ;; esac
if "$py" -m macspec models 2>/dev/null | grep -q '^qwen2.5-coder-1.5b '; then
    check qwen2.5-coder-1.5b qwen2.5-coder-1.5b qwen2.5-coder-0.5b
else
    echo "== qwen2.5-coder-1.5b: not in the store ($("$py" -c 'from macspec.base.paths import models_dir; print(models_dir())')); skipped"
fi
echo "written: $out"
