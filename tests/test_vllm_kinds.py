"""How the fleet reads a stock vLLM server, with no vLLM running: its /metrics (both generations
of names, and what it refuses), its KV events (re-keyed as sloserve keys blocks; gaps, replays,
restarts, malformed batches), the body a generation call sends it (deadline priority), and the
worker sources a fleet of vLLM workers can and cannot have. tests/test_vllm_workers.py runs the
real thing."""
from __future__ import annotations

import math

import msgspec
import pytest

from sloserve.cluster.spec import FleetSpec
from sloserve.core.config import EngineConfig
from sloserve.core.types import QoSClass, Request, SamplingParams
from sloserve.kv.hashing import hash_full_blocks
from sloserve.workers.kinds.vllm import VllmKind, deadline_priority
from sloserve.workers.kinds.vllm_events import KVEventIndex
from sloserve.workers.kinds.vllm_metrics import MetricsError, parse_metrics
from sloserve.workers.source import WorkerSource

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 400.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7e+09
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 100.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 1.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 57.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="1024"} 1.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters="chat,sql"} 1.0
"""
# An older vLLM: gpu_ names, usage in percent, no cache info
OLD_METRICS = """\
vllm:num_requests_running{model_name="m"} 1.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:gpu_cache_usage_perc{model_name="m"} 50.0
vllm:gpu_prefix_cache_queries_total{model_name="m"} 10.0
vllm:gpu_prefix_cache_hits_total{model_name="m"} 5.0
"""


def test_metrics_become_the_routers_state_and_the_dashboards_counters():
    load = parse_metrics(METRICS)
    state = load.instance_state()
    assert (state.num_running, state.num_waiting, state.block_size, state.kv_blocks_total) == (3, 2, 128, 1024)
    assert (state.kv_blocks_used, state.kv_blocks_free) == (256, 768)
    assert state.prefix_cache_hit_rate == 0.25 and math.isinf(state.min_ttft_slack_s)
    assert state.adapters == frozenset({"sql", "chat"})
    reading = load.reading()
    assert reading["preempted"] == 1.0 and reading["output_tokens"] == 57.0 and reading["prefix_hits"] == 100.0


def test_the_older_metric_names_are_read_too():
    load = parse_metrics(OLD_METRICS)
    assert (load.running, load.kv_usage, load.prefix_hits, load.prefix_queries) == (1, 0.5, 5.0, 10.0)
    assert load.instance_state().block_size == 16  # no cache info: the fleet's default


@pytest.mark.parametrize("text, named", [
    ("vllm:num_requests_running 1\n", "waiting requests, KV cache usage"),
    ("sglang:num_running_reqs 1\n", "running requests"),
    ("<html>not metrics</html>", "unreadable"),
])
def test_metrics_this_sloserve_cannot_read_are_one_line_naming_what_is_missing(text, named):
    with pytest.raises(MetricsError, match=named) as e:
        parse_metrics(text)
    assert "\n" not in str(e.value)


def frames(seq: int, *events: dict) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, list(events)])]


def stored(hashes: list, tokens: list[int], parent=None, size: int = 4) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": size, "lora_id": None, "medium": "GPU", "lora_name": None}


def test_stored_blocks_get_the_keys_a_router_computes_from_the_prompt():
    index = KVEventIndex()
    prompt = list(range(100, 112))  # three blocks of 4
    assert index.receive(frames(0, stored([b"h1", b"h2"], prompt[:8]))) is None
    assert index.receive(frames(1, stored([b"h3"], prompt[8:12], parent=b"h2"))) is None
    assert index.prefix_keys == frozenset(hash_full_blocks(prompt, 4)) and index.block_size == 4
    index.receive(frames(2, {"type": "BlockRemoved", "block_hashes": [b"h3"], "medium": "GPU"}))
    assert index.prefix_keys == frozenset(hash_full_blocks(prompt[:8], 4))
    index.receive(frames(3, {"type": "AllBlocksCleared"}))
    assert index.prefix_keys == frozenset()


def test_a_salted_prefix_is_keyed_with_its_salt_down_the_chain():
    index = KVEventIndex()
    prompt = list(range(8))
    index.receive(frames(0, {**stored([1], prompt[:4]), "extra_keys": [["tenant-a"]]}))
    index.receive(frames(1, stored([2], prompt[4:], parent=1)))
    assert index.prefix_keys == frozenset(hash_full_blocks(prompt, 4, salt="tenant-a"))
    assert not index.prefix_keys & frozenset(hash_full_blocks(prompt, 4))  # another tenant matches nothing


def test_a_gap_waits_for_the_replay_and_a_restart_starts_over():
    index = KVEventIndex()
    index.receive(frames(0, stored([1], [1, 2, 3, 4])))
    gap = frames(3, stored([4], [9, 9, 9, 9]))
    assert index.receive(gap) == 1 and len(index.keys) == 1  # nothing applied past a gap
    index.replayed([frames(1, stored([2], [5, 6, 7, 8], parent=1)), frames(2, {"type": "BlockRemoved",
                                                                              "block_hashes": [2]}), gap])
    assert set(index.keys) == {1, 4} and index.last_seq == 3 and index.counters["gaps"] == 1
    assert index.receive(frames(2, stored([7], [1, 1, 1, 1]))) is None and 7 not in index.keys  # seen: skipped
    index.receive(frames(0, stored([8], [2, 2, 2, 2])))  # back to 0: the worker restarted
    assert set(index.keys) == {8} and index.counters["restarts"] == 1


def test_malformed_messages_and_events_are_counted_and_skipped():
    index = KVEventIndex()
    assert index.receive([b"kv", b"\x00"]) is None  # a short sequence number
    assert index.receive([b"kv", (0).to_bytes(8, "big"), b"\xc1not msgpack"]) is None
    assert index.receive([b"kv", (0).to_bytes(8, "big"), msgspec.msgpack.encode({"x": 1})]) is None
    index.receive(frames(0, stored([1], [1, 2, 3]), stored([2], [5, 6, 7, 8])))  # 3 tokens for a block of 4
    assert index.counters["malformed"] == 4 and set(index.keys) == {2}
    index.receive(frames(1, stored([3], [1, 1, 1, 1], parent=b"never-seen")))
    assert 3 not in index.keys and index.counters["orphans"] == 1


def routed(arrival: float, ttft: float, priority=None) -> Request:
    return Request("r", [1, 2], SamplingParams(max_tokens=4), arrival_time=arrival,
                   qos=QoSClass("c", ttft, 0.1), priority=priority)


def test_a_generation_call_carries_its_deadline_as_vllms_priority():
    import json

    kind = VllmKind()
    body = {"model": "m", "prompt": "hi", "qos_class": "c", "sloserve_prompt_ids": [1, 2], "stream": True}
    sent = json.loads(kind.upstream_body(body, b"", routed(110.0, 0.5), epoch=100.0))
    assert sent == {"model": "m", "prompt": "hi", "stream": True, "priority": 10_500, "return_token_ids": True}
    salted = routed(110.0, 0.5)
    salted.cache_salt = "tenant-a"
    assert json.loads(kind.upstream_body(body, b"", salted, epoch=100.0))["cache_salt"] == "tenant-a"
    early, late = routed(110.0, 0.5), routed(109.0, 5.0)  # arrived later but due sooner: served first
    assert deadline_priority(early, 100.0) < deadline_priority(late, 100.0)
    no_target = deadline_priority(routed(100.0, math.inf), 100.0)
    assert no_target == 3_600_000 > deadline_priority(routed(3000.0, 10.0), 100.0)
    assert json.loads(kind.upstream_body(body, b"", routed(110.0, 0.5, priority=-3), 100.0))["priority"] == -3
    attached = VllmKind(deadline_priority=False)
    assert "priority" not in json.loads(attached.upstream_body({**body, "priority": 2}, b"", routed(1, 1), 0))


def test_tokenize_calls_go_to_vllms_own_route():
    kind = VllmKind()
    assert kind.tokenize_call({"prompt": "hi", "max_tokens": 3, "model": "m"}) == ("/tokenize", {"prompt": "hi",
                                                                                                 "model": "m"})
    path, body = kind.tokenize_call({"messages": [{"role": "user", "content": "x"}], "max_tokens": None})
    assert path == "/tokenize" and body["add_generation_prompt"] is True and "max_tokens" not in body
    assert kind.tokenize_call({"prompt": [1, 2, 3], "max_tokens": None}) is None  # ids are ids


@pytest.mark.parametrize("source, spec, message", [
    (WorkerSource(engine="vllm"), FleetSpec(pd=(1, 1)), "KV connectors"),
    (WorkerSource(engine="vllm"), FleetSpec(instances=2, migration="balance"), "drop --migration"),
    (WorkerSource(engine="vllm", backend="ray"), FleetSpec(), "drop --backend ray"),
    (WorkerSource(engine="vllm"), FleetSpec(), "needs --model DIR"),
    (WorkerSource(engine="vllm", attach=("http://a:1",)), FleetSpec(instances=2), "2 instances"),
    (WorkerSource(attach=("http://a:1",)), FleetSpec(instances=1, min_instances=0, autoscale="reactive"),
     "started elsewhere"),
    (WorkerSource(engine="sglang"), FleetSpec(), "unknown --engine"),
])
def test_a_worker_source_a_fleet_cannot_have_is_one_clear_error(source, spec, message):
    with pytest.raises(ValueError, match=message):
        source.check(spec, EngineConfig(model=None))


def test_vllm_without_its_venv_says_how_to_get_it(tmp_path):
    with pytest.raises(ValueError, match="make vllm"):
        WorkerSource(engine="vllm", vllm_python=str(tmp_path / "none")).check(FleetSpec(), EngineConfig(
            model=str(tmp_path)))
    with pytest.raises(ValueError, match="http"):
        WorkerSource.parse_urls("localhost:8000")


def sse(obj) -> bytes:
    import json

    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_the_stream_reader_takes_vllms_token_ids_out_and_notes_them():
    import json

    from sloserve.workers.kinds.vllm_stream import StreamReader

    reader = StreamReader()
    first = {"id": "cmpl-1", "created": 7, "object": "text_completion", "model": "m",
             "choices": [{"index": 0, "text": " a", "prompt_token_ids": [1, 2, 3], "token_ids": [9]}]}
    out, note = reader.event(sse(first))
    assert note == {"id": "cmpl-1", "engine_id": "cmpl-1", "created": 7, "prompt_ids": [1, 2, 3],
                    "prompt_tokens": 3, "t": [9]}
    assert json.loads(out[6:])["choices"][0] == {"index": 0, "text": " a"}
    chat = {"id": "chat-1", "created": 7, "prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {
        "content": "x"}, "token_ids": [5, 6]}]}
    out, note = reader.event(sse(chat))
    assert note["t"] == [5, 6] and note["prompt_ids"] == [1, 2] and b"token_ids" not in out
    assert reader.event(b"data: [DONE]\n\n") == (b"data: [DONE]\n\n", None)
    kept, _ = StreamReader(client_asked_ids=True).event(sse(first))  # the client asked for them: kept
    assert b"token_ids" in kept


def test_a_call_continues_from_its_prompt_and_the_tokens_sent():
    from sloserve.workers.kinds.vllm_stream import resume_call

    body = {"model": "m", "prompt": "hi", "max_tokens": 10, "temperature": 0, "stream": True, "priority": 5,
            "min_tokens": 4, "ignore_eos": True}
    call = resume_call(body, False, {"prompt_ids": [1, 2]}, [7, 8, 9])
    assert call["prompt"] == [1, 2, 7, 8, 9] and call["max_tokens"] == 7 and call["min_tokens"] == 1
    assert (call["priority"], call["temperature"], call["ignore_eos"], call["return_token_ids"]) == (5, 0, True, True)
    assert resume_call({**body, "max_tokens": 3}, False, {"prompt_ids": [1]}, [7, 8, 9]) is None  # nothing left
    assert resume_call({**body, "logprobs": 2}, False, {"prompt_ids": [1]}, [7]) is None
    assert resume_call({"messages": [], "tools": [{"type": "function"}]}, True, {"prompt_ids": [1]}, [7]) is None
    chat = resume_call({"model": "m", "messages": [], "max_completion_tokens": 5}, True, {"prompt_ids": [1]}, [2])
    assert chat["max_tokens"] == 4 and chat["add_special_tokens"] is False
    assert resume_call(body, False, {}, [7]) is None  # the prompt's ids never arrived


def test_a_chat_calls_continuation_reads_as_the_original_call():
    import json

    from sloserve.workers.kinds.vllm_stream import ResumedReader

    reader = ResumedReader(chat=True, head={"id": "chat-1", "created": 7}, sent=3, usage_asked=True, model="m")
    out, note = reader.event(sse({"id": "cmpl-9", "created": 9, "object": "text_completion", "model": "x",
                                  "choices": [{"index": 0, "text": " more", "token_ids": [4],
                                               "finish_reason": None}]}))
    event = json.loads(out[6:])
    assert note == {"t": [4]} and (event["id"], event["created"], event["object"]) == ("chat-1", 7,
                                                                                     "chat.completion.chunk")
    assert event["choices"] == [{"index": 0, "delta": {"content": " more"}, "logprobs": None, "finish_reason": None}]
    out, _ = reader.event(sse({"id": "cmpl-9", "choices": [], "usage": {"prompt_tokens": 13, "completion_tokens": 4,
                                                                       "total_tokens": 17}}))
    assert json.loads(out[6:])["usage"] == {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}
    silent = ResumedReader(chat=False, head={"id": "c"}, sent=1, usage_asked=False, model="m")
    assert silent.event(sse({"id": "x", "choices": [], "usage": {"prompt_tokens": 2}}))[0] == b""


def test_the_priority_vllm_is_sent_is_the_deadline_unless_asked_otherwise():
    assert WorkerSource(engine="vllm").engine_kind().deadline_priority  # the servers sloserve starts
    assert not WorkerSource(engine="vllm", attach=("http://a:1",)).engine_kind().deadline_priority
    assert not WorkerSource(engine="vllm", vllm_priority="none").engine_kind().deadline_priority
    assert WorkerSource(engine="vllm", attach=("http://a:1",), vllm_priority="deadline").engine_kind().deadline_priority
    with pytest.raises(ValueError, match="--vllm-priority"):
        WorkerSource(engine="vllm", vllm_priority="edf").check(FleetSpec(), EngineConfig(model=None))


def test_a_continuation_whose_first_piece_repeats_the_text_so_far_keeps_only_what_is_new():
    import json

    from sloserve.workers.kinds.vllm_stream import ResumedReader

    reader = ResumedReader(chat=True, head={"id": "c"}, sent=2, usage_asked=False, model="m",
                           sent_text=" once upon")
    whole = {"id": "x", "choices": [{"index": 0, "text": "system\nYou are kind\nuser\nHi\nassistant\n once upon a",
                                     "token_ids": [7]}]}
    out, _ = reader.event(sse(whole))
    assert json.loads(out[6:])["choices"][0]["delta"] == {"content": " a"}
    out, _ = reader.event(sse({"id": "x", "choices": [{"index": 0, "text": " once upon", "token_ids": [8]}]}))
    assert json.loads(out[6:])["choices"][0]["delta"] == {"content": " once upon"}  # only the first is cut
    assert reader.text == " once upon a once upon"
