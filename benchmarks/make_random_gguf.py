"""A random-weight Llama GGUF of a given shape and block type, for runs larger than RAM.

    python benchmarks/make_random_gguf.py OUT.gguf --like SmolLM2-135M-Instruct.Q4_1.gguf [--preset 2.5b] [--hidden 2560
    ...]

The tokenizer and every other metadata key come from the GGUF `--like` (its vocabulary sets the embedding's rows);
blocks are random but well formed (fp16 scales sized for weights of about 0.02, random codes), written one tensor at
a time by the gguf package's own writer (`rocketllm_cli.synthetic.gguf.write_llama_gguf`), so a file of several GB
needs one tensor's bytes in memory and never a float copy of the model.

Presets (any size flag given beside one wins):
- 2.5b: hidden 2560, 32 layers, FFN 6912, 32/8 heads, every weight Q4_0, a head of its own (SmolLM2's 49,152-token
  vocabulary: 2.47 B parameters, 1.39 GB);
- 2.8b: hidden 3072, 26 layers, FFN 8192, 24/8 heads, Q4_0 with a Q8_0 embedding tied to the head (1.64 GB), the file
  of docs/HARDWARE.md's larger-than-RAM rows.
Prints the file's size and parameter count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rocketllm_cli.sizes import format_bytes
from rocketllm_cli.synthetic.gguf import TYPES, write_llama_gguf

PRESETS = {
    "2.5b": {
        "hidden": 2560,
        "layers": 32,
        "intermediate": 6912,
        "heads": 32,
        "kv_heads": 8,
        "qtype": "Q4_0",
        "embed_type": "Q4_0",
        "output_type": "Q4_0",
    },
    "2.8b": {
        "hidden": 3072,
        "layers": 26,
        "intermediate": 8192,
        "heads": 24,
        "kv_heads": 8,
        "qtype": "Q4_0",
        "embed_type": "Q8_0",
        "output_type": None,
    },
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--like", type=Path, required=True, help="a Llama GGUF whose tokenizer and metadata to copy")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="2.5b")
    for name in ("hidden", "layers", "intermediate", "heads", "kv_heads"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int)
    parser.add_argument("--qtype", choices=TYPES, help="the layers' weights")
    parser.add_argument("--embed-type", choices=TYPES)
    parser.add_argument(
        "--output-type", choices=(*TYPES, "tied"), help="a head of its own in this type, or tied to the embedding"
    )
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = dict(PRESETS[args.preset])
    for name in (*shape, "output_type"):
        given = getattr(args, name, None)
        if given is not None:
            shape[name] = None if given == "tied" else given
    path = write_llama_gguf(args.out, args.like, seed=args.seed, context=args.context, **shape)
    print(
        f"{path}: {format_bytes(path.stat().st_size)} ({path.stat().st_size} bytes), {_parameters(path) / 1e9:.2f} B "
        f"parameters"
    )


def _parameters(path: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(path).tensors)


if __name__ == "__main__":
    main()
