"""doctor and profile, beyond tests/test_doctor.py: no Python process they start (cpuinfo runs in a child
interpreter) opens a socket, and their output carries no machine identifier (host name, machine and boot ids,
MAC addresses, disk serials and UUIDs, DMI serials) and nothing shaped like a UUID."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HOST = "zq9hostname"
USER = "zq9user"
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)
NETWORK_EVENTS = (
    "socket.__new__",
    "socket.connect",
    "socket.bind",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyaddr",
    "socket.getnameinfo",
    "socket.sendto",
    "socket.sendmsg",
    "urllib.Request",
)

# Installed in every Python process of the run (the doctor and the cpuinfo child it starts) through PYTHONPATH.
SITECUSTOMIZE = '''
import os, sys
_log = os.environ["AUDIT_LOG"]
_watch = tuple(os.environ["AUDIT_EVENTS"].split(","))
def _hook(event, args):
    if event.startswith(_watch):
        with open(_log, "a") as f:
            f.write(f"{os.getpid()} {event} {args!r:.200}\\n")
sys.addaudithook(_hook)
'''


def machine_identifiers() -> dict[str, str]:
    """Identifiers of this machine that a report must never contain (those readable here, 6 characters or more)."""
    found: dict[str, str] = {}

    def read(label: str, path: Path) -> None:
        try:
            value = path.read_text(errors="replace").strip()
        except OSError:
            return
        if len(value) >= 6 and set(value) - set("0:-"):
            found[f"{label} ({path})"] = value

    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id", "/proc/sys/kernel/random/boot_id"):
        read("id", Path(path))
    for name in ("product_uuid", "product_serial", "board_serial", "chassis_serial"):
        read("dmi", Path("/sys/class/dmi/id") / name)
    for path in Path("/sys/class/net").glob("*/address"):
        read("mac", path)
    for pattern in ("*/device/serial", "*/device/wwid", "*/wwid", "*/serial"):
        for path in Path("/sys/block").glob(pattern):
            read("disk", path)
    for folder in ("by-uuid", "by-partuuid", "by-id"):
        for path in Path("/dev/disk", folder).glob("*") if Path("/dev/disk", folder).is_dir() else []:
            if len(path.name) >= 6:
                found[f"disk ({path})"] = path.name
    host = socket.gethostname().split(".")[0]
    if len(host) >= 6:
        found["host name"] = host
    return found


def _unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-ru", "sh", "-c", f"hostname {HOST}"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    """doctor (measuring afresh), doctor --json and profile, each in its own process with a private home and user
    name, the audit hook in every Python process, and (where a UTS namespace is allowed) a host name of its own."""
    root = tmp_path_factory.mktemp("doctor-privacy")
    home = root / USER
    model = home / "models" / "tiny"
    shutil.copytree(tiny_checkpoint, model)
    hook_dir = root / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = root / "audit.log"
    env = {k: v for k, v in os.environ.items() if k not in ("ROCKETLLM_CACHE", "XDG_CACHE_HOME", "PYTHONPATH")}
    env.update(
        HOME=str(home),
        USER=USER,
        LOGNAME=USER,
        ROCKETLLM_PROBE_BYTES="32MiB",
        PYTHONPATH=str(hook_dir),
        AUDIT_LOG=str(log),
        AUDIT_EVENTS=",".join(NETWORK_EVENTS),
    )
    own_host = _unshare_works()
    outputs = []
    for args in (
        ["doctor", "--refresh", "--model", str(model)],
        ["doctor", "--model", str(model), "--json"],
        ["profile", "--model", str(model)],
    ):
        command = [sys.executable, "-m", "rocketllm_cli", *args]
        if own_host:
            command = ["unshare", "-ru", "sh", "-c", f'hostname {HOST} && exec "$@"', "sh", *command]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(done.stdout + done.stderr)
    return outputs, log, own_host, home


def test_no_python_process_of_doctor_opens_a_socket(runs):
    outputs, log, _, _ = runs
    events = log.read_text() if log.exists() else ""
    assert events == "", events
    assert "## Measured bandwidths" in outputs[0]  # it did measure, with the hook in place


def test_reports_carry_no_machine_identifier(runs):
    outputs, _, own_host, home = runs
    secrets = {**machine_identifiers(), "user name": USER, "home": str(home)}
    if own_host:
        secrets["host name (namespace)"] = HOST
    for text in outputs:
        for label, value in secrets.items():
            assert value not in text, f"{label} appears in the report"
        assert not UUID.search(text), UUID.search(text).group(0)
