"""rocketllm shard: every source tensor lands in exactly one unit file, reruns reuse, --verify catches
changed bytes, an interrupted run never leaves a loadable set and resumes to the same bytes, and every
bad input is one `error:` line with nothing written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_contract import one_error_line
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.checkpoint.manifest import MANIFEST, Manifest
from rocketllm_cli.shard import sharder
from rocketllm_cli.shard.journal import JOURNAL

pytestmark = pytest.mark.compat

RESHARD_HINT = "re-run `rocketllm shard`"


def invoke(*args, env: dict | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def files_under(path: Path) -> dict[str, int]:
    """Every file below `path` (hidden ones included) -> its mtime in ns."""
    return (
        {str(p.relative_to(path)): p.stat().st_mtime_ns for p in sorted(path.rglob("*")) if p.is_file()}
        if path.exists()
        else {}
    )


def source_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    for f in sorted(model_dir.glob("*.bin")):
        tensors.update(torch.load(f, map_location="cpu", weights_only=True))
    return tensors


def shard_json(source: Path, out: Path, *extra) -> dict:
    result = invoke("shard", source, "--out", out, "--json", *extra)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)  # stdout holds the one JSON document and nothing else


@pytest.fixture(scope="module")
def good_set(tiny_checkpoint, tmp_path_factory) -> Path:
    """One complete shard set of the default tiny model; tests that damage it work on a copy."""
    out = tmp_path_factory.mktemp("good") / "llama"
    shard_json(tiny_checkpoint, out)
    return out


# -- a good source ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["single", "sharded", "bin"])
def test_shard_accounts_for_every_tensor_and_reruns_reuse(layout, tiny_factory, good_set, tmp_path):
    source = tiny_factory("llama", layout)
    out = tmp_path / "out"
    doc = shard_json(source, out)
    assert doc["reused"] is False and doc["directory"] == str(out)
    assert doc["units"] == 7 and doc["layers"] == 4 and doc["dtype"] == "fp32"
    assert doc["seconds"] > 0 and doc["mb_per_s"] == round(doc["bytes"] / doc["seconds"] / 1e6, 1)

    manifest = Manifest.load(out)
    assert [u.name for u in manifest.units] == [
        "embed",
        "layer.000",
        "layer.001",
        "layer.002",
        "layer.003",
        "norm",
        "lm_head",
    ]
    assert doc["bytes"] == manifest.total_bytes
    expected = source_tensors(source)
    records = [(u, t) for u in manifest.units for t in u.tensors]
    assert sorted(t.source for _, t in records) == sorted(expected)  # each source tensor in exactly one unit
    for unit in manifest.units:
        stored = load_file(out / unit.file)
        assert sorted(stored) == sorted(t.name for t in unit.tensors)
        for t in unit.tensors:
            assert torch.equal(stored[t.name], expected[t.source]), t.name
    for name in ("config.json", "tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).is_file(), name  # self-contained: generate needs nothing from the source
    assert not (out / JOURNAL).exists() and not (out.parent / f".{out.name}.partial").exists()

    # The same weights in another layout give byte-identical units.
    assert [u.sha256 for u in manifest.units] == [u.sha256 for u in Manifest.load(good_set).units]

    before = files_under(out)
    again = shard_json(source, out)
    assert again["reused"] is True and again["units"] == doc["units"] and again["bytes"] == doc["bytes"]
    assert files_under(out) == before  # nothing rewritten


def test_default_location_is_the_cache_and_a_second_run_reuses(tiny_checkpoint, tmp_path):
    env = {"ROCKETLLM_CACHE": str(tmp_path / "cache")}
    first = invoke("shard", tiny_checkpoint, "--json", env=env)
    assert first.exit_code == 0, first.stderr
    doc = json.loads(first.stdout)
    directory = Path(doc["directory"])
    assert directory.parent == tmp_path / "cache" / "shards" and (directory / MANIFEST).is_file()
    assert doc["reused"] is False
    before = files_under(directory)

    second = invoke("shard", tiny_checkpoint, "--json", env=env)
    assert second.exit_code == 0, second.stderr
    again = json.loads(second.stdout)
    assert again["reused"] is True and again["directory"] == str(directory)
    assert files_under(directory) == before
    assert [p.name for p in (tmp_path / "cache" / "shards").iterdir()] == [directory.name]


@pytest.mark.realmodel
def test_a_gguf_is_known_by_its_content_under_any_path_or_name(smollm2_gguf, tmp_path):
    """The same file copied elsewhere under another name (a new modification time too) finds the set the first
    sharded, and the same warm server; a file whose bytes differ is another model."""
    from rocketllm_cli.warm.registry import key_for

    env = {"ROCKETLLM_CACHE": str(tmp_path / "cache")}
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copyfile(smollm2_gguf, copy)
    first = json.loads(invoke("shard", smollm2_gguf, "--json", env=env).stdout)
    again = invoke("shard", copy, "--json", env=env)
    assert again.exit_code == 0, again.stderr
    doc = json.loads(again.stdout)
    assert doc["reused"] is True and doc["directory"] == first["directory"]
    assert [p.name for p in (tmp_path / "cache" / "shards").iterdir()] == [Path(first["directory"]).name]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ROCKETLLM_CACHE", str(tmp_path / "cache"))
        assert key_for(str(copy), {}) == key_for(str(smollm2_gguf), {})
        with open(copy, "r+b") as f:  # one byte of tensor data changed: not the same model any more
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 1]))
        assert key_for(str(copy), {}) != key_for(str(smollm2_gguf), {})


def test_human_output_names_the_directory_on_stdout_and_logs_on_stderr(tiny_checkpoint, tmp_path):
    result = invoke("shard", tiny_checkpoint, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == str(tmp_path / "out") and "7 units (4 layers)" in lines[1] and "sharded in" in lines[1]
    assert "sharded" in result.stderr  # the log line goes to stderr, never into the result


# -- verify -------------------------------------------------------------------------------------------------


def test_verify_passes_on_a_good_set(good_set):
    result = invoke("shard", good_set, "--verify")
    assert result.exit_code == 0, result.stderr
    assert "verify: ok" in result.stdout
    doc = json.loads(invoke("shard", good_set, "--verify", "--json").stdout)
    assert doc["verified"] is True and doc["problems"] == [] and doc["reused"] is True
    # A shard directory reports the same fields as a fresh run.
    assert {"units", "layers", "bytes", "seconds", "mb_per_s", "dtype"} <= set(doc)


def test_verify_catches_one_flipped_byte_inside_a_tensor(good_set, tmp_path):
    copy = shutil.copytree(good_set, tmp_path / "copy")
    unit = Manifest.load(copy).unit("layer.001")
    tensor = unit.tensors[0]
    path = copy / unit.file
    data = bytearray(path.read_bytes())
    data[tensor.offset + tensor.nbytes // 2] ^= 0x01
    path.write_bytes(bytes(data))

    result = invoke("shard", copy, "--verify")
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and RESHARD_HINT in lines[0] and unit.file in lines[0]
    assert "Traceback" not in result.stderr
    assert "verify: FAILED" in result.stdout


def test_a_truncated_unit_fails_on_load_with_one_line(good_set, tmp_path):
    copy = shutil.copytree(good_set, tmp_path / "copy")
    unit = Manifest.load(copy).unit("layer.002")
    os.truncate(copy / unit.file, unit.bytes // 2)
    for args in (["generate", copy, "Hello", "--raw", "-n", "2"], ["shard", copy]):
        line = one_error_line(invoke(*args))
        assert unit.file in line and "truncated" in line and RESHARD_HINT in line


# -- interrupted runs ---------------------------------------------------------------------------------------


def test_an_interrupted_shard_never_completes_and_a_rerun_resumes_to_the_same_bytes(
    tiny_factory, good_set, tmp_path, monkeypatch
):
    source = tiny_factory("llama")
    out = tmp_path / "out"
    partial = tmp_path / f".{out.name}.partial"
    real_write = sharder._write_unit
    calls: list[str] = []

    def interrupted_after_three(directory, file, plan, tensors, mapping, formats=None, fused=None):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(file)
        return real_write(directory, file, plan, tensors, mapping, formats, fused)

    monkeypatch.setattr(sharder, "_write_unit", interrupted_after_three)
    result = invoke("shard", source, "--out", out)
    assert result.exit_code == 130
    assert result.stderr.strip().splitlines()[-1] == (
        "error: interrupted: 3 of 7 units are written and kept; run the same command again to resume"
    )
    assert not out.exists()  # nothing that loads
    journal = (partial / JOURNAL).read_text().splitlines()
    assert len(journal) == 3 and sorted(p.name for p in partial.glob("*.safetensors")) == sorted(calls)

    # Make the leftovers worse: a torn last journal line and a journaled unit cut short.
    with open(partial / JOURNAL, "a") as f:
        f.write('{"fingerprint": "torn')
    os.truncate(partial / calls[1], 100)

    rewritten: list[str] = []

    def counting(directory, file, plan, tensors, mapping, formats=None, fused=None):
        rewritten.append(file)
        return real_write(directory, file, plan, tensors, mapping, formats, fused)

    monkeypatch.setattr(sharder, "_write_unit", counting)
    result = invoke("shard", source, "--out", out, "--json")
    assert result.exit_code == 0, result.stderr
    # the journal's torn line is dropped and the cut unit is written again: two of the three are kept
    assert f"resuming: 2 of 7 units already written (in {partial})" in result.stderr.splitlines()
    doc = json.loads(result.stdout)
    assert doc["reused"] is False
    assert len(rewritten) == 7 - 3 + 1 and calls[1] in rewritten and calls[0] not in rewritten
    assert not partial.exists() and not (out / JOURNAL).exists()
    resumed, clean = Manifest.load(out), Manifest.load(good_set)
    assert [(u.name, u.file, u.bytes, u.sha256) for u in resumed.units] == [
        (u.name, u.file, u.bytes, u.sha256) for u in clean.units
    ]
    assert invoke("shard", out, "--verify").exit_code == 0


@pytest.mark.parametrize("where", ["reading", "planning", "the first unit"])
def test_an_interrupt_before_any_unit_says_there_is_nothing_to_resume(where, tiny_factory, tmp_path, monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    target = {
        "reading": (sharder, "open_source"),
        "planning": (sharder, "plan_packing"),
        "the first unit": (sharder, "_write_unit"),
    }
    monkeypatch.setattr(*target[where], interrupt)
    out = tmp_path / "out"
    result = invoke("shard", tiny_factory("llama"), "--out", out)
    assert result.exit_code == 130, (result.stdout, result.stderr)
    assert result.stderr.strip().splitlines()[-1] == (
        "error: interrupted before the first unit was written: nothing to resume"
    )
    assert not out.exists()


# -- bad inputs ---------------------------------------------------------------------------------------------


def _model_dir(
    root: Path, template: Path, config: dict | None = None, weights: bool = True, garbage: bool = False
) -> Path:
    root.mkdir()
    for f in template.iterdir():
        if f.suffix == ".safetensors" and not weights:
            continue
        shutil.copy(f, root / f.name)
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    if garbage:
        (root / "model.safetensors").write_bytes((24).to_bytes(8, "little") + b"{not a safetensors header")
    return root


BAD_INPUTS = {
    # case: (how to build the model argument, extra args, what the message must say)
    "missing path": (lambda tmp, src: tmp / "no-such-model", [], "model path not found"),
    "no config.json": (lambda tmp, src: (tmp / "empty").mkdir() or tmp / "empty", [], "no config.json"),
    "unknown model_type": (
        lambda tmp, src: _model_dir(tmp / "m", src, {"model_type": "notamodel"}),
        [],
        "unsupported architecture 'notamodel'",
    ),
    "not a causal LM": (
        lambda tmp, src: _model_dir(tmp / "m", src, {"model_type": "t5"}),
        [],
        "unsupported architecture 't5'",
    ),
    "bad --dtype": (lambda tmp, src: src, ["--dtype", "fp8"], "bad --dtype 'fp8'"),
    "garbage safetensors header": (
        lambda tmp, src: _model_dir(tmp / "m", src, garbage=True),
        [],
        "model.safetensors: corrupt safetensors header",
    ),
    "config without weights": (
        lambda tmp, src: _model_dir(tmp / "m", src, weights=False),
        [],
        "no *.safetensors or *.bin weights",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_error_line_and_writes_nothing(case, tiny_checkpoint, tmp_path):
    build, extra, says = BAD_INPUTS[case]
    model = build(tmp_path, tiny_checkpoint)
    cache = tmp_path / "cache"
    for out_args in ([], ["--out", tmp_path / "out"]):
        line = one_error_line(invoke("shard", model, *out_args, *extra, env={"ROCKETLLM_CACHE": str(cache)}))
        assert says in line, line
        assert files_under(cache) == {} and not (cache / "shards").exists()
        assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


def test_out_on_a_foreign_directory_leaves_it_untouched(tiny_checkpoint, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    (foreign / "sub").mkdir()
    (foreign / "sub" / "data.bin").write_bytes(b"\x00" * 10)
    before = files_under(foreign)
    line = one_error_line(invoke("shard", tiny_checkpoint, "--out", foreign))
    assert str(foreign) in line and "not a shard directory" in line
    assert files_under(foreign) == before and (foreign / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no partial directory beside it


def test_errors_cross_the_process_boundary_as_one_line_and_debug_shows_the_traceback(tiny_checkpoint, tmp_path):
    model = _model_dir(tmp_path / "m", tiny_checkpoint, {"model_type": "t5"})
    command = [sys.executable, "-m", "rocketllm_cli", "shard", str(model), "--out", str(tmp_path / "out")]
    base = {k: v for k, v in os.environ.items() if k != "ROCKETLLM_DEBUG"}
    plain = subprocess.Popen(command, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    debug = subprocess.Popen(
        command, env={**base, "ROCKETLLM_DEBUG": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = plain.communicate(timeout=120)
    dout, derr = debug.communicate(timeout=120)

    assert plain.returncode == 1 and out == ""
    assert err.strip().splitlines() == [err.strip()] and err.startswith("error: unsupported architecture 't5'")
    assert debug.returncode == 1 and dout == ""
    assert "Traceback (most recent call last)" in derr and derr.strip().splitlines()[-1] == err.strip()
    assert not (tmp_path / "out").exists()


def test_a_gguf_tensor_of_a_type_nothing_decodes_is_one_line_naming_it(smollm2_gguf, tmp_path):
    """A tensor stored as an activation-only type (Q8_K) is refused before any unit is written, in one line that names
    the tensor and its type: gguf's dequantize would have failed on it half way through the set."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    from rocketllm_cli.synthetic.gguf import write_llama_gguf

    good = write_llama_gguf(
        tmp_path / "good.gguf",
        smollm2_gguf,
        hidden=256,
        layers=1,
        intermediate=256,
        heads=4,
        kv_heads=2,
        qtype="Q8_0",
        embed_type="F16",
    )
    source = GGUFReader(good)
    bad = tmp_path / "q8k.gguf"
    writer = GGUFWriter(bad, "llama")
    for key, field in source.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for tensor in source.tensors:
        if tensor.name == "blk.0.attn_q.weight":  # 256 x 256 as Q8_K: one 292-byte block per row
            writer.add_tensor(tensor.name, np.zeros((256, 292), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_K)
        else:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "set"
    result = invoke("shard", bad, "--out", out, "--json")
    message = one_error_line(result)
    assert "blk.0.attn_q.weight is Q8_K" in message and "another type" in message, message
    assert not out.exists() or not any(out.iterdir())
