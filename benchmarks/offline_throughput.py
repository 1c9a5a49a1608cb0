#!/usr/bin/env python3
"""Offline throughput: sloserve against HF transformers `generate` (and vLLM for CPU), in one run.

Every system gets the same token ids (ShareGPT first-turn prompts, raw text without a chat
template, truncated to --max-prompt-len tokens), must produce exactly --max-tokens greedy
tokens per prompt (EOS ignored), and serves the embedded SmolLM2-135M-Instruct. The peers
run it in fp32. sloserve runs once per --precisions item, each its own row: `default` is what
a user gets (dtype auto, quantization auto: the GGUF's int4 with a dense 16-bit copy for large
steps), `float32` (quantization none) the exact reference with the peers' fp32 weights, and
`D+Q` / `D+Q/only` other dtype / weight-quantization pairs (see sloserve/bench/precision.py).
The systems run one after another, never concurrently, each in its own child process, so that

* a process's peak RSS belongs to one system only (the parent samples the RSS summed over
  the child's whole process tree, which also covers vLLM's engine-core subprocess), and
* one system's thread pools and allocator state cannot slow the next one down.

A GEMM probe (a large fp32 `torch.mm`) runs first: it is the ceiling of what this machine's
cores do in fp32, and each system's effective GFLOP/s is reported as a fraction of it (rows
in bfloat16 or on quantized weights can exceed it: it is an fp32 yardstick, not their ceiling).

Greedy agreement (the "same tokens" column): every row's output tokens are compared with the
`sloserve float32` row's (without one, the first sloserve row that ran). Reduced precision may
pick other tokens at near-ties; the count of identical outputs is reported, not a failure.

Timings cover only the `generate` call (after model load and a tiny warm-up); start-up
time is reported separately. Usage: `python benchmarks/offline_throughput.py --help`.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

from sloserve.bench.precision import SYNTAX as PRECISION_SYNTAX
from sloserve.bench.precision import Precision, checkpoint_quantization, parse_precision, parse_precision_list
from sloserve.workers import vllm_process

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATASET = REPO_ROOT.parent / "shared" / "data" / "sharegpt_v3_first_turn.jsonl.gz"
DEFAULT_OUTPUT_DIR = REPO_ROOT / "benchmarks" / "results"
VLLM_PYTHON = vllm_process.VLLM_PYTHON  # `make vllm` sets it up
VLLM_SCRIPT = REPO_ROOT / "benchmarks" / "peers" / "vllm_offline.py"
VLLM_MODEL_DIR = REPO_ROOT / "benchmarks" / "results" / "smollm2-135m-hf"
VLLM_SETUP = "benchmarks/peers/setup_vllm_cpu.sh"

PEERS = ("hf", "vllm")
VLLM_DTYPES = ("float32", "bfloat16")
LABELS = {"hf": "HF transformers", "vllm": "vLLM-CPU"}  # sloserve rows are named "sloserve <precision>"
REFERENCE_ROW = "sloserve float32"  # greedy agreement is measured against this row when it ran
RSS_SAMPLE_INTERVAL_S = 0.2
WARMUP_PROMPT = list(range(1000, 1008))  # 8 arbitrary ids: shorter than a KV block, so nothing gets prefix-cached
WARMUP_TOKENS = 2

FLOPS_FORMULA = (
    "effective FLOPs = 2 * P_body * (prompt_tokens + output_tokens) + 2 * V * h * output_tokens, where "
    "P_body = all parameters except the (tied) embedding / LM-head table, V * h = that table. Every token "
    "goes through all layers once; only positions that sample a token need an LM-head row. Attention "
    "scores (QK^T, PV) and padding are not counted, so this is the useful dense matmul work: a lower "
    "bound on what the hardware executed."
)


# ---------------------------------------------------------------------- command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="a GGUF file sloserve and the HF peer read (default: the embedded SmolLM2-135M); give vLLM "
                        "the same weights with --vllm-model (benchmarks/models.py writes both)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--dataset", type=Path, default=DEFAULT_DATASET, help="ShareGPT first-turn .jsonl.gz")
    p.add_argument("--seed", type=int, default=0, help="selects the prompts (and seeds every engine)")
    p.add_argument("--max-prompt-len", type=int, default=1024, help="prompts keep their first N tokens")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt (EOS ignored)")
    p.add_argument("--peer", action="append", default=None,
                   help="hf, vllm or none; repeat or comma-separate (default: hf)")
    p.add_argument("--precisions", default="default,float32",
                   help=f"sloserve rows, comma-separated, each {PRECISION_SYNTAX}; /only = no dense copy "
                        "of the quantized linears. Each is its own row 'sloserve <item>', in its own process")
    p.add_argument("--num-threads", type=int, default=None, help="compute threads (default: the usable cores)")
    p.add_argument("--hf-batch-size", type=int, default=16,
                   help="static batch size for HF generate (batches in prompt order, left-padded)")
    p.add_argument("--kv-cache-gib", type=float, default=2.0,
                   help="sloserve's KV pool (vLLM's peer gets the same via VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sloserve's running-request cap (vLLM's default)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="sloserve's per-step token budget")
    p.add_argument("--gemm-size", type=int, default=2048, help="n of the n x n x n fp32 GEMM probe")
    p.add_argument("--gemm-reps", type=int, default=5)
    p.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    p.add_argument("--vllm-model", type=Path, default=VLLM_MODEL_DIR, help="HF-format copy of the model")
    p.add_argument("--vllm-dtypes", default="float32",
                   help="vLLM rows, comma-separated dtypes (float32, bfloat16): each its own row 'vLLM-CPU <dtype>'")
    # Internal: the parent re-invokes this script with these to run one system in a fresh process.
    p.add_argument("--only", choices=("gemm", "sloserve", "hf"), help=argparse.SUPPRESS)
    p.add_argument("--precision", default="default", help=argparse.SUPPRESS)  # the --only sloserve child's
    p.add_argument("--prompts-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.model is not None and not args.model.is_file():
        p.error(f"--model: no such GGUF file {args.model}")
    args.vllm_dtypes = [d.strip() for d in args.vllm_dtypes.split(",") if d.strip()]
    for dtype in args.vllm_dtypes:
        if dtype not in VLLM_DTYPES:
            p.error(f"--vllm-dtypes: unknown dtype {dtype!r} (choose from {', '.join(VLLM_DTYPES)})")
    args.peers = parse_peers(args.peer, p, args.vllm_dtypes)
    try:
        args.precision_list = parse_precision_list(args.precisions)
        args.precision_spec = parse_precision(args.precision)
    except ValueError as exc:
        p.error(f"--precisions: {exc}")
    if args.num_threads is None:
        args.num_threads = usable_cores()
    for name in ("num_prompts", "max_prompt_len", "max_tokens", "num_threads", "hf_batch_size", "gemm_size",
                 "gemm_reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def parse_peers(values: Optional[list[str]], parser: argparse.ArgumentParser,
                vllm_dtypes: Sequence[str] = ("float32",)) -> list[str]:
    """`--peer hf --peer vllm`, `--peer hf,vllm` and `--peer none` all work; order kept, duplicates dropped.
    vLLM becomes one system per dtype: "vllm float32", "vllm bfloat16"."""
    names = [n.strip() for v in (values or ["hf"]) for n in v.split(",") if n.strip()]
    for name in names:
        if name not in PEERS + ("none",):
            parser.error(f"--peer: unknown peer {name!r} (choose from hf, vllm, none)")
    systems = []
    for name in dict.fromkeys(n for n in names if n != "none"):
        systems += [f"vllm {dtype}" for dtype in vllm_dtypes] if name == "vllm" else [name]
    return systems


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------------- prompts


@dataclass
class ModelFacts:
    """What the FLOP count needs, read from the GGUF's tensor shapes (no dequantization)."""

    path: str
    body_params: int  # everything but the embedding / LM-head table
    head_params: int  # V * h: the tied embedding, which is also the LM head
    total_params: int


