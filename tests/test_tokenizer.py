"""The tokenizer against transformers' on the embedded model, chat templates, message validation,
a SentencePiece GGUF vocabulary, and streaming detokenization."""
from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sloserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from sloserve.engine.weights import embedded_model_path, load_tokenizer

TEXTS = [
    "Hello, world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧",
    "中文测试，日本語のテキスト、한국어",
    "Prices: 1234567 + 89.50 = 1234656.50; 2024-01-31",
    "  leading spaces\t\ttabs\n\n\nnewlines  ",
    "Ünïcödé àccénts — “quotes” and ‘apostrophes’ naïve café",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],  # the template adds SmolLM's default system prompt
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke"},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why? 🐔"},
    ],
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def hf_tok():
    import transformers

    path = embedded_model_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


# ---------------------------------------------------------------------- the embedded vocabulary


def test_properties(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.special_token_ids == set(range(17))
    assert "<|im_start|>" in tok.chat_template


def test_special_tokens_in_text_are_single_ids(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>")
    assert ids[0] == 1 and ids[-2:] == [2, 0]
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # no BOS for SmolLM2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|><|endoftext|>"


def test_digits_are_split(tok: Tokenizer) -> None:
    assert len(tok.encode("12345")) == 5
    assert len(tok.encode("٣٤٥")) == 3 * len(tok.encode("٣"))  # non-ASCII numerals too


def test_round_trip_and_token_bytes(tok: Tokenizer) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    ids = tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok, messages, add_generation_prompt) -> None:
    want = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want
    assert tok.encode_chat(messages, add_generation_prompt) == tok.encode(want)


def test_default_system_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        None,
        ["hello"],
        [{"role": "user"}],
        [{"role": "wizard", "content": "hi"}],
        [{"content": "hi"}],
        [{"role": "user", "content": 42}],
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        [{"role": "user", "content": "ok"}, "not a dict"],
    ],
)
def test_invalid_messages(tok: Tokenizer, messages) -> None:
    with pytest.raises(ValueError):
        tok.apply_chat_template(messages)


def test_no_chat_template_is_a_clear_error(tok: Tokenizer) -> None:
    bare = Tokenizer(tok.backend, chat_template=None, bos_token_id=1, eos_token_id=2)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception_becomes_value_error(tok: Tokenizer) -> None:
    strict = Tokenizer(tok.backend, chat_template="{{ raise_exception('only one message') }}")
    with pytest.raises(ValueError, match="only one message"):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])


def test_from_dir_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}}'
    )
    (tmp_path / "chat_template.jinja").write_text(tok.chat_template)
    again = Tokenizer.from_dir(tmp_path)
    assert (again.bos_token_id, again.eos_token_id, again.chat_template) == (1, 2, tok.chat_template)
    assert again.special_token_ids == tok.special_token_ids
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    assert again.token_bytes(tok.encode(" café")[-1]) == tok.token_bytes(tok.encode(" café")[-1])


