"""Project seconds per token for a model split over N hosts by the stage planner (distributed/stageplan.py), against one
host.

    python benchmarks/stage_projection.py --model-size 70B --weight-bits 4 --ram 32GiB --hosts 1 2 4 8

Every host is this machine as its profile measured it (compute, page cache and storage bandwidths), with --ram of
memory for weights; links are the Ethernet speeds below with their typical one-way latencies. One host is the plain
single-process plan: what fits in RAM resident, the rest streamed from storage each token.
"""

from __future__ import annotations

import argparse

from rocketllm_cli.distributed.stageplan import RankFacts, plan_stages
from rocketllm_cli.profiles import HardwareProfile, ModelFacts, parse_param_count
from rocketllm_cli.profiles.cost import tier_bandwidth
from rocketllm_cli.sizes import format_bytes, parse_bytes

LINKS = {"1 GbE": (125e6, 100e-6), "10 GbE": (1.25e9, 30e-6), "25 GbE": (3.125e9, 20e-6)}  # bytes/s, one-way latency


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-size", default="70B")
    ap.add_argument("--weight-bits", type=float, default=4.0)
    ap.add_argument("--ram", default="32GiB", help="memory each host gives weights")
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--storage-bps", type=float, default=None, help="override the measured storage bandwidth (bytes/s)")
    args = ap.parse_args()
    profile = HardwareProfile.load()
    facts = ModelFacts.from_size(parse_param_count(args.model_size), args.weight_bits)
    ram = parse_bytes(args.ram)
    compute = profile.matvec_bps() or profile.device_memory_bps
    storage = args.storage_bps or tier_bandwidth(profile, "storage")[0]
    host_bps = tier_bandwidth(profile, "host")[0]
    n = facts.num_layers
    layer = (facts.total_bytes - facts.non_layer_bytes) // n
    hidden_bytes = args.hidden * 2
    print(
        f"model {args.model_size} at {args.weight_bits:g} bits: {format_bytes(facts.total_bytes)}, {n} layers; each "
        f"host: {format_bytes(ram)} for weights, compute {compute / 1e9:.2f} GB/s, storage {storage / 1e9:.2f} GB/s "
        f"(this machine's profile); hidden state {hidden_bytes} bytes\n"
    )
    print("| hosts | " + " | ".join(f"{name}: s/token (slowest stage)" for name in LINKS) + " |")
    print("|---|" + "---|" * len(LINKS))
    for hosts in args.hosts:
        cells = []
        for bps, latency in LINKS.values():
            ranks = [
                RankFacts(
                    r,
                    f"host{r}",
                    ram,
                    0,
                    compute,
                    host_bps,
                    storage,
                    "",
                    latency if hosts > 1 else 0.0,
                    bps if hosts > 1 else 0.0,
                )
                for r in range(hosts)
            ]
            plan = plan_stages(ranks, [layer] * n, [layer] * n, facts.non_layer_bytes, 0, hidden_bytes)
            streamed = sum(t["storage"] for t in plan.stage_bytes)
            cells.append(
                f"{plan.stream_seconds:.2f} ({plan.slowest_seconds:.2f}; {format_bytes(streamed)} from storage; links "
                f"{1000 * plan.link_seconds:.2f} ms)"
            )
        print(f"| {hosts} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
