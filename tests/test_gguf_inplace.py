"""A GGUF set indexes the file in place: no weight byte copied, the same numbers as a copied set in every tier, and
a file that moves or changes makes the set again rather than serve other bytes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from rocketllm_cli.checkpoint.manifest import MANIFEST, SIDE_FILE, UNIT_FILE, Manifest
from rocketllm_cli.errors import ShardError
from rocketllm_cli.shard.checks import verify
from rocketllm_cli.shard.sharder import shard
from rocketllm_cli.stream.engineconfig import EngineConfig
from rocketllm_cli.stream.model import StreamingModel

pytestmark = pytest.mark.compat  # transformers' GGUF processors decide what is a piece, a row order or a side tensor

IDS = torch.tensor([[1, 400, 5000, 77, 9000, 12, 300, 41]])
TIERS = {  # the whole set resident, mapped from the page cache, read from storage on each use
    "device": dict(device_cache_bytes=1 << 40),
    "host": dict(host_cache_bytes=1 << 40),
    "storage": dict(),
}


@pytest.fixture(scope="module")
def tiny(smollm2_gguf, tmp_path_factory):
    """A tiny Llama GGUF of K-quant layers and a Q8_0 embedding (the real model's vocabulary), and its two sets:
    indexed in place (the default) and copied (--copy)."""
    from rocketllm_cli.synthetic.gguf import write_llama_gguf

    root = tmp_path_factory.mktemp("inplace")
    path = write_llama_gguf(
        root / "m.gguf", smollm2_gguf, hidden=256, layers=3, intermediate=512, heads=4, kv_heads=2, qtype="Q4_K"
    )
    logs: list[str] = []
    indexed = shard(path, out=root / "indexed", log=logs.append)
    copied = shard(path, out=root / "copied", log=lambda m: None, copy=True)
    return path, indexed, copied, logs


def _run(directory, tier: str):
    with StreamingModel(directory, EngineConfig(compute_dtype="fp32", **TIERS[tier])) as model, torch.inference_mode():
        logits = model(IDS).logits
        served = model.ledger.summary()["prefill"]["served"]
        plan = "".join(model.plan.tier[u.name][0] for u in model.manifest.layers)
    return logits, served, plan


def test_the_set_is_the_files_bytes_and_no_copy(tiny):
    path, (manifest, directory, summary), (copied, copy_dir, _), logs = tiny
    assert manifest.indexed and not copied.indexed
    assert manifest.indexes == {
        "path": str(path.resolve()),
        "size": path.stat().st_size,
        "mtime_ns": path.stat().st_mtime_ns,
    }
    assert not [p for p in os.listdir(directory) if UNIT_FILE.match(p)]  # no unit file: no weight byte copied
    assert len([p for p in os.listdir(copy_dir) if UNIT_FILE.match(p)]) == len(copied.units)
    assert manifest.total_bytes == copied.total_bytes
    assert all(u.indexed and u.start % 4096 == 0 and u.file == str(path.resolve()) for u in manifest.units)
    # each unit's window is its tensors' bytes and at most a page either side
    for u in manifest.units:
        assert u.bytes <= u.tensor_bytes + 2 * 4096, u.name
    # every packed tensor's bytes are the file's own blocks, read at the place the manifest gives
    from gguf import GGUFReader

    reader = GGUFReader(path)
    by_offset = {int(t.data_offset): t for t in reader.tensors}
    raw = path.read_bytes()
    for u in manifest.units:
        for t in u.tensors:
            pieces = t.pieces or [[t.offset, t.nbytes, None]]
            for offset, nbytes, _ in pieces:
                assert u.start + offset in by_offset, (u.name, t.name)
                assert int(by_offset[u.start + offset].n_bytes) == nbytes
    assert raw  # read whole above: the offsets are the file's
    assert any(m.startswith("indexed m: ") and "in place" in m for m in logs)


def test_llama_rows_are_reordered_and_members_fused_from_pieces(tiny):
    _, (manifest, _, _), (copied, _, _), _ = tiny
    layer = manifest.layers[0]
    fused = {t.name: t for t in layer.tensors if t.fused}
    qkv = next(t for n, t in fused.items() if "q_proj+k_proj+v_proj" in n)
    assert [p[2] is not None for p in qkv.pieces] == [True, True, False]  # Q and K rows in transformers' order
    assert all(p[2] in manifest.row_orders for p in qkv.pieces if p[2])
    # the copied set holds the same weights under the same names and formats
    assert {t.name: (t.packed, t.fused, t.nbytes) for t in layer.tensors} == {
        t.name: (t.packed, t.fused, t.nbytes) for t in copied.layers[0].tensors
    }


@pytest.mark.parametrize("tier", list(TIERS))
def test_every_tier_computes_what_the_copied_set_does(tiny, tier):
    """Bit for bit, and the same bytes served from the same tier per token."""
    _, (_, directory, _), (_, copy_dir, _), _ = tiny
    got, served, plan = _run(directory, tier)
    want, served_copy, plan_copy = _run(copy_dir, tier)
    assert torch.equal(got, want)
    assert served == served_copy and plan == plan_copy
    assert set(plan) == {tier[0]}


def test_indexed_set_matches_transformers_on_the_file(tiny):
    from transformers import AutoModelForCausalLM

    from rocketllm_cli.compat import dtype_kwargs

    path, (_, directory, _), _, _ = tiny
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **dtype_kwargs(torch.float32))
    got, _, _ = _run(directory, "storage")
    with torch.inference_mode():
        want = reference(IDS).logits
    assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_moved_or_changed_file_makes_the_set_again(tiny, tmp_path):
    path = tiny[0]
    mine = tmp_path / "copy-of-m.gguf"
    shutil.copy2(path, mine)
    manifest, directory, _ = shard(mine, out=tmp_path / "s", log=lambda m: None)
    assert manifest.indexes["path"] == str(mine.resolve())

    os.utime(mine, ns=(mine.stat().st_atime_ns, mine.stat().st_mtime_ns + 10**9))  # touched: it may have changed
    with pytest.raises(ShardError, match=r"indexes .*copy-of-m\.gguf in place, and it has changed since; re-run"):
        Manifest.load(directory)
    logs: list[str] = []
    again, _, summary = shard(mine, out=tmp_path / "s", log=logs.append)
    assert not summary["reused"] and again.indexes["mtime_ns"] == mine.stat().st_mtime_ns
    assert any("has changed since; sharding it again" in m for m in logs)

    moved = tmp_path / "moved.gguf"
    os.rename(mine, moved)
    with pytest.raises(ShardError, match=r"indexes copy-of-m\.gguf in place, and .* is gone; re-run"):
        Manifest.load(directory)
    again, _, _ = shard(moved, out=tmp_path / "s", log=lambda m: None)
    assert again.indexes["path"] == str(moved.resolve())
    assert torch.equal(_run(directory, "device")[0], _run(tiny[1][1], "device")[0])


def test_copy_makes_an_indexed_set_its_own_files_and_the_default_reuses_a_copy(tiny, tmp_path):
    path = tiny[0]
    shard(path, out=tmp_path / "s", log=lambda m: None)
    logs: list[str] = []
    copied, directory, _ = shard(path, out=tmp_path / "s", log=logs.append, copy=True)
    assert not copied.indexed and len([p for p in os.listdir(directory) if UNIT_FILE.match(p)]) == len(copied.units)
    assert any("writing the set's own files (--copy)" in m for m in logs)
    reused, _, summary = shard(path, out=tmp_path / "s", log=lambda m: None)  # a copied set still loads as it is
    assert summary["reused"] and not reused.indexed


def test_verify_hashes_the_indexed_file(tiny, tmp_path):
    path = tiny[0]
    mine = tmp_path / "m.gguf"
    shutil.copy2(path, mine)
    _, directory, _ = shard(mine, out=tmp_path / "s", log=lambda m: None)
    assert verify(directory) == []
    st = mine.stat()
    with open(mine, "r+b") as f:  # one byte of the last tensor changed, size and mtime kept
        f.seek(st.st_size - 100)
        byte = f.read(1)
        f.seek(st.st_size - 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(mine, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert verify(directory) == [f"{mine.resolve()}: checksum mismatch (contents changed)"]


def test_a_manifest_window_past_the_file_or_bad_pieces_is_refused(tiny, tmp_path):
    _, (_, directory, _), _, _ = tiny
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    doc = json.loads((broken / MANIFEST).read_text())
    doc["units"][1]["start"] = doc["indexes"]["size"]  # aligned or not, past the end
    doc["units"][1]["start"] -= doc["units"][1]["start"] % 4096
    (broken / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ShardError, match="lies past the end of m.gguf; re-run"):
        Manifest.load(broken)
    doc = json.loads((directory / MANIFEST).read_text())
    record = next(t for t in doc["units"][1]["tensors"] if t.get("pieces"))
    record["pieces"][0][1] += 1
    (broken / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ShardError, match="manifest is corrupt .*bad pieces"):
        Manifest.load(broken)
    for edit, says in (
        (lambda d: d["units"][1].update(start=d["units"][1]["start"] + 512), "bad start"),
        (lambda d: d["indexes"].update(path="m.gguf"), "bad indexes"),
        (lambda d: d["row_orders"].update({k: [0] * len(v) for k, v in d["row_orders"].items()}), "bad row_orders"),
        (lambda d: d["units"][1]["tensors"][0].update(side="yes"), "bad side"),
    ):
        doc = json.loads((directory / MANIFEST).read_text())
        edit(doc)
        (broken / MANIFEST).write_text(json.dumps(doc))
        with pytest.raises(ShardError, match=f"manifest is corrupt .*{says}"):
            Manifest.load(broken)


def test_an_untied_embedding_is_the_files_blocks_and_each_tier_matches_transformers(smollm2_gguf, tmp_path):
    """A file with its own output head (Llama 3, Qwen 2.5 7B, Mistral ...): its Q4_K token embedding stays the file's
    blocks (a lookup dequantizes the rows it reads), where it was once decoded into the set as bf16 (3.6x its bytes,
    and bf16-rounded under an fp32 forward); every tier computes what transformers does on the file, in fp32."""
    from transformers import AutoModelForCausalLM

    from gguf import GGUFReader

    from rocketllm_cli.checkpoint.modelfacts import facts_from_manifest, model_facts_from_path
    from rocketllm_cli.compat import dtype_kwargs
    from rocketllm_cli.synthetic.gguf import write_llama_gguf

    path = write_llama_gguf(
        tmp_path / "untied.gguf",
        smollm2_gguf,
        hidden=256,
        layers=2,
        intermediate=512,
        heads=4,
        kv_heads=2,
        qtype="Q4_K",
        embed_type="Q4_K",
        output_type="Q6_K",
    )
    manifest, directory, _ = shard(path, out=tmp_path / "set", log=lambda m: None)
    embed = next(t for u in manifest.units if u.kind == "embed" for t in u.tensors)
    assert embed.packed["kind"] == "gguf" and embed.packed["gguf_type"] == "Q4_K" and not manifest.aliases
    assert manifest.dtype == "fp32"  # the file's F32 norms decide: no table decoded into the set
    stored = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    assert manifest.total_bytes <= stored + 4096 * len(manifest.units)  # the file's own bytes, the side file's aside
    # a token looks one row of it up: the projection's products leave it out, from the header as from the set
    config = json.loads((directory / "config.json").read_text())
    for facts in (model_facts_from_path(path), facts_from_manifest(manifest, config)):
        assert facts.lookup_bytes == embed.nbytes
        assert f"{embed.packed['shape'][0]}x{embed.packed['shape'][1]}" not in facts.block_bytes.get("Q4_K", {})
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **dtype_kwargs(torch.float32))
    with torch.inference_mode():
        want = reference(IDS).logits
    for tier in TIERS:
        got, _, _ = _run(directory, tier)
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max())), tier
        assert torch.equal(got.argmax(-1), want.argmax(-1)), tier


def test_gemma_norms_go_to_the_side_file(gemma_gguf, tmp_path):
    """transformers reads Gemma's norms less one: those few tensors are the set's own, the rest the file's."""
    manifest, directory, _ = shard(gemma_gguf, out=tmp_path / "g", log=lambda m: None)
    side = [t for u in manifest.units for t in u.tensors if t.side]
    assert manifest.indexed and side and all("norm" in t.name for t in side)
    assert (directory / SIDE_FILE).stat().st_size < 1 << 20
    assert sum(t.nbytes for t in side) < manifest.total_bytes / 500


def test_cli_says_indexed_and_cache_ls_says_in_place(tiny, tmp_path):
    env = {**os.environ, "ROCKETLLM_CACHE": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-m", "rocketllm_cli", "shard", str(tiny[0])], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr
    assert "indexed in place in" in run.stdout
    ls = subprocess.run(
        [sys.executable, "-m", "rocketllm_cli", "cache", "ls", "--json"], capture_output=True, text=True, env=env
    )
    sets = json.loads(ls.stdout)["sets"]
    assert [s["indexes"] for s in sets] == [str(tiny[0].resolve())]
    assert sets[0]["bytes"] < tiny[0].stat().st_size  # the weights are the file's, not the cache's


def test_an_indexed_set_is_measured_where_its_file_is(tiny):
    """The profile's storage figures are those of the filesystem the weights stream from: the indexed file's."""
    from rocketllm_cli.profiles.probe.filesystems import weights_location

    path, (_, directory, _), (_, copy_dir, _), _ = tiny
    assert weights_location(directory) == path.resolve()
    assert weights_location(copy_dir) == copy_dir
    assert weights_location(path) == path


def test_a_first_contacts_hash_runs_once_beside_the_imports(tiny, tmp_path, monkeypatch):
    """The content hash a set is found by is begun on a thread as the command starts; the sharder waits for that one
    rather than hashing the file again, reads the header meanwhile, and the memo keeps the result."""
    import threading

    from rocketllm_cli.shard import identity

    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path / "cache"))
    mine = tmp_path / "fresh.gguf"
    shutil.copy2(tiny[0], mine)
    calls, release = [], threading.Event()
    real = identity.file_digest

    def slow_digest(path):
        calls.append(path)
        release.wait(30)  # held until the sharder is waiting for it
        return real(path)

    monkeypatch.setattr(identity, "file_digest", slow_digest)
    identity.hash_in_background(mine)
    identity.hash_in_background(mine)  # once per file state
    assert identity.hashing(mine) and len(calls) <= 1
    threading.Timer(0.5, release.set).start()
    manifest, _, summary = shard(mine, log=lambda m: None)
    assert len(calls) == 1 and not identity.hashing(mine)
    assert manifest.source["fingerprint"] == real(mine) == identity.known_fingerprint(mine)
    assert manifest.indexed and not summary["reused"]
    identity.hash_in_background(tmp_path / "absent.gguf")  # nothing to hash: nothing started, nothing raised
    identity.hash_in_background(tiny[1][1])  # not a GGUF
    assert not identity.hashing(mine)