def test_unknown_gguf_tokenizer_model() -> None:
    with pytest.raises(ValueError, match="'bert'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


# ---------------------------------------------------------------------- a SentencePiece GGUF


SPM_PIECES = {
    "▁": -1.0, "▁t": -2.0, "he": -3.0, "▁the": -1.5, "▁a": -2.5, "ll": -4.0, "▁he": -3.5, "llo": -4.5,
    "▁hello": -5.0, "o": -6.0, "w": -6.1, "r": -6.2, "d": -6.3, "l": -6.4, "h": -6.5, "e": -6.6, "t": -6.7,
    "a": -6.8, "▁w": -7.0, "or": -7.1, "▁wor": -7.2, "ld": -7.3, "▁world": -7.4,
}


def write_spm_gguf(path: Path) -> None:
    """A Llama-2-style vocabulary: <unk> <s> </s>, 256 byte tokens, scored pieces, no merges."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(SPM_PIECES)
    writer = gguf.GGUFWriter(str(path), "llama")
    for add in ("add_block_count", "add_head_count", "add_head_count_kv"):
        getattr(writer, add)(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + list(SPM_PIECES.values()))
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
def test_sentencepiece_gguf_matches_transformers(tmp_path: Path) -> None:
    import transformers

    write_spm_gguf(tmp_path / "spm.gguf")
    ours = load_tokenizer(str(tmp_path / "spm.gguf"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["hello world", "the world", " the  world", "héllo wörld 😀", "a\nb", "hello</s>world", ""]:
        ids = ours.encode(text, add_special_tokens=True)
        assert ids == theirs.encode(text), text
        assert ids[0] == 1  # llama.cpp adds BOS to sentencepiece vocabularies by default
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    ids = ours.encode("héllo 😀")
    assert ours.decode(ids) == "héllo 😀"
    assert b"".join(ours.token_bytes(i) for i in ids) == " héllo 😀".encode()  # with SentencePiece's prefix space


# ---------------------------------------------------------------------- streaming detokenization


class CountingTokenizer:
    """Records how many ids each decode call sees, to prove the detokenizer decodes a window only."""

    def __init__(self, inner: Tokenizer):
        self.inner = inner
        self.longest = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


STREAM_TEXT = "Héllo wörld! 😀🎉 中文测试 日本語 — naïve café 👨‍👩‍👧 ok. " * 8


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("chunk", [1, 3])
def test_detokenizer_deltas(tok: Tokenizer, chunk: int) -> None:
    prompt = tok.encode_chat([{"role": "user", "content": "Say something"}])
    ids = tok.encode(STREAM_TEXT) + [2]
    counter = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counter, prompt)
    deltas = stream(detok, ids, chunk)
    assert "".join(deltas) == tok.decode(ids) == STREAM_TEXT
    assert detok.text == STREAM_TEXT and detok.num_output_tokens == len(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # nothing was held back at the end
    assert sum(1 for d in deltas if d == "") > 1  # multi-token characters were held back
    assert counter.longest <= 16  # a window, not the whole output


def test_detokenizer_holds_partial_character(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji is split across byte tokens
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "😀"
    # A generation that stops mid-character releases the replacement character on flush.
    cut = IncrementalDetokenizer(tok, [])
    assert cut.add(ids[:1]) == "" and cut.flush() == "\ufffd" == tok.decode(ids[:1])


def test_detokenizer_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hi!<|im_end|>")
    shown = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(stream(shown, ids)) == "Hi!<|im_end|>"
    hidden = IncrementalDetokenizer(tok, [])
    assert "".join(stream(hidden, ids)) == "Hi!"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), max_size=40), chunk=st.integers(1, 4))
def test_detokenizer_random_ids(tok: Tokenizer, ids: list[int], chunk: int) -> None:
    prompt = [1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198]  # "<|im_start|>user\nHello<|im_end|>\n..."
    full = tok.decode(ids)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    if "\ufffd" not in full:
        assert "".join(deltas) == full
        assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + detok.flush() == full


# ---------------------------------------------------------------------- a bound without encoding


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(max_size=300), st.sampled_from([
    " " * 257, "\n" * 300, "-" * 400, "<|im_start|>" * 40, "<|endoftext|>" * 30, "😀" * 90, "ab" * 200,
    "                                                                " * 5])))
def test_min_tokens_never_exceeds_the_real_count(tok: Tokenizer, text: str) -> None:
    """The bound a server refuses over-long prompts on is a true lower bound, also for the texts
    that pack the most characters into one token (whitespace runs, special tokens)."""
    assert tok.min_tokens(text) <= len(tok.encode(text))


def test_min_tokens_claims_nothing_behind_a_normalizer(tmp_path: Path) -> None:
    write_spm_gguf(tmp_path / "spm.gguf")
    spm = load_tokenizer(str(tmp_path / "spm.gguf"))
    if spm.backend.normalizer is not None:
        assert spm.min_tokens("x" * 100_000) == 0
    else:
        assert 0 < spm.min_tokens("x" * 100_000) <= len(spm.encode("x" * 100_000))


@pytest.mark.slow
def test_a_prompt_far_past_the_window_is_refused_before_it_is_tokenized(llm, monkeypatch) -> None:
    from sloserve.engine.llm_engine import ContextLengthError

    huge = "lorem ipsum dolor sit amet " * 150_000  # 4 MB: ~1.5M tokens, seconds of CPU to tokenize
    near = "hello " * 9000  # past the window too, but not provably so without encoding it
    with pytest.raises(ContextLengthError, match=r"^prompt has \d+ tokens; the context window is 8192"):
        llm.engine.check_context(llm.engine.tokenize_prompt(near))

    def encoded(*args, **kwargs):
        raise AssertionError("the tokenizer ran on a prompt the bound refuses")

    monkeypatch.setattr(llm.engine.tokenizer, "encode", encoded)
    with pytest.raises(ContextLengthError, match=r"^prompt has at least \d+ tokens .*context window is 8192"):
        llm.engine.tokenize_prompt(huge)
    with pytest.raises(ContextLengthError, match=r"^conversation has at least"):
        llm.engine.tokenize_chat([{"role": "user", "content": huge}])
