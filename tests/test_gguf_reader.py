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
