"""ms/token of `rocketllm generate` under OpenMP wait policies and thread counts, idle and with a competing
CPU-bound process.

    python benchmarks/openmp_wait.py SHARD_DIR [ROUNDS]

The first column is rocketllm's default (OpenMP's own spin, compute threads following the free cores); the others fix
the thread count at the machine's cores (OMP_NUM_THREADS turns the following off) under each wait policy, the
earlier default GOMP_SPINCOUNT=1000 among them. Prints each run as it goes, then the Markdown table
docs/HARDWARE.md shows ("OpenMP threads").
"""

import json
import os
import subprocess
import sys

SHARDS = sys.argv[1]
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
CORES = str(len(os.sched_getaffinity(0)))
POLICIES = {
    "default: OpenMP's spin, threads follow the free cores": {},
    f"OpenMP's spin, {CORES} threads": {"OMP_NUM_THREADS": CORES},
    f"GOMP_SPINCOUNT=1000, {CORES} threads": {"GOMP_SPINCOUNT": "1000", "OMP_NUM_THREADS": CORES},
    f"PASSIVE, {CORES} threads": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": CORES},
}
REGIMES = {
    "resident": ["--device-cache-bytes", "1TB"],
    "storage": ["--device-cache-bytes", "0", "--host-cache-bytes", "0"],
}


def run(env_extra, regime):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env.update(env_extra)
    cmd = [
        sys.executable,
        "-m",
        "rocketllm_cli",
        "generate",
        SHARDS,
        "The history of computing is",
        "--raw",
        "-n",
        "48",
        "--json",
        *REGIMES[regime],
    ]
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
        if hog:
            hog.kill()
print()
print("| regime, machine | " + " | ".join(POLICIES) + " |")
print("|---|" + "---|" * len(POLICIES))
for load in ("idle", "busy"):
    for regime in REGIMES:
        cells = [" / ".join(f"{v:.0f}" for v in results[(load, regime, n)]) for n in POLICIES]
        print(f"| {os.path.basename(SHARDS.rstrip('/'))} {regime}, {load} | " + " | ".join(cells) + " |")
