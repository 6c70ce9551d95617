"""A byte-level BPE tokenizer made offline: 6 special tokens, one token per byte, then 58 common English pieces.

Token id of byte b is b + 6; any text round-trips; the vocabulary is exactly the tiny configs' 320,
so every id a tiny model can emit decodes to text.
"""

from __future__ import annotations

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>")
SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}  # config kwargs
# Each piece is a merge of two earlier tokens; 6 + 256 + 58 = 320.
PIECES = (
    " t",
    " a",
    "he",
    "in",
    "re",
    "on",
    " s",
    "er",
    " w",
    "at",
    "en",
    "nd",
    " o",
    " c",
    "es",
    "is",
    "it",
    "or",
    " b",
    "ou",
    "ed",
    " f",
    "an",
    " p",
    "ar",
    "al",
    " m",
    " d",
    " h",
    "le",
    "as",
    " i",
    "ic",
    " l",
    " n",
    "ro",
    " e",
    "st",
    "ly",
    " g",
    "ll",
    "om",
    "ce",
    "ch",
    " u",
    "ve",
    "ur",
    "ing",
    "ion",
    "ent",
    " the",
    " in",
    " and",
    " of",
    " to",
    " is",
    " re",
    " th",
)
VOCAB_SIZE = len(SPECIAL_TOKENS) + 256 + len(PIECES)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(added: tuple[str, ...] = (), **named: str):
    """A PreTrainedTokenizerFast with bos/eos/pad/unk and a ChatML template; save it with save_pretrained.

    added: more special tokens, given ids from 320 on (a vision model's image tokens); named: attributes naming some of
    them (Gemma 3's processor reads `boi_token`, `eoi_token` and `image_token` off its tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ..compat import extra_special_tokens_kwargs

    to_char = _bytes_to_unicode()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({to_char[b]: len(SPECIAL_TOKENS) + b for b in range(256)})
    merges: list[tuple[str, str]] = []
    for piece in PIECES:
        token = "".join(to_char[b] for b in piece.encode())
        left, right = _apply_merges(token, merges)  # the two tokens BPE reaches for this piece so far
        merges.append((left, right))
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS) + list(added))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        **extra_special_tokens_kwargs(["<|im_start|>", "<|im_end|>"]),
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        **named,
    )


def _apply_merges(token: str, merges: list[tuple[str, str]]) -> list[str]:
    rank = {pair: i for i, pair in enumerate(merges)}
    parts = list(token)
    while len(parts) > 1:
        best, at = min((rank.get(pair, len(rank)), i) for i, pair in enumerate(zip(parts, parts[1:])))
        if best == len(rank):
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-in for each byte, the alphabet the ByteLevel pre-tokenizer emits.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + extra)
    return table
