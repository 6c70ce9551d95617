"""Whether this process is one stage of a pipeline: torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...), read
without importing torch, so a single-process command pays nothing for them."""

from __future__ import annotations

import contextlib
import contextvars
import ipaddress
import os
import socket
from dataclasses import dataclass

from ..errors import RocketError

ALLOW_ANY = "ROCKETLLM_STAGE_ALLOW_ANY"  # 1: let gloo pick its own interface, a wildcard rendezvous address included
# the address this rank's stage binds to (default: the one that reaches MASTER_ADDR)
ADDRESS = "ROCKETLLM_STAGE_ADDRESS"
WILDCARDS = ("0.0.0.0", "::", "[::]", "*")


class StageError(RocketError):
    """A pipeline stage could not start, or a rank failed: one line naming the rank and its host."""


@dataclass(frozen=True)
class Launch:
    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the rendezvous store (else rank 0 does, as env:// does)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def host(self) -> str:
        return socket.gethostname()


_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("rocketllm_alone", default=False)


@contextlib.contextmanager
def alone():
    """Within: models load in this process alone, whatever the launch (rank 0's draft model)."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


def launched(env=os.environ) -> Launch | None:
    """The launch this process is part of, or None when it runs alone (no WORLD_SIZE, or 1)."""
    if _ALONE.get():
        return None
    world = env.get("WORLD_SIZE", "")
    if world in ("", "1"):
        return None
    try:
        values = {
            name: int(env.get(name, default))
            for name, default in (
                ("WORLD_SIZE", "1"),
                ("RANK", "-1"),
                ("LOCAL_RANK", "0"),
                ("LOCAL_WORLD_SIZE", world),
                ("MASTER_PORT", "-1"),
            )
        }
    except ValueError:
        raise StageError(
            "WORLD_SIZE, RANK, LOCAL_RANK and MASTER_PORT must be integers; launch the stages with torchrun"
        ) from None
    rank, size = values["RANK"], values["WORLD_SIZE"]
    if not 0 <= rank < size:
        raise StageError(
            f"RANK {env.get('RANK', '(unset)')} is not within WORLD_SIZE {size}; launch the stages with torchrun"
        )
    addr = env.get("MASTER_ADDR", "")
    if not addr or values["MASTER_PORT"] <= 0:
        raise StageError(
            "MASTER_ADDR and MASTER_PORT are not set; launch the stages with torchrun (--rdzv-endpoint HOST:PORT)"
        )
    return Launch(
        rank,
        size,
        values["LOCAL_RANK"],
        values["LOCAL_WORLD_SIZE"],
        addr,
        values["MASTER_PORT"],
        env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
    )


def stage_address(launch: Launch, env=os.environ) -> str | None:
    """The address this rank's gloo transport binds to, or None to let gloo choose (ROCKETLLM_STAGE_ALLOW_ANY=1).

    c10d authenticates nobody, so a stage binds to one address: ROCKETLLM_STAGE_ADDRESS, else the loopback address when
    the rendezvous is on this host, else the local address that routes to MASTER_ADDR. A wildcard is refused unless
    asked."""
    allow_any = env.get(ALLOW_ANY, "") not in ("", "0", "false", "no")
    given = env.get(ADDRESS, "").strip()
    for what, value in ((ADDRESS, given), ("MASTER_ADDR", launch.master_addr)):
        if value in WILDCARDS and not allow_any:
            raise StageError(
                f"{what} {value} is a wildcard: stages have no authentication, so each binds to one address; give this "
                f"host's address on the trusted network (or set {ALLOW_ANY}=1 to let every interface accept stages)"
            )
    if allow_any and not given:
        return None
    if given:
        return given
    return local_address_towards(launch.master_addr)


def local_address_towards(host: str) -> str:
    """This host's address on the route to HOST (a UDP socket connected, nothing sent); loopback for a loopback HOST."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError as e:
        raise StageError(
            f"MASTER_ADDR {host} does not resolve ({e.strerror or e}); give the rendezvous host's address"
        ) from None
    family, _, _, _, sockaddr = infos[0]
    if ipaddress.ip_address(sockaddr[0].split("%")[0]).is_loopback:
        return sockaddr[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((sockaddr[0], 9))
            return s.getsockname()[0]
        except OSError as e:
            raise StageError(
                f"no route to MASTER_ADDR {host} ({e.strerror or e}); check the network between the hosts"
            ) from None


def memory_cgroup() -> str:
    """This process's memory cgroup (v1's memory controller, else v2's unified path); "" where /proc does not say."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return ""
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
    return next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), "")
