"""A pre-quantized safetensors checkpoint read one weight at a time: compressed-tensors, GPTQ and AWQ.

config.json's `quantization_config` says which format; the weights say which modules are quantized (a
`weight_packed`, an int8 `weight` beside a `weight_scale`, a `qweight`). Each such module's tensors are presented
as the one float weight `<module>.weight` [N, K] the model has, so name mapping, units and shapes work as for a
float checkpoint: read() gives the format's own dequantization (u − uz)·s in fp32, read_packed() the portable int4
or int8 form the sharder stores under `--quantize auto` (packed/fromint.py, exact). What no packed format holds
exactly is stored dequantized and the shard output says so: act-order groups, int8 with zero points or several
groups a row, int4 with rows not a multiple of 16.

Supported, everything else refused in one line before anything is written:
    compressed-tensors  formats pack-quantized, naive-quantized, int-quantized (dense modules as floats); int weights
                        of 4 or 8 bits, strategy group, channel or tensor, symmetric or not; activation
                        quantization is not applied (activations stay in the compute dtype)
    gptq                bits 4 or 8, checkpoint_format gptq (zeros stored minus one) or gptq_v2; act-order via g_idx
    awq                 bits 4, version gemm, with zero points
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError

METHODS = ("compressed-tensors", "gptq", "awq")
CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "dense")
CT_STRATEGIES = ("group", "channel", "tensor")
CT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
ADVICE = "use an unquantized checkpoint of the model, or one in a supported format (see `rocketllm shard --help`)"


def quantization_config(path: Path) -> dict | None:
    """config.json's quantization_config of the checkpoint directory `path`, read without transformers; None if none."""
    try:
        doc = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    found = doc.get("quantization_config") if isinstance(doc, dict) else None
    return found if isinstance(found, dict) else None


def declares_packed(path: Path) -> bool:
    """Whether `path` is a checkpoint in a format whose weights a shard set keeps packed (what names its set)."""
    found = quantization_config(path) if Path(path).is_dir() else None
    return found is not None and str(found.get("quant_method", "")).lower() in METHODS


def check_declared(path: Path) -> None:
    """Refuse, in one line and without torch, a checkpoint whose config declares a quantization not read here."""
    config = quantization_config(path) if Path(path).is_dir() else None
    if config is None:
        return
    method = _method(path, config)
    if method == "gptq":
        _gptq_scheme(config)
    elif method == "awq":
        _awq_scheme(config)
    else:
        for name, group in (config.get("config_groups") or {}).items():
            _ct_check(group, _ct_format(group, config), f"compressed-tensors config group {name}")


@dataclass(frozen=True)
class Scheme:
    """How one module's weight is stored."""

    method: str  # compressed-tensors | gptq | awq
    bits: int
    group: int | None  # columns per scale; None: one group a row (channel, tensor, GPTQ's -1)
    symmetric: bool
    layout: str = ""  # compressed-tensors: pack-quantized | naive-quantized; gptq: gptq | gptq_v2; awq: gemm


@dataclass
class QuantizedModule:
    scheme: Scheme
    shape: tuple[int, int]  # (N, K) of the float weight
    tensors: dict[str, str]  # role (packed, scale, zero, g_idx, weight ...) -> stored tensor name


