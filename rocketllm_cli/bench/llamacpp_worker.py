"""The llama.cpp measurement, in a process of its own (bench/llamacpp.py runs this module with `python -m`).

llama-cpp-python's native code and its OpenMP runtime stay out of bench's process, so a crash there (a CPU feature
the build uses and the machine refuses) is a skipped row, not a lost bench. Standard library and llama_cpp only,
with our standard-library read counter (iocounts.py, the ledger's own rule): llama.cpp is measured as a user runs it,
with neither torch nor transformers loaded beside it.

stdin:  {"gguf", "n_ctx", "n_threads", "n_gpu_layers", "prompt_text", "prompt_tokens", "new_tokens", "extra_buffers"}
        (extra_buffers false: llama.cpp's extra buffer types off, its repacked weight copies among them)
stdout: {"skip": reason} or {"version", "start", "times", "marks"}: perf_counter before the prompt went in, after
        each generated token, and /proc/self/io read_bytes after each token.
"""

from __future__ import annotations

import json
import sys
import time

from rocketllm_cli.iocounts import storage_read_bytes


def measure(req: dict) -> dict:
    try:
        import llama_cpp
    except ImportError:
        return {"skip": "llama-cpp-python is not installed (pip install llama-cpp-python)"}
    if not req.get("extra_buffers", True) and not without_extra_buffers(llama_cpp):
        return {"skip": "this llama-cpp-python cannot turn its extra buffer types off (no llama_model_default_params)"}
    llm = llama_cpp.Llama(
        model_path=req["gguf"],
        n_ctx=req["n_ctx"],
        n_threads=req["n_threads"],
        n_threads_batch=req["n_threads"],
        n_gpu_layers=req["n_gpu_layers"],
        use_mmap=True,
        verbose=False,
    )
    ids = llm.tokenize(req["prompt_text"].encode("utf-8"), add_bos=False)
    if not ids:
        return {"skip": "llama.cpp encodes the fixed benchmark text to no tokens"}
    n = req["prompt_tokens"]
    prompt = (ids * (n // len(ids) + 1))[:n]  # the rule of timing.fixed_prompt, with the GGUF's own tokenizer
    times, marks = [], []
    start = time.perf_counter()
    steps = llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)  # greedy; never stops at EOS itself
    for _ in steps:
        times.append(time.perf_counter())
        marks.append(storage_read_bytes())
        if len(times) == req["new_tokens"]:
            break
    steps.close()
    if hasattr(llm, "close"):
        llm.close()
    return {"version": getattr(llama_cpp, "__version__", None), "start": start, "times": times, "marks": marks}


def without_extra_buffers(llama_cpp) -> bool:
    """Make every model this process loads use llama.cpp's plain CPU buffers (use_extra_bufts false): the Llama
    class takes its model parameters from llama_model_default_params of its low-level module."""
    low = getattr(getattr(llama_cpp, "llama", None), "llama_cpp", None)
    default = getattr(low, "llama_model_default_params", None)
    if default is None:
        return False

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
    return True


if __name__ == "__main__":
    answer = measure(json.loads(sys.stdin.read()))
    sys.stdout.write(json.dumps(answer) + "\n")
