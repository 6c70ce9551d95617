"""Chat messages and tools to token ids, through the model's own chat template.

Both APIs are first turned into one message list in the form transformers' chat templates take:
{"role": system|user|assistant|tool, "content": str, "tool_calls": [{"id", "type": "function",
"function": {"name", "arguments": dict}}], "tool_call_id": str}. Tools are passed to the template as
OpenAI-style function schemas. A template that ignores tools (found once, at start, by rendering a
probe tool) gets them in a system message in the chosen parser family's format instead, with earlier
calls and results written as that family writes them.

tool_choice: "none" withholds the tools; "auto" offers them; "required" and a named function add an instruction (and
for a named one only that tool is offered); constrained decoding enforces them (server/structured.py).
"""

from __future__ import annotations

import copy
import json

from .tools import ToolParser, parser_for

PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "rocketllm_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


class PromptError(Exception):
    """The messages cannot be rendered (the template refused them, or there is no template)."""


class PromptBuilder:
    def __init__(self, tokenizer, family: str, processor=None) -> None:
        if tokenizer is None:
            raise PromptError("this model has no tokenizer")
        self.tokenizer = copy.deepcopy(tokenizer)  # used on the request side; the worker keeps the model's own
        self.processor = copy.deepcopy(processor)  # a vision-language model's: messages with pictures go through it
        self.family = family
        self.parser: ToolParser = parser_for(family)
        self.has_template = bool(getattr(self.tokenizer, "chat_template", None))
        self.native_tools = self._probe() if self.has_template else False

    # -- public ---------------------------------------------------------------------------------
    def chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        tool_choice: object = "auto",
        continue_final: bool = False,
    ) -> list[int]:
        return self._render(*self._prepare(messages, tools, tool_choice, continue_final))

    def chat_inputs(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        tool_choice: object = "auto",
        continue_final: bool = False,
    ) -> tuple[list[int], dict | None]:
        """chat(), and for messages with image parts the processor's other tensors (pixel_values ...); None without."""
        from ..errors import ImageError
        from ..text.images import check_count, count_images, processor_inputs

        count = count_images(messages)
        if not count:
            return self.chat(messages, tools, tool_choice, continue_final), None
        if self.processor is None:
            raise PromptError("this model takes text only")
        try:
            check_count(count)
            prepared, kwargs = self._prepare(messages, tools, tool_choice, continue_final)
            return processor_inputs(self.processor, prepared, **kwargs)
        except ImageError as exc:
            raise PromptError(str(exc)) from None

    def _prepare(
        self, messages: list[dict], tools: list[dict] | None, tool_choice: object, continue_final: bool
    ) -> tuple[list[dict], dict]:
        """The messages and template arguments to render: tools offered natively or described, a bias, the generation
        prompt."""
        if not self.has_template:
            raise PromptError(
                "this model's tokenizer has no chat template; send a plain prompt to /v1/completions instead"
            )
        messages = [dict(m) for m in messages]
        offered = self._offered(tools, tool_choice)
        bias = self._bias(tool_choice) if offered else ""
        if offered and not self.native_tools:
            messages = self._as_text(messages)
            _add_system(messages, self.parser.system_prompt(offered) + (f"\n\n{bias}" if bias else ""))
        else:
            messages = [_for_template(m) for m in messages]
            if bias:
                _add_system(messages, bias)
        kwargs = {"tools": offered} if offered and self.native_tools else {}
        if continue_final:
            kwargs.update(add_generation_prompt=False, continue_final_message=True)
        else:
            kwargs.update(add_generation_prompt=True)
        return messages, kwargs

    def completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        return list(self.tokenizer(prompt).input_ids)

    def prefill_ids(self, text: str) -> list[int]:
        """The ids of text the server writes at the start of a reply (a forced tool call's opening): no special
        tokens added, markers the tokenizer knows as tokens kept as those tokens."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- internals ------------------------------------------------------------------------------
    def _probe(self) -> bool:
        """Does the template render tools at all? (Render a probe tool and look for its name.)"""
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=[PROBE_TOOL], add_generation_prompt=True, tokenize=False
            )
        except Exception:  # noqa: BLE001 - any template failure means: not usable with tools
            return False
        return "rocketllm_probe_tool" in str(text)

    def _offered(self, tools: list[dict] | None, tool_choice: object) -> list[dict]:
        if not tools or tool_choice == "none":
            return []
        if isinstance(tool_choice, dict):
            name = tool_choice.get("name")
            return [t for t in tools if t["function"]["name"] == name]
        return list(tools)

    @staticmethod
    def _bias(tool_choice: object) -> str:
        if tool_choice == "required":
            return "Answer by calling one or more of the functions offered."
        if isinstance(tool_choice, dict):
            return f"Answer by calling the function {tool_choice.get('name')}."
        return ""

    def _as_text(self, messages: list[dict]) -> list[dict]:
        """Earlier calls and tool results in the family's own writing, for a template that knows no tools."""
        out = []
        for m in messages:
            if m.get("role") == "assistant" and m.get("tool_calls"):
                calls = "\n".join(
                    self.parser.render_call(
                        {"name": c["function"]["name"], "arguments": _args(c["function"].get("arguments"))}
                    )
                    for c in m["tool_calls"]
                )
                text = (m.get("content") or "").strip()
                out.append({"role": "assistant", "content": f"{text}\n{calls}".strip()})
            elif m.get("role") == "tool":
                out.append({"role": "user", "content": self.parser.render_result(m.get("content") or "")})
            else:
                out.append({"role": m["role"], "content": m.get("content") or ""})
        return out

    def _render(self, messages: list[dict], kwargs: dict) -> list[int]:
        try:
            result = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, raise_exception(), a bad message shape
            raise PromptError(
                f"the model's chat template refused these messages: {' '.join(str(exc).split())}"
            ) from None
        ids = result["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(t) for t in ids]


def _args(arguments: object) -> dict:
    """Call arguments as a dict (the APIs send a JSON string; templates want a mapping)."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str) and arguments.strip():
        try:
            value = json.loads(arguments)
        except ValueError:
            return {"value": arguments}
        return value if isinstance(value, dict) else {"value": value}
    return {}


def _for_template(message: dict) -> dict:
    m = {k: v for k, v in message.items() if v is not None}
    m.setdefault("content", "")
    if m.get("tool_calls"):
        m["tool_calls"] = [
            {
                "id": c.get("id", ""),
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": _args(c["function"].get("arguments"))},
            }
            for c in m["tool_calls"]
        ]
    return m


def _add_system(messages: list[dict], text: str) -> None:
    if messages and messages[0].get("role") == "system":
        first = messages[0].get("content") or ""
        messages[0] = {**messages[0], "content": f"{first}\n\n{text}" if first else text}
    else:
        messages.insert(0, {"role": "system", "content": text})
