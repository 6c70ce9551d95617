"""Image content parts of both APIs: decoded on the request side into the parts chat templates take.

OpenAI sends {"type": "image_url", "image_url": {"url": ...}}, Anthropic {"type": "image", "source": {"type": "base64",
"media_type", "data"}} (or a "url" source); data: URLs and paths this machine can read are accepted, http(s) never
(text/images.py says why). Every refusal is a 400 naming the field."""

from __future__ import annotations

from ..errors import ImageError
from ..text.images import decode_base64, decode_image, image_from_url
from .refusals import bad


def text_only(kind: str, where: str, param: str, state) -> Exception:
    """The 400 for a picture sent to a model that cannot take one here."""
    return bad(f"'{where}' is {kind}, but {state.model_id} {state.image_refusal}", param)


def openai_image(part: dict, where: str, param: str, state) -> dict:
    """An OpenAI image_url part as an image part."""
    if state.image_refusal is not None:
        raise text_only("an image_url part", where, param, state)
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    try:
        return {"type": "image", "image": image_from_url(url, f"{where}.image_url.url")}
    except ImageError as exc:
        raise bad(str(exc), param) from None


def anthropic_image(block: dict, where: str, param: str, state) -> dict:
    """An Anthropic image block (base64 or url source) as an image part."""
    if state.image_refusal is not None:
        raise text_only("an image block", where, param, state)
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad(f"'{where}.source' must be an object with 'type' base64 (media_type, data) or url", param)
    try:
        if source.get("type") == "base64":
            return {
                "type": "image",
                "image": decode_image(
                    decode_base64(source.get("data"), f"{where}.source.data"), f"{where}.source.data"
                ),
            }
        if source.get("type") == "url":
            return {"type": "image", "image": image_from_url(source.get("url"), f"{where}.source.url")}
    except ImageError as exc:
        raise bad(str(exc), param) from None
    raise bad(f"'{where}.source.type' must be base64 or url (got {source.get('type')!r})", param)
