"""The `TokenSpeedScheduler` gRPC service, driven by a client generated from smg-grpc-proto.

One headless replica (`tokenspeed serve --grpc-port P`, embedded model) for
the module. Covers: health, model/server info, loads, Generate streamed and
not (same tokens; text in == ids in; n = 2; stop-token trimming), Abort
mid-stream, a cancelled call freeing its request, malformed requests as
clean statuses, the tokenizer bundle, and the KV-event stream (snapshot of
the pages a prompt filled, then live events). Each test ends with no
request running and no KV page referenced (the replica's own accounting).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as pb_grpc

from tokenspeed.grpc.tokenizer_bundle import tokenizer_files

PAGE_SIZE = 16
PROMPT = list(range(100, 140))  # 2 full pages and a partial one


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_replica(log: Path, *extra: str) -> SimpleNamespace:
    port = _free_port()
    command = [sys.executable, "-m", "tokenspeed.cli", "serve", "--grpc-port", str(port),
               "--max-model-len", "512", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.TokenSpeedSchedulerStub(channel)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"replica exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if stub.HealthCheck(pb.HealthCheckRequest(), timeout=1).healthy:
                return SimpleNamespace(proc=proc, stub=stub, channel=channel, port=port, log=log)
        except grpc.RpcError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"replica did not become healthy:\n{log.read_text()}")


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    running = start_replica(tmp_path_factory.mktemp("grpc") / "replica.log")
    yield running
    running.channel.close()
    if running.proc.poll() is None:
        running.proc.send_signal(signal.SIGTERM)
        assert running.proc.wait(30) == 0


@pytest.fixture(scope="module")
def stub(replica):
    return replica.stub


def _idle_load(stub) -> pb.SchedulerLoad:
    """The replica's load once nothing runs (the stats arrive one engine step late)."""
    deadline = time.monotonic() + 10
    while True:
        load = stub.GetLoads(pb.GetLoadsRequest()).loads[0]
        if (load.num_running_reqs == 0 and load.num_waiting_reqs == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def nothing_left_running(stub):
    yield
    load = _idle_load(stub)
    assert load.num_running_reqs == 0 and load.num_waiting_reqs == 0
    assert load.active_token_usage == 0, "an idle replica still references KV pages"


def _request(request_id: str, prompt=PROMPT, *, stream=False, **sampling) -> pb.GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_new_tokens", 6)
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(**sampling),
        stream=stream,
    )


def _completes(responses) -> dict[int, pb.GenerateComplete]:
    return {r.complete.index: r.complete for r in responses if r.WhichOneof("response") == "complete"}


def test_health_model_and_server_info(stub):
    assert stub.HealthCheck(pb.HealthCheckRequest()).healthy
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.served_model_name == "embedded"
    assert info.max_context_length == 512 and info.vocab_size > 0 and list(info.eos_token_ids)
    assert info.architectures == ["Qwen3ForCausalLM"]
    server = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert server.max_total_num_tokens % PAGE_SIZE == 0 and server.max_total_num_tokens > 0
    assert server.scheduler_info["page_size"] == PAGE_SIZE
    loads = stub.GetLoads(pb.GetLoadsRequest(include=["all"]))
    assert loads.dp_rank_count == 1 and loads.loads[0].max_running_requests == 256
    assert stub.GetLoads(pb.GetLoadsRequest(dp_rank=1)).loads == []


