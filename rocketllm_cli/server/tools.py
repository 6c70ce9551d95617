"""Tool calling: parser families, chosen by reading the model's chat template, never its name.

A family knows how its models write a tool call and how to describe tools to a model whose template does
not render them. Each parser turns a finished reply into (content, calls); while a reply streams, `start()`
says where a tool call may begin, so text before it streams as content and the call is held back whole.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Hermes, Qwen2.5/3, and the default)
    llama3_json  {"name": ..., "parameters": {...}}, optionally after <|python_tag|>, several joined by ';'
    mistral      [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]

A new family is a subclass registered in FAMILIES, plus a detection rule in `detect()` and a sample in
tests/fixtures/tool_calls/<family>/.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = "call_" + uuid.uuid4().hex[:24]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def _decoder_objects(text: str) -> list[tuple[object, int, int]]:
    """Every top-level JSON value in `text` as (value, start, end), skipping what is not JSON."""
    decoder, found, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i] in "{[":
            try:
                value, end = decoder.raw_decode(text, i)
            except ValueError:
                i += 1
                continue
            found.append((value, i, end))
            i = end
        else:
            i += 1
    return found


def _as_call(value: object, arg_keys: tuple[str, ...]) -> ToolCall | None:
    """{"name": str, <one of arg_keys>: object or JSON text} -> ToolCall; anything else -> None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if "function" in value and isinstance(value["function"], dict):  # {"type": "function", "function": {...}}
        return _as_call(value["function"], arg_keys)
    args: object = {}
    for key in arg_keys:
        if key in value:
            args = value[key]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], args)


def _json_calls(body: str, arg_keys: tuple[str, ...]) -> tuple[list[ToolCall], str] | None:
    """The calls written as JSON values (objects, or lists of them) from the start of `body`, and the text between and
    after them; None unless every value is a call."""
    found = _decoder_objects(body)
    if not found or found[0][1] != 0:
        return None
    calls = [_as_call(c, arg_keys) for v, _, _ in found for c in (v if isinstance(v, list) else [v])]
    if not calls or any(c is None for c in calls):
        return None
    leftover = body
    for _, start, end in reversed(found):
        leftover = leftover[:start] + leftover[end:]
    return calls, leftover


class ToolParser:
    family = ""
    # How the family writes calls, for constrained decoding (server/structured.py): a reply that calls tools is
    # MARKER + AFTER_MARKER + call (+ BETWEEN + call ...) + CLOSE, each call {"name": ..., ARGS: {...}}.
    MARKER = ""
    AFTER_MARKER = ""
    BETWEEN = ""
    CLOSE = ""
    ARGS = "arguments"
    MARKER_OPTIONAL = False  # the call may also open the reply without the marker (llama3_json's bare JSON)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content without the calls, calls); a reply whose calls do not parse is all content."""
        raise NotImplementedError

    def start(self, text: str) -> int | None:
        """Where in `text` a tool call starts (or may start, if more text comes); None when nothing is held back."""
        raise NotImplementedError

    def system_prompt(self, tools: list[dict]) -> str:
        """Tells a model whose chat template ignores tools what it may call and how to write a call."""
        raise NotImplementedError

    def render_call(self, call: dict) -> str:
        """An earlier assistant call ({"name", "arguments"}) as this family writes it, for templates without tool
        support."""
        raise NotImplementedError

    def render_result(self, content: str) -> str:
        return content


