"""The committed stubs match the .proto; unknown-field detection; the codec round trip."""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

from bucketserve.gateway.generate_input import GenerateInput
from bucketserve.gateway.proto import regenerate
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2 as pb
from bucketserve.gateway.proto_codec import (
    delta_to_response,
    input_to_request,
    request_to_input,
    response_to_chunk,
    unknown_fields,
)
from bucketserve.messages import RequestTimings, StreamDelta


def test_committed_stubs_match_the_proto() -> None:
    assert regenerate.stale_files() == []


STUBS = regenerate.PROTO_DIR / "bucketserve" / "v1"


def test_only_the_generators_version_stamps_are_ignored() -> None:
    grpc_stub = (STUBS / "serving_pb2_grpc.py").read_bytes()
    restamped = re.sub(rb"VERSION = '[^']*'", b"VERSION = '9.9.9'", grpc_stub)
    assert restamped != grpc_stub
    assert regenerate.unstamped(restamped) == regenerate.unstamped(grpc_stub)
    method = b"/bucketserve.v1.Generation/Generate'"
    renamed = grpc_stub.replace(method, b"/bucketserve.v1.Generation/Gen'")
    assert renamed != grpc_stub
    assert regenerate.unstamped(renamed) != regenerate.unstamped(grpc_stub)
    pb_stub = (STUBS / "serving_pb2.py").read_bytes()
    newer = re.sub(rb"Version: [\d.]+", b"Version: 8.0.0", pb_stub)
    newer = re.sub(rb"(Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,", rb"\1 8, 0, 0,", newer)
    assert newer != pb_stub
    assert regenerate.unstamped(newer) == regenerate.unstamped(pb_stub)


def test_the_declared_runtimes_are_ones_the_stubs_accept() -> None:
    """pyproject's lowest grpcio and protobuf are no older than the stubs' stamps (the
    releases they refuse to import under)."""
    project = tomllib.loads((regenerate.ROOT / "pyproject.toml").read_text())["project"]
    declared = {Requirement(r).name: Requirement(r).specifier for r in project["dependencies"]}
    grpc = (STUBS / "serving_pb2_grpc.py").read_text()
    pb_text = (STUBS / "serving_pb2.py").read_text()
    stamps = {
        "grpcio": re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc)[1],
        "protobuf": re.search(r"Protobuf Python Version: ([\d.]+)", pb_text)[1],
    }
    for name, stamped in stamps.items():
        lowest = min(Version(s.version) for s in declared[name] if s.operator == ">=")
        assert lowest >= Version(stamped), f"pyproject must ask {name}>={stamped}"


def test_package_is_versioned() -> None:
    assert pb.DESCRIPTOR.package == "bucketserve.v1"
    assert "Generation" in pb.DESCRIPTOR.services_by_name


def with_unknown(message: pb.GenerateRequest, field_number: int) -> pb.GenerateRequest:
    """`message` as a newer client would send it: plus a varint field we don't define."""
    low, high = (field_number << 3) & 0x7F, field_number >> 4
    tag = bytes([low | 0x80, high]) if high else bytes([low])
    parsed = pb.GenerateRequest()
    parsed.ParseFromString(message.SerializeToString() + tag + b"\x01")
    return parsed


def test_unknown_fields_are_found_at_any_depth() -> None:
    request = pb.GenerateRequest(text="hi")
    assert unknown_fields(request) == []
    assert unknown_fields(with_unknown(request, 99)) == ["GenerateRequest #99"]
    nested = pb.GenerateRequest()
    tag_40 = bytes([(40 << 3) & 0x7F | 0x80, (40 << 3) >> 7])  # field 40, varint: 2 bytes
    inner = pb.SamplingParams(max_tokens=3).SerializeToString() + tag_40 + b"\x01"
    nested.ParseFromString(b"\x2a" + bytes([len(inner)]) + inner)  # field 5: sampling_params
    assert unknown_fields(nested) == ["GenerateRequest.sampling_params #40"]
    chat = pb.GenerateRequest()
    message = b"\x0a\x04user" + bytes([(9 << 3)]) + b"\x07"  # ChatMessage with field 9
    messages = b"\x0a" + bytes([len(message)]) + message
    chat.ParseFromString(b"\x22" + bytes([len(messages)]) + messages)  # field 4: chat
    assert unknown_fields(chat) == ["GenerateRequest.chat.messages[0] #9"]


def test_request_round_trip() -> None:
    inp = GenerateInput(
        messages=[{"role": "user", "content": "Hello"}],
        sampling={"temperature": 0.0, "max_tokens": 5, "stop": ["x"], "seed": 3, "top_k": -1},
        request_id="r1",
        priority=-2,
        slo_ttft_s=0.25,
    )
    back = request_to_input(input_to_request(inp, stream=True))
    assert back.messages == inp.messages
    assert back.sampling == {**inp.sampling, "stop_token_ids": [], "ignore_eos": False}
    assert (back.request_id, back.priority) == ("r1", -2)
    assert (back.slo_ttft_s, back.slo_tpot_s) == (0.25, None)
    ids = input_to_request(GenerateInput(prompt_token_ids=[4, 5]), stream=False)
    assert request_to_input(ids).prompt_token_ids == [4, 5]


def test_unset_sampling_fields_stay_unset() -> None:
    back = request_to_input(pb.GenerateRequest(text="x"))
    assert back.prompt == "x"
    assert back.sampling == {"stop": [], "stop_token_ids": [], "ignore_eos": False}


def test_response_round_trip() -> None:
    delta = StreamDelta("r1", [7, 8], "ab", finished=True, finish_reason="length")
    delta.num_prompt_tokens, delta.num_output_tokens, delta.num_cached_tokens = 3, 9, 2
    delta.timings = RequestTimings(0.1, 0.2, 0.3, 0.4, 0.5)
    delta.request_bucket, delta.shape_bucket = (0, 512), (4, 128, 2)
    chunk = response_to_chunk(delta_to_response(delta))
    assert (chunk.token_ids, chunk.text, chunk.finish_reason) == ([7, 8], "ab", "length")
    assert (chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens) == (3, 9, 2)
    assert chunk.timings == RequestTimings(0.1, 0.2, 0.3, 0.4, 0.5)
    assert (chunk.request_bucket, chunk.shape_bucket) == ((0, 512), (4, 128, 2))
    middle = response_to_chunk(delta_to_response(StreamDelta("r1", [1], "a")))
    assert not middle.finished and middle.finish_reason is None


def test_cancel_reason_reaches_the_final_message() -> None:
    delta = StreamDelta("r", finished=True, finish_reason="cancelled")
    chunk = response_to_chunk(delta_to_response(delta, "the server is shutting down"))
    assert (chunk.finish_reason, chunk.error) == ("cancelled", "the server is shutting down")
