"""Tokenization, chat templates and streaming detokenization.

`Tokenizer` wraps a `tokenizers.Tokenizer` (Rust, fast) and renders chat templates with a
sandboxed jinja2 environment, so serving needs no `transformers`. It is built either from a
`tokenizer.json` directory or from the vocabulary a GGUF file stores as metadata.
`IncrementalDetokenizer` turns a stream of token ids into text deltas that never split a
UTF-8 character.
"""
from __future__ import annotations

import json
import logging
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

logger = logging.getLogger(__name__)

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})

# llama.cpp token types (tokenizer.ggml.token_type).
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED, _TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_SPM_SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

# How byte-level vocabularies that do not use GPT-2's own regex split text before BPE, keyed by
# GGUF `tokenizer.ggml.pre`. A missing entry means GPT-2's regex (ByteLevel's built-in one).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@lru_cache(maxsize=1)
def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to U+0100 upward, in order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _char_to_byte() -> dict[str, int]:
    return {c: b for b, c in _byte_to_char().items()}


def _content(token: Any) -> Optional[str]:
    """`tokenizer_config.json` writes special tokens as a string or as {"content": ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _tojson(value: Any, indent: Optional[int] = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    # jinja2's built-in tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def validate_messages(messages: Any) -> None:
    """Reject malformed chat requests before they reach the template (templates fail cryptically)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
        for key, value in message.items():
            if isinstance(value, str):
                check_unicode(value, f"messages[{i}].{key}")


