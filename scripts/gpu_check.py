"""The GPU check: every tiny architecture on the accelerator, equal to plain transformers on it, with the defaults and
in
the host and storage regimes; the CLI on its defaults; serve answering one request; and a resident/host/storage bench of
a 1B model beside plain transformers. It runs in minutes on a machine with a CUDA device and prints one Markdown report.

    python scripts/gpu_check.py --out DIR            # everything; DIR gets report.md and one JSON per step
    python scripts/gpu_check.py --out DIR --quick    # the equality matrix and the CLI only
    python scripts/gpu_check.py --device cpu ...     # the same checks on the CPU (to try the script itself)

Each step runs on its own: one that fails is reported and the next one runs. Exit status 1 when any check failed.
CI runs no GPU: this script is how a GPU is checked (docs/HARDWARE.md records its output).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = [1, 40, 57, 60, 71, 85, 90]
NEW_TOKENS = 8
HUGE = 1 << 40
STEPS = ("environment", "equality", "cli", "serve", "bench", "resident", "split")
QUICK = ["environment", "equality", "cli"]
REGIMES = {
    "resident": {"decode_graphs": "off"},
    "host": {"device_cache_bytes": 0},
    "storage": {"device_cache_bytes": 0, "host_cache_bytes": 0},
}
GRAPH_ARCHS = ("llama", "gemma3", "qwen3_moe")  # each compiles its decode step (seconds each): a sample of the families


class Report:
    def __init__(self, out: Path) -> None:
        self.out, self.lines, self.failed = out, [], []

    def step(self, name: str):
        return _Step(self, name)

    def add(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def save(self, name: str, doc) -> None:
        (self.out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str))

    def finish(self) -> int:
        self.add(f"\nchecks failed: {len(self.failed)}" + (f" ({', '.join(self.failed)})" if self.failed else ""))
        (self.out / "report.md").write_text("\n".join(self.lines) + "\n")
        return 1 if self.failed else 0


class _Step:
    def __init__(self, report: Report, name: str) -> None:
        self.report, self.name = report, name

    def __enter__(self):
        self.start = time.perf_counter()
        self.report.add(f"\n## {self.name}")
        return self

    def __exit__(self, kind, exc, tb):
        seconds = time.perf_counter() - self.start
        if exc is not None:
            self.report.failed.append(self.name)
            self.report.add(f"FAILED after {seconds:.1f} s: {kind.__name__}: {exc}")
            self.report.add("```\n" + "".join(traceback.format_exception(kind, exc, tb))[-3000:] + "```")
        else:
            self.report.add(f"({seconds:.1f} s)")
        (self.report.out / "report.md").write_text("\n".join(self.report.lines) + "\n")  # kept if a later step hangs
        return True  # the next step runs


def environment(report: Report, device: str) -> None:
    import torch
    import transformers

    facts = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(),
        "device": device,
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        facts.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            vram_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
        try:
            facts["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            facts["driver"] = f"unknown ({exc})"
    report.save("environment", facts)
    report.add(" · ".join(f"{k} {v}" for k, v in facts.items()))


def equality(report: Report, device: str, work: Path) -> None:
    """Every architecture of the synthetic table against plain transformers on the same device and dtype (fp32
    checkpoints: the engine computes in the stored fp32): every unit resident with the decode eager, then the host and
    storage regimes; and for GRAPH_ARCHS the decode as CUDA graphs, whose compiled kernels may round differently: its
    tokens, and the KL of its per-step distributions against plain transformers' up to the first differing token."""
    import torch
    from transformers import AutoModelForCausalLM

    from rocketllm_cli.compat import dtype_kwargs
    from rocketllm_cli.auto import AutoModel
    from rocketllm_cli.synthetic import ARCHS

    prompt = torch.tensor([PROMPT], device=device)
    columns = [*REGIMES, "graphs"]
    rows, table = [], ["| arch | transformers | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    for arch in ARCHS:
        row = {"arch": arch}
        source = tiny(work, arch)
        expected, expected_scores = None, []
        try:
            plain = AutoModelForCausalLM.from_pretrained(source, **dtype_kwargs(torch.float32)).to(device)
            expected = _greedy(plain, prompt, expected_scores)
            del plain
            row["transformers"] = expected
        except Exception as exc:  # noqa: BLE001 - recorded: plain transformers cannot run it here
            row["transformers"] = f"cannot run: {type(exc).__name__}: {exc}"[:200]
        runs = {**REGIMES, **({"graphs": {"decode_graphs": "on"}} if arch in GRAPH_ARCHS else {})}
        for regime, knobs in runs.items():
            try:
                scores: list = []
                with AutoModel.from_pretrained(source, out=work / "sets" / arch, **knobs) as model:
                    got = _greedy(model, prompt, scores)
                    row[f"{regime}_tiers"] = sorted({str(t) for t in model.plan.tier.values()})
                    if regime == "graphs":
                        from rocketllm_cli.stream.graphs import wanted

                        row["graphs_why_not"] = model.graphs_failed or wanted(model)
                row[regime] = "equal" if got == expected else f"DIFFERS {got} vs {expected}"
                if regime == "graphs":
                    kl = _kl(expected_scores, scores, expected, got)
                    row["graphs_kl"] = kl
                    row[regime] += f" (KL mean {kl['mean']:.2e}, max {kl['max']:.2e} over {kl['steps']} steps)"
                    if row["graphs_why_not"]:
                        row[regime] += f"; not graphed: {row['graphs_why_not']}"
            except Exception as exc:  # noqa: BLE001 - a crash is the finding
                row[regime] = f"ERROR {type(exc).__name__}: {exc}"[:300]
                row[f"{regime}_traceback"] = traceback.format_exc()[-2000:]
        rows.append(row)
        shown = ["ok" if isinstance(row["transformers"], list) else row["transformers"]] + [
            row.get(r, "-") for r in columns
        ]
        table.append(f"| {arch} | " + " | ".join(shown) + " |")
    report.save("equality", rows)
    for line in table:
        report.add(line)
    bad = [r["arch"] for r in rows if any(not str(r[g]).startswith("equal") for g in REGIMES)]
    bad += [r["arch"] + " (graphs)" for r in rows if "graphs_kl" in r and r["graphs_kl"]["max"] > 1e-3]
    bad += [r["arch"] + " (graphs)" for r in rows if str(r.get("graphs", "")).startswith("ERROR")]
    if bad:
        raise AssertionError(f"not equal to plain transformers: {', '.join(bad)}")


def _kl(reference: list, scores: list, expected, got) -> dict:
    """KL(reference || scores) per step over the steps whose prefixes agree (up to and with the first differing
    token)."""
    import torch

    steps = len(reference) if expected == got else next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b) + 1
    # tokens a processor masks (-inf in both: end-of-sequence under min_new_tokens) add nothing
    values = [
        float(torch.where(r.isfinite(), r.exp() * (r - s), 0.0).sum())
        for r, s in zip(reference[:steps], scores[:steps])
    ]
    return {"mean": sum(values) / max(1, len(values)), "max": max(values, default=0.0), "steps": len(values)}


