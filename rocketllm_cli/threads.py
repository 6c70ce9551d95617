"""torch's CPU threads: how they wait between parallel regions (fixed before torch loads) and how many compute
(followed while the model runs).

GNU OpenMP (the runtime torch's CPU build ships) spins a thread after each parallel region before it sleeps. A
decode step is hundreds of short kernels with Python between them, so a thread that has gone to sleep is woken
hundreds of times per token; on a virtual machine each wake is an interrupt between CPUs, and a short spin
(GOMP_SPINCOUNT=1000) measured 1.6-2.7x slower per token than OpenMP's default spin (docs/HARDWARE.md, "OpenMP
threads"). Spinning costs only when something else wants the cores: then a spinning thread takes the core its
team's other thread, or another process, needs. So RocketLLM keeps OpenMP's default spin and instead runs as many
compute threads as there are cores other processes leave free (ComputeThreads): on a busy machine one thread, which
has no partner to wake or to spin for. A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins, and OMP_NUM_THREADS
(or a caller's own torch.set_num_threads) fixes the count.
"""

from __future__ import annotations

import math
import os
import sys
import time

USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_decision: str | None = None


def wait_policy() -> str:
    """How torch's OpenMP threads wait, worded: the user's variables, or OpenMP's default spin."""
    global _decision
    if _decision is None:
        chosen = [f"{n}={os.environ[n]}" for n in USER_VARIABLES if n in os.environ]
        if chosen:
            _decision = f"{', '.join(chosen)}, set by the user"
        else:
            _decision = (
                "OpenMP's default spin after each parallel region (a decode step's hundreds of short kernels "
                "never wait for a sleeping thread); compute threads follow the free cores instead"
            )
    return _decision