def check_unicode(text: str, what: str = "prompt") -> None:
    """Refuse text that has no UTF-8 encoding before it reaches `tokenizers`.

    A JSON string may escape a lone surrogate ("\\ud800"); Python keeps it, and the Rust
    tokenizer then fails with a TypeError that looks like a bug instead of a bad request.
    """
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} contains invalid Unicode (a lone surrogate at character {exc.start})") from None


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: Optional[str] = None,
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
        byte_level: bool = True,
    ) -> None:
        self._backend = backend
        self._chat_template = chat_template
        self._template_variables: Optional[frozenset[str]] = None
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._byte_level = byte_level
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._added_content = {i: tok.content for i, tok in added.items()}
        self._compiled_template: Optional[jinja2.Template] = None
        self._max_token_bytes: Optional[int] = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """A Hugging Face model directory: tokenizer.json plus tokenizer_config.json."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{root}: no tokenizer.json (only fast-tokenizer checkpoints are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust error type is not a Python exception class we can name
            raise ValueError(f"{tokenizer_file}: cannot parse tokenizer ({exc})") from exc

        config: dict[str, Any] = {}
        config_file = root / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))

        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
            chat_template = named.get("default") or next(iter(named.values()), None)
        jinja_file = root / "chat_template.jinja"  # newer transformers save the template beside the config
        if jinja_file.is_file():
            chat_template = jinja_file.read_text(encoding="utf-8")

        def token_id(key: str) -> Optional[int]:
            content = _content(config.get(key))
            return backend.token_to_id(content) if content is not None else None

        return cls(
            backend,
            chat_template=chat_template if isinstance(chat_template, str) else None,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            byte_level=_uses_byte_level(backend),
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes from its `tokenizer.*` metadata (plain values)."""
        kind = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF has no tokenizer.ggml.tokens: no embedded tokenizer")
        token_types = list(metadata.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, metadata.get("tokenizer.ggml.merges") or [], token_types,
                                      metadata.get("tokenizer.ggml.pre"))
            byte_level = True
            add_bos_default = False
        elif kind == "llama":
            backend = _sentencepiece_bpe(tokens, metadata.get("tokenizer.ggml.scores"), token_types,
                                         metadata.get("tokenizer.ggml.merges"),
                                         bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
                                         metadata.get("tokenizer.ggml.unknown_token_id"))
            byte_level = False
            add_bos_default = True  # llama.cpp adds BOS to sentencepiece vocabularies unless told otherwise
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', 'llama')")

        bos = metadata.get("tokenizer.ggml.bos_token_id")
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        if bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None:
            bos_token = tokens[bos]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_token}:0 $A:0", pair=f"{bos_token}:0 $A:0 $B:1", special_tokens=[(bos_token, bos)]
            )
        return cls(
            backend,
            chat_template=metadata.get("tokenizer.chat_template"),
            bos_token_id=bos,
            eos_token_id=eos,
            byte_level=byte_level,
        )

    # ------------------------------------------------------------------ properties

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> Optional[int]:
        return self._eos_token_id

    @property
    def special_token_ids(self) -> set[int]:
        return set(self._special_ids)

    @property
    def chat_template(self) -> Optional[str]:
        return self._chat_template

    def token_to_id(self, token: str) -> Optional[int]:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._backend.id_to_token(token_id)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (`<|im_start|>`) become their ids.

        Raises ValueError for text that is not valid Unicode (a lone surrogate)."""
        check_unicode(text)
        # encode_batch releases the GIL while the Rust side works (encode holds it for the whole
        # call: seconds for a multi-MB prompt), so a server can tokenize off its event loop.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to, known without encoding it: no token
        stands for more bytes of text than the vocabulary's longest, and a character is at least
        one byte. 0 (no bound claimed) when a normalizer rewrites the text first, since it may
        shorten it. What lets a server refuse a prompt far past its context window without
        spending seconds of CPU tokenizing it."""
        if self._backend.normalizer is not None:
            return 0
        if self._max_token_bytes is None:
            self._max_token_bytes = max(len(self.token_bytes(i)) for i in range(self.vocab_size)
                                        if self._backend.id_to_token(i) is not None)
        return len(text) // max(1, self._max_token_bytes)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (useful for grammar-constrained decoding)."""
        if token_id in self._added_content:
            return self._added_content[token_id].encode("utf-8")
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise KeyError(f"token id {token_id} is outside the vocabulary")
        if self._byte_level:
            table = _char_to_byte()
            return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in token)
        match = _BYTE_TOKEN.match(token)
        if match:
            return bytes([int(match.group(1), 16)])
        return token.replace(_SPM_SPACE, " ").encode("utf-8")

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render a conversation to the prompt text the model was trained on."""
        validate_messages(messages)
        template = self._template()
        token = lambda i: self._backend.id_to_token(i) if i is not None else ""  # noqa: E731
        variables = {
            "bos_token": token(self._bos_token_id),
            "eos_token": token(self._eos_token_id),
            **template_kwargs,
        }
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: Optional[list[dict]] = None) -> list[int]:
        """Token ids of a rendered conversation. The template writes BOS itself, so none is added."""
        extra = {} if tools is None else {"tools": tools}
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra), add_special_tokens=False)

    def template_reads(self, variable: str) -> bool:
        """Whether the chat template reads `variable` (e.g. `tools`: it renders a tool list itself)."""
        if not self._chat_template:
            return False
        if self._template_variables is None:
            try:
                parsed = self._environment().parse(self._chat_template)
            except jinja2.exceptions.TemplateSyntaxError:
                return False
            self._template_variables = frozenset(jinja2.meta.find_undeclared_variables(parsed))
        return variable in self._template_variables

    def _environment(self) -> jinja2.sandbox.ImmutableSandboxedEnvironment:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            if not self._chat_template:
                raise ValueError("this model has no chat template; send a plain completion prompt instead")
            try:
                self._compiled_template = self._environment().from_string(self._chat_template)
            except jinja2.exceptions.TemplateSyntaxError as exc:
                raise ValueError(f"the model's chat template does not parse: {exc}") from exc
        return self._compiled_template


# ---------------------------------------------------------------------- GGUF vocabularies


def _uses_byte_level(backend: tokenizers.Tokenizer) -> bool:
    decoder = backend.decoder
    if decoder is None:
        return False
    return '"ByteLevel"' in json.dumps(json.loads(decoder.__getstate__()))


def _added_tokens(tokens: Sequence[str], token_types: Sequence[int]) -> list[AddedToken]:
    """Control tokens become special tokens; user-defined ones plain added tokens. Both match whole."""
    added = []
    for token, kind in zip(tokens, token_types):
        if kind == _TOKEN_CONTROL:
            added.append(AddedToken(token, special=True, normalized=False))
        elif kind == _TOKEN_USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    return added


def _byte_level_bpe(
    tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int], pre: Optional[str]
) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE (`tokenizer.ggml.model == "gpt2"`)."""
    alphabet = set(_byte_to_char().values())
    spell = _byte_to_char()
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, token_types)):
        if kind not in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and not set(token) <= alphabet:
            # A few converters store raw text for normal tokens; BPE needs the byte alphabet spelling.
            token = "".join(spell[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    # Llama 3 looks a whole pre-token up in the vocabulary before merging (llama.cpp does the same).
    ignore_merges = _PRE_SPLITS.get(pre or "") == _LLAMA3_SPLIT
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs, ignore_merges=ignore_merges))

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM splits every digit on its own before GPT-2's regex.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level]
        )
    elif pre in _PRE_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        if pre not in (None, "default", "gpt-2", "gpt2"):
            logger.warning("GGUF pre-tokenizer %r is not known; using GPT-2's split", pre)
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    added = _added_tokens(tokens, token_types)
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return backend


