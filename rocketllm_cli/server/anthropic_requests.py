"""Anthropic Messages requests, checked field by field and made the Prepared request the worker runs: content
blocks, the system prompt, tools and tool_choice, output_format; and count_tokens on the same prompt."""

from __future__ import annotations

from ..text.constraints import Constraint
from ..text.loop import GenerationRequest
from .fields import (
    boolean,
    check_fields,
    check_model,
    function_tool,
    number,
    required,
    sampling,
    stop_strings,
    string,
    tool_list,
    tool_schema,
)
from .imageparts import anthropic_image
from .openai_requests import tool_choice
from .prepared import Prepared
from .prompts import PromptError
from .refusals import bad, check_context
from .structured import Structure, plan, relaxed_header

FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        "output_format",
    }
)


REFUSED = {
    "container": "this server runs no code containers",
    "mcp_servers": "this server connects to no MCP servers",
    "context_management": "this server edits no context",
}


# -- requests ------------------------------------------------------------------------------------------
def _text_of(value: object, where: str, state) -> str:
    """A content value that may only hold text: a string or a list of text blocks."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"'{where}' must be a string or a list of content blocks", where)
    texts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict):
            raise bad(f"'{where}[{j}]' must be a content block object", where)
        kind = block.get("type")
        if kind == "text":
            texts.append(string(block, "text", f"{where}[{j}].", needed=True))
        elif kind in ("image", "document"):
            only = (
                "images go in a user message's content"
                if state.multimodal and kind == "image"
                else f"{state.model_id} takes text only"
            )
            raise bad(f"'{where}[{j}]' is an {kind} block, but {only}", where)
        else:
            raise bad(f"'{where}[{j}].type' must be 'text' here (got {kind!r})", where)
    return "\n".join(texts)


def _messages(raw: list, state) -> list[dict]:
    out: list[dict] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{where}' must be an object with 'role' and 'content'", "messages")
        role = string(m, "role", f"{where}.", needed=True)
        if role not in ("user", "assistant"):
            raise bad(
                f"'{where}.role' must be user or assistant (got {role!r}); put a system prompt in 'system'",
                f"{where}.role",
            )
        content = required(m, "content", f"{where}.")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"'{where}.content' must be a string or a list of content blocks", f"{where}.content")
        if not content and role == "user":
            raise bad(
                f"'{where}.content' is an empty list; a user message needs at least one content block",
                f"{where}.content",
            )
        texts, calls, parts = [], [], []  # parts: the text and image parts in order, used when there are pictures
        for j, block in enumerate(content):
            bw = f"{where}.content[{j}]"
            if not isinstance(block, dict):
                raise bad(f"'{bw}' must be a content block object", f"{where}.content")
            kind = block.get("type")
            if kind == "text":
                texts.append(string(block, "text", f"{bw}.", needed=True))
                parts.append({"type": "text", "text": texts[-1]})
            elif kind == "image" and role == "user":
                parts.append(anthropic_image(block, bw, f"{where}.content", state))
            elif kind == "tool_use" and role == "assistant":
                name = string(block, "name", f"{bw}.", needed=True)
                args = block.get("input") or {}
                if not isinstance(args, dict):
                    raise bad(f"'{bw}.input' must be an object", f"{bw}.input")
                calls.append(
                    {"id": block.get("id") or "", "type": "function", "function": {"name": name, "arguments": args}}
                )
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                text = _text_of(result, f"{bw}.content", state) if result is not None else ""
                if block.get("is_error"):
                    text = f"error: {text}"
                out.append(
                    {"role": "tool", "content": text, "tool_call_id": string(block, "tool_use_id", f"{bw}.") or ""}
                )
            elif kind in ("thinking", "redacted_thinking"):
                continue
            elif kind in ("image", "document"):
                only = (
                    "images go in user messages"
                    if state.multimodal and kind == "image"
                    else (f"{state.model_id} takes text only")
                )
                raise bad(f"'{bw}' is an {kind} block, but {only}", f"{where}.content")
            else:
                raise bad(f"'{bw}.type' {kind!r} is not supported in a {role} message", f"{where}.content")
        if texts or calls or parts or role == "assistant":
            message: dict = {"role": role, "content": parts if len(parts) > len(texts) else "\n".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def _tools(value: object) -> list[dict]:
    return tool_list(value, "'tools' must be a list", _tool)


def _tool(i: int, t: object) -> dict:
    if not isinstance(t, dict):
        raise bad(f"'tools[{i}]' must be an object", f"tools[{i}]")
    if t.get("type") not in (None, "custom"):
        raise bad(
            f"'tools[{i}]' is a {t.get('type')} tool; only custom tools (name, input_schema) are supported",
            f"tools[{i}]",
        )
    return function_tool(
        string(t, "name", f"tools[{i}].", needed=True),
        string(t, "description", f"tools[{i}]."),
        tool_schema(required(t, "input_schema", f"tools[{i}]."), f"tools[{i}].input_schema"),
    )


def _tool_choice(value: object, tools: list[dict]) -> tuple[object, bool]:
    """(choice in the OpenAI terms the prompt builder takes, whether parallel calls are allowed)."""
    if value is None:
        return tool_choice(None, tools), True
    if not isinstance(value, dict) or value.get("type") not in ("auto", "any", "tool", "none"):
        raise bad("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice")
    kind = value["type"]
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {"name": value.get("name")}
    disable = value.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise bad("'tool_choice.disable_parallel_tool_use' must be true or false", "tool_choice")
    return tool_choice(mapped, tools), not disable


def _output_format(body: dict):
    """output_config.format (or the beta's output_format) as a Constraint; None for a free reply."""
    config = body.get("output_config")
    fmt, where = None, "output_config"
    if config is not None:
        if not isinstance(config, dict):
            raise bad(
                "'output_config' must be an object such as {\"format\": {\"type\": \"json_schema\", \"schema\": "
                "{...}}}",
                where,
            )
        unknown = sorted(set(config) - {"format"})
        if unknown:
            raise bad(f"'output_config.{unknown[0]}' is not supported here (only 'format' is)", where)
        fmt, where = config.get("format"), "output_config.format"
    if body.get("output_format") is not None:
        if fmt is not None:
            raise bad("give 'output_config.format' or 'output_format', not both", "output_format")
        fmt, where = body["output_format"], "output_format"
    if fmt is None:
        return None, where
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad(f"'{where}' must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}", where)
    return Constraint.json_schema(fmt["schema"]), where


def _system(value: object, state) -> str:
    if value is None:
        return ""
    return _text_of(value, "system", state)


def _prompt(body: dict, state) -> tuple[list[int], bool, Structure, dict | None]:
    """(prompt ids, whether to parse tool calls, the structure enforced, the processor's tensors for pictures) for a
    Messages request."""
    check_model(body, state)
    check_fields(body, FIELDS, REFUSED)
    raw = required(body, "messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list", "messages")
    messages = _messages(raw, state)
    if not messages:
        raise bad("'messages' holds no text, tool call or tool result", "messages")
    system = _system(body.get("system"), state)
    if system:
        messages.insert(0, {"role": "system", "content": system})
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise bad(
            "extended thinking is not supported; send thinking {\"type\": \"disabled\"} or leave it out", "thinking"
        )
    answer, answer_param = _output_format(body)
    prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    # Anthropic's structured outputs promise adherence: a schema the engine cannot enforce whole is a 400; tools only
    # when marked strict
    strict = answer is not None or any(isinstance(t, dict) and t.get("strict") is True for t in body.get("tools") or [])
    structure = plan(state, tools, choice, parallel, answer, answer_param, strict)
    if prefill and (structure.prefill or structure.constraint is not None):
        raise bad(
            "the last message is an assistant prefill, which the reply would continue, but "
            f"{'tool_choice' if tools and choice != 'none' else answer_param} constrains the whole reply; drop "
            f"one",
            "messages",
        )
    try:
        ids, inputs = state.builder.chat_inputs(messages, tools, choice, continue_final=prefill)
    except PromptError as exc:
        raise bad(str(exc), "messages") from None
    return ids + state.builder.prefill_ids(structure.prefill), bool(tools) and choice != "none", structure, inputs


def prepare_messages(body: dict, state) -> Prepared:
    max_tokens = number(body, "max_tokens", 1, integer=True, needed=True)
    ids, use_tools, structure, inputs = _prompt(body, state)
    max_tokens = check_context(
        len(ids), max_tokens, state.max_context, "max_tokens", state.context_why, state.context_int4
    )
    params = sampling(body, max_tokens, 1.0)
    stop = stop_strings(body.get("stop_sequences"), "stop_sequences")
    request = GenerationRequest(ids, params, stop, model_inputs=inputs, constraint=structure.constraint)
    return Prepared(request, boolean(body, "stream"), use_tools, False, relaxed_header(structure), structure=structure)


def count_tokens(body: dict, state) -> dict:
    ids, _, _, _ = _prompt(body, state)
    return {"input_tokens": len(ids)}
