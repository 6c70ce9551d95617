"""The fast GGUF reader (shard/ggufreader.py) gives what gguf's own reader gives: every field's name, types, data
indices and parts, every tensor's type, offset and bytes; and transformers makes the same config and tokenizer from it,
the config from the fields without the vocabulary's arrays."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.compat


def _same_reader(path) -> None:
    import gguf

    from rocketllm_cli.shard.ggufreader import FastReader

    slow, fast = gguf.GGUFReader(path), FastReader(path)
    assert list(slow.fields) == list(fast.fields)
    for key, a in slow.fields.items():
        b = fast.fields[key]
        assert (a.offset, a.name, list(a.types), list(a.data)) == (b.offset, b.name, list(b.types), list(b.data)), key
        assert len(a.parts) == len(b.parts), key
        for x, y in zip(a.parts, b.parts):
            assert x.dtype == y.dtype and np.array_equal(x, y), key
        assert a.contents() == b.contents(), key
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes, t.data.shape, t.data.dtype) for t in slow.tensors] == [
        (t.name, t.tensor_type, t.data_offset, t.n_bytes, t.data.shape, t.data.dtype) for t in fast.tensors
    ]
    for x, y in zip(slow.tensors, fast.tensors):
        assert np.array_equal(x.data, y.data), x.name


def test_fields_and_tensors_are_ggufs_on_the_real_file(smollm2_gguf):
    _same_reader(smollm2_gguf)


@pytest.mark.parametrize("qtype", ["Q4_K", "MXFP4"])
def test_fields_and_tensors_are_ggufs_on_written_files(qtype, smollm2_gguf, tmp_path):
    from rocketllm_cli.synthetic.gguf import write_llama_gguf

    path = write_llama_gguf(
        tmp_path / "m.gguf",
        smollm2_gguf,
        hidden=256,
        layers=1,
        intermediate=256,
        heads=4,
        kv_heads=2,
        qtype=qtype,
        embed_type="Q8_0",
        output_type="Q6_K",
    )
    _same_reader(path)


def test_config_and_tokenizer_are_the_ones_transformers_makes_alone(smollm2_gguf, tmp_path):
    """The sharder's way (one fast reader; the config from the fields without the vocabulary) and transformers alone
    (gguf's reader, every field) make the same config and a tokenizer that encodes alike."""
    from transformers import AutoConfig, AutoTokenizer

    from rocketllm_cli.shard.ggufsource import shared_reader
    from rocketllm_cli.shard.tokenizers import gguf_tokenizer

    directory, name = smollm2_gguf.parent, smollm2_gguf.name
    plain_config = AutoConfig.from_pretrained(directory, gguf_file=name).to_dict()
    plain_tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    with shared_reader(smollm2_gguf) as reader:
        with reader().for_config():
            config = AutoConfig.from_pretrained(directory, gguf_file=name).to_dict()
        tokenizer = gguf_tokenizer(smollm2_gguf, reader)
    assert config == plain_config
    text = "The capital of France is Paris. <|im_start|>user\nÇa va? 12345<|im_end|>"
    # (the sharder then sets BOS/EOS as the file declares them, which transformers 4.x does not: compared apart)
    assert (
        tokenizer(text, add_special_tokens=False).input_ids == plain_tokenizer(text, add_special_tokens=False).input_ids
    )
    assert len(tokenizer) == len(plain_tokenizer) and tokenizer.all_special_tokens == plain_tokenizer.all_special_tokens


def test_the_config_view_counts_the_vocabulary_instead_of_listing_it(smollm2_gguf):
    """No tokenizer array reaches the config: where the file gives no vocab_size, its count stands in for the
    262,144 strings transformers would otherwise parse to count them (transformers maps llama.vocab_size)."""
    from rocketllm_cli.shard.ggufreader import FastReader, field_value

    reader = FastReader(smollm2_gguf)
    fields = reader.config_fields()
    assert "tokenizer.ggml.tokens" not in fields
    assert field_value(fields["llama.vocab_size"]) == len(reader.fields["tokenizer.ggml.tokens"].data) == 49152
    assert not any(k.startswith("tokenizer.") and fields[k].types[0] == 9 for k in fields)
    assert {k for k in reader.fields if not k.startswith("tokenizer.")} <= set(fields)
    with reader.for_config():
        assert reader.fields is not None and set(reader.fields) == set(fields)
    assert "tokenizer.ggml.merges" in reader.fields  # restored on the way out


def _tiny(tmp_path, smollm2_gguf, name: str, qtype: str) -> Path:
    from rocketllm_cli.synthetic.gguf import write_llama_gguf

    shape = dict(hidden=64, layers=1, intermediate=128, heads=2, kv_heads=1)
    return write_llama_gguf(tmp_path / name, smollm2_gguf, qtype=qtype, **shape)


def test_the_tokenizer_digest_is_the_tokenizer_entries_alone(smollm2_gguf, tmp_path):
    """Two quantizations of one model share a digest; the shared model (another config, other tensors) shares it
    too, having the same tokenizer entries; a changed entry (the BOS flag), another architecture (transformers picks
    the tokenizer's class by it) or another salt does not; a file that is no GGUF has none."""
    from rocketllm_cli.checkpoint.ggufheader import tokenizer_digest

    q4, q8 = _tiny(tmp_path, smollm2_gguf, "a.gguf", "Q4_0"), _tiny(tmp_path, smollm2_gguf, "b.gguf", "Q8_0")
    digest = tokenizer_digest(q4, "salt")
    assert digest is not None and digest == tokenizer_digest(q8, "salt") == tokenizer_digest(smollm2_gguf, "salt")
    assert tokenizer_digest(q4, "other salt") != digest
    data = bytearray(q4.read_bytes())
    key = b"tokenizer.ggml.add_bos_token"
    at = data.index(key) + len(key) + 4  # the bool after its value type
    data[at] ^= 1
    flipped = tmp_path / "flipped.gguf"
    flipped.write_bytes(bytes(data))
    assert tokenizer_digest(flipped, "salt") not in (None, digest)
    data = bytearray(q4.read_bytes())
    at = data.index(b"general.architecture") + len(b"general.architecture") + 4 + 8  # the string after its length
    assert data[at : at + 5] == b"llama"
    data[at : at + 5] = b"llamb"  # another architecture, the same tokenizer entries
    other = tmp_path / "other-architecture.gguf"
    other.write_bytes(bytes(data))
    assert tokenizer_digest(other, "salt") not in (None, digest)
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + bytes(64))
    assert tokenizer_digest(tmp_path / "not.gguf") is None


