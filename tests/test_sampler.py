"""Tests for sloserve.engine.sampler: filters, distributions, seeding, penalties, logprobs."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sloserve.engine.sampler import SampleOutput, Sampler, SamplingRow, _apply_top_k_top_p
from sloserve.core.types import SamplingParams

torch.set_num_threads(1)


def row(prompt: list[int] | None = None, output: list[int] | None = None,
        gen: torch.Generator | None = None, eos: tuple[int, ...] = (), **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), list(output or []), list(prompt or []), gen, eos)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draws(logits: list[float], n: int, seed: int = 0, **kw) -> torch.Tensor:
    """n samples of one row, drawn as one batch of n identical rows; returns counts per token."""
    x = torch.tensor([logits]).repeat(n, 1)
    out = Sampler(gen(seed))(x, [row(**kw) for _ in range(n)])
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(logits))


logit_rows = st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=2, max_size=40)


# ---- greedy -------------------------------------------------------------------------------

def test_greedy_is_argmax_and_uses_fast_path():
    x = torch.randn(6, 50, generator=gen(1))
    before = x.clone()
    out = Sampler()(x, [row(temperature=0.0) for _ in range(6)])
    assert out.token_ids == x.argmax(-1).tolist()
    assert out.logprobs == [None] * 6 and out.top_logprobs == [None] * 6
    assert torch.equal(x, before)  # the caller's logits are never modified


def test_greedy_ties_pick_lowest_index():
    out = Sampler()(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), [row(temperature=0.0)])
    assert out.token_ids == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_with_the_native_argmax_picks_the_same_tokens(dtype):
    from sloserve.engine.kernels import load_fused_ops

    ops = load_fused_ops()
    if ops is None:
        pytest.skip("no C++ toolchain to build the native kernels")
    x = torch.randn(40, 4099, generator=gen(2)).to(dtype)
    x[3, 10:20] = 9.0  # a tie
    rows = [row(temperature=0.0) for _ in range(40)]
    native = Sampler(argmax=ops.argmax_rows)(x, rows)
    assert native.token_ids == Sampler()(x, rows).token_ids
    assert native.token_ids[3] == 10


def test_greedy_rows_unaffected_and_draw_no_randomness_in_mixed_batch():
    x = torch.randn(8, 30, generator=gen(2))
    rows = [row(temperature=0.0, gen=gen(9)) if i % 2 == 0 else row(temperature=1.0)
            for i in range(8)]
    default = gen(3)
    out = Sampler(default)(x, rows)
    for i in range(0, 8, 2):
        assert out.token_ids[i] == int(x[i].argmax())
        # The greedy row's own generator was never advanced.
        assert torch.equal(rows[i].generator.get_state(), gen(9).get_state())
    # Greedy rows don't consume from the default generator either: the random rows get the
    # same tokens as when they are sampled alone.
    alone = Sampler(gen(3))(x[1::2], [row(temperature=1.0) for _ in range(4)])
    assert alone.token_ids == out.token_ids[1::2]


def test_all_greedy_fast_path_leaves_global_rng_alone():
    torch.manual_seed(123)
    expect = torch.rand(3)
    torch.manual_seed(123)
    Sampler()(torch.randn(4, 10, generator=gen(0)), [row(temperature=0.0)] * 4)
    assert torch.equal(torch.rand(3), expect)


# ---- top-k / top-p / min-p ----------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(logits=logit_rows, seed=st.integers(0, 2**31 - 1))
def test_top_k_1_equals_greedy(logits, seed):
    x = torch.tensor([logits])
    out = Sampler(gen(seed))(x, [row(temperature=1.5, top_k=1)])
    assert out.token_ids == [int(x.argmax())]


@settings(max_examples=60, deadline=None)
@given(logits=logit_rows, k=st.integers(1, 10), seed=st.integers(0, 2**31 - 1))
def test_top_k_only_samples_among_k_highest(logits, k, seed):
    n = 64
    x = torch.tensor([logits]).repeat(n, 1)
    out = Sampler(gen(seed))(x, [row(temperature=2.0, top_k=k) for _ in range(n)])
    kth = torch.tensor(logits).sort(descending=True).values[min(k, len(logits)) - 1]
    for t in out.token_ids:
        assert logits[t] >= kth


def test_top_k_disabled_values_sample_everything():
    for k in (0, -1):
        counts = draws([0.0] * 5, 2000, top_k=k)
        assert (counts > 0).all()


def test_top_p_keeps_minimal_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    counts = draws(logits, 5000, top_p=0.8)
    assert counts[2] == 0 and counts[3] == 0
    # Renormalised over the nucleus: 0.5/0.8 = 0.625 of draws.
    assert abs(counts[0].item() / 5000 - 0.625) < 0.03
    # Just above 0.8 the third token is needed.
    counts = draws(logits, 5000, top_p=0.85)
    assert counts[2] > 0 and counts[3] == 0


def test_top_p_tiny_keeps_best_and_top_p_1_keeps_tail():
    logits = [5.0, 0.0, -5.0, -30.0]
    assert draws(logits, 500, top_p=1e-6)[1:].sum() == 0
    # With top_p=1 even a 1e-14 tail token is kept as a candidate (no rounding trim).
    x = torch.tensor([logits])
    kept = _apply_top_k_top_p(x, x, torch.tensor([4]), torch.tensor([1.0]))
    assert torch.isfinite(kept).all()


def test_top_k_then_top_p_renormalises():
    # Top-2 leaves probs 0.5/0.8 and 0.3/0.8 = 0.625, 0.375; top_p=0.6 then keeps only one.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    counts = draws(logits, 1000, top_k=2, top_p=0.6)
    assert counts[0] == 1000


def test_min_p_filters_relative_to_max():
    probs = torch.tensor([0.4, 0.3, 0.19, 0.11])
    # min_p=0.3 -> threshold 0.12: token 3 dropped, tokens 0-2 kept.
    counts = draws(probs.log().tolist(), 6000, min_p=0.3)
    assert counts[3] == 0 and (counts[:3] > 0).all()
    expect = probs[:3] / probs[:3].sum()
    assert (counts[:3].double() / 6000 - expect.double()).abs().max() < 0.03


def test_filters_keep_at_least_one_token():
    counts = draws([1.0, 1.0 - 1e-3, -3.0], 300, top_k=1, top_p=1e-3, min_p=1.0)
    assert counts[0] == 300


# ---- distributions ------------------------------------------------------------------------

def test_temperature_1_matches_softmax():
    logits = [1.0, 0.5, 0.0, -0.5, -2.0]
    n = 20000
    counts = draws(logits, n, seed=7)
    probs = torch.tensor(logits, dtype=torch.float64).softmax(0)
    emp = counts.double() / n
    assert (emp - probs).abs().max() < 0.015
    chi2 = (((counts.double() - n * probs) ** 2) / (n * probs)).sum()
    assert chi2 < 20.5  # chi-square, 4 dof: p < 0.0004 under the null


def test_temperature_scaling_sharpens_and_flattens():
    logits = [1.0, 0.5, 0.0, -0.5, -2.0]
    n = 8000
    cold = draws(logits, n, temperature=0.5).double() / n
    hot = draws(logits, n, temperature=2.0).double() / n
    expect_cold = (torch.tensor(logits, dtype=torch.float64) / 0.5).softmax(0)
    assert (cold - expect_cold).abs().max() < 0.025
    assert cold[0] > 0.55 > hot[0]  # softmax at T=1 gives 0.43 to token 0
    assert hot[4] > cold[4]


def test_tiny_temperature_is_stable():
    out = Sampler(gen(0))(torch.tensor([[100.0, 99.0, -100.0]]), [row(temperature=1e-6)])
    assert out.token_ids == [0]


# ---- seeding ------------------------------------------------------------------------------

def _seeded_run(seed: int, neighbours: int, steps: int = 12) -> list[int]:
    vocab = 40
    g = gen(seed)
    noise_gen = gen(1000 + neighbours)
    sampler = Sampler(gen(neighbours))
    tokens = []
    for step in range(steps):
        x = torch.randn(1, vocab, generator=gen(step))  # the seeded request's logits
        others = torch.randn(neighbours, vocab, generator=noise_gen)
        at = neighbours // 2
        batch = torch.cat([others[:at], x, others[at:]])
        rows = [row(temperature=1.0) for _ in range(neighbours)]
        rows.insert(at, row(temperature=1.0, top_p=0.9, seed=seed, gen=g))
        tokens.append(sampler(batch, rows).token_ids[at])
    return tokens


def test_seeded_rows_reproducible_across_batches():
    a = _seeded_run(seed=42, neighbours=0)
    b = _seeded_run(seed=42, neighbours=5)
    c = _seeded_run(seed=42, neighbours=2)
    assert a == b == c
    assert _seeded_run(seed=43, neighbours=3) != a


# ---- penalties and min_tokens -------------------------------------------------------------

def lp_row(**kw) -> SamplingRow:
    return row(temperature=0.0, logprobs=0, **kw)


def processed(x: list[float], r: SamplingRow) -> torch.Tensor:
    """The processed logits, recovered up to a constant from the returned top logprobs."""
    r.params.logprobs = len(x) if len(x) <= 20 else 20
    out = Sampler()(torch.tensor([x]), [r])
    lp = torch.full((len(x),), -math.inf)
    for t, v in out.top_logprobs[0]:
        lp[t] = v
    return lp


def test_repetition_penalty_divides_positive_multiplies_negative():
    x = [2.0, -1.0, 1.0, -3.0, 0.5]
    r = lp_row(prompt=[0], output=[1, 1], repetition_penalty=2.0)
    lp = processed(x, r)
    expect = torch.tensor([1.0, -2.0, 1.0, -3.0, 0.5]).log_softmax(0)
    assert torch.allclose(lp, expect, atol=1e-5)


def test_frequency_and_presence_penalties():
    x = [1.0, 1.0, 1.0, 1.0]
    r = lp_row(prompt=[3], output=[0, 0, 0, 1], frequency_penalty=0.5, presence_penalty=0.25)
    lp = processed(x, r)
    # Token 0: 1 - 3*0.5 - 0.25; token 1: 1 - 0.5 - 0.25; prompt-only token 3 untouched.
    expect = torch.tensor([-0.75, 0.25, 1.0, 1.0]).log_softmax(0)
    assert torch.allclose(lp, expect, atol=1e-5)


def test_penalty_flips_greedy_choice_and_negative_penalty_boosts():
    x = torch.tensor([[3.0, 2.9, 0.0]])
    assert Sampler()(x, [row(temperature=0.0, output=[0])]).token_ids == [0]
    assert Sampler()(x, [row(temperature=0.0, output=[0], presence_penalty=0.2)]).token_ids == [1]
    assert Sampler()(x, [row(temperature=0.0, prompt=[0], repetition_penalty=1.1)]).token_ids == [1]
    assert Sampler()(x, [row(temperature=0.0, output=[2, 2], frequency_penalty=-2.0)]).token_ids == [2]


def test_penalties_only_touch_their_rows():
    x = torch.tensor([[3.0, 2.9, 0.0]] * 3)
    rows = [row(temperature=0.0, output=[0]), row(temperature=0.0, output=[0], presence_penalty=1.0),
            row(temperature=0.0, output=[0], frequency_penalty=0.0)]
    assert Sampler()(x, rows).token_ids == [0, 1, 0]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    x = torch.tensor([[0.0, 5.0, 4.0, 1.0]])  # 1 is EOS, 2 a stop id
    kw = dict(temperature=0.0, min_tokens=3, stop_token_ids=[2], eos=(1,))
    assert Sampler()(x, [row(output=[0, 0], **kw)]).token_ids == [3]
    assert Sampler()(x, [row(output=[0, 0, 0], **kw)]).token_ids == [1]
    # ignore_eos: EOS is no stop token, so it is not masked (vLLM); the stop id still is.
    assert Sampler()(x, [row(output=[], ignore_eos=True, **kw)]).token_ids == [1]
    # Random rows never sample a masked id either.
    counts = draws([0.0, 5.0, 4.0, 1.0], 500, min_tokens=1, stop_token_ids=[2], eos=(1,))
    assert counts[1] == 0 and counts[2] == 0


# ---- logprobs -----------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(logits=logit_rows, n=st.integers(1, 20), temp=st.sampled_from([0.0, 0.7, 1.0]),
       seed=st.integers(0, 1000))
def test_logprobs_match_log_softmax_of_processed_logits(logits, n, temp, seed):
    x = torch.tensor([logits])
    r = row(temperature=temp, top_k=3, logprobs=n, output=[0], frequency_penalty=0.3)
    out = Sampler(gen(seed))(x, [r])
    proc = x.clone()
    proc[0, 0] -= 0.3
    ref = proc.log_softmax(-1)[0]  # untempered, unfiltered: the documented choice
    tok = out.token_ids[0]
    assert out.logprobs[0] == pytest.approx(ref[tok].item(), abs=1e-5)
    top = out.top_logprobs[0]
    assert len(top) == min(n, len(logits))
    vals = [v for _, v in top]
    assert vals == sorted(vals, reverse=True)
    assert vals[0] == pytest.approx(ref.max().item(), abs=1e-5)
    for t, v in top:
        assert v == pytest.approx(ref[t].item(), abs=1e-5)


def test_logprobs_zero_gives_only_sampled_token_and_none_when_unset():
    x = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]]))
    out = Sampler()(x, [row(temperature=0.0, logprobs=0), row(temperature=0.0)])
    assert isinstance(out, SampleOutput)
    assert out.token_ids == [0, 0]
    assert out.logprobs[0] == pytest.approx(math.log(0.5), abs=1e-6)
    assert out.top_logprobs[0] == []
    assert out.logprobs[1] is None and out.top_logprobs[1] is None


def test_logprobs_see_min_tokens_mask():
    out = Sampler()(torch.zeros(1, 4), [row(temperature=0.0, logprobs=4, min_tokens=1, eos=(3,))])
    top = dict(out.top_logprobs[0])
    assert top[3] == -math.inf and top[0] == pytest.approx(math.log(1 / 3), abs=1e-6)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 4), [row()])
