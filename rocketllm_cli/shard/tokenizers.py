"""The tokenizer a shard set carries: a checkpoint's own files copied, or a GGUF's vocabulary converted by
transformers and saved portable, with the special-token flags the GGUF gives (add_bos_token and friends).

A GGUF's conversion is kept in the cache (tokenizers/<digest>/), keyed by its `tokenizer.*` entries as stored and the
transformers version: another quantization of the same model (or the same file re-indexed) copies those files instead
of converting again, which took Gemma 3's 262,144-token vocabulary 3-5 s of a 2-core machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelError

if TYPE_CHECKING:  # an annotation only: source.py opens checkpoints and imports this module
    from .source import Source


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    # a vision-language model's processor: what turns a picture into the tensors its tower takes
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)


def gguf_special_token_flags(path: Path) -> dict[str, bool]:
    """`add_bos_token` / `add_eos_token` as the GGUF at `path` declares them (`tokenizer.ggml.add_*_token`); only
    those it declares."""
    from ..checkpoint.ggufheader import read_gguf

    try:
        meta, _ = read_gguf(path)
    except (ModelError, OSError):  # unreadable here: the tokenizer as transformers made it
        return {}
    return {
        flag: bool(meta[f"tokenizer.ggml.{flag}"])
        for flag in ("add_bos_token", "add_eos_token")
        if f"tokenizer.ggml.{flag}" in meta
    }


def _portable_tokenizer_class(dest: Path) -> None:
    """Name the tokenizer class as every supported transformers line reads it: 5.x writes its generic
    `TokenizersBackend`, which 4.x cannot load; `PreTrainedTokenizerFast` is the same tokenizer to both."""
    path = dest / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


TOKENIZER_CACHE_FORMAT = 1  # of what is kept in tokenizers/<digest>/: bumped when the files saved there change


class SavedTokenizer:
    """A GGUF's converted tokenizer as the cache holds it: its files, copied into a set as they are."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def save_pretrained(self, dest) -> None:
        import shutil

        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        for f in self.folder.iterdir():
            if f.is_file():
                shutil.copyfile(f, dest / f.name)


def set_tokenizer(path: Path, reader=None):
    """What a set of the GGUF at `path` saves as its tokenizer: the cache's conversion of it (a SavedTokenizer),
    made first where the cache has none (gguf_tokenizer); None when the file has no tokenizer. `reader`:
    ggufsource.shared_reader's, in effect around the call."""
    cached = _tokenizer_cache(path)
    if cached is not None and (cached / "tokenizer_config.json").is_file():
        return SavedTokenizer(cached)
    tokenizer = gguf_tokenizer(path, reader)
    if tokenizer is not None and cached is not None:
        kept = _keep(tokenizer, cached)
        if kept is not None:
            return kept
    return tokenizer


def _tokenizer_cache(path: Path) -> Path | None:
    """Where the cache keeps the conversion of this GGUF's tokenizer, or None (no tokenizer entries, unreadable)."""
    import transformers

    from ..cachehome import cache_root
    from ..checkpoint.ggufheader import tokenizer_digest

    digest = tokenizer_digest(path, f"{TOKENIZER_CACHE_FORMAT} transformers {transformers.__version__}")
    return None if digest is None else cache_root() / "tokenizers" / digest


def _keep(tokenizer, folder: Path) -> SavedTokenizer | None:
    """Save TOKENIZER into FOLDER whole or not at all (a temporary folder renamed into place); None where the cache
    cannot be written (the set then saves the tokenizer itself)."""
    import shutil
    import tempfile

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    except OSError:
        return None
    try:
        tokenizer.save_pretrained(scratch)
        _portable_tokenizer_class(scratch)
        try:
            scratch.rename(folder)
        except OSError:  # another process kept the same conversion first: theirs serves
            if not (folder / "tokenizer_config.json").is_file():
                return None
    except OSError:
        return None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return SavedTokenizer(folder)


def gguf_tokenizer(path: Path, reader=None):
    """The tokenizer in the GGUF at `path` as transformers converts it, with the file's own BOS/EOS flags; None
    when it has none. `reader`: ggufsource.shared_reader's, in effect around the call."""
    from contextlib import nullcontext

    from transformers import AutoTokenizer

    # A transformers that reads the vocabulary from the file itself asks gguf's reader only for the config on the way
    # (~10^6 values parsed in Python for a 262k vocabulary): give it the config's fields alone.
    config_only = reader is not None and _reads_vocabulary_itself()
    try:
        with reader().for_config() if config_only else nullcontext():
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception:  # noqa: BLE001 - a model without a tokenizer still shards
        return None
    # The file says whether a prompt starts with BOS (and ends with EOS), as llama.cpp reads it; transformers
    # 4.x's conversion turns BOS on for every Llama-family GGUF, so the same file tokenized differently by line.
    for flag, value in gguf_special_token_flags(path).items():
        if getattr(tokenizer, flag, value) != value:
            setattr(tokenizer, flag, value)
    return tokenizer


def _reads_vocabulary_itself() -> bool:
    """Whether transformers' GGUF tokenizer conversion reads the vocabulary with its own reader (5.x), not gguf's."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            get_gguf_tokenizer,  # noqa: F401
        )
    except ImportError:
        return False
    return True


def save_gguf_tokenizer(path: Path, dest: Path, tokenizer=None) -> bool:
    """The tokenizer in the GGUF at `path` (or `tokenizer`, already converted from it), saved in `dest` as
    transformers files; False when it has none."""
    tokenizer = tokenizer if tokenizer is not None else set_tokenizer(path)
    if tokenizer is None:
        return False
    tokenizer.save_pretrained(dest)
    if not isinstance(tokenizer, SavedTokenizer):  # the cache's files are portable already
        _portable_tokenizer_class(dest)
    return True


def save_tokenizer(source: Source, dest: Path) -> bool:
    """Copy the tokenizer (and generation config) beside the shards so they are self-contained."""
    if source.kind == "gguf":
        return save_gguf_tokenizer(source.path, dest, source._tokenizer)
    copied = False
    for name in TOKENIZER_FILES:
        f = source.path / name
        if f.is_file():
            (dest / name).write_bytes(f.read_bytes())
            copied = True
    return copied
