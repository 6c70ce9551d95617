"""Hostile manifests: Manifest.load on an edited, truncated or garbage manifest.json refuses in one line that
says to re-run `rocketllm shard`, or loads a manifest that describes exactly the same units: never another
exception, never an allocation sized by what the manifest claims."""

from __future__ import annotations

import json
import re
import shutil
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rocketllm_cli.checkpoint.manifest import MANIFEST, RESHARD, Manifest
from rocketllm_cli.errors import ShardError
from rocketllm_cli.shard import sharder

FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

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
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def good(tiny_factory, tmp_path_factory) -> tuple[Path, dict]:
    """A shard set of a model with tied embeddings (so the manifest has aliases) and its manifest as JSON."""
    out = tmp_path_factory.mktemp("manifest-fuzz") / "set"
    sharder.shard(tiny_factory("llama", tie_word_embeddings=True), out=out, log=lambda m: None)
    doc = json.loads((out / MANIFEST).read_text())
    assert doc["aliases"], "the fixture should exercise aliases"
    return out, doc


def what_loads(manifest: Manifest) -> tuple:
    """Everything a load binds by: fields that may differ without changing a single weight are left out
    (sha256 is --verify's business; seconds, source names and labels are informational)."""
    return (
        manifest.format_version,
        manifest.dtype,
        manifest.stack,
        sorted(manifest.aliases.items()),
        manifest.source["fingerprint"],
        [
            (
                u.name,
                u.kind,
                u.module,
                u.file,
                u.bytes,
                u.index,
                sorted((t.name, t.dtype, tuple(t.shape), t.offset, t.nbytes) for t in u.tensors),
            )
            for u in manifest.units
        ],
    )


def paths_of(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths_of(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths_of(v, prefix + (i,))


@st.composite
def edited(draw, doc: dict) -> bytes:
    """One edit anywhere in the manifest's JSON tree, or raw bytes that are not a manifest at all."""
    kind = draw(st.sampled_from(["edit"] * 8 + ["truncate", "binary", "nested", "digits"]))
    text = json.dumps(doc, indent=1)
    if kind == "truncate":
        return text.encode()[: draw(st.integers(0, len(text) - 1))]
    if kind == "binary":
        return draw(st.binary(max_size=200))
    if kind == "nested":
        return b"[" * draw(st.integers(500, 100_000))
    if kind == "digits":
        return text.replace('"bytes": ', '"bytes": ' + "7" * draw(st.integers(4300, 9000)), 1).encode()
    doc = json.loads(text)
    paths = [p for p in paths_of(doc) if p]
    path = draw(st.sampled_from(paths))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key, value = path[-1], parent[path[-1]]
    op = draw(st.sampled_from(["replace", "nudge", "delete", "duplicate", "swap", "add"]))
    if op == "nudge" and type(value) is int:
        parent[key] = value + draw(st.sampled_from([-4096, -4, -1, 1, 2, 4, 4096]))
    elif op == "delete":
        del parent[key]
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(key, json.loads(json.dumps(value)))
    elif op == "swap" and isinstance(parent, list) and len(parent) > 1:
        other = draw(st.integers(0, len(parent) - 1))
        parent[key], parent[other] = parent[other], parent[key]
    elif op == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=8))] = draw(json_values)
    else:
        parent[key] = draw(json_values)
    return json.dumps(doc).encode()


@settings(FUZZ)
@given(data=st.data())
def test_manifest_load_refuses_any_edit_in_one_line_or_loads_the_same_units(data, good, tmp_path_factory):
    source, doc = good
    work = tmp_path_factory.getbasetemp() / "manifest-fuzz-copy"
    if not work.exists():
        shutil.copytree(source, work)
    original = what_loads(Manifest.load(source))
    blob = data.draw(edited(doc), label="manifest.json")
    (work / MANIFEST).write_bytes(blob)
    tracemalloc.start()
    try:
        loaded = Manifest.load(work)
    except ShardError as exc:
        loaded, message = None, str(exc)
        assert "\n" not in message and message.endswith(RESHARD) and len(message) < 600, message
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 64 * len(blob) + (4 << 20), peak
    if loaded is None:
        event("refused: " + re.sub(r"\d+|'[^']*'|\"[^\"]*\"|^.*manifest.json: |; re-run.*", "", message)[:50])
    else:
        assert what_loads(loaded) == original  # an edit that loads changed nothing a load binds
        event("loaded unchanged")


NAMED_EDITS = {
    # name: (edit, what the message says); the first two loaded and generated other text before the header check
    "offset moved 4 bytes": (
        lambda d: d["units"][2]["tensors"][0].update(offset=d["units"][2]["tensors"][0]["offset"] + 4),
        "does not match the manifest",
    ),
    "offset of another tensor": (
        lambda d: d["units"][2]["tensors"][1].update(offset=d["units"][2]["tensors"][0]["offset"]),
        "does not match the manifest",
    ),
    "dtype changed": (lambda d: d["units"][3]["tensors"][0].update(dtype="F16"), "bad dtype"),
    "file not a string": (lambda d: d["units"][3].update(file=123), "bad file name"),
    "file with a NUL": (lambda d: d["units"][3].update(file="a\x00b"), "bad file name"),
    "a layer removed": (lambda d: d["units"].pop(3), "out of order"),
    "norm removed": (lambda d: d["units"].pop(-2), "bad file name"),
    "last unit removed": (lambda d: d["units"].pop(), "is not in the manifest"),
    "index true": (lambda d: d["units"][1].update(index=True), "layer index"),
    "format 6": (lambda d: d.update(format_version=6), "manifest format 6"),
    "packing unknown": (lambda d: d.update(packing="q3"), "bad packing"),
    "packed in a float set": (
        lambda d: d["units"][1]["tensors"][0].update(packed={"kind": "int4"}),
        "bad packed format",
    ),
    "aliases missing": (lambda d: d.pop("aliases"), "fields missing or unknown"),
    "a window in a set of files": (lambda d: d["units"][1].update(start=0), "bad start"),
    "pieces in a set of files": (
        lambda d: d["units"][1]["tensors"][0].update(pieces=[[0, 4, None]]),
        "placed in a set that indexes nothing",
    ),
    "indexes without its version": (
        lambda d: d.update(indexes={"path": "/m.gguf", "size": 1, "mtime_ns": 1}),
        "bad indexes",
    ),
}


@pytest.mark.parametrize("name", list(NAMED_EDITS))
def test_named_manifest_edits(name, good, tmp_path):
    """Edits that used to load (and generate other text) or end in an internal error."""
    edit, says = NAMED_EDITS[name]
    source, doc = good
    work = shutil.copytree(source, tmp_path / "set")
    doc = json.loads(json.dumps(doc))
    edit(doc)
    (work / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ShardError) as caught:
        Manifest.load(work)
    assert says in str(caught.value) and str(caught.value).endswith(RESHARD), caught.value


def test_loading_checks_headers_cheaply(tiny_factory, tmp_path):
    """The header check reads a few KB per unit: an 80-layer manifest loads in well under 100 ms."""
    import time

    out = tmp_path / "deep"
    sharder.shard(tiny_factory("llama", num_hidden_layers=80), out=out, log=lambda m: None)
    Manifest.load(out)
    started = time.perf_counter()
    for _ in range(5):
        Manifest.load(out)
    seconds = (time.perf_counter() - started) / 5
    print(f"Manifest.load of {len(Manifest.load(out).units)} units: {seconds * 1000:.1f} ms")
    assert seconds < 0.1
