#!/usr/bin/env bash
# The bench runs behind docs/HARDWARE.md. Usage: benchmarks/run.sh MODEL.gguf   (BIG=1 adds the larger-than-RAM run)
set -euo pipefail

model=${1:?usage: benchmarks/run.sh path/to/SmolLM2-135M-Instruct.Q4_1.gguf}
fingerprint=$(rocketllm doctor --json | python -c 'import json,sys; print(json.load(sys.stdin)["profile"]["fingerprint"])')
out="$(dirname "$0")/results/$(date +%Y%m%d)-$fingerprint"
mkdir -p "$out"

run() {  # run NAME ARGS...: the table to NAME.md, progress and load to NAME.log
  local name=$1; shift
  echo "== $name: rocketllm bench $*" >&2
  { uptime; rocketllm bench "$@" 2>&1 >"$out/$name.md"; uptime; } >"$out/$name.log"
  cat "$out/$name.md"
}

run smollm2 "$model" --regime all --baseline transformers accelerate naive airllm
run llama-1b --synthetic llama:1B --regime all --baseline transformers accelerate naive airllm --tokens 4
run batch "$model" --batch 1 4 8

if [[ "${BIG:-0}" == 1 ]]; then
  run llama-16b --synthetic llama:16B --regime storage --tokens 2
  cache=${ROCKETLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rocketllm}
  rm -rf "$cache"/synthetic/llama-16B-seed0 "$cache"/shards/llama-16B-seed0-*  # ~64 GB back
fi
