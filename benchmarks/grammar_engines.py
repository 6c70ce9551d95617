"""Compare two constrained-decoding engines, llguidance and xgrammar, on JSON schemas and a real tokenizer.

    python benchmarks/grammar_engines.py --tokenizer DIR --schemas DIR [--sample 400] [--seed 0]
        [--timeout 30] [--engines llguidance xgrammar] [--json OUT]

Data: the MaskBench set of https://github.com/guidance-ai/jsonschemabench, folder maskbench/data. Each file
is {"description", "meta", "schema", "tests": [{"description", "valid", "data"}]}. Get it with
    git clone --depth 1 https://github.com/guidance-ai/jsonschemabench && pass --schemas jsonschemabench/maskbench/data
The tokenizer is any Hugging Face tokenizer directory (we use SmolLM2-135M's, 49,152 tokens).

Method, per engine, one engine at a time and single-threaded (a grammar engine runs beside the model on the
same cores, so its one-core cost is what matters):

1. Tokenizer set-up, once: llguidance.hf.from_tokenizer / xgrammar.TokenizerInfo.from_huggingface plus a
   GrammarCompiler with max_threads=1 and its cache off, so every schema's compile is really measured.
2. Compile ("time to first mask"): schema -> grammar -> matcher -> first mask into a preallocated int32 bitmask.
   Engine options are the engines' defaults: llguidance's JSON compiler (flexible whitespace, unknown keywords
   are errors), xgrammar's compile_json_schema (any_whitespace=True, strict_mode=True: properties and items the
   schema does not list are refused; --xgrammar-non-strict turns that off). A compile error, an error state of
   the matcher, a crash or a timeout counts the schema as unsupported by that engine.
3. Mask time: each valid test value is serialised compactly, tokenized with the HF tokenizer (no special tokens,
   special-token text split as ordinary text), and fed to a fresh matcher token by token: time the next-token
   mask, check the token's bit, consume the token; at the end one more mask must allow end-of-sequence and the
   matcher must accept it. A fresh matcher per value is what a server does per request, and it is why the first
   mask of each value is reported apart from the later ones (llguidance builds its lexer lazily, so its first
   mask is expensive; xgrammar precomputes at compile time).
4. Invalid test values go through the same loop and should be refused somewhere; we count the ones accepted.
   Some MaskBench "invalid" values rely on formats or keywords that engines legitimately do not enforce, so this
   is a count, not a verdict.

The per-engine tables cover every schema that engine compiled; a last table repeats the main figures on the
schemas every engine compiled, since an engine that refuses the hard schemas otherwise looks faster.

Times are wall clock (perf_counter_ns; the CPU-time clocks are system calls costing ~2 us, too much beside a
~10 us mask). The machine may be shared, so a mask or compile during which this process was involuntarily
switched out (getrusage's ru_nivcsw grew; read outside the timed window) counts as preempted: preempted masks
are left out of the mask figures and counted; preempted compiles are counted, and every compile's process CPU
time is reported beside its wall time. The machine's CPU busy share during each engine's run is printed too.

Each engine runs in a child process (multiprocessing, spawn) pinned to one core; the parent waits at most
--timeout seconds for a schema's compile and again for its test values, and kills and restarts the child on a
timeout or crash, so one pathological schema costs at most that long. Stdout gets Markdown tables, stderr progress.
"""

from __future__ import annotations

import os

# Before torch or either engine is imported (also in the spawned child, which re-imports this module):
# one thread for OpenMP (torch) and rayon (llguidance's parallel paths).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import argparse
import gc
import importlib.metadata
import json
import math
import multiprocessing
import platform
import random
import resource
import sys
import time
from functools import partial
from pathlib import Path

ENGINES = ("llguidance", "xgrammar")
READY_TIMEOUT_S = 300  # loading the tokenizer and setting an engine up; not part of any schema's budget


# ----------------------------------------------------------------------------------------------------------
# Engine adapters (run in the child). Each exposes the same small surface so the measuring loop is shared.
# ----------------------------------------------------------------------------------------------------------


