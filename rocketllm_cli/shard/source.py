"""Checkpoint sources: a HF directory (safetensors, sharded index, legacy .bin), a .gguf file, or a hub id.

A source yields its config, its tensor names with shapes, and one tensor at a
time, so the sharder holds about one layer in memory whatever the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import stfile
from ..checkpoint.manifest import MANIFEST, RESHARD, UNIT_FILE
from ..errors import ModelError, ShardError
from .quantconfig import check_declared, quantization_config
from .quantsource import open_quantized
from .tokenizers import set_tokenizer

if TYPE_CHECKING:  # torch is imported where tensors are read, so locating a model stays cheap
    import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class Located:
    """Where a checkpoint is and what kind, found without reading any weights."""

    kind: str  # safetensors | bin | gguf
    path: Path  # directory, or the .gguf file
    files: tuple[Path, ...]  # weight files

    @property
    def name(self) -> str:
        return self.path.stem if self.kind == "gguf" else self.path.name

    def fingerprint(self) -> str:
        """Identity of the source: a GGUF's content (the same file anywhere is the same model, identity.py); a
        checkpoint directory's file names, sizes and modification times, plus its config."""
        if self.kind == "gguf":
            from .identity import content_fingerprint

            return content_fingerprint(self.path)
        return self.legacy_fingerprint()

    def legacy_fingerprint(self) -> str:
        """File names, sizes and modification times, plus the config: how sets were named before a GGUF's content
        named them (such a set is still found, target.find_existing)."""
        h = hashlib.sha256()
        for f in self.files:
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        cfg = self.path / "config.json"
        if self.kind != "gguf" and cfg.is_file():
            h.update(cfg.read_bytes())
        return h.hexdigest()[:16]


@dataclass
class Source:
    kind: str  # safetensors | bin | gguf
    path: Path  # directory, or the .gguf file
    name: str
    config: object
    located: Located | None = None
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    _headers: dict[str, stfile.TensorEntry] = field(default_factory=dict, repr=False)
    _file_of: dict[str, Path] = field(default_factory=dict, repr=False)
    _state: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    _fds: dict[Path, int] = field(default_factory=dict, repr=False)
    # a per-tensor reader that presents the weights transformers loads: a GGUF's (ggufsource.LazyGGUF), or a
    # pre-quantized safetensors checkpoint's (quantsource.QuantizedSafetensors)
    _lazy: object = field(default=None, repr=False)
    # a GGUF's tokenizer, converted while the file's metadata was parsed for the config (None: it has none)
    _tokenizer: object = field(default=None, repr=False)
    # the model skeleton (discover.build_meta_model) the source was mapped onto, where it built one: the sharder's own
    _meta: object = field(default=None, repr=False)

    def fingerprint(self) -> str:
        return self.located.fingerprint()

    def read(self, name: str) -> torch.Tensor:
        """One source tensor, read into fresh memory."""
        if self._state is not None:
            return self._state[name]
        if self._lazy is not None:
            return self._lazy.read(name)
        return self.read_stored(name)

    def read_stored(self, name: str) -> torch.Tensor:
        """One tensor of a safetensors file as stored (a quantized checkpoint's packed codes too)."""
        entry = self._headers[name]
        path = self._file_of[name]
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return stfile.read_tensor(fd, entry)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._state = None
        self._lazy = None


def resolve(model: str | os.PathLike) -> Path:
    """A local path for MODEL: an existing path, or a hub id fetched with huggingface_hub."""
    text = str(model)
    path = Path(text).expanduser()
    if path.exists():
        return path
    if not _looks_like_hub_id(text):
        raise ModelError(
            f"model path not found: {text} (give a model directory, a .gguf file or a hub id like org/name)"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.bin"])
        )
    except Exception as exc:  # noqa: BLE001 - any hub failure is one line for the user
        offline = os.environ.get("HF_HUB_OFFLINE") or "connect" in str(exc).lower() or "resolve" in str(exc).lower()
        why = "the hub is not reachable (offline?)" if offline else f"{type(exc).__name__}"
        raise ModelError(f"cannot download {text}: {why}; download it elsewhere and pass the local directory") from None