def load_prompts(args: argparse.Namespace) -> tuple[list[list[int]], ModelFacts, dict[str, Any]]:
    """Pick `num_prompts` rows at random (seeded) and tokenize them with the model's tokenizer.

    Raw prompt text, no chat template (as vLLM's own throughput benchmark does); the first
    `max_prompt_len` tokens are kept.
    """
    from sloserve.engine.gguf_file import read_gguf
    from sloserve.engine.tokenizer import Tokenizer
    from sloserve.engine.weights import embedded_model_path

    path = str(args.model) if args.model is not None else embedded_model_path()
    gguf_file = read_gguf(path)
    tokenizer = Tokenizer.from_gguf_metadata(gguf_file.metadata)
    facts = model_facts(path, gguf_file)

    rows = read_dataset(args.dataset)
    if args.num_prompts > len(rows):
        raise SystemExit(f"--num-prompts {args.num_prompts} exceeds the {len(rows)} rows of {args.dataset}")
    picked = random.Random(args.seed).sample(range(len(rows)), args.num_prompts)
    prompts, truncated = [], 0
    for index in picked:
        ids = tokenizer.encode(rows[index]["prompt"])
        truncated += len(ids) > args.max_prompt_len
        prompts.append(ids[:args.max_prompt_len])
    lengths = sorted(len(p) for p in prompts)
    stats = {
        "dataset": str(args.dataset),
        "row_ids": [rows[i]["id"] for i in picked],
        "prompt_tokens": sum(lengths),
        "prompt_len_min": lengths[0],
        "prompt_len_median": lengths[len(lengths) // 2],
        "prompt_len_max": lengths[-1],
        "num_truncated": truncated,
    }
    return prompts, facts, stats


def read_dataset(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise SystemExit(f"dataset not found: {path} (see --dataset)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def model_facts(path: str, gguf_file: Any) -> ModelFacts:
    sizes = {t.name: math.prod(t.shape) for t in gguf_file.tensors}
    head = sizes["token_embd.weight"]
    total = sum(sizes.values())
    body = total - head - sizes.get("output.weight", 0)  # an untied head would be the same size: count it once
    return ModelFacts(path=path, body_params=body, head_params=head, total_params=total)


def effective_gflops(facts: ModelFacts, prompt_tokens: int, output_tokens: int, seconds: float) -> float:
    """See FLOPS_FORMULA."""
    flops = 2 * facts.body_params * (prompt_tokens + output_tokens) + 2 * facts.head_params * output_tokens
    return flops / seconds / 1e9


# ---------------------------------------------------------------------- children: one system each


def run_child(args: argparse.Namespace) -> int:
    """Run one system in this (fresh) process and write its result JSON; never raise."""
    started = time.perf_counter()
    try:
        if args.only == "gemm":
            result = gemm_probe(args.gemm_size, args.gemm_reps, args.num_threads)
        else:
            prompts = json.loads(args.prompts_file.read_text())["prompts"]
            runner = run_sloserve if args.only == "sloserve" else run_hf
            result = runner(prompts, args)
            result["startup_s"] = result.pop("ready_at") - started
        result["versions"] = library_versions()
        result["ok"] = True
    except Exception as exc:  # reported by the parent as one line
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    result["peak_rss_self_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    args.result_file.write_text(json.dumps(result))
    return 0 if result["ok"] else 1


def library_versions() -> dict[str, str]:
    import importlib.metadata

    names = ("torch", "transformers", "sloserve")
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def gemm_probe(n: int, reps: int, threads: int) -> dict[str, Any]:
    """Best and median GFLOP/s of an n x n x n fp32 matmul: the ceiling for dense fp32 work here."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)  # warm-up: thread pool start, page faults
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - t0)
    times.sort()
    flop = 2 * n**3
    return {"n": n, "reps": reps, "threads": threads, "times_s": times,
            "peak_gflops": flop / times[0] / 1e9, "median_gflops": flop / times[len(times) // 2] / 1e9}


def run_sloserve(prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """sloserve's offline API with its defaults (continuous batching, chunked prefill, prefix cache)
    at the precision of `--precision` (`default`: the engine's own dtype / quantization choice).

    Built from an EngineConfig, whose defaults are LLM's, because `LLM(...)` has no
    `quantized_dense_copy` argument (the `/only` specs need it)."""
    from sloserve import LLM, SamplingParams
    from sloserve.core.config import CacheConfig, EngineConfig, SchedulerConfig

    precision: Precision = args.precision_spec
    model = {"model": str(args.model)} if args.model is not None else {}
    config = EngineConfig(num_threads=args.num_threads, seed=args.seed, **model, **precision.engine_kwargs,
                          cache=CacheConfig(kv_cache_gib=args.kv_cache_gib),
                          scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                                    max_num_batched_tokens=args.max_num_batched_tokens))
    llm = LLM(config=config)
    llm.generate([WARMUP_PROMPT], SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0, ignore_eos=True))
    ready_at = time.perf_counter()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, progress=True)
    wall = time.perf_counter() - t0
    engine = llm.engine
    cfg = engine.config
    return {
        "wall_s": wall, "ready_at": ready_at,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "output_tokens": sum(len(o.token_ids) for o in outputs),
        "output_token_ids": [list(o.token_ids) for o in outputs],
        "settings": {"precision": precision.label, "requested": {"dtype": cfg.dtype, "quantization": cfg.quantization,
                                                                 "quantized_dense_copy": cfg.quantized_dense_copy},
                     "dtype": str(engine.dtype).removeprefix("torch."), "quantization": engine.quantization,
                     "weight_bytes": int(engine.model.weight_bytes),
                     "threads": args.num_threads, "max_num_seqs": cfg.scheduler.max_num_seqs,
                     "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
                     "kv_cache_gib": cfg.cache.kv_cache_gib, "block_size": cfg.cache.block_size,
                     "prefix_caching": cfg.cache.enable_prefix_caching},
    }


def run_hf(prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """transformers `generate`, greedy, static batches of --hf-batch-size prompts in dataset order.

    Left padding so every row's last real token sits at the end; `min_new_tokens` equal to
    `max_new_tokens` suppresses EOS so each prompt gets exactly max_tokens outputs, like
    `ignore_eos` elsewhere. No sorting by length: a static-batch server cannot choose its
    arrivals either.
    """
    import torch
    from rich.progress import Progress
    from transformers import AutoModelForCausalLM

    from sloserve.engine.weights import embedded_model_path

    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    gguf_file = args.model if args.model is not None else Path(embedded_model_path())
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    model.eval()
    kinds = {param.dtype for param in model.parameters()}
    if kinds != {torch.float32}:  # newer transformers keep GGUF blocks when the `kernels` package is present
        raise RuntimeError(f"transformers did not dequantize the GGUF to fp32 (parameter dtypes {kinds})")
    pad_id = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    hf_generate(model, [WARMUP_PROMPT], WARMUP_TOKENS, pad_id)
    ready_at = time.perf_counter()

    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    with Progress(transient=True) as bar:
        task = bar.add_task("HF generate", total=len(prompts))
        for start in range(0, len(prompts), args.hf_batch_size):
            batch = prompts[start:start + args.hf_batch_size]
            outputs += hf_generate(model, batch, args.max_tokens, pad_id)
            bar.advance(task, len(batch))
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall, "ready_at": ready_at,
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": sum(len(o) for o in outputs),
        "output_token_ids": outputs,
        "settings": {"dtype": "float32", "quantization": "none", "threads": args.num_threads,
                     "batch_size": args.hf_batch_size, "padding": "left"},
    }


def hf_generate(model: Any, batch: list[list[int]], new_tokens: int, pad_id: int) -> list[list[int]]:
    """One left-padded static batch through `model.generate`; returns only the new tokens of each row."""
    import torch

    width = max(len(p) for p in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        mask[row, width - len(ids):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    return out[:, width:].tolist()


# ---------------------------------------------------------------------- parent: orchestration


class TreeRssSampler:
    """Peak of the RSS summed over a process and all its descendants, sampled from outside.

    Summing RSS counts pages shared between processes (the torch libraries) once per process,
    which only matters for vLLM (driver, engine-core and worker processes); it is what `ps` shows.
    """

    def __init__(self, pid: int):
        import psutil

        self._root = psutil.Process(pid)
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            try:
                procs = [self._root] + self._root.children(recursive=True)
            except psutil.Error:
                return
            for proc in procs:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop.wait(RSS_SAMPLE_INTERVAL_S)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_bytes


def run_in_subprocess(command: list[str], result_file: Path, env: dict[str, str]) -> dict[str, Any]:
    """Start one system, sample its RSS until it exits, and return what it wrote to result_file."""
    proc = subprocess.Popen(command, env=env, cwd=REPO_ROOT)
    sampler = TreeRssSampler(proc.pid)
    code = proc.wait()
    peak = sampler.stop()
    if not result_file.is_file():
        return {"ok": False, "error": f"exited with code {code} and wrote no result"}
    result = json.loads(result_file.read_text())
    result["peak_rss_bytes"] = max(peak, result.get("peak_rss_self_bytes", 0))
    return result


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def sloserve_row(precision: Precision) -> str:
    """The system name (and label) of one sloserve row: "sloserve default", "sloserve bfloat16+int4"."""
    return f"sloserve {precision.label}"


def label(system: str) -> str:
    if system.startswith("vllm "):
        return f"{LABELS['vllm']} {system.split(' ', 1)[1]}"
    return LABELS.get(system, system)


def run_own(system: str, args: argparse.Namespace, prompts_file: Path, workdir: Path,
            precision: Optional[Precision] = None) -> dict[str, Any]:
    """One of this script's own steps (gemm, hf, or a sloserve row at `precision`) in a child process."""
    result_file = workdir / ("".join(c if c.isalnum() or c in "-." else "_" for c in system) + ".json")
    only = "sloserve" if precision is not None else system
    command = [sys.executable, str(Path(__file__).resolve()), "--only", only,
               "--prompts-file", str(prompts_file), "--result-file", str(result_file),
               "--max-tokens", str(args.max_tokens), "--num-threads", str(args.num_threads),
               "--hf-batch-size", str(args.hf_batch_size), "--seed", str(args.seed),
               "--gemm-size", str(args.gemm_size), "--gemm-reps", str(args.gemm_reps),
               "--kv-cache-gib", str(args.kv_cache_gib), "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.model is not None:
        command += ["--model", str(args.model)]
    if precision is not None:
        command += ["--precision", precision.label]
    return run_in_subprocess(command, result_file, child_env(args.num_threads))


def run_vllm(args: argparse.Namespace, prompts_file: Path, workdir: Path, dtype: str) -> dict[str, Any]:
    """vLLM for CPU in its own venv at `dtype`; its script sets vLLM's CPU environment itself."""
    if not args.vllm_python.is_file():
        return {"ok": False, "error": f"{args.vllm_python} not found; run {VLLM_SETUP} first"}
    if not (args.vllm_model / "config.json").is_file():
        return {"ok": False, "error": f"no HF-format model in {args.vllm_model}; run {VLLM_SETUP} first"}
    result_file = workdir / f"vllm-{dtype}.json"
    command = [str(args.vllm_python), str(VLLM_SCRIPT), "--model", str(args.vllm_model), "--dtype", dtype,
               "--prompts-file", str(prompts_file), "--result-file", str(result_file),
               "--max-tokens", str(args.max_tokens), "--num-threads", str(args.num_threads),
               "--seed", str(args.seed), "--kv-cache-gib", str(max(1, round(args.kv_cache_gib)))]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # keep sloserve's venv out of vLLM's
    result = run_in_subprocess(command, result_file, env)
    if result.get("ok"):  # vllm_offline.py loads the HF-format weights at `dtype`, as the checkpoint stores them
        result.setdefault("settings", {}).update({"dtype": dtype,
                                                  "quantization": checkpoint_quantization(args.vllm_model)})
    return result


def run_all(args: argparse.Namespace) -> list[str]:
    """Run every step in order, report, save; returns the steps that failed."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # rich assumes 80 columns when piped: too narrow for the table
        console.width = max(console.width, 150)
    with console.status("reading and tokenizing prompts"):
        prompts, facts, prompt_stats = load_prompts(args)
    console.print(f"{len(prompts)} prompts, {prompt_stats['prompt_tokens']} prompt tokens "
                  f"(median {prompt_stats['prompt_len_median']}, max {prompt_stats['prompt_len_max']}, "
                  f"{prompt_stats['num_truncated']} truncated to {args.max_prompt_len}); "
                  f"{args.max_tokens} output tokens each; {args.num_threads} threads")
    load_at_start = os.getloadavg()  # a busy machine at start skews the GEMM probe and everything after
    rows = {sloserve_row(p): p for p in args.precision_list}
    systems = list(rows) + args.peers
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="offline_throughput-") as tmp:
        workdir = Path(tmp)
        prompts_file = workdir / "prompts.json"
        prompts_file.write_text(json.dumps({"prompts": prompts}))
        steps = ["gemm"] + systems
        for i, system in enumerate(steps, 1):
            console.rule(f"[{i}/{len(steps)}] {'GEMM peak probe' if system == 'gemm' else label(system)}")
            result = run_vllm(args, prompts_file, workdir, system.split(" ", 1)[1]) if system.startswith("vllm ") else \
                run_own(system, args, prompts_file, workdir, rows.get(system))
            if not result.get("ok"):
                console.print(f"[red]{label(system)} failed: {result.get('error')}[/red]")
            results[system] = result
    failed = [step for step, result in results.items() if not result.get("ok")]
    report = build_report(args, facts, prompt_stats, prompts, results)
    report["machine"]["load_average_at_start"] = load_at_start
    print_report(console, report)
    json_path, png_path = save_report(report, args.output_dir)
    console.print(f"wrote {json_path} and {png_path}")
    return failed


# ---------------------------------------------------------------------- report


def build_report(args: argparse.Namespace, facts: ModelFacts, prompt_stats: dict[str, Any],
                 prompts: list[list[int]], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Derive the metrics from the raw child results, identically for every system."""
    results = dict(results)
    gemm = results.pop("gemm")
    peak = gemm.get("peak_gflops") if gemm.get("ok") else None
    reference_name = output_reference(results)
    reference = results[reference_name].get("output_token_ids") if reference_name else None
    expected_output = len(prompts) * args.max_tokens
    systems: dict[str, dict[str, Any]] = {}
    for name, raw in results.items():
        entry: dict[str, Any] = {"label": label(name), "ok": bool(raw.get("ok"))}
        if not raw.get("ok"):
            entry["error"] = raw.get("error")
            systems[name] = entry
            continue
        wall, p_tok, o_tok = raw["wall_s"], raw["prompt_tokens"], raw["output_tokens"]
        gflops = effective_gflops(facts, p_tok, o_tok, wall)
        entry.update({
            "wall_s": wall, "startup_s": raw.get("startup_s"),
            "prompt_tokens": p_tok, "output_tokens": o_tok,
            "output_tokens_as_expected": o_tok == expected_output and p_tok == prompt_stats["prompt_tokens"],
            "output_tok_s": o_tok / wall, "total_tok_s": (p_tok + o_tok) / wall,
            "peak_rss_bytes": raw["peak_rss_bytes"], "peak_rss_self_bytes": raw.get("peak_rss_self_bytes"),
            "effective_gflops": gflops, "fraction_of_gemm_peak": gflops / peak if peak else None,
            "same_output_as_reference": None if name == reference_name else
            same_outputs(reference, raw.get("output_token_ids")),
            "settings": raw.get("settings", {}),
        })
        for key in ("versions", "vllm_peak_rss_bytes"):
            if key in raw:
                entry[key] = raw[key]
        systems[name] = entry
    return {
        "benchmark": "offline_throughput",
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "settings": {"num_prompts": len(prompts), "max_prompt_len": args.max_prompt_len,
                     "max_tokens": args.max_tokens, "seed": args.seed, "threads": args.num_threads,
                     "sloserve_precisions": [p.label for p in args.precision_list], "hf_dtype": "float32", "vllm_dtypes": args.vllm_dtypes,
                     "greedy": True, "ignore_eos": True, "chat_template": False,
                     "hf_batch_size": args.hf_batch_size, "peers": args.peers},
        "prompts": prompt_stats,
        "model": {"gguf": facts.path, "total_params": facts.total_params, "body_params": facts.body_params,
                  "embedding_head_params": facts.head_params},
        "flops_formula": FLOPS_FORMULA,
        "gemm": gemm,
        "output_reference": reference_name,
        "systems": systems,
        "ratios_sloserve_over_peer": ratios(systems),
    }


def output_reference(results: dict[str, dict[str, Any]]) -> Optional[str]:
    """The row whose greedy tokens the others are compared with: `sloserve float32` (the exact
    reference configuration) when it ran, else the first sloserve row that ran; None if none did."""
    ran = [name for name, raw in results.items() if name.startswith("sloserve ") and raw.get("ok")]
    if not ran:
        return None
    return REFERENCE_ROW if REFERENCE_ROW in ran else ran[0]


def same_outputs(reference: Optional[list[list[int]]], other: Optional[list[list[int]]]) -> Optional[str]:
    """'k/n' prompts whose greedy tokens equal the reference row's: a check that both did the same work.

    fp32 results of different kernels and batch shapes differ in the last bits, so a few
    near-ties may flip; a low count at fp32 means the inputs or settings differ. Rows in
    bfloat16 or on quantized weights are expected to differ more: the count is information
    (how often reduced precision changes the greedy text), not a pass/fail.
    """
    if reference is None or other is None or len(reference) != len(other):
        return None
    return f"{sum(a == b for a, b in zip(reference, other))}/{len(reference)}"


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per sloserve row, per peer: sloserve / peer for throughput (>1 = sloserve faster) and for
    peak RSS (<1 = sloserve smaller). `{"sloserve float32": {"hf": {"total_tok_s": ..., ...}}}`."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    peers = {name: e for name, e in systems.items() if not name.startswith("sloserve ") and e.get("ok")}
    for name, own in systems.items():
        if not name.startswith("sloserve ") or not own.get("ok") or not peers:
            continue
        out[name] = {peer_name: {key: own[key] / peer[key] for key in ("total_tok_s", "output_tok_s", "peak_rss_bytes")}
                     for peer_name, peer in peers.items()}
    return out


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cpu_features": cpu_features(), "usable_cores": usable_cores(),
                            "python": platform.python_version()}
    try:
        info["load_average_at_end"] = os.getloadavg()
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
        info["sloserve_commit"] = commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def cpu_features() -> list[str]:
    """The SIMD features that decide fp32/bf16 matmul speed (AVX-512 and AMX change the GEMM peak a lot)."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in flags]
    except OSError:
        pass
    return []


def gib(n: float) -> float:
    return n / 2**30


def print_report(console: Any, report: dict[str, Any]) -> None:
    from rich.table import Table

    gemm = report["gemm"]
    if gemm.get("ok"):
        console.print(f"GEMM peak ({gemm['n']}^3 fp32, {gemm['threads']} threads): "
                      f"{gemm['peak_gflops']:.1f} GFLOP/s best, {gemm['median_gflops']:.1f} median")
    else:
        console.print(f"[red]GEMM probe failed: {gemm.get('error')}[/red]")
    s = report["settings"]
    table = Table(title=f"Offline throughput: {s['num_prompts']} prompts x {s['max_tokens']} tokens, "
                        f"{s['threads']} threads")
    reference = report["output_reference"]
    columns = ("system", "dtype/weights", "weights MiB", "wall s", "output tok/s", "total tok/s", "peak RSS GiB",
               "eff. GFLOP/s", "% GEMM peak", "same tokens", "start-up s")
    for column in columns:
        left = column in ("system", "dtype/weights")
        table.add_column(column, justify="left" if left else "right", no_wrap=left)
    for name, entry in report["systems"].items():
        if not entry["ok"]:
            table.add_row(entry["label"], "failed", *[""] * (len(columns) - 2))
            continue
        frac = entry["fraction_of_gemm_peak"]
        settings = entry["settings"]
        weights = settings.get("weight_bytes")
        same = "(ref.)" if name == reference else entry["same_output_as_reference"] or ""
        table.add_row(entry["label"], precision_text(settings), "" if weights is None else f"{weights / 2**20:.0f}",
                      f"{entry['wall_s']:.1f}", f"{entry['output_tok_s']:.1f}",
                      f"{entry['total_tok_s']:.1f}", f"{gib(entry['peak_rss_bytes']):.2f}",
                      f"{entry['effective_gflops']:.1f}", "" if frac is None else f"{100 * frac:.1f}",
                      same, f"{entry['startup_s']:.1f}")
    console.print(table)
    if reference:
        console.print(f"same tokens: outputs identical to {label(reference)}'s (ref.); lower precision may "
                      "differ at near-ties (not a failure)")
    for name, by_peer in report["ratios_sloserve_over_peer"].items():
        for peer, r in by_peer.items():
            console.print(f"{label(name)} / {label(peer)}: total tok/s {r['total_tok_s']:.2f}x, "
                          f"output tok/s {r['output_tok_s']:.2f}x, peak RSS {r['peak_rss_bytes']:.2f}x")
    for entry in report["systems"].values():
        if entry["ok"] and not entry["output_tokens_as_expected"]:
            console.print(f"[yellow]warning: {entry['label']} processed {entry['prompt_tokens']} prompt / "
                          f"{entry['output_tokens']} output tokens, not the expected counts[/yellow]")


def precision_text(settings: dict[str, Any]) -> str:
    """What a row resolved to: "bfloat16/int4", "float32/none", "bfloat16/int4 only" (no dense copy)."""
    dtype, quant = settings.get("dtype"), settings.get("quantization")
    if dtype is None:
        return ""
    text = f"{dtype}/{quant or '?'}"
    requested = settings.get("requested", {})
    if quant not in (None, "none") and requested.get("quantized_dense_copy") is False:
        text += " only"
    return text


def save_report(report: dict[str, Any], output_dir: Path) -> tuple[Path, Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = f"offline_throughput-{datetime.now().strftime('%Y-%m-%d-%H%M%S')}"
    json_path, png_path = output_dir / f"{stem}.json", output_dir / f"{stem}.png"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot_report(report, png_path)
    return json_path, png_path


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Three bar panels (total tok/s, output tok/s, peak RSS), one bar per system that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {name: e for name, e in report["systems"].items() if e["ok"]}
    labels = [e["label"] for e in ok.values()]
    panels = [("total tok/s", [e["total_tok_s"] for e in ok.values()]),
              ("output tok/s", [e["output_tok_s"] for e in ok.values()]),
              ("peak RSS (GiB)", [gib(e["peak_rss_bytes"]) for e in ok.values()])]
    width = max(4.0, 0.9 * len(ok) + 1.5)
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 4.2))
    # sloserve rows in blues (darkest first), each peer its own colour
    own = [name for name in ok if name.startswith("sloserve ")]
    blues = plt.get_cmap("Blues")
    peer_colors = iter(["tab:orange", "tab:green", "tab:red", "tab:purple"])
    colors = [blues(0.85 - 0.5 * own.index(name) / max(1, len(own) - 1)) if name in own else next(peer_colors)
              for name in ok]
    for ax, (title, values) in zip(axes, panels):
        bars = ax.bar(labels, values, color=colors)
        ax.bar_label(bars, fmt="%.1f" if "tok" in title else "%.2f", fontsize="small")
        ax.margins(y=0.15)  # room for the labels above the tallest bar
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=30)
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")
    s = report["settings"]
    peer_precisions = sorted({precision_text(e.get("settings", {})) for name, e in ok.items()
                              if not name.startswith("sloserve ")} - {""})
    peers = f", peers in {' and '.join(peer_precisions)}" if peer_precisions else ""
    fig.suptitle(f"{s['num_prompts']} ShareGPT prompts x {s['max_tokens']} tokens{peers}, "
                 f"{s['threads']} threads ({report['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.only:
        return run_child(args)
    failed = run_all(args)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