class LlguidanceEngine:
    """llguidance: the JSON schema is compiled when the LLMatcher is built; masks are computed lazily."""

    def __init__(self, tok, options):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        started = time.perf_counter()
        self.lltok = llguidance.hf.from_tokenizer(tok)
        self.setup_s = time.perf_counter() - started
        self.vocab = self.lltok.vocab_size
        self.eos = self.lltok.eos_token

    def compile(self, schema_text):
        return self.llg.LLMatcher.grammar_from_json_schema(schema_text)

    def matcher(self, grammar):
        # log_level=0: errors are read back with get_error(), not printed.
        m = self.llg.LLMatcher(self.lltok, grammar, log_level=0)
        self.raise_if_error(m)
        return m

    @staticmethod
    def mask_fn(m, bitmask):
        return partial(m.unsafe_compute_mask_ptr, bitmask.data_ptr(), bitmask.numel() * 4)

    @staticmethod
    def consume(m, token):
        return m.consume_token(token)

    @staticmethod
    def raise_if_error(m):
        # llguidance never raises for grammar problems; it puts the matcher in an error state instead.
        if m.is_error():
            raise RuntimeError(m.get_error())

    @staticmethod
    def finished(m):
        return m.is_stopped() and not m.is_error()


class XgrammarEngine:
    """xgrammar: compile_json_schema precomputes token masks; a GrammarMatcher per value is cheap."""

    def __init__(self, tok, options):
        import xgrammar

        self.xgr = xgrammar
        self.strict_mode = not options.get("xgrammar_non_strict", False)
        started = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        # Cache off: the benchmark compiles each schema once and must measure that compile.
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.setup_s = time.perf_counter() - started
        self.vocab = info.vocab_size
        self.eos = info.stop_token_ids[0]

    def compile(self, schema_text):
        self.compiler.clear_cache()  # a no-op with the cache off; kept so a changed default cannot skew timings
        return self.compiler.compile_json_schema(schema_text, strict_mode=self.strict_mode)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    @staticmethod
    def mask_fn(m, bitmask):
        return partial(m.fill_next_token_bitmask, bitmask)

    @staticmethod
    def consume(m, token):
        return m.accept_token(token)

    @staticmethod
    def raise_if_error(m):
        pass  # xgrammar raises instead

    @staticmethod
    def finished(m):
        return m.is_terminated()


ADAPTERS = {"llguidance": LlguidanceEngine, "xgrammar": XgrammarEngine}


# ----------------------------------------------------------------------------------------------------------
# Child process: set up once, then answer one schema file at a time with a stream of messages.
# ----------------------------------------------------------------------------------------------------------


def first_line(exc) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def tokenize(tok, value):
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    # split_special_tokens: a value containing "<|im_end|>" is text, not the special token.
    ids = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    round_trip = tok.decode(ids, clean_up_tokenization_spaces=False) == text
    return ids, round_trip


def switches():
    """Involuntary context switches of this process so far. A timed call during which this grows was preempted
    by another process (the machine may be shared), so its wall time is not the engine's; read outside the
    timed window because getrusage is a system call costing about as much as a cheap mask. Read twice: a
    preemption already due is taken on the return from the first system call, and would otherwise be blamed on
    the call being timed."""
    resource.getrusage(resource.RUSAGE_SELF)
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def feed(engine, m, ids, bitmask, words, keep_times):
    """Mask, check, consume each token, then check end-of-sequence. Returns the instance's result dict."""
    fill = engine.mask_fn(m, bitmask)
    clock = time.perf_counter_ns  # wall clock: the CPU-time clocks are system calls, ~2 us each here
    times, preempted = [], []
    result = {"tokens": len(ids), "accepted": False, "reject_at": None, "reason": None, "disagree": False}
    for pos, token in enumerate(ids + [engine.eos]):
        before = switches()
        started = clock()
        fill()
        elapsed = clock() - started
        if keep_times:
            times.append(elapsed)
            if switches() != before:
                preempted.append(pos)
        engine.raise_if_error(m)
        allowed = (int(words[token >> 5]) >> (token & 31)) & 1
        consumed = engine.consume(m, token)
        if allowed != consumed:
            result["disagree"] = True  # mask and consume should never differ; worth knowing if they do
        if not (allowed and consumed):
            result["reject_at"] = pos
            result["reason"] = ("eos" if pos == len(ids) else "mask") if not allowed else "consume"
            break
    else:
        result["accepted"] = engine.finished(m)
        if not result["accepted"]:
            result["reject_at"], result["reason"] = len(ids), "not finished"
    result["mask_ns"], result["preempted"] = times, preempted
    return result


