"""The layering contract in pyproject.toml ([tool.importlinter]): no module imports from a layer above its own,
imports inside functions included. A new upward import fails here; the standing ones are listed there as debt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.compat


def test_no_module_imports_from_a_layer_above_its_own():
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout, done.stdout[-2000:]


def test_no_two_modules_import_each_other_through_any_path():
    """No circle of imports between modules (imports inside functions counted; annotation-only imports under
    TYPE_CHECKING are not run and are left out): a module's dependencies can be read without finding it again."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (pip install -e '.[dev]')")
    graph = grimp.build_graph("rocketllm_cli", cache_dir=None, exclude_type_checking_imports=True)
    circles = [sorted(found) for found in _strongly_connected(graph) if len(found) > 1]
    assert not circles, circles


def _strongly_connected(graph) -> list[set[str]]:
    """Tarjan's components of the module graph, iteratively (the package's depth would do recursively too)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                found.append(component)
    return found


def test_no_line_is_longer_than_the_limit():
    """pyproject.toml's [tool.ruff] line length, over the package, the tests, benchmarks and scripts."""
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    trees = [
        name for name in ("rocketllm_cli", "rocketllm", "tests", "benchmarks", "scripts") if (ROOT / name).is_dir()
    ]
    done = subprocess.run(
        [str(ruff), "check", "--no-cache", *trees], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


MODULE_LINES = 400  # a module longer than this does more than one job a reader can name


def test_no_module_of_the_package_is_longer_than_the_limit():
    """Each module of the package at most MODULE_LINES lines (docs/ARCHITECTURE.md: split by role)."""
    long = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / "rocketllm_cli").rglob("*.py"))
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MODULE_LINES
    }
    assert not long, long


# Module names that stand in more than one package, each meaning the same kind of thing in its room: the commands are
# named after their subcommands, bench's modules after what they measure, and app/report are each room's own.
SHARED_NAMES = {
    "app.py": "the CLI (app.py) and the server's FastAPI app (server/app.py)",
    "cache.py": "`rocketllm cache` (commands/) and the profile cache (profiles/)",
    "plan.py": "`rocketllm plan` (commands/); the planner is planning/",
    "grammar.py": "bench's grammar measurement (bench/) and the grammar engine (text/)",
    "kernels.py": "bench --kernels (bench/) and the native kernels (native/)",
    "report.py": "bench's report and plan's report",
}


def test_a_module_name_says_its_room():
    """A module name that stands in two packages means the same kind of thing in each (SHARED_NAMES says which); any
    other repeat is two meanings under one name, which a newcomer would open the wrong file for."""
    names: dict[str, list[str]] = {}
    for path in sorted((ROOT / "rocketllm_cli").rglob("*.py")):
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    repeated = {name: where for name, where in names.items() if len(where) > 1 and name not in SHARED_NAMES}
    assert not repeated, repeated