def test_a_streamed_window_is_read_from_storage_each_time_even_from_a_warm_file(tiny):
    """Windows of one file: a buffered read must neither run ahead into the next window (read twice, or served from
    the page cache unseen) nor leave the large folios of an earlier whole-file read behind when it evicts. What the
    ledger says came from storage is what /proc/self/io saw, with the file first read whole by another process."""
    from rocketllm_cli.stream.model import StreamingModel

    path, (_, directory, _), _, _ = tiny
    subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)  # warm, in another process's folios
    config = EngineConfig(compute_dtype="fp32", prefetch_depth=0, direct_io=False)
    with StreamingModel(directory, config) as model, torch.inference_mode():
        ids = torch.tensor([[1, 400, 5000, 77]])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False)
        summary = model.ledger.summary()
    if summary["per_token_storage_witnessed"] is None:
        pytest.skip("/proc/self/io is not readable")
    served = summary["per_token_served"]["storage"]
    assert served > 0 and summary["per_token_storage_witnessed"] == pytest.approx(served, rel=0.02)


def test_a_unit_all_in_the_side_file_reads_and_evicts_nothing(tmp_path, monkeypatch):
    """Gemma's final norm is changed on its way in: its unit is a window of no bytes, which must not read, map or
    evict the whole file (a length of 0 means 'to the end' to fadvise and mmap)."""
    from rocketllm_cli.checkpoint.unitrecords import UnitRecord
    from rocketllm_cli.stream import windows

    file = tmp_path / "m.gguf"
    file.write_bytes(b"\0" * 8192)
    calls = []
    monkeypatch.setattr(windows.os, "posix_fadvise", lambda *a: calls.append(a))
    monkeypatch.setattr(windows.os, "open", lambda *a, **k: calls.append(a) or pytest.fail("opened the file"))
    unit = UnitRecord("norm", "norm", "model.norm", str(file), 0, "0" * 64, [], -1, start=0)
    windows.read_unit(tmp_path, unit, torch.empty(0, dtype=torch.uint8), evict=True, direct_io=False)
    assert calls == []


