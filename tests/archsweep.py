"""The architecture sweep: every causal-LM model type of the installed transformers, tiny, streamed, compared.

For each model type: a tiny config (size fields shrunk by name, generically; OVERRIDES only where a config needs
more), a random model built and run by plain transformers on CPU (fp32, greedy), written with save_pretrained,
sharded, streamed with nothing resident and all resident, and compared with plain transformers token for token
(and logit for logit on the prompt). Each type gets one outcome:

    equal       every streamed run matches plain transformers
    refused     the project refuses it, in one line that names what is missing
    cannot run  plain transformers cannot build, run or save it on CPU (not the project's to fix)
    differs     a streamed run gives other tokens or logits (a bug)
    error       the project crashed with something other than its one-line refusal (a bug)

    python tests/archsweep.py                      # every type, ARCHITECTURES.md written to docs/
    python tests/archsweep.py llama gemma3n_text   # some types, the table printed
    python tests/archsweep.py --only dbrx xlstm    # re-run some types, their rows and the counts updated in the
    document
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

OUTCOMES = ("equal", "refused", "cannot run", "differs", "error")
BUGS = ("differs", "error")
PROMPT_LENGTH = 6
NEW_TOKENS = 4
VOCAB = 512
TYPE_SECONDS = 240  # one type in a subprocess of the full sweep; a hang is recorded as "cannot run"
DOC = Path(__file__).resolve().parent.parent / "docs" / "ARCHITECTURES.md"

# Size fields by name: shrunk to these wherever they are larger (or unset), in the config and every sub-config.
_SIZES = {
    64: (
        "hidden_size",
        "n_embd",
        "d_model",
        "embed_dim",
        "n_embed",
        "model_dim",
        "dim",
        "word_embed_proj_dim",
        "embedding_size",
        "d_embed",
        "hidden_dim",
        "hidden_size_global",
        "adapter_in_dim",
        "adapter_out_dim",
        "adapter_input_size",
        "projection_dim",
        "text_hidden_size",
        "vision_hidden_size",
        "audio_hidden_size",
        "embedding_dim",
        "emb_dim",
    ),
    128: (
        "intermediate_size",
        "ffn_dim",
        "n_inner",
        "d_ff",
        "ffn_hidden_size",
        "decoder_ffn_dim",
        "encoder_ffn_dim",
        "dense_intermediate_size",
        "mlp_dim",
        "inner_hidden_size",
    ),
    32: (
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "expert_intermediate_size",
        "moe_ffn_hidden_size",
        "expert_ffn_hidden_size",
        "kv_lora_rank",
        "q_lora_rank",
        "moe_shared_expert_intermediate_size",
        "shared_intermediate_size",
    ),
    16: (
        "head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "attention_head_dim",
        "kv_channels",
        "d_head",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "ssm_state_size",
        "state_size",
        "d_state",
        "mamba_d_state",
        "mamba_d_head",
        "time_step_rank",
        "global_head_dim",
        "linear_head_dim",
        "swa_head_dim",
    ),
    8: ("qk_rope_head_dim", "rope_head_dim", "rotary_dim"),
    4: (
        "num_attention_heads",
        "n_head",
        "num_heads",
        "n_heads",
        "decoder_attention_heads",
        "encoder_attention_heads",
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
        "moe_num_experts",
        "linear_num_value_heads",
        "linear_num_heads",
        "mamba_n_heads",
    ),
    2: (
        "num_key_value_heads",
        "n_kv_heads",
        "num_kv_heads",
        "multi_query_group_num",
        "num_experts_per_tok",
        "moe_topk",
        "top_k",
        "num_experts_per_token",
        "moe_k",
        "zero_expert_num",
        "linear_num_key_heads",
        "n_group",
        "mamba_n_groups",
        "n_groups",
        "num_kv_shared_layers",
    ),
    1: (
        "n_shared_experts",
        "num_shared_experts",
        "num_expert_group",
        "topk_group",
        "first_k_dense_replace",
        "moe_layer_start_index",
    ),
    VOCAB: ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length"),
}
SHRINK = {name: size for size, names in _SIZES.items() for name in names}
LAYERS = 4  # every layer count (decoder, encoder, hidden): they must agree where a model builds one cache for both
_LAYER_COUNTS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "num_blocks",
    "decoder_layers",
    "num_decoder_layers",
    "encoder_layers",
    "num_encoder_layers",
)

# Qwen4-Exp's indexed-attention layers need the token indexer's settings, which its default config leaves unset.
_QSA = {
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
}
# dots3's sliding-window layers take their own attention sizes from swa_* arguments, which no config field shows:
# as many KV heads as heads, and a head of nope + rope dimensions.
_DOTS3 = {
    "num_key_value_heads": 4,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 4,
    "swa_q_lora_rank": 32,
    "swa_kv_lora_rank": 32,
    "swa_head_dim": 24,
    "swa_qk_nope_head_dim": 16,
    "swa_v_head_dim": 16,
}
# Only where the generic shrink leaves a config transformers refuses: model type -> config kwargs.
OVERRIDES: dict[str, dict] = {
    "bamba": {"mamba_d_head": 32, "attn_layer_indices": [1, 3]},  # mamba heads x head size = expand x hidden
    # default: no attention
    "granitemoehybrid": {"mamba_d_head": 32, "layer_types": ["linear_attention", "attention"] * (LAYERS // 2)},
    "mamba2": {"head_dim": 32},
    # Rotary settings per layer type, as its checkpoints' configs give them (the default's one setting is not read).
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 50000.0}}},
    # read there unconditionally; DBRX's config.json sets both
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8}},
    # else 42 layers' pyramid
    "dots3_note": {"text_config": _DOTS3, "vision_config": {"mlp_layer_types": ["dense", "sparse"] * (LAYERS // 2)}},
    "dots3_note_text": _DOTS3,
    # One codebook, so a prompt is one row of ids; generation starts from a token of its own, as MusicGen's config sets.
    "musicgen": {"decoder": {"num_codebooks": 1, "decoder_start_token_id": VOCAB - 2}},
    "musicgen_melody": {"decoder": {"num_codebooks": 1, "decoder_start_token_id": VOCAB - 2}},
    "gpt_neo": {"attention_types": [[["global", "local"], LAYERS // 2]]},  # one entry per layer
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "gemma4_assistant": {
        "text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "num_kv_shared_layers": 0}
    },  # 0: the config shares every layer, as it must
    "gemma4_unified_assistant": {"text_config": {"num_kv_shared_layers": 0}},  # 0: the config shares every layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "qwen4_exp": {"text_config": _QSA},
    "qwen4_exp_text": _QSA,
    "reformer": {"is_decoder": True, "axial_pos_shape": [16, 32], "axial_pos_embds_dim": [32, 32]},
    "xlstm": {"qk_dim_factor": 1.0},  # the cache rounds hidden x factor up to a multiple of 64, the projections do not
    "xmod": {"default_language": "en_XX"},
    # a shared block used twice
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"]},
}


# Why plain transformers cannot run a type, where its error alone does not say: put before that error in the row.
# Each was checked with a config consistent by the model's own rules (see OVERRIDES).
CANNOT_RUN = {
    "blt": "generate builds its cache from BltConfig, which has no num_hidden_layers (the layer counts live in its "
    "patcher, encoder, decoder and global sub-configs), with the default config too",
    "gemma3n": "its vision tower is a TimmWrapperModel, which needs the timm and Pillow packages (absent where this "
    "record was made); gemma3n_text, the same text model, streams equal",
    "gemma4_assistant": "a speculative-decoding drafter: its forward needs the target model's embeddings and shared KV "
    "states, so it does not run as a causal LM of its own",
    "gemma4_unified_assistant": "a speculative-decoding drafter: its forward needs the target model's embeddings and "
    "shared KV states, so it does not run as a causal LM of its own",
}


@dataclass
class Result:
    model_type: str
    outcome: str
    detail: str = ""
    seconds: float = 0.0


def causal_lm_types() -> list[str]:
    """Every model type the installed transformers builds a causal LM for."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sample(types: list[str], day: int, size: int = 8) -> list[str]:
    """`size` types that rotate with the day of the year: every type comes round within len(types) / size days."""
    start = (day * size) % len(types)
    return [types[(start + i) % len(types)] for i in range(min(size, len(types)))]


