"""What a one-shot generate is given: PROMPT or stdin and --system as text, decoded by one policy (a byte the
locale cannot decode becomes U+FFFD with one warning), and pictures read and checked against the model before it
loads."""

from __future__ import annotations

import os
import sys
from typing import Optional

from ..errors import RocketError
from ..output import Output


def read_prompt(prompt: Optional[str], output: Output) -> str:
    if prompt is None or prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise RocketError("no prompt: pass PROMPT or pipe it on stdin")
        stream = getattr(sys.stdin, "buffer", None)
        prompt = _decode(stream.read(), sys.stdin.encoding, "stdin", output) if stream is not None else sys.stdin.read()
    else:
        prompt = argument_text(prompt, "PROMPT", output)
    if not prompt.strip():
        raise RocketError("empty prompt: pass PROMPT or pipe non-empty text on stdin")
    return prompt.rstrip("\n")


def argument_text(value: str, where: str, output: Output) -> str:
    """An argument as text: bytes the locale could not decode arrive as surrogate escapes; os.fsencode gives them
    back."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return _decode(os.fsencode(value), sys.getfilesystemencoding(), where, output)


def _decode(raw: bytes, encoding: str | None, where: str, output: Output) -> str:
    """The one policy for prompt bytes (docs/ERRORS.md): the locale's encoding (UTF-8 nearly everywhere); a byte
    it cannot decode becomes U+FFFD, with one warning, never an error."""
    import codecs

    encoding = codecs.lookup(encoding or "utf-8").name
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        output.warn(
            f"{where} is not valid {encoding.upper()} (first bad byte at offset {exc.start}); "
            "undecodable bytes were replaced with U+FFFD"
        )
        return raw.decode(encoding, errors="replace")


def read_images(paths: list[str], model: str) -> list:
    import json as _json
    from pathlib import Path

    from ..errors import ImageError
    from ..text.images import check_count, read_image

    if not paths:
        return []
    check_count(len(paths))
    pictures = [read_image(p) for p in paths]
    path = Path(str(model)).expanduser()
    config = path / "config.json"
    text_only = path.suffix == ".gguf"  # a GGUF file holds a text model (a projector comes in a separate file)
    if not text_only and config.is_file():
        try:
            text_only = "vision_config" not in _json.loads(config.read_text())
        except (OSError, ValueError):
            pass  # loading says what is wrong with it
    if text_only:
        raise ImageError(f"{model} takes text only (no vision config); send the prompt without images")
    return pictures


def with_images(streamed, model: str, text: str, system: str | None, pictures: list) -> tuple[list[list[int]], dict]:
    """The prompt with its pictures, through the model's processor: ([ids], the processor's other tensors)."""
    from ..text.images import check_accepts, processor_inputs, user_content

    check_accepts(streamed, str(model))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user_content(text, pictures)}
    ]
    ids, inputs = processor_inputs(streamed.processor, messages)
    return [ids], inputs
