"""Loaders for the public traces in `../shared/data/` and for user files in the same formats.

Each loader turns one file format into `WorkloadRequest`s with arrival times in seconds from the
first request, lengths as the file gives them, and nothing invented: prompts are left to the
synthesizer, classes and tenants to the mix. Files may be plain or gzip-compressed (by suffix).
See `../shared/data/README.md` for the provenance and columns of each file.
"""
from __future__ import annotations

import csv
import gzip
import io
import json
import os
from datetime import datetime
from pathlib import Path
from typing import IO, Iterator, Optional, Union

from sloserve.workload.types import WorkloadRequest

PathLike = Union[str, os.PathLike]

MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in the Mooncake FAST'25 traces

#: workload name -> file name under the shared data directory
SHARED_FILES = {
    "azure-code": "azure_llm_2023_code.csv.gz",
    "azure-conv": "azure_llm_2023_conv.csv.gz",
    "mooncake-conv": "mooncake_fast25_conversation_trace.jsonl.gz",
    "mooncake-synthetic": "mooncake_fast25_synthetic_trace.jsonl.gz",
    "sharegpt": "sharegpt_v3_first_turn.jsonl.gz",
    "servegen": "servegen_client_windows_10min.csv.gz",
    "servegen-total": "servegen_total_rate_10min.csv.gz",  # a demand series (workload/series.py), not requests
}


def data_dir() -> Path:
    """Where the shared traces live: $SLOSERVE_DATA_DIR, else `shared/data` beside the checkout.

    The checkout's parent is tried first (the layout this project is developed in), then the
    current directory's parent, so an installed package run from a checkout still finds them.
    """
    env = os.environ.get("SLOSERVE_DATA_DIR")
    if env:
        return Path(env)
    candidates = [Path(__file__).resolve().parents[3] / "shared" / "data", Path.cwd().parent / "shared" / "data",
                  Path.cwd() / "shared" / "data"]
    for c in candidates:
        if c.is_dir():
            return c
    return candidates[0]


def shared_path(name: str) -> Path:
    """The shared file behind a workload name; FileNotFoundError with the directory tried otherwise."""
    if name not in SHARED_FILES:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(SHARED_FILES)}")
    path = data_dir() / SHARED_FILES[name]
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (set SLOSERVE_DATA_DIR to the folder with the traces)")
    return path


def open_text(path: PathLike) -> IO[str]:
    """A text handle on a plain or .gz file (gzip is chosen by the magic bytes, not the name)."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, "r", encoding="utf-8", newline="")


# ---------------------------------------------------------------------------------------- Azure


def parse_azure_timestamp(text: str) -> float:
    """POSIX seconds (as if UTC) of `2023-11-16 18:17:03.9799600`.

    Parsed by hand because the 7 fractional digits defeat `datetime.fromisoformat` before Python
    3.11, and only differences between rows matter.
    """
    whole, _, frac = text.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    epoch = (base - datetime(1970, 1, 1)).total_seconds()
    return epoch + (float("0." + frac) if frac else 0.0)


def load_azure(path: PathLike, source: str = "azure") -> list[WorkloadRequest]:
    """Azure LLM inference trace 2023 (`TIMESTAMP,ContextTokens,GeneratedTokens`)."""
    out: list[WorkloadRequest] = []
    with open_text(path) as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: not an Azure LLM trace, missing columns {sorted(missing)}")
        t0: Optional[float] = None
        for i, row in enumerate(reader):
            t = parse_azure_timestamp(row["TIMESTAMP"])
            if t0 is None:
                t0 = t
            out.append(WorkloadRequest(arrival_s=t - t0, prompt_len=int(row["ContextTokens"]),
                                       output_len=int(row["GeneratedTokens"]), request_id=f"{source}-{i}",
                                       source=source))
    return out


# ------------------------------------------------------------------------------------- Mooncake


def load_mooncake(path: PathLike, source: str = "mooncake",
                  block_size: int = MOONCAKE_BLOCK_SIZE) -> list[WorkloadRequest]:
    """Mooncake FAST'25 JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`."""
    out: list[WorkloadRequest] = []
    with open_text(path) as f:
        t0: Optional[float] = None
        for i, line in enumerate(f):
            if not line.strip():
                continue
            d = json.loads(line)
            t = float(d["timestamp"]) / 1000.0
            if t0 is None:
                t0 = t
            hashes = d.get("hash_ids")
            out.append(WorkloadRequest(arrival_s=t - t0, prompt_len=int(d["input_length"]),
                                       output_len=int(d["output_length"]),
                                       hash_ids=tuple(hashes) if hashes else None,
                                       hash_block_size=block_size if hashes else None,
                                       request_id=f"{source}-{i}", source=source))
    return out