def _looks_like_hub_id(text: str) -> bool:
    return text.count("/") == 1 and not text.startswith((".", "/", "~")) and not Path(text).suffix


def check_locatable(model: str | os.PathLike) -> None:
    """Refuse a local MODEL that cannot be a checkpoint, cheaply (no torch, no transformers, no network)."""
    path = Path(str(model)).expanduser()
    if path.exists() and not (path.is_dir() and (path / MANIFEST).is_file()):
        located = locate(path)
        if located.kind == "gguf":
            from ..checkpoint.ggufheader import header_problem

            problem = header_problem(located.path)  # its header alone: a cut download is one line before any import
            if problem:
                raise ModelError(problem)
        check_declared(located.path)  # a quantization not read here, too
    elif not path.exists() and not _looks_like_hub_id(str(model)):
        resolve(model)  # refused in one line; a hub id is fetched later, when it is sharded


def locate(model: str | os.PathLike) -> Located:
    """Find the checkpoint MODEL names; errors name the problem and what to pass instead."""
    path = resolve(model)
    if path.is_file() and path.suffix == ".gguf":
        return Located("gguf", path, (path,))
    if path.is_file():
        raise ModelError(f"{path.name}: not a model (expected a model directory or a .gguf file)")
    _refuse_incomplete_shards(path)
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return Located("gguf", ggufs[0], (ggufs[0],))
        raise ModelError(
            f"{path}: no config.json, so not a Hugging Face model directory (pass the model directory or a .gguf file)"
        )
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            listed = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModelError(f"{index.name}: corrupt index (re-download the model)") from None
        missing = [f.name for f in listed if not f.is_file()]
        if missing:
            raise ModelError(f"{path}: index lists {missing[0]} but the file is missing (incomplete download?)")
        return Located("safetensors", path, tuple(listed))
    for kind, pattern in (("safetensors", "*.safetensors"), ("bin", "*.bin")):
        files = tuple(sorted(path.glob(pattern)))
        if files:
            return Located(kind, path, files)
    raise ModelError(f"{path}: has config.json but no *.safetensors or *.bin weights")


def _refuse_incomplete_shards(path: Path) -> None:
    """Unit files without a manifest are an interrupted or damaged shard set, never a model to shard again."""
    units = sorted(f for f in path.iterdir() if UNIT_FILE.match(f.name)) if path.is_dir() else []
    if not units or (path / MANIFEST).is_file():
        return
    try:
        is_unit = "unit" in stfile.read_header(units[0]).metadata
    except ShardError:
        is_unit = False
    if is_unit:
        raise ShardError(
            f"{path}: unit files without {MANIFEST}: an interrupted or damaged shard set, not a model; {RESHARD}"
        )


def open_source(located: Located) -> Source:
    """Read the config and the tensor index (GGUF: dequantize the whole model)."""
    if located.kind == "gguf":
        source = _open_gguf(located.path)
    elif located.kind == "safetensors":
        source = _open_safetensors(located.path, _load_config(located.path), list(located.files))
    else:
        source = _open_bin(located.path, _load_config(located.path), list(located.files))
    source.located = located
    return source


