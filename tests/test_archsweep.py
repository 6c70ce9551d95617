"""Every causal LM transformers ships streams equal to plain transformers, or is refused in one line.

The default run sweeps ARCHSWEEP_SAMPLE model types that rotate with the day of the year; `pytest -m archsweep`
sweeps them all (docs/ARCHITECTURES.md is the full sweep's record: `python tests/archsweep.py` writes it).
"""

from __future__ import annotations

import datetime
import json

import archsweep
import pytest
from archsweep import (
    BUGS,
    Result,
    causal_lm_types,
    markdown,
    read_document,
    run_type,
    sample,
)

from rocketllm_cli.errors import ModelError
from rocketllm_cli.shard.source import _load_config

ARCHSWEEP_SAMPLE = 8
TYPES = causal_lm_types()
TODAY = sample(TYPES, datetime.date.today().timetuple().tm_yday, ARCHSWEEP_SAMPLE)


def _check(model_type: str, tmp_path) -> None:
    result = run_type(model_type, tmp_path)
    assert result.outcome not in BUGS, f"{model_type}: {result.outcome}: {result.detail}"
    if result.outcome == "refused":
        assert result.detail and "\n" not in result.detail


@pytest.mark.parametrize("model_type", TODAY)
def test_todays_sample_streams_equal_or_is_refused(model_type, tmp_path):
    _check(model_type, tmp_path)


@pytest.mark.archsweep
@pytest.mark.parametrize("model_type", TYPES)
def test_every_type_streams_equal_or_is_refused(model_type, tmp_path):
    _check(model_type, tmp_path)


def test_sample_rotates_through_every_type():
    days = -(-len(TYPES) // ARCHSWEEP_SAMPLE)
    seen = {t for day in range(days) for t in sample(TYPES, day, ARCHSWEEP_SAMPLE)}
    assert seen == set(TYPES) and len(TODAY) == min(ARCHSWEEP_SAMPLE, len(TYPES))


def test_only_reruns_some_types_and_updates_their_rows_and_the_counts(tmp_path, monkeypatch):
    doc = tmp_path / "ARCHITECTURES.md"
    before = [
        Result("dbrx", "cannot run", "AttributeError: no rope_theta"),
        Result("gpt2", "equal"),
        Result("llama", "equal"),
    ]
    doc.write_text(markdown(before, "5.0", "2.0", 1860.0))
    monkeypatch.setattr(archsweep, "sweep", lambda types, seconds: [Result(t, "equal", "", 1.0) for t in types])
    archsweep.main(["--only", "dbrx", "--out", str(doc)])
    rows, seconds, rerun = read_document(doc)
    assert [(r.model_type, r.outcome) for r in rows.values()] == [
        ("dbrx", "equal"),
        ("gpt2", "equal"),
        ("llama", "equal"),
    ]
    assert seconds == 1860.0 and rerun == ["dbrx"]
    assert "**3 model types: 3 equal, 0 refused, 0 cannot run, 0 differs, 0 error**" in doc.read_text()
    with pytest.raises(SystemExit, match="no_such_type"):
        archsweep.main(["--only", "no_such_type", "--out", str(doc)])


LATER = {  # what a later transformers writes and this one cannot read: an unknown model type, or an unknown sub-config
    "model type": {"model_type": "no_such_model_type"},
    "sub-config": {"model_type": "llava", "text_config": {"model_type": "no_such_text_model"}},
}


@pytest.mark.compat
@pytest.mark.parametrize("case", LATER)
def test_a_config_from_a_later_transformers_names_the_version_to_install(case, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LATER[case], "transformers_version": "99.1.0"}))
    with pytest.raises(ModelError) as caught:
        _load_config(tmp_path)
    message = str(caught.value)
    assert "99.1.0" in message and "upgrade transformers" in message and "\n" not in message


@pytest.mark.compat
def test_an_unknown_model_type_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model_type"}))
    with pytest.raises(
        ModelError,
        match=r"^unsupported architecture 'no_such_model_type': transformers \S+ does not know",
    ):
        _load_config(tmp_path)
