"""/metrics in the Prometheus text format (0.0.4): counters, gauges and two latency summaries."""

from __future__ import annotations

import collections
import threading

WINDOW = 2048  # latest samples the summary quantiles are computed over
QUANTILES = (0.5, 0.9, 0.99)


class _Summary:
    def __init__(self) -> None:
        self.recent: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.sum = 0.0
        self.count = 0

    def observe(self, values) -> None:
        for v in values:
            self.recent.append(v)
            self.sum += v
            self.count += 1

    def quantile(self, q: float) -> float | None:
        if not self.recent:
            return None
        ordered = sorted(self.recent)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()  # (endpoint, status) -> n
        self.tokens: collections.Counter = collections.Counter()  # prompt | generated | reused
        self.cancelled = 0
        self.refused_full = 0
        self.token_latency = _Summary()
        self.prefill_latency = _Summary()
        self.bytes_served: collections.Counter = collections.Counter()  # tier -> bytes, every pass
        self.bytes_per_token: dict[str, int] = {}  # tier -> bytes per decode token, latest generation
        # proposed | accepted | passes | tokens, speculative generations
        self.speculation: collections.Counter = collections.Counter()

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, str(status))] += 1

    def queue_full(self) -> None:
        with self._lock:
            self.refused_full += 1

    def generation(self, outcome, other_rows_generated: int = 0) -> None:
        """One job's figures: its first row's (a batch of n choices shares one record), every row's generated tokens."""
        with self._lock:
            self.tokens["prompt"] += outcome.prompt_tokens
            self.tokens["generated"] += outcome.new_tokens + other_rows_generated
            self.tokens["reused"] += outcome.reused_tokens
            if outcome.finish_reason == "cancelled":
                self.cancelled += 1
            stats = outcome.stats
            self.token_latency.observe(stats.token_gaps_s)
            spec = stats.speculation or {}
            if "proposed" in spec:
                for key in ("proposed", "accepted", "passes", "tokens"):
                    self.speculation[key] += spec[key]
            if stats.ttft_s is not None:
                self.prefill_latency.observe([stats.ttft_s])
            for tier, n in stats.served_bytes.items():
                self.bytes_served[tier] += n
            per = stats.bytes_per_token
            if per:
                self.bytes_per_token = dict(per)

    def render(self, queue_length: int, busy: bool, model: str, prefix: dict | None) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                out.append(f"{name}{_labels(labels)} {_number(value)}")

        with self._lock:
            metric(
                "rocketllm_requests_total",
                "counter",
                "HTTP requests by endpoint and status code.",
                [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())],
            )
            metric(
                "rocketllm_tokens_total",
                "counter",
                "Tokens processed: prompt, generated, and prompt tokens reused from the prefix cache.",
                [({"kind": k}, self.tokens.get(k, 0)) for k in ("prompt", "generated", "reused")],
            )
            metric(
                "rocketllm_generations_cancelled_total",
                "counter",
                "Generations stopped because the client went away.",
                [({}, self.cancelled)],
            )
            metric(
                "rocketllm_queue_full_total",
                "counter",
                "Requests refused with 429 because the queue was full.",
                [({}, self.refused_full)],
            )
            for name, summary, help_text in (
                ("rocketllm_token_latency_seconds", self.token_latency, "Time between successive generated tokens."),
                (
                    "rocketllm_prefill_seconds",
                    self.prefill_latency,
                    "Time from a job's start to its first generated token.",
                ),
            ):
                samples = [
                    ({"quantile": str(q)}, summary.quantile(q)) for q in QUANTILES if summary.quantile(q) is not None
                ]
                metric(name, "summary", help_text + f" Quantiles over the latest {WINDOW}.", samples)
                out.append(f"{name}_sum {_number(summary.sum)}")
                out.append(f"{name}_count {summary.count}")
            metric(
                "rocketllm_bytes_served_total",
                "counter",
                "Weight bytes served by each tier over every forward pass.",
                [({"tier": t}, self.bytes_served.get(t, 0)) for t in ("device", "host", "storage")],
            )
            metric(
                "rocketllm_bytes_per_token",
                "gauge",
                "Weight bytes each tier served per decode token in the latest generation.",
                [({"tier": t}, self.bytes_per_token.get(t, 0)) for t in ("device", "host", "storage")],
            )
            metric(
                "rocketllm_speculative_tokens_total",
                "counter",
                "Speculative decoding: drafted tokens proposed to the model and accepted by it.",
                [({"kind": k}, self.speculation.get(k, 0)) for k in ("proposed", "accepted")],
            )
            metric(
                "rocketllm_speculative_passes_total",
                "counter",
                "Forward passes of speculative generations.",
                [({}, self.speculation.get("passes", 0))],
            )
            passes = self.speculation.get("passes", 0)
            metric(
                "rocketllm_tokens_per_pass",
                "gauge",
                "Tokens made per forward pass over the speculative generations (1 without speculation).",
                [({}, round(self.speculation["tokens"] / passes, 4) if passes else 1.0)],
            )
        metric(
            "rocketllm_queue_length",
            "gauge",
            "Requests waiting for the model (not counting the one running).",
            [({}, queue_length)],
        )
        metric("rocketllm_busy", "gauge", "1 while a generation runs.", [({}, int(busy))])
        if prefix is not None:
            metric(
                "rocketllm_prefix_cache_hits_total",
                "counter",
                "Prompts that reused a cached prefix.",
                [({}, prefix["hits"])],
            )
            metric(
                "rocketllm_prefix_cache_lookups_total",
                "counter",
                "Prompts looked up in the prefix cache.",
                [({}, prefix["lookups"])],
            )
            metric("rocketllm_prefix_cache_bytes", "gauge", "Bytes of KV checkpoints held.", [({}, prefix["bytes"])])
        metric("rocketllm_model_info", "gauge", "The served model.", [({"model": model}, 1)])
        return "\n".join(out) + "\n"


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))
