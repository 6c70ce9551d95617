"""The CLI's contract for a failure, checked the same way by every test module."""


def one_error_line(result, code: int = 1) -> str:
    """The exit code, exactly one `error:` line on stderr, no traceback or internal error, nothing on stdout."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "internal error" not in lines[0] and "Traceback" not in result.stderr + result.stdout
    assert result.stdout == ""
    return lines[0]
