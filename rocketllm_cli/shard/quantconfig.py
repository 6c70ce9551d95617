"""What a pre-quantized checkpoint's config.json and tensor names say: the format, each quantized module's scheme and
stored tensors, and the one-line refusal of anything not read here (shard/quantsource.py reads the weights).

Read: compressed-tensors formats pack-quantized, naive-quantized and int-quantized with int weights of 4 or 8 bits,
strategy group, channel or tensor, symmetric or not (a module is matched to its config group by exact name, then
a `re:` pattern, then a class name such as Linear, as the library matches them); GPTQ of 4 or 8 bits,
checkpoint_format gptq (zeros stored minus one) or gptq_v2; AWQ of 4 bits, version gemm, with zero points;
bitsandbytes LLM.int8 (`load_in_8bit`: an int8 weight beside its SCB) and 4-bit nf4 or fp4 (`load_in_4bit`: packed
bytes, absmax, quant_map and a quant_state, with or without double quantization), as transformers saves them.
The config checks need no torch, so `check_declared` runs before torch is imported.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError

METHODS = ("compressed-tensors", "gptq", "awq", "bitsandbytes")
CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "dense")
CT_STRATEGIES = ("group", "channel", "tensor")
BNB_TYPES = ("nf4", "fp4")
BNB_STATE = ".weight.quant_state.bitsandbytes__"  # <module> + this + the 4-bit type: the JSON of its quant_state
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
    elif method == "bitsandbytes":
        _bnb_scheme(config)
    else:
        for name, group in (config.get("config_groups") or {}).items():
            _ct_check(group, _ct_format(group, config), f"compressed-tensors config group {name}")


@dataclass(frozen=True)
class Scheme:
    """How one module's weight is stored."""

    method: str  # compressed-tensors | gptq | awq | bitsandbytes
    bits: int
    # columns per scale; None: one group a row (channel, tensor, GPTQ's -1); bitsandbytes 4-bit: blocksize
    group: int | None
    symmetric: bool
    layout: str = ""  # compressed-tensors: pack-quantized | naive-quantized; gptq: gptq | gptq_v2; awq: gemm;
    # bitsandbytes: int8 | nf4 | fp4


@dataclass
class QuantizedModule:
    scheme: Scheme
    shape: tuple[int, int]  # (N, K) of the float weight
    tensors: dict[str, str]  # role (packed, scale, zero, g_idx, weight ...) -> stored tensor name
    dtype: str | None = None  # the float weight's dtype where the scales' is not it (bitsandbytes)
    state: dict | None = None  # bitsandbytes 4-bit: its parsed quant_state


def find_modules(path: Path, config: dict, stored: dict, read_stored) -> tuple[str, dict[str, QuantizedModule]]:
    """(the method, {"<module>.weight": its stored tensors}) of a checkpoint whose quantization_config is `config`;
    `stored` {name: (shape, dtype)}. ModelError, one line, for a format or setting not read here."""
    method = _method(path, config)
    modules: dict[str, QuantizedModule] = {}
    if method == "compressed-tensors":
        for module in _ct_modules(stored):
            modules[f"{module}.weight"] = _ct_module(module, config, stored, read_stored)
    elif method == "bitsandbytes":
        modules = _bnb_modules(_bnb_scheme(config), stored, read_stored)
    else:
        scheme = _gptq_scheme(config) if method == "gptq" else _awq_scheme(config)
        for module in sorted(n.removesuffix(".qweight") for n in stored if n.endswith(".qweight")):
            modules[f"{module}.weight"] = _gptq_module(module, scheme, stored)
    return method, modules


def quantizes_activations(config: dict) -> bool:
    """Whether a compressed-tensors config quantizes activations too (W8A8 ...), which is not applied here."""
    return any((g or {}).get("input_activations") for g in (config.get("config_groups") or {}).values())


