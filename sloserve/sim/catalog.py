"""Model shapes for simulation, from each model's published config.json."""
from __future__ import annotations

from sloserve.core.config import ModelConfig

MODELS: dict[str, ModelConfig] = {
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0,
                                max_position_embeddings=131072, name="llama-3.1-8b"),
    # meta-llama/Llama-2-7b-hf config.json (multi-head attention: 32 KV heads, 512 KiB of KV per token in bf16)
    "llama-2-7b": ModelConfig("llama", 32000, 4096, 11008, 32, 32, 32, 128, 1e-5, 10000.0,
                              max_position_embeddings=4096, name="llama-2-7b"),
    # meta-llama/Llama-2-13b-hf config.json
    "llama-2-13b": ModelConfig("llama", 32000, 5120, 13824, 40, 40, 40, 128, 1e-5, 10000.0,
                               max_position_embeddings=4096, name="llama-2-13b"),
    # meta-llama/Llama-3.1-70B config.json
    "llama-3.1-70b": ModelConfig("llama", 128256, 8192, 28672, 80, 64, 8, 128, 1e-5, 500000.0,
                                 max_position_embeddings=131072, name="llama-3.1-70b"),
    # Qwen/Qwen2.5-7B config.json (q/k/v biases)
    "qwen2.5-7b": ModelConfig("qwen2", 152064, 3584, 18944, 28, 28, 4, 128, 1e-6, 1e6,
                              max_position_embeddings=32768, attention_bias=True, name="qwen2.5-7b"),
    # Qwen/Qwen2.5-72B config.json
    "qwen2.5-72b": ModelConfig("qwen2", 152064, 8192, 29568, 80, 64, 8, 128, 1e-6, 1e6,
                               max_position_embeddings=32768, attention_bias=True, name="qwen2.5-72b"),
    # mistralai/Mixtral-8x7B-v0.1 config.json: 8 experts, 2 per token
    "mixtral-8x7b": ModelConfig("mistral", 32000, 4096, 14336, 32, 32, 8, 128, 1e-5, 1e6,
                                max_position_embeddings=32768, num_experts=8, num_experts_per_token=2,
                                name="mixtral-8x7b"),
    # Qwen/Qwen3-30B-A3B config.json: 128 routed experts per layer, 8 per token (moe_intermediate_size
    # 768, every layer sparse, no shared expert): the fine-grained many-expert design DeepSeek-MoE
    # introduced, with plain GQA attention (32 query heads of 128, 4 KV heads)
    "qwen3-30b-a3b": ModelConfig("qwen3", 151936, 2048, 768, 48, 32, 4, 128, 1e-6, 1e6,
                                 max_position_embeddings=40960, num_experts=128, num_experts_per_token=8,
                                 name="qwen3-30b-a3b"),
    # HuggingFaceTB/SmolLM2-135M-Instruct (the embedded model)
    "smollm2-135m": ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True, name="smollm2-135m"),
}


def get_model(name: str) -> ModelConfig:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}") from None