# ------------------------------------------------------------------------------------- ShareGPT


def iter_sharegpt(path: PathLike, conversation_starts_only: bool = False) -> Iterator[dict]:
    """Raw ShareGPT first-turn records (dicts), lazily, in file order."""
    with open_text(path) as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            if conversation_starts_only and not d.get("is_conversation_start", True):
                continue
            yield d


def load_sharegpt(path: PathLike, source: str = "sharegpt",
                  conversation_starts_only: bool = False) -> list[WorkloadRequest]:
    """ShareGPT first turns as requests with real prompt text; no arrival times (all 0).

    Lengths are the file's cl100k counts; the builder re-counts prompts with the served
    model's tokenizer when it has one. The output length is the recorded reply's length.
    """
    out = []
    for i, d in enumerate(iter_sharegpt(path, conversation_starts_only)):
        out.append(WorkloadRequest(arrival_s=0.0, prompt_len=int(d["prompt_tokens_cl100k"]),
                                   output_len=int(d["response_tokens_cl100k"]), prompt_text=d["prompt"],
                                   request_id=f"{source}-{d.get('id', i)}", source=source))
    return out


def sharegpt_texts(path: PathLike, limit: Optional[int] = None) -> Iterator[str]:
    """Prompt texts to synthesize prompts from (the corpus of `PromptSynthesizer`)."""
    for i, d in enumerate(iter_sharegpt(path)):
        if limit is not None and i >= limit:
            return
        yield d["prompt"]


# ---------------------------------------------------------------------------------- native JSONL


def load_native(path: PathLike) -> list[WorkloadRequest]:
    """JSONL of `WorkloadRequest.to_dict()` lines (what `save_native` writes)."""
    with open_text(path) as f:
        return [WorkloadRequest.from_dict(json.loads(line)) for line in f if line.strip()]


def save_native(path: PathLike, requests: list[WorkloadRequest]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_dict()) + "\n")


# ------------------------------------------------------------------------------- format sniffing


def sniff_format(path: PathLike) -> str:
    """Which loader reads a user file: azure, servegen, mooncake, sharegpt or native.

    Decided by the first line's columns or keys, so a renamed or uncompressed copy of a shared
    file, or a user's own trace in the same format, loads the same way.
    """
    with open_text(path) as f:
        first = f.readline().strip()
    if not first:
        raise ValueError(f"{path}: empty file")
    if first.startswith("{"):
        keys = set(json.loads(first))
        if {"timestamp", "input_length", "output_length"} <= keys:
            return "mooncake"
        if "prompt" in keys and "response_tokens_cl100k" in keys:
            return "sharegpt"
        if {"arrival_s", "prompt_len", "output_len"} <= keys:
            return "native"
        raise ValueError(f"{path}: unrecognized JSONL keys {sorted(keys)}")
    columns = {c.strip() for c in first.split(",")}
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= columns:
        return "azure"
    if {"client_id", "window_start_s", "rate_rps", "arrival_dist"} <= columns:
        return "servegen"
    raise ValueError(f"{path}: unrecognized CSV header {first!r}")


def load_file(path: PathLike, source: Optional[str] = None) -> list[WorkloadRequest]:
    """Any per-request trace file (not ServeGen windows, which are a generator: see servegen.py)."""
    fmt = sniff_format(path)
    name = source or Path(path).name
    if fmt == "azure":
        return load_azure(path, name)
    if fmt == "mooncake":
        return load_mooncake(path, name)
    if fmt == "sharegpt":
        return load_sharegpt(path, name)
    if fmt == "native":
        return load_native(path)
    raise ValueError(f"{path}: {fmt} files describe arrival patterns, not requests; use the servegen workload")
