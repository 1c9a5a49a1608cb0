"""LoRA adapters: PEFT-format low-rank deltas on the base model's linears, many in one batch.

An adapter adds `scaling * B (A x)` to some of every layer's projections (q, k, v, o, gate, up,
down). The forward runs the base model once for the whole batch, then adds each adapter's delta to
the rows of its requests: two thin products per fused projection and adapter present in the step
(the gathered, segmented form of Punica's and S-LoRA's kernels). The adapters of one fused
projection are stored fused too: q, k and v's A matrices stacked, their B matrices as one
block-diagonal matrix, so the qkv delta is two products whatever the adapter targets.

Files are read as PEFT writes them (`adapter_config.json` + `adapter_model.safetensors`, keys like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`), without peft itself. What the
engine cannot apply exactly is refused at load with a message naming it: DoRA, biases, replaced
modules (`modules_to_save`), targets outside the decoder layers' projections, shapes that do not
fit the base model.

The registry keeps every loaded adapter in host memory and a bounded number (`max_loras`) in the
compute device's form, least recently used out first; on a CPU the two are the same tensors.
An adapter unloaded while requests still use it leaves the lookup at once (new requests are
refused) and stays usable by those requests until the last one ends.
"""
from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from sloserve.core.config import ModelConfig

# PEFT module name -> (the fused projection that computes it, its place among that projection's parts)
_TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
            "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


class LoraError(ValueError):
    """An adapter that cannot be loaded or applied; the message names what and why."""


class LoraExists(LoraError):
    """The name is already served (or still finishing requests after an unload)."""


def part_shapes(config: ModelConfig) -> dict[str, list[tuple[int, int]]]:
    """Each fused projection's parts as (out_features, in_features), in the order they are fused."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {"qkv": [(q, h), (kv, h), (kv, h)], "o": [(h, q)], "gate_up": [(i, h), (i, h)], "down": [(h, i)]}


@dataclass
class LoraAdapter:
    """One adapter in fused form: per layer, fused projection -> (A [R, in], B [out, R]), the
    scaling folded into B; a projection the adapter does not touch is absent."""

    name: str
    path: str
    rank: int  # the largest rank of any module
    target_modules: tuple[str, ...]
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    nbytes: int = 0

    def to(self, device: torch.device, dtype: torch.dtype) -> "LoraAdapter":
        """A copy on `device` in `dtype` (the same tensors where nothing changes)."""
        layers = [{k: (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)) for k, (a, b) in lay.items()}
                  for lay in self.layers]
        return LoraAdapter(self.name, self.path, self.rank, self.target_modules, layers, self.nbytes)


def check_name(name: object) -> str:
    """An adapter's name as requests give it in `model`: 1-128 characters of letters, digits and . _ : / -."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise LoraError(f"adapter name must be 1-128 characters of letters, digits and . _ : / - "
                        f"(starting with a letter or digit), got {name!r}")
    return name


