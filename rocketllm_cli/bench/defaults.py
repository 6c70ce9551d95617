"""What a bench run measures unless told otherwise: read by the request dataclasses and by the CLI's options and
help."""

DECODE_TOKENS = 8  # decode tokens timed per regime (after the warm-up)
PROMPT_TOKENS = 16  # length of the fixed prompt
REPLY_TOKENS = 32  # reply length per turn of a conversation replay
BATCH_REGIME = "storage"  # a batch sweep measures one regime: by default the one where every pass streams every weight
CONVERSATION_REGIME = "resident"  # where prefix reuse pays; a streaming regime shows that it does not
PERPLEXITY_WINDOW = 512  # tokens per --perplexity pass (less where the model's context is shorter); stride: half of it
PERPLEXITY_REGIME = "storage"  # every pass streams every weight: the cost a window's tokens share
GRAMMAR_TOKENS = 64  # tokens a --json-schema reply may run to (and its free twin then runs exactly as far)
