"""The stage plan: which contiguous layer range each rank runs, chosen by the cost model.

Each rank measured itself (its HardwareProfile and its knobs) and the link to the next rank. A stage's seconds per
token is the cost model's overlapped figure for the bytes it serves: the bytes that fit its device and host budgets
served from there, the rest from its storage, max(io, compute). The plan minimises the slowest stage (what bounds
micro-batches flowing through the pipeline), then the sum (what one stream waits for: its stages run one after
another, plus one hidden state over every link). Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import KnobError
from ..sizes import format_bytes


@dataclass(frozen=True)
class RankFacts:
    """What one rank measured of itself: its budgets, its tiers' bandwidths and its link to the next rank."""

    rank: int
    host: str
    device_bytes: int  # device_cache_bytes: weights it keeps on its compute device
    host_bytes: int  # host_cache_bytes: weights its host tier keeps (the page cache on a CPU)
    compute_bps: float | None  # weight bytes per second its resident forward reads (measured matvec or memory copy)
    host_bps: float | None
    storage_bps: float | None
    compute_how: str = ""
    link_latency_s: float = 0.0  # one message to the next rank in the ring
    link_bps: float = 0.0  # bytes per second to the next rank
    device: str = "cpu"


@dataclass
class StagePlan:
    """Layer ranges per rank ([start, stop)), each stage's projected seconds per token, and how they were chosen."""

    ranges: list[tuple[int, int]]
    stage_seconds: list[float | None]
    link_seconds: float  # one hidden state over every link of the ring, per token
    formula: str
    inputs: dict = field(default_factory=dict)
    source: str = "derived"  # derived | --stages
    hosts: list[str] = field(default_factory=list)
    stage_bytes: list[dict] = field(default_factory=list)  # per rank: device / host / storage bytes per token

    @property
    def stream_seconds(self) -> float | None:
        """One stream's seconds per token: every stage in turn, plus the links."""
        if any(s is None for s in self.stage_seconds):
            return None
        return sum(self.stage_seconds) + self.link_seconds

    @property
    def slowest_seconds(self) -> float | None:
        known = [s for s in self.stage_seconds if s is not None]
        return max(known) if len(known) == len(self.stage_seconds) else None

    def counts(self) -> str:
        return ",".join(str(b - a) for a, b in self.ranges)

    def describe(self) -> str:
        parts = []
        for r, ((a, b), s) in enumerate(zip(self.ranges, self.stage_seconds)):
            host = f" on {self.hosts[r]}" if r < len(self.hosts) else ""
            at = f", {1000 * s:.1f} ms/token" if s is not None else ""
            parts.append(f"rank {r}{host}: layers {a}-{b - 1}{at}")
        stream = f"; one stream {1000 * self.stream_seconds:.1f} ms/token" if self.stream_seconds is not None else ""
        return (
            f"stages ({self.source}, --stages {self.counts()}): "
            + "; ".join(parts)
            + f"; links {1000 * self.link_seconds:.2f} ms/token{stream}"
        )

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["stream_seconds"], doc["slowest_seconds"] = self.stream_seconds, self.slowest_seconds
        return doc


FORMULA = (
    "stage seconds = max(io, compute): compute = its bytes per token / its compute bandwidth; io = bytes beyond its "
    "device budget up to its host budget / host bandwidth + the rest / storage bandwidth; ranges minimise the slowest "
    "stage, then the sum; links = sum over hops of (latency + hidden bytes / bandwidth)"
)


def stage_cost(facts: RankFacts, memory_bytes: int, token_bytes: int) -> tuple[float | None, dict]:
    """(seconds per token, bytes per tier) of a stage holding MEMORY_BYTES of weights and reading TOKEN_BYTES per token.

    A mixture-of-experts stage reads only its routed share: its tiers are split in the same proportions."""
    device = min(memory_bytes, facts.device_bytes)
    host = min(memory_bytes - device, facts.host_bytes)
    storage = memory_bytes - device - host
    share = token_bytes / memory_bytes if memory_bytes else 0.0
    tiers = {"device": int(device * share), "host": int(host * share), "storage": int(storage * share)}
    if not facts.compute_bps:
        return None, tiers
    io = 0.0
    for tier, bps in (("host", facts.host_bps), ("storage", facts.storage_bps)):
        if tiers[tier]:
            if not bps:
                return None, tiers
            io += tiers[tier] / bps
    return max(io, token_bytes / facts.compute_bps), tiers


def link_seconds(ranks: list[RankFacts], hidden_bytes: int) -> float:
    return sum(f.link_latency_s + (hidden_bytes / f.link_bps if f.link_bps else 0.0) for f in ranks)