def _load_config(path: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as exc:
        import re

        import transformers

        try:
            doc = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            doc = {}
        doc = doc if isinstance(doc, dict) else {}
        model_type, written = doc.get("model_type"), str(doc.get("transformers_version") or "")

        def line(version: str) -> tuple[int, ...]:  # major.minor; dev and rc suffixes aside
            return tuple(int(p) for p in re.findall(r"\d+", version)[:2])

        if written and line(written) > line(transformers.__version__):
            # A model type (or a sub-config's) that only a later transformers knows: name the version to install.
            raise ModelError(
                f"{path}/config.json ({model_type!r}) was written by transformers {written}, which this transformers "
                f"{transformers.__version__} cannot read; upgrade transformers to {written} or later"
            ) from None
        # transformers' advice is a paragraph: name the type instead
        if "does not recognize this architecture" in str(exc):
            raise ModelError(
                f"unsupported architecture {model_type!r}: transformers {transformers.__version__} does not know this "
                f"model_type; "
                "upgrade transformers or use a supported model"
            ) from None
        raise ModelError(f"{path}/config.json: cannot be used ({' '.join(str(exc).split())[:200]})") from None
    except (OSError, json.JSONDecodeError):
        raise ModelError(f"{path}/config.json: unreadable or not valid JSON") from None


def _open_safetensors(path: Path, config, files: list[Path]) -> Source:
    source = Source("safetensors", path, path.name, config)
    for f in files:
        for name, entry in stfile.read_header(f).entries.items():
            if name in source._headers:
                raise ModelError(f"{path}: tensor {name} appears in two files")
            source._headers[name] = entry
            source._file_of[name] = f
            source.shapes[name] = (entry.shape, entry.dtype)
    quantized = quantization_config(path)
    if quantized is not None:
        # the weights are read as their format dequantizes them, or kept packed (packing.py); the config that
        # transformers would hand its quantizer is dropped, so neither the meta model nor the shard set carries it
        source._lazy = open_quantized(path, quantized, dict(source.shapes), source.read_stored)
        source.shapes = dict(source._lazy.shapes)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
    return source


def _open_bin(path: Path, config, files: list[Path]) -> Source:
    import torch

    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - old pickles cannot be mmapped
            try:
                part = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001
                raise ModelError(f"{f.name}: cannot read legacy weights ({type(exc).__name__})") from None
        state.update({k: v for k, v in part.items() if isinstance(v, torch.Tensor)})
    source = Source("bin", path, path.name, config, _state=state)
    source.shapes = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    return source


def _open_gguf(path: Path) -> Source:
    """A GGUF read one tensor at a time (ggufsource.py); where transformers' processor must see the whole file,
    dequantized by transformers as a whole (memory: the full model, once). The file's metadata is parsed once for
    the config, the tensor map and the tokenizer (ggufsource.shared_reader)."""
    from ..checkpoint.ggufheader import header_problem

    problem = header_problem(path)  # before any reader trips over the missing end or a type it cannot decode
    if problem is not None:
        raise ModelError(problem)
    try:
        from transformers import AutoConfig

        from .ggufsource import shared_reader
    except ImportError:
        raise ModelError("reading .gguf needs the gguf package: pip install gguf") from None
    try:
        with shared_reader(path) as reader:
            return _open_gguf_shared(path, AutoConfig, reader)
    except ImportError:
        raise ModelError("reading .gguf needs the gguf package: pip install gguf") from None


def _open_gguf_shared(path: Path, AutoConfig, reader) -> Source:
    try:
        with reader().for_config():  # the metadata without the vocabulary's arrays, which no config key reads
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 - a foreign file
        raise ModelError(f"{path.name}: not a readable GGUF model ({' '.join(str(exc).split())[:160]})") from None
    from .discover import build_meta_model
    from .ggufsource import open_lazy

    tokenizer = set_tokenizer(path, reader)  # before open_lazy lets the vocabulary's metadata go
    meta = build_meta_model(config)
    lazy = open_lazy(path, config, meta)
    if lazy is not None:
        return Source(
            "gguf", path, path.stem, config, shapes=dict(lazy.shapes), _lazy=lazy, _tokenizer=tokenizer, _meta=meta
        )
    try:
        import torch
        from transformers import AutoModelForCausalLM

        from ..compat import dtype_kwargs

        kwargs = {"gguf_file": path.name, **dtype_kwargs(torch.bfloat16)}  # torch_dtype before transformers 4.56
        try:
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:  # transformers 4.x dequantizes GGUF without being asked
            pass
        model = AutoModelForCausalLM.from_pretrained(path.parent, **kwargs)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"{path.name}: cannot dequantize this GGUF ({' '.join(str(exc).split())[:160]})") from None
    config = model.config
    state = {k: v for k, v in model.state_dict().items()}
    source = Source("gguf", path, path.stem, config, _state=state, _tokenizer=tokenizer)
    source.shapes = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    return source