def tiny_configs(model_type: str) -> list:
    """Tiny configs of MODEL_TYPE, every size field shrunk (sub-configs too), then OVERRIDES; token ids inside the
    vocab.

    Per-layer settings (layer types, sparsity per layer, indices of the attention layers ...) come three ways, tried
    in turn by the sweep until plain transformers runs one: derived by the config from the layer count; the first
    layers' settings; settings sampled evenly through the stack (where the first layers are all of one kind)."""
    from transformers import AutoConfig

    overrides = OVERRIDES.get(model_type, {})
    try:
        default = AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 - some defaults validate only with their overrides
        default = AutoConfig.for_model(model_type, **overrides)
    configs, seen = [], []
    for picks in (None, "first", "sampled"):
        kwargs = _merged(_shrunk(default, full=False, picks=picks), overrides)
        if kwargs not in seen:
            seen.append(kwargs)
            try:
                configs.append(AutoConfig.for_model(model_type, **kwargs))
            except Exception as exc:  # noqa: BLE001 - this way of cutting the layers does not validate
                if picks == "sampled" and not configs:
                    raise exc from None
    return configs + [sub for config in configs if (sub := _declared_sub_config(config)) is not None]


def _declared_sub_config(config):
    """The sub-config of CONFIG that the type's causal-LM class declares it takes, where that is not CONFIG's own class
    (MusicGen's decoder); tried after CONFIG, for the classes that build only from it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if isinstance(config, causal_lm.config_class):
        return None
    sub = next((sub for sub in vars(config).values() if isinstance(sub, causal_lm.config_class)), None)
    if sub is not None:
        sub.architectures = [causal_lm.__name__]  # what its checkpoint names, and _plain builds
    return sub


def _plain(config):
    """The causal LM of CONFIG in plain transformers, fp32; a sub-config by the class its architectures name."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from rocketllm_cli.compat import dtype_kwargs

    try:
        return AutoModelForCausalLM.from_config(config, **dtype_kwargs(torch.float32))
    except ValueError:
        if not getattr(config, "architectures", None):
            raise
        return getattr(transformers, config.architectures[0])._from_config(config, **dtype_kwargs(torch.float32))


