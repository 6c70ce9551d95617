"""What a request's structure fields become in the loop: a Constraint, and text the server writes itself.

Both APIs translate their fields here, once, into a Structure:
    response_format json_object / json_schema, output_config.format    -> the reply is that JSON (a Constraint)
    tool_choice named (OpenAI {"function": {"name"}}, Anthropic tool)  -> the reply is one call of that tool
    tool_choice required / any                                         -> the reply is one call (or several) of the
    tools
    tool_choice auto                                                   -> free text, but a call the model opens is valid
Calls are written in the model family's own format (server/tools.py). Where the tool is known, the server writes the
call's opening itself (`prefill`: appended to the prompt, so the model continues it) and its end (`closing`), and the
model generates only the arguments: each forced token costs a pass, which may be seconds when layers stream. The reply
is then prefill + generated + closing, parsed by the family's parser as any reply is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..text.constraints import Constraint, engine_schema
from .tools import ToolParser


@dataclass(frozen=True)
class Structure:
    constraint: Constraint | None = None
    prefill: str = ""  # the start of the reply, written into the prompt: the model continues from it
    closing: str = ""  # the end of a forced call, written after the generated arguments
    enforced: str = ""  # what the constraint enforces, in words
    relaxed: str = ""  # why some of the schema is not enforced (the engine's reason), for a request that allowed that


FREE = Structure()


def call_schema(parser: ToolParser, tool: dict) -> dict:
    """One call of TOOL as the family writes it: {"name": <the name>, ARGS: <its parameters>}."""
    fn = tool["function"]
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, parser.ARGS: fn["parameters"]},
        "required": ["name", parser.ARGS],
        "additionalProperties": False,
    }


def _schema_text(schema: dict) -> str:
    return json.dumps(schema, ensure_ascii=False)


def _calls_rule(parser: ToolParser, tools: list[dict], parallel: bool, literal, lenient: bool) -> str:
    """Lark rules for one call (or, with parallel, several joined the family's way) of any of the tools."""
    one = call_schema(parser, tools[0]) if len(tools) == 1 else {"anyOf": [call_schema(parser, t) for t in tools]}
    rules = f"call: %json {_schema_text(engine_schema(one, lenient))}\n"
    if parallel and parser.BETWEEN:
        return f"calls: call ({literal(parser.BETWEEN)} call)*\n" + rules
    return "calls: call\n" + rules


def for_tools(
    parser: ToolParser,
    tools: list[dict],
    choice: object,
    parallel: bool,
    literal,
    answer: Constraint | None = None,
    lenient: bool = False,
) -> Structure:
    """The structure for a request that offers TOOLS with CHOICE ('auto', 'required' or {'name': ...}).

    literal(text) writes TEXT as a Lark expression: a special token as <[id]>, other text as a string.
    answer: a response_format the reply must follow when it is not a call (auto only).
    lenient: leave the keywords of the tools' schemas that the engine does not implement unenforced."""
    if isinstance(choice, dict) or (choice == "required" and len(tools) == 1):
        name = choice["name"] if isinstance(choice, dict) else tools[0]["function"]["name"]
        tool = next(t for t in tools if t["function"]["name"] == name)
        opening = parser.MARKER + parser.AFTER_MARKER if not parser.MARKER_OPTIONAL else ""
        prefill = (
            opening
            + "{"
            + json.dumps("name")
            + ": "
            + json.dumps(name, ensure_ascii=False)
            + ", "
            + json.dumps(parser.ARGS)
            + ": "
        )
        return Structure(
            Constraint.json_schema(tool["function"]["parameters"], lenient),
            prefill,
            "}" + parser.CLOSE,
            f"a call of {name} (its arguments generated against its schema)",
        )
    if choice == "required":
        opening = parser.MARKER + parser.AFTER_MARKER if not parser.MARKER_OPTIONAL else ""
        grammar = "start: calls\n" + _calls_rule(parser, tools, parallel, literal, lenient)
        return Structure(
            Constraint.lark(grammar),
            opening,
            parser.CLOSE,
            f"{'calls' if parallel else 'one call'} of the {len(tools)} tools offered, valid against their schemas",
        )
    # auto: text, or once the model opens a call, calls valid against the tools' schemas
    calls = _calls_rule(parser, tools, parallel, literal, lenient)
    close = f" {literal(parser.CLOSE)}" if parser.CLOSE else ""
    marker = literal(parser.MARKER)
    after = f" {literal(parser.AFTER_MARKER)}" if parser.AFTER_MARKER else ""
    if answer is not None:
        text_rule = f"text: %json {_schema_text(engine_schema(json.loads(answer.source), lenient or answer.lenient))}\n"
    elif parser.MARKER_OPTIONAL:  # a reply that opens with '{' is a call; any other reply is text
        text_rule = "text: TEXT\nTEXT: /(\\s*[^\\s{<](.|\\n)*)?/\n"
    else:
        text_rule = f"text: TEXT\nTEXT: /(.|\\n)*/ & ~/(.|\\n)*{_regex_escape(parser.MARKER)}(.|\\n)*/\n"
    if parser.MARKER_OPTIONAL:
        grammar = f"start: text | {marker}? calls{close}\n"
    elif answer is not None:
        grammar = f"start: text | {marker}{after} calls{close}\n"
    # a special token: text cannot contain it, so it alone opens the calls
    elif marker.startswith("<[") and " " not in marker:
        grammar = f"start: text | TEXT {marker}{after} calls{close}\n"
    else:
        grammar = f"start: text | head{after} calls{close}\nhead[lazy]: TEXT {marker}\n"
    return Structure(
        Constraint.lark(grammar + text_rule + calls),
        "",
        "",
        "tool calls the model opens are valid against the tools' schemas",
    )


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in "\\/.^$|?*+()[]{}-" else c for c in text)


