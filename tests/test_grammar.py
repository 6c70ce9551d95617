"""Constrained decoding in the one generation loop, on a tiny random model whose tokens are noise: whatever it picks,
the grammar's mask must leave only valid output. For schemas a generator makes (bounded, so every reply can end),
greedy and sampled replies parse and validate, every layer streamed from storage and every unit resident alike, in a
batch beside a free row (which stays token for token what it is alone), with speculative decoding on (greedy tokens
equal speculation off), and after a prefix restored from the cache. The engine compiles a schema once, refuses what
it cannot compile in one line, and the loop hands the mask the token of each step before the next forward pass."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocketllm_cli.auto import AutoModel
from rocketllm_cli.errors import ParameterError
from rocketllm_cli.text.constraints import SAFE_INTEGER, Constraint, GrammarError, for_generation
from rocketllm_cli.text.grammar import GrammarMask
from rocketllm_cli.text.loop import GenerationRequest, Generator
from rocketllm_cli.text.prefix import PrefixCache
from rocketllm_cli.text.sampling import SamplingParams

SEED = 61  # this module's own tiny model
EVERYTHING = 1 << 40
BUDGET = 800  # tokens: more than any bounded schema below needs, whitespace runs and escapes included

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def source(tiny_factory):
    return tiny_factory("llama", seed=SEED)


@pytest.fixture(scope="module")
def streamed(source):
    model = AutoModel.from_pretrained(source, device_cache_bytes=0, host_cache_bytes=0)
    yield model
    model.close()


@pytest.fixture(scope="module")
def resident(source):
    model = AutoModel.from_pretrained(source, device_cache_bytes=EVERYTHING)
    yield model
    model.close()


@pytest.fixture(scope="module")
def prompt(streamed):
    return streamed.tokenizer("Give me a JSON value: ").input_ids


def run(model, ids, constraint, params=SamplingParams(max_new_tokens=BUDGET), **generator):
    return Generator(model, **generator).run(GenerationRequest(list(ids), params, constraint=constraint))


def valid(outcome, schema) -> object:
    assert outcome.finish_reason == "stop", f"the reply did not end within {BUDGET} tokens: {outcome.text[:200]!r}"
    value = json.loads(outcome.text)
    jsonschema.validate(value, schema)
    return value


# -- a generator of bounded schemas ------------------------------------------------------------------
NAMES = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
        st.integers(-1000, 1000),
        st.integers(0, 2000),
    ),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(
        lambda values: {"enum": values},
        st.lists(
            st.one_of(st.text(alphabet="xyz é\"", min_size=1, max_size=4), st.integers(-9, 9), st.booleans()),
            min_size=1,
            max_size=4,
            unique=True,
        ),
    ),
    st.sampled_from(
        [{"type": "string", "pattern": "^[a-z]{1,4}$"}, {"type": "string", "pattern": "^[0-9]{2,3}-[A-Z]$"}]
    ),
)


def _object(props: dict, required_mask: list[bool]) -> dict:
    names = list(props)
    return {"type": "object", "properties": props, "required": [n for n, keep in zip(names, required_mask) if keep]}


SCHEMAS = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
                lambda mask: _object(props, mask)
            )
        ),
        st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, children, st.integers(0, 3)),
        st.builds(lambda options: {"anyOf": options}, st.lists(children, min_size=2, max_size=3)),
    ),
    max_leaves=5,
)

PROPERTY = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@PROPERTY
@given(schema=SCHEMAS)
def test_greedy_and_sampled_replies_of_generated_schemas_parse_and_validate(streamed, prompt, schema):
    constraint = Constraint.json_schema(schema)
    greedy = run(streamed, prompt, constraint, speculate="off")
    valid(greedy, schema)
    valid(
        run(
            streamed,
            prompt,
            constraint,
            SamplingParams(max_new_tokens=BUDGET, temperature=1.0, seed=3),
            speculate="off",
        ),
        schema,
    )
    drafted = run(streamed, prompt, constraint, speculate="prompt-lookup")  # drafted tokens checked by the matcher
    assert drafted.token_ids == greedy.token_ids


@PROPERTY
@given(schema=SCHEMAS)
def test_a_batch_masks_each_row_by_its_own_schema_and_leaves_a_free_row_as_it_is(resident, prompt, schema):
    generator = Generator(resident, speculate="off")
    params = SamplingParams(max_new_tokens=BUDGET)
    free_alone = generator.run(GenerationRequest(list(prompt), SamplingParams(max_new_tokens=12)))
    rows = generator.run_batch(
        [
            GenerationRequest(list(prompt), params, constraint=Constraint.json_schema(schema)),
            GenerationRequest(list(prompt), params, constraint=Constraint.json_schema(PERSON)),
            GenerationRequest(list(prompt), params),
        ]
    )
    valid(rows[0], schema)
    valid(rows[1], PERSON)
    assert rows[2].token_ids[:12] == free_alone.token_ids  # its scores were never touched


@pytest.mark.parametrize("regime", ["streamed", "resident"])
def test_streamed_and_resident_give_the_same_constrained_tokens(streamed, resident, prompt, regime):
    model = streamed if regime == "streamed" else resident
    got = run(model, prompt, Constraint.json_schema(PERSON), speculate="off")
    valid(got, PERSON)
    other = run(resident if regime == "streamed" else streamed, prompt, Constraint.json_schema(PERSON), speculate="off")
    assert got.token_ids == other.token_ids


@pytest.mark.parametrize("mode", ["prompt-lookup", "draft"])
def test_speculation_under_a_grammar_keeps_greedy_tokens_and_validity(streamed, resident, prompt, mode):
    """Drafted tokens pass through the mask: the verification rejects any the grammar refuses, and the matcher rolls
    back."""
    constraint = Constraint.json_schema(PERSON)
    plain = run(streamed, prompt, constraint, speculate="off")
    extra = {"draft_model": resident} if mode == "draft" else {}
    fast = run(streamed, prompt, constraint, speculate=mode, **extra)
    assert fast.stats.speculation["mode"] == mode and fast.stats.speculation["proposed"] > 0
    assert fast.token_ids == plain.token_ids
    valid(fast, PERSON)
    sampled = run(
        streamed,
        prompt,
        constraint,
        SamplingParams(max_new_tokens=BUDGET, temperature=0.9, seed=11),
        speculate=mode,
        **extra,
    )
    valid(sampled, PERSON)


def test_a_constrained_reply_after_a_prefix_from_the_cache(resident, prompt):
    cache = PrefixCache(1 << 30)
    generator = Generator(resident, cache, speculate="off")
    long = list(prompt) * 4  # 16-token blocks are cached; the prompt must span some
    free = generator.run(GenerationRequest(long, SamplingParams(max_new_tokens=8)))
    again = generator.run(
        GenerationRequest(long, SamplingParams(max_new_tokens=BUDGET), constraint=Constraint.json_schema(PERSON))
    )
    assert free.reused_tokens == 0 and again.reused_tokens > 0
    assert (
        again.token_ids
        == Generator(resident, speculate="off")
        .run(GenerationRequest(long, SamplingParams(max_new_tokens=BUDGET), constraint=Constraint.json_schema(PERSON)))
        .token_ids
    )
    valid(again, PERSON)


def test_json_object_lark_and_regex_constraints(resident, prompt):
    value = json.loads(run(resident, prompt, Constraint.json_object(), speculate="off").text)
    assert isinstance(value, dict)
    lark = run(
        resident, prompt, Constraint.lark('start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,3}/'), speculate="off"
    )
    assert lark.text in ("yes", "no") or (lark.text.startswith("maybe ") and lark.text[6:].isdigit())
    regex = run(resident, prompt, Constraint.regex(r"[A-Z][a-z]{2,5}-[0-9]{2}"), speculate="off")
    assert (
        regex.finish_reason == "stop"
        and len(regex.text) in range(6, 10)
        and regex.text[0].isupper()
        and regex.text[-2:].isdigit()
    )


def test_the_engine_compiles_a_schema_once_and_each_row_gets_a_matcher_of_its_own(resident, prompt):
    generator = Generator(resident, speculate="off")
    grammars = generator.grammars
    one = Constraint.json_schema(PERSON)
    generator.run_batch([GenerationRequest(list(prompt), SamplingParams(max_new_tokens=BUDGET), constraint=one)] * 3)
    assert grammars.compiles == 1 and grammars.hits >= 2
    generator.run(
        GenerationRequest(
            list(prompt), SamplingParams(max_new_tokens=BUDGET), constraint=Constraint.json_schema(dict(PERSON))
        )
    )
    assert grammars.compiles == 1  # the same schema again: the cached grammar


def test_the_next_mask_is_computed_from_the_token_the_streamer_saw(resident, prompt, monkeypatch):
    """A plain step's token goes to the mask before the next forward pass, so the call during that pass finds it
    consumed."""
    seen = {"advanced": 0, "followed_in_call": 0}
    advance, follow_calls = GrammarMask.advance, []  # follow_calls: whether each call found a row behind the ids
    monkeypatch.setattr(
        GrammarMask,
        "advance",
        lambda self, tokens: (seen.__setitem__("advanced", seen["advanced"] + 1), advance(self, tokens))[1],
    )
    original_call = GrammarMask.__call__

    def call(self, input_ids, scores):
        self._wait()  # the grammar thread's work for the last step
        behind = [
            row is not None and input_ids[b, self.width :].tolist() != row.consumed for b, row in enumerate(self.rows)
        ]
        follow_calls.append(any(behind))
        return original_call(self, input_ids, scores)

    monkeypatch.setattr(GrammarMask, "__call__", call)
    out = run(resident, prompt, Constraint.json_schema(PERSON), speculate="off")
    assert out.new_tokens > 3 and seen["advanced"] == out.new_tokens
    assert len(follow_calls) == out.new_tokens and not any(follow_calls)  # every call found the matcher already in step


def test_a_schema_the_engine_cannot_use_is_one_line_naming_the_problem(resident):
    grammars = Generator(resident).grammars
    with pytest.raises(GrammarError) as err:
        grammars.compile(Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}))
    assert "\n" not in str(err.value) and "JSON Schema" in str(err.value) and "missing" in str(err.value)
    with pytest.raises(GrammarError, match="Lark grammar"):
        grammars.compile(Constraint.lark("start: undefined_rule"))
    with pytest.raises(GrammarError, match="empty"):
        Constraint.lark("  ")


def test_generation_refuses_unnamed_properties_and_bounds_numbers_but_leaves_all_of_branches_open():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": ["integer", "null"], "minimum": 0}}}},
        "$defs": {"D": {"properties": {"x": {}}}},
        "allOf": [{"properties": {"y": {}}}],
        "anyOf": [{"properties": {"z": {"type": "number", "exclusiveMaximum": 1}}, "additionalProperties": True}],
    }
    out = for_generation(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in out["allOf"][0] and out["anyOf"][0]["additionalProperties"] is True
    assert out["properties"]["a"]["properties"]["b"] == {
        "type": ["integer", "null"],
        "minimum": 0,
        "maximum": SAFE_INTEGER,
    }
    assert out["anyOf"][0]["properties"]["z"] == {"type": "number", "exclusiveMaximum": 1, "minimum": -SAFE_INTEGER}
    # as it came
    assert "additionalProperties" not in schema and "maximum" not in schema["properties"]["a"]["properties"]["b"]


def test_a_repeated_digit_ends_within_the_safe_integers(resident):
    """A bounded integer: the engine refuses a 17th digit, so a looping model must close the number."""
    grammars = Generator(resident).grammars
    tokenizer = resident.tokenizer
    for kind in ("integer", "number"):
        matcher = grammars.matcher(Constraint.json_schema({"type": kind}))
        assert matcher.validate_tokens(tokenizer("1" * 16, add_special_tokens=False).input_ids) == 16
        assert matcher.validate_tokens(tokenizer("1" * 17, add_special_tokens=False).input_ids) == 16
    number = grammars.matcher(Constraint.json_schema({"type": "number"}))
    ids = tokenizer("-3.14159", add_special_tokens=False).input_ids
    assert number.validate_tokens(ids) == len(ids)


# -- the command line and the Python API --------------------------------------------------------------
def cli(*args, input: str | None = None):
    from typer.testing import CliRunner

    from rocketllm_cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def test_generate_json_schema_and_grammar_flags(source, tmp_path):
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(PERSON))
    for schema_arg in (schema_file, json.dumps(PERSON)):
        result = cli(
            "generate", source, "A person:", "--raw", "-n", BUDGET, "--json-schema", schema_arg, "--speculate", "off"
        )
        assert result.exit_code == 0, result.stderr
        jsonschema.validate(json.loads(result.stdout), PERSON)
    lark = tmp_path / "answer.lark"
    lark.write_text('start: "yes" | "no"\n')
    result = cli("generate", source, "Yes or no?", "--raw", "-n", 8, "--grammar", lark, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["text"] in ("yes", "no"), result.output
    batch = cli(
        "generate", source, "--raw", "-n", BUDGET, "--batch", "--json", "--json-schema", schema_file, input="one\ntwo\n"
    )
    assert batch.exit_code == 0, batch.stderr
    for row in json.loads(batch.stdout)["results"]:
        jsonschema.validate(json.loads(row["text"]), PERSON)


@pytest.mark.parametrize(
    "args, words",
    [
        (("--json-schema", "{not json"), "the JSON Schema is not valid JSON"),
        (("--json-schema", "missing-file.json"), "neither inline JSON nor a file"),
        (("--json-schema", '{"$ref": "#/nowhere"}'), "JSON Schema the engine cannot use"),
        (("--grammar", "missing.lark"), "--grammar missing.lark: no such file"),
        (("--json-schema", "{}", "--grammar", "x.lark"), "give --json-schema or --grammar, not both"),
        (("--grammar", "x.lark", "--server", "http://127.0.0.1:9"), "--grammar goes with a model loaded here"),
    ],
)
def test_bad_constraint_flags_are_one_line_errors(source, tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.lark").write_text('start: "x"\n')
    result = cli("generate", source, "hi", *args)
    assert result.exit_code == 1 and words in result.stderr and len(result.stderr.strip().splitlines()) == 1, (
        result.stderr
    )


def test_the_python_api_takes_json_schema_and_grammar(resident, prompt):
    import torch

    ids = torch.tensor([prompt, prompt])
    out = resident.generate(ids, max_new_tokens=BUDGET, do_sample=False, json_schema=PERSON)
    for row in out[:, ids.shape[1] :]:
        jsonschema.validate(json.loads(resident.tokenizer.decode(row, skip_special_tokens=True)), PERSON)
    yes_no = resident.generate(ids[:1], max_new_tokens=8, do_sample=False, grammar='start: "yes" | "no"')
    assert resident.tokenizer.decode(yes_no[0, ids.shape[1] :], skip_special_tokens=True) in ("yes", "no")
    with pytest.raises(ParameterError, match="not both"):
        resident.generate(ids, max_new_tokens=2, json_schema=PERSON, grammar="start: x")


def test_bench_json_schema_times_constrained_and_free_replies_of_the_same_length(source, tmp_path):
    schema = tmp_path / "list.json"
    schema.write_text(json.dumps({"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 8}))
    result = cli("bench", source, "--json-schema", schema, "--regime", "resident", "--tokens", 8, "--json")
    assert result.exit_code == 0, result.stderr
    run = json.loads(result.stdout)["runs"][0]
    # 1 + warm-up + 8: cut
    assert run["status"] == "measured" and len(run["tokens"]) == 3 and all(t == 10 for t in run["tokens"])
    assert (
        run["constrained_ms"] > 0
        and run["free_ms"] > 0
        and run["overhead"] == round(run["constrained_ms"] / run["free_ms"] - 1, 4)
    )
    assert run["blocking_ms_per_mask"] >= 0
    text = cli("bench", source, "--json-schema", schema, "--regime", "resident", "--tokens", 8)
    assert "| resident | 10, 10, 10 |" in text.stdout and "ms/token with the schema" in text.stdout