class QuantizedSafetensors:
    """{name: (shape, dtype)} with every quantized module shown as its float weight; read() one tensor at a time."""

    def __init__(self, modules: dict[str, QuantizedModule], shapes: dict, read_stored) -> None:
        self.modules = modules  # "<module>.weight" -> its stored tensors
        self.shapes = shapes
        self._read_stored = read_stored
        self._contiguous: dict[str, bool] = {}
        self.notes: list[str] = []  # said once by the sharder, whatever --quantize is

    def read(self, name: str):
        """A stored tensor, or a quantized module's weight dequantized (fp32)."""
        if name in self.modules:
            return self._int_weight(name).dequantize()
        return self._read_stored(name)

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
        if not _keeps(scheme):
            return False, "int8 with zero points or several groups a row (the int8 kernel takes one scale per row): stored dequantized"
        if not self._groups_contiguous(name):
            return False, "act-order (g_idx): groups that are not runs of columns, which no packed format holds; stored dequantized in the set's dtype"
        if scheme.bits == 8:
            return True, None
        group = kernel_group(scheme.group or k, k)[0]
        if n % int4_rows or group % 2:
            return False, f"int4 with rows not a multiple of {int4_rows} or an odd group (no int4 kernel takes them): stored dequantized"
        if group not in _kernel_groups():
            return True, (f"int4 at group {group}, which the int4 kernel does not take ({', '.join(map(str, _kernel_groups()))}): "
                          "stored packed, dequantized on each use (slower)")
        return True, None

    def packed_format(self, name: str):
        """The PackedFormat read_packed gives (the scales' dtype as stored; fp32 where zero points make it so)."""
        from .. import dtypes
        from ..packed.format import PackedFormat
        from ..packed.fromint import kernel_group

        module = self.modules[name]
        n, k = module.shape
        stored = dtypes.short_name(self.shapes[name][1]) or "fp32"
        if module.scheme.bits == 8:
            return PackedFormat("int8", (n, k), k, scale_dtype=stored)
        return PackedFormat("int4", (n, k), kernel_group(module.scheme.group or k, k)[0],
                            scale_dtype=stored if module.scheme.symmetric else "fp32")

    def read_packed(self, name: str):
        try:
            return self._int_weight(name).to_packed()
        except ValueError as exc:  # the data contradicts the config (an int8 "symmetric" weight with zero points ...)
            raise ModelError(f"{self.modules[name].tensors.get('packed', name)}: {exc}; shard with --quantize none") from None

    # -- reading -------------------------------------------------------------------------
    def _groups_contiguous(self, name: str) -> bool:
        if name not in self._contiguous:
            module = self.modules[name]
            g_idx = module.tensors.get("g_idx")
            group = module.scheme.group or module.shape[1]
            if g_idx is None:
                self._contiguous[name] = True
            else:
                import torch

                self._contiguous[name] = torch.equal(self._read_stored(g_idx).to(torch.int64), torch.arange(module.shape[1]) // group)
        return self._contiguous[name]

    def _int_weight(self, name: str):
        from ..packed import fromint

        module = self.modules[name]
        scheme, t = module.scheme, module.tensors
        read = self._read_stored
        optional = {role: read(t[role]) if role in t else None for role in ("zero", "g_idx")}
        try:
            if scheme.method == "awq":
                return fromint.from_awq(read(t["packed"]), read(t["zero"]), read(t["scale"]))
            if scheme.method == "gptq":
                return fromint.from_gptq(read(t["packed"]), read(t["zero"]), read(t["scale"]), optional["g_idx"], scheme.bits,
                                         v1=scheme.layout == "gptq")
            if "packed" in t:
                return fromint.from_compressed(read(t["packed"]), read(t["scale"]), optional["zero"], module.shape, scheme.bits,
                                               optional["g_idx"])
            return fromint.from_naive(read(t["weight"]), read(t["scale"]), optional["zero"], scheme.bits, optional["g_idx"])
        except ValueError as exc:
            raise ModelError(f"{name.removesuffix('.weight')}: {exc} (a damaged or foreign checkpoint); {ADVICE}") from None


def _kernel_groups() -> tuple[int, ...]:
    from ..packed.layout import INT4_GROUPS

    return INT4_GROUPS


def _keeps(scheme: Scheme) -> bool:
    """Whether a packed format holds this scheme's weights: int4 always, int8 only symmetric with one group a row."""
    return scheme.bits == 4 or (scheme.bits == 8 and scheme.symmetric and scheme.group is None)


# -- opening ---------------------------------------------------------------------------
def open_quantized(path: Path, config: dict, stored: dict, read_stored) -> QuantizedSafetensors:
    """The reader of a checkpoint whose config.json has `config` as quantization_config; `stored` {name: (shape, dtype)}
    of its tensors. ModelError, one line, for a format or setting not supported."""
    method = _method(path, config)
    modules: dict[str, QuantizedModule] = {}
    if method == "compressed-tensors":
        for module in _ct_modules(stored):
            modules[f"{module}.weight"] = _ct_module(module, config, stored, read_stored)
    else:
        scheme = _gptq_scheme(config) if method == "gptq" else _awq_scheme(config)
        for module in sorted(n.removesuffix(".qweight") for n in stored if n.endswith(".qweight")):
            modules[f"{module}.weight"] = _gptq_module(module, scheme, stored)
    hidden = {t for m in modules.values() for t in m.tensors.values()}
    hidden |= {n for n in stored if n.rsplit(".", 1)[-1] in ("weight_shape",) and n.rsplit(".", 1)[0] + ".weight" in modules}
    shapes = {n: v for n, v in stored.items() if n not in hidden}
    for name, module in modules.items():
        shapes[name] = (module.shape, stored[module.tensors["scale"]][1])
    reader = QuantizedSafetensors(modules, shapes, read_stored)
    if method == "compressed-tensors" and any((g or {}).get("input_activations") for g in (config.get("config_groups") or {}).values()):
        reader.notes.append("the checkpoint also quantizes activations; they are computed here in the compute dtype, unquantized "
                            "(weights are exact; outputs differ slightly from an engine that quantizes activations)")
    return reader


def _method(path: Path, config: dict) -> str:
    method = str(config.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ModelError(f"{Path(path).name}: quantization method {config.get('quant_method')!r} is not supported "
                         f"(supported: {', '.join(METHODS)}); {ADVICE}")
    return method


def _refuse(what: str, read: str = "") -> ModelError:
    return ModelError(f"{what} is not supported{f' ({read})' if read else ''}; {ADVICE}")


def _gptq_scheme(config: dict) -> Scheme:
    bits = int(config.get("bits", 4))
    if bits not in (4, 8):
        raise _refuse(f"{bits}-bit GPTQ", "4- and 8-bit GPTQ is read")
    layout = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
    if layout not in ("gptq", "gptq_v2") or config.get("is_marlin_format"):
        raise _refuse(f"GPTQ checkpoint_format {layout!r}", "gptq and gptq_v2 are read")
    group = int(config.get("group_size", 128))
    return Scheme("gptq", bits, None if group < 0 else group, bool(config.get("sym", True)), layout)


def _awq_scheme(config: dict) -> Scheme:
    bits = int(config.get("bits", config.get("w_bit", 4)))
    version = str(config.get("version", "gemm")).lower()
    if bits != 4:
        raise _refuse(f"{bits}-bit AWQ", "4-bit AWQ is read")
    if version != "gemm":
        raise _refuse(f"AWQ version {version!r}", "its weights are packed differently; gemm is read")
    if not config.get("zero_point", True):
        raise _refuse("AWQ without zero points")
    group = int(config.get("group_size", config.get("q_group_size", 128)))
    return Scheme("awq", 4, None if group < 0 else group, False, version)


def _gptq_module(module: str, scheme: Scheme, stored: dict) -> QuantizedModule:
    names = {"packed": f"{module}.qweight", "zero": f"{module}.qzeros", "scale": f"{module}.scales", "g_idx": f"{module}.g_idx"}
    missing = [n for role, n in names.items() if role != "g_idx" and n not in stored]
    if missing:
        raise ModelError(f"{module}: has qweight but no {missing[0].rsplit('.', 1)[1]} (a damaged {scheme.method.upper()} checkpoint); {ADVICE}")
    if names["g_idx"] not in stored or scheme.method == "awq":
        del names["g_idx"]
    rows, cols = stored[names["packed"]][0]
    per_word = 32 // scheme.bits
    n, k = (cols, rows * per_word) if scheme.method == "gptq" else (cols * per_word, rows)
    groups = stored[names["scale"]][0][0]
    group = scheme.group or k
    if k % group or groups != k // group or stored[names["scale"]][0][1] != n:
        raise ModelError(f"{module}: scales {list(stored[names['scale']][0])} do not fit a [{n}, {k}] weight at group_size "
                         f"{scheme.group or -1} (config and weights disagree); {ADVICE}")
    return QuantizedModule(Scheme(scheme.method, scheme.bits, scheme.group if scheme.group != k else None, scheme.symmetric,
                                  scheme.layout), (n, k), names)


def _ct_modules(stored: dict) -> list[str]:
    """Modules with compressed-tensors' quantized tensors: a weight_packed, or an integer weight beside a weight_scale."""
    found = set()
    for name in stored:
        if name.endswith(".weight_packed"):
            found.add(name.removesuffix(".weight_packed"))
        elif name.endswith(".weight_scale"):
            module = name.removesuffix(".weight_scale")
            weight = stored.get(f"{module}.weight")
            if weight is not None and not weight[1].is_floating_point:
                found.add(module)
    return sorted(found)


def _ct_module(module: str, config: dict, stored: dict, read_stored) -> QuantizedModule:
    group_config, fmt = _ct_scheme_of(module, config)
    where = f"compressed-tensors module {module}"
    bits, strategy = _ct_check(group_config, fmt, where)
    if not bits:
        raise _refuse(f"{where}: quantized tensors under a config group that quantizes no weights")
    weights = group_config.get("weights") or {}
    tensors = {"scale": f"{module}.weight_scale"}
    for role, suffix in (("zero", "weight_zero_point"), ("g_idx", "weight_g_idx"), ("shape", "weight_shape")):
        if f"{module}.{suffix}" in stored:
            tensors[role] = f"{module}.{suffix}"
    if f"{module}.weight_packed" in stored:
        tensors["packed"] = f"{module}.weight_packed"
        rows, cols = stored[tensors["packed"]][0]
        k = int(read_stored(tensors["shape"])[-1]) if "shape" in tensors else cols * 32 // bits
        if math.ceil(k * bits / 32) != cols:
            raise ModelError(f"{where}: weight_packed [{rows}, {cols}] does not hold {k} columns of {bits} bits "
                             f"(config and weights disagree); {ADVICE}")
    else:
        tensors["weight"] = f"{module}.weight"
        rows, k = stored[tensors["weight"]][0]
    if tensors["scale"] not in stored:
        raise ModelError(f"{where}: no weight_scale (a damaged checkpoint); {ADVICE}")
    group = int(weights.get("group_size") or 0) if strategy == "group" else None
    if group is not None and (group < 1 or k % group):
        raise ModelError(f"{where}: group_size {group} does not divide its {k} columns; {ADVICE}")
    tensors.pop("shape", None)
    scheme = Scheme("compressed-tensors", bits, group if group != k else None, "zero" not in tensors,
                    "pack-quantized" if "packed" in tensors else "naive-quantized")
    return QuantizedModule(scheme, (int(rows), int(k)), tensors)


def _ct_check(group: dict, fmt: str, where: str) -> tuple[int, str]:
    """(bits, strategy) of a config group whose weights are read here; ModelError for any other."""
    weights = group.get("weights")
    if fmt == "dense" or weights is None:
        return 0, ""
    if fmt not in CT_FORMATS:
        raise _refuse(f"{where}: format {fmt!r}", "pack-quantized, naive-quantized and int-quantized are read")
    if str(weights.get("type", "int")).lower() != "int":
        raise _refuse(f"{where}: {weights.get('type')} weights", "int weights are read")
    bits, strategy = int(weights.get("num_bits", 0)), str(weights.get("strategy", "")).lower()
    if bits not in (4, 8):
        raise _refuse(f"{where}: num_bits {bits}", "4 and 8 are read")
    if strategy not in CT_STRATEGIES:
        raise _refuse(f"{where}: strategy {strategy!r}", f"{', '.join(CT_STRATEGIES)} are read")
    return bits, strategy


def _ct_format(group: dict, config: dict) -> str:
    return str(group.get("format") or config.get("format") or "").lower()


def _ct_scheme_of(module: str, config: dict) -> tuple[dict, str]:
    """The config group that quantizes `module` (an exact name, then a `re:` pattern, then a class name such as
    Linear, as compressed-tensors matches them) and its format."""
    groups = config.get("config_groups") or {}
    ranked = []
    for group in groups.values():
        for target in group.get("targets") or []:
            target = str(target)
            if target == module:
                ranked.append((0, group))
            elif target.startswith("re:") and re.match(target[3:], module):
                ranked.append((1, group))
            elif target[:1].isupper():  # a module class: only Linear layers are stored quantized here
                ranked.append((2, group))
    if not ranked:
        raise ModelError(f"compressed-tensors module {module}: no config group targets it (config and weights disagree); {ADVICE}")
    group = min(ranked, key=lambda r: r[0])[1]
    return group, _ct_format(group, config)
