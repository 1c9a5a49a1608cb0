"""The real executor: turns a StepPlan into one forward pass and sampled tokens."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from sloserve.engine.model import ForwardBatch, KVCache, LlamaModel, PrefillSpan
from sloserve.engine.sampler import Sampler, SamplingRow
from sloserve.engine.kv_tiers import TierMoveReport, TierMovers
from sloserve.engine.lora import LoraBatch, LoraRegistry
from sloserve.engine.structured import GrammarBackend, RequestMatcher
from sloserve.engine.swap import HostKVPool
from sloserve.sched.plan import ScheduledRequest, StepPlan, StepResult

_SEED_MODULUS = 2**64  # torch generators take seeds in [0, 2**64); they reduce negatives the same way
_MASK = _SEED_MODULUS - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def token_seed(seed: int, index: int) -> int:
    """The generator seed for output token `index` of a request seeded with `seed`: the seed
    and the index each pass through SplitMix64, so neighbouring seeds and indices give
    unrelated streams. Stateless by design: a request's sampling state is (seed, tokens so
    far), which a migration or a failover carries for free."""
    return _splitmix64(_splitmix64(seed % _SEED_MODULUS) ^ index)


class KVTransferError(RuntimeError):
    """The step failed while moving KV blocks (swap or copy-on-write), before any request
    computed: the pool's contents are unknown, so this is an engine fault, not a request's."""


class TierLoadFailed(RuntimeError):
    """Some prefix blocks could not be loaded from a lower tier (a file gone, the store lost a
    key). Raised after every KV move of the step ran and before any compute: the engine sends
    the requests that would read those blocks back to recompute them and runs the rest."""

    def __init__(self, failed_blocks: set[int]):
        super().__init__(f"{len(failed_blocks)} KV blocks did not load from their tier")
        self.failed_blocks = failed_blocks


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, eos_token_ids: tuple[int, ...], seed: int = 0,
                 host_pool: Optional[HostKVPool] = None, tier_movers: Optional[TierMovers] = None):
        self.model = model
        self.kv_cache = kv_cache
        self.host_pool = host_pool  # the swap tier; None when preemption only recomputes
        self.tier_movers = tier_movers  # the prefix cache's lower tiers; None without them
        self.last_tier_report = TierMoveReport()
        self.last_swap_s = 0.0  # time the last step spent copying KV to/from the host tier
        self.last_swap_blocks = 0
        self.block_size = kv_cache.block_size
        self.device = model.device
        self.eos_token_ids = eos_token_ids
        default = torch.Generator(device=self.device)
        default.manual_seed(seed)
        self.sampler = Sampler(default, argmax=getattr(model.fused, "argmax_rows", None))
        self._generators: dict[str, torch.Generator] = {}
        self.grammar: Optional[GrammarBackend] = None  # set by the engine with its first structured request
        self._matchers: dict[str, RequestMatcher] = {}
        self._mask_pool: Optional[ThreadPoolExecutor] = None  # fills masks during the forward pass
        self.loras: Optional[LoraRegistry] = None  # the engine's adapters; None when it serves none

    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan's KV operations, then its forward pass and sampling.

        Raises KVTransferError when the KV operations fail. A seeded request's draw depends only
        on its seed and its output length (`token_seed`), so after a failed compute the engine
        can re-run any subset of the plan's requests (without its KV operations) and draw the
        same tokens, and another instance continuing the request draws what this one would."""
        t0 = time.perf_counter()
        self.last_swap_s, self.last_swap_blocks = 0.0, 0
        report = TierMoveReport()
        try:
            # Reads of this step's device blocks first (tier saves, swap-outs), then writes
            # (swap-ins, tier loads, copies), then the forward.
            movers = self.tier_movers
            if plan.tier_ops and movers is None:
                raise RuntimeError("the plan moves KV to or from lower tiers but the engine has none")
            if plan.tier_ops:
                movers.save(plan.tier_ops, report)
            if plan.swap_out or plan.swap_in:
                t_swap = time.perf_counter()
                self._swap(plan)
                self.last_swap_s = time.perf_counter() - t_swap
            if plan.tier_ops:
                movers.load(plan.tier_ops, report)
            if plan.copies:
                self.kv_cache.copy_blocks([(op.src, op.dst) for op in plan.copies])
        except Exception as exc:
            raise KVTransferError(f"KV block transfer failed: {exc!r}") from exc
        self.last_tier_report = report
        if report.failed_blocks:
            raise TierLoadFailed(report.failed_blocks)
        if plan.is_empty:
            return StepResult({}, time.perf_counter() - t0)
        return self._compute(plan, t0)

    def _compute(self, plan: StepPlan, t0: float) -> StepResult:
        # A draft verify runs as decode rows, one per position (each attends to its own prefix),
        # through the same attention kernel as plain decoding: the same numbers, no gather.
        decodes = [s for s in plan.scheduled if s.num_new_tokens == 1 or s.draft_token_ids]
        chunks = [s for s in plan.scheduled if s.num_new_tokens > 1 and not s.draft_token_ids]
        batch = self._build_batch(decodes, chunks)
        sampling = [s for s in decodes + chunks if s.samples]
        masks = self._start_masks(sampling)  # computed while the forward runs
        logits = self.model.forward(batch, self.kv_cache)
        if masks is not None:
            self.grammar.apply(logits, *masks.result())  # type: ignore[union-attr]
        rows: list[SamplingRow] = []
        for s in sampling:
            rows.extend(self._verify_rows(s) if s.draft_token_ids else [self._row(s)])
        out = self.sampler(logits, rows)
        sampled, extras, more = {}, {}, {}
        i = 0
        for s in sampling:
            rid = s.request_id
            sampled[rid] = out.token_ids[i]
            if s.draft_token_ids:
                n = len(s.draft_token_ids)
                tokens = out.token_ids[i:i + n + 1]
                accepted = 0
                while accepted < n and tokens[accepted] == s.draft_token_ids[accepted]:
                    accepted += 1
                more[rid] = tokens[1:accepted + 1]
                i += n + 1
                continue
            if out.logprobs[i] is not None:
                extras[rid] = (out.logprobs[i], out.top_logprobs[i])
            i += 1
        return StepResult(sampled, time.perf_counter() - t0, extras, more)

    def _swap(self, plan: StepPlan) -> None:
        """Out before in: a block swapped out may be the destination of a swap-in (or of this
        step's writes) in the same step."""
        if self.host_pool is None:
            raise RuntimeError("the plan swaps KV but the engine has no host swap pool")
        self.host_pool.swap_out(self.kv_cache, plan.swap_out)
        self.host_pool.swap_in(self.kv_cache, plan.swap_in)
        if self.kv_cache.data.device.type == "cuda":
            torch.cuda.synchronize(self.kv_cache.data.device)  # time the copies, and finish them before reuse
        self.last_swap_blocks = len(plan.swap_out) + len(plan.swap_in)

    def release(self, request_id: str) -> None:
        """Forget per-request state once a request has finished."""
        self._generators.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def _start_masks(self, sampling: list[ScheduledRequest]) -> Optional[Future]:
        """The token masks of this step's requests with a structured output (engine/structured.py),
        computed on a helper thread while the forward pass runs; None when no request has one.
        Matchers first catch up with their requests' outputs. A request verifying drafts gets one
        mask per verified position, each after the drafts before it: a draft the constraint forbids
        cannot be its row's token, so verification stops there."""
        work: list[tuple[int, RequestMatcher, tuple[int, ...]]] = []
        row = 0
        for s in sampling:
            constraint = s.request.sampling_params.structured
            if constraint is not None:
                if self.grammar is None:
                    raise RuntimeError("a structured request reached the runner before the engine built its grammar")
                matcher = self._matchers.get(s.request_id)
                if matcher is None:
                    matcher = self._matchers[s.request_id] = self.grammar.matcher(constraint)
                matcher.sync(s.request.output_token_ids)
                work.append((row, matcher, tuple(s.draft_token_ids)))
            row += 1 + len(s.draft_token_ids)
        if not work:
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="sloserve-masks")
        return self._mask_pool.submit(self.grammar.masks, work, row)  # type: ignore[union-attr]

    def _row(self, item: ScheduledRequest) -> SamplingRow:
        req = item.request
        params = req.sampling_params
        gen: Optional[torch.Generator] = None
        if params.seed is not None and not params.greedy:
            gen = self._generators.get(req.request_id)
            if gen is None:
                gen = self._generators[req.request_id] = torch.Generator(device=self.device)
            gen.manual_seed(token_seed(params.seed, len(req.output_token_ids)))
        return SamplingRow(params, req.output_token_ids, req.prompt_token_ids, gen, self.eos_token_ids)

    def _verify_rows(self, item: ScheduledRequest) -> list[SamplingRow]:
        """One row per verified position: the row after draft j sees the output as if drafts
        0..j-1 were already accepted, so penalties and min_tokens apply exactly as plain
        decoding would apply them (speculation is for greedy requests: no generator)."""
        req = item.request
        params, out, drafts = req.sampling_params, req.output_token_ids, list(item.draft_token_ids)
        return [SamplingRow(params, out + drafts[:j], req.prompt_token_ids, None, self.eos_token_ids)
                for j in range(len(drafts) + 1)]

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _build_batch(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]) -> ForwardBatch:
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        sample_indices: list[int] = []
        bs = self.block_size

        decode_blocks = decode_mask = ctx = None
        lora_rows: dict[str, list[int]] = {}  # adapter -> its requests' rows in the flat batch
        if decodes:
            # One row per computed position: a plain decode has one, a verify 1 + its drafts.
            contexts: list[int] = []
            for d in decodes:
                contexts.extend(range(d.start + 1, d.start + 2 + len(d.draft_token_ids)))
            ctx = torch.tensor(contexts)
            width = -(-int(ctx.max()) // bs)
            tables = torch.zeros(len(contexts), width, dtype=torch.long)
            row = 0
            for d in decodes:
                n = min(width, len(d.block_table))
                rows = 1 + len(d.draft_token_ids)
                tables[row:row + rows, :n] = torch.tensor(d.block_table[:n], dtype=torch.long)
                ids.extend(d.request.token_slice(d.start, d.start + 1))
                ids.extend(d.draft_token_ids)
                if d.samples:
                    sample_indices.extend(range(row, row + rows))
                if d.request.lora is not None:
                    lora_rows.setdefault(d.request.lora, []).extend(range(row, row + rows))
                row += rows
            decode_blocks = tables
            if self.model.reads_decode_mask(self.kv_cache):  # the native kernel masks by context length
                pos = torch.arange(width * bs)
                valid = pos.unsqueeze(0) < ctx.unsqueeze(1)  # padding blocks and slots are masked out
                window = self.model.config.sliding_window
                if window is not None:
                    valid &= pos.unsqueeze(0) > (ctx - 1 - window).unsqueeze(1)
                decode_mask = torch.zeros(len(contexts), 1, 1, width * bs, dtype=self.model.dtype)
                decode_mask.masked_fill_(~valid.view(len(contexts), 1, 1, -1), float("-inf"))
            last = ctx - 1
            positions.append(last)
            slots.append(tables[torch.arange(len(contexts)), last // bs] * bs + last % bs)

        spans: list[PrefillSpan] = []
        for p in prefills:
            start, end = p.start, p.start + p.num_new_tokens
            token_start = len(ids)
            ids.extend(p.request.token_slice(start, end))
            if p.request.lora is not None:
                lora_rows.setdefault(p.request.lora, []).extend(range(token_start, len(ids)))
            positions.append(torch.arange(start, end))
            slots.append(self._slots(p.block_table, start, end))
            blocks = None
            if start:
                blocks = torch.tensor(p.block_table[: -(-end // bs)], dtype=torch.long, device=self.device)
            spans.append(PrefillSpan(token_start, p.num_new_tokens, start, blocks))
            if p.samples:
                sample_indices.append(len(ids) - 1)

        prefill_tables = None
        if spans and self.device.type == "cpu" and self.model.takes_prefill_tables(self.kv_cache):  # model.py
            width = max(-(-(p.start + p.num_new_tokens) // bs) for p in prefills)
            prefill_tables = torch.zeros(len(prefills), width, dtype=torch.long)
            for i, p in enumerate(prefills):
                n = -(-(p.start + p.num_new_tokens) // bs)
                prefill_tables[i, :n] = torch.tensor(p.block_table[:n], dtype=torch.long)
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.cat(positions).to(dev),
            slot_mapping=torch.cat(slots).to(dev),
            num_decodes=0 if ctx is None else len(ctx),
            decode_blocks=None if decode_blocks is None else decode_blocks.to(dev),
            decode_mask=None if decode_mask is None else decode_mask.to(dev),
            decode_context_lens=None if ctx is None else ctx.to(dev),
            prefills=spans,
            sample_indices=torch.tensor(sample_indices, dtype=torch.long, device=dev),
            prefill_tables=prefill_tables,
            lora=self._lora_batch(lora_rows, len(ids)),
        )

    def _lora_batch(self, rows: dict[str, list[int]], num_tokens: int) -> Optional[LoraBatch]:
        """The step's adapters and their rows (None: no request of the step uses one)."""
        if not rows:
            return None
        if self.loras is None:
            raise RuntimeError("a request with an adapter reached an engine that serves none")
        adapters = self.loras.for_step(list(rows))
        return LoraBatch([(adapter, None if len(r) == num_tokens else torch.tensor(r, dtype=torch.long,
                                                                                 device=self.device))
                          for adapter, r in zip(adapters, rows.values())],
                         self.loras.stack() if len(adapters) > 1 else None)
