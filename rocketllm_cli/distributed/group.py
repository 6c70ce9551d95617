"""The process group the stages talk over: torch.distributed (c10d), gloo on CPUs and NCCL where every rank computes on
a CUDA device, formed from torchrun's variables; its liveness; and its messages.

Liveness: c10d has no timeout that suits an inference server (a blocking receive either waits forever or, once timed
out, closes the pair for good), so every rank counts a heartbeat in the rendezvous store and a watchdog thread reads
everyone's. A rank whose count has not moved for `timeout_s` is stopped or hung; a rank that exited closes its sockets,
which the blocked receive reports at once. Either way `failure` is set to one line naming the rank and its host, and
`on_failure` runs (the CLI prints it and exits; the server answers 503).

Messages: a pass is two sends from rank to rank: a fixed header of int64 and one byte payload holding the hidden state
and what the layers need beside it (attention mask, position ids, cache positions), each part 8-byte aligned.
"""

from __future__ import annotations

import datetime
import importlib
import os
import threading
import time

import torch
import torch.distributed as dist

from .torchrun import Launch, StageError, memory_cgroup, stage_address

HEADER_LEN = 48
OP_PASS, OP_STOP, OP_FAIL, OP_RESULT = 1, 2, 3, 4
# header fields
F_OP, F_NBYTES, F_PAST, F_CACHE, F_SEQ, F_COMPUTE_US, F_DEVICE_B, F_HOST_B, F_STORAGE_B, F_FINAL, F_PARTS = range(11)

# a part's code
WIRE_DTYPES = (None, torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.int32, torch.bool, torch.uint8)
MAX_DIMS = 4
NEVER_S = 7 * 24 * 3600  # the op timeout: a stage waits for the next request as long as its peers are alive


def _code(t: torch.Tensor | None) -> int:
    return 0 if t is None else WIRE_DTYPES.index(t.dtype)


def _dtype(code: int) -> torch.dtype:
    return WIRE_DTYPES[code]


def pack(header: torch.Tensor, parts: list[torch.Tensor | None]) -> torch.Tensor:
    """The payload of PARTS (each described in HEADER from F_PARTS on: dtype code, ndim, dims) as one uint8 tensor."""
    chunks, at = [], F_PARTS
    header[at] = len(parts)
    at += 1
    for t in parts:
        header[at] = _code(t)
        if t is None:
            header[at + 1] = 0
            at += 2 + MAX_DIMS
            continue
        if t.dim() > MAX_DIMS:
            raise StageError(f"a tensor of {t.dim()} dimensions cannot cross stages (at most {MAX_DIMS})")
        header[at + 1] = t.dim()
        for d, size in enumerate(t.shape):
            header[at + 2 + d] = size
        at += 2 + MAX_DIMS
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        chunks.append(raw)
        pad = -raw.numel() % 8
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8, device=raw.device))
    payload = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    header[F_NBYTES] = payload.numel()
    return payload


def unpack(header: torch.Tensor, payload: torch.Tensor) -> list[torch.Tensor | None]:
    out, at, offset = [], F_PARTS + 1, 0
    for _ in range(int(header[F_PARTS])):
        code, ndim = int(header[at]), int(header[at + 1])
        if code == 0:
            out.append(None)
        else:
            shape = [int(x) for x in header[at + 2 : at + 2 + ndim]]
            dtype = _dtype(code)
            n = 1
            for s in shape:
                n *= s
            nbytes = n * torch.empty((), dtype=dtype).element_size()
            out.append(payload[offset : offset + nbytes].view(dtype).view(shape))
            offset += nbytes + (-nbytes % 8)
        at += 2 + MAX_DIMS
    return out