def test_a_looked_up_row_is_the_torch_decoders_bit_for_bit_on_the_native_path(monkeypatch):
    """An embedding lookup of a GGUF table dequantizes its rows in one native call where the kernels cover the type;
    the values are the torch decoder's, bit for bit, for every covered type (and the decoder's where not)."""
    from types import SimpleNamespace

    from rocketllm_cli.checkpoint.ggmlblocks import dequantize_blocks
    from rocketllm_cli.native import kernels
    from rocketllm_cli.native.kernels import GGML_IDS, NativeKernels
    from rocketllm_cli.native.sample import sample_blocks
    from rocketllm_cli.stream import rowgathers

    nk = kernels()  # loaded now, as a model on them has them
    calls = []
    real = NativeKernels.dequantize  # on the class: an ISA cap hands out a capped copy of the kernels per call
    monkeypatch.setattr(NativeKernels, "dequantize", lambda self, *a, **k: (calls.append(a[1]), real(self, *a, **k))[1])
    for name in GGML_IDS:
        blocks = sample_blocks(name, 5, 512, seed=3)
        fmt = SimpleNamespace(gguf_type=name, shape=(5, 512))  # what the lookup reads of a PackedFormat
        got = rowgathers._gguf_rows(blocks[[4, 1]], fmt)
        assert torch.equal(got, dequantize_blocks(blocks[[4, 1]], name)), name
    assert calls == (list(GGML_IDS) if nk is not None else [])
    assert rowgathers._unique_rows(torch.tensor([[7, 3, 7]])) == [3, 7]
    assert rowgathers._unique_rows(torch.arange(100).flip(0)) == list(range(100))


