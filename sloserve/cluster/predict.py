"""Output-length prediction: prompt -> a distribution over the response length.

Why: requests differ by orders of magnitude in how long they decode, and a router that
knows roughly how long (and how uncertain) a request will run can keep it off an instance
whose KV pool it would overflow. The router needs it on every arrival, so the model is
small and linear:

- features: a bias, the prompt length (one-hot log2 bins plus a smooth log term), and
  hashed unigrams + bigrams of the prompt text's first 1024 and last 256 characters
  (instructions sit at either end; long pasted material in the middle says little);
  binary, scaled by 1/sqrt(count) so long prompts do not dominate;
- a softmax over length buckets (`BUCKET_EDGES`), trained with minibatch Adam on
  cross-entropy; quantiles come from the predicted CDF, interpolated log-linearly inside a
  bucket. One distribution gives a median (the point prediction), quantiles (the router's
  overflow risk) and a bucket (the classifier view) at once;
- a second, length-only head on the same data, used when no text is at hand (simulated
  traces carry only token counts).

Online adaptation (`update`): the served model's lengths are not ChatGPT's. Each completed
request takes one SGD step on both heads and moves per-level calibration offsets (adaptive
conformal inference: an offset rises while its level is exceeded more often than it should
be), so the quantiles track the served model's distribution within a few hundred requests.

Inference is numpy over a few hundred active features: tens of microseconds per prompt,
well inside the 1 ms budget. Training is deterministic (fixed seed, fixed batch order, no
BLAS reductions), so `sloserve train-predictor` reproduces the shipped default byte for byte.
The routers never import this module; they consume `LengthPrediction` (`cluster/lengths.py`).
"""
from __future__ import annotations

import base64
import json
import logging
import math
import re
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np

from sloserve.cluster.lengths import LEVELS, LengthPrediction

logger = logging.getLogger(__name__)

FORMAT = "sloserve-length-predictor"
VERSION = 1
DEFAULT_PATH = Path(__file__).resolve().parent / "predictor_default.json"

#: bucket k holds lengths in [BUCKET_EDGES[k], BUCKET_EDGES[k+1]); the last is open above
BUCKET_EDGES: tuple[int, ...] = (0, 16, 32, 64, 128, 192, 256, 320, 384, 512, 640, 768, 1024)
TOP_LENGTH = 2048  # where the open last bucket's probability mass is spread up to
TEXT_DIM = 1 << 13
LEN_BINS = 18  # log2(prompt tokens) bins: 0, 1, 2-3, ..., 2^16+
LEN_FEATURES = 1 + LEN_BINS + 2  # bias, bins, log term, its square
HEAD_CHARS, TAIL_CHARS = 1024, 256
CHARS_PER_TOKEN = 4.0  # token estimate when only text is given (cl100k-like)

_WORD = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")


def bucket_of(length: float) -> int:
    k = 0
    for i, e in enumerate(BUCKET_EDGES):
        if length >= e:
            k = i
    return k


def _length_features(prompt_tokens: int) -> tuple[list[int], list[float]]:
    t = max(0, int(prompt_tokens))
    b = min(LEN_BINS - 1, t.bit_length())
    z = math.log1p(t) / 8.0
    return [0, 1 + b, 1 + LEN_BINS, 2 + LEN_BINS], [1.0, 1.0, z, z * z]


def text_feature_ids(text: str) -> list[int]:
    """Hashed unigram and bigram ids of the text's head and tail (stable across processes:
    crc32, not Python's salted hash)."""
    if len(text) > HEAD_CHARS + TAIL_CHARS:
        text = text[:HEAD_CHARS] + " " + text[-TAIL_CHARS:]
    words = _WORD.findall(text.lower())
    ids = {zlib.crc32(w.encode()) % TEXT_DIM for w in words}
    ids.update(zlib.crc32(f"{a} {b}".encode()) % TEXT_DIM for a, b in zip(words, words[1:]))
    return sorted(ids)


def featurize(text: Optional[str], prompt_tokens: int, with_text: bool = True) -> tuple[list[int], list[float]]:
    """Sparse feature vector (ids, values) of the text head's input space."""
    idx, val = _length_features(prompt_tokens)
    if with_text and text:
        ids = text_feature_ids(text)
        if ids:
            w = 1.0 / math.sqrt(len(ids))
            idx += [LEN_FEATURES + i for i in ids]
            val += [w] * len(ids)
    return idx, val


