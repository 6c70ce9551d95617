"""Random-weight checkpoints of real architectures, for tests (tiny) and benchmarks (up to tens of GB).

    config = config_for("llama", "1B")
    write_checkpoint(config, Path("llama-1b"), dtype=torch.bfloat16, layout="sharded")

Tensor names and shapes are those `save_pretrained` writes, read from a meta-device model;
values are streamed chunk by chunk, so no model is ever materialised whole.

What transformers 5 saves (checked against save_pretrained in tests/test_synthetic.py):
- tied embeddings: only model.embed_tokens.weight / transformer.wte.weight is written, no lm_head.weight.
- MoE experts are fused 3D parameters in the module tree but saved one tensor per expert:
  mixtral  module mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj [E, H, I], router mlp.gate.weight;
           saved  block_sparse_moe.experts.{e}.w1/w3.weight [I, H] (gate/up halves), .w2.weight [H, I],
                  router block_sparse_moe.gate.weight (the module prefix is renamed back too).
  qwen3_moe module mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I];
           saved  mlp.experts.{e}.gate_proj/up_proj.weight [I, H], .down_proj.weight [H, I], mlp.gate.weight.
- Dense families (llama, mistral, qwen2/3, gemma2/3, phi3, gpt2, gpt_neox, olmo2) save their module tree as is
  (phi3 keeps its fused qkv_proj/gate_up_proj; gpt2 its Conv1D [in, out] weights; non-persistent buffers
  such as rotary inv_freq and gpt2's attn.bias are not saved).
transformers 4.x (checked on 4.57) saves the same names and shapes: its experts are modules of their own
(mixtral's under block_sparse_moe, qwen3_moe's under mlp), so there is nothing to revert.
"""

from .archs import (
    ARCHS,
    MOE_ARCHS,
    TINY_SHAPE,
    ArchSpec,
    config_for,
    config_from_spec,
    count_params,
    parse_size,
)
from .tensors import TensorSpec, make_chunk, saved_tensors, tensor_chunks, tensor_values
from .tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, VOCAB_SIZE, build_tokenizer
from .writer import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_STD,
    LAYOUTS,
    plan_files,
    value_rules,
    write_checkpoint,
    write_safetensors,
)

__all__ = [
    "ARCHS",
    "MOE_ARCHS",
    "TINY_SHAPE",
    "ArchSpec",
    "config_for",
    "config_from_spec",
    "count_params",
    "parse_size",
    "TensorSpec",
    "make_chunk",
    "saved_tensors",
    "tensor_chunks",
    "tensor_values",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "build_tokenizer",
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_STD",
    "LAYOUTS",
    "plan_files",
    "value_rules",
    "write_checkpoint",
    "write_safetensors",
]