def tiny_config(model_type: str):
    """The first of tiny_configs(MODEL_TYPE)."""
    return tiny_configs(model_type)[0]


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _shrunk(config, full: bool, picks: str | None) -> dict:
    """The shrunk fields of CONFIG (with FULL, every field: a sub-config is passed whole). PICKS: which of the
    original layers per-layer settings are taken from (None: leave them to the config)."""
    from transformers import PretrainedConfig

    values = config.to_dict()
    out = dict(values) if full else {}
    layers = next((values[k] for k in _LAYER_COUNTS if isinstance(values.get(k), int) and values[k] > 0), None)
    kept = _picked(layers, picks) if layers and picks else None
    for key, value in values.items():
        if isinstance(vars(config).get(key), PretrainedConfig):
            out[key] = _shrunk(vars(config)[key], full=True, picks=picks)
        elif key in _LAYER_COUNTS and isinstance(value, int) and value > 0:
            out[key] = LAYERS
        elif key == "head_dim" and "qk_rope_head_dim" in values:
            out[key] = SHRINK["qk_rope_head_dim"]  # attention with a latent KV (DeepSeek): rotary over the rope part
        elif key == "num_key_value_heads" and "kv_lora_rank" in values and value is not None:
            out[key] = SHRINK["num_attention_heads"]  # latent-KV attention has one KV head per head
        elif key in SHRINK and (
            value is None or (isinstance(value, int) and not isinstance(value, bool) and value > SHRINK[key])
        ):
            out[key] = SHRINK[key]
        elif "vocab_size" in key and isinstance(value, int) and value > VOCAB:
            out[key] = VOCAB
        elif re.search(r"token_id$|token_index$", key) and isinstance(value, int) and value >= VOCAB:
            out[key] = VOCAB - 1 - len(out) % 8  # a distinct id near the top of the vocab
        elif kept is not None and isinstance(value, (list, dict)) and value:
            cut = _per_layer(value, layers, kept)
            if cut is not None:
                out[key] = cut
            elif full:
                out[key] = value
        elif (
            full and layers and isinstance(value, (list, dict)) and value and _per_layer(value, layers, [0]) is not None
        ):
            # a sub-config's per-layer settings, left to it (as its own defaults are) rather than kept too long
            del out[key]
        elif full:
            out[key] = value
    return out


def _picked(layers: int, picks: str) -> list[int]:
    if picks == "first" or layers <= LAYERS:
        return list(range(min(LAYERS, layers)))
    return [int((i + 0.5) * layers / LAYERS) for i in range(LAYERS)]


def _per_layer(value, layers: int, kept: list[int]):
    """VALUE cut to the KEPT layers if it follows the layers: one entry per layer, {layer index: setting}, or the
    indices of some layers (renumbered; at least one stays). None if it does not follow them."""
    new = {old: i for i, old in enumerate(kept)}
    if isinstance(value, dict):
        if all(str(k).isdigit() for k in value):
            return {type(k)(new[int(k)]): v for k, v in value.items() if int(k) in new}
        return None
    scalars = all(isinstance(v, (str, int, float)) for v in value)
    if not scalars:
        return None
    if len(value) == layers:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value) and sorted(value) == list(range(layers)):
            return list(range(len(kept)))  # the indices of every layer
        return [value[i] for i in kept]
    if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers for v in value) and len(value) < layers:
        return [new[v] for v in value if v in new] or [len(kept) - 1]  # indices of some layers (the attention ones ...)
    return None