def parse_counts(text: str, layers: int, world: int) -> list[tuple[int, int]]:
    """`--stages 20,10`: layer counts per rank, in rank order, adding up to the model's layers."""
    try:
        counts = [int(x) for x in str(text).replace(" ", "").split(",")]
    except ValueError:
        raise KnobError(
            f"bad value {text!r} for stages: expected auto or one layer count per rank, e.g. {','.join(['1'] * world)}"
        ) from None
    if len(counts) != world or min(counts) < 1 or sum(counts) != layers:
        raise KnobError(
            f"stages {text!r} does not fit: give {world} layer counts of at least 1 adding up to the model's {layers} "
            f"layers (got {len(counts)} adding up to {sum(counts)})"
        )
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


def plan_stages(
    ranks: list[RankFacts],
    layer_bytes: list[int],
    layer_token_bytes: list[int],
    first_bytes: int,
    other_bytes: int,
    hidden_bytes: int,
    override: str = "auto",
) -> StagePlan:
    """Contiguous layer ranges, one per rank in rank order.

    layer_bytes / layer_token_bytes: each layer's weights (experts included) and what one token reads of them;
    first_bytes: the units only rank 0 holds (embeddings, head, norm ...); other_bytes: what every other rank holds
    besides its layers (the final norm, extras); hidden_bytes: one token's hidden state as it crosses a link."""
    n, world = len(layer_bytes), len(ranks)
    if world > n:
        raise KnobError(
            f"{world} ranks for a model of {n} layers: launch at most {n} (each stage holds at least one layer)"
        )
    links = link_seconds(ranks, hidden_bytes)
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)
    tprefix = [0]
    for b in layer_token_bytes:
        tprefix.append(tprefix[-1] + b)

    def cost(r: int, a: int, b: int) -> float | None:
        fixed = first_bytes if r == 0 else other_bytes
        s, _ = stage_cost(ranks[r], prefix[b] - prefix[a] + fixed, tprefix[b] - tprefix[a] + fixed)
        return s

    inputs = {
        "layers": n,
        "ranks": world,
        "hidden_bytes": hidden_bytes,
        "first_bytes": first_bytes,
        "other_bytes": other_bytes,
        "per_rank": [asdict(f) for f in ranks],
    }
    if override and override != "auto":
        ranges, source = parse_counts(override, n, world), "--stages"
    else:
        ranges, source = _best(cost, n, world), "derived"
    seconds, tiers = [], []
    for r, (a, b) in enumerate(ranges):
        fixed = first_bytes if r == 0 else other_bytes
        s, t = stage_cost(ranks[r], prefix[b] - prefix[a] + fixed, tprefix[b] - tprefix[a] + fixed)
        seconds.append(s)
        tiers.append(t)
    return StagePlan(ranges, seconds, links, FORMULA, inputs, source, [f.host for f in ranks], tiers)


def _best(cost, n: int, world: int) -> list[tuple[int, int]]:
    """Dynamic programme over split points: minimise (slowest stage, sum of stages); an unmeasured stage costs its
    layer count (an even split) so a machine without measurements still gets a plan."""
    inf = (float("inf"), float("inf"))
    best: list[list[tuple[float, float]]] = [[inf] * (n + 1) for _ in range(world + 1)]
    cut: list[list[int]] = [[0] * (n + 1) for _ in range(world + 1)]
    best[0][0] = (0.0, 0.0)
    for r in range(1, world + 1):
        for j in range(r, n - (world - r) + 1):
            for i in range(r - 1, j):
                if best[r - 1][i] == inf:
                    continue
                c = cost(r - 1, i, j)
                c = float(j - i) if c is None else c
                cand = (max(best[r - 1][i][0], c), best[r - 1][i][1] + c)
                if cand < best[r][j]:
                    best[r][j], cut[r][j] = cand, i
    ranges, j = [], n
    for r in range(world, 0, -1):
        i = cut[r][j]
        ranges.append((i, j))
        j = i
    return ranges[::-1]


def describe_rank(f: RankFacts) -> str:
    link = (
        f", link to the next rank {1e6 * f.link_latency_s:.0f} µs + {f.link_bps / 1e6:.0f} MB/s" if f.link_bps else ""
    )
    bw = ", ".join(
        f"{name} {bps / 1e9:.2f} GB/s"
        for name, bps in (("compute", f.compute_bps), ("host", f.host_bps), ("storage", f.storage_bps))
        if bps
    )
    return (
        f"rank {f.rank} ({f.host}, {f.device}): device {format_bytes(f.device_bytes)}, host "
        f"{format_bytes(f.host_bytes)}; {bw}{link}"
    )