def test_generate_streamed_equals_complete_and_text_in(stub):
    whole = list(stub.Generate(_request("whole")))
    assert [r.WhichOneof("response") for r in whole] == ["complete"]
    complete = whole[0].complete
    assert complete.finish_reason == "length" and len(complete.output_ids) == 6
    assert complete.prompt_tokens == len(PROMPT) and complete.completion_tokens == 6

    streamed = list(stub.Generate(_request("streamed", stream=True)))
    kinds = [r.WhichOneof("response") for r in streamed]
    assert kinds[-1] == "complete" and set(kinds[:-1]) == {"chunk"}
    ids = [t for r in streamed if r.WhichOneof("response") == "chunk" for t in r.chunk.token_ids]
    assert ids == list(complete.output_ids)
    assert streamed[-2].chunk.completion_tokens == 6
    # The repeated prompt's full pages came from the prefix cache.
    assert streamed[-1].complete.cached_tokens == 2 * PAGE_SIZE

    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(info.tokenizer_path)
    text = "def fibonacci(n):\n    return"
    by_text = pb.GenerateRequest(request_id="text", tokenized=pb.TokenizedInput(original_text=text),
                                 sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=4))
    by_ids = _request("ids", tokenizer.encode(text), max_new_tokens=4)
    assert list(stub.Generate(by_text))[0].complete.output_ids == list(stub.Generate(by_ids))[0].complete.output_ids


def test_n_samples_and_logprobs(stub):
    request = _request("n2", n=2, temperature=1.0, sampling_seed=7, max_new_tokens=5)
    request.return_logprob, request.top_logprobs_num = True, 3
    completes = _completes(stub.Generate(request))
    assert sorted(completes) == [0, 1]
    for complete in completes.values():
        logprobs = complete.output_logprobs
        assert list(logprobs.token_ids) == list(complete.output_ids)
        assert len(logprobs.token_logprobs) == 5 and all(len(t.values) == 3 for t in logprobs.top_logprobs)
    again = _completes(stub.Generate(_request("n2-again", n=2, temperature=1.0, sampling_seed=7, max_new_tokens=5)))
    assert [again[i].output_ids for i in (0, 1)] == [completes[i].output_ids for i in (0, 1)]


def test_stop_token_is_trimmed_unless_asked(stub):
    first = list(stub.Generate(_request("probe", max_new_tokens=3)))[0].complete.output_ids[0]
    trimmed = list(stub.Generate(_request("trim", stop_token_ids=[first], max_new_tokens=3)))[0].complete
    assert trimmed.finish_reason == "stop" and trimmed.matched_token_id == first
    assert list(trimmed.output_ids) == [] and trimmed.completion_tokens == 1
    kept = list(stub.Generate(_request("keep", stop_token_ids=[first], max_new_tokens=3, no_stop_trim=True)))
    assert list(kept[0].complete.output_ids) == [first]


def test_abort_mid_stream_completes_with_abort(stub):
    request = _request("long", stream=True, max_new_tokens=400, ignore_eos=True)
    responses = stub.Generate(request)
    first = next(responses)
    assert first.WhichOneof("response") == "chunk"
    reply = stub.Abort(pb.AbortRequest(request_id="long"))
    assert reply.success
    rest = list(responses)
    assert rest[-1].WhichOneof("response") == "complete"
    assert rest[-1].complete.finish_reason == "abort" and rest[-1].complete.completion_tokens < 400
    assert not stub.Abort(pb.AbortRequest(request_id="long")).success  # gone now


def test_cancelled_call_frees_its_request(stub):
    responses = stub.Generate(_request("cancelled", stream=True, max_new_tokens=400, ignore_eos=True))
    next(responses)
    responses.cancel()
    # The autouse check proves the request left the engine and released its pages.


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (_request("bad-token", [10**6]), grpc.StatusCode.INVALID_ARGUMENT),
        (_request("too-long", list(range(600))), grpc.StatusCode.OUT_OF_RANGE),
        (_request("empty", []), grpc.StatusCode.INVALID_ARGUMENT),
        (_request("", PROMPT), grpc.StatusCode.INVALID_ARGUMENT),
        (_request("hot", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT),
        (_request("schema", json_schema='{"type": "object", "properties": 3}'), grpc.StatusCode.INVALID_ARGUMENT),
        (_request("bias", logit_bias={"1000000": 1.0}), grpc.StatusCode.INVALID_ARGUMENT),
    ],
    ids=["token-out-of-vocab", "context-too-long", "no-prompt", "no-request-id", "negative-temperature",
         "json-schema", "logit-bias"],
)
def test_malformed_requests_get_a_clean_status(stub, request_, code):
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request_))
    assert caught.value.code() == code and caught.value.details()
    assert stub.HealthCheck(pb.HealthCheckRequest()).healthy