def load_peft_adapter(name: str, path: str, config: ModelConfig, dtype: torch.dtype = torch.float32,
                      max_rank: int = 64) -> LoraAdapter:
    """Read a PEFT LoRA directory for a base model of `config`, in host memory as `dtype`."""
    root = Path(path)
    cfg_path = root / "adapter_config.json"
    if not cfg_path.is_file():
        raise LoraError(f"adapter {name!r}: {cfg_path} not found (a PEFT LoRA directory holds "
                        "adapter_config.json and adapter_model.safetensors)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"adapter {name!r}: {cfg_path} is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"adapter {name!r}: {cfg_path} must hold a JSON object")
    _check_config(name, cfg)
    weights_path = root / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise LoraError(f"adapter {name!r}: {weights_path} not found (only safetensors adapters load)")
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # a truncated or foreign file: safetensors raises its own types
        raise LoraError(f"adapter {name!r}: {weights_path} is not a readable safetensors file ({exc})") from None

    shapes = part_shapes(config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoraError(f"adapter {name!r}: tensor {key!r} is not a LoRA matrix of a decoder layer's "
                            "projection (embeddings, the LM head and other modules are not supported)")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in _TARGETS:
            raise LoraError(f"adapter {name!r}: target {module!r} is not one of {', '.join(_TARGETS)}")
        if layer >= config.num_layers:
            raise LoraError(f"adapter {name!r}: tensor {key!r} is for layer {layer}, the base model has "
                            f"{config.num_layers}")
        slot = pairs.setdefault((layer, module), {})
        if which in slot:
            raise LoraError(f"adapter {name!r}: two lora_{which} tensors for layer {layer}'s {module}")
        slot[which] = tensor
    if not pairs:
        raise LoraError(f"adapter {name!r}: {weights_path} holds no LoRA matrices")

    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(config.num_layers)]
    by_part: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for (layer, module), slot in sorted(pairs.items()):
        if set(slot) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: layer {layer}'s {module} has lora_{''.join(slot)} without its pair")
        a, b = slot["A"].float(), slot["B"].float()
        part, index = _TARGETS[module]
        out_f, in_f = shapes[part][index]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape != (out_f, r):
            raise LoraError(f"adapter {name!r}: layer {layer}'s {module} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}; the base model needs A [r, {in_f}] and B [{out_f}, r]")
        if not 0 < r <= max_rank:
            raise LoraError(f"adapter {name!r}: rank {r} of layer {layer}'s {module} is over the server's "
                            f"--max-lora-rank {max_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraError(f"adapter {name!r}: layer {layer}'s {module} holds NaN or infinite values")
        rank = max(rank, r)
        scaled_b = b * _scaling(cfg, f"layers.{layer}.{module}", r)
        by_part.setdefault((layer, part), []).append((index, a, scaled_b))
    nbytes = 0
    for (layer, part), items in by_part.items():
        a_cat = torch.cat([a for _, a, _ in items]).to(dtype)
        outs = shapes[part]
        b_fused = torch.zeros(sum(o for o, _ in outs), a_cat.shape[0], dtype=dtype)
        col = 0
        for index, a, b in items:
            row = sum(o for o, _ in outs[:index])
            b_fused[row:row + b.shape[0], col:col + a.shape[0]] = b.to(dtype)
            col += a.shape[0]
        layers[layer][part] = (a_cat.contiguous(), b_fused)
        nbytes += (a_cat.numel() + b_fused.numel()) * a_cat.element_size()
    targets = tuple(sorted({module for _, module in pairs}, key=list(_TARGETS).index))
    return LoraAdapter(name, str(root), rank, targets, layers, nbytes)


def _check_config(name: str, cfg: dict) -> None:
    def refuse(why: str):
        raise LoraError(f"adapter {name!r}: {why}")

    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        refuse(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        refuse("DoRA adapters (use_dora) are not supported")
    if cfg.get("fan_in_fan_out"):
        refuse("fan_in_fan_out adapters (GPT-2 style Conv1D layers) do not fit Llama-family linears")
    if cfg.get("bias", "none") not in ("none", None):
        refuse(f"bias {cfg.get('bias')!r}: adapters that train biases are not supported")
    if cfg.get("modules_to_save"):
        refuse(f"modules_to_save {cfg['modules_to_save']!r}: adapters that replace whole modules are not supported")
    alpha = cfg.get("lora_alpha", cfg.get("r", 8))
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        refuse(f"lora_alpha must be a number, got {alpha!r}")


def _scaling(cfg: dict, module_path: str, rank: int) -> float:
    """PEFT's scaling for one module: alpha / r, or alpha / sqrt(r) with rsLoRA; alpha from
    `alpha_pattern` where one of its keys names this module (as PEFT matches them: a suffix)."""
    alpha = cfg.get("lora_alpha", cfg.get("r", 8))
    for pattern, value in (cfg.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){pattern}$", module_path):
            alpha = value
            break
    return float(alpha) / (math.sqrt(rank) if cfg.get("use_rslora") else rank)


@dataclass
class LoraStack:
    """Every resident adapter's matrices side by side, per layer and fused projection: A's stacked
    [sum R, in], B's side by side [out, sum R], and each adapter's columns. A step that mixes
    adapters computes all its deltas in two products per projection, each row masked to its own
    adapter's columns: one pair of GEMMs instead of a gather, two thin products and a scatter
    per adapter (16 adapters over 32 rows, one qkv projection of the embedded model in bf16 on
    2 Zen4 cores: 274 against 893 us). A resident adapter the step does not use costs compute,
    never a wrong row (its columns are masked out)."""

    names: tuple[str, ...]
    parts: list[dict[str, tuple[torch.Tensor, torch.Tensor, tuple[tuple[str, int, int], ...]]]]

    @classmethod
    def of(cls, adapters: list[LoraAdapter]) -> "LoraStack":
        num_layers = len(adapters[0].layers) if adapters else 0
        parts: list[dict] = []
        for layer in range(num_layers):
            mine: dict = {}
            for part in ("qkv", "o", "gate_up", "down"):
                having = [(a.name, *a.layers[layer][part]) for a in adapters if part in a.layers[layer]]
                if not having:
                    continue
                cols, c = [], 0
                for name, a, _ in having:
                    cols.append((name, c, c + a.shape[0]))
                    c += a.shape[0]
                mine[part] = (torch.cat([a for _, a, _ in having]).contiguous(),
                              torch.cat([b for _, _, b in having], dim=1).contiguous(), tuple(cols))
            parts.append(mine)
        return cls(tuple(a.name for a in adapters), parts)


@dataclass
class LoraBatch:
    """The adapters of one forward pass and the flat-batch rows each applies to (None: every
    row); with `stack` (two adapters or more in the step) their deltas are computed stacked."""

    groups: list[tuple[LoraAdapter, Optional[torch.Tensor]]]
    stack: Optional[LoraStack] = None
    _masks: dict = field(default_factory=dict, repr=False)  # column layout -> [rows, sum R] 0/1 mask

    def add(self, layer: int, part: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += B (A x[rows]) for each adapter that touches this layer's `part`."""
        if self.stack is not None:
            entry = self.stack.parts[layer].get(part)
            if entry is not None:
                a_all, b_all, cols = entry
                out.add_(((x @ a_all.t()) * self._mask(cols, x)) @ b_all.t())
            return
        for adapter, rows in self.groups:
            ab = adapter.layers[layer].get(part)
            if ab is None:
                continue
            a, b = ab
            if rows is None:
                out.add_((x @ a.t()) @ b.t())
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())

    def _mask(self, cols: tuple[tuple[str, int, int], ...], x: torch.Tensor) -> torch.Tensor:
        """1 where a row's adapter owns the column (one mask per column layout and step)."""
        mask = self._masks.get(cols)
        if mask is None:
            mask = torch.zeros(x.shape[0], cols[-1][2] if cols else 0, dtype=x.dtype, device=x.device)
            where = {name: (c0, c1) for name, c0, c1 in cols}
            for adapter, rows in self.groups:
                span = where.get(adapter.name)
                if span is None:
                    continue
                if rows is None:
                    mask[:, span[0]:span[1]] = 1
                else:
                    mask[rows, span[0]:span[1]] = 1
            self._masks[cols] = mask
        return mask


@dataclass
class _Held:
    adapter: LoraAdapter  # host form
    users: int = 0
    unloaded: bool = False


@dataclass
class LoraRegistry:
    """The adapters one engine serves, by name (see the module docstring)."""

    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_loras: int = 4  # adapters kept in the device's form
    max_rank: int = 64
    _held: dict[str, _Held] = field(default_factory=dict)
    _resident: "OrderedDict[str, LoraAdapter]" = field(default_factory=OrderedDict)
    # What names() returns, replaced whole on each change: another thread (a server's event loop)
    # reads it while the engine thread loads and unloads.
    _served: tuple[str, ...] = ()
    _stack: Optional[LoraStack] = None  # of the resident adapters, built when a step mixes them

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise LoraError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_rank < 1:
            raise LoraError(f"max_lora_rank must be >= 1, got {self.max_rank}")

    def load(self, name: str, path: str) -> LoraAdapter:
        """Read and serve `name` (LoraError if the name is taken or the files do not fit)."""
        self._check_free(name)
        return self.add(self.read(name, path))

    def read(self, name: str, path: str) -> LoraAdapter:
        """Read an adapter for this base model without serving it (touches no registry state:
        a server reads files off the engine's thread, then `add`s on it)."""
        self._check_free(check_name(name))
        return load_peft_adapter(name, path, self.config, self.dtype, self.max_rank)

    def add(self, adapter: LoraAdapter) -> LoraAdapter:
        """Serve an adapter `read` returned."""
        self._check_free(adapter.name)
        self._held[adapter.name] = _Held(adapter)
        self._served = (*self._served, adapter.name)
        return adapter

    def _check_free(self, name: str) -> None:
        if name in self._held:
            raise LoraExists(f"adapter {name!r} is already loaded" + (
                " (unloaded, still finishing requests)" if self._held[name].unloaded else ""))

    def unload(self, name: str) -> None:
        """Stop serving `name`; requests already using it finish with it."""
        held = self._held.get(name)
        if held is None or held.unloaded:
            raise LoraError(f"adapter {name!r} is not loaded")
        held.unloaded = True
        self._served = tuple(n for n in self._served if n != name)
        self._drop_if_idle(name)

    def names(self) -> tuple[str, ...]:
        """The adapters new requests may use, in load order (safe to read from any thread)."""
        return self._served

    def get(self, name: str) -> LoraAdapter:
        held = self._held.get(name)
        if held is None or held.unloaded:
            raise LoraError(f"adapter {name!r} is not loaded")
        return held.adapter

    def __contains__(self, name: object) -> bool:
        """Whether new requests may use `name` (safe from any thread)."""
        return name in self._served

    def acquire(self, name: str) -> None:
        """A request starts using `name` (which must be served)."""
        self.get(name)
        self._held[name].users += 1

    def release(self, name: str) -> None:
        """A request using `name` ended."""
        held = self._held.get(name)
        if held is None:
            return
        held.users = max(0, held.users - 1)
        self._drop_if_idle(name)

    def users(self, name: str) -> int:
        held = self._held.get(name)
        return 0 if held is None else held.users

    def resident(self) -> list[str]:
        """Adapters in the device's form, least recently used first."""
        return list(self._resident)

    def for_step(self, names: list[str]) -> list[LoraAdapter]:
        """The device form of each adapter a step uses (every one of them resident during the
        step, even past max_loras: the least recently used others are evicted first)."""
        out = []
        for name in names:
            found = self._resident.get(name)
            if found is None:
                found = self._resident[name] = self._held[name].adapter.to(self.device, self.dtype)
                self._stack = None
            self._resident.move_to_end(name)
            out.append(found)
        keep = set(names)
        for name in list(self._resident):
            if len(self._resident) <= self.max_loras:
                break
            if name not in keep:
                del self._resident[name]
                self._stack = None
        return out

    def stack(self) -> LoraStack:
        """The resident adapters stacked (rebuilt only when the resident set changes)."""
        if self._stack is None:
            self._stack = LoraStack.of(list(self._resident.values()))
        return self._stack

    def _drop_if_idle(self, name: str) -> None:
        held = self._held[name]
        if held.unloaded and held.users == 0:
            del self._held[name]
            if self._resident.pop(name, None) is not None:
                self._stack = None


def parse_lora_option(text: str) -> tuple[str, str]:
    """`NAME=PATH` (a `--lora` value) -> (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise LoraError(f"--lora takes NAME=PATH (a PEFT adapter directory), got {text!r}")
    return check_name(name.strip()), path.strip()


__all__ = ["LoraAdapter", "LoraBatch", "LoraError", "LoraExists", "LoraRegistry", "LoraStack", "check_name", "load_peft_adapter",
           "parse_lora_option", "part_shapes"]
