"""llama.cpp's decode speed on a GGUF, alone in its process: what `with-ram LIMIT -- ...` measures beside RocketLLM.

    python benchmarks/llamacpp_decode.py MODEL.gguf [--tokens 8] [--threads 2] [--no-repack]

Loads the file with mmap (llama-cpp-python), evaluates a 16-token prompt, then times one token at a time, greedy,
after one warm-up token, and prints the median, min and max ms/token. --no-repack turns off llama.cpp's extra
buffer types (its repacked weight copies are anonymous memory, so under a memory limit smaller than the model the
default is killed). Needs `pip install llama-cpp-python`; not part of RocketLLM or its tests.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-repack", action="store_true")
    args = parser.parse_args()

    import llama_cpp
    import llama_cpp.llama as module

    if args.no_repack:
        default = llama_cpp.llama_model_default_params

        def without_extra_buffers():
            params = default()
            params.use_extra_bufts = False
            return params

        module.llama_cpp.llama_model_default_params = without_extra_buffers
    started = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=args.model, n_ctx=256, n_threads=args.threads, n_gpu_layers=0, verbose=False, use_mmap=True
    )
    load = time.perf_counter() - started
    prompt = (llm.tokenize(b"The capital of France is") * 4)[:16]
    started = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - started
    times = []
    for _ in range(args.tokens + 1):
        token = llm.sample(top_k=1)
        started = time.perf_counter()
        llm.eval([token])
        times.append(time.perf_counter() - started)
    decode = sorted(times[1:])
    print(
        f"llama.cpp: load {load:.2f} s, prefill of 16 tokens {prefill * 1e3:.0f} ms, decode median "
        f"{decode[len(decode) // 2] * 1e3:.1f} ms/token (min {decode[0] * 1e3:.1f}, max {decode[-1] * 1e3:.1f}), "
        f"{args.tokens} tokens"
    )


if __name__ == "__main__":
    main()
