"""The knob table: every tuning value's name, type and help, declared once.

Defaults are never declared here: every knob is derived from the measured
HardwareProfile (see knobs.py) unless a flag, a ROCKETLLM_<NAME> variable or
a Python keyword overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...dtypes import NAMES as DTYPES
from ...dtypes import short_name
from ...errors import KnobError
from ...sizes import ACCEPTED as BYTES_ACCEPTED
from ...sizes import parse_bytes

EXPERT_CACHE_POLICIES = ("lfu", "lru")  # most often routed, most recently routed
# auto: on where a pass streams layers (running.py speculate)
SPECULATION_MODES = ("auto", "off", "prompt-lookup", "draft")
KV_CACHE_DTYPES = ("auto", *DTYPES, "int4")  # auto: the dtype the model computes in
NATIVE_KERNELS = ("exact", "int16", "int8")  # the native kernels' modes: fp32, 16-bit or 8-bit activations
# the modes whose decode attends on the native kernels too (decode_attention's formula, running.py)
NATIVE_ATTENTION_KERNELS = ("int16", "int8")
KERNEL_PATHS = (*NATIVE_KERNELS, "torch")  # how packed Linears compute; torch: its int4 kernel in its fastest dtype


def native_mode(kernel: str) -> str:
    """The native kernels' mode for the `kernel` knob's value: its own where it names one, else exact (torch's path
    leaves the GGUF types it does not cover to the exact kernels)."""
    return kernel if kernel in NATIVE_KERNELS else "exact"


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class KnobSpec:
    name: str
    kind: str  # "bytes" | "int" | "choice" | "bool" | "path"
    help: str
    choices: tuple[str, ...] = ()
    minimum: int = 0
    flags: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "ROCKETLLM_" + self.name.upper()

    def accepted(self) -> str:
        if self.kind == "bytes":
            return BYTES_ACCEPTED
        if self.kind == "int":
            return f"an integer >= {self.minimum}"
        if self.kind == "bool":
            return "on/off (true/false, 1/0)"
        if self.kind == "path":
            return "a model directory, .gguf file, hub id or shard directory"
        if self.kind == "stages":
            return "auto, or one layer count per rank in rank order (20,10)"
        return "one of " + ", ".join(self.choices)

    def parse(self, raw: object, origin: str = "") -> object:
        """Parse a raw override; a bad value is a KnobError naming the knob and the accepted forms."""
        where = f" (from {origin})" if origin else ""
        try:
            if self.kind == "bytes":
                return parse_bytes(raw)  # type: ignore[arg-type]
            if self.kind == "int":
                value = int(str(raw).strip())
                if value < self.minimum:
                    raise ValueError
                return value
            if self.kind == "path":
                text = str(raw).strip()
                if not text:
                    raise ValueError
                return text
            if self.kind == "stages":
                text = str(raw).replace(" ", "").lower()
                if text != "auto" and not all(part.isdigit() and int(part) > 0 for part in text.split(",")):
                    raise ValueError
                return text
            if self.kind == "bool":
                if isinstance(raw, bool):
                    return raw
                text = str(raw).strip().lower()
                if text in _TRUE | _FALSE:
                    return text in _TRUE
                raise ValueError
            text = str(raw).strip().lower()
            text = short_name(text) or text
            if text not in self.choices:
                raise ValueError
            return text
        except (ValueError, TypeError):
            raise KnobError(f"bad value {raw!r} for {self.name}{where}: expected {self.accepted()}") from None


KNOB_SPECS: tuple[KnobSpec, ...] = (
    KnobSpec(
        "reserve_bytes",
        "bytes",
        "Memory left untouched for the OS, other programs, the page cache of reads and the allocator's slack.",
    ),
    KnobSpec(
        "runtime_bytes",
        "bytes",
        "Memory the Python runtime (torch, transformers, the engine) will still take beside the model: measured once "
        "per machine, less what this process holds already.",
    ),
    KnobSpec("device_cache_bytes", "bytes", "Weights kept resident on the compute device (0 streams every layer)."),
    KnobSpec(
        "host_cache_bytes",
        "bytes",
        "Weights kept in host RAM / page cache between tokens (0 reads every streamed layer from storage).",
    ),
    KnobSpec("io_workers", "int", "Threads reading shards from storage.", minimum=1),
    KnobSpec(
        "prefetch_depth", "int", "Streamed units read ahead of the one computing (0 disables prefetch).", minimum=0
    ),
    KnobSpec("compute_dtype", "choice", "Dtype the forward pass runs in.", choices=DTYPES, flags=("--dtype",)),
    KnobSpec(
        "kernel",
        "choice",
        "How packed (low-bit) Linears compute: exact, in the compute dtype (a GGUF type's own blocks on the native "
        "kernels in fp32); int16, those kernels with activations quantized to 16 bits per 32 (integer dot products, "
        "~2e-5 relative error per product); int8, with activations quantized to 8 bits per block as llama.cpp does "
        "(faster still, ~5e-3); or torch, torch's int4 kernel in the activation dtype it runs "
        "fastest in (bf16 on x86: on an fp32 forward each product is rounded to bf16).",
        choices=KERNEL_PATHS,
    ),
    KnobSpec(
        "decode_attention",
        "choice",
        "How a decode step on the native kernels attends (one position of one sequence, fp32, no mask): native, "
        "their own fp32 attention on their threads, the cache split between the cores; torch, transformers' SDPA "
        "on torch's one thread. Every other attention call is SDPA either way.",
        choices=("native", "torch"),
    ),
    KnobSpec(
        "kv_cache_dtype",
        "choice",
        "What the KV cache stores keys and values in: auto (the compute dtype), a float dtype, or int4 (K per channel, "
        "V per token, 4 bits, with the most recent tokens kept in the compute dtype).",
        choices=KV_CACHE_DTYPES,
    ),
    KnobSpec(
        "kv_residual_tokens",
        "int",
        "int4 KV cache: the most recent tokens kept in full precision before they are quantized.",
        minimum=0,
    ),
    KnobSpec(
        "kv_cache_bytes",
        "bytes",
        "Memory for the context: its KV cache and the activations of a pass over it (a prefill); bounds the context "
        "length.",
    ),
    KnobSpec("max_context", "int", "Longest prompt + generation in tokens.", minimum=1),
    KnobSpec(
        "direct_io", "bool", "Read streamed shards with O_DIRECT instead of buffered reads + page-cache eviction."
    ),
    KnobSpec("pin_memory", "bool", "Page-locked host buffers for faster host-to-device copies."),
    KnobSpec(
        "decode_graphs",
        "choice",
        "CUDA GPU, every unit resident: run each decode step as CUDA graphs (a static KV cache and transformers' "
        "compiled step; the first request pays the compile). auto decides from the residency and the run.",
        choices=("auto", "on", "off"),
    ),
    KnobSpec(
        "prefix_cache", "choice", "Reuse the KV cache of a repeated prompt prefix.", choices=("auto", "on", "off")
    ),
    KnobSpec(
        "draft_model",
        "path",
        "A small model with the same tokenizer that drafts tokens for speculative decoding, kept resident.",
    ),
    KnobSpec(
        "speculate",
        "choice",
        "Speculative decoding: each pass verifies drafted tokens, from the prompt and text so far (prompt-lookup) or "
        "from --draft-model (draft); auto turns it on where layers stream.",
        choices=SPECULATION_MODES,
    ),
    KnobSpec("draft_tokens", "int", "Tokens drafted for each pass to verify when speculating.", minimum=1),
    KnobSpec(
        "default_max_tokens",
        "int",
        "serve: the reply length of a request that sets no max_tokens (derived from the projected speed: what fits in "
        "a minute).",
        minimum=1,
    ),
    KnobSpec(
        "stages",
        "stages",
        "Under torchrun: the layers each rank runs, in rank order; auto splits them by every rank's measured budgets, "
        "bandwidths and links (docs/DISTRIBUTED.md).",
    ),
    KnobSpec(
        "stage_timeout_s",
        "int",
        "Under torchrun: seconds without a heartbeat before a rank counts as failed (and the rendezvous wait at "
        "start).",
        minimum=1,
    ),
    KnobSpec(
        "expert_cache_policy",
        "choice",
        "Which experts a mixture-of-experts model keeps in its expert cache: the most often routed (lfu) or the most "
        "recently routed (lru).",
        choices=EXPERT_CACHE_POLICIES,
    ),
)
KNOBS_BY_NAME = {spec.name: spec for spec in KNOB_SPECS}