class ComputeThreads:
    """torch's intra-op thread count, following the cores other processes leave free.

    poll() is called at every forward pass and samples at most every INTERVAL_S: the CPU time all processes used
    (/proc/stat, steal included: a hypervisor's other guests) less this process's own (/proc/self/stat, all its
    threads), over the wall time between samples, is what others used. Threads = the cores this process may run on
    less that, rounded, between 1 and torch's own default. Off where OMP_NUM_THREADS is set, where /proc is not,
    and from the moment a caller sets torch's thread count itself."""

    INTERVAL_S = 0.5

    def __init__(self, proc: str = "/proc", set_threads=None, get_threads=None, clock=time.monotonic) -> None:
        self.proc = proc
        self._set_threads, self._get_threads = set_threads, get_threads
        self.clock = clock
        self.enabled = "OMP_NUM_THREADS" not in os.environ and os.path.exists(os.path.join(proc, "stat"))
        self.reason = (
            "" if self.enabled else ("OMP_NUM_THREADS is set" if "OMP_NUM_THREADS" in os.environ else "no /proc/stat")
        )
        self.most: int | None = None  # torch's default count, the most ever used
        self.current: int | None = None  # the compute threads the free cores allow now
        self.native_pass = False  # this pass is a decode on the native kernels: they get `current`, torch one thread
        self._torch: int | None = None  # what this object last set torch's count to
        self.others: float | None = None  # cores other processes used over the last interval (None: not yet measured)
        self._last: tuple[float, int, int] | None = None  # (wall, all busy ticks, own ticks)

    def poll(self, native_decode: bool = False) -> None:
        """Sample if INTERVAL_S has passed since the last sample; set the thread count if it changed.

        NATIVE_DECODE: the pass about to run computes every product on the native kernels (a decode step, or a
        prompt short of the dense crossover: stream/nativepass.py): torch gets one thread and the kernels' own pool
        the free cores (native_pass). Its products are hundreds of short calls with torch's small ops between them;
        torch's OpenMP threads spinning after each op took the cores the pool's workers needed (SmolLM2 Q4_1, 2
        cores: 25-30 ms/token with both on two threads, 16 with the cores the pool's alone). A longer prompt, whose
        large products torch computes too, keeps both."""
        if not self.enabled:
            self.native_pass = False
            return
        self._sample()
        if not self.enabled:  # the caller chose a count
            self.native_pass = False
            return
        self.native_pass = native_decode
        want = 1 if native_decode else self.current
        if want is not None and want != self._torch:
            self._set(want)
            self._torch = want

    def native_threads(self) -> int | None:
        """The threads the native kernels get in a native_pass: the free cores' count."""
        return self.current

    def _sample(self) -> None:
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.INTERVAL_S:
            return
        try:
            busy, own, cpus = self._read()
        except (OSError, ValueError, IndexError):
            self.enabled, self.reason = False, "/proc/stat unreadable"
            return
        last, self._last = self._last, (now, busy, own)
        if self.most is None:
            self.most = self.current = self._torch = self._get()
        elif self._get() != self._torch:  # the caller chose a count: theirs stands from now on
            self.enabled, self.reason = False, f"set to {self._get()} by the caller"
            return
        if last is None or now <= last[0]:
            return
        ticks = os.sysconf("SC_CLK_TCK") * (now - last[0])
        others_all = max(0.0, (busy - last[1]) - (own - last[2])) / ticks
        available = _available_cpus(cpus)
        # others fill the cores outside this process's set first
        self.others = max(0.0, others_all - (cpus - available))
        self.current = max(1, min(self.most, math.floor(available - self.others + 0.5)))

    def restore(self) -> None:
        """Back to torch's default count (a model closed: what runs next in this process starts as it would have)."""
        if self.enabled and self.most is not None and self._torch != self.most:
            self._set(self.most)
            self._torch = self.most
        if self.most is not None:
            self.current = self.most
        self._last = None
        self.others = None
        self.native_pass = False

    def describe(self) -> str:
        if not self.enabled:
            return f"torch's own count ({self.reason})" if self.reason else "torch's own count"
        if self.others is None:
            now = f"{self._get()}, " if "torch" in sys.modules else ""
            return (
                f"{now}torch's default until the cores other processes leave free are measured (every "
                f"{self.INTERVAL_S:g} s while a model runs)"
            )
        return (
            f"{self.current} of {self.most}: the cores other processes leave free ({self.others:.2f} cores used "
            f"by others between the last two samples, {self.INTERVAL_S:g} s or more apart)"
            + ("; a decode on the native kernels gives them these and torch one" if self.native_pass else "")
        )

    def _read(self) -> tuple[int, int, int]:
        with open(os.path.join(self.proc, "stat")) as f:
            lines = f.read().splitlines()
        fields = [int(v) for v in lines[0].split()[1:]]
        # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user and nice]
        busy = sum(fields[:3]) + sum(fields[5:8])
        cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        with open(os.path.join(self.proc, "self", "stat")) as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        # utime, stime (fields 14 and 15): every thread of the process; cutime, cstime (16 and 17): the children it
        # has waited for (the runtime probe's interpreter, the native build's compilers), its own work too. Read as
        # others they left a first doctor one thread for the kernel rates it measured right after.
        own = sum(int(v) for v in after_name[11:15])
        return busy, own, max(1, cpus)

    def _get(self) -> int:
        if self._get_threads is not None:
            return self._get_threads()
        import torch

        return torch.get_num_threads()

    def _set(self, n: int) -> None:
        if self._set_threads is not None:
            self._set_threads(n)
            return
        import torch

        torch.set_num_threads(n)


def _available_cpus(total: int) -> int:
    try:
        return max(1, min(total, len(os.sched_getaffinity(0))))
    except (AttributeError, OSError):
        return total


COMPUTE_THREADS = ComputeThreads() if sys.platform.startswith("linux") else ComputeThreads(proc="/nonexistent")


# how much less a helper process started beside the main work (the native build's compilers, the runtime-memory
# probe's interpreter) is scheduled than the process that waits on nothing: on a 2-core machine five compilers and an
# interpreter beside a first run's imports took its core from it; once the main work waits on them they have the CPU
BACKGROUND_NICENESS = 10


def background_priority() -> None:
    """For subprocess's preexec_fn: the child runs at BACKGROUND_NICENESS (where the OS allows it; never fails)."""
    try:
        os.nice(BACKGROUND_NICENESS)
    except OSError:
        pass
