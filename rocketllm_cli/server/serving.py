"""The app under uvicorn: every log line on stderr, and a stop (Ctrl-C, SIGTERM) that ends open streams first.

On a stop, uvicorn closes its listening sockets, asks each connection to close once its response is done, and
waits up to GRACE_S before cancelling what still runs (a CancelledError traceback, and a stream cut without
its last event). So the server halts the worker before that wait: queued jobs end at once, the running one
after its current step or STOP_WAIT_S, whichever comes first, and each open stream sends its API's final
events (OpenAI's finish_reason and [DONE], Anthropic's message_delta and message_stop) and closes.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import signal
import sys
import threading

import uvicorn

from .app import create_app
from .state import ServerState

GRACE_S = 5  # uvicorn's wait for open responses once the worker halted; they end within STOP_WAIT_S, so a backstop
SWITCH_INTERVAL_S = 0.001  # the longest the event loop waits for the interpreter lock while the worker computes


def log_config() -> dict:
    """uvicorn's logging setup with every handler on stderr: its default puts the access log on stdout,
    which carries only results (the --json document)."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for handler in config["handlers"].values():
        handler["stream"] = "ext://sys.stderr"
    return config


class StoppingServer(uvicorn.Server):
    """uvicorn's server over one ServerState, which it halts before waiting for open connections."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.rocketllm_state = state
        self.on_started = None  # called once uvicorn listens and holds the signals: a Ctrl-C after it is a clean stop

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    async def shutdown(self, sockets=None) -> None:
        self.rocketllm_state.stop()
        await super().shutdown(sockets=sockets)


def make_server(state: ServerState, access_log: bool, grace_s: float = GRACE_S) -> StoppingServer:
    """The uvicorn server for `state`'s app, logging on stderr (one line per request when `access_log`).

    The worker thread runs Python between its tensor operations; at the interpreter's default switch interval (5 ms)
    the event loop waits that long for the lock each time it wakes (a request takes several wakes), which puts
    /health behind the worker by tens of milliseconds under load. 1 ms keeps it answering in a few."""
    if sys.getswitchinterval() > SWITCH_INTERVAL_S:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
    config = uvicorn.Config(
        create_app(state),
        log_level="warning",
        access_log=access_log,
        log_config=log_config(),
        timeout_graceful_shutdown=grace_s,
    )
    if access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    return StoppingServer(config, state)


@contextlib.contextmanager
def sigterm_as_ctrl_c():
    """While serving, SIGTERM does what Ctrl-C does. uvicorn stops on either while it holds the signals, but it
    raises the signal again once stopped, and one may come just before it takes them: there Python's default
    for SIGTERM ends the process at once (exit -15, no cleanup), while SIGINT's becomes a KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