def run_instance(engine, tok, artefact, test, bitmask, words):
    ids, round_trip = tokenize(tok, test["data"])
    try:
        m = engine.matcher(artefact)  # fresh matcher, as per request; not timed (compile already was)
        gc.disable()  # keep collector pauses out of the per-token times
        try:
            result = feed(engine, m, ids, bitmask, words, keep_times=test["valid"])
        finally:
            gc.enable()
    except Exception as exc:  # an engine raising mid-value counts as a refusal, with its reason
        result = {
            "tokens": len(ids),
            "accepted": False,
            "reject_at": None,
            "reason": "error: " + first_line(exc),
            "disagree": False,
            "mask_ns": [],
            "preempted": [],
        }
    result["valid"] = bool(test["valid"])
    result["round_trip"] = round_trip
    return result


def run_schema(engine, tok, path, conn, bitmask, words):
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    schema_text = json.dumps(doc["schema"])  # both engines get the same string; serialising is not timed
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        before, cpu_started = switches(), time.process_time_ns()
        started = clock()
        artefact = engine.compile(schema_text)
        built = clock()
        m = engine.matcher(artefact)
        matched = clock()
        engine.mask_fn(m, bitmask)()
        engine.raise_if_error(m)
        done = clock()
        cpu_ns, preempted = time.process_time_ns() - cpu_started, switches() != before
    except Exception as exc:
        conn.send(("unsupported", first_line(exc)))
        return
    finally:
        gc.enable()
    conn.send(
        (
            "compiled",
            {
                "compile_ns": done - started,
                "build_ns": matched - started,
                "grammar_ns": built - started,
                "first_mask_ns": done - matched,
                "compile_cpu_ns": cpu_ns,
                "compile_preempted": preempted,
            },
        )
    )
    for index, test in enumerate(doc.get("tests", [])):
        result = run_instance(engine, tok, artefact, test, bitmask, words)
        result["index"] = index
        conn.send(("instance", result))
    conn.send(("done", None))


