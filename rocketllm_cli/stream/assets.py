"""What a shard set carries beside its weights, loaded when it opens: the generation config, the tokenizer and,
for a vision-language model, the processor. Each is optional: a missing or unreadable one is None (the processor
with the reason a user is told)."""

from __future__ import annotations

from pathlib import Path

from torch import nn


def load_generation_config(model: nn.Module, directory: Path) -> None:
    if (directory / "generation_config.json").is_file():
        from transformers import GenerationConfig

        try:
            model.generation_config = GenerationConfig.from_pretrained(directory)
        except (OSError, ValueError):
            pass


def load_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    if not any(
        (directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    ):
        return None
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError):
        return None


def load_processor(directory: Path) -> tuple[object | None, str | None]:
    """The shard set's processor (AutoProcessor), or None and why it cannot be used here."""
    if not any((directory / f).is_file() for f in ("preprocessor_config.json", "processor_config.json")):
        return None, (
            "has no image processor in its shard directory; re-shard from a model directory that includes its processor"
        )
    from transformers import AutoProcessor
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "requires torchvision, falling back to the Pillow backend" is no news to a user
    try:
        processor = AutoProcessor.from_pretrained(directory)
    except ImportError as exc:
        missing = "torchvision" if "torchvision" in str(exc).lower() else "a package it imports"
        return None, (
            f"has a processor that needs {missing}, which is not installed; install it (torchvision from the "
            f"same "
            "index as torch)"
        )
    except Exception as exc:  # noqa: BLE001 - any processor that does not load: the model still serves text
        return None, f"has a processor that does not load ({' '.join(str(exc).split())[:160]})"
    finally:
        logging.set_verbosity(verbosity)
    if not hasattr(processor, "image_processor"):
        return None, (
            "has no image processor in its shard directory; re-shard from a model directory that includes its processor"
        )
    return processor, None
