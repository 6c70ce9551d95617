"""The few places where transformers 4.x (>= 4.57) and 5.x differ in what this project calls.

Everything version-dependent is decided here, once, from the installed version, so the
rest of the code calls one spelling and the differences stay listed in one file.
"""

from __future__ import annotations

import re

import transformers


def _version(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


TRANSFORMERS_VERSION = _version(transformers.__version__)
TRANSFORMERS_5 = TRANSFORMERS_VERSION >= (5, 0)

# The keyword that sets a model's dtype in from_pretrained/from_config: `dtype` from 4.56 on, `torch_dtype` before.
DTYPE_KWARG = "dtype" if TRANSFORMERS_VERSION >= (4, 56) else "torch_dtype"


def dtype_kwargs(dtype) -> dict:
    """{DTYPE_KWARG: dtype}, or {} for None (the model's own default)."""
    return {} if dtype is None else {DTYPE_KWARG: dtype}


def set_config_dtype(config, dtype) -> None:
    """Record the weights' dtype on a config, under the attribute the installed version serialises."""
    setattr(config, DTYPE_KWARG, dtype)


def extra_special_tokens_kwargs(tokens: list[str]) -> dict:
    """A tokenizer's extra special tokens, a plain list, as its constructor takes them.

    transformers 5 takes the list as `extra_special_tokens`; 4.x takes it as `additional_special_tokens`
    (its `extra_special_tokens` is a different thing there: a dict of named attributes).
    """
    return {"extra_special_tokens" if TRANSFORMERS_5 else "additional_special_tokens": list(tokens)}
