"""Crash safety: `rocketllm shard` SIGKILLed at dozens of seeded random points never leaves a set that loads
incomplete, and re-running it always finishes a set identical to an uninterrupted run's.

The kills happen in tests/fixtures/kill_shard.py (one warm process forking a child per run); this test
states what must hold after each. Set ROCKETLLM_KILL_SEED to replay a failure; the seed is in every message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RESHARD = "re-run `rocketllm shard` on the source model"
HELPER = Path(__file__).parent / "fixtures" / "kill_shard.py"
MIN_KILLS = 30


def one_line(run: dict) -> str:
    lines = run["stderr"].strip().splitlines()
    assert run["code"] == 1 and len(lines) == 1 and lines[0].startswith("error: "), run
    assert "internal error" not in lines[0] and "Traceback" not in run["stderr"], run
    return lines[0]


def check_after_kill(kill: dict, start: str, reference: dict) -> None:
    """What a user finds after the kill: the output directory is absent, complete and right, or (when a damaged
    set was being replaced) still the damaged one, refused with the advice to re-run shard."""
    after = kill["after"]
    assert "child_error" not in after, after
    if after["load"] == "ok":
        assert after["units"] == reference["units"], "a set that loads after a kill must be the complete one"
        assert after["generate"]["code"] == 0, after["generate"]
    elif after["load"] == "absent":
        assert "model path not found" in one_line(after["generate"])
    else:
        assert start == "damaged" and after["load"].startswith("refused: ") and after["load"].endswith(RESHARD), after[
            "load"
        ]
        assert one_line(after["generate"]).endswith(RESHARD)
    if "generate_partial" in after:  # the hidden partial directory is never taken for a model either
        partial = after["generate_partial"]
        if partial["code"] != 0:  # 0 only once its manifest is written: it is then complete
            line = one_line(partial)
            assert line.endswith(RESHARD) or "no config.json" in line, line
    if not kill["killed"]:
        assert kill["run"].get("code") == 0, kill["run"]  # the point was past the end: the run finished


def check_resume(trial: dict, reference: dict) -> None:
    resume = trial["resume"]
    assert "child_error" not in resume, resume
    assert resume["code"] == 0, resume
    assert resume["verify"]["code"] == 0 and json.loads(resume["verify"]["stdout"])["verified"] is True, resume[
        "verify"
    ]
    assert resume["units"] == reference["units"] and resume["files"] == reference["files"]
    assert resume["tokens"] == reference["tokens"]
    assert set(resume["leftovers"]) <= {".out.lock"}, resume["leftovers"]  # no partial or replaced set left behind
    last = trial["kills"][-1]["after"]
    if trial["start"] == "fresh":
        # Resuming rewrites only what was not finished: at most the unit in flight beyond those on disk.
        on_disk = last.get("units_on_disk", len(reference["units"]) if last["load"] == "ok" else 0)
        assert len(resume["rewritten"]) <= len(reference["units"]) - on_disk + 1, (on_disk, resume["rewritten"])


def test_shard_survives_sigkill_at_random_points(tiny_factory, tmp_path, monkeypatch):
    seed = int(os.environ.get("ROCKETLLM_KILL_SEED", "20240607"))
    source = tiny_factory("llama", "sharded", num_hidden_layers=12)
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps(
            {
                "source": str(source),
                "work": str(tmp_path),
                "seed": seed,
                "random_events": 8,
                "bytes_kills": 10,
                "timer_kills": 5,
                "prompt_ids": [1, 5, 9, 42, 7],
                "new_tokens": 6,
            }
        )
    )
    env = {**os.environ, "ROCKETLLM_PROBE_BYTES": "32MiB", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(HELPER), str(plan)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"seed {seed}: {done.stderr[-3000:]}"
    report = json.loads(done.stdout)
    reference = report["reference"]
    assert reference.get("code") == 0 and len(reference["units"]) == 15 and reference["tokens"], (
        f"seed {seed}: {reference}"
    )

    kills = [k for t in report["trials"] for k in t["kills"] if k["killed"]]
    for trial in report["trials"]:
        for kill in trial["kills"]:
            try:
                check_after_kill(kill, trial["start"], reference)
            except AssertionError as exc:
                raise AssertionError(
                    f"seed {seed} (ROCKETLLM_KILL_SEED={seed} replays it), trial {trial['trial']}, "
                    f"{kill['kind']} kill at {kill['at']} ({kill['where']}): {exc}"
                ) from None
        try:
            check_resume(trial, reference)
        except AssertionError as exc:
            raise AssertionError(
                f"seed {seed} (ROCKETLLM_KILL_SEED={seed} replays it), trial {trial['trial']} after kills at "
                f"{[(k['kind'], k['at'], k['where']) for k in trial['kills']]}: {exc}"
            ) from None

    print(
        f"seed {seed}: {len(kills)} kills survived ({sum(k['kind'] == 'event' for k in kills)} at write-side calls, "
        f"{sum(k['kind'] == 'bytes' for k in kills)} inside file data, {sum(k['kind'] == 'timer' for k in kills)} on a "
        f"timer), {sum(t['start'] == 'damaged' for t in report['trials'])} of {len(report['trials'])} trials repairing "
        f"a damaged set; {reference['events']} write-side calls and {reference['bytes']} bytes in an uninterrupted run"
    )
    assert len(kills) >= MIN_KILLS, f"seed {seed}: only {len(kills)} of the kill points landed inside a run"
    # The kills spread over the run: into unit data, and into the final manifest / journal / rename steps.
    wheres = [k["where"] or "" for k in kills]
    assert any(".safetensors.tmp" in w and "bytes written" in w for w in wheres), (
        f"seed {seed}: no kill inside unit data"
    )
    for step in (
        "open manifest.json.tmp",
        "os.replace(manifest.json.tmp",
        "os.unlink(journal.jsonl)",
        "os.rename(.out.partial, out)",
    ):
        assert any(step in w for w in wheres), f"seed {seed}: no kill just before {step}"