def test_a_converted_tokenizer_is_kept_and_serves_the_next_file_of_the_model(smollm2_gguf, tmp_path, monkeypatch):
    """set_tokenizer converts once per tokenizer (another quantization copies the cache's files), and what a set
    gets from the cache encodes as the conversion does."""
    from transformers import AutoTokenizer

    from rocketllm_cli.shard import tokenizers

    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path / "cache"))
    converted, real = [], tokenizers.gguf_tokenizer
    monkeypatch.setattr(tokenizers, "gguf_tokenizer", lambda path, reader=None: converted.append(path) or real(path))
    q4, q8 = _tiny(tmp_path, smollm2_gguf, "a.gguf", "Q4_0"), _tiny(tmp_path, smollm2_gguf, "b.gguf", "Q8_0")
    first = tokenizers.set_tokenizer(q4)
    second = tokenizers.set_tokenizer(q8)
    assert converted == [q4], "the second file of the model converted its tokenizer again"
    assert isinstance(first, tokenizers.SavedTokenizer) and second.folder == first.folder
    assert first.folder.parent == tmp_path / "cache" / "tokenizers"
    assert not [p for p in first.folder.parent.iterdir() if p.name.startswith(".")]  # no scratch folder left
    for made in ("set-a", "set-b"):
        assert tokenizers.save_gguf_tokenizer(q8, tmp_path / made)
    direct = real(q8)
    direct.save_pretrained(tmp_path / "direct")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "set-b")
    text = "The capital of France is Paris. <|im_start|>user\nÇa va? 12345<|im_end|>"
    assert loaded(text).input_ids == direct(text).input_ids
    assert getattr(loaded, "add_bos_token", None) == getattr(direct, "add_bos_token", None)
    assert (tmp_path / "set-a" / "tokenizer.json").read_bytes() == (tmp_path / "set-b" / "tokenizer.json").read_bytes()
