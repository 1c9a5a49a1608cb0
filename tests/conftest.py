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

# Test workers (pytest-xdist) share the cores: each engine they run, in process or in a server they
# start, gets its share of threads. Two workers with two threads each on two cores oversubscribe them,
# and torch's threads then wait for one another: a constrained generation ran 4x slower than with one.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:  # set before torch is imported: torch's own default reads it too
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))


@pytest.fixture(scope="session")
def llm():
    """The embedded SmolLM2-135M in the exact configuration (engine_helpers.EXACT)."""
    from engine_helpers import EXACT

    from sloserve import LLM

    return LLM(**EXACT)



@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """`sloserve serve` with its defaults on a loopback port, shared by the tests that only call it."""
    from server_helpers import ServerProcess

    proc = ServerProcess([], tmp_path_factory.mktemp("default-server") / "server.log", exact=False)
    yield proc
    proc.kill()


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
