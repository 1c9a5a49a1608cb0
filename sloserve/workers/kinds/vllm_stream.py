"""A vLLM worker's stream as the front's relay reads it, and the same call resumed on another vLLM
worker when the first dies mid-stream.

Reading: the front asks vLLM for `return_token_ids` on a call it may resume; vLLM then puts the
prompt's token ids in the first event and each event's new token ids in its choice. `StreamReader`
takes them out of every event (unless the client asked for them itself) and hands the relay the
same note a sloserve worker's annotation gives: the response's id and creation time, the prompt's
ids, the tokens the client now has.

Resuming: vLLM cannot continue another server's request, but a greedy call continues exactly from
its prompt plus the tokens already sent, recomputed. `resume_call` is that call: a completion
whose prompt is those token ids (a chat call's prompt as vLLM rendered it), for the tokens left;
`ResumedReader` makes its events the original call's: its id, creation time and kind of event
(a chat call's continuation becomes `chat.completion.chunk` deltas), and usage counted from the
original prompt. A call with tools, a response format, logprobs, echo or several choices is not
resumed (its continuation would not be the same call)."""
from __future__ import annotations

import json
from typing import Any, Optional

_DATA = b"data: "
# Body fields a resumed completion takes from the original call as they are
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens",
                   "spaces_between_special_tokens", "user", "priority", "cache_salt")
# Body fields whose call another worker cannot continue from token ids alone
NOT_RESUMABLE = ("tools", "response_format", "logprobs", "top_logprobs", "echo", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar", "structured_outputs", "prompt_logprobs", "suffix")


def resumable(body: dict) -> bool:
    """Whether another vLLM worker can continue this (single-choice, streamed) call."""
    return not any(body.get(k) not in (None, False, 0) for k in NOT_RESUMABLE) and body.get("n") in (None, 1)


class StreamReader:
    """Strips vLLM's token ids from a stream's events and notes them for the relay."""

    def __init__(self, client_asked_ids: bool = False):
        self.keep = client_asked_ids
        self.text = ""  # what the client has been sent of the choice's text

    def event(self, event: bytes) -> tuple[bytes, Optional[dict]]:
        """(the event as the client gets it, the relay's note or None)."""
        obj = _json_event(event)
        if obj is None:
            return event, None
        note: dict[str, Any] = {}
        if isinstance(obj.get("id"), str):
            note.update(id=obj["id"], engine_id=obj["id"])
        if isinstance(obj.get("created"), int):
            note["created"] = obj["created"]
        choices = obj.get("choices") if isinstance(obj.get("choices"), list) else []
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        prompt_ids = obj.get("prompt_token_ids", choice.get("prompt_token_ids"))
        if isinstance(prompt_ids, list):
            note.update(prompt_ids=prompt_ids, prompt_tokens=len(prompt_ids))
        tokens = choice.get("token_ids")
        if isinstance(tokens, list):
            note["t"] = tokens
        piece = choice.get("text", (choice.get("delta") or {}).get("content"))
        if isinstance(piece, str):
            self.text += piece
        if self.keep:
            return event, note
        obj.pop("prompt_token_ids", None)
        choice.pop("prompt_token_ids", None)
        choice.pop("token_ids", None)
        return _data(obj), note


def resume_call(body: dict, chat: bool, head: dict, tokens: list[int]) -> Optional[dict]:
    """The completion that continues the call `body` from `tokens` (the prompt's ids in
    `head["prompt_ids"]`), streamed; None when it cannot be continued."""
    prompt_ids = head.get("prompt_ids")
    if not isinstance(prompt_ids, list) or not resumable(body):
        return None
    out: dict[str, Any] = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    out.update(model=body.get("model"), prompt=[*prompt_ids, *tokens], stream=True, return_token_ids=True,
               stream_options={"include_usage": True})
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(limit, int):
        if limit - len(tokens) < 1:
            return None
        out["max_tokens"] = limit - len(tokens)
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - len(tokens))
    if chat:  # a rendered chat prompt already holds its special tokens
        out["add_special_tokens"] = False
    return out


class ResumedReader(StreamReader):
    """The continuation's events as the original call's (see the module docstring)."""

    def __init__(self, chat: bool, head: dict, sent: int, usage_asked: bool, model: Any,
                 client_asked_ids: bool = False, sent_text: str = ""):
        super().__init__(client_asked_ids)
        self.chat, self.head, self.sent, self.usage_asked, self.model = chat, head, sent, usage_asked, model
        self.sent_text, self.first = sent_text, True
        self.text = sent_text  # a second failover continues from all of it

    def event(self, event: bytes) -> tuple[bytes, Optional[dict]]:
        obj = _json_event(event)
        if obj is None:
            return event, None
        choices = obj.get("choices") if isinstance(obj.get("choices"), list) else []
        choice = choices[0] if choices and isinstance(choices[0], dict) else None
        note = {"t": choice["token_ids"]} if choice and isinstance(choice.get("token_ids"), list) else {}
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            usage["prompt_tokens"] -= self.sent
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.sent
        if choice is None and not self.usage_asked:
            return b"", note  # the continuation's own usage event: the client did not ask for one
        if choice is not None and isinstance(choice.get("text"), str) and choice["text"] and self.first:
            self.first = False
            text = choice["text"]
            # vLLM primes its detokenizer with the prompt's ids; where their text does not decode back
            # as a prefix (a chat prompt's special tokens, skipped), its first piece is the whole text so
            # far: keep what follows the text the client already has
            if self.sent_text and len(text) > len(self.sent_text) and self.sent_text in text:
                choice["text"] = text[text.rindex(self.sent_text) + len(self.sent_text):]
        if choice is not None and isinstance(choice.get("text"), str):
            self.text += choice["text"]
        out: dict[str, Any] = {"id": self.head.get("id", obj.get("id")), "object": "chat.completion.chunk"
                               if self.chat else obj.get("object", "text_completion"),
                               "created": self.head.get("created", obj.get("created")), "model": self.model}
        if choice is not None:
            if self.chat:
                delta = {"content": choice.get("text", "")} if choice.get("text") else {}
                kept = {"token_ids": choice["token_ids"]} if self.keep and "token_ids" in choice else {}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": choice.get("finish_reason"),
                          **kept}
            else:
                choice = {k: v for k, v in choice.items() if self.keep or k not in ("token_ids", "prompt_token_ids")}
            out["choices"] = [choice]
        else:
            out["choices"] = []
        if usage is not None:
            out["usage"] = usage
        return _data(out), note


def _json_event(event: bytes) -> Optional[dict]:
    if not event.startswith(_DATA + b"{"):
        return None
    try:
        obj = json.loads(event[len(_DATA):])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _data(obj: dict) -> bytes:
    return _DATA + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
