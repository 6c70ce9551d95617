"""AutoModel: one call from a model path, GGUF file, hub id or shard directory to a streaming model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from .checkpoint.manifest import MANIFEST, Manifest
from .output import BLINK_S, no_progress
from .profiles.knobs.table import native_mode
from .stream.residency import check_floor
from .tiers import RESIDENT_KINDS

if TYPE_CHECKING:  # torch and transformers load only once the model path has been checked
    from .stream.engineconfig import EngineConfig
    from .stream.model import StreamingModel


def ensure_shards(
    model: str | os.PathLike, out: Path | None = None, dtype: str = "auto", progress=None, log=None
) -> tuple[Manifest, Path]:
    """A complete shard set for MODEL: the directory itself if it is one, else shard it (or reuse)."""
    path = Path(str(model)).expanduser()
    if path.is_dir() and (path / MANIFEST).is_file():
        return Manifest.load(path), path
    from .shard.sharder import shard

    manifest, directory, _ = shard(model, out=out, dtype=dtype, progress=progress, log=log or (lambda m: None))
    return manifest, directory


def engine_config(profile, knobs, manifest: Manifest) -> tuple[EngineConfig, list[str]]:
    """Turn resolved knobs into the engine's config; returns it and the decisions worth logging once."""
    from .stream.engineconfig import EngineConfig

    notes = []
    from .profiles.knobs.derivation import engine_compute_dtype

    # the same rule the KV knobs were sized with (max_context counts K and V in this dtype)
    blocks = manifest.packing == "blocks"
    compute = engine_compute_dtype(
        str(knobs.value("compute_dtype")),
        knobs["compute_dtype"].overridden,
        manifest.dtype,
        profile.compute_device,
        blocks,
    )
    # a GGUF's blocks compute in fp32 on a CPU by default: only its small float tensors convert, not worth a note
    if compute != manifest.dtype and not (blocks and not knobs["compute_dtype"].overridden):
        notes.append(
            f"shards hold {manifest.dtype}, computing in {compute}: each streamed use converts (reshard with "
            f"--dtype {compute} to avoid it)"
        )
    layouts = {
        t.packed.get("layout") for u in manifest.units for t in u.tensors if t.packed and t.packed.get("kind") == "int4"
    }
    if layouts and profile.compute_device == "cpu":
        from .packed.cpulayout import cpu_layout

        here = cpu_layout()
        if here is not None and layouts != {here}:
            notes.append(
                f"int4 shards are in the {'/'.join(sorted(str(x) for x in layouts))} order another CPU's kernel reads, "
                f"this one reads {here}: each streamed use reorders them (to avoid it, run the source itself, or "
                f"`rocketllm shard` it: a set's name carries its int4 order, so this machine writes its own set beside "
                f"this one)"
            )
    config = EngineConfig(
        device=profile.compute_device,
        compute_dtype=compute,
        device_cache_bytes=int(knobs.value("device_cache_bytes")),
        host_cache_bytes=int(knobs.value("host_cache_bytes")),
        prefetch_depth=int(knobs.value("prefetch_depth")),
        io_workers=int(knobs.value("io_workers")),
        direct_io=bool(knobs.value("direct_io")),
        pin_memory=bool(knobs.value("pin_memory")),
        expert_cache_policy=str(knobs.value("expert_cache_policy")),
        # exact: packed Linears compute in the compute dtype; torch: in the dtype its kernel measured fastest in
        packed_dtype="fastest" if knobs.value("kernel") == "torch" else "",
        native_mode=native_mode(str(knobs.value("kernel"))),
        kv_cache_dtype=str(knobs.value("kv_cache_dtype")),
        kv_residual_tokens=int(knobs.value("kv_residual_tokens")),
        decode_graphs="off" if knobs.value("decode_graphs") == "off" else "on",  # graphs.wanted() checks the rest
        decode_attention=str(knobs.value("decode_attention")),
    )
    return config, notes


def _without_native_kernels(manifest: Manifest, profile) -> str:
    """One line where a set's GGUF blocks cannot run on the native kernels here (no compiler, a failed build): they
    compute through the exact torch decoder instead, an order of magnitude slower."""
    if profile.compute_device != "cpu" or not any(
        t.packed and t.packed.get("kind") == "gguf" for u in manifest.units for t in u.tensors
    ):
        return ""
    from .native import kernels, why_not

    if kernels() is not None:
        return ""
    return (
        f"note: this model's GGUF blocks are decoded by torch for every product, about 10x slower than on the native "
        f"kernels, which are not available: {why_not()}"
    )