class _Scores:
    """A logits processor that keeps each step's log-probabilities (on the CPU, fp32)."""

    def __init__(self, into: list) -> None:
        self.into = into

    def __call__(self, input_ids, scores):
        self.into.append(scores[0].float().log_softmax(-1).cpu())
        return scores


def tiny(work: Path, arch: str) -> Path:
    """The tiny fp32 checkpoint of ARCH, written once under WORK."""
    import torch

    from rocketllm_cli.synthetic import config_for, write_checkpoint

    dest = work / "tiny" / arch
    return (
        dest
        if (dest / "config.json").is_file()
        else write_checkpoint(config_for(arch), dest, dtype=torch.float32, seed=0)
    )


def _greedy(model, prompt, scores: list | None = None) -> list[int]:
    import torch
    from transformers import LogitsProcessorList

    extra = {"logits_processor": LogitsProcessorList([_Scores(scores)])} if scores is not None else {}
    with torch.inference_mode():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=3,
            **extra,
        )
    return out[0, prompt.shape[1] :].tolist()


def cli(report: Report, work: Path, env: dict) -> None:
    """The commands a user types first, on their defaults: doctor, and generate of a tiny model (it crashed once)."""
    runs = {
        "doctor": ["doctor"],
        "generate": ["generate", str(tiny(work, "llama")), "The capital of France is", "-n", "8", "--stats"],
        "generate-moe": ["generate", str(tiny(work, "qwen3_moe")), "hello", "-n", "8", "--keep-alive", "0"],
    }
    results = {}
    for name, args in runs.items():
        done = subprocess.run(
            [sys.executable, "-m", "rocketllm_cli", *args], capture_output=True, text=True, env=env, timeout=300
        )
        results[name] = {"rc": done.returncode, "stdout": done.stdout[-4000:], "stderr": done.stderr[-4000:]}
        report.add(
            f"- `rocketllm {' '.join(args[:1])}` exit {done.returncode}"
            + ("" if done.returncode == 0 else f": {done.stderr.strip().splitlines()[-1:]}")
        )
    report.save("cli", results)
    (report.out / "doctor.md").write_text(results["doctor"]["stdout"])
    failed = [n for n, r in results.items() if r["rc"] != 0 or "Traceback" in r["stderr"]]
    if failed:
        raise AssertionError(f"failed: {', '.join(failed)}")


