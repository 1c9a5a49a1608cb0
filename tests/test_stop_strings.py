"""Stop strings: the incremental matcher against a naive scan, their limits, and the engine
cutting (and holding back) text exactly as a scan of every stop string would."""
from __future__ import annotations

from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sloserve import SamplingParams
from sloserve.engine.stop_strings import StopMatch, StopMatcher
from sloserve.core.types import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

PROMPT = "The capital of France is Paris. The capital of Germany is"
MAX_TOKENS = 24


# ---------------------------------------------------------------------- the naive reference


def naive_match(text: str, stops: list[str]) -> Optional[tuple[int, str]]:
    """The engine's former rule: the earliest start over all stop strings, the first listed on a tie."""
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        i = text.find(stop)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def naive_pending(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    return max(k for k in range(len(text) + 1)
               if any(k < len(s) and s.startswith(text[len(text) - k:]) for s in stops))


# ---------------------------------------------------------------------- the matcher

ALPHABET = "ab c"
stop_lists = st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=6)


@st.composite
def chunked_texts(draw) -> list[str]:
    text = draw(st.text(ALPHABET, max_size=60))
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=12)) | {0, len(text)})
    return [text[a:b] for a, b in zip(cuts, cuts[1:])] or [""]


@settings(max_examples=400, deadline=None)
@given(stops=stop_lists, chunks=chunked_texts())
def test_matcher_agrees_with_a_naive_scan(stops, chunks):
    matcher = StopMatcher(stops)
    text = ""
    for chunk in chunks:
        text += chunk
        got = matcher.feed(chunk)
        assert matcher.consumed == len(text)
        want = naive_match(text, stops)
        if want is not None:
            assert got == StopMatch(*want), (text, stops)
            return
        assert got is None
        assert matcher.pending == naive_pending(text, stops), (text, stops)


def test_matcher_examples():
    m = StopMatcher(["ab", "abc"])
    assert m.feed("xa") is None and m.pending == 1
    assert m.feed("bc") == StopMatch(1, "ab")  # same start: the one listed first
    m = StopMatcher(["abcd", "bc"])
    assert m.feed("abc") == StopMatch(1, "bc")  # "abcd" might come, but "bc" is complete now
    m = StopMatcher(["xyz", "yzw"])
    assert m.feed("xyzw") == StopMatch(0, "xyz")  # both completed by one chunk: the earliest start
    m = StopMatcher(["hello world"])
    assert m.feed("say hello wor") is None and m.pending == len("hello wor")
    assert m.feed("k") is None and m.pending == 0


# ---------------------------------------------------------------------- limits


def test_stop_limits_are_enforced():
    SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)])
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS])
    SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    with pytest.raises(ValueError, match=r"^stop must .*at most 32"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ValueError, match=r"^stop must .*1 to 256"):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])
    with pytest.raises(ValueError, match=r"^stop must "):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match=r"^stop_token_ids must .*at most 64"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    assert (MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS) == (32, 256, 64)


# ---------------------------------------------------------------------- end to end (greedy)


def stream(llm, params: SamplingParams) -> tuple[list[str], "object"]:
    """Run one request alone on the engine; the delta text of each step, and the last output."""
    engine = llm.engine
    rid = engine.add_request(PROMPT, params)
    deltas: list[str] = []
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            deltas.append(out.delta_text)
            last = out
    return deltas, last


@pytest.fixture(scope="module")
def baseline(llm):
    """Greedy output with no stop strings: per step, the text decoded so far."""
    deltas, last = stream(llm, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert last.finish_reason == "length"
    texts, acc = [], ""
    for d in deltas:
        acc += d
        texts.append(acc)
    assert len(texts[-1]) > 40, texts[-1]
    return texts


@pytest.mark.slow
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_output_as_before(llm, baseline, include):
    full = baseline[-1]
    words = full.split()
    late, early = words[6], words[3]
    stops = ["never seen \x00", late, early]  # the earliest occurrence wins, whatever the order
    out = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=stops,
                                              include_stop_str_in_output=include))[0]
    i, stop = naive_match(full, stops)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == (full[: i + len(stop)] if include else full[:i])


@pytest.mark.slow
def test_streaming_holds_back_exactly_a_possible_stop_string(llm, baseline):
    """Each step shows all text except the tail that could still become a stop string.

    The stop strings never match: one starts with a word the output contains, one is long
    (the former rule held back len(longest stop) - 1 characters at every step)."""
    word = baseline[-1].split()[4]
    stops = [word + " \x00never", "\x01" * MAX_STOP_STRING_CHARS]
    deltas, last = stream(llm, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=stops))
    assert last.finish_reason == "length" and len(deltas) == len(baseline)
    shown = ""
    held_somewhere = False
    for step, (delta, text) in enumerate(zip(deltas, baseline)):
        shown += delta
        if step == len(deltas) - 1:
            assert shown == text  # finished: everything is released
            break
        pending = naive_pending(text, stops)
        held_somewhere |= pending > 0
        assert shown == text[: len(text) - pending], (step, shown, text)
    assert held_somewhere  # the word's prefix was held back at least once


@pytest.mark.slow
def test_many_long_stop_strings_still_match(llm, baseline):
    """At the limits (32 stop strings of 256 characters) the match is the same."""
    full = baseline[-1]
    target = full.split()[5]
    fillers = [chr(0x100 + i) * MAX_STOP_STRING_CHARS for i in range(MAX_STOP_STRINGS - 1)]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                              stop=fillers + [target]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.text == full[: full.find(target)]