def _sentencepiece_bpe(
    tokens: Sequence[str],
    scores: Optional[Sequence[float]],
    token_types: Sequence[int],
    merges: Optional[Sequence[str]],
    add_space_prefix: bool,
    unk_id: Optional[int],
) -> tokenizers.Tokenizer:
    """Llama/Mistral SentencePiece BPE (`tokenizer.ggml.model == "llama"`) with byte fallback.

    SentencePiece merges by the score of the merged piece; a BPE model whose merges are every
    split of every token, ordered by that token's score, encodes the same.
    """
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    if merges:
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        if scores is None:
            raise ValueError("sentencepiece GGUF vocabulary has neither merges nor scores")
        merge_pairs = _merges_from_scores(tokens, scores, token_types)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merge_pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPM_SPACE, prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    added = _added_tokens(tokens, token_types)
    if unk is not None:
        added.append(AddedToken(unk, special=True, normalized=False))
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return backend


def _merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int]
) -> list[tuple[str, str]]:
    ids = {}
    for i, token in enumerate(tokens):
        ids.setdefault(token, i)
    candidates: list[tuple[float, int, int, int, int, str, str]] = []
    for token, score, kind in zip(tokens, scores, token_types):
        if kind != _TOKEN_NORMAL and kind != _TOKEN_USER_DEFINED:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                # Best score first; ties as transformers orders them (shorter left piece first).
                candidates.append((-score, len(left), len(right), ids[left], ids[right], left, right))
    candidates.sort()
    return [(left, right) for *_, left, right in candidates]


# ---------------------------------------------------------------------- streaming


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas as they arrive.

    Decodes only a short window of recent tokens (vLLM's prefix/read offsets): the text of
    `window[prefix:read]` was already emitted, so the delta is what decoding `window[prefix:]`
    adds beyond it. A delta ending in U+FFFD is an incomplete UTF-8 character and is held back
    until a later token completes it; `flush()` releases whatever is still held at the end.
    """

    PROMPT_CONTEXT = 5  # prompt tokens kept as left context (SentencePiece spacing depends on it)

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._window: list[int] = list(prompt_token_ids[-self.PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._window)
        self._prefix_text: Optional[str] = None
        self._pieces: list[str] = []
        self._num_output_tokens = 0

    @property
    def text(self) -> str:
        """All text emitted so far (held-back bytes excluded).

        Append-only: a later value always starts with an earlier one, since deltas are only
        ever appended. Stop-string matching relies on it to feed just the new characters."""
        return "".join(self._pieces)

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; returns the newly complete text (possibly empty)."""
        self._window.extend(new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of generation: emit any held-back tail, even if it is not valid UTF-8."""
        return self._advance(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._window):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[self._prefix : self._read])
        full = self._decode(self._window[self._prefix :])
        if len(full) <= len(self._prefix_text) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(self._prefix_text) :]
        # The just-emitted tokens become the left context of the next decode.
        self._window = self._window[self._read :]
        self._prefix, self._read = 0, len(self._window)
        self._prefix_text = None
        self._pieces.append(delta)
        return delta