class StageGroup:
    """This rank's membership of the pipeline: the c10d group, the hosts of every rank, heartbeats and the watchdog."""

    def __init__(self, launch: Launch, timeout_s: float, device: str = "cpu") -> None:
        self.launch = launch
        self.rank, self.world = launch.rank, launch.world
        self.timeout_s = float(timeout_s)
        self.failure: str | None = None
        # called once with the failure line, from the watchdog thread or a failed receive; by default a failure the main
        # thread will raise is left to it, and one the watchdog found (the main thread may be blocked for good) ends the
        # process
        self.on_failure = self._exit_from_watchdog
        self.open_stage = None  # the Stage of the model open now, if any (distributed/stages.py)
        self._stop = threading.Event()
        self._failed_once = threading.Lock()
        # NCCL where this rank computes on a CUDA device and the build has it (a capability, not a name); else gloo,
        # whose
        # messages are host tensors (a CUDA rank's hidden state is copied across)
        self.backend = (
            "nccl" if device.startswith("cuda") and torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        )
        self.device = torch.device("cpu")
        if self.backend == "nccl":
            torch.cuda.set_device(launch.local_rank % max(1, torch.cuda.device_count()))
            self.device = torch.device("cuda", torch.cuda.current_device())
        # a wildcard is refused before anything binds
        address = stage_address(launch) if self.backend == "gloo" else None
        self.store = self._store()
        self._round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's store outlives a restarted group
        self._gather()
        options = None
        if self.backend == "gloo":
            if address is not None:
                options = dist.ProcessGroupGloo._Options()
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
                options._timeout = datetime.timedelta(seconds=NEVER_S)
        # torch.distributed.nn binds group.WORLD as its functions' default argument when first imported (a tokenizer's
        # load imports it): imported after the group forms, it keeps the group alive past destroy_process_group, and
        # gloo's threads then meet the interpreter's exit (an abort now and then). Imported first, it binds None.
        importlib.import_module("torch.distributed.nn.functional")

        try:
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore("rocketllm/pg", self.store),
                rank=self.rank,
                world_size=self.world,
                timeout=datetime.timedelta(seconds=NEVER_S),
                pg_options=options,
            )
        except (RuntimeError, ValueError, OSError) as e:
            raise StageError(
                f"rank {self.rank} ({launch.host}) could not join the stages at "
                f"{launch.master_addr}:{launch.master_port} within {self.timeout_s:.0f} s: {_first_line(e)}"
            ) from None
        self.places = self.exchange((launch.host, memory_cgroup()))  # each rank's host and memory cgroup
        self.hosts = [host for host, _ in self.places]
        self._beats = {r: (-1, time.monotonic()) for r in range(self.world) if r != self.rank}
        self._thread = threading.Thread(target=self._watch, name="rocketllm-stage-watchdog", daemon=True)
        self._thread.start()

    def _gather(self) -> None:
        """Wait until every rank has reached the store, timeout_s at most: c10d's own wait is the op timeout (days)."""
        key = f"rocketllm/{self._round}/joined"
        joined = self.store.add(key, 1)
        if joined == self.world:
            self.store.set(f"rocketllm/{self._round}/all", "1")
        try:
            self.store.wait([f"rocketllm/{self._round}/all"], datetime.timedelta(seconds=self.timeout_s))
        except (RuntimeError, OSError):
            try:
                joined = self.store.add(key, 0)
            except (RuntimeError, OSError):
                pass
            launch = self.launch
            raise StageError(
                f"rank {self.rank} ({launch.host}) could not join the stages at "
                f"{launch.master_addr}:{launch.master_port}: "
                f"{joined} of {self.world} ranks came within {self.timeout_s:.0f} s (--stage-timeout-s); "
                f"start every rank "
                "with the same --rdzv-endpoint and WORLD_SIZE"
            ) from None

    def _store(self):
        """The rendezvous store: torchrun's agent's, or rank 0's own (as env:// makes it); joining waits timeout_s at
        most."""
        launch = self.launch
        host_it = launch.rank == 0 and not launch.agent_store
        try:
            return dist.TCPStore(
                launch.master_addr,
                launch.master_port,
                self.world if host_it else None,
                host_it,
                timeout=datetime.timedelta(seconds=self.timeout_s),
                wait_for_workers=False,
                use_libuv=True,
            )
        except (RuntimeError, OSError) as e:
            raise StageError(
                f"rank {launch.rank} ({launch.host}) could not reach the rendezvous at "
                f"{launch.master_addr}:"
                f"{launch.master_port} within {self.timeout_s:.0f} s: {_first_line(e)}; start every rank "
                f"with the same "
                "--rdzv-endpoint, rank 0's host first reachable"
            ) from None

    def name(self, rank: int) -> str:
        host = self.hosts[rank] if rank < len(self.hosts) else "?"
        return f"rank {rank} ({host})"

    # -- collective exchanges at start ------------------------------------------------------------------------------
    def exchange(self, obj) -> list:
        """Every rank's OBJ, in rank order (all_gather_object)."""
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's OBJ on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # -- point to point --------------------------------------------------------------------------------------------
    def send(self, header: torch.Tensor, payload: torch.Tensor, dst: int) -> None:
        try:
            dist.send(header.to(self.device), dst)
            if payload.numel():
                dist.send(payload, dst)
        except RuntimeError as e:
            raise self.fail(f"{self.name(dst)} stopped answering ({_first_line(e)})") from None

    def recv(self, src: int) -> tuple[torch.Tensor, torch.Tensor]:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        try:
            dist.recv(header, src)
            header = header.cpu()  # read field by field on the host
            payload = torch.empty(int(header[F_NBYTES]), dtype=torch.uint8, device=self.device)
            if payload.numel():
                dist.recv(payload, src)
        except RuntimeError as e:
            raise self.fail(f"{self.name(src)} stopped answering ({_first_line(e)})") from None
        return header, payload

    # -- liveness --------------------------------------------------------------------------------------------------
    def fail(self, line: str) -> StageError:
        """Record the first failure (later ones are its echoes), run on_failure once; the StageError to raise."""
        with self._failed_once:
            first = self.failure is None
            if first:
                self.failure = line
        if first and self.on_failure is not None:
            self.on_failure(line)
        return StageError(self.failure or line)

    def _exit_from_watchdog(self, line: str) -> None:
        if threading.current_thread() is threading.main_thread():
            return
        from ..output import write_stderr

        write_stderr(f"error: {line}" if self.rank == 0 else f"error: {self.name(self.rank)} stops: {line}")
        os._exit(1)

    def _watch(self) -> None:
        period = max(0.2, min(2.0, self.timeout_s / 8))
        key = f"rocketllm/beat/{self.rank}"
        while not self._stop.wait(period):
            try:
                self.store.add(key, 1)
                for r in list(self._beats):
                    count = self.store.add(f"rocketllm/beat/{r}", 0)
                    last, since = self._beats[r]
                    now = time.monotonic()
                    if count != last:
                        self._beats[r] = (count, now)
                    elif now - since > self.timeout_s:
                        self.fail(
                            f"{self.name(r)} stopped answering: no heartbeat for {now - since:.0f} s "
                            f"(--stage-timeout-s)"
                        )
                        return
            except Exception as e:  # noqa: BLE001 - the store's host is gone, whatever the error type
                if self._stop.is_set():
                    return
                self.fail(
                    f"the rendezvous at {self.launch.master_addr}:{self.launch.master_port} is gone "
                    f"({_first_line(e)}): "
                    "rank 0 or its launcher ended"
                )
                return

    def end(self) -> None:
        """Rank 0, at exit: tell the other ranks no more models come (they leave run_later_stage), then close."""
        told = False
        if self.rank == 0 and not self.closed and self.failure is None:
            try:
                if self.open_stage is not None:  # a model still open (a server whose close was cut short): the others
                    self.open_stage.stop_all(final=True)  # wait in their serve loop, so the word goes round the ring
                else:
                    self.broadcast({"op": "end"})
                told = True
            except Exception:  # noqa: BLE001 - a rank already gone: nothing to tell it
                pass
        self.close(orderly=told)

    def _stop_watchdog(self) -> None:
        """Stop the heartbeats and wait for the thread, so no store call is under way while the group and store go."""
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.timeout_s + 5)

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def close(self, orderly: bool = False) -> None:
        """Stop the watchdog; ORDERLY (every rank closes now, told so by rank 0): leave together, so the rank hosting
        the rendezvous store is not gone while another still talks to it; then destroy the group and drop the store."""
        if self.closed:
            return
        self._stop_watchdog()
        try:
            if dist.is_initialized():
                if orderly and self.failure is None:
                    dist.barrier()
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - closing after a peer failed: nothing left to tidy
            pass
        self.store = None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    # gloo's messages start with the source file that raised them: drop it
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    text = text.split(" This is typically caused by", 1)[0]  # gloo's advice to read the other rank's log: we name it
    return text.removesuffix(" GLHF! 🏖️").strip().rstrip(".")
