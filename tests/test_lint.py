"""The tree passes the formatter and the linter configured in pyproject.toml, so CI (`pytest -q`) fails otherwise.

A failure prints ruff's report; to repair it, run from the repository root:

    .venv/bin/ruff format . && .venv/bin/ruff check .     # --fix repairs import order and unused imports
"""

import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
CONFIG = os.path.join(ROOT, "pyproject.toml")


def ruff(*args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    """Run ruff (the one installed beside this Python, pinned in requirements-common.txt) and return the process."""
    exe = os.path.join(os.path.dirname(sys.executable), "ruff")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "ruff"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def report(proc: subprocess.CompletedProcess) -> str:
    return f"{' '.join(proc.args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"


def test_tree_passes_ruff_check():
    proc = ruff("check", ".")
    assert proc.returncode == 0, report(proc)
    # ruff looks at every Python file at the top of the tree (the configuration excludes none of them)
    listed = ruff("check", "--show-files", ".")
    seen = {os.path.basename(line.strip()) for line in listed.stdout.splitlines()}
    top = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py"))}
    assert top <= seen, f"not looked at: {sorted(top - seen)}\n{report(listed)}"


def test_tree_passes_ruff_format():
    proc = ruff("format", "--check", "--diff", ".")
    assert proc.returncode == 0, report(proc)


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff_fails_on_a_bad_file(tmp_path, command):
    # The two checks above can fail: with this repository's configuration, a file holding one 130-character
    # single-quoted line is reported by the linter (E501) and by the formatter (quotes; the line is not split).
    bad = tmp_path / "bad.py"
    bad.write_text("x = '" + "a" * 124 + "'\n")
    assert len(bad.read_text().rstrip("\n")) == 130
    proc = ruff(*command, "--no-cache", "--config", CONFIG, str(bad), cwd=str(tmp_path))
    assert proc.returncode == 1, report(proc)
    assert ("E501" if command == ["check"] else "would be reformatted") in proc.stdout + proc.stderr, report(proc)
