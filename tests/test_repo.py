"""The repository's promises about itself: CI runs exactly the README's test command; the license files exist."""

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


def test_ci_runs_exactly_the_readme_test_command():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    test_commands = [b for b in blocks if "pytest" in b]
    assert len(test_commands) == 1, blocks
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_commands[0] in ci.splitlines()


def test_readme_has_a_doctor_command_that_installs_first():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    doctor = [b for b in blocks if b.endswith("rocketllm doctor")]
    assert len(doctor) == 1 and "pip install" in doctor[0]


def test_license_and_notice():
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    notice = (ROOT / "NOTICE").read_text()
    assert "RocketLLM" in notice and "AirLLM" in notice and "Gavin Li" in notice
