"""A pre-quantized safetensors checkpoint read one weight at a time: compressed-tensors, GPTQ, AWQ and bitsandbytes.

config.json's `quantization_config` says which format; the weights say which modules are quantized (a
`weight_packed`, an int8 `weight` beside a `weight_scale`, a `qweight`). Each such module's tensors are presented
as the one float weight `<module>.weight` [N, K] the model has, so name mapping, units and shapes work as for a
float checkpoint: read() gives the format's own dequantization (u − uz)·s in fp32, read_packed() the portable int4
or int8 form the sharder stores under `--quantize auto` (packed/fromint.py, exact). What no packed format holds
exactly is stored dequantized and the shard output says so: act-order groups, int8 with zero points or several
groups a row, int4 with rows not a multiple of 16.

bitsandbytes: LLM.int8 is int8 per row exactly as the others (read() is bitsandbytes' own (q·SCB)·(1/127), the
packed scale SCB·(1/127) within one fp32 rounding of it). A 4-bit nf4/fp4 weight has a 16-value codebook no int4
format holds: read() is its exact dequantization, and read_packed() re-quantizes that round-to-nearest into int4
at group 32 (lossy), measuring the error as it goes; written_notes() says it once the set is written.

Which formats and settings are read, and the one-line refusal of the others, live in shard/quantconfig.py.
"""

from __future__ import annotations

from pathlib import Path

from .. import dtypes
from ..errors import ModelError
from .quantconfig import (
    ADVICE,
    QuantizedModule,
    Scheme,
    find_modules,
    quantizes_activations,
)


