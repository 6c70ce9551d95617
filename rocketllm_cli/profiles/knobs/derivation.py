"""What every knob derivation is made of: Derivation (a readable expression and its inputs, whose value is
the expression evaluated on them, so a printed knob can always be recomputed from what was printed), Context (what
derivations read: the profile, the model and the values resolved so far), and the values used where the profile
lacks what derives a knob.

On a CPU the compute device's memory is host RAM: the 'device' tier is weights resident in process RAM and the 'host'
tier is the page cache holding shard files (mapped zero-copy), so both budgets come out of the same free RAM, device
first."""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil

from ...checkpoint.modelfacts import ModelFacts
from ...dtypes import ITEMSIZE, int4_kv_value_bytes
from ..hardware import HardwareProfile
from .shape import ACTIVATION_VALUE_BYTES, PassShape

GiB, MiB = 1024**3, 1024**2


# A knob's value where the profile lacks what derives it; EngineConfig's defaults are the same values.
FALLBACK_COMPUTE_DTYPE = "fp32"  # runs on every device


FALLBACK_PREFETCH_DEPTH = 2  # double buffering


FALLBACK_DIRECT_IO = False  # buffered reads work on every filesystem


DEFAULT_EXPERT_CACHE_POLICY = "lfu"  # why: see expert_cache_policy() below


DEFAULT_DRAFT_TOKENS = 10  # transformers' prompt-lookup default; a streaming pass costs its bytes, not its tokens


CGROUP_RESERVE_FRACTION = 0.10  # the reserve inside a memory cgroup: a tenth of its limit (reserve_bytes)


MIN_CONTEXT = 2048  # a server's KV cache holds at least this many tokens where memory allows (kv_cache_bytes)


CONTEXT_SHARE = 0.5  # ... and at most this share of what the runtime and the least streaming buffers leave


FLOOR_CONTEXT = 256  # the least context the floor counts for a server (a one-shot run: its own tokens)


@dataclass
class Derivation:
    formula: str
    inputs: dict = field(default_factory=dict)
    source: str = "derived"  # derived | measured | default
    note: str = ""

    @classmethod
    def default(cls, formula: str, note: str = "") -> Derivation:
        """A value the project chose, not derived from this machine: FORMULA is the value itself, NOTE says why."""
        return cls(formula, {}, "default", note)


class Context:
    """What derivations read: the profile, the model (or None) and the knob values resolved so far."""

    def __init__(
        self,
        profile: HardwareProfile,
        model: ModelFacts | None,
        values: dict,
        overridden: set[str],
        run_tokens: int | None = None,
        shape: PassShape | None = None,
    ) -> None:
        self.profile, self.model, self.values, self.overridden = profile, model, values, overridden
        self.run_tokens = run_tokens  # the tokens of KV a one-shot run holds at most (every row); None: any request
        self.shape = shape  # the widths a pass fills per token (its activations); None: not known, not counted
        self.cpu = profile.compute_device == "cpu"
        # CPU and Apple MPS: the device tier and the host tier are carved out of the same RAM.
        self.unified = profile.compute_device in ("cpu", "mps")
        # The compute device's free memory: VRAM on a GPU; RAM on the CPU (and on unified-memory devices).
        self.device_free = profile.vram_free if profile.vram_free is not None else profile.ram_available

    def compute_dtype(self) -> str:
        """The dtype the engine will compute in (auto.py engine_config applies the same rule)."""
        return engine_compute_dtype(
            str(self.values["compute_dtype"]),
            "compute_dtype" in self.overridden,
            self.model.dtype if self.model else "",
            self.profile.compute_device,
            bool(self.model and self.model.gguf_blocks),
        )

    def kv_dtype(self) -> str:
        chosen = str(self.values["kv_cache_dtype"])
        return self.compute_dtype() if chosen == "auto" else chosen

    def kv_values(self) -> dict:
        """K and V values per token of the layers whose cache grows, how many layers, and the bytes each value takes."""
        m = self.model
        compute = ITEMSIZE.get(self.compute_dtype(), 2)
        values = m.kv_values_per_token or m.kv_bytes_per_token // ITEMSIZE.get(m.dtype, 2)
        kv = self.kv_dtype()
        stored = int4_kv_value_bytes(m.kv_head_dim) if kv == "int4" else ITEMSIZE.get(kv, compute)
        return {
            "kv_values_per_token": values,
            "kv_layers": m.kv_growing_layers or m.num_layers,
            "kv_value_bytes": stored,
            "compute_value_bytes": compute,
            **self.activations(),
        }

    def activations(self) -> dict:
        """A pass's activations per token of it, where the model's shape is known (every context token may be one
        pass's: a prefill); {} where it is not."""
        if self.shape is None:
            return {}
        return {
            "activation_values_per_token": self.shape.activation_values_per_token,
            "activation_value_bytes": ACTIVATION_VALUE_BYTES,
        }

    def runtime(self) -> dict:
        """runtime_bytes as an input of a budget of the compute device's memory: RAM's (a CPU, unified memory), not
        a GPU's, whose budgets the runtime takes nothing from."""
        return {"runtime_bytes": self.values["runtime_bytes"]} if self.unified or self.profile.vram_free is None else {}

    def kv_per_token(self) -> dict:
        # K and V per token as the KV cache stores them (the compute dtype, another float dtype, or int4 with its
        # scales).
        v = self.kv_values()
        return {"kv_bytes_per_token": ceil(v["kv_values_per_token"] * v["kv_value_bytes"])}


def engine_compute_dtype(chosen: str, overridden: bool, stored: str, device: str, gguf_blocks: bool = False) -> str:
    """Run in the dtype the shards hold where the device runs it well: converting costs a copy per use.
    fp32 runs everywhere; fp16 is slow on a CPU; bf16 only where the profile chose it. A GGUF's blocks on a CPU: fp32,
    what the native kernels (and the exact decoder) compute in: bf16 activations would only add two roundings per
    product and a conversion at each one (SmolLM2 Q4_1: mean KL against transformers fp32 1.1e-3 in bf16, 1.5e-5 in
    fp32, and 12% fewer ms/token), while the weights' bytes, which bound the speed, are the blocks either way."""
    if overridden:
        return chosen
    if gguf_blocks and device == "cpu":
        return "fp32"
    if stored == "fp32" or (stored == "fp16" and device != "cpu"):
        return stored
    return chosen
