"""rocketllm serve on models whose cache keeps a recurrent or convolution state: /health says whether prefix reuse
is on, in which mode and why; a multi-turn chat through the server reuses each earlier turn's state and replies
exactly as with reuse off; a model whose forward drops a kept state serves with reuse off and says why at start."""

from __future__ import annotations

import itertools

import pytest
import torch
from serve_helpers import LiveServer

from rocketllm_cli.auto import AutoModel

TURNS = ("Name a number.", "Another one?", "And a third?")
DIGITS = [6 + ord(c) for c in "0123456789"]  # the synthetic tokenizer's byte tokens, which no merge joins


class DigitsOnly:
    """Greedy replies among digit tokens only: their text encodes back to the same ids, so the next turn's prompt
    extends what the last generation kept exactly (as a real model's reply text does), and which digit comes next
    still follows the model's logits."""

    def __init__(self, model) -> None:
        from transformers import LogitsProcessorList

        self.model, self.original, self.list = model, model.generate, LogitsProcessorList
        model.generate = self._generate

    def __call__(self, input_ids, scores):
        allowed = torch.full_like(scores, float("-inf"))
        allowed[:, DIGITS] = 0.0
        return scores + allowed

    def _generate(self, ids, **kwargs):
        return self.original(
            ids, logits_processor=self.list([*(kwargs.pop("logits_processor", None) or []), self]), **kwargs
        )

    def remove(self) -> None:
        self.model.__dict__.pop("generate", None)


def conversation(server) -> list[str]:
    client, messages, replies = server.openai(), [], []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        replies.append(reply.choices[0].message.content)
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies


@pytest.fixture(scope="module")
def lfm2(stateful_factory):
    model = AutoModel.from_pretrained(stateful_factory("lfm2"), device_cache_bytes="1GB")
    yield model
    model.close()


def test_health_says_reuse_extends_kept_states_and_a_chat_replies_as_without_it(lfm2):
    with LiveServer(lfm2) as server:
        health = server.http().get("/health").json()["prefix_cache"]
        assert health["enabled"] is True and health["mode"] == "extend"
        assert health["reason"].startswith("on: auto, and every weight is resident")
        assert "LinearAttentionLayer layers, whose state cannot be cropped back" in health["reason"]
        assert "a prompt reuses a kept one only when it extends it exactly" in health["reason"]
        assert server.state.startup_lines()[3] == f"prefix cache: {health['reason']}"
        digits = DigitsOnly(lfm2)
        try:
            reused = conversation(server)
            turns = server.history[-len(TURNS) :]
            server.state.generator.prefix_cache = None  # the same chat again, every prompt computed afresh
            fresh = conversation(server)
        finally:
            digits.remove()
        assert reused == fresh and all(r.isdigit() and len(r) == 6 for r in reused)
        assert turns[0]["reused_tokens"] == 0
        for before, turn in itertools.pairwise(turns):  # each turn's prompt and reply (but its last token) are reused
            assert turn["reused_tokens"] == before["prompt_tokens"] + before["generated_tokens"] - 1
        stats = server.http().get("/health").json()["prefix_cache"]
        assert stats["hits"] == 2 and stats["entries"] == 3 and stats["bytes"] > 0


def test_a_model_whose_forward_drops_a_kept_state_serves_with_reuse_off_and_says_why(stateful_factory):
    model = AutoModel.from_pretrained(stateful_factory("mamba"), device_cache_bytes="1GB")
    try:
        with LiveServer(model) as server:
            health = server.http().get("/health").json()["prefix_cache"]
            assert health["enabled"] is False and health["mode"] is None
            assert health["reason"].startswith(
                "off: the model's cache has LinearAttentionLayer layers, whose state cannot"
            )
            assert "gives other logits than a fresh prefill" in health["reason"]
            assert server.state.startup_lines()[3] == f"prefix cache: {health['reason']}"
            reply = server.openai().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert reply.usage.completion_tokens >= 1 and server.history[-1]["reused_tokens"] == 0
            assert not any("prefix" in line for line in server.logs)  # said once, at start, not again per request
    finally:
        model.close()