class QuantizedSafetensors:
    """{name: (shape, dtype)} with every quantized module shown as its float weight; read() one tensor at a time."""

    def __init__(self, modules: dict[str, QuantizedModule], shapes: dict, read_stored) -> None:
        self.modules = modules  # "<module>.weight" -> its stored tensors
        self.shapes = shapes
        self._read_stored = read_stored
        self._contiguous: dict[str, bool] = {}
        self.notes: list[str] = []  # said once by the sharder, whatever --quantize is
        self._requantized: dict[str, list[float]] = {}  # 4-bit type -> [weights, Σ error², Σ weight²] re-quantized

    def read(self, name: str):
        """A stored tensor, or a quantized module's weight dequantized (fp32)."""
        module = self.modules.get(name)
        if module is None:
            return self._read_stored(name)
        if module.scheme.method == "bitsandbytes":
            from ..packed import frombnb

            if module.scheme.bits == 8:
                return self._checked(
                    name,
                    lambda: frombnb.int8_dequantize(
                        *map(self._read_stored, (module.tensors["weight"], module.tensors["scale"]))
                    ),
                )
            return self._bnb4(name).dequantize()
        return self._int_weight(name).dequantize()

    # -- packed: what shard/packing.py asks of a source --------------------------------
    def holds_kept_types(self) -> bool:
        return any(_keeps(m.scheme) for m in self.modules.values())

    def packable(self, name: str, shape: tuple[int, int], int4_rows: int) -> bool:
        return self._verdict(name, shape, int4_rows)[0]

    def pack_note(self, name: str, shape: tuple[int, int], int4_rows: int) -> str | None:
        """What the shard output says about how `name` is stored, where that is not simply packed for a kernel."""
        return self._verdict(name, shape, int4_rows)[1]

    def _verdict(self, name: str, shape: tuple[int, int], int4_rows: int) -> tuple[bool, str | None]:
        from ..packed.fromint import kernel_group

        module = self.modules.get(name)
        if module is None:
            return False, None
        scheme, (n, k) = module.scheme, module.shape
        if tuple(shape) != module.shape:
            return False, "a shape other than the model's: stored dequantized"
        if scheme.method == "bitsandbytes" and scheme.bits == 4:
            from ..packed.frombnb import REPACK_GROUP

            if n % int4_rows or k % REPACK_GROUP:
                return False, (
                    f"bitsandbytes {scheme.layout} with rows not a multiple of {int4_rows} or columns not "
                    f"of {REPACK_GROUP} "
                    "(no int4 kernel takes them): stored dequantized, exactly"
                )
            return True, (
                f"bitsandbytes {scheme.layout} re-quantized to int4 group {REPACK_GROUP}, round-to-nearest "
                f"from its exact "
                "dequantization (lossy; --quantize none stores it exactly, as floats)"
            )
        if not _keeps(scheme):
            return False, (
                "int8 with zero points or several groups a row (the int8 kernel takes one scale per row): "
                "stored dequantized"
            )
        if not self._groups_contiguous(name):
            return False, (
                "act-order (g_idx): groups that are not runs of columns, which no packed format holds; "
                "stored dequantized in the set's dtype"
            )
        if scheme.bits == 8:
            return True, None
        group = kernel_group(scheme.group or k, k)[0]
        if n % int4_rows or group % 2:
            return False, (
                f"int4 with rows not a multiple of {int4_rows} or an odd group (no int4 kernel takes them): "
                f"stored dequantized"
            )
        if group not in _kernel_groups():
            return True, (
                f"int4 at group {group}, which the int4 kernel does not take "
                f"({', '.join(map(str, _kernel_groups()))}): "
                "stored packed, dequantized on each use (slower)"
            )
        return True, None

    def packed_format(self, name: str):
        """The PackedFormat read_packed gives (the scales' dtype as stored; fp32 where zero points make it so)."""
        from ..checkpoint.packedformat import PackedFormat
        from ..packed.fromint import kernel_group

        module = self.modules[name]
        n, k = module.shape
        stored = dtypes.short_name(self.shapes[name][1]) or "fp32"
        if module.scheme.method == "bitsandbytes":
            from ..packed.frombnb import REPACK_GROUP

            if module.scheme.bits == 8:
                return PackedFormat("int8", (n, k), k, scale_dtype="fp32")
            return PackedFormat("int4", (n, k), REPACK_GROUP, scale_dtype=stored)
        if module.scheme.bits == 8:
            return PackedFormat("int8", (n, k), k, scale_dtype=stored)
        return PackedFormat(
            "int4",
            (n, k),
            kernel_group(module.scheme.group or k, k)[0],
            scale_dtype=stored if module.scheme.symmetric else "fp32",
        )

    def read_packed(self, name: str):
        module = self.modules[name]
        if module.scheme.method == "bitsandbytes" and module.scheme.bits == 4:
            from ..packed import dequantize
            from ..packed.frombnb import REPACK_GROUP

            packed, exact = self._bnb4(name).to_packed(REPACK_GROUP, dtypes.short_name(self.shapes[name][1]) or "fp32")
            tally = self._requantized.setdefault(module.scheme.layout, [0, 0.0, 0.0])
            tally[0] += 1
            tally[1] += float((dequantize(packed).float() - exact).double().square().sum())
            tally[2] += float(exact.double().square().sum())
            return packed
        try:
            return self._int_weight(name).to_packed()
        except ValueError as exc:  # the data contradicts the config (an int8 "symmetric" weight with zero points ...)
            raise ModelError(
                f"{self.modules[name].tensors.get('packed', name)}: {exc}; shard with --quantize none"
            ) from None

    def written_notes(self) -> list[str]:
        """What the shard output says once the set is written: the measured error of weights re-quantized lossily."""
        return [
            f"{count} bitsandbytes {kind} weight{'s' if count > 1 else ''} re-quantized to int4: relative RMS error "
            f"{(error / total) ** 0.5 if total else 0.0:.1e} against their exact {kind} values"
            for kind, (count, error, total) in self._requantized.items()
        ]

    # -- reading -------------------------------------------------------------------------
    def _checked(self, name: str, read):
        try:
            return read()
        except ValueError as exc:
            raise ModelError(
                f"{name.removesuffix('.weight')}: {exc} (a damaged or foreign checkpoint); {ADVICE}"
            ) from None

    def _bnb4(self, name: str):
        from ..packed import frombnb

        module = self.modules[name]
        t, read = module.tensors, self._read_stored
        nested = {role: read(t[role]) if role in t else None for role in ("nested_scale", "nested_map")}
        return self._checked(
            name,
            lambda: frombnb.from_4bit(
                read(t["packed"]),
                read(t["scale"]),
                read(t["map"]),
                module.state,
                nested["nested_scale"],
                nested["nested_map"],
            ),
        )

    def _groups_contiguous(self, name: str) -> bool:
        if name not in self._contiguous:
            module = self.modules[name]
            g_idx = module.tensors.get("g_idx")
            group = module.scheme.group or module.shape[1]
            if g_idx is None:
                self._contiguous[name] = True
            else:
                import torch

                self._contiguous[name] = torch.equal(
                    self._read_stored(g_idx).to(torch.int64), torch.arange(module.shape[1]) // group
                )
        return self._contiguous[name]

    def _int_weight(self, name: str):
        from ..packed import frombnb, fromint

        module = self.modules[name]
        scheme, t = module.scheme, module.tensors
        read = self._read_stored
        optional = {role: read(t[role]) if role in t else None for role in ("zero", "g_idx")}
        try:
            if scheme.method == "bitsandbytes":
                return frombnb.from_int8(read(t["weight"]), read(t["scale"]))
            if scheme.method == "awq":
                return fromint.from_awq(read(t["packed"]), read(t["zero"]), read(t["scale"]))
            if scheme.method == "gptq":
                return fromint.from_gptq(
                    read(t["packed"]),
                    read(t["zero"]),
                    read(t["scale"]),
                    optional["g_idx"],
                    scheme.bits,
                    v1=scheme.layout == "gptq",
                )
            if "packed" in t:
                return fromint.from_compressed(
                    read(t["packed"]), read(t["scale"]), optional["zero"], module.shape, scheme.bits, optional["g_idx"]
                )
            return fromint.from_naive(
                read(t["weight"]), read(t["scale"]), optional["zero"], scheme.bits, optional["g_idx"]
            )
        except ValueError as exc:
            raise ModelError(
                f"{name.removesuffix('.weight')}: {exc} (a damaged or foreign checkpoint); {ADVICE}"
            ) from None


