"""What a generation's output must be, in words the engine compiles (text/grammar.py runs it): a JSON Schema, any JSON
object, a Lark grammar or a regular expression. Torch-free, so the command line reads and checks a schema before it
loads anything; llguidance is imported only to turn a constraint into the engine's grammar."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import RocketError

# Whitespace the JSON grammar allows between tokens: at most this many characters at each place JSON allows any, so a
# small model cannot spend its whole budget on newlines, yet pretty-printed output a few levels deep still fits.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,16}"


class GrammarError(RocketError):
    """A grammar or schema the engine cannot compile, or a tokenizer it cannot read. One line, names the problem."""


class EngineUnavailable(GrammarError):
    """The engine cannot work with this model at all (its tokenizer), whatever the grammar."""


@dataclass(frozen=True)
class Constraint:
    """What a generation's output must be. kind: json_schema | json_object | lark | regex; source: the schema as JSON
    text, the Lark grammar, or the regular expression."""

    kind: str
    source: str = ""
    lenient: bool = False  # a JSON Schema's keywords the engine does not implement are left unenforced, not refused

    @staticmethod
    def json_schema(schema: dict | bool, lenient: bool = False) -> Constraint:
        if schema is True or schema == {}:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError("a JSON Schema must be an object (or true)")
        return Constraint("json_schema", json.dumps(schema, sort_keys=False, ensure_ascii=False), lenient)

    def relaxed(self) -> Constraint:
        """The same constraint with the keywords the engine does not implement (not, uniqueItems, an unknown format ...)
        left unenforced: for a request that did not ask for strict adherence."""
        return Constraint(self.kind, self.source, True)

    @staticmethod
    def json_object() -> Constraint:
        return Constraint("json_object", json.dumps({"type": "object"}))

    @staticmethod
    def lark(grammar: str) -> Constraint:
        if not grammar.strip():
            raise GrammarError("the grammar is empty; give Lark rules with a 'start:' rule")
        return Constraint("lark", grammar)

    @staticmethod
    def regex(pattern: str) -> Constraint:
        return Constraint("regex", pattern)

    def engine_grammar(self) -> str:
        """The grammar as llguidance takes it (a JSON Schema gets bounded whitespace unless it says otherwise)."""
        import llguidance

        if self.kind in ("json_schema", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(engine_schema(json.loads(self.source), self.lenient))
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        raise GrammarError(f"unknown constraint kind {self.kind!r}")

    def describe(self) -> str:
        return {
            "json_schema": "a JSON Schema",
            "json_object": "a JSON object",
            "lark": "a Lark grammar",
            "regex": "a regular expression",
        }[self.kind]


# Keywords whose values are one subschema, or a map or list of them, that for_generation() walks into.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames", "additionalProperties")
_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "prefixItems")


def engine_schema(schema, lenient: bool = False):
    """A JSON Schema as the engine is given it: for_generation(), with bounded whitespace unless it sets its own (the
    x-guidance key), oneOf generated as anyOf (a reply matches at least one branch: exactly one where the branches
    exclude each other, as a discriminated union's do), and with `lenient` unimplemented keywords left unenforced."""
    schema = for_generation(schema)
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {
            "x-guidance": {
                "whitespace_pattern": JSON_WHITESPACE,
                "coerce_one_of": True,
                **({"lenient": True} if lenient else {}),
            },
            **schema,
        }
    return schema


SAFE_INTEGER = 2**53 - 1  # the integers every JSON reader holds exactly (RFC 8259, section 6)


def for_generation(schema):
    """SCHEMA as generation should read it; what is generated still validates against the schema as given.

    - No property it does not name: an object schema with `properties` and no word on others gets
      `additionalProperties: false` (xgrammar's strict mode does the same); a small model otherwise fills objects with
      keys nobody asked for. allOf branches are left open: closing one would refuse the properties another names.
    - Numbers within +-(2^53 - 1) where the schema sets no bound: a model repeating a digit ends at 16 digits, not at
      max_tokens with the reply cut."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and not any(
        k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")
    ):
        out["additionalProperties"] = False
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "integer" in kinds or "number" in kinds:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = for_generation(out[key])
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: for_generation(sub) for name, sub in out[key].items()}
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [for_generation(sub) for sub in out[key]]
    return out


def from_flags(json_schema: str | None, grammar: str | None) -> Constraint | None:
    """The constraint `--json-schema SCHEMA` (inline JSON or a file) or `--grammar FILE` (Lark rules) ask for."""
    from pathlib import Path

    if json_schema is not None and grammar is not None:
        raise GrammarError("give --json-schema or --grammar, not both")
    if json_schema is not None:
        return Constraint.json_schema(json_schema_of(json_schema))
    if grammar is None:
        return None
    path = Path(grammar).expanduser()
    if not path.is_file():
        raise GrammarError(f"--grammar {grammar}: no such file; give a file of Lark rules with a 'start:' rule")
    try:
        return Constraint.lark(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise GrammarError(
            f"--grammar {grammar} is not UTF-8 text (byte {exc.start}); give a file of Lark rules"
        ) from None


def json_schema_of(text_or_path: str) -> dict:
    """A JSON Schema given on a command line: inline JSON, or the path of a file holding it."""
    from pathlib import Path

    text = text_or_path
    if not text_or_path.lstrip().startswith(("{", "true")):
        path = Path(text_or_path).expanduser()
        if not path.is_file():
            raise GrammarError(
                f"--json-schema {text_or_path}: neither inline JSON nor a file; give a schema as JSON "
                f"or a file holding one"
            )
        text = path.read_text(encoding="utf-8")
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise GrammarError(
            f"the JSON Schema is not valid JSON ({exc}); fix it or give a file holding valid JSON"
        ) from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("the JSON Schema must be a JSON object")
    return schema