# -- one type ---------------------------------------------------------------------------------


def run_type(model_type: str, workdir: Path) -> Result:
    """Build, run, save, shard and stream one model type; never raises."""
    started = time.perf_counter()
    try:
        outcome, detail = _run(model_type, Path(workdir))
    except Exception as exc:  # noqa: BLE001 - the sweep records every failure as a row
        outcome, detail = "error", _short(exc, traceback.extract_tb(exc.__traceback__))
    if outcome == "cannot run" and model_type in CANNOT_RUN:
        detail = f"{CANNOT_RUN[model_type]} ({detail})"
    return Result(model_type, outcome, detail, round(time.perf_counter() - started, 1))


def _run(model_type: str, workdir: Path) -> tuple[str, str]:
    import torch

    from rocketllm_cli.errors import RocketError
    from rocketllm_cli.shard.sharder import shard
    from rocketllm_cli.stream.engineconfig import EngineConfig
    from rocketllm_cli.stream.model import StreamingModel

    try:
        configs = tiny_configs(model_type)
    except Exception as exc:  # noqa: BLE001 - no tiny config validates: not the project's to fix
        return "cannot run", _short(exc)
    failures = []  # (how far the config got, a missing package, -its place, the exception)
    for place, config in enumerate(configs):
        torch.manual_seed(0)
        stage = 0
        try:
            plain = _plain(config).eval()
            stage = 1
            head = plain.get_output_embeddings()
            head = head[0] if isinstance(head, torch.nn.ModuleList) else head  # one head per codebook (MusicGen)
            vocab = head.weight.shape[0] if head is not None else VOCAB
            prompt = torch.randint(
                3, min(vocab, VOCAB) - 16, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(1)
            )
            expected_logits, expected = _outputs(plain, prompt)
            stage = 2
            plain.save_pretrained(workdir / "source")
            break
        except Exception as exc:  # noqa: BLE001 - plain transformers cannot: not the project's to fix
            failures.append((stage, isinstance(exc, ImportError), -place, exc))
    else:  # the reason given: the config that got furthest, a missing package first, else the earliest tried
        return "cannot run", _short(max(failures, key=lambda f: f[:3])[3])
    del plain
    runs = {
        "nothing resident": {"device_cache_bytes": 0, "host_cache_bytes": 0},
        "resident": {"device_cache_bytes": 1 << 40},
    }
    try:
        manifest, directory, _ = shard(workdir / "source", out=workdir / "shards", log=lambda m: None)
        for name, budgets in runs.items():
            with StreamingModel(directory, EngineConfig(**budgets), manifest) as model:
                logits, tokens = _outputs(model, prompt)
            if not torch.equal(tokens, expected):
                return "differs", (
                    f"{name}: tokens {tokens[0, PROMPT_LENGTH:].tolist()} != {expected[0, PROMPT_LENGTH:].tolist()}"
                )
            if not torch.allclose(logits, expected_logits, rtol=1e-4, atol=1e-5):
                return "differs", (
                    f"{name}: prompt logits differ by up to {float((logits - expected_logits).abs().max()):.3g}"
                )
    except RocketError as exc:
        return "refused", " ".join(str(exc).split())
    return "equal", ""


def _outputs(model, prompt):
    import torch

    mask = torch.ones_like(prompt)
    with torch.inference_mode():
        logits = model(input_ids=prompt, attention_mask=mask).logits[0, -1].float()
        tokens = model.generate(
            prompt,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            # the default, which MusicGen's own generate needs said
            pad_token_id=0,
            num_return_sequences=1,
        )
    return logits, tokens


def _short(exc: BaseException, frames=None, limit: int = 160) -> str:
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    if frames:
        last = frames[-1]
        text += f" (at {Path(last.filename).name}:{last.lineno})"
    return text


# -- the whole sweep and its document -----------------------------------------------------------