def lark_literal(tokenizer):
    """literal(text) for a tokenizer: TEXT as a Lark expression, each special token in it as <[id]> (the tokenizer turns
    that text into the token, which a grammar cannot spell byte by byte) and the rest as quoted strings."""
    import re

    specials = {
        str(token): int(token_id)
        for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
        if getattr(token, "special", False)
    }
    split = (
        re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")
        if specials
        else None
    )

    def literal(text: str) -> str:
        parts = [p for p in split.split(text) if p] if split is not None else [text]
        return " ".join(f"<[{specials[p]}]>" if p in specials else json.dumps(p, ensure_ascii=False) for p in parts)

    return literal


def plan(
    state,
    tools: list[dict],
    choice: object,
    parallel: bool,
    answer: Constraint | None,
    answer_param: str,
    strict: bool = True,
) -> Structure:
    """The request's Structure, compiled now (on the request thread): a schema or tool the engine cannot use is a 400
    naming the field, before the request queues. answer_param: the field `answer` came from. strict: the request asked
    for exact adherence (OpenAI strict: true, Anthropic structured outputs, a tool marked strict); without it a schema
    keyword the engine does not implement is left unenforced and said so (Structure.relaxed), not refused."""
    from ..text.constraints import EngineUnavailable, GrammarError
    from .refusals import bad

    offered = bool(tools) and choice != "none"
    if offered and answer is not None and choice != "auto":
        raise bad(
            f"'{answer_param}' asks for a JSON reply, but tool_choice forces a tool call; give one or the other",
            answer_param,
        )
    if not offered and answer is None:
        return FREE
    param = "tools" if offered else answer_param

    def build(lenient: bool) -> Structure:
        if offered:
            return for_tools(state.builder.parser, tools, choice, parallel, state.lark_literal, answer, lenient)
        return Structure(answer.relaxed() if lenient else answer, enforced=f"the reply is {answer.describe()}")

    structure = build(False)
    try:
        state.generator.grammars.compile(structure.constraint)
        return structure
    except EngineUnavailable as exc:
        # constraining an auto reply's calls is a safeguard, not what it asked
        if offered and choice == "auto" and answer is None:
            state.notice_once("auto-tools-free", f"tool calls are parsed but not constrained: {exc}")
            return FREE
        raise bad(str(exc), param) from None
    except GrammarError as exc:
        if strict:
            raise bad(
                f"{exc} (strict adherence was asked for; without it the rest of the schema is enforced)", param
            ) from None
        reason = str(exc)
    structure = build(True)
    try:
        state.generator.grammars.compile(structure.constraint)
    except GrammarError as exc:
        raise bad(str(exc), param) from None
    state.notice_once(
        f"relaxed:{reason}", f"a schema was enforced without what the engine does not implement: {reason}"
    )
    return Structure(structure.constraint, structure.prefill, structure.closing, structure.enforced, reason)


RELAXED_HEADER = "x-rocketllm-schema-relaxed"


def relaxed_header(structure: Structure) -> dict:
    """The response header that says which part of a schema was not enforced (ASCII: header values are Latin-1)."""
    if not structure.relaxed:
        return {}
    return {RELAXED_HEADER: structure.relaxed.encode("ascii", "backslashreplace").decode("ascii")[:300]}
