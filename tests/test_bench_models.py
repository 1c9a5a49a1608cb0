"""benchmarks/models.py writes one set of random weights as a Hugging Face directory and as GGUF
files: on its tiny shapes (both architectures) sloserve reading the GGUF, sloserve reading the
directory and transformers reading the directory give the same greedy tokens, and the quantized
GGUF loads with the padded vocabulary."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import models  # noqa: E402

from sloserve import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = "Hello there, how are"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_the_gguf_and_the_hf_directory_hold_the_same_model(name, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = models.SHAPES[name]
    hf = models.write_hf(shape, 0, tmp_path / "hf", dtype="float32")
    gguf_f32 = models.write_gguf(shape, 0, tmp_path / "m-f32.gguf", "f32")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    from_gguf = LLM(str(gguf_f32), dtype="float32", quantization="none").generate([PROMPT], greedy)[0].token_ids
    from_hf = LLM(str(hf), dtype="float32", quantization="none").generate([PROMPT], greedy)[0].token_ids
    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).generate(
        ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert from_gguf == from_hf == ref
    assert len(set(ref)) > 3  # weights large enough that attention moves the tokens (RoPE row order checked)
    q8 = LLM(str(models.write_gguf(shape, 0, tmp_path / "m-q8_0.gguf", "q8_0")), dtype="float32")
    assert q8.engine.model_config.vocab_size == shape.vocab == len(tok)
    assert len(q8.generate([PROMPT], greedy)[0].token_ids) == 12