def _start_first_run_work(model, refresh: bool) -> None:
    """What a first run needs beside sharding: the native kernels' build begun on the other cores (a GGUF's blocks
    compute on them), the storage probe's file written (a GGUF's filesystem, where not profiled yet: its reads are
    timed when the profile loads), and the profile's measurement of the runtime's memory taken here, before anything
    is loaded (the imports the load makes anyway, made first). SmolLM2's first generate on a fresh cache spent 3.9 s
    and 3.3 s on the build and the runtime's memory after its 6.4 s of sharding when both ran after it."""
    from .profiles import HardwareProfile

    gguf = str(model).endswith(".gguf")
    if gguf or _is_blocks_set(Path(str(model)).expanduser()):
        from .native import build_in_background

        build_in_background()
    if gguf:  # its set indexes it in place: the profile measures the file's filesystem
        HardwareProfile.write_storage_probe_ahead(Path(str(model)).expanduser(), refresh)
    if refresh or not HardwareProfile.host_cached():
        from .profiles.probe.runtime import start

        start()


def _is_blocks_set(path: Path) -> bool:
    import json

    try:
        return json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("packing") == "blocks"
    except (OSError, ValueError, AttributeError):  # not a set, or a damaged one: said where it is opened
        return False


def _refuse_before_sharding(model, flags: dict, kwargs: dict, refresh: bool) -> None:
    """Sharding a large model takes long: refuse a budget that cannot run it before, from the source's headers.

    Only with a profile measured already: a bad input must not leave a new one behind."""
    from .checkpoint.modelfacts import model_facts_from_path
    from .errors import RocketError
    from .profiles import HardwareProfile, resolve_knobs
    from .profiles.knobs.memory import memory_floor
    from .profiles.knobs.shape import pass_shape_of

    path = Path(str(model)).expanduser()
    if not path.exists() or (path / MANIFEST).is_file():
        return
    try:
        facts = model_facts_from_path(path)
    except RocketError:
        return  # not sizeable from headers: sharding gives the precise error
    profile = None if refresh else HardwareProfile.cached(storage_path=path)
    if profile is None:
        return
    shape = pass_shape_of(path)
    knobs = resolve_knobs(profile, facts, flags=flags, kwargs=kwargs, shape=shape)
    check_floor(profile, memory_floor(profile, facts, knobs, shape=shape), knobs["reserve_bytes"].overridden)


def _load_draft(target, knobs, progress, log):
    """The draft model speculative decoding drafts with, every weight resident; None unless the speculate knob is draft
    (auto is draft where layers stream and a draft model is given). Refused when its vocabulary is not the target's."""
    from .errors import ParameterError

    path = knobs.value("draft_model")
    mode = knobs.value("speculate")
    if mode == "auto":
        mode = knobs["speculate"].derived_value
    if mode == "draft" and not path:
        raise ParameterError("{speculate} draft needs a draft model: give {draft_model}", "speculate", "draft_model")
    if not path or mode != "draft":
        if path:
            (log or (lambda m: None))(
                f"note: the draft model is not loaded: speculation is {mode} ({knobs['speculate'].formula})"
            )
        return None
    everything = 1 << 62  # device_cache_bytes covering any model: every unit bound once, nothing streams
    from .distributed.torchrun import alone

    with alone():  # under torchrun the draft is rank 0's own, whole and resident
        draft = AutoModel.from_pretrained(
            path,
            progress=progress,
            log=log,
            device_cache_bytes=everything,
            host_cache_bytes=0,
            speculate="off",
            compute_dtype=str(target.dtype).removeprefix("torch."),
        )
    try:
        problem = _vocabulary_differs(target, draft)
    except BaseException:
        draft.close()
        raise
    if problem:
        draft.close()
        raise ParameterError(f"{{draft_model}} {path} cannot draft for this model: {problem}", "draft_model")
    return draft