def _method(path: Path, config: dict) -> str:
    method = str(config.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ModelError(
            f"{Path(path).name}: quantization method {config.get('quant_method')!r} is not supported "
            f"(supported: {', '.join(METHODS)}); {ADVICE}"
        )
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


def _bnb_scheme(config: dict) -> Scheme:
    """LLM.int8 or 4-bit nf4/fp4, from load_in_8bit / load_in_4bit (or their underscored copies)."""
    eight = bool(config.get("load_in_8bit") or config.get("_load_in_8bit"))
    four = bool(config.get("load_in_4bit") or config.get("_load_in_4bit"))
    if eight == four:
        raise _refuse("a bitsandbytes config with neither (or both) of load_in_8bit and load_in_4bit")
    if eight:
        return Scheme("bitsandbytes", 8, None, True, "int8")
    kind = str(config.get("bnb_4bit_quant_type", "fp4")).lower()
    if kind not in BNB_TYPES:
        raise _refuse(f"bitsandbytes 4-bit quant_type {kind!r}", "nf4 and fp4 are read")
    return Scheme("bitsandbytes", 4, None, True, kind)


def _bnb_modules(scheme: Scheme, stored: dict, read_stored) -> dict[str, QuantizedModule]:
    """LLM.int8: `<m>.weight` int8 [N, K] beside `<m>.SCB` [N] (and `<m>.weight_format`, rows). 4-bit: `<m>.weight`
    bytes with `.absmax`, `.quant_map`, the quant_state JSON (shape, dtype, blocksize) and, double quantized,
    `.nested_absmax` and `.nested_quant_map`. A module without them (lm_head, skipped modules) stays float."""
    modules: dict[str, QuantizedModule] = {}
    if scheme.bits == 8:
        floats = {}
        for name, (shape, dtype) in stored.items():
            if dtype.is_floating_point and not name.endswith(".SCB"):
                floats[dtype] = floats.get(dtype, 0) + math.prod(shape)
        model_dtype = str(max(floats, key=floats.get)) if floats else "float32"  # SCB is fp32 whatever the model's
        for module in sorted(n.removesuffix(".SCB") for n in stored if n.endswith(".SCB")):
            names = {"weight": f"{module}.weight", "scale": f"{module}.SCB"}
            weight = stored.get(names["weight"])
            if (
                weight is None
                or weight[1].is_floating_point
                or len(weight[0]) != 2
                or math.prod(stored[names["scale"]][0]) != weight[0][0]
            ):
                raise ModelError(
                    f"{module}: SCB {list(stored[names['scale']][0])} without an int8 weight of as many rows (a "
                    f"damaged bitsandbytes checkpoint); {ADVICE}"
                )
            if f"{module}.weight_format" in stored:
                layout = int(read_stored(f"{module}.weight_format").reshape(-1)[0])
                if layout != 0:
                    raise _refuse(
                        f"bitsandbytes int8 module {module}: weight_format {layout}",
                        "weights stored as rows (0) are read",
                    )
                names["format"] = f"{module}.weight_format"
            modules[names["weight"]] = QuantizedModule(scheme, tuple(weight[0]), names, model_dtype)
        return modules
    for name in sorted(n for n in stored if BNB_STATE in n):
        module, kind = name.split(BNB_STATE)
        if kind not in BNB_TYPES:
            raise _refuse(f"bitsandbytes module {module}: 4-bit type {kind!r}", "nf4 and fp4 are read")
        base = f"{module}.weight"
        names = {"packed": base, "scale": f"{base}.absmax", "map": f"{base}.quant_map", "state": name}
        for role, suffix in (("nested_scale", "nested_absmax"), ("nested_map", "nested_quant_map")):
            if f"{base}.{suffix}" in stored:
                names[role] = f"{base}.{suffix}"
        missing = [n for role, n in names.items() if n not in stored]
        if missing:
            raise ModelError(
                f"{module}: has a 4-bit quant_state but no {missing[0].removeprefix(base + '.')} (a damaged "
                f"bitsandbytes checkpoint); {ADVICE}"
            )
        state = _bnb_state(read_stored(name), module)
        shape, blocksize = state.get("shape"), state.get("blocksize")
        if (
            str(state.get("quant_type", kind)) != kind
            or not (isinstance(shape, list) and len(shape) == 2)
            or not isinstance(blocksize, int)
        ):
            raise ModelError(
                f"{module}: its quant_state {json.dumps(state)[:120]} is not a 2-D {kind} weight's; {ADVICE}"
            )
        dtype = str(state.get("dtype", "float32"))
        modules[base] = QuantizedModule(
            Scheme("bitsandbytes", 4, blocksize, True, kind),
            (int(shape[0]), int(shape[1])),
            names,
            dtype if dtype.startswith(("float", "bfloat")) else "float32",
            state,
        )
    return modules


def _bnb_state(tensor, module: str) -> dict:
    try:
        found = json.loads(bytes(tensor.reshape(-1).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        found = None
    if not isinstance(found, dict):
        raise ModelError(
            f"{module}: its 4-bit quant_state is not the JSON bitsandbytes writes (a damaged checkpoint); {ADVICE}"
        )
    return found


def _gptq_module(module: str, scheme: Scheme, stored: dict) -> QuantizedModule:
    names = {
        "packed": f"{module}.qweight",
        "zero": f"{module}.qzeros",
        "scale": f"{module}.scales",
        "g_idx": f"{module}.g_idx",
    }
    missing = [n for role, n in names.items() if role != "g_idx" and n not in stored]
    if missing:
        raise ModelError(
            f"{module}: has qweight but no {missing[0].rsplit('.', 1)[1]} (a damaged "
            f"{scheme.method.upper()} checkpoint); {ADVICE}"
        )
    if names["g_idx"] not in stored or scheme.method == "awq":
        del names["g_idx"]
    rows, cols = stored[names["packed"]][0]
    per_word = 32 // scheme.bits
    n, k = (cols, rows * per_word) if scheme.method == "gptq" else (cols * per_word, rows)
    groups = stored[names["scale"]][0][0]
    group = scheme.group or k
    if k % group or groups != k // group or stored[names["scale"]][0][1] != n:
        raise ModelError(
            f"{module}: scales {list(stored[names['scale']][0])} do not fit a [{n}, {k}] weight at group_size "
            f"{scheme.group or -1} (config and weights disagree); {ADVICE}"
        )
    return QuantizedModule(
        Scheme(
            scheme.method, scheme.bits, scheme.group if scheme.group != k else None, scheme.symmetric, scheme.layout
        ),
        (n, k),
        names,
    )


def _ct_modules(stored: dict) -> list[str]:
    """Modules with compressed-tensors' quantized tensors: a weight_packed, or an integer weight beside a
    weight_scale."""
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
            raise ModelError(
                f"{where}: weight_packed [{rows}, {cols}] does not hold {k} columns of {bits} bits "
                f"(config and weights disagree); {ADVICE}"
            )
    else:
        tensors["weight"] = f"{module}.weight"
        rows, k = stored[tensors["weight"]][0]
    if tensors["scale"] not in stored:
        raise ModelError(f"{where}: no weight_scale (a damaged checkpoint); {ADVICE}")
    group = int(weights.get("group_size") or 0) if strategy == "group" else None
    if group is not None and (group < 1 or k % group):
        raise ModelError(f"{where}: group_size {group} does not divide its {k} columns; {ADVICE}")
    tensors.pop("shape", None)
    scheme = Scheme(
        "compressed-tensors",
        bits,
        group if group != k else None,
        "zero" not in tensors,
        "pack-quantized" if "packed" in tensors else "naive-quantized",
    )
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
        raise ModelError(
            f"compressed-tensors module {module}: no config group targets it (config and weights disagree); {ADVICE}"
        )
    group = min(ranked, key=lambda r: r[0])[1]
    return group, _ct_format(group, config)