def test_grammar_constraints_and_logit_bias(stub):
    """What smg sends for response_format / forced tools: the constraint holds, the bias applies."""
    from tokenspeed.engine.llm import load_tokenizer
    from tokenspeed.models.embedded.materialize import package_dir

    tokenizer = load_tokenizer(package_dir())
    eos = list(stub.GetModelInfo(pb.GetModelInfoRequest()).eos_token_ids)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2]}},
              "required": ["ok", "n"]}
    (done,) = _completes(stub.Generate(_request("json", max_new_tokens=40, json_schema=json.dumps(schema),
                                               stop_token_ids=eos))).values()
    value = json.loads(tokenizer.decode(list(done.output_ids)))
    assert set(value) == {"ok", "n"} and value["n"] in (1, 2)
    (done,) = _completes(stub.Generate(_request("regex", max_new_tokens=10, regex="[0-9]{3}"))).values()
    assert tokenizer.decode(list(done.output_ids)).isdigit()
    (done,) = _completes(stub.Generate(_request("bias", max_new_tokens=4, logit_bias={"77": 100.0},
                                               ignore_eos=True))).values()
    assert list(done.output_ids) == [77] * 4


def test_tokenizer_bundle(stub):
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and "config.json" in names


def _stored_blocks(batch: common_pb2.KvEventBatch) -> list[common_pb2.KvBlock]:
    return [b for e in batch.events if e.WhichOneof("data") == "stored" for b in e.stored.blocks]


def test_tokenizer_files_carry_tiktoken_ranks_but_no_code(tmp_path):
    """Kimi-K2's folder: `tiktoken.model` (its ranks) is bundled, its remote tokenizer code is not."""
    for name in ("tokenizer_config.json", "tiktoken.model", "tokenization_kimi.py", "model.safetensors"):
        (tmp_path / name).write_text("x")
    assert [p.name for p in tokenizer_files(tmp_path)] == ["tokenizer_config.json", "tiktoken.model"]


def test_kv_events_snapshot_then_live(stub):
    prompt = list(range(200, 240))
    list(stub.Generate(_request("kv-a", prompt, max_new_tokens=2)))
    stream = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True))
    received: list[common_pb2.KvEventBatch] = []
    done = threading.Event()

    def read() -> None:
        try:
            for batch in stream:
                received.append(batch)
        except grpc.RpcError as exc:  # the test cancels the stream when done
            assert exc.code() == grpc.StatusCode.CANCELLED and done.is_set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 10
    while len(received) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    heartbeat, snapshot = received[0], received[1]
    assert heartbeat.sequence_number == 0 and heartbeat.load.load_only
    assert snapshot.HasField("snapshot") and snapshot.events[0].WhichOneof("data") == "cleared"
    tokens = {tuple(b.token_ids) for b in _stored_blocks(snapshot)}
    assert tuple(prompt[:16]) in tokens and tuple(prompt[16:32]) in tokens

    fresh = list(range(300, 340))
    list(stub.Generate(_request("kv-b", fresh, max_new_tokens=2)))
    while time.monotonic() < deadline:
        live = [b for b in received[2:] if b.events]
        if any(tuple(fresh[:16]) == tuple(k.token_ids) for b in live for k in _stored_blocks(b)):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"no live Stored event for the new prompt in {received[2:]}")
    first_page = next(k for b in live for k in _stored_blocks(b) if tuple(k.token_ids) == tuple(fresh[:16]))
    assert first_page.block_size == PAGE_SIZE
    assert all(b.sequence_number > snapshot.sequence_number for b in live)
    assert all(b.HasField("load") for b in received)
    done.set()
    stream.cancel()
    reader.join(5)
