"""Our forward on tiny random-weight HF checkpoints of each supported family against
transformers' greedy generation: Llama with Llama-3 rope scaling and an untied head,
Mistral with a sliding window shorter than the prompt, Qwen2 with q/k/v biases."""
from __future__ import annotations

import pytest
import torch
import transformers

from engine_helpers import EXACT
from sloserve import LLM, SamplingParams
from test_weights import TINY_VOCAB, save_tiny_tokenizer

COMMON = dict(vocab_size=TINY_VOCAB + 5, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              eos_token_id=2)


def build(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=50000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if kind == "mistral":
        return transformers.MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=12)
    return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_greedy_matches_transformers_on_tiny_checkpoints(tmp_path, kind):
    torch.manual_seed(1)
    config = build(kind)
    if kind == "mistral":
        config._attn_implementation = "eager"  # transformers applies the window in eager/sdpa masks
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    save_tiny_tokenizer(tmp_path)

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (5, 23, 40)]
    # Chunks of 8 make the sliding window cross chunk boundaries and cached prefixes.
    ours = LLM(model=str(tmp_path), max_num_batched_tokens=8, num_blocks=64, block_size=4, **EXACT)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = ours.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist(), (kind, len(prompt))
