"""The floating-point dtypes weights are stored and computed in, declared once.

Short names (bf16, fp16, fp32) are what knobs, flags and manifests say; everything else
(torch dtypes, safetensors names, bytes per element, the spellings configs use) is looked
up here. torch is imported only when a torch dtype is asked for, so the CLI starts fast.
"""

from __future__ import annotations

NAMES = ("bf16", "fp16", "fp32")
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
SAFETENSORS = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}  # the stored name of a shard set's floating tensors
_TORCH = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# int4 KV cache (stream/kvcache.py): 4-bit codes, a scale and a minimum in fp16 per group of KV_INT4_GROUP values:
# keys per channel over that many tokens, values per token over that many channels (a whole head when it is shorter).
KV_INT4_GROUP = 64
KV_INT4_SCALE_BYTES = 2


def int4_kv_value_bytes(head_dim: int) -> float:
    """Bytes an int4 KV cache spends per key or value element, scales included (K and V averaged)."""
    scales = 2 * KV_INT4_SCALE_BYTES  # scale and minimum of one group
    value_group = min(KV_INT4_GROUP, head_dim) if head_dim > 0 else KV_INT4_GROUP
    return 0.5 + (scales / KV_INT4_GROUP + scales / value_group) / 2


# Every other spelling seen in configs, GGUF/safetensors headers and flags.
_SPELLINGS = {
    **{n: n for n in NAMES},
    **{v: k for k, v in _TORCH.items()},
    **{v: k for k, v in SAFETENSORS.items()},
    "half": "fp16",
    "float": "fp32",
    "bfloat": "bf16",
}


def short_name(spelling: object) -> str | None:
    """'bfloat16', 'torch.bfloat16', 'BF16', torch.bfloat16 ... -> 'bf16'; None for anything else."""
    text = str(spelling).strip().removeprefix("torch.")
    return _SPELLINGS.get(text) or _SPELLINGS.get(text.lower())


def torch_dtype(name: str):
    """The torch dtype of a short name (KeyError for an unknown one)."""
    import torch

    return getattr(torch, _TORCH[name])