def _partial_marker(text: str, marker: str) -> int | None:
    """Index of an end of `text` that is a strict beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return len(text) - n
    return None


def _tool_lines(tools: list[dict]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


class HermesParser(ToolParser):
    family = "hermes"
    OPEN, CLOSE_TAG = "<tool_call>", "</tool_call>"
    MARKER, AFTER_MARKER, BETWEEN, CLOSE = OPEN, "\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.OPEN not in text:
            return text, []
        calls: list[ToolCall] = []
        content = []
        pos = 0
        for match in re.finditer(re.escape(self.OPEN) + r"(.*?)(?:" + re.escape(self.CLOSE_TAG) + r"|$)", text, re.S):
            found = _json_calls(match.group(1).strip(), ("arguments", "parameters"))
            if found is None:
                return text, []  # a malformed call: give the model's text back as it is
            content.append(text[pos : match.start()])
            calls.extend(found[0])
            pos = match.end()
        content.append(text[pos:])
        return "".join(content).strip(), calls

    def start(self, text: str) -> int | None:
        at = text.find(self.OPEN)
        return at if at >= 0 else _partial_marker(text, self.OPEN)

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "You can call functions to help answer the user. The functions are listed, one JSON signature per line, "
            f"between <tools> and </tools>:\n<tools>\n{_tool_lines(tools)}\n</tools>\n\n"
            "To call a function, answer with a JSON object holding its name and arguments between <tool_call> and "
            "</tool_call>:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n</tool_call>'
        )

    def render_call(self, call: dict) -> str:
        body = json.dumps({'name': call['name'], 'arguments': call['arguments']}, ensure_ascii=False)
        return f"{self.OPEN}\n{body}\n{self.CLOSE_TAG}"

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class Llama3JsonParser(ToolParser):
    family = "llama3_json"
    TAG = "<|python_tag|>"
    MARKER, BETWEEN, ARGS, MARKER_OPTIONAL = TAG, "; ", "parameters", True

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].strip()
        if not body.startswith(("{", "[")):
            return text, []
        found = _json_calls(body, ("parameters", "arguments"))
        if found is None or found[1].replace(";", "").strip():  # calls, joined by ';', and nothing else
            return text, []
        return "", found[0]

    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped:
            return 0 if text else None  # only whitespace so far: a call may still begin
        if stripped.startswith(("{", "[", self.TAG)) or self.TAG.startswith(stripped):
            return 0
        return None

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "You can call functions to help answer the user. To call one, reply with nothing but a JSON object in the "
            "form "
            '{"name": "<function name>", "parameters": {<arguments as a JSON object>}}.\n\n'
            f"The functions, one JSON signature per line:\n{_tool_lines(tools)}"
        )

    def render_call(self, call: dict) -> str:
        return json.dumps({"name": call["name"], "parameters": call["arguments"]}, ensure_ascii=False)


class MistralParser(ToolParser):
    family = "mistral"
    MARK = "[TOOL_CALLS]"
    MARKER, AFTER_MARKER, BETWEEN, CLOSE = MARK, " [", ", ", "]"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(self.MARK)
        if at < 0:
            stripped = text.lstrip()  # the marker is a special token: decoding may have dropped it
            if not stripped.startswith('[{"name"'):
                return text, []
            at, body = 0, stripped
        else:
            body = text[at + len(self.MARK) :].strip()
        found = _json_calls(body, ("arguments", "parameters"))
        if found is None:
            return text, []
        return text[:at].strip(), found[0]

    def start(self, text: str) -> int | None:
        at = text.find(self.MARK)
        if at >= 0:
            return at
        stripped = text.lstrip()
        if stripped and '[{"name"'.startswith(stripped[:8]) and stripped[0] == "[":
            return len(text) - len(stripped)
        return _partial_marker(text, self.MARK)

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "You can call functions to help answer the user. To call them, reply with [TOOL_CALLS] followed by a JSON "
            "list "
            'of calls: [TOOL_CALLS] [{"name": "<function name>", "arguments": {<arguments as a JSON object>}}].\n\n'
            f"The functions, one JSON signature per line:\n{_tool_lines(tools)}"
        )

    def render_call(self, call: dict) -> str:
        return (
            self.MARK + " " + json.dumps([{"name": call["name"], "arguments": call["arguments"]}], ensure_ascii=False)
        )


FAMILIES: dict[str, type[ToolParser]] = {cls.family: cls for cls in (HermesParser, Llama3JsonParser, MistralParser)}
DEFAULT_FAMILY = "hermes"


def parser_for(family: str) -> ToolParser:
    return FAMILIES[family]()


def template_text(tokenizer) -> str:
    """Every chat template the tokenizer has, as one text (a tokenizer may hold several named ones)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template or ""


def detect(template: str) -> tuple[str | None, str]:
    """(family, why) from the chat template's text; (None, why) when it names no tool-call format."""
    if not template:
        return None, "the model has no chat template"
    if "<tool_call>" in template:
        return "hermes", "the chat template writes <tool_call> blocks"
    if "<|python_tag|>" in template:
        return "llama3_json", "the chat template knows <|python_tag|>"
    if "<|start_header_id|>" in template and '"parameters"' in template:
        return "llama3_json", 'the chat template asks for {"name": ..., "parameters": ...} JSON'
    if "[TOOL_CALLS]" in template:
        return "mistral", "the chat template writes [TOOL_CALLS]"
    return None, "the chat template names no tool-call format"


def choose(tokenizer, override: str | None = None) -> tuple[str, str]:
    """(family, why): the override, else what the chat template shows, else the default."""
    if override:
        return override, "--tool-parser"
    family, why = detect(template_text(tokenizer))
    if family is None:
        return DEFAULT_FAMILY, f"{why}; {DEFAULT_FAMILY} by default"
    return family, why


class StreamSplitter:
    """Splits a streamed reply into content to send now and a tool-call tail held back until the end."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0

    def feed(self, piece: str) -> str:
        """Add text; returns the content that can be sent now."""
        self.text += piece
        start = self.parser.start(self.text)
        end = len(self.text) if start is None else start
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, calls) once the reply is complete."""
        content, calls = self.parser.parse(self.text)
        if not calls:
            return self.text[self.sent :], []
        sent = self.text[: self.sent].strip()  # content before the first call went out already
        return (content[len(sent) :] if content.startswith(sent) else ""), calls
