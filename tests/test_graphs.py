"""The graphed resident decode (stream/graphs.py): where it applies, that the static cache it gives transformers keeps
the
tokens equal to plain transformers', that the ledger still counts one pass per forward with the pass hooks set aside,
and that a compile failure falls back to the eager step for good. CUDA graphs themselves run on a GPU only
(scripts/gpu_check.py); here the same plumbing runs eagerly on the CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rocketllm_cli.compat import dtype_kwargs
from rocketllm_cli.profiles.knobs.running import GRAPH_MIN_RUN_TOKENS
from rocketllm_cli.shard.sharder import shard
from rocketllm_cli.stream import graphs
from rocketllm_cli.stream.engineconfig import EngineConfig
from rocketllm_cli.stream.model import StreamingModel

PROMPT = torch.tensor([[1, 40, 57, 60, 71, 85, 90]])
NEW = 10
HUGE = 1 << 40


@pytest.fixture(scope="module")
def tiny_set(tiny_factory, tmp_path_factory):
    source = tiny_factory("llama")
    _, directory, _ = shard(source, out=tmp_path_factory.mktemp("graphs") / "set", log=lambda m: None)
    return source, directory


def greedy(model) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            PROMPT,
            attention_mask=torch.ones_like(PROMPT),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=3,
        )
    return out[0, PROMPT.shape[1] :].tolist()


def test_the_decode_graphs_apply_only_to_a_resident_model_on_a_cuda_gpu(tiny_set):
    _, directory = tiny_set
    with StreamingModel(directory, EngineConfig(device_cache_bytes=HUGE, decode_graphs="on")) as model:
        assert graphs.wanted(model) == "the compute device is not a CUDA GPU"
    with StreamingModel(directory, EngineConfig(device_cache_bytes=0, decode_graphs="on")) as model:
        model.device = torch.device("cuda")  # asked without touching a GPU: the streamed units decide
        assert "some units stream" in graphs.wanted(model)
    with StreamingModel(directory, EngineConfig(device_cache_bytes=HUGE)) as model:
        assert graphs.wanted(model) == "decode_graphs is off"


def test_a_static_cache_decode_equals_transformers_and_the_ledger_counts_every_pass(tiny_set, monkeypatch):
    source, directory = tiny_set
    plain = AutoModelForCausalLM.from_pretrained(source, **dtype_kwargs(torch.float32))
    expected = greedy(plain)
    with StreamingModel(directory, EngineConfig(device_cache_bytes=HUGE)) as model:
        eager = greedy(model)
        eager_steps = [(s.tokens, s.served) for s in model.ledger.steps]
    monkeypatch.setattr(graphs, "wanted", lambda streamed: "")  # the CPU stands in: transformers runs the step eagerly
    with StreamingModel(directory, EngineConfig(device_cache_bytes=HUGE, decode_graphs="on")) as model:
        hooks = len(model.model._forward_pre_hooks)
        first = greedy(model)
        ((key, cache),) = model.static_caches.items()
        assert key == (1, graphs.BUCKET)
        model.ledger.reset()  # the loop resets it per request; here the second call's passes alone are counted
        again = greedy(model)  # the same cache object, reset: a recorded graph reads the same addresses
        assert model.static_caches[key] is cache
        steps = [(s.tokens, s.served) for s in model.ledger.steps]
        assert len(model.model._forward_pre_hooks) == hooks  # the pass hooks are back after each call
    assert first == again == eager == expected
    assert steps == eager_steps and len(steps) == NEW and steps[0][0] == PROMPT.numel()


def test_a_failed_compile_falls_back_to_the_eager_step_for_good(tiny_set, monkeypatch):
    _, directory = tiny_set

    def broken(*args, **kwargs):
        def call(*a, **k):
            raise RuntimeError("no compiler here")

        return call

    monkeypatch.setattr(torch, "compile", broken)
    with StreamingModel(directory, EngineConfig(device_cache_bytes=HUGE, decode_graphs="on")) as model:
        guarded = graphs.GuardedCompile(model)
        with torch.inference_mode():
            out = guarded(input_ids=PROMPT)
        assert "no compiler here" in model.graphs_failed and out.logits.shape[:2] == PROMPT.shape
        assert "compiling the decode step failed once" in graphs.wanted(model) or graphs.wanted(model)


def test_the_knob_is_on_for_a_resident_gpu_server_and_a_long_run_only():
    from test_knob_edges import profile

    from rocketllm_cli.profiles import ModelFacts, resolve_knobs

    gpu = profile("cuda:0", 1e12, (1 << 40, 1 << 39), 1 << 40)
    model = ModelFacts.from_size(1e9, 16)
    assert resolve_knobs(gpu, model, env={}).value("decode_graphs") == "on"
    assert resolve_knobs(gpu, model, env={}, run_tokens=GRAPH_MIN_RUN_TOKENS - 1).value("decode_graphs") == "off"
    assert resolve_knobs(gpu, model, env={}, kwargs={"device_cache_bytes": 0}).value("decode_graphs") == "off"
    cpu = profile("cpu", 1e12, (1 << 40, 1 << 39))
    assert resolve_knobs(cpu, model, env={}).value("decode_graphs") == "off"