def worker_main(engine_name, tokenizer_dir, options, conn, cpu):
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})  # one core, away from the parent, so timings are not shared
    import numpy
    import torch
    import transformers

    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    engine = ADAPTERS[engine_name](tok, options)
    bitmask = torch.full((1, (engine.vocab + 31) // 32), -1, dtype=torch.int32)  # preallocated, reused
    words = bitmask.numpy().view(numpy.uint32)[0]  # shares memory with bitmask; for reading bits
    conn.send(("ready", {"setup_s": engine.setup_s, "vocab": engine.vocab, "eos": engine.eos}))
    while (job := conn.recv()) is not None:
        run_schema(engine, tok, job, conn, bitmask, words)


# ----------------------------------------------------------------------------------------------------------
# Parent: drive a child per engine, enforce timeouts, restart after a kill or a crash.
# ----------------------------------------------------------------------------------------------------------


class Timeout(Exception):
    pass


class Crash(Exception):
    pass


class EngineProcess:
    def __init__(self, engine, tokenizer_dir, options, cpu):
        self.engine, self.tokenizer_dir, self.options, self.cpu = engine, tokenizer_dir, options, cpu
        self.proc = self.conn = None
        self.starts = []  # the "ready" payload of every start: the first is the reported set-up time

    def ensure_started(self):
        if self.proc is not None and self.proc.is_alive():
            return
        ctx = multiprocessing.get_context("spawn")  # fresh interpreter: no inherited threads or engine state
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=worker_main, daemon=True, args=(self.engine, self.tokenizer_dir, self.options, child, self.cpu)
        )
        self.proc.start()
        child.close()
        kind, payload = self.receive(time.monotonic() + READY_TIMEOUT_S)
        self.starts.append(payload)

    def receive(self, deadline):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self.conn.poll(remaining):
            self.kill()
            raise Timeout()
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            code = self.proc.exitcode
            self.kill()
            raise Crash(f"child died, exit code {code}")

    def kill(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.conn.close()
        self.proc = self.conn = None

    def close(self):
        if self.proc is not None and self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(10)
        self.kill()

    def run_schema(self, path, timeout):
        """One schema file -> (row, instance results). Compile and tests each get `timeout` seconds."""
        self.ensure_started()
        row = {
            "file": Path(path).name,
            "category": category(Path(path).name),
            "status": None,
            "error": None,
            "test_status": None,
        }
        instances = []
        self.conn.send(str(path))
        try:
            kind, payload = self.receive(time.monotonic() + timeout)
        except Timeout:
            row.update(status="timeout", error=f"compile exceeded {timeout:g} s")
            return row, instances
        except Crash as exc:
            row.update(status="crash", error=str(exc))
            return row, instances
        if kind == "unsupported":
            row.update(status="unsupported", error=payload)
            return row, instances
        row["status"] = "ok"
        row.update({k.replace("_ns", "_ms"): v / 1e6 if k.endswith("_ns") else v for k, v in payload.items()})
        deadline = time.monotonic() + timeout
        try:
            while (message := self.receive(deadline))[0] == "instance":
                instances.append(message[1])
            row["test_status"] = "ok"
        except Timeout:
            row["test_status"] = f"timeout after {len(instances)} values"
        except Crash as exc:
            row["test_status"] = f"crash after {len(instances)} values: {exc}"
        return row, instances


def category(name: str) -> str:
    """The MaskBench source of a file name: 'Github_easy---o1.json' -> Github_easy, 'BFCL_java_0.json' -> BFCL_java."""
    stem = name.removesuffix(".json")
    if "---" in stem:
        return stem.split("---")[0]
    head, _, tail = stem.rpartition("_")
    return head if tail.isdigit() else stem


# ----------------------------------------------------------------------------------------------------------
# Statistics and reporting.
# ----------------------------------------------------------------------------------------------------------


def percentile(sorted_values, q):
    """Linear interpolation between closest ranks (numpy's default), on an already sorted list."""
    if not sorted_values:
        return None
    k = (len(sorted_values) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def describe(values):
    """count, mean, p50, p90, p99, max of a list of numbers."""
    values = sorted(values)
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "count": len(values),
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": values[-1],
    }


def summarise_schema(row, instances):
    """Fold a schema's instance results into its row (counts, per-schema mask figures, failures)."""
    valid = [r for r in instances if r["valid"]]
    invalid = [r for r in instances if not r["valid"]]
    masks_us = [ns / 1000 for r in valid for ns in clean_masks(r)]
    row.update(
        valid_tried=len(valid),
        valid_accepted=sum(r["accepted"] for r in valid),
        invalid_tried=len(invalid),
        invalid_accepted=sum(r["accepted"] for r in invalid),
        masks=len(masks_us),
        mask_us_mean=sum(masks_us) / len(masks_us) if masks_us else None,
        mask_us_max=max(masks_us, default=None),
        masks_preempted=sum(len(r["preempted"]) for r in valid),
        disagreements=sum(r["disagree"] for r in instances),
        not_round_trip=sum(not r["round_trip"] for r in instances),
        wrongly_rejected=[
            {k: r[k] for k in ("index", "tokens", "reject_at", "reason")} for r in valid if not r["accepted"]
        ],
        wrongly_accepted=[r["index"] for r in invalid if r["accepted"]],
    )
    return row


def clean_masks(result):
    """A value's mask times without the preempted ones."""
    skip = set(result["preempted"])
    return [ns for pos, ns in enumerate(result["mask_ns"]) if pos not in skip]


def summarise_engine(rows, instances, starts, wall_s, busy=None):
    valid = [r for r in instances if r["valid"]]
    first, later = [], []
    for r in valid:
        skip = set(r["preempted"])
        for pos, ns in enumerate(r["mask_ns"]):
            if pos not in skip:
                (later if pos else first).append(ns / 1000)
    ok = [r for r in rows if r["status"] == "ok"]
    reasons = {}
    for r in valid:
        if not r["accepted"]:
            key = r["reason"].split(":")[0]
            reasons[key] = reasons.get(key, 0) + 1
    return {
        "setup_s": starts[0]["setup_s"] if starts else None,
        "starts": len(starts),
        "wall_s": wall_s,
        "machine_busy_pct": busy,
        "schemas_tried": len(rows),
        "schemas_compiled": len(ok),
        "unsupported": sum(r["status"] == "unsupported" for r in rows),
        "compile_timeouts": sum(r["status"] == "timeout" for r in rows),
        "crashes": sum(r["status"] == "crash" for r in rows),
        "test_phase_cut_short": sum(r["test_status"] not in (None, "ok") for r in rows),
        "compile_ms": describe([r["compile_ms"] for r in ok]),
        "compile_cpu_ms": describe([r["compile_cpu_ms"] for r in ok]),
        "compiles_preempted": sum(r["compile_preempted"] for r in ok),
        "build_ms": describe([r["build_ms"] for r in ok]),
        "compile_first_mask_ms": describe([r["first_mask_ms"] for r in ok]),
        "valid_tried": len(valid),
        "valid_accepted": sum(r["accepted"] for r in valid),
        "valid_rejected_by_reason": reasons,
        "invalid_tried": sum(not r["valid"] for r in instances),
        "invalid_accepted": sum(r["accepted"] for r in instances if not r["valid"]),
        "disagreements": sum(r["disagree"] for r in instances),
        "not_round_trip": sum(not r["round_trip"] for r in instances),
        "masks_preempted": sum(len(r["preempted"]) for r in valid),
        "mask_us_all": describe(first + later),
        "mask_us_first": describe(first),
        "mask_us_later": describe(later),
    }


def fmt(x, digits=1):
    if x is None:
        return "-"
    return f"{x:,.{digits}f}" if isinstance(x, float) else f"{x:,}"


def stats_cells(d, digits=1):
    return " / ".join(fmt(d[k], digits) for k in ("mean", "p50", "p90", "p99", "max"))


def pct(a, b):
    return f"{a:,} / {b:,} ({100 * a / b:.1f}%)" if b else f"{a} / {b}"


def engine_table(name, version, s):
    lines = [f"### {name} {version}", "", "| metric | value |", "|---|---|"]
    add = lambda k, v: lines.append(f"| {k} | {v} |")
    add("tokenizer set-up (s)", fmt(s["setup_s"], 3))
    add("schemas compiled / tried", pct(s["schemas_compiled"], s["schemas_tried"]))
    add(
        "unsupported (error) / compile timeout / crash",
        f"{s['unsupported']} / {s['compile_timeouts']} / {s['crashes']}",
    )
    add("schemas whose tests were cut short (timeout/crash)", s["test_phase_cut_short"])
    add("compile = time to first mask (ms): mean / p50 / p90 / p99 / max", stats_cells(s["compile_ms"], 2))
    add("  of which grammar + matcher (ms): mean / p50 / p90 / p99 / max", stats_cells(s["build_ms"], 2))
    add("  of which first mask (ms): mean / p50 / p90 / p99 / max", stats_cells(s["compile_first_mask_ms"], 2))
    add("compile, process CPU time (ms): mean / p50 / p90 / p99 / max", stats_cells(s["compile_cpu_ms"], 2))
    add("compiles preempted by other processes (wall time inflated)", s["compiles_preempted"])
    add("valid values fully accepted / tried", pct(s["valid_accepted"], s["valid_tried"]))
    add(
        "valid values wrongly rejected (by where)",
        f"{s['valid_tried'] - s['valid_accepted']:,}"
        + (
            " (" + ", ".join(f"{k}: {v}" for k, v in sorted(s["valid_rejected_by_reason"].items())) + ")"
            if s["valid_rejected_by_reason"]
            else ""
        ),
    )
    add("invalid values wrongly accepted / tried", pct(s["invalid_accepted"], s["invalid_tried"]))
    add("mask/consume disagreements", s["disagreements"])
    add("masks preempted by other processes (left out of mask times)", f"{s['masks_preempted']:,}")
    for label, key in (("all", "mask_us_all"), ("first of a value", "mask_us_first"), ("later", "mask_us_later")):
        add(f"mask time, {label} (us): n = {s[key]['count']:,}; mean / p50 / p90 / p99 / max", stats_cells(s[key]))
    add("wall time of the run (s)", fmt(s["wall_s"], 1))
    add("machine CPU busy during the run (this benchmark alone: one core)", fmt(s["machine_busy_pct"], 0) + "%")
    return "\n".join(lines)


def notable(results, top=5):
    """Slowest compiles per engine, and schemas where one engine compiles far slower than the other."""
    lines = []
    for name, res in results.items():
        ok = sorted((r for r in res["rows"] if r["status"] == "ok"), key=lambda r: -r["compile_ms"])[:top]
        lines.append(f"- {name}, slowest compiles: " + ", ".join(f"{r['file']} {r['compile_ms']:,.0f} ms" for r in ok))
        bad = [r for r in res["rows"] if r["status"] in ("timeout", "crash") or r["test_status"] not in (None, "ok")]
        for r in bad:
            lines.append(f"- {name}, {r['file']}: {r['status']} {r['error'] or ''} {r['test_status'] or ''}".rstrip())
    if len(results) == 2:
        (a, ra), (b, rb) = results.items()
        by_file = {r["file"]: r for r in rb["rows"]}
        pairs = [
            (r, by_file[r["file"]])
            for r in ra["rows"]
            if r["status"] == "ok" and by_file.get(r["file"], {}).get("status") == "ok"
        ]
        ratio = sorted(
            pairs, key=lambda p: -max(p[0]["compile_ms"] / p[1]["compile_ms"], p[1]["compile_ms"] / p[0]["compile_ms"])
        )[:top]
        lines.append(
            f"- compile ratio extremes ({a} ms vs {b} ms): "
            + ", ".join(f"{x['file']} {x['compile_ms']:,.1f} vs {y['compile_ms']:,.1f}" for x, y in ratio)
        )
        only_a = [
            r["file"] for r in ra["rows"] if r["status"] == "ok" and by_file.get(r["file"], {}).get("status") != "ok"
        ]
        by_file_a = {r["file"]: r for r in ra["rows"]}
        only_b = [
            r["file"] for r in rb["rows"] if r["status"] == "ok" and by_file_a.get(r["file"], {}).get("status") != "ok"
        ]
        lines.append(f"- compiled only by {a}: {len(only_a)}; only by {b}: {len(only_b)}")
    return "\n".join(lines)


def common_subset(results):
    """Summaries restricted to the schemas every engine compiled, so coverage does not skew the comparison."""
    compiled = [{r["file"] for r in res["rows"] if r["status"] == "ok"} for res in results.values()]
    common = set.intersection(*compiled)
    out = {}
    for name, res in results.items():
        rows = [r for r in res["rows"] if r["file"] in common]
        instances = [r for r in res["instances"] if r["file"] in common]
        out[name] = summarise_engine(rows, instances, res["starts"], None)
    return out


def comparison_table(subset):
    """Side by side, one column per engine, on the common subset."""
    names = list(subset)
    lines = [
        "| metric (schemas compiled by every engine) | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    row = lambda label, cell: lines.append(f"| {label} | " + " | ".join(cell(subset[n]) for n in names) + " |")
    row("schemas", lambda s: fmt(s["schemas_tried"]))
    row("compile (ms): mean / p50 / p90 / p99 / max", lambda s: stats_cells(s["compile_ms"], 2))
    row("compile, CPU time (ms): mean / p50 / p90 / p99 / max", lambda s: stats_cells(s["compile_cpu_ms"], 2))
    row("valid values fully accepted / tried", lambda s: pct(s["valid_accepted"], s["valid_tried"]))
    row("invalid values wrongly accepted / tried", lambda s: pct(s["invalid_accepted"], s["invalid_tried"]))
    for label, key in (("all", "mask_us_all"), ("first of a value", "mask_us_first"), ("later", "mask_us_later")):
        row(f"mask time, {label} (us): mean / p50 / p90 / p99 / max", lambda s, key=key: stats_cells(s[key]))
    return "\n".join(lines)


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_counters():
    """(idle, total) jiffies of the whole machine from /proc/stat, or None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return fields[3] + fields[4], sum(fields)


def busy_pct(start, end):
    """Share of all cores that were busy between two cpu_counters() readings."""
    if start is None or end is None or end[1] == start[1]:
        return None
    return 100 * (1 - (end[0] - start[0]) / (end[1] - start[1]))


def version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# ----------------------------------------------------------------------------------------------------------
# Main.
# ----------------------------------------------------------------------------------------------------------


def sample_files(directory, n, seed):
    """A seeded random sample of the schema files, the same for every engine; sorted names for stable output."""
    files = sorted(p.name for p in Path(directory).glob("*.json"))
    if not files:
        sys.exit(f"no *.json files in {directory}")
    return sorted(random.Random(seed).sample(files, min(n, len(files))))


def run_engine(name, files, args, options, log):
    cpu = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    proc = EngineProcess(name, args.tokenizer, options, cpu)
    rows, all_instances = [], []
    started, counters = time.monotonic(), cpu_counters()
    try:
        for i, fname in enumerate(files, 1):
            row, instances = proc.run_schema(Path(args.schemas) / fname, args.timeout)
            rows.append(summarise_schema(row, instances))
            all_instances.extend(dict(r, file=fname) for r in instances)
            if row["status"] in ("timeout", "crash") or row["test_status"] not in (None, "ok"):
                log(f"  {name} {fname}: {row['status']} {row['error'] or ''} {row['test_status'] or ''}")
            if i % 25 == 0 or i == len(files):
                log(f"  {name}: {i}/{len(files)} schemas, {time.monotonic() - started:.0f} s")
    finally:
        proc.close()
    wall_s = time.monotonic() - started
    busy = busy_pct(counters, cpu_counters())
    return {
        "summary": summarise_engine(rows, all_instances, proc.starts, wall_s, busy),
        "rows": rows,
        "starts": proc.starts,
        "instances": all_instances,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer directory")
    parser.add_argument("--schemas", required=True, help="MaskBench data directory (jsonschemabench/maskbench/data)")
    parser.add_argument("--sample", type=int, default=400, help="number of schema files (default 400)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds allowed for one schema's compile, and again for its test values (default 30)",
    )
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument(
        "--xgrammar-non-strict",
        action="store_true",
        help="compile_json_schema(strict_mode=False): allow properties/items the schema does not list",
    )
    parser.add_argument("--json", help="write every per-schema row and the summaries here")
    args = parser.parse_args()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)

    files = sample_files(args.schemas, args.sample, args.seed)
    options = {"xgrammar_non_strict": args.xgrammar_non_strict}
    versions = {name: version(name) for name in args.engines}
    results = {}
    for name in args.engines:  # one engine at a time: never two timing runs at once
        log(f"{name} {versions[name]}: {len(files)} schemas")
        results[name] = run_engine(name, files, args, options, log)

    header = [
        "## Grammar engines on MaskBench",
        "",
        f"CPU: {cpu_model()} ({os.cpu_count()} logical cores; engine child pinned to one, single-threaded); Python "
        f"{platform.python_version()}; tokenizer {args.tokenizer}; {len(files)} schema files sampled with seed "
        f"{args.seed} from {args.schemas}; timeout {args.timeout:g} s. Options: llguidance JSON defaults; xgrammar "
        f"any_whitespace=True, strict_mode={not args.xgrammar_non_strict}. Times: mean / p50 / p90 / p99 / max.",
    ]
    tables = [engine_table(name, versions[name], res["summary"]) for name, res in results.items()]
    subset = common_subset(results)
    if len(results) > 1:
        tables.append("### Side by side on the common subset\n\n" + comparison_table(subset))
    text = "\n\n".join(["\n".join(header), *tables, "### Notable schemas\n\n" + notable(results)])
    print(text)
    if args.json:
        payload = {
            "cpu": cpu_model(),
            "versions": versions,
            "sample": args.sample,
            "seed": args.seed,
            "timeout_s": args.timeout,
            "options": options,
            "files": files,
            "common_subset": subset,
            # per-value results (with every mask time) stay out: rows carry their per-schema figures
            "engines": {n: {k: v for k, v in res.items() if k != "instances"} for n, res in results.items()},
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
