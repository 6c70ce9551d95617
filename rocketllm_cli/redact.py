"""Remove private data from text meant to be pasted: home directory, user name, host name, secret-looking values."""

from __future__ import annotations

import getpass
import os
import re
import socket  # only gethostname(), which opens no connection

SECRET_NAMES = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL|AUTH", re.IGNORECASE)


def redact(text: str) -> str:
    """Home prefix -> ~, then the user name as a path component -> <user>, the host name -> <host>."""
    home = os.path.expanduser("~").rstrip("/")
    for prefix in {home, os.path.realpath(home)}:
        if len(prefix) > 1:
            text = re.sub(re.escape(prefix) + r"(?=/|\b|$)", "~", text)
    for user in _user_names():
        text = re.sub(rf"(?<![\w.-]){re.escape(user)}(?![\w-])", "<user>", text)
    host = _host_name()
    if host:
        text = re.sub(rf"(?<![\w-]){re.escape(host)}(?![\w-])", "<host>", text)
    return text


def redact_env_value(name: str, value: str) -> str:
    return "<redacted>" if SECRET_NAMES.search(name) else redact(value)


def _user_names() -> set[str]:
    names = {os.environ.get(var, "") for var in ("USER", "LOGNAME", "USERNAME")}
    try:
        names.add(getpass.getuser())
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        pass
    # Too short or too common to replace without mangling ordinary words.
    return {n for n in names if len(n) >= 3 and n not in {"root", "user", "nobody"}}


def _host_name() -> str:
    try:
        host = socket.gethostname().split(".")[0]
    except OSError:
        return ""
    return host if len(host) >= 3 and host not in {"localhost"} else ""


def redact_tree(value):
    """VALUE (a JSON-shaped document) with every string in it redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_tree(v) for v in value]
    return value
