"""ComputeThreads: torch's thread count follows the cores other processes leave free, read from /proc.

A fake /proc (stat and self/stat written by the test) and a fake clock make every decision exact: what others
used is the machine's busy time less this process's own, over the wall time between samples."""

from __future__ import annotations

import os

import pytest

from rocketllm_cli import threads
from rocketllm_cli.threads import ComputeThreads

HZ = os.sysconf("SC_CLK_TCK")


class FakeProc:
    """/proc/stat for two CPUs and /proc/self/stat, advanced by what others and this process use per second."""

    def __init__(self, root, cpus: int = 2) -> None:
        self.root, self.cpus = root, cpus
        (root / "self").mkdir(parents=True)
        self.busy = self.own = 0
        self.now = 100.0
        self.write()

    def advance(
        self, seconds: float, others_cores: float, own_cores: float, steal_cores: float = 0.0, child_cores: float = 0.0
    ) -> None:
        self.now += seconds
        self.own += round(own_cores * seconds * HZ)
        self.children = getattr(self, "children", 0) + round(child_cores * seconds * HZ)
        self.busy += round(child_cores * seconds * HZ)
        self.busy += round((others_cores + own_cores) * seconds * HZ)
        self.steal = getattr(self, "steal", 0) + round(steal_cores * seconds * HZ)
        self.write()

    def write(self) -> None:
        steal = getattr(self, "steal", 0)
        idle = 10_000_000
        lines = [f"cpu  {self.busy} 0 0 {idle} 0 0 0 {steal} 0 0"]
        lines += [f"cpu{i} 0 0 0 0 0 0 0 0 0 0" for i in range(self.cpus)]
        (self.root / "stat").write_text("\n".join(lines) + "\nintr 0\n")
        # pid (comm with ) and spaces) state ppid ... utime(14) stime(15) cutime(16) cstime(17)
        rest = ["S"] + ["0"] * 10 + [str(self.own), "0", str(getattr(self, "children", 0)), "0"] + ["0"] * 28
        (self.root / "self" / "stat").write_text(f"4242 (python (x) y) {' '.join(rest)}\n")


@pytest.fixture
def machine(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_available_cpus", lambda total: total)
    proc = FakeProc(tmp_path / "proc")
    state = {"threads": 2, "sets": []}

    def set_threads(n):
        state["threads"] = n
        state["sets"].append(n)

    ct = ComputeThreads(
        proc=str(proc.root), set_threads=set_threads, get_threads=lambda: state["threads"], clock=lambda: proc.now
    )
    return proc, ct, state


def test_an_idle_machine_keeps_every_thread_and_a_busy_one_gets_one(machine):
    proc, ct, state = machine
    ct.poll()  # the first sample: nothing decided yet
    assert state["sets"] == [] and ct.most == 2
    proc.advance(1.0, others_cores=0.05, own_cores=2.0)
    ct.poll()
    assert state["threads"] == 2 and state["sets"] == []  # unchanged: never set for nothing
    proc.advance(1.0, others_cores=1.0, own_cores=1.0)  # one CPU-bound process beside us
    ct.poll()
    assert state["threads"] == 1 and abs(ct.others - 1.0) < 0.02
    assert "1 of 2" in ct.describe() and "1.00 cores used by others" in ct.describe()
    ct.restore()  # a model closed: torch's count again, and nothing measured until two more samples
    assert state["threads"] == 2 and ct.describe().startswith("2, torch's default until")
    ct.poll()
    proc.advance(1.0, others_cores=1.0, own_cores=1.0)
    ct.poll()
    assert state["threads"] == 1
    proc.advance(1.0, others_cores=0.1, own_cores=1.0)  # it ended
    ct.poll()
    assert state["sets"] == [1, 2, 1, 2]


def test_a_child_this_process_waited_for_is_its_own_work(machine):
    """The runtime probe's interpreter or the native build's compilers, once waited for, are this process's own CPU
    time (cutime, cstime), not another process's: the cores stay ours."""
    proc, ct, state = machine
    ct.poll()
    proc.advance(1.0, others_cores=0.05, own_cores=0.3, child_cores=1.0)
    ct.poll()
    assert state["threads"] == 2 and ct.others < 0.1


def test_samples_are_at_most_every_interval_and_steal_counts_as_others(machine):
    proc, ct, state = machine
    ct.poll()
    proc.advance(0.2, others_cores=2.0, own_cores=0.0)
    ct.poll()  # too soon: not sampled
    assert state["sets"] == []
    proc.advance(0.4, others_cores=0.0, own_cores=0.5, steal_cores=1.2)  # the hypervisor ran other guests
    ct.poll()
    assert state["threads"] == 1


def test_never_fewer_than_one_nor_more_than_torchs_own_count(machine):
    proc, ct, state = machine
    proc.cpus = 4  # more cores than torch's default of 2
    ct.poll()
    proc.advance(1.0, others_cores=5.0, own_cores=0.0)
    ct.poll()
    assert state["threads"] == 1
    proc.advance(1.0, others_cores=0.0, own_cores=0.0)
    ct.poll()
    assert state["threads"] == 2  # torch's default, not the 4 free cores


def test_a_callers_own_count_stands_and_restore_gives_back_torchs(machine):
    proc, ct, state = machine
    ct.poll()
    proc.advance(1.0, others_cores=1.0, own_cores=1.0)
    ct.poll()
    assert state["threads"] == 1
    ct.restore()
    assert state["threads"] == 2
    state["threads"] = 7  # the caller's torch.set_num_threads(7)
    proc.advance(1.0, others_cores=1.0, own_cores=1.0)
    ct.poll()
    assert state["threads"] == 7 and not ct.enabled and "by the caller" in ct.describe()


def test_a_decode_on_the_native_kernels_gives_them_the_cores_and_torch_one(machine):
    proc, ct, state = machine
    ct.poll()
    proc.advance(1.0, others_cores=0.0, own_cores=2.0)
    ct.poll(native_decode=True)
    assert state["threads"] == 1 and ct.native_pass and ct.native_threads() == 2
    assert "torch one" in ct.describe()
    proc.advance(0.1, others_cores=0.0, own_cores=0.1)
    ct.poll(native_decode=True)  # every decode pass, sampled or not: still ours, not "set by the caller"
    assert ct.enabled and state["threads"] == 1
    ct.poll()  # a prefill: torch computes too
    assert state["threads"] == 2 and not ct.native_pass
    proc.advance(1.0, others_cores=1.0, own_cores=1.0)  # a busy neighbour: the kernels get the one free core
    ct.poll(native_decode=True)
    assert state["threads"] == 1 and ct.native_threads() == 1
    ct.restore()
    assert state["threads"] == 2 and not ct.native_pass and state["sets"] == [1, 2, 1, 2]


def test_omp_num_threads_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    ct = ComputeThreads(proc=str(tmp_path), set_threads=lambda n: pytest.fail("set"), get_threads=lambda: 3)
    ct.poll()
    assert not ct.enabled and "OMP_NUM_THREADS" in ct.describe()


def test_the_real_proc_reads(monkeypatch):
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc on this system")
    busy, own, cpus = ComputeThreads()._read()
    assert busy >= own >= 0 and cpus >= 1


def test_the_wait_policy_is_the_users_where_set(monkeypatch):
    monkeypatch.setattr(threads, "_decision", None)
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    assert threads.wait_policy() == "GOMP_SPINCOUNT=5, set by the user"
    monkeypatch.setattr(threads, "_decision", None)
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert "OpenMP's default spin" in threads.wait_policy()