def estimate_tokens(text: Optional[str], prompt_tokens: Optional[int]) -> int:
    if prompt_tokens is not None:
        return int(prompt_tokens)
    return int(math.ceil(len(text or "") / CHARS_PER_TOKEN))


def quantiles_from_probs(probs: Sequence[float], levels: Sequence[float] = LEVELS) -> tuple[float, ...]:
    """Quantiles of a bucket distribution, log-linear inside the bucket where the CDF crosses."""
    edges = list(BUCKET_EDGES) + [TOP_LENGTH]
    out = []
    cum, k = 0.0, 0
    for q in levels:
        while k < len(probs) - 1 and cum + probs[k] < q:
            cum += probs[k]
            k += 1
        p = probs[k]
        frac = min(1.0, max(0.0, (q - cum) / p)) if p > 0 else 0.5
        lo, hi = max(1.0, float(edges[k])), float(edges[k + 1])
        out.append(lo * (hi / lo) ** frac)
    return tuple(out)


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


# ------------------------------------------------------------------------------ the model


@dataclass
class LengthPredictor:
    """Two softmax heads (text + length, length only) and per-level calibration offsets."""

    w_text: np.ndarray  # (LEN_FEATURES + TEXT_DIM, buckets)
    w_len: np.ndarray  # (LEN_FEATURES, buckets)
    levels: tuple[float, ...] = LEVELS
    offsets: list[float] = field(default_factory=lambda: [0.0] * len(LEVELS))  # log-space, per level
    online_lr: float = 0.05  # SGD step per completed request
    calibration_rate: float = 0.05  # adaptive-conformal step per completed request
    meta: dict = field(default_factory=dict)
    num_updates: int = 0

    # ---- prediction ----------------------------------------------------------------
    def bucket_probs(self, prompt: Optional[str] = None, prompt_tokens: Optional[int] = None) -> np.ndarray:
        w, idx, val = self._head(prompt, prompt_tokens)
        logits = (w[idx] * np.asarray(val, dtype=np.float32)[:, None]).sum(axis=0)
        return _softmax(logits)

    def predict(self, prompt: Optional[str] = None, prompt_tokens: Optional[int] = None) -> LengthPrediction:
        """Output-length quantiles at `levels` from the prompt text and/or its token count.
        Without text the length-only head answers."""
        base = quantiles_from_probs(self.bucket_probs(prompt, prompt_tokens).tolist(), self.levels)
        values, prev = [], 1.0
        for v, o in zip(base, self.offsets):
            prev = max(prev, v * math.exp(o))
            values.append(prev)
        return LengthPrediction(self.levels, tuple(values))

    def predict_bucket(self, prompt: Optional[str] = None, prompt_tokens: Optional[int] = None) -> int:
        return int(np.argmax(self.bucket_probs(prompt, prompt_tokens)))

    def _head(self, prompt: Optional[str], prompt_tokens: Optional[int]):
        tokens = estimate_tokens(prompt, prompt_tokens)
        if prompt:
            idx, val = featurize(prompt, tokens)
            return self.w_text, idx, val
        idx, val = featurize(None, tokens, with_text=False)
        return self.w_len, idx, val

    # ---- online adaptation -----------------------------------------------------------
    def update(self, prompt: Optional[str], actual_len: int, prompt_tokens: Optional[int] = None) -> None:
        """Learn from one completed request of the served model: an SGD step on the head(s)
        that would answer for it, then the calibration offsets."""
        if actual_len < 0:
            raise ValueError(f"actual_len must be >= 0, got {actual_len}")
        predicted = self.predict(prompt, prompt_tokens)
        tokens = estimate_tokens(prompt, prompt_tokens)
        target = bucket_of(actual_len)
        heads = [(self.w_len, featurize(None, tokens, with_text=False))]
        if prompt:
            heads.append((self.w_text, featurize(prompt, tokens)))
        for w, (idx, val) in heads:
            v = np.asarray(val, dtype=np.float32)
            p = _softmax((w[idx] * v[:, None]).sum(axis=0))
            p[target] -= 1.0
            w[idx] -= (self.online_lr * v)[:, None] * p[None, :]  # ids are unique within one example
        for j, (q, value) in enumerate(zip(self.levels, predicted.values)):
            miss = 1.0 if actual_len > value else 0.0
            self.offsets[j] += self.calibration_rate * (miss - (1.0 - q))
        self.num_updates += 1

    # ---- persistence -------------------------------------------------------------------
    def to_json(self) -> str:
        def enc(a: np.ndarray) -> str:
            return base64.b64encode(np.ascontiguousarray(a, dtype="<f2").tobytes()).decode()

        doc = {
            "format": FORMAT, "version": VERSION, "levels": list(self.levels), "bucket_edges": list(BUCKET_EDGES),
            "top_length": TOP_LENGTH, "text_dim": TEXT_DIM, "len_bins": LEN_BINS,
            "head_chars": HEAD_CHARS, "tail_chars": TAIL_CHARS,
            "offsets": [round(o, 6) for o in self.offsets], "meta": self.meta,
            "w_text": enc(self.w_text), "w_len": enc(self.w_len),
        }
        return json.dumps(doc, sort_keys=True, indent=1) + "\n"

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def from_json(cls, text: str) -> "LengthPredictor":
        doc = json.loads(text)
        if doc.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        if (tuple(doc["bucket_edges"]) != BUCKET_EDGES or doc["text_dim"] != TEXT_DIM or doc["len_bins"] != LEN_BINS
                or doc["top_length"] != TOP_LENGTH):
            raise ValueError("predictor file was trained with other feature settings; retrain with train-predictor")
        k = len(BUCKET_EDGES)

        def dec(s: str, rows: int) -> np.ndarray:
            return np.frombuffer(base64.b64decode(s), dtype="<f2").astype(np.float32).reshape(rows, k)

        return cls(dec(doc["w_text"], LEN_FEATURES + TEXT_DIM), dec(doc["w_len"], LEN_FEATURES),
                   tuple(doc["levels"]), list(doc["offsets"]), meta=doc.get("meta", {}))

    @classmethod
    def load(cls, path: Union[str, Path]) -> "LengthPredictor":
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    @classmethod
    def default(cls) -> "LengthPredictor":
        """The predictor shipped in the package (a fresh copy: online updates stay local)."""
        return cls.load(DEFAULT_PATH)


