"""The command-line reference (docs/cli-reference.md) is what the argparse definitions say now."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_cli_reference_is_generated_from_the_current_options():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = module.render()
    assert "## `sloserve serve`" in expected and "`--tool-call-parser`" in expected
    assert (ROOT / "docs" / "cli-reference.md").read_text(encoding="utf-8") == expected, (
        "docs/cli-reference.md is stale: run `.venv/bin/python docs/cli_reference.py`")
