"""`sloserve generate` as a user runs it: a real subprocess on the embedded model."""
from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sloserve.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_generate_streams_text():
    res = run_cli("generate", "The capital of France is", "--max-tokens", "6", "--num-threads", "1")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--max-tokens", "0"], "max_tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--model", "/nonexistent/model.gguf"], "not found"),
    ],
)
def test_bad_input_is_one_line_error(args, needle):
    res = run_cli("generate", "hi", *args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sloserve: error:") and needle in lines[0], res.stderr
