"""Text in, text out: prompts, sampling settings, the one generation loop, the prefix cache."""
