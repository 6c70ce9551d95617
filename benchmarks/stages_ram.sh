#!/usr/bin/env bash
# Two pipeline ranks, each under a memory cap, against one process streaming under the same cap: ms/token side by side,
# with the link time per token. Needs a with-ram tool (a memory cgroup per command; see docs/HARDWARE.md).
#
#   WITH_RAM=path/to/with-ram benchmarks/stages_ram.sh SHARD_DIR CAP [TOKENS] [RUNS]
#
# Every run starts cold (the shard files evicted from the page cache); speculation is off in both, so the rows compare
# the weights' bytes, not how repetitive the text is.
set -euo pipefail
shards=$1; cap=$2; tokens=${3:-16}; runs=${4:-2}
with_ram=${WITH_RAM:?set WITH_RAM to the with-ram tool}
py=${PYTHON:-python}
prompt="The capital of France is"
args=(generate "$shards" "$prompt" --raw -n "$tokens" --speculate off --json)
stat() { "$py" -c '
import json, sys
d = json.loads(sys.stdin.read()); s = d["stats"]; st = s.get("stages") or {}; ph = s.get("phase_seconds_per_token") or {}
print("%.1f ms/token; served/token %s; witnessed storage (rank 0) %s; links %.2f ms/token; other ranks %.1f ms/token; %s" % (
    s["per_token_ms"], s["bytes_per_token"], s.get("storage_bytes_per_token_witnessed"), 1000 * ph.get("stages: links", 0),
    1000 * ph.get("stages: other ranks computing", 0), st.get("plan", "one process")))'; }
for run in $(seq "$runs"); do
  echo "== run $run: one process under $cap"
  ROCKETLLM_KEEP_ALIVE=0 "$with_ram" --evict "$shards" "$cap" -- "$py" -m rocketllm_cli "${args[@]}" 2>/tmp/stages-one.err | stat
  grep "with-ram" /tmp/stages-one.err || true
  echo "== run $run: two ranks, each under $cap"
  port=$(( 29600 + RANDOM % 300 ))
  for r in 1 0; do
    env RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port ROCKETLLM_KEEP_ALIVE=0 \
      "$with_ram" --evict "$shards" "$cap" -- "$py" -m rocketllm_cli "${args[@]}" >"/tmp/stages-$r.out" 2>"/tmp/stages-$r.err" &
  done
  wait
  stat < /tmp/stages-0.out
  grep "with-ram" /tmp/stages-0.err /tmp/stages-1.err || true
done