def _vocabulary_differs(target, draft) -> str:
    """Why DRAFT's tokens are not the target's (its tokenizer or its vocabulary size), or ""."""
    a, b = target.tokenizer, draft.tokenizer
    if a is not None and b is not None:
        va, vb = a.get_vocab(), b.get_vocab()
        if va != vb:
            differ = sum(1 for t, i in va.items() if vb.get(t) != i) + sum(1 for t in vb if t not in va)
            return f"its tokenizer differs ({len(vb)} tokens against {len(va)}, {differ} mapped differently)"
    elif (a is None) != (b is None):
        return "one of the two has no tokenizer, so their tokens cannot be compared"
    na = target.config.get_text_config(decoder=True).vocab_size
    nb = draft.config.get_text_config(decoder=True).vocab_size
    if na != nb:
        return f"its vocabulary has {nb} entries against {na}"
    return ""


class AutoModel:
    """`AutoModel.from_pretrained(path_or_id_or_gguf, **knob_overrides)` -> a StreamingModel."""

    @staticmethod
    def from_pretrained(
        model: str | os.PathLike,
        *,
        out: Path | None = None,
        shard_dtype: str = "auto",
        flags: dict | None = None,
        refresh_profile: bool = False,
        progress=None,
        log=None,
        run_tokens=None,
        measured_speed: bool = False,
        **knob_overrides,
    ) -> StreamingModel:
        """Shard MODEL once (or reuse its shards) and open it streamed, every knob derived from this machine's profile.

        A memory budget that cannot run the model is refused before the model loads, and before sharding where a
        cached profile and the source's headers can size it.

        model: a Hugging Face model directory, a .gguf file, a hub id, or a shard directory (opened as it is).
        out: where to write the shards; default a directory under the cache named after the source and the dtype.
        shard_dtype: the shards' dtype, bf16, fp16 or fp32; "auto" keeps the one most of the source's weights are stored
        in.
        flags: knob values as a command line gave them (name -> text); a flag wins over a knob_overrides keyword.
        refresh_profile: measure this machine again instead of using its cached profile.
        progress: a factory of context managers, progress(description, total), for the sharding progress
        (Output.progress).
        log: called with one line per thing worth telling (sharding steps, shards converted on each use); default
        silent.
        run_tokens: for a one-shot run, the most tokens of KV it holds (every row's prompt and new tokens, and a
        margin),
            or a function of the set's tokenizer giving them: the KV cache is sized for those, not for any request, and
            the weights get what that frees (profiles/knobs resolve_knobs). None (a server, a session): any request.
        measured_speed: knobs that project a token's time take this machine's measured speed (layerprobe.py).
        knob_overrides: any knob by name (device_cache_bytes="4GiB", io_workers=2, ...); beats ROCKETLLM_<NAME> and the
        derivation.
        """
        from .shard.source import check_locatable

        check_locatable(model)  # a mistyped path is refused before torch and transformers are imported
        from .shard.identity import hash_in_background

        hash_in_background(model)  # a GGUF's first content hash runs beside the imports below

        from transformers import AutoConfig

        from .checkpoint.modelfacts import facts_from_manifest
        from .heap import return_large_blocks
        from .profiles import HardwareProfile, resolve_knobs
        from .profiles.knobs.memory import memory_floor
        from .profiles.knobs.shape import pass_shape
        from .profiles.probe.unitreads import with_own_reads
        from .shard.cachedir import mark_used

        return_large_blocks()  # before sharding too: its tensors' memory goes back once each is written
        _start_first_run_work(model, refresh_profile)
        _refuse_before_sharding(model, flags or {}, knob_overrides, refresh_profile)
        manifest, directory = ensure_shards(model, out=out, dtype=shard_dtype, progress=progress, log=log)
        mark_used(directory)  # for `rocketllm cache ls`; a set outside the cache is left untouched
        # What the process holds beside the weights is in place before the profile reads the free memory (live), so
        # the plan counts it as it is: the runtime (the engine's imports) and the tokenizer.
        from .stream.assets import load_tokenizer
        from .stream.model import StreamingModel

        tokenizer = load_tokenizer(directory)
        # A status on a terminal when it is slow (measuring); off one silent as before, so a first run's error stays one
        # line.
        with (progress or no_progress)(
            "measuring this machine once (cached afterwards)", after=BLINK_S, announce=False
        ):
            profile = HardwareProfile.load(storage_path=directory, refresh=refresh_profile)
        # The native kernels build (a compiler run, once per machine) before any weight is read, not beside them.
        slow = _without_native_kernels(manifest, profile)
        hf_config = AutoConfig.from_pretrained(directory)
        facts = facts_from_manifest(manifest, hf_config)
        shape = pass_shape(hf_config)
        from .distributed.torchrun import launched

        launch = launched()  # under torchrun: this rank's share of the layers, the others' on their ranks
        if launch is not None:
            from .distributed.opening import join, share_cores, shared_memory_profile

            group = join(launch, flags)
            share_cores(group, profile, log)
            profile = shared_memory_profile(profile, group, log)
        if callable(run_tokens):
            run_tokens = run_tokens(tokenizer) if tokenizer is not None else None

        def resolve(f):
            return resolve_knobs(
                profile, f, flags=flags or {}, kwargs=knob_overrides, run_tokens=run_tokens, shape=shape
            )

        knobs = resolve(facts)
        if measured_speed:
            from .stream.layerprobe import with_measured_speed

            knobs = resolve(facts := with_measured_speed(profile, facts, directory, manifest, knobs))
        # Streamed from storage: the read method and depth come from the set's own units read cold (once per set).
        with (progress or no_progress)(
            "measuring this set's reads once (cached afterwards)", after=BLINK_S, announce=False
        ):
            facts, knobs = with_own_reads(profile, facts, directory, knobs, resolve, log, manifest=manifest)
        config, notes = engine_config(profile, knobs, manifest)
        resident = sum(u.tensor_bytes for u in manifest.units if u.kind in RESIDENT_KINDS)
        check_floor(
            profile, memory_floor(profile, facts, knobs, run_tokens, shape, resident), knobs["reserve_bytes"].overridden
        )
        from .stream.store import LOAD_PROGRESS

        loading = LOAD_PROGRESS.set(progress)  # the store's resident load gets the same kind of bar as sharding
        try:
            if launch is not None:
                from .distributed.opening import open_stages

                streamed = open_stages(
                    launch, directory, manifest, profile, knobs, facts, config, log, overrides=knob_overrides
                )
            else:
                streamed = StreamingModel(directory, config, manifest, tokenizer)
        finally:
            LOAD_PROGRESS.reset(loading)
        if manifest.vision:  # the vision tower and projector: resident, read once, in the device budget (plan.py)
            from .sizes import format_bytes

            images = "" if streamed.processor is not None else f"; images refused: the model {streamed.processor_error}"
            (log or (lambda m: None))(
                f"resident modules: vision tower {format_bytes(sum(u.tensor_bytes for u in manifest.vision))} "
                f"({', '.join(u.module for u in manifest.vision)}){images}"
            )
        if any(tier != "device" for tier in streamed.plan.tier.values()):  # resident units convert once, at load
            for note in notes:
                (log or (lambda m: None))(note)
        if slow:
            (log or (lambda m: None))(slow)
        from .text.grammar import constrained_kwargs

        streamed.constrain = constrained_kwargs  # json_schema/grammar in generate(): the engine above stream
        streamed.knobs = knobs
        streamed.profile = profile
        streamed.facts = facts
        if launch is not None and not launch.is_first:
            return streamed  # a later stage: sampling, and so drafting, happen on rank 0
        try:
            streamed.draft = _load_draft(streamed, knobs, progress, log)
        except BaseException:
            streamed.close()
            raise
        return streamed


def run_later_stage(model, flags: dict | None) -> None:
    """A rank other than 0 of `generate`, `serve` or `bench` under torchrun: for every model rank 0 loads, open this
    rank's
    share of MODEL with rank 0's knob keywords and run its layers until rank 0 closes it; return when rank 0 ends (its
    prompt, output and HTTP server are rank 0's alone)."""
    from .distributed.torchrun import launched
    from .distributed.opening import join

    flags = flags or {}
    group = join(launched(), flags)
    orderly = False  # rank 0 said the end: every rank closes together
    try:
        while True:
            order = group.broadcast(None)
            if order.get("op") != "load":
                orderly = True
                return
            streamed = AutoModel.from_pretrained(model, flags=flags, **order.get("overrides", {}))
            try:
                final = streamed.stage.serve()
            finally:
                streamed.close()
            if final:  # rank 0 ended with this model open (its close skipped): no broadcast follows
                orderly = True
                return
    finally:
        group.close(orderly)
