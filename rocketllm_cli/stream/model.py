"""The streaming model: a transformers model on the meta device whose weights arrive just in time.

Resident units are bound once. Each streamed unit gets a forward pre-hook on its module that binds views of its bytes
to (module, name) pairs computed up front, and a post-hook that puts the placeholders back and frees the buffer.
transformers runs the forward pass and generate() unchanged; on a CPU its RMS norms and rotary embedding run in fewer
torch ops, or one native call, where that gives their bits (fusednorms.py, rotary.py).

An unbound tensor is an `Unbound` placeholder (unbound.py): shape, dtype and device answer, a computation raises
UnboundWeightError, and a streamed embedding table's placeholder answers lookups by reading rows.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..checkpoint.manifest import RESHARD, Manifest
from ..checkpoint.packedformat import PackedFormat
from ..dtypes import torch_dtype
from ..errors import ParameterError, ShardError
from ..heap import return_large_blocks
from ..shard.discover import build_meta_model
from ..threads import COMPUTE_THREADS
from .assets import load_generation_config, load_processor, load_tokenizer
from .attention import planless_attention
from .binding import Binding, assign, called_site, is_lookup, move_buffers
from .decodeattention import attention_path
from .engineconfig import EngineConfig
from .fusednorms import fuse_norms
from .graphs import graphs_excluded
from .ledger import Ledger
from .nativepass import NO_NATIVE_PASSES, NativePasses
from .packedbind import PackedBinding, activation_dtype, make_fused, make_packed
from .residency import ResidencyPlan, make_plan
from .rotary import fast_rotary
from .store import WeightStore
from .unbound import Unbound, unbind_all


class StreamingModel:
    """A causal LM streamed from a shard directory. Attribute access falls through to the transformers model.

    Holds the residency plan (`plan`), the weight store (`store`), the byte ledger (`ledger`) and the tokenizer; close()
    (or a with block) stops its IO threads and unmaps its files. AutoModel.from_pretrained builds one from resolved
    knobs.
    """

    # generate()'s json_schema/grammar: its logits processor's keywords, set from text/ (grammar.py constrained_kwargs)
    constrain = None
    native_passes = NO_NATIVE_PASSES  # until the model is bound (nativepass.py)

    def __init__(self, directory: Path, config: EngineConfig, manifest: Manifest | None = None, tokenizer=None) -> None:
        """Open the shard set in DIRECTORY as `config` says; `manifest` and `tokenizer` (the set's, loaded already)
        save loading them again."""
        from transformers import AutoConfig

        self.directory = Path(directory)
        self.config_engine = config
        self.manifest = manifest or Manifest.load(self.directory)
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.compute_dtype)
        hf_config = AutoConfig.from_pretrained(self.directory)
        return_large_blocks(4 * (getattr(hf_config.get_text_config(), "vocab_size", 0) or 0))  # passes' (heap.py)
        self.kv_dtype = config.kv_dtype()
        if self.kv_dtype not in (config.compute_dtype, "auto"):
            from .kvcache import refusal

            why = refusal(hf_config, self.kv_dtype)
            if why:
                raise ParameterError(why, "kv_cache_dtype")  # before any weight is read
        model = build_meta_model(hf_config, self.dtype)
        self.fused_norms = fuse_norms(model, self.dtype, self.manifest.packing == "blocks", self.device)
        self.fast_rotary = fast_rotary(model, self.dtype, self.device, self.manifest.packing == "blocks")
        self.plan: ResidencyPlan = make_plan(
            self.manifest,
            config.device_cache_bytes,
            config.host_cache_bytes,
            device=self.device.type,
            compute_itemsize=self.dtype.itemsize,
        )
        # the device tier's bytes every pass serves: resident experts count when routed, a vision tower once a request
        resident = sum(
            u.tensor_bytes
            for u in self.manifest.units
            if self.plan.tier[u.name] == "device" and u.kind not in ("expert", "vision")
        )
        self.ledger = Ledger(resident)
        self.store = WeightStore(
            self.directory,
            self.manifest,
            self.plan,
            self.ledger,
            device=self.device,
            compute_dtype=self.dtype,
            prefetch_depth=config.prefetch_depth,
            io_workers=config.io_workers,
            direct_io=config.direct_io,
            pin_memory=config.pin_memory,
        )
        self._hooks: list = []
        self.pass_hooks: list = []  # the root module's pass hooks (begin_pass, _end_pass)
        self.static_caches: dict = {}  # (rows, length) -> the StaticCache a graphed decode reuses (graphs.py)
        self.graphs_failed = ""  # why compiling the decode step failed, once it has
        self.experts = None
        unbind_all(model, self.device)
        self._bind(model)
        if self.manifest.experts:
            from ..shard.names import candidate_names
            from .experts import ExpertStreamer

            prefix = getattr(model, "base_model_prefix", "") or ""
            self.experts = ExpertStreamer(
                model,
                self.manifest,
                self.plan,
                self.store,
                self.ledger,
                io_workers=config.io_workers,
                candidates=lambda n: candidate_names(n, prefix),
                cache_policy=config.expert_cache_policy,
            )
        move_buffers(model, self.device)
        load_generation_config(model, self.directory)
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.directory)
        # A vision-language model's processor turns pictures into the tensors its tower takes (text/images.py)
        self.processor, self.processor_error = load_processor(self.directory) if self.manifest.vision else (None, None)
        self.knobs = self.profile = self.facts = None  # filled in by AutoModel.from_pretrained
        self.draft = None  # the resident draft model speculation drafts with (AutoModel loads it); closed with this
        self.stage = None  # under torchrun: this rank's place in the pipeline (distributed/stages.py)
        COMPUTE_THREADS.poll()  # the first sample: the first pass half a second on sets the thread count

    # -- wiring -----------------------------------------------------------------------
    def _bind(self, model: nn.Module) -> None:
        bindings: dict[str, dict[str, list[Binding]]] = {}  # unit -> hook module path -> bindings
        units = [u for u in self.manifest.units if u.kind != "expert"]  # experts: see expertstream.py
        owner = {t.name: u.name for u in units for t in u.tensors}
        hook_of = {u.name: u.module for u in units}
        records = {t.name: t for u in units for t in u.tensors}
        targets = [(t.name, t.name, u.name) for u in units for t in u.tensors]
        targets += [(alias, src, owner[src]) for alias, src in self.manifest.aliases.items() if src in owner]
        for name, key, unit in targets:
            if records[key].fused:  # several Linears' weights stored as one (shard/fusion.py)
                persistent = self.plan.tier[unit] == "host" and self.device.type == "cpu"
                hook, binding = self._fused_binding(model, records[key], unit, hook_of[unit], persistent)
                bindings.setdefault(unit, {}).setdefault(hook, []).append(binding)
                continue
            module_path, _, attr = name.rpartition(".")
            module = model.get_submodule(module_path)
            is_buffer = attr in module._buffers
            table = module._buffers if is_buffer else module._parameters
            hook = called_site(model, hook_of[unit] if name == key else module_path, module_path)
            # Buffers are real (initial values), parameters may be tied placeholders: each gets its own, naming its site
            where = f"{hook or 'the model'} (unit {unit})"
            placeholder = table[attr] = Unbound(name, table[attr], self.device, where)
            persistent = self.plan.tier[unit] == "host" and self.device.type == "cpu"  # views of the persistent mapping
            fmt = records[key].packed
            if fmt is not None:
                binding = self._packed_binding(
                    module, name, key, unit, PackedFormat.from_dict(fmt), placeholder, where, persistent
                )
                if binding is None:
                    continue  # a table read by rows: its placeholder answers lookups
            else:
                binding = Binding(module, attr, key, is_buffer, placeholder, persistent)
            bindings.setdefault(unit, {}).setdefault(hook, []).append(binding)

        self.bindings = bindings  # kept for inspection: which module each unit's tensors are bound to
        hooked: set[str] = set()  # streamed units whose tensors are bound whole around a module's forward
        for unit, by_hook in bindings.items():
            if self.plan.tier[unit] == "device":
                tensors = self.store.resident(unit)
                for group in by_hook.values():
                    assign(group, tensors)
                continue
            for hook_path, group in by_hook.items():
                module = model.get_submodule(hook_path)
                if self.store.can_gather_rows(unit) and is_lookup(module, group):
                    # A token lookup reads a few rows of the table, not the table: the placeholder serves it.
                    group[0].placeholder.rows = self._rows(unit, group[0].tensor)
                    continue
                self._hooks.append(module.register_forward_pre_hook(self._pre_hook(unit, group)))
                self._hooks.append(module.register_forward_hook(self._post_hook(unit, group)))
                hooked.add(unit)
        self.pass_hooks = self.register_pass_hooks(model)
        # GGUF blocks on a CPU with the native kernels: a pass they compute alone gets the cores (nativepass.py)
        self.native_passes = NativePasses(self.device, self.manifest.packing, self.plan)
        # ... and attends on them too where the knob says so (decodeattention.py: the decode case alone)
        self.decode_attention = attention_path(model, self.config_engine.decode_attention, self.native_passes.products)
        # A unit only ever looked up by rows is never read whole: no read-ahead, and no buffer sized for it.
        self.store.read_whole_only(hooked)

    def register_pass_hooks(self, model: nn.Module | None = None) -> list:
        """The hooks that open and close each forward pass in the ledger, on the root module."""
        model = self.model if model is None else model
        return [
            model.register_forward_pre_hook(self._begin_pass, with_kwargs=True),
            model.register_forward_hook(self._end_pass),
        ]

    def _fused_binding(
        self, model: nn.Module, record, unit: str, unit_module: str, persistent: bool
    ) -> tuple[str, PackedBinding]:
        """(the module whose forward binds it, the binding) of a fused record: its members compute through one
        FusedGroup."""
        members = [m for m, _ in record.fused]
        parent = members[0].rsplit(".", 2)[0]
        hook = called_site(model, unit_module, parent)
        where = f"{hook or 'the model'} (unit {unit})"
        modules = []
        for member in members:
            module = model.get_submodule(member.rpartition(".")[0])
            if not isinstance(module, nn.Linear) or "weight" not in module._parameters:
                raise ShardError(f"{member} is stored fused but its module is a {type(module).__name__}; {RESHARD}")
            module._parameters["weight"] = Unbound(member, module._parameters["weight"], self.device, where)
            modules.append(module)
        fmt = PackedFormat.from_dict(record.packed)
        group = make_fused(modules, members, [int(n) for _, n in record.fused], fmt, where)
        dtype = activation_dtype(self.config_engine.packed_dtype, fmt, self.dtype, self.device)
        return hook, PackedBinding(
            modules[0],
            record.name,
            fmt,
            self.device,
            dtype,
            None,
            persistent,
            group=group,
            mode=self.config_engine.native_mode,
        )

    def _packed_binding(
        self,
        module: nn.Module,
        name: str,
        key: str,
        unit: str,
        fmt: PackedFormat,
        placeholder,
        where: str,
        persistent: bool,
    ) -> PackedBinding | None:
        """A Linear computes on its packed weight; an embedding table's placeholder dequantizes the rows looked up."""
        if isinstance(module, nn.Linear) and name.endswith(".weight"):
            make_packed(module, name, where)
            return PackedBinding(
                module,
                key,
                fmt,
                self.device,
                activation_dtype(self.config_engine.packed_dtype, fmt, self.dtype, self.device),
                placeholder,
                persistent,
                mode=self.config_engine.native_mode,
            )
        if (
            isinstance(module, nn.Embedding)
            and name.endswith(".weight")
            and (fmt.kind == "gguf" or (fmt.kind == "int8" and fmt.group == fmt.shape[1]))
        ):
            store = self.store
            placeholder.rows = lambda ids: store.gather_packed_rows(unit, key, fmt, ids)
            return None
        raise ShardError(
            f"{name} is stored packed ({fmt.kind}) but its module is a {type(module).__name__}, which "
            f"cannot compute on it; {RESHARD}"
        )

    def _pre_hook(self, unit: str, group: list[Binding]):
        store = self.store

        def hook(module, args):
            assign(group, store.acquire(unit))

        return hook

    def _post_hook(self, unit: str, group: list[Binding]):
        store = self.store

        def hook(module, args, output):
            for b in group:
                b.unbind()
            store.release(unit)

        return hook

    def _rows(self, unit: str, key: str):
        store = self.store
        return lambda ids: store.gather_rows(unit, key, ids)

    def _begin_pass(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            embeds = kwargs.get("inputs_embeds")
            tokens = int(embeds.shape[0] * embeds.shape[1]) if embeds is not None else 0
            positions = int(embeds.shape[1]) if embeds is not None else None
        else:
            tokens = int(ids.numel())
            positions = int(ids.shape[-1]) if ids.dim() else None
        self.begin_pass(tokens, positions)

    def begin_pass(self, tokens: int, positions: int | None = None) -> None:
        """A forward pass of TOKENS positions starts (the pre-hook, or graphs.PassClock where no hook runs), POSITIONS
        of them per row (1: a decode step), where known."""
        self.native_passes.begin(tokens, positions)
        self.ledger.begin(tokens)
        self.store.begin_pass()

    def _end_pass(self, module, args, output):
        if self.experts is not None:
            self.experts.end_pass()
        self.store.end_pass()
        self.ledger.end()

    def residency_text(self) -> str:
        """Where the units live and how the streamed ones are read, in words (--stats, bench, /health)."""
        return f"{self.plan.describe(self.manifest)}; {self.store.describe_buffers()}"

    def generate(self, *args, json_schema: dict | None = None, grammar: str | None = None, **kwargs):
        """transformers' generate(), on the streamed model. A prompt plus max_new_tokens over the max_context knob
        is refused first (ParameterError, with the numbers), as `generate` and `serve` refuse it.

        json_schema (a JSON Schema as a dict) or grammar (Lark rules, llguidance's syntax) constrains every row's new
        tokens (text/grammar.py); the model's tokenizer must be a fast one."""
        from .context import check_generate_call

        check_generate_call(
            self.__dict__.get("knobs"), args, kwargs, getattr(self.model, "generation_config", None), self.model.config
        )
        if json_schema is not None or grammar is not None:
            if self.constrain is None:
                raise ParameterError(
                    "{json_schema} and {grammar} need the grammar engine: open the model with "
                    "AutoModel.from_pretrained",
                    "json_schema" if json_schema is not None else "grammar",
                )
            self.constrain(self, args, kwargs, json_schema, grammar)
        from .appendcache import appending_cache, needs_cache, run_tokens

        if needs_cache(self.model, kwargs):
            from .kvcache import generate_cache_kwarg

            cache = self.new_kv_cache()
            if cache is not None:
                kwargs[generate_cache_kwarg()] = cache
            elif self.config_engine.decode_graphs == "on" and not graphs_excluded(kwargs):
                from .graphs import graphed, static_cache

                ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
                cache, self.graphs_why = static_cache(self, ids, kwargs.get("max_new_tokens"))
                if cache is not None:
                    kwargs[generate_cache_kwarg()] = cache
                    with graphed(self, kwargs, ids), planless_attention(self.device):
                        return self.model.generate(*args, **kwargs)
            kwargs.setdefault(generate_cache_kwarg(), appending_cache(self.model.config, run_tokens(args, kwargs)))
        with planless_attention(self.device):
            return self.model.generate(*args, **kwargs)

    def new_kv_cache(self):
        """An empty KV cache storing the kv_cache_dtype knob's dtype, or None where transformers' own cache does."""
        from .kvcache import make_cache

        return make_cache(self.model.config, self.kv_dtype, self.dtype, self.config_engine.kv_residual_tokens)

    def __call__(self, *args, **kwargs):
        """One forward pass of the transformers model, weights streamed in as each unit runs."""
        with planless_attention(self.device):
            return self.model(*args, **kwargs)

    def __getattr__(self, name: str):
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def close(self) -> None:
        """Remove the hooks, stop the IO threads and unmap the shard files; the model cannot run afterwards."""
        if self.draft is not None:
            self.draft.close()
            self.draft = None
        if self.stage is not None:
            stage, self.stage = self.stage, None
            stage.stop_all()  # rank 0: the other ranks close their share (the group stays for the next model)
            stage.close()
        for h in (*self._hooks, *self.pass_hooks):
            h.remove()
        self._hooks.clear()
        self.pass_hooks = []
        self.static_caches.clear()
        if self.experts is not None:
            self.experts.close()
        self.store.close()
        COMPUTE_THREADS.restore()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
