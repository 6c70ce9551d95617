"""The repository's promises about itself: CI runs exactly the README's test command, on every transformers line
the README names; the license files exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks(text: str) -> list[str]:
    blocks, inside, current = [], False, []
    for line in text.splitlines():
        if line.strip().startswith("```"):
            if inside:
                blocks.append("\n".join(current).strip())
                current = []
            inside = not inside and line.strip() == "```bash"
            continue
        if inside:
            current.append(line)
    return blocks


def _readme_test_command() -> list[str]:
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    test_commands = [b for b in blocks if "pytest" in b]
    assert len(test_commands) == 1, blocks
    return test_commands[0].splitlines()


def test_ci_runs_exactly_the_readme_test_command():
    command = _readme_test_command()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    # Every line of the README's block, in order and nothing between them.
    assert any(ci[i : i + len(command)] == command for i in range(len(ci))), (command, ci)


def test_the_test_command_runs_the_compat_tests_on_every_older_transformers_the_readme_names():
    pinned = [line for line in _readme_test_command() if "'transformers==" in line]
    assert pinned and all(line.endswith("python -m pytest -q -m compat") for line in pinned), pinned
    versions = [re.search(r"'transformers==([0-9.]+)'", line).group(1) for line in pinned]
    supported = " ".join((ROOT / "README.md").read_text().split("## Supported", 1)[1].split())
    assert f"the `compat` tests on {' and on '.join(versions)}" in supported, versions
    # the whole suite runs on what a fresh install brings: no upper bound on transformers
    requirement = re.search(r'^\s*"(transformers[^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert requirement.startswith("transformers>=") and "<" not in requirement, requirement


def test_readme_has_a_doctor_command_that_installs_first():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    doctor = [b for b in blocks if b.endswith("rocketllm doctor")]
    assert len(doctor) == 1 and "pip install" in doctor[0]


def test_license_and_notice():
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    notice = (ROOT / "NOTICE").read_text()
    assert "RocketLLM" in notice and "AirLLM" in notice and "Gavin Li" in notice


def test_the_code_runs_on_the_oldest_python_the_package_claims():
    # transformers 5 needs 3.10; vermin finds the oldest Python every construct and library call works on.
    import subprocess
    import sys

    claimed = re.search(r'requires-python = ">=(3\.\d+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    vermin = Path(sys.executable).with_name("vermin")  # the console script the dev extra installs beside python
    done = subprocess.run(
        [
            str(vermin),
            "--no-tips",
            "--eval-annotations",
            "--violations",
            f"--target={claimed}-",
            str(ROOT / "rocketllm_cli"),
            str(ROOT / "rocketllm"),
            str(ROOT / "tests"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
