"""Progress is for a person at a terminal: there `shard` draws a bar of units and bytes; off one (a log, a pipe)
no bar of ours or of any library draws, and each phase is at most one line. Library warnings are silenced
unless ROCKETLLM_DEBUG=1."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from collections import Counter

import pytest

from rocketllm_cli import output as output_module
from rocketllm_cli.checkpoint.manifest import Manifest
from rocketllm_cli.output import Output
from rocketllm_cli.sizes import format_bytes

CLI = [sys.executable, "-m", "rocketllm_cli"]
# What a redrawn bar leaves in a log: a carriage return, tqdm's `%|` and `it/s`, bar glyphs (ours and tqdm's).
BAR_MARKS = ("\r", "%|", "it/s", "━", "█", "▏", "Loading weights", "Converting and de-quantizing")
# The switches the CLI sets itself: a parent that set them (an earlier in-process command) must not do its work.
SWITCHES = (
    "TQDM_DISABLE",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "TRANSFORMERS_VERBOSITY",
    "TOKENIZERS_PARALLELISM",
    "ROCKETLLM_DEBUG",
)


def clean_env(**extra: str) -> dict:
    return {**{k: v for k, v in os.environ.items() if k not in SWITCHES}, **extra}


def run_cli(*args, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=clean_env(**(env or {}))
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def assert_log_lines(stderr: str) -> list[str]:
    """No bar and at most one line per phase (each line's first word: sharding, sharded, loading...)."""
    for mark in BAR_MARKS:
        assert mark not in stderr, (mark, stderr[-2000:])
    lines = stderr.strip().splitlines()
    repeated = [word for word, n in Counter(line.split()[0] for line in lines).items() if n > 1]
    assert not repeated, stderr
    return lines


def test_off_a_terminal_shard_and_generate_print_no_bar(tiny_checkpoint, tmp_path):
    out = tmp_path / "set"
    done = run_cli("shard", tiny_checkpoint, "--out", out)
    lines = assert_log_lines(done.stderr)
    assert [line for line in lines if line.startswith("sharded ")] == [lines[-1]] and lines[-1].endswith(f"-> {out}"), (
        lines
    )
    assert done.stdout.splitlines()[0] == str(out)

    # generate shards on first use (into a cache of its own), then loads and generates
    done = run_cli(
        "generate", tiny_checkpoint, "Hello", "--raw", "-n", "4", env={"ROCKETLLM_CACHE": str(tmp_path / "cache")}
    )
    lines = assert_log_lines(done.stderr)
    assert any(line.startswith("sharded ") for line in lines), lines
    assert done.stdout.strip()


def test_on_a_terminal_shard_draws_a_bar_of_units_and_bytes(tiny_checkpoint, tmp_path):
    out = tmp_path / "set"
    screen, stdout = run_on_terminal([*CLI, "shard", str(tiny_checkpoint), "--out", str(out)])
    units = len(Manifest.load(out).units)
    assert re.search(rf"sharding {tiny_checkpoint.name} .*\d+/{units} units · \d+/\d+ KiB", screen), screen
    assert f"sharded {tiny_checkpoint.name}: {units} units" in screen
    assert stdout.splitlines()[0] == str(out)  # the result stays on stdout, bar or not


def run_on_terminal(command: list[str], timeout: float = 300) -> tuple[str, str]:
    """Run with stderr on a pseudo-terminal (stdout a pipe); returns (everything drawn on the terminal, stdout)."""
    master, slave = pty.openpty()
    env = clean_env(TERM="xterm", COLUMNS="160")
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    drawn = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if not ready:
            if process.poll() is not None:
                break
            continue
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    stdout, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, drawn.decode(errors="replace")[-3000:]
    return drawn.decode(errors="replace"), stdout.decode()


def test_a_phase_off_a_terminal_is_one_line_once_it_lasts(monkeypatch, capsys):
    monkeypatch.setattr(output_module, "ANNOUNCE_AFTER_S", 0.05)
    out = Output()
    with out.progress("sharding tiny", 3 << 20, units=5) as phase:
        time.sleep(0.3)
        for _ in range(5):
            phase.advance(1 << 20, units=1)
    with out.progress("loading tiny", 1 << 20, units=1):
        pass  # quick: no line
    with out.progress("storage: RocketLLM", announce=False):
        time.sleep(0.3)  # the caller logs its own line
    assert capsys.readouterr().err.splitlines() == ["sharding tiny (5 units, 3.00 MiB)…"]


LIBRARY_NOISE = """
import warnings
from rocketllm_cli.output import quiet_libraries
quiet_libraries()
import tqdm
from transformers.utils import logging
for _ in tqdm.tqdm(range(3), desc="a library's bar"):
    pass
warnings.warn("a library's warning")
logging.get_logger("transformers").warning("transformers' warning")
"""


@pytest.mark.parametrize("debug", ["", "1"])
def test_library_bars_are_off_and_their_warnings_only_with_debug(debug):
    done = subprocess.run(
        [sys.executable, "-c", LIBRARY_NOISE],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(ROCKETLLM_DEBUG=debug),
    )
    assert done.returncode == 0, done.stderr
    assert "a library's bar" not in done.stderr and "\r" not in done.stderr
    shown = "a library's warning" in done.stderr, "transformers' warning" in done.stderr
    assert shown == ((True, True) if debug else (False, False)), done.stderr


@pytest.mark.realmodel
def test_the_real_gguf_off_a_terminal_is_a_line_per_phase_and_no_warning(smollm2_gguf, tmp_path):
    """Sharding SmolLM2 takes seconds: each phase that lasts ANNOUNCE_AFTER_S gets its one announcing line, in
    order (a phase this machine finishes sooner prints none), then the `indexed` line (the set indexes the file in
    place); transformers' GGUF bars and
    torch's warnings stay out of the log; generate on the set prints nothing but its phases."""
    out = tmp_path / "set"
    done = run_cli("shard", smollm2_gguf, "--out", out)
    manifest = Manifest.load(out)
    name = smollm2_gguf.stem
    phases = [
        f"reading {name}…",
        f"sharding {name} ({len(manifest.units)} units, {format_bytes(sum(u.tensor_bytes for u in manifest.units))})…",
        f"saving the config and tokenizer of {name}…",
    ]
    lines = assert_log_lines(done.stderr)
    assert lines[-1].startswith(f"indexed {name}: {len(manifest.units)} units"), lines
    assert lines[-1].endswith(f"of {smollm2_gguf.name} in place in {manifest.seconds:.1f} s -> {out}"), lines
    assert lines[:-1] == [p for p in phases if p in lines[:-1]], lines
    assert "Warning" not in done.stderr

    done = run_cli("generate", out, "The capital of France is", "--raw", "-n", "4")
    lines = assert_log_lines(done.stderr)
    assert all(line.startswith("loading ") and line.endswith(")…") for line in lines), lines
    assert done.stdout.strip()