def test_a_resident_tables_few_rows_are_dequantized_in_place_a_native_call_each(tiny, monkeypatch):
    """A decode step looks up one row: a resident GGUF table's few rows go from its blocks straight into its sparse
    fp32 table, a native call a row (no index tensors, no copies), the same values as a prompt's many rows take."""
    from rocketllm_cli.checkpoint.ggmlblocks import dequantize_blocks
    from rocketllm_cli.native import kernels
    from rocketllm_cli.native.kernels import NativeKernels
    from rocketllm_cli.stream import rowgathers

    if kernels() is None:
        pytest.skip("no native kernels here")
    _, (manifest, directory, _), _, _ = tiny
    rows_asked = []
    real = NativeKernels.dequantize
    monkeypatch.setattr(
        NativeKernels, "dequantize", lambda self, b, *a, **k: (rows_asked.append(b.shape[0]), real(self, b, *a, **k))[1]
    )
    with StreamingModel(directory, EngineConfig(compute_dtype="fp32", **TIERS["device"])) as model:
        embed = model.model.get_input_embeddings()
        name = next(u.name for u in manifest.units if u.kind == "embed")
        key = next(t.name for u in manifest.units if u.kind == "embed" for t in u.tensors)
        with torch.inference_mode():
            few = embed(torch.tensor([[5000, 12, 5000]]))
            assert rows_asked == [1, 1]  # two distinct rows, a call each
            many = embed(torch.arange(rowgathers.FEW_ROWS + 1).reshape(1, -1) * 7 + 12)  # a prompt: the batched path
    blocks = model.store._parts_of_resident[(name, key)][1]["blocks"]
    assert torch.equal(few[0], dequantize_blocks(blocks[[5000, 12, 5000]], "Q8_0"))
    assert torch.equal(many[0, 0], few[0, 1])  # row 12 both ways