def load_predictor(spec: Optional[str]) -> Optional[LengthPredictor]:
    """`None`/"none" -> no predictor; "default" -> the shipped one; else a file path."""
    if spec is None or spec == "none":
        return None
    if spec == "default":
        return LengthPredictor.default()
    return LengthPredictor.load(spec)


# ---------------------------------------------------------------------------- training


@dataclass(frozen=True)
class Example:
    prompt: str
    prompt_tokens: int
    output_len: int


@dataclass
class TrainConfig:
    epochs: int = 8
    batch_size: int = 256
    lr: float = 0.01
    l2: float = 1e-5
    seed: int = 0
    holdout_mod: int = 10  # a prompt is held out when crc32(prompt) % holdout_mod == 0


def load_examples(path: Optional[Union[str, Path]] = None, limit: Optional[int] = None) -> list[Example]:
    """ShareGPT first turns: prompt text, prompt cl100k tokens, response cl100k tokens."""
    from sloserve.workload.traces import iter_sharegpt, shared_path

    out = []
    for d in iter_sharegpt(path or shared_path("sharegpt")):
        if limit is not None and len(out) >= limit:
            break
        out.append(Example(d["prompt"], int(d["prompt_tokens_cl100k"]), int(d["response_tokens_cl100k"])))
    return out


def split(examples: Sequence[Example], holdout_mod: int = 10) -> tuple[list[Example], list[Example]]:
    """Deterministic train / held-out split by a hash of the prompt text, so duplicated
    prompts (ShareGPT has ~10%) never straddle the two sides."""
    train, held = [], []
    for e in examples:
        (held if zlib.crc32(e.prompt.encode()) % holdout_mod == 0 else train).append(e)
    return train, held


class _CSR:
    """Rows of sparse features, row-sliceable without scipy."""

    def __init__(self, rows: Iterable[tuple[list[int], list[float]]]):
        indptr, indices, data = [0], [], []
        for idx, val in rows:
            indices.extend(idx)
            data.extend(val)
            indptr.append(len(indices))
        self.indptr = np.asarray(indptr, dtype=np.int64)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.data = np.asarray(data, dtype=np.float32)

    def rows(self, a: int, b: int):
        s, e = self.indptr[a], self.indptr[b]
        counts = np.diff(self.indptr[a:b + 1])
        return self.indices[s:e], self.data[s:e], np.repeat(np.arange(b - a), counts), self.indptr[a:b] - s


