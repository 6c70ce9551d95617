"""A random-weight Llama GGUF of any size and low-bit type, written with the `gguf` package's own writer.

    write_llama_gguf(path, like=real.gguf, hidden=3072, layers=26, intermediate=8192, heads=24, kv_heads=8,
    qtype="Q4_0")

The output head is tied to the embedding unless `output_type` names a type for a head of its own (`output.weight`).

The vocabulary and every other metadata key come from the GGUF `like` (so transformers, llama.cpp and RocketLLM
read its tokenizer); the sizes, the tensors and their types are this module's. Blocks are random but well formed
(finite fp16 scales sized for weights of about WEIGHT_STD), written one tensor at a time, so a file of several GB
needs one tensor's bytes in memory. Used by tests (tiny, every packed type) and by bench's larger-than-RAM runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

WEIGHT_STD = 0.02
# what this writer makes blocks for (IQ2_XXS, TQ2_0 and MXFP4 stand for the grid types, which no kernel here reads)
TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0", "Q6_K", "IQ2_XXS", "TQ2_0", "MXFP4", "F16")
SKIPPED_KEYS = ("GGUF.", "general.architecture", "llama.")  # the writer's own, and the sizes written here


def write_llama_gguf(
    path: Path,
    like: Path,
    *,
    hidden: int,
    layers: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    qtype: str = "Q4_0",
    embed_type: str = "Q8_0",
    output_type: str | None = None,
    seed: int = 0,
    context: int = 2048,
) -> Path:
    """Write the GGUF at `path` (atomically: a partial file never has the name) and return it."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    for name in (qtype, embed_type, *([output_type] if output_type else [])):
        if name not in TYPES:
            raise ValueError(f"{name}: this writer makes {', '.join(TYPES)}")
    source = GGUFReader(like)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(tmp, "llama")
    for key, field in source.fields.items():
        if key.startswith(SKIPPED_KEYS):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    head_dim = hidden // heads
    tensors = [("token_embd.weight", (vocab, hidden), embed_type)]
    for i in range(layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (hidden,), "F32"),
            (f"blk.{i}.attn_q.weight", (hidden, hidden), qtype),
            (f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), qtype),
            (f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden), qtype),
            (f"blk.{i}.attn_output.weight", (hidden, hidden), qtype),
            (f"blk.{i}.ffn_norm.weight", (hidden,), "F32"),
            (f"blk.{i}.ffn_gate.weight", (intermediate, hidden), qtype),
            (f"blk.{i}.ffn_up.weight", (intermediate, hidden), qtype),
            (f"blk.{i}.ffn_down.weight", (hidden, intermediate), qtype),
        ]
    tensors.append(("output_norm.weight", (hidden,), "F32"))
    if output_type:  # a head of its own: transformers unties it when the file has output.weight
        tensors.append(("output.weight", (vocab, hidden), output_type))
    rng = np.random.default_rng(seed)
    for name, shape, kind in tensors:
        nbytes, byte_shape, dtype = _sizes(shape, kind)
        raw = None if kind == "F32" else GGMLQuantizationType[kind]
        writer.add_tensor_info(name, byte_shape, dtype, nbytes, raw_dtype=raw)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, shape, kind in tensors:
            writer.write_tensor_data(_blocks(rng, shape, kind))
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _sizes(shape: tuple[int, ...], kind: str):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if kind == "F32":
        return 4 * int(np.prod(shape)), shape, np.dtype(np.float32)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rows, cols = shape
    if cols % block:
        raise ValueError(f"{kind} needs rows of a multiple of {block} values, got {cols}")
    byte_shape = (rows, cols // block * size)
    return rows * byte_shape[1], byte_shape, np.dtype(np.uint8)


def _fp16(rng, count: int, value: float, spread: float = 0.25) -> np.ndarray:
    return (value * (1 + spread * rng.standard_normal(count))).astype(np.float16).view(np.uint8).reshape(count, 2)


def _blocks(rng, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Random, well-formed blocks of `kind` for a tensor of `shape` (F32: near-one norm weights)."""
    if kind == "F32":
        return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    _, byte_shape, _ = _sizes(shape, kind)
    rows, width = byte_shape
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    n = rows * width // size
    out = rng.integers(0, 256, size=(n, size), dtype=np.uint8)  # codes: every byte random
    if kind == "Q4_0":  # d, 16 bytes: w = (q − 8)·d, uniform q has std 4.6
        out[:, 0:2] = _fp16(rng, n, WEIGHT_STD / 4.6)
    elif kind == "Q4_1":  # d, m: w = q·d + m
        d = WEIGHT_STD / 4.6
        out[:, 0:2] = _fp16(rng, n, d)
        out[:, 2:4] = _fp16(rng, n, -8 * d)
    elif kind == "Q8_0":  # d, 32 int8: std of uniform int8 is 74
        out[:, 0:2] = _fp16(rng, n, WEIGHT_STD / 74)
    elif kind == "Q5_0":  # d, 4 bytes of high bits, 16 bytes of low nibbles: w = (q − 16)·d, std of uniform q 9.2
        out[:, 0:2] = _fp16(rng, n, WEIGHT_STD / 9.2)
    elif kind == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales and mins (mean 32), 128 bytes of codes
        out[:, 0:2] = _fp16(rng, n, WEIGHT_STD / 4.6 / 32)
        out[:, 2:4] = _fp16(rng, n, 7.5 * WEIGHT_STD / 4.6 / 32)
    elif kind == "Q6_K":  # 128 + 64 bytes of codes, 16 int8 scales, d last: w = d·scale·(q − 32), std of q 18.5
        out[:, 192:208] = rng.integers(16, 48, size=(n, 16), dtype=np.uint8)
        out[:, 208:210] = _fp16(rng, n, WEIGHT_STD / 18.5 / 32)
    elif kind == "IQ2_XXS":  # d, 32 uint16: grid values 8..43 times d·(0.5 + a 4-bit scale)/4, about 100·d
        out[:, 0:2] = _fp16(rng, n, WEIGHT_STD / 100)
    elif kind == "TQ2_0":  # 64 bytes of 2-bit codes (−1, 0, +1, +2), d last
        out[:, 64:66] = _fp16(rng, n, WEIGHT_STD)
    elif kind == "MXFP4":  # an E8M0 exponent e (scale 2^(e−128)), 16 bytes of doubled e2m1 codes (std ~5.5)
        out[:, 0] = 128 + int(np.round(np.log2(WEIGHT_STD / 5.5)))
    elif kind == "F16":
        out = (WEIGHT_STD * rng.standard_normal(shape)).astype(np.float16).view(np.uint8)
    return out.reshape(rows, width)
