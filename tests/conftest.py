"""Shared fixtures. Loading the embedded model costs seconds, so engines are shared."""
from __future__ import annotations

import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests import their helpers by module name

# What the tests measure once (dtype and crossover probes, capacities) goes to a cache of their
# own, inherited by the servers they start: probes timed while two test workers share the cores
# are noisy, and the user's cache is what `sloserve serve` reads for good (user_cache.py).
os.environ.setdefault("SLOSERVE_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"sloserve-tests-{os.getuid()}"))


@pytest.fixture(scope="session")
def llm():
    """The embedded SmolLM2-135M in the exact configuration (engine_helpers.EXACT)."""
    from engine_helpers import EXACT

    from sloserve import LLM

    return LLM(**EXACT)



@pytest.fixture(scope="session")
def hf_reference():
    """transformers' own load of the same GGUF (dequantized to fp32) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from sloserve.engine.weights import embedded_model_path

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    model.eval()
    return model