def sweep(types: list[str], seconds: int = TYPE_SECONDS, log=print) -> list[Result]:
    """Each type in a subprocess of its own (a crash or hang in one cannot stop the rest)."""
    results = []
    for model_type in types:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, __file__, "--one", model_type, "--workdir", tmp, "--json", str(out)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds)
                if out.is_file():
                    result = Result(**json.loads(out.read_text()))
                else:
                    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    result = Result(model_type, "error", f"exit code {done.returncode}: {tail[:160]}")
            except subprocess.TimeoutExpired:
                result = Result(model_type, "cannot run", f"did not finish in {seconds} s", float(seconds))
        log(f"{result.model_type:32s} {result.outcome:10s} {result.seconds:6.1f}s {result.detail}")
        results.append(result)
    return results


def markdown(
    results: list[Result], transformers_version: str, torch_version: str, seconds: float, rerun: list[str] = ()
) -> str:
    counts = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    runnable = len(results) - counts["cannot run"]
    share = f"{100 * counts['equal'] / runnable:.0f}%" if runnable else "n/a"
    lines = [
        "# Architectures",
        "",
        f"Every model type in the causal-LM mapping of transformers {transformers_version} (torch {torch_version}), as "
        f"a tiny "
        "random model streamed by RocketLLM with nothing resident and all resident, compared with plain transformers "
        "token for token. Written by `tests/archsweep.py`; `pytest -m archsweep` runs the same sweep as tests.",
        "",
        f"**{len(results)} model types: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES) + f"** — {share} of the "
        f"{runnable} that plain transformers runs on CPU stream equal. Sweep wall time: {seconds / 60:.0f} min"
        + (f"; {len(rerun)} types re-run since with `--only`: {', '.join(f'`{t}`' for t in rerun)}." if rerun else "."),
        "",
    ]
    for outcome in OUTCOMES[1:]:
        rows = [r for r in results if r.outcome == outcome]
        if rows:
            lines += [f"{outcome.capitalize()}:", ""] + [f"- `{r.model_type}`: {r.detail}" for r in rows] + [""]
    lines += [
        "| model type | outcome | detail |",
        "|---|---|---|",
    ]
    lines += [f"| `{r.model_type}` | {r.outcome} | {r.detail.replace('|', '/')} |" for r in results]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="stream every causal-LM model type of transformers, tiny, and compare")
    parser.add_argument("types", nargs="*", help="model types (default: all; the document is written only for all)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=int, default=TYPE_SECONDS, help="limit per type")
    parser.add_argument("--out", type=Path, default=DOC, help="where the document goes")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="TYPE",
        help="re-run these types and update their rows (and the counts) in the document --out holds",
    )
    args = parser.parse_args(argv)
    if args.one:
        import torch

        torch.set_num_threads(1)
        Path(args.json).write_text(json.dumps(asdict(run_type(args.one, Path(args.workdir)))))
        return
    import torch
    import transformers

    versions = transformers.__version__, torch.__version__.split("+")[0]
    if args.only:
        rows, seconds, rerun = read_document(args.out)
        unknown = sorted(set(args.only) - set(rows) - set(causal_lm_types()))
        if unknown:
            raise SystemExit(f"not a causal-LM model type of transformers {versions[0]}: {', '.join(unknown)}")
        for result in sweep(args.only, args.seconds):
            rows[result.model_type] = result
        rerun = [*rerun, *(t for t in args.only if t not in rerun)]
        args.out.write_text(markdown([rows[t] for t in sorted(rows)], *versions, seconds, rerun))
        return
    started = time.perf_counter()
    types = args.types or causal_lm_types()
    results = sweep(types, args.seconds)
    if not args.types:
        args.out.write_text(markdown(results, *versions, time.perf_counter() - started))


_ROW = re.compile(r"^\| `(?P<type>[^`]+)` \| (?P<outcome>[a-z ]+) \| (?P<detail>.*) \|$")
_WALL = re.compile(
    r"Sweep wall time: (?P<minutes>\d+) min(?:; \d+ types re-run since with `--only`: (?P<rerun>[^.]*))?"
)


def read_document(path: Path) -> tuple[dict[str, Result], float, list[str]]:
    """The rows of a document markdown() wrote, its sweep's wall time in seconds and the types re-run since."""
    text = path.read_text()
    rows = {
        m["type"]: Result(m["type"], m["outcome"], m["detail"].strip())
        for m in map(_ROW.match, text.splitlines())
        if m and m["outcome"] in OUTCOMES
    }
    wall = _WALL.search(text)
    rerun = re.findall(r"`([^`]+)`", wall["rerun"]) if wall and wall["rerun"] else []
    return rows, 60.0 * float(wall["minutes"]) if wall else 0.0, rerun


if __name__ == "__main__":
    main()