def _kernel_groups() -> tuple[int, ...]:
    from ..packed.layout import INT4_GROUPS

    return INT4_GROUPS


def _keeps(scheme: Scheme) -> bool:
    """Whether a packed format holds this scheme's weights: int4 always (bitsandbytes' 4-bit re-quantized), int8 only
    symmetric with one group a row."""
    return scheme.bits == 4 or (scheme.bits == 8 and scheme.symmetric and scheme.group is None)


def open_quantized(path: Path, config: dict, stored: dict, read_stored) -> QuantizedSafetensors:
    """The reader of a checkpoint whose config.json has `config` as quantization_config; `stored` {name: (shape, dtype)}
    of its tensors, `read_stored(name)` reads one as stored. ModelError, one line, for a format or setting not read."""
    method, modules = find_modules(path, config, stored, read_stored)
    hidden = {t for m in modules.values() for t in m.tensors.values()}
    hidden |= {n for n in stored if n.endswith(".weight_shape") and n.removesuffix("_shape") in modules}
    shapes = {n: v for n, v in stored.items() if n not in hidden}
    for name, module in modules.items():
        shapes[name] = (
            module.shape,
            dtypes.torch_dtype(dtypes.short_name(module.dtype) or "fp32")
            if module.dtype
            else stored[module.tensors["scale"]][1],
        )
    reader = QuantizedSafetensors(modules, shapes, read_stored)
    if method == "bitsandbytes" and any(m.scheme.bits == 8 for m in modules.values()):
        reader.notes.append(
            f"LLM.int8 weights are read exactly; its outlier threshold "
            f"({config.get('llm_int8_threshold', 6.0)}) "
            "splits activations in bitsandbytes' own matmul, which is not done here: activations are "
            "computed in the compute dtype, unquantized"
        )
    if method == "compressed-tensors" and quantizes_activations(config):
        reader.notes.append(
            "the checkpoint also quantizes activations; they are computed here in the compute dtype, unquantized "
            "(weights are exact; outputs differ slightly from an engine that quantizes activations)"
        )
    return reader
