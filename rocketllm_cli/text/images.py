"""Pictures in: decode an image from bytes, a file or a data: URL, check it, and hand prompt and pictures to the
model's own processor, which makes the tensors its vision tower takes (transformers' apply_chat_template).

Every refusal is an ImageError, one line: the CLI prints it, the server answers 400 with it.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path

from ..errors import ImageError

FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP", "GIF": "GIF", "BMP": "BMP"}  # Pillow's name -> how we say it
MAX_IMAGES = 8  # per prompt: each picture is a prefill of hundreds of placeholder tokens on a real model
MAX_IMAGE_BYTES = 20 << 20
MAX_PIXELS = 8192 * 8192  # a decoded picture larger than this is refused before its pixels are decoded
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)$", re.DOTALL)
NEEDS_PILLOW = (
    "images need the Pillow package: pip install -e '.[vision]' in the rocketllm source directory (or pip "
    "install pillow)"
)


def accepted() -> str:
    names = list(FORMATS.values())
    return ", ".join(names[:-1]) + " or " + names[-1]


def decode_image(data: bytes, where: str):
    """DATA (the file's bytes) as an RGB PIL image; ImageError if it is not an image of a supported format."""
    try:
        from PIL import Image
    except ImportError:
        raise ImageError(NEEDS_PILLOW) from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(
            f"{where} is {len(data) >> 20} MiB; images of at most {MAX_IMAGE_BYTES >> 20} MiB are accepted"
        )
    try:
        image = Image.open(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - Pillow raises several kinds for bytes that are no image it knows
        raise ImageError(f"{where} does not decode as an image (accepted formats: {accepted()})") from None
    if image.format not in FORMATS:
        raise ImageError(f"{where} is a {image.format} image, which is not supported; send {accepted()}")
    width, height = image.size
    if width * height > MAX_PIXELS:
        raise ImageError(f"{where} is {width}x{height} pixels; at most {MAX_PIXELS} pixels are accepted")
    try:
        image.load()
        return image.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt data behind a valid header
        raise ImageError(
            f"{where} does not decode as an image: {' '.join(str(exc).split()) or type(exc).__name__}"
        ) from None


def read_image(path: str | Path, where: str | None = None):
    """The image in file PATH; ImageError if it cannot be read or decoded."""
    path = Path(path).expanduser()
    named = f" ({where})" if where else ""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except IsADirectoryError:
        raise ImageError(f"{path} is a directory, not an image file{named}") from None
    except OSError as exc:
        raise ImageError(f"cannot read image file {path}{named}: {exc.strerror or exc}") from None
    return decode_image(data, where or str(path))


def image_from_url(url: str, where: str):
    """An image given by URL, as the APIs send one: a data: URL (base64), a file:// URL or a path this machine can
    read. http(s) is refused: fetching it would make the server request addresses chosen by whoever sent the request."""
    if not isinstance(url, str) or not url:
        raise ImageError(f"{where} must be a non-empty string (a data: URL, or a path the server can read)")
    scheme = url.split(":", 1)[0].lower() if ":" in url[:12] else ""
    if scheme in ("http", "https"):
        raise ImageError(
            f"{where} is an {scheme} URL, which this server does not fetch (it would request addresses "
            f"chosen by "
            "whoever sends the request); send the image inline, base64-encoded, instead"
        )
    if scheme == "data":
        match = _DATA_URL.match(url)
        if match is None:
            raise ImageError(f"{where} is a data: URL that is not base64 (expected data:image/png;base64,...)")
        return decode_image(decode_base64(match.group("data"), where), where)
    if scheme == "file":
        url = url[len("file://") :] if url.startswith("file://") else url[len("file:") :]
    elif scheme:
        raise ImageError(
            f"{where} has the URL scheme {scheme!r}; send a data: URL (base64) or a path the server can read"
        )
    return read_image(url, where)


def decode_base64(text: str, where: str) -> bytes:
    if not isinstance(text, str):
        raise ImageError(f"{where} must be base64 text")
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where} is not valid base64") from None


def check_count(count: int) -> None:
    if count > MAX_IMAGES:
        raise ImageError(f"{count} images in one prompt; at most {MAX_IMAGES} are accepted")


def refusal(model) -> str | None:
    """Why MODEL cannot take pictures here, or None if it can: no vision tower, or no processor that loads."""
    manifest = getattr(model, "manifest", None)
    if manifest is not None and not manifest.vision:
        return "takes text only (no vision tower in its shards)"
    if getattr(model, "processor", None) is None:
        return getattr(model, "processor_error", None) or "has no processor to turn pictures into its inputs"
    return None


def check_accepts(model, name: str) -> None:
    reason = refusal(model)
    if reason is not None:
        text_only = getattr(model, "manifest", None) is not None and not model.manifest.vision
        raise ImageError(f"{name} {reason}" + ("; send the prompt without images" if text_only else ""))


def user_content(text: str, images: list) -> list[dict]:
    """A user message's content parts: the pictures, then the text (the form chat templates take)."""
    return [*({"type": "image", "image": image} for image in images), {"type": "text", "text": text}]


def processor_inputs(processor, messages: list[dict], **template_kwargs) -> tuple[list[int], dict]:
    """Token ids and the other tensors (pixel_values, image_grid_thw, token_type_ids ...) the processor makes of
    MESSAGES,
    whose content parts may carry PIL images; through the processor's own apply_chat_template, as transformers does."""
    kwargs = {"add_generation_prompt": True, **template_kwargs}
    try:
        out = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt", **kwargs)
    except ImageError:
        raise
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, a processor that refuses the pictures
        raise ImageError(f"the model's processor refused these images: {' '.join(str(exc).split())[:300]}") from None
    ids = out["input_ids"][0].tolist()
    extra = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
    return ids, extra


def count_images(messages: list[dict]) -> int:
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    )
