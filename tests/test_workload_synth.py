"""Prompt synthesis: exact token lengths, real shared prefixes for shared hash ids, none otherwise."""
from __future__ import annotations

import pytest

from sloserve.workload import traces
from sloserve.workload.synth import PromptSynthesizer
from sloserve.workload.types import WorkloadRequest

CORPUS = [f"Sentence number {i} talks about topic {i % 7} with some words. " * 5 for i in range(400)]


class CharTokenizer:
    """One token per character: lengths are trivially checkable and decoding is exact."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(map(chr, ids))


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def synth():
    return PromptSynthesizer(CharTokenizer(), CORPUS, seed=5, pool_tokens=50_000)


def test_exact_lengths_and_determinism(synth):
    for n in (0, 1, 3, 17, 64, 65, 1000, 4097):
        r = WorkloadRequest(0, n, 1, request_id=f"q{n}")
        ids = synth.token_ids(r)
        assert len(ids) == n and synth.token_ids(r) == ids
        assert len(synth.text(r)) == n
    other = PromptSynthesizer(CharTokenizer(), CORPUS, seed=6, pool_tokens=50_000)
    r = WorkloadRequest(0, 500, 1, request_id="q")
    assert other.token_ids(r) != synth.token_ids(r)


def test_shared_hash_ids_share_blocks_token_for_token(synth):
    a = WorkloadRequest(0, 1000, 1, hash_ids=(1, 2, 3), hash_block_size=400, request_id="a")
    b = WorkloadRequest(0, 900, 1, hash_ids=(1, 2, 9), hash_block_size=400, request_id="b")
    c = WorkloadRequest(0, 1000, 1, hash_ids=(4, 2, 3), hash_block_size=400, request_id="c")
    ta, tb, tc = synth.token_ids(a), synth.token_ids(b), synth.token_ids(c)
    assert (len(ta), len(tb), len(tc)) == (1000, 900, 1000)
    assert ta[:800] == tb[:800] and _common_prefix(ta[800:], tb[800:]) < 10  # blocks 1, 2 shared; 3 not
    assert _common_prefix(ta, tc) < 10  # a different first block shares (almost) nothing
    assert ta[400:800] == tc[400:800]  # same id, same tokens (the chain decides what a cache can reuse)
    # a prompt longer than its blocks gets a private tail
    d = WorkloadRequest(0, 1000, 1, hash_ids=(1,), hash_block_size=400, request_id="d")
    assert synth.token_ids(d)[:400] == ta[:400] and len(synth.token_ids(d)) == 1000


def test_unrelated_requests_share_no_prefix(synth):
    ids = [synth.token_ids(WorkloadRequest(0, 300, 1, request_id=f"azure-{i}")) for i in range(300)]
    worst = max(_common_prefix(ids[i], ids[j]) for i in range(len(ids)) for j in range(i + 1, len(ids)))
    assert worst < 16  # not even one 16-token KV block in common


def test_synthesize_formats(synth):
    reqs = [WorkloadRequest(0, 50, 2, request_id="s1"), WorkloadRequest(0, 999, 2, prompt_text="hello world",
                                                                          request_id="s2")]
    toks = synth.synthesize(reqs, "tokens")
    assert len(toks[0].prompt_token_ids) == 50 and toks[0].prompt_text is None
    assert toks[1].prompt_token_ids == CharTokenizer().encode("hello world") and toks[1].prompt_len == 11
    texts = synth.synthesize(reqs, "text")
    assert len(texts[0].prompt_text) == 50 and texts[1].prompt_text == "hello world" and texts[1].prompt_len == 11
    clipped = synth.synthesize(reqs, "text", max_prompt_len=5)
    assert clipped[1].prompt_text == "hello" and clipped[1].prompt_len == 5


@pytest.mark.skipif(not (traces.data_dir() / traces.SHARED_FILES["sharegpt"]).is_file(), reason="no ShareGPT file")
def test_with_the_served_models_tokenizer():
    """The embedded SmolLM2 tokenizer (no weights loaded): token ids exact, text re-encodes to the length."""
    from sloserve.engine.weights import load_tokenizer

    tok = load_tokenizer(None)
    synth = PromptSynthesizer(tok, traces.sharegpt_texts(traces.shared_path("sharegpt")), seed=0,
                              pool_tokens=30_000)
    exact = 0
    for i, n in enumerate((5, 16, 100, 512, 1500)):
        r = WorkloadRequest(0, n, 1, hash_ids=(i, 99), hash_block_size=1024, request_id=f"r{i}")
        assert len(synth.token_ids(r)) == n
        exact += len(tok.encode(synth.text(r))) == n
        assert abs(len(tok.encode(synth.text(r))) - n) <= 2
    assert exact >= 4
