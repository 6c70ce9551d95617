"""lm-evaluation-harness against serve, as its users run it: `local-completions` (loglikelihood through
/v1/completions with echo and logprobs 1, its remote tokenizer through /tokenizer_info and /tokenize) on a
multiple-choice task from local data (benchmarks/lm_eval/), compared per choice with its own `hf` backend on the same
weights: a tiny random Llama in fp32, served every unit resident. benchmarks/lm_eval_compare.py runs the same on
SmolLM2."""

from __future__ import annotations

from pathlib import Path

from serve_helpers import LiveServer

from rocketllm_cli.auto import AutoModel

TASK = "rocketllm_facts"
TASK_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "lm_eval"
NATS = 1e-3


def evaluate(model: str, model_args: str, monkeypatch) -> tuple[list[list[float]], float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASK_DIR)  # the task names its data file relative to the working directory
    result = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASK_DIR)),
        log_samples=True,
        batch_size=1,
    )
    samples = sorted(result["samples"][TASK], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples], float(result["results"][TASK]["acc,none"])


def test_local_completions_loglikelihoods_equal_the_hf_backends(tiny_factory, monkeypatch):
    source = tiny_factory("llama", seed=89)
    model = AutoModel.from_pretrained(source, device_cache_bytes="1GB", compute_dtype="fp32")
    try:
        with LiveServer(model, "tiny") as server:
            served, served_acc = evaluate(
                "local-completions",
                f"model=tiny,base_url={server.url}/v1/completions,tokenizer_backend=remote,"
                "tokenized_requests=True,num_concurrent=1,max_retries=1",
                monkeypatch,
            )
            assert any(h["endpoint"] == "/v1/completions" for h in server.history)
    finally:
        model.close()
    local, local_acc = evaluate("hf", f"pretrained={source},dtype=float32,device=cpu", monkeypatch)
    assert len(served) == len(local) == 20 and all(len(s) == 4 for s in served)
    worst = max(abs(a - b) for s, h in zip(served, local) for a, b in zip(s, h))
    assert worst < NATS, worst
    assert served_acc == local_acc
