"""ms/token of `rocketllm generate` under OpenMP wait policies, idle and with a competing CPU-bound process.

    python benchmarks/openmp_wait.py SHARD_DIR [ROUNDS]

Prints each run as it goes, then the Markdown table docs/HARDWARE.md shows ("OpenMP wait policy").
"""
import json
import os
import subprocess
import sys

SHARDS = sys.argv[1]
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
POLICIES = {
    "OpenMP default (GOMP_SPINCOUNT=300000)": {"GOMP_SPINCOUNT": "300000"},
    "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "GOMP_SPINCOUNT=100000": {"GOMP_SPINCOUNT": "100000"},
}
REGIMES = {"resident": ["--device-cache-bytes", "1TB"], "storage": ["--device-cache-bytes", "0", "--host-cache-bytes", "0"]}
def run(env_extra, regime):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env.update(env_extra)
    cmd = [sys.executable, "-m", "rocketllm_cli", "generate", SHARDS, "The history of computing is", "--raw", "-n", "24", "--json", *REGIMES[regime]]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    doc = json.loads(out.stdout)
    return doc["stats"]["per_token_ms"]
results = {}
for load in ("idle", "busy"):
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
    try:
        for r in range(ROUNDS):
            for regime in REGIMES:
                for name, env in POLICIES.items():
                    ms = run(env, regime)
                    results.setdefault((load, regime, name), []).append(ms)
                    print(load, regime, name, ms, flush=True)
    finally:
        if hog: hog.kill()
print()
print("| regime, machine | " + " | ".join(POLICIES) + " |")
print("|---|" + "---|" * len(POLICIES))
for load in ("idle", "busy"):
    for regime in REGIMES:
        cells = [" / ".join(f"{v:.0f}" for v in results[(load, regime, n)]) for n in POLICIES]
        print(f"| SmolLM2-135M bf16 {regime}, {load} | " + " | ".join(cells) + " |")
