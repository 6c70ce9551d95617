"""The naive streaming loop (the slow path DESIGN 6b measures): per tensor safe_open + set_module_tensor_to_device.

A meta-device model gets, on each decoder layer and on every top-level module that owns weights,
a pre-hook that opens the checkpoint and loads that module's tensors one at a time, and a post-hook
that moves them back to meta. No architecture-specific code: the stack is the largest ModuleList.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


class NaiveStreamer:
    def __init__(self, hf_dir: Path, dtype: torch.dtype) -> None:
        from transformers import AutoConfig

        from ..shard.discover import build_meta_model

        self.dtype = dtype
        self.files = _weight_map(Path(hf_dir))
        self.model = build_meta_model(AutoConfig.from_pretrained(hf_dir), dtype)
        pin_cpu(self.model)
        if (Path(hf_dir) / "generation_config.json").is_file():
            from transformers import GenerationConfig

            self.model.generation_config = GenerationConfig.from_pretrained(hf_dir)
        tied = _tied_sources(self.model)
        for module_path, module, recurse in _units(self.model):
            names = [f"{module_path}.{n}" if module_path else n for n, _ in module.named_parameters(recurse=recurse)]
            module.register_forward_pre_hook(self._load(names, tied))
            module.register_forward_hook(self._drop(names))

    def _load(self, names: list[str], tied: dict[str, str]):
        from accelerate.utils import set_module_tensor_to_device
        from safetensors import safe_open

        def hook(module, args):
            for name in names:
                key = name if name in self.files else tied.get(name, name)
                with safe_open(self.files[key], framework="pt") as f:  # one open per tensor: the naive way
                    value = f.get_tensor(key)
                set_module_tensor_to_device(self.model, name, "cpu", value=value, dtype=self.dtype)

        return hook

    def _drop(self, names: list[str]):
        from accelerate.utils import set_module_tensor_to_device

        def hook(module, args, output):
            for name in names:
                set_module_tensor_to_device(self.model, name, "meta")

        return hook


def pin_cpu(model: nn.Module) -> None:
    """Parameters that wait on the meta device (or on disk) must not make generate() think the model runs on meta."""
    cls = model.__class__
    model.__class__ = type(cls.__name__, (cls,), {"device": property(lambda self: torch.device("cpu"))})


def _weight_map(hf_dir: Path) -> dict[str, Path]:
    index = next(iter(hf_dir.glob("*.safetensors.index.json")), None)
    if index is not None:
        return {k: hf_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    files = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files


def _tied_sources(model: nn.Module) -> dict[str, str]:
    """Output-embedding parameter -> input-embedding parameter, when the checkpoint stores them once."""
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is None or out is None:
        return {}
    return {f"{names[id(out)]}.weight": f"{names[id(inp)]}.weight"}


def _units(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """(path, module, whole subtree?): each block of the decoder stack, plus every module outside it that owns
    parameters directly (its own parameters only)."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    stack_path, stack = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    units = [(f"{stack_path}.{i}", block, True) for i, block in enumerate(stack)]
    for name, module in model.named_modules():
        if name.startswith(stack_path + ".") or name == stack_path:
            continue
        if any(True for _ in module.parameters(recurse=False)):
            units.append((name, module, False))
    return units
