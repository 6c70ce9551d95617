"""lm-evaluation-harness against `rocketllm serve`: its `local-completions` backend (loglikelihood through
/v1/completions
with echo and logprobs, its remote tokenizer through /tokenizer_info and /tokenize) beside its own `hf` backend on the
same weights, per choice of a multiple-choice task built from local data (benchmarks/lm_eval/facts.jsonl, 20 questions).

    pip install lm-eval                                   # in a venv that already has this project's torch
    rocketllm shard HF_DIR --out SET --dtype fp32 --quantize none
    rocketllm serve SET --port 8000 --dtype fp32 &
    python benchmarks/lm_eval_compare.py --base-url http://127.0.0.1:8000 --model SET_NAME --hf HF_DIR [--dtype float32]

HF_DIR is a transformers model directory; the shard set must hold the same weights (a float set of it), so the two
backends differ only in how they compute. Prints each choice's loglikelihood both ways, the largest difference in
nats, and accuracy both ways, as Markdown.
"""

from __future__ import annotations

import argparse
from pathlib import Path

TASK = "rocketllm_facts"
TASK_DIR = Path(__file__).parent / "lm_eval"  # rocketllm_facts.yaml and its data, facts.jsonl


def run(model: str, model_args: str) -> tuple[list[list[float]], float]:
    """(each question's choice loglikelihoods, accuracy) from one backend."""
    import os

    import lm_eval
    from lm_eval.tasks import TaskManager

    here = os.getcwd()
    os.chdir(TASK_DIR)  # the task's data file is named relative to the working directory
    try:
        result = lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=[TASK],
            task_manager=TaskManager(include_path=str(TASK_DIR)),
            log_samples=True,
            batch_size=1,
        )
    finally:
        os.chdir(here)
    samples = sorted(result["samples"][TASK], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples], float(result["results"][TASK]["acc,none"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the rocketllm serve, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the served model id")
    parser.add_argument("--hf", required=True, help="the same weights as a transformers model directory")
    parser.add_argument("--dtype", default="float32", help="the hf backend's dtype (match the server's --dtype)")
    args = parser.parse_args()
    served, served_acc = run(
        "local-completions",
        f"model={args.model},base_url={args.base_url.rstrip('/')}/v1/completions,"
        "tokenizer_backend=remote,tokenized_requests=True,num_concurrent=1,max_retries=1",
    )
    local, local_acc = run("hf", f"pretrained={args.hf},dtype={args.dtype},device=cpu")
    worst = max(abs(a - b) for s, h in zip(served, local) for a, b in zip(s, h))
    print("| question | choice | local-completions (rocketllm serve) | hf | difference |\n|---|---|---|---|---|")
    for q, (s, h) in enumerate(zip(served, local)):
        for c, (a, b) in enumerate(zip(s, h)):
            print(f"| {q} | {c} | {a:.6f} | {b:.6f} | {abs(a - b):.2e} |")
    print(
        f"\nlargest difference {worst:.2e} nats over {sum(map(len, served))} choices; "
        f"accuracy {served_acc:.3f} (local-completions) vs {local_acc:.3f} (hf); hf dtype {args.dtype}"
    )


if __name__ == "__main__":
    main()
