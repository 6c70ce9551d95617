"""A live `rocketllm serve` app on 127.0.0.1 for tests, and a script that makes a tiny random model say given text.

with LiveServer(model) as server:               # uvicorn in a thread, on a free port
    server.openai().chat.completions.create(...)  # the real openai and anthropic clients
"""

from __future__ import annotations

import collections
import gc
import threading
import time
from pathlib import Path

import torch

GATE_TIMEOUT_S = 30


class LiveServer:
    def __init__(self, model, model_id: str = "tiny", tool_parser: str | None = None, **state_options) -> None:
        from rocketllm_cli.server.serving import make_server
        from rocketllm_cli.server.sockets import bind, freeze_loaded_heap
        from rocketllm_cli.server.state import ServerState

        self.logs: list[str] = []
        self.state = ServerState(model, model_id, tool_parser, log=self.logs.append, **state_options)
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(self.state, access_log=False, grace_s=2)  # the CLI's server, its stop included
        freeze_loaded_heap()  # as the CLI does before it serves (close() gives the test session's objects back)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def openai(self, api_key: str = "unused", **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kwargs)

    def anthropic(self, api_key: str = "unused", **kwargs):
        import anthropic

        return anthropic.Anthropic(base_url=self.url, api_key=api_key, max_retries=0, **kwargs)

    def http(self):
        import httpx

        return httpx.Client(base_url=self.url, timeout=60)

    @property
    def history(self) -> list[dict]:
        return list(self.state.worker.history)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        gc.unfreeze()
        self.state.close()
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Force:
    """A logits processor: the i-th new token is forced[i], then end-of-sequence."""

    def __init__(self, forced: list[int], prompt_len: int, eos: int) -> None:
        self.forced, self.prompt_len, self.eos = forced, prompt_len, eos

    def __call__(self, input_ids, scores):
        i = input_ids.shape[1] - self.prompt_len
        target = self.forced[i] if i < len(self.forced) else self.eos
        out = torch.full_like(scores, float("-inf"))
        out[:, target] = 0.0
        return out


class _Slow:
    """A logits processor that makes every step take `delay` seconds and never ends the sequence early."""

    def __init__(self, delay: float, eos: int) -> None:
        self.delay, self.eos = delay, eos

    def __call__(self, input_ids, scores):
        time.sleep(self.delay)
        scores[:, self.eos] = float("-inf")
        return scores


class Script:
    """Wraps a StreamingModel's generate (on the instance, so the engine's real path runs) to:
    say the queued replies token by token, record each prompt, hold generation at a gate, or slow it down."""

    def __init__(self, model) -> None:
        from transformers import LogitsProcessorList

        self.model = model
        self.replies: collections.deque[str] = collections.deque()
        self.prompts: list[list[int]] = []
        self.gate: threading.Event | None = None
        self.delay = 0.0
        self._list = LogitsProcessorList
        self._original = model.generate
        eos = model.generation_config.eos_token_id
        self.eos = int(eos[0] if isinstance(eos, list) else eos)
        model.generate = self._generate

    def say(self, *texts: str) -> "Script":
        self.replies.extend(texts)
        return self

    def prompt_text(self, index: int = -1) -> str:
        return self.model.tokenizer.decode(self.prompts[index])

    def _generate(self, ids, **kwargs):
        self.prompts.append(ids[0].tolist())
        if self.gate is not None:
            assert self.gate.wait(GATE_TIMEOUT_S), "the test never opened the gate"
        processors = self._list(kwargs.pop("logits_processor", None) or [])
        if self.replies:
            forced = self.model.tokenizer.encode(self.replies.popleft(), add_special_tokens=False)
            processors.append(_Force(forced, ids.shape[1], self.eos))
        if self.delay:
            processors.append(_Slow(self.delay, self.eos))
        return self._original(ids, logits_processor=processors, **kwargs)

    def remove(self) -> None:
        self.model.__dict__.pop("generate", None)


def with_template(source: Path, template: str, dest: Path) -> Path:
    """A copy of a checkpoint directory whose tokenizer carries another chat template."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(source, dest)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = template
    for name in ("chat_template.jinja", "chat_template.json"):
        (dest / name).unlink(missing_ok=True)
    tokenizer.save_pretrained(dest)
    return dest
