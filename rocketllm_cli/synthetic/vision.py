"""Tiny random vision-language checkpoints (LLaVA, Qwen2.5-VL, Gemma 3) with a processor, built offline.

Each is a real transformers image-text-to-text model at toy size (a 2-block vision tower on 28x28 pictures, a
4-layer decoder of hidden 64), its weights random, saved with save_pretrained beside the synthetic byte tokenizer
(plus the family's image tokens) and an image processor of the family's own class, so AutoProcessor loads it:

    write_vlm("llava", dest)          # -> dest, with config, weights, tokenizer and processor
"""

from __future__ import annotations

import math
from pathlib import Path

from .tokenizer import SPECIAL_IDS, build_tokenizer

VLM_KINDS = ("llava", "qwen2_5_vl", "gemma3")
IMAGE_SIZE = 28  # pixels a side: 2 x 2 patches of 14
_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    **SPECIAL_IDS,
}
# What the chat template writes for one image: the processor expands it into the image's placeholder tokens.
_IMAGE_TEXT = {
    "llava": "<image>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",
}
_TOKENS = {
    "llava": ["<image>"],
    "qwen2_5_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "gemma3": ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
}


def chat_template(kind: str) -> str:
    """ChatML that renders content given as a string or as a list of text and image parts."""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}" + _IMAGE_TEXT[kind] + "{% elif part['type'] == 'text' %}{{ part['text'] "
        "}}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt "
        "%}<|im_start|>assistant\n{% endif %}"
    )


def write_vlm(kind: str, dest: Path, *, seed: int = 0, std: float = 0.3) -> Path:
    """A tiny random KIND checkpoint in DEST (config, safetensors, generation config, tokenizer, processor)."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    if kind not in VLM_KINDS:
        raise ValueError(f"unknown vision-language kind {kind!r}; expected one of {', '.join(VLM_KINDS)}")
    # Gemma 3's processor reads its image tokens off the tokenizer by name
    named = (
        {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
        if kind == "gemma3"
        else {}
    )
    tokenizer = build_tokenizer(tuple(_TOKENS[kind]), **named)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _TOKENS[kind]}
    tokenizer.chat_template = chat_template(kind)
    config = _config(kind, len(tokenizer), ids)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():  # the default 0.02 init makes a tiny model repeat one token; wider weights give varied output
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                # Gemma multiplies embeddings by sqrt(hidden)
                scaled = kind == "gemma3" and name.endswith("embed_tokens.weight")
                p.normal_(0.0, std * math.sqrt(64 / max(1, p[0].numel())) / (8.0 if scaled else 1.0))
            elif "norm" in name and "bias" not in name:
                p.fill_(0.0 if kind == "gemma3" else 1.0)  # Gemma's norms scale by 1 + weight
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    GenerationConfig(**SPECIAL_IDS).save_pretrained(dest)
    processor = _processor(kind, tokenizer)
    if processor is None:  # the image processor and the tokenizer alone, as the processor would have saved them
        _image_processor(kind).save_pretrained(dest)
        tokenizer.save_pretrained(dest)
    else:
        processor.save_pretrained(dest)
    return dest


def processor_needs_torchvision(kind: str) -> bool:
    """Qwen2.5-VL's processor carries a video processor, which transformers 5 builds only with torchvision installed."""
    from transformers.utils import is_torchvision_available

    return kind == "qwen2_5_vl" and not is_torchvision_available()


# the ViT tower LLaVA's CLIP and Gemma 3's SigLIP share here: two layers, 32 wide, 14-pixel patches
_TOWER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": IMAGE_SIZE,
    "patch_size": 14,
}


def _config(kind: str, vocab: int, ids: dict[str, int]):
    from transformers import AutoConfig

    text = {**_TEXT, "vocab_size": vocab}
    if kind == "llava":
        return AutoConfig.for_model(
            "llava",
            text_config={"model_type": "llama", **text},
            vision_config={"model_type": "clip_vision_model", **_TOWER, "projection_dim": 32},
            image_token_index=ids["<image>"],
            vision_feature_layer=-1,
            tie_word_embeddings=False,
        )
    if kind == "qwen2_5_vl":
        return AutoConfig.for_model(
            "qwen2_5_vl",
            text_config={
                **text,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            },
            vision_config={
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": 64,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 56,
                "fullatt_block_indexes": [1],
            },
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False,
        )
    return AutoConfig.for_model(
        "gemma3",
        text_config={"model_type": "gemma3_text", **text, "sliding_window": 512, "query_pre_attn_scalar": 16},
        vision_config={"model_type": "siglip_vision_model", **_TOWER},
        mm_tokens_per_image=4,
        image_token_index=ids["<image_soft_token>"],
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        **SPECIAL_IDS,
    )


def _image_processor(kind: str):
    """The family's image processor at tiny size (the Pillow backend where torchvision is absent)."""
    if kind == "llava":
        from transformers import CLIPImageProcessor as cls

        return cls(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    if kind == "qwen2_5_vl":
        from transformers import Qwen2VLImageProcessor as cls

        return cls(
            min_pixels=IMAGE_SIZE * IMAGE_SIZE,
            max_pixels=4 * IMAGE_SIZE * IMAGE_SIZE,
            patch_size=14,
            merge_size=2,
            temporal_patch_size=2,
        )
    from transformers import Gemma3ImageProcessor as cls

    return cls(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def _processor(kind: str, tokenizer):
    """The family's processor, or None where it cannot be built here (processor_needs_torchvision)."""
    template = chat_template(kind)
    image = _image_processor(kind)
    if kind == "llava":
        from transformers import LlavaProcessor

        return LlavaProcessor(
            image_processor=image,
            tokenizer=tokenizer,
            patch_size=14,
            vision_feature_select_strategy="default",
            image_token="<image>",
            num_additional_image_tokens=1,
            chat_template=template,
        )
    if kind == "qwen2_5_vl":
        if processor_needs_torchvision(kind):
            return None
        from transformers import Qwen2_5_VLProcessor, Qwen2VLVideoProcessor

        return Qwen2_5_VLProcessor(
            image_processor=image, tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(), chat_template=template
        )
    from transformers import Gemma3Processor

    return Gemma3Processor(image_processor=image, tokenizer=tokenizer, image_seq_length=4, chat_template=template)
