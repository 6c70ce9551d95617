"""Hostile safetensors headers and truncated GGUF files: every one is a one-line RocketError, never another
exception, never a read outside the file, never an allocation sized by what the header claims.

Hypothesis runs derandomized with bounded example counts, so CI sees the same examples every time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch
from cli_contract import one_error_line
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.checkpoint import stfile
from rocketllm_cli.errors import ShardError
from rocketllm_cli.sizes import format_bytes

FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
DTYPE_NAMES = sorted(stfile.DTYPES)

# -- strategies ----------------------------------------------------------------------------------------------

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 5000),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
dims = st.one_of(
    st.integers(0, 9),
    st.integers(-5, -1),
    st.integers(2**31, 2**70),
    st.booleans(),
    st.floats(0, 10),
    st.text(max_size=2),
)
numbers = st.one_of(
    st.integers(0, 4096),
    st.integers(-(2**64), -1),
    st.integers(2**32, 2**70),
    st.booleans(),
    st.floats(-10, 1e20),
    st.text(max_size=3),
    st.none(),
)


@st.composite
def consistent_entries(draw):
    """(name, dtype, shape) laid out contiguously as a writer would, then optionally damaged one way."""
    tensors = draw(
        st.lists(
            st.tuples(
                st.text(min_size=1, max_size=12), st.sampled_from(DTYPE_NAMES), st.lists(st.integers(0, 6), max_size=3)
            ),
            max_size=5,
            unique_by=lambda t: t[0],
        )
    )
    doc, offset = {}, 0
    for name, dtype, shape in tensors:
        n = stfile.DTYPES[dtype].itemsize
        for d in shape:
            n *= d
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    damage = draw(
        st.sampled_from(
            ["none"] * 6
            + ["overlap", "past_end", "product", "negative", "reversed", "dtype", "shape", "offsets", "entry"]
        )
    )
    names = list(doc)
    if names and damage != "none":
        victim = doc[draw(st.sampled_from(names))]
        begin, end = victim["data_offsets"]
        if damage == "overlap":
            victim["data_offsets"] = [max(0, begin - draw(st.integers(1, 64))), end]
        elif damage == "past_end":
            victim["data_offsets"] = [begin, end + draw(st.integers(1, 2**40))]
        elif damage == "product":
            victim["shape"] = victim["shape"] + [draw(st.integers(2, 2**40))]
        elif damage == "negative":
            victim["data_offsets"] = [-draw(st.integers(1, 2**40)), end]
        elif damage == "reversed":
            victim["data_offsets"] = [end + 1, begin]
        elif damage == "dtype":
            victim["dtype"] = draw(st.one_of(st.sampled_from(["F4", "f32", "", "Q4_0"]), json_values))
        elif damage == "shape":
            victim["shape"] = draw(st.one_of(st.lists(dims, max_size=4), json_values))
        elif damage == "offsets":
            victim["data_offsets"] = draw(st.one_of(st.lists(numbers, max_size=3), json_values))
        else:
            doc[draw(st.sampled_from(names))] = draw(json_values)
    if draw(st.booleans()):
        doc["__metadata__"] = draw(
            st.one_of(
                st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3),
                st.dictionaries(st.text(max_size=6), json_values, max_size=3),
                json_values,
            )
        )
    return doc, offset


@st.composite
def hostile_files(draw) -> bytes:
    """A whole file: 8-byte header length, header bytes, data."""
    kind = draw(st.sampled_from(["entries", "entries", "entries", "json", "binary", "nested", "digits", "huge"]))
    data_len = None
    if kind == "entries":
        doc, data_len = draw(consistent_entries())
        header = json.dumps(doc).encode()
    elif kind == "json":
        header = json.dumps(draw(json_values)).encode()
    elif kind == "binary":
        header = draw(st.binary(max_size=300))
    elif kind == "nested":  # deeper than any recursion limit
        depth = draw(st.integers(500, 200_000))
        opener = draw(st.sampled_from(["[", '{"a":', '{"t":{"dtype":"F32","shape":']))
        header = (opener * depth).encode()
    elif kind == "digits":  # an integer longer than Python parses by default
        header = b'{"t":{"dtype":"F32","shape":[' + b"9" * draw(st.integers(4000, 20_000)) + b'],"data_offsets":[0,4]}}'
    else:  # many entries: big, but bounded by the file itself
        n = draw(st.integers(1000, 20_000))
        header = json.dumps(
            {f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(n)}
        ).encode()
        data_len = n
    if data_len is None:
        data_len = draw(st.integers(0, 64))
    data_len = max(0, data_len + draw(st.sampled_from([0] * 6 + [-1, 1, -7])))
    claimed = draw(st.sampled_from(["exact"] * 6 + ["plus", "minus", "huge", "max", "limit"]))
    length = {
        "exact": len(header),
        "plus": len(header) + draw(st.integers(1, 100)),
        "minus": max(0, len(header) - draw(st.integers(1, 8))),
        "huge": 2**63 + 5,
        "max": 2**64 - 1,
        "limit": stfile.MAX_HEADER_BYTES + 1,
    }[claimed]
    return struct.pack("<Q", length) + header + bytes(data_len)


# -- stfile.read_header ----------------------------------------------------------------------------------------


def check_header_file(path: Path) -> str:
    """read_header on PATH: a ShardError of one line naming the file, or a header whose every tensor lies in the
    file."""
    size = path.stat().st_size
    tracemalloc.start()
    try:
        header = stfile.read_header(path)
    except ShardError as exc:
        header, message = None, str(exc)
        assert "\n" not in message and message.startswith(path.name) and len(message) < 400, message
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # What the header claims never sizes an allocation: parsing costs a bounded multiple of the file's own bytes.
    assert peak < 64 * size + (1 << 20), (peak, size)
    if header is None:
        return "refused"
    spans = []
    for entry in header.entries.values():
        numel = 1
        for d in entry.shape:
            numel *= d
        assert numel * entry.dtype.itemsize == entry.nbytes
        assert header.data_offset <= entry.start and entry.start + entry.nbytes <= size
        spans.append((entry.start, entry.start + entry.nbytes))
    spans = sorted(s for s in spans if s[0] < s[1])
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    fd = os.open(path, os.O_RDONLY)
    try:
        raw = path.read_bytes()
        for entry in header.entries.values():  # every accepted tensor reads fully from inside the file
            tensor = stfile.read_tensor(fd, entry)
            assert tuple(tensor.shape) == entry.shape and tensor.dtype == entry.dtype
            if entry.nbytes:
                assert (
                    bytes(tensor.reshape(-1).view(torch.uint8).numpy()) == raw[entry.start : entry.start + entry.nbytes]
                )
    finally:
        os.close(fd)
    return "accepted"


@settings(FUZZ, max_examples=250)
@given(data=hostile_files())
def test_read_header_refuses_hostile_headers_in_one_line(data, tmp_path_factory):
    path = tmp_path_factory.getbasetemp() / "fuzz-header.safetensors"
    path.write_bytes(data)
    event(check_header_file(path))


@pytest.mark.parametrize(
    "name, data",
    [
        ("empty file", b""),
        ("7 bytes", b"\x01" * 7),
        ("length past the end", struct.pack("<Q", 1000) + b"{}"),
        ("length 2**64-1", struct.pack("<Q", 2**64 - 1) + b"{}"),
        ("not UTF-8", struct.pack("<Q", 4) + b"\xff\xfe{}"),
        ("a JSON list", struct.pack("<Q", 2) + b"[]"),
        (
            "unhashable dtype",
            struct.pack("<Q", 55) + b'{"t":{"dtype":["F32"],"shape":[1],"data_offsets":[0,4]}}' + bytes(4),
        ),
        (
            "dtype an object",
            struct.pack("<Q", 52) + b'{"t":{"dtype":{"a":1},"shape":[],"data_offsets":[0,4]}}' + bytes(4),
        ),
        (
            "20000 digits",
            struct.pack("<Q", 20_060)
            + b'{"t":{"dtype":"F32","shape":['
            + b"9" * 20_000
            + b'],"data_offsets":[0,4]}}'
            + bytes(4),
        ),
        ("nested 100000 deep", struct.pack("<Q", 100_000) + b"[" * 100_000),
        ("metadata nested 900 deep", None),
        ("overlap", None),
        ("shape x dtype != bytes", None),
        (
            "bool offsets",
            struct.pack("<Q", 54) + b'{"t":{"dtype":"U8","shape":[1],"data_offsets":[false,true]}}' + bytes(1),
        ),
    ],
)
def test_read_header_named_cases(name, data, tmp_path):
    if name == "metadata nested 900 deep":  # parses, but printing it would recurse as deep as it nests
        body = b'{"__metadata__":{"k":' + b"[" * 900 + b"]" * 900 + b"}}"
        data = struct.pack("<Q", len(body)) + body
    elif name == "overlap":
        body = json.dumps(
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            }
        ).encode()
        data = struct.pack("<Q", len(body)) + body + bytes(12)
    elif name == "shape x dtype != bytes":
        body = json.dumps({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode()
        data = struct.pack("<Q", len(body)) + body + bytes(8)
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    assert check_header_file(path) == "refused", name


# -- through `rocketllm shard` ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hostile_model(tiny_checkpoint, tmp_path_factory):
    """A copy of the tiny model whose model.safetensors each example replaces, and the real header to mutate."""
    root = tmp_path_factory.mktemp("hostile")
    model = root / "model"
    shutil.copytree(tiny_checkpoint, model)
    raw = (model / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return model, json.loads(raw[8 : 8 + length]), raw[8 + length :]


@st.composite
def mutated_real_files(draw, real: dict, data: bytes) -> bytes:
    """The tiny model's own header with one field of one tensor changed: what a broken or hostile writer makes."""
    doc = json.loads(json.dumps(real))
    names = sorted(k for k in doc if k != "__metadata__")
    victim = draw(st.sampled_from(names))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "name", "entry", "drop"]))
    if field == "dtype":
        doc[victim]["dtype"] = draw(
            st.sampled_from(["I32", "U32", "F16", "BF16", "BOOL", "F64", "F8_E4M3", "I64", "Q4", ""])
        )
    elif field == "shape":
        doc[victim]["shape"] = draw(st.one_of(st.lists(st.integers(0, 2**20), max_size=3), st.lists(dims, max_size=3)))
    elif field == "data_offsets":
        begin, end = doc[victim]["data_offsets"]
        shift = draw(st.integers(-(2**20), 2**20))
        doc[victim]["data_offsets"] = draw(
            st.sampled_from([[begin + shift, end + shift], [begin, end + shift], [begin + shift, end]])
        )
    elif field == "name":
        doc[draw(st.text(min_size=1, max_size=30))] = doc.pop(victim)
    elif field == "entry":
        doc[victim] = draw(json_values)
    else:
        del doc[victim]
    header = json.dumps(doc).encode()
    return struct.pack("<Q", len(header)) + header + data


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")  # a failing 2 MB file is not worth printing
@settings(FUZZ, max_examples=80)
@given(data=st.data())
def test_shard_refuses_a_hostile_checkpoint_in_one_line_and_writes_nothing(data, hostile_model, tmp_path_factory):
    model, real, payload = hostile_model
    blob = data.draw(st.one_of(hostile_files(), mutated_real_files(real, payload)), label="model.safetensors")
    (model / "model.safetensors").write_bytes(blob)
    out = tmp_path_factory.getbasetemp() / "hostile-out"
    shutil.rmtree(out, ignore_errors=True)
    tracemalloc.start()
    try:
        result = CliRunner().invoke(app, ["shard", str(model), "--out", str(out)])
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 64 * len(blob) + (48 << 20), peak
    if result.exit_code == 0:
        # Only a header that still describes every tensor with its real dtype and shape may shard.
        header = stfile.read_header(model / "model.safetensors")
        assert {n: (e.dtype, e.shape) for n, e in header.entries.items()} == {
            n: (stfile.DTYPES[s["dtype"]], tuple(s["shape"])) for n, s in real.items() if n != "__metadata__"
        }
        event("sharded")
        return
    line = one_error_line(result)
    event("refused: " + re.sub(r" at tensor .*| \(.*|'.*", "", line.split(": ", 2)[-1])[:60])
    assert not out.exists() and not (out.parent / f".{out.name}.partial").exists()