def _fit_head(csr: _CSR, y: np.ndarray, dim: int, cfg: TrainConfig, on_epoch=None) -> np.ndarray:
    """Multinomial logistic regression by minibatch Adam, deterministic (sums via bincount and
    reduceat, in a fixed order)."""
    k = len(BUCKET_EDGES)
    w = np.zeros((dim, k), dtype=np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    b1, b2, eps = 0.9, 0.999, 1e-8
    n = len(y)
    starts = list(range(0, n, cfg.batch_size))
    rng = np.random.default_rng(cfg.seed)
    t = 0
    for epoch in range(cfg.epochs):
        loss = 0.0
        for a in (starts[i] for i in rng.permutation(len(starts))):
            b = min(n, a + cfg.batch_size)
            idx, val, row, offs = csr.rows(a, b)
            contrib = w[idx] * val[:, None]
            logits = np.add.reduceat(contrib, offs, axis=0)
            p = _softmax(logits)
            yb = y[a:b]
            loss += float(-np.log(p[np.arange(b - a), yb] + 1e-12).sum())
            p[np.arange(b - a), yb] -= 1.0
            p /= (b - a)
            gi = p[row] * val[:, None]
            grad = np.stack([np.bincount(idx, weights=gi[:, j], minlength=dim) for j in range(k)], axis=1)
            grad += cfg.l2 * w
            t += 1
            m = b1 * m + (1 - b1) * grad
            v = b2 * v + (1 - b2) * grad * grad
            w -= cfg.lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
        if on_epoch is not None:
            on_epoch(epoch, loss / n)
        logger.info("epoch %d: train cross-entropy %.4f", epoch + 1, loss / n)
    return w.astype(np.float32)


def train(examples: Sequence[Example], cfg: Optional[TrainConfig] = None, on_epoch=None) -> LengthPredictor:
    """Fit both heads on `examples` (already the training side of a split)."""
    cfg = cfg or TrainConfig()
    order = np.random.default_rng(cfg.seed).permutation(len(examples))  # one shuffle; batches are slices of it
    ex = [examples[i] for i in order]
    y = np.asarray([bucket_of(e.output_len) for e in ex], dtype=np.int64)
    text_rows = _CSR(featurize(e.prompt, e.prompt_tokens) for e in ex)
    len_rows = _CSR(featurize(None, e.prompt_tokens, with_text=False) for e in ex)
    w_text = _fit_head(text_rows, y, LEN_FEATURES + TEXT_DIM, cfg, on_epoch)
    w_len = _fit_head(len_rows, y, LEN_FEATURES, cfg)
    # the float16 the file stores, so a trained model predicts exactly what its saved copy does
    w_text = w_text.astype("<f2").astype(np.float32)
    w_len = w_len.astype("<f2").astype(np.float32)
    meta = {"train_examples": len(examples), "config": asdict(cfg)}
    return LengthPredictor(w_text, w_len, meta=meta)


# -------------------------------------------------------------------------- evaluation


class GlobalMedianBaseline:
    """Every prompt gets the training set's length quantiles."""

    name = "global median"

    def __init__(self, train_examples: Sequence[Example], levels: Sequence[float] = LEVELS):
        ys = np.asarray([e.output_len for e in train_examples], dtype=np.float64)
        self.prediction = LengthPrediction(tuple(levels), tuple(float(np.quantile(ys, q)) for q in levels))

    def predict(self, prompt: Optional[str] = None, prompt_tokens: Optional[int] = None) -> LengthPrediction:
        return self.prediction


class LinearLengthBaseline:
    """Least squares on prompt tokens; quantiles = the line plus the residuals' quantiles."""

    name = "linear on prompt length"

    def __init__(self, train_examples: Sequence[Example], levels: Sequence[float] = LEVELS):
        x = np.asarray([e.prompt_tokens for e in train_examples], dtype=np.float64)
        y = np.asarray([e.output_len for e in train_examples], dtype=np.float64)
        xm, ym = x.mean(), y.mean()
        self.slope = float(((x - xm) * (y - ym)).sum() / max(1e-9, ((x - xm) ** 2).sum()))
        self.intercept = float(ym - self.slope * xm)
        resid = y - (self.intercept + self.slope * x)
        self.levels = tuple(levels)
        self.resid_q = tuple(float(np.quantile(resid, q)) for q in levels)

    def predict(self, prompt: Optional[str] = None, prompt_tokens: Optional[int] = None) -> LengthPrediction:
        point = self.intercept + self.slope * estimate_tokens(prompt, prompt_tokens)
        values, prev = [], 1.0
        for r in self.resid_q:
            prev = max(prev, point + r)
            values.append(prev)
        return LengthPrediction(self.levels, tuple(values))


@dataclass
class EvalReport:
    name: str
    n: int
    mae: float  # |median - actual|, tokens
    bucket_accuracy: float  # bucket of the median == bucket of the actual length
    within_one_bucket: float
    coverage: dict  # level -> share of actual lengths <= the predicted quantile
    interval_80: float  # share inside [q0.1, q0.9]
    mean_us: float = math.nan  # mean predict() time per request (informational)


def evaluate(name: str, predict: Callable[[Optional[str], Optional[int]], LengthPrediction],
             examples: Sequence[Example], use_text: bool = True, clock: Optional[Callable[[], float]] = None
             ) -> EvalReport:
    """Score a predictor on held-out examples. `clock` (e.g. time.perf_counter), when given,
    times the calls; the numbers themselves never depend on it."""
    abs_err, hit, near, inside = 0.0, 0, 0, 0
    covered = [0] * len(LEVELS)
    spent = 0.0
    for e in examples:
        t0 = clock() if clock else 0.0
        pred = predict(e.prompt if use_text else None, e.prompt_tokens)
        if clock:
            spent += clock() - t0
        med = pred.quantile(0.5)
        abs_err += abs(med - e.output_len)
        pb, tb = bucket_of(med), bucket_of(e.output_len)
        hit += pb == tb
        near += abs(pb - tb) <= 1
        for j, q in enumerate(LEVELS):
            covered[j] += e.output_len <= pred.quantile(q)
        inside += pred.quantile(0.1) <= e.output_len <= pred.quantile(0.9)
    n = max(1, len(examples))
    return EvalReport(name, len(examples), abs_err / n, hit / n, near / n,
                      {f"{q:g}": c / n for q, c in zip(LEVELS, covered)}, inside / n,
                      1e6 * spent / n if clock else math.nan)


def report_markdown(reports: Sequence[EvalReport]) -> str:
    cov = [f"{q:g}" for q in LEVELS]
    lines = ["| predictor | n | MAE (tokens) | bucket acc | ±1 bucket | "
             + " | ".join(f"cov q{c}" for c in cov) + " | in [q0.1, q0.9] | µs / request |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(cov) + "---:|---:|"]
    for r in reports:
        us = "" if math.isnan(r.mean_us) else f"{r.mean_us:.0f}"
        lines.append(f"| {r.name} | {r.n} | {r.mae:.1f} | {r.bucket_accuracy:.3f} | {r.within_one_bucket:.3f} | "
                     + " | ".join(f"{r.coverage[c]:.3f}" for c in cov) + f" | {r.interval_80:.3f} | {us} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ serving / simulation glue


class PredictionBook:
    """Predicts each admitted request once, keeps the distribution for the router while the
    request lives, and feeds its actual length back when it completes (online adaptation).

    The request carries the median as `predicted_output_len` (the scheduler's snapshot sums
    those); the router reads the quantiles through `lookup`."""

    def __init__(self, predictor: LengthPredictor, online: bool = True):
        self.predictor = predictor
        self.online = online
        self._live: dict[str, tuple[LengthPrediction, Optional[str]]] = {}
        self.num_predicted = 0
        self.num_observed = 0

    def annotate(self, request, prompt_text: Optional[str] = None) -> LengthPrediction:
        pred = self.predictor.predict(prompt_text, request.num_prompt_tokens)
        request.predicted_output_len = pred.median
        self._live[request.request_id] = (pred, prompt_text)
        self.num_predicted += 1
        return pred

    def lookup(self, request) -> Optional[LengthPrediction]:
        entry = self._live.get(request.request_id)
        return entry[0] if entry is not None else None

    def observe(self, request, actual_len: Optional[int] = None, completed: bool = True) -> None:
        """The request is done: forget it, and learn from its length if it ran to completion."""
        entry = self._live.pop(request.request_id, None)
        if entry is None or not completed or not self.online:
            return
        n = request.num_output_tokens if actual_len is None else actual_len
        self.predictor.update(entry[1], n, request.num_prompt_tokens)
        self.num_observed += 1