def serve(report: Report, work: Path, env: dict) -> None:
    """`rocketllm serve` on the tiny llama answers one chat completion."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "rocketllm_cli", "serve", str(tiny(work, "llama")), "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None:
                    raise AssertionError(f"serve exited {server.returncode}: {server.stdout.read()[-2000:]}") from None
                time.sleep(0.5)
        body = json.dumps({"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
        report.save("serve", answer)
        report.add(
            f"- chat completion: finish_reason {answer['choices'][0]['finish_reason']}, "
            f"{answer['usage']['completion_tokens']} tokens"
        )
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def bench(report: Report, env: dict, spec: str, tokens: int) -> None:
    """bench of a synthetic model: resident (ours with the decode as CUDA graphs, beside plain transformers) and host
    with
    TOKENS tokens, storage with 4 (seconds each), each with its projection and limit."""
    docs = []
    for regimes, count, extra in (
        (["resident", "host"], tokens, ["--baseline", "transformers", "--decode-graphs", "on"]),
        (["storage"], 4, []),
    ):
        args = [
            sys.executable,
            "-m",
            "rocketllm_cli",
            "bench",
            "--synthetic",
            spec,
            "--regime",
            *regimes,
            *extra,
            "--tokens",
            str(count),
            "--json",
        ]
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=400)
        (report.out / f"bench-{regimes[0]}.stderr.txt").write_text(done.stderr[-20000:])
        if done.returncode != 0:
            raise AssertionError(f"bench exit {done.returncode}: {done.stderr.strip().splitlines()[-3:]}")
        docs.append(json.loads(done.stdout))
    report.save("bench", docs)
    rows = _bench_rows(docs[0])
    rows += _bench_rows(docs[1])[2:]
    for line in rows:
        report.add(line)


def _bench_rows(doc) -> list[str]:
    rows = ["| regime | engine | ms/token (median) | projected | limit | efficiency |", "|---|---|---|---|---|---|"]
    for row in doc.get("rows", []):
        ms = row.get("ms_per_token") or {}
        rows.append(
            f"| {row.get('regime')} | {row.get('name', 'rocketllm')} | {ms.get('median', row.get('reason', ''))} | "
            f"{row.get('projected_ms', '')} | {row.get('limit_ms', '')} | {row.get('efficiency', '')} |"
        )
    return rows


def profile_resident(report: Report, device: str, spec: str) -> None:
    """A resident decode through the loop bench and generate run (text/loop.py): ours with the decode as CUDA graphs,
    ours eager and plain transformers eager, alternated twice after a warm-up (a GPU's clocks rise under load)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rocketllm_cli.bench.sources import synthetic_checkpoint
    from rocketllm_cli.bench.timing import timed_run
    from rocketllm_cli.compat import dtype_kwargs
    from rocketllm_cli.auto import AutoModel

    source = synthetic_checkpoint(spec)
    tokens = 64
    median = lambda stats: round(sorted(stats.token_gaps_s)[len(stats.token_gaps_s) // 2] * 1000, 3)  # noqa: E731
    figures: dict = {"graphs": [], "eager": [], "transformers": []}
    graphed = AutoModel.from_pretrained(source, device_cache_bytes=HUGE, decode_graphs="on")
    eager = AutoModel.from_pretrained(source, device_cache_bytes=HUGE, decode_graphs="off")
    plain = AutoModelForCausalLM.from_pretrained(source, **dtype_kwargs(graphed.dtype)).to(device)
    try:
        engines = {"graphs": graphed, "eager": eager, "transformers": plain}
        start = time.perf_counter()
        for model in engines.values():
            timed_run(model, PROMPT, 8)  # compile, allocate
        while time.perf_counter() - start < 5:  # warm the GPU up
            timed_run(plain, PROMPT, 16)
        for _ in range(2):
            for name, model in engines.items():
                figures[name].append(median(timed_run(model, PROMPT, tokens)))
        figures["graphs_failed"] = graphed.graphs_failed
        figures["dtype"] = str(graphed.dtype)
        figures["bytes"] = graphed.ledger.resident_bytes
    finally:
        graphed.close()
        eager.close()
    report.save("resident", figures)
    report.add(
        f"- every unit resident, {tokens} tokens, the same loop, alternated (ms/token, two rounds): ours as CUDA "
        f"graphs {figures['graphs']}, ours eager {figures['eager']}, plain transformers eager "
        f"{figures['transformers']} ({figures['dtype']}, {figures['bytes'] / 2**30:.2f} GiB of weights)"
        + (f"; graphs failed: {figures['graphs_failed']}" if figures["graphs_failed"] else "")
    )


def bench_split(report: Report, env: dict, spec: str, tokens: int) -> None:
    """A model larger than the device memory allowed: half of it may stay on the device, the rest streams from host
    memory (the first use case: a small GPU and a large model); measured against the cost model's projection."""
    from rocketllm_cli.bench.sources import synthetic_checkpoint

    total = sum(f.stat().st_size for f in synthetic_checkpoint(spec).glob("*.safetensors"))
    args = [
        sys.executable,
        "-m",
        "rocketllm_cli",
        "bench",
        "--synthetic",
        spec,
        "--regime",
        "auto",
        "--tokens",
        str(tokens),
        "--device-cache-bytes",
        str(total // 2),
        "--json",
    ]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    (report.out / "split.stderr.txt").write_text(done.stderr[-20000:])
    if done.returncode != 0:
        raise AssertionError(f"bench exit {done.returncode}: {done.stderr.strip().splitlines()[-3:]}")
    doc = json.loads(done.stdout)
    report.save("split", doc)
    for line in _bench_rows(doc):
        report.add(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda where torch sees one)")
    parser.add_argument("--quick", action="store_true", help="the equality matrix and the CLI only")
    parser.add_argument("--bench", default="llama:1B", help="the synthetic model bench and the profile run")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--steps", nargs="*", choices=STEPS, help="run only these steps (environment is always useful)")
    args = parser.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    os.environ.setdefault("ROCKETLLM_CACHE", str(work / "cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    env = {
        **os.environ,
        "ROCKETLLM_KEEP_ALIVE": "0",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    report.add("# rocketllm GPU check")
    steps = {
        "environment": ("environment", lambda: environment(report, device)),
        "equality": (
            "equality with plain transformers (greedy, fp32 tiny checkpoints)",
            lambda: equality(report, device, work),
        ),
        "cli": ("CLI defaults", lambda: cli(report, work, env)),
        "serve": ("serve", lambda: serve(report, work, env)),
        "bench": (f"bench {args.bench}", lambda: bench(report, env, args.bench, args.tokens)),
        "resident": ("resident decode profile", lambda: profile_resident(report, device, args.bench)),
        "split": (
            "half the model on the device, the rest in host memory",
            lambda: bench_split(report, env, args.bench, args.tokens),
        ),
    }
    chosen = args.steps or (QUICK if args.quick else list(steps))
    for name in chosen:
        title, run = steps[name]
        with report.step(title):
            run()
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
