"""The engine-core wire format: every message survives msgpack unchanged, and nothing else gets in."""

from __future__ import annotations

import typing

import msgpack
import pytest

from tokenspeed.config import EngineConfig
from tokenspeed.engine import ipc
from tokenspeed.engine.stream import EngineStats
from tokenspeed.errors import ContextTooLong, EngineDead, InvalidRequest, TokenSpeedError
from tokenspeed.kvcache.events import PagesRemoved, PagesStored
from tokenspeed.scheduler.plan import TokenLogprob
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.updates import RequestUpdate

PARAMS = SamplingParams(
    n=2,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    seed=7,
    stop=["\n\n", "END"],
    stop_token_ids=[5, 6],
    max_tokens=33,
    logprobs=3,
    prompt_logprobs=1,
    eos_token_ids=(2, 151645),
)
UPDATE = RequestUpdate(
    request_id="req-1#1",
    new_token_ids=[11, 12],
    new_logprobs=[TokenLogprob(11, -0.25, 1, [(11, -0.25), (99, -2.5)]), TokenLogprob(12, -1.5, 2, [])],
    new_prompt_logprobs=[TokenLogprob(3, -7.0, 40, [(4, -0.1)])],
    finished=True,
    finish_reason="stop",
    stop_reason=6,
    num_prompt_tokens=17,
    num_cached_tokens=16,
)
MESSAGES: list[ipc.Message] = [
    ipc.AddRequest("req-1", [1, 2, 3], PARAMS),
    ipc.AddRequest("plain", [4], SamplingParams()),
    ipc.AbortRequest("req-1"),
    ipc.FinishStream("req-1#1", "stop", "END"),
    ipc.Shutdown(),
    ipc.Ready(pid=123, max_model_len=512, vocab_size=4096, max_num_seqs=8, page_size=16, num_kv_pages=100),
    ipc.StartupFailed("ContextTooLong", "too long", "Traceback ..."),
    ipc.Outputs([UPDATE, RequestUpdate("r")], EngineStats(1, 2, 100, 50, 40, 10, 300, 20, 16), 5),
    ipc.Outputs([], EngineStats(), 0),
    ipc.Outputs([], EngineStats(), 1, [PagesStored(None, [b"h" * 16], list(range(16))),
                                       PagesStored(b"p" * 16, [b"a" * 16, b"b" * 16], [7] * 32),
                                       PagesRemoved([b"h" * 16, b"a" * 16])]),
    ipc.RequestFailed("req-2", "InvalidRequest", "bad"),
    ipc.EngineFailed("RuntimeError", "boom", "Traceback ..."),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    frame = ipc.encode(message)
    assert ipc.decode(frame) == message
    # Plain msgpack (no pickle, no extension types): any msgpack reader can read it.
    tag, body = msgpack.unpackb(
        frame, raw=False, ext_hook=lambda *_: pytest.fail("extension type on the wire")
    )
    assert isinstance(tag, str) and isinstance(body, dict)


def test_every_message_type_is_covered():
    assert set(typing.get_args(ipc.Message)) == {type(m) for m in MESSAGES}


def test_sampling_params_keep_their_types():
    decoded = ipc.decode(ipc.encode(ipc.AddRequest("x", [1], PARAMS)))
    assert isinstance(decoded, ipc.AddRequest)
    assert decoded.params.eos_token_ids == (2, 151645)  # a tuple again: msgpack has only lists
    assert decoded.params.stop_ids() == PARAMS.stop_ids()


def test_invalid_params_are_refused_on_decode():
    frame = ipc.encode(ipc.AddRequest("x", [1], SamplingParams()))
    tag, body = msgpack.unpackb(frame, raw=False)
    body["params"]["top_p"] = 0.0
    with pytest.raises(InvalidRequest, match="top_p"):
        ipc.decode(msgpack.packb([tag, body]))


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1",
        msgpack.packb(["nope", {}]),
        msgpack.packb(["abort", {"wrong": 1}]),
        msgpack.packb(["abort", [1]]),
    ],
)
def test_malformed_frames_raise_wire_format_error(frame):
    with pytest.raises(ipc.WireFormatError):
        ipc.decode(frame)


def test_encode_refuses_non_messages():
    with pytest.raises(TypeError):
        ipc.encode(UPDATE)  # type: ignore[arg-type]


def test_errors_come_back_typed():
    error = ipc.error_from_wire("ContextTooLong", "limit is 512")
    assert type(error) is ContextTooLong and str(error) == "limit is 512"
    assert type(ipc.error_from_wire("KeyError", "x")) is TokenSpeedError
    fallback = ipc.error_from_wire("RuntimeError", "cuda", fallback=EngineDead)
    assert type(fallback) is EngineDead and "RuntimeError: cuda" in str(fallback)
    assert type(ipc.error_from_wire("Exception", "x")) is TokenSpeedError  # not a TokenSpeedError subclass


def test_engine_config_survives_the_command_line():
    config = EngineConfig(model="/m", max_model_len=77, kernel_overrides=("attention.decode=reference",))
    assert ipc.config_from_wire(EngineConfig, ipc.config_to_wire(config)) == config
