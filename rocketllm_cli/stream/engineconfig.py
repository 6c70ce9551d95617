"""EngineConfig: everything the streaming model needs, checked against the knob table; AutoModel fills it from
the resolved knobs, and built by hand it is what each knob is on an unmeasured machine."""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import KV_INT4_GROUP
from ..errors import KnobError
from ..profiles.knobs.derivation import (
    DEFAULT_EXPERT_CACHE_POLICY,
    FALLBACK_COMPUTE_DTYPE,
    FALLBACK_DIRECT_IO,
    FALLBACK_PREFETCH_DEPTH,
)
from ..profiles.knobs.table import KNOBS_BY_NAME


@dataclass
class EngineConfig:
    """Everything the streaming model needs; AutoModel fills it from the resolved knobs.

    Built by hand, it defaults to nothing cached, one reader thread, and what each knob is on an unmeasured machine."""

    device: str = "cpu"
    compute_dtype: str = FALLBACK_COMPUTE_DTYPE
    device_cache_bytes: int = 0
    host_cache_bytes: int = 0
    prefetch_depth: int = FALLBACK_PREFETCH_DEPTH
    io_workers: int = 1
    direct_io: bool = FALLBACK_DIRECT_IO
    pin_memory: bool = False
    expert_cache_policy: str = DEFAULT_EXPERT_CACHE_POLICY
    packed_dtype: str = ""  # activations of packed Linears: "" the compute dtype, "fastest" the kernel's measured best
    # what the KV cache stores: auto (the compute dtype), a float dtype or int4 (stream/kvcache.py)
    kv_cache_dtype: str = "auto"
    kv_residual_tokens: int = KV_INT4_GROUP  # int4: the most recent tokens kept in the compute dtype
    decode_graphs: str = "off"  # "on": a resident decode on a CUDA GPU runs as CUDA graphs where it can (graphs.py)
    native_mode: str = "exact"  # GGUF blocks on the native kernels: fp32 activations, or "int8" (packed/compute.py)
    decode_attention: str = "torch"  # "native": a decode on the native kernels attends on them (decodeattention.py)

    def __post_init__(self) -> None:
        # Ranges and choices are the knob table's.
        for name in ("compute_dtype", "expert_cache_policy", "kv_cache_dtype", "decode_graphs", "decode_attention"):
            spec = KNOBS_BY_NAME[name]
            if getattr(self, name) not in spec.choices:
                raise KnobError(f"bad {name} {getattr(self, name)!r}: expected {spec.accepted()}")
        for name in ("device_cache_bytes", "host_cache_bytes", "prefetch_depth", "io_workers", "kv_residual_tokens"):
            minimum = KNOBS_BY_NAME[name].minimum
            if getattr(self, name) < minimum:
                raise KnobError(f"bad {name} {getattr(self, name)}: must be >= {minimum}")

    def kv_dtype(self) -> str:
        """The dtype the KV cache stores: the compute dtype for auto."""
        return self.compute_dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