# -- GGUF ----------------------------------------------------------------------------------------------------------


def gguf_cuts(gguf: Path, tmp_path: Path, cuts) -> list[Path]:
    """Copies of the first N bytes of GGUF, as an interrupted download leaves them."""
    paths = []
    with open(gguf, "rb") as f:
        for cut in cuts:
            f.seek(0)
            path = tmp_path / f"cut{cut}.gguf"
            path.write_bytes(f.read(cut))
            paths.append(path)
    return paths


# inside the magic, the counts, the metadata (the vocabulary runs to ~1.9 MB)
HEADER_CUTS = (0, 3, 8, 24, 1000, 100_000)
DATA_CUTS = (2_000_000, 49_181_216, -1)  # the header is whole, tensor data is missing (-1: one byte short)


@pytest.mark.realmodel
def test_a_truncated_gguf_is_one_line_naming_the_file_and_the_bytes(smollm2_gguf, tmp_path):
    size = smollm2_gguf.stat().st_size
    cuts = [*HEADER_CUTS, *(c if c > 0 else size + c for c in DATA_CUTS)]
    for path in gguf_cuts(smollm2_gguf, tmp_path, cuts):
        cut = path.stat().st_size
        if cut == 0:
            why = "the file is empty"
        elif cut in HEADER_CUTS:
            why = f"it ends inside its header, at {cut:,} bytes"
        else:  # the header is whole: it says how long the file is
            why = f"its header describes {size:,} bytes ({format_bytes(size)}), the file has {cut:,}"
        for args in (["shard", str(path), "--out", str(tmp_path / "out")], ["doctor", "--model", str(path)]):
            line = one_error_line(CliRunner().invoke(app, args))
            assert line.startswith(f"error: {path.name} is truncated: {why}"), line
            assert line.endswith("download it again (an interrupted download or a full disk cuts a file short)"), line
        assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


@pytest.mark.realmodel
def test_a_truncated_gguf_is_refused_before_torch_loads_or_a_warm_server_starts(smollm2_gguf, tmp_path):
    """generate with keep-alive on (a warm server would load the model): the cut file is one line from its header
    alone, before torch is imported or any note about warm models."""
    import os
    import subprocess
    import sys

    (path,) = gguf_cuts(smollm2_gguf, tmp_path, [2_000_000])
    probe = (
        "import sys\nfrom rocketllm_cli.app import main\ntry:\n    main()\nfinally:\n"
        "    print('imported torch:', 'torch' in sys.modules, file=sys.stderr)\n"
    )
    env = {**os.environ, "ROCKETLLM_KEEP_ALIVE": "5m"}
    done = subprocess.run(
        [sys.executable, "-c", probe, "generate", str(path), "hi", "-n", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and lines[-1] == "imported torch: False", done.stderr
    assert len(lines) == 2 and lines[0].startswith(f"error: {path.name} is truncated: its header describes"), (
        done.stderr
    )
