"""Generated stubs are current, and our KServe proto is wire-compatible with the official Triton client.

tritonclient registers its own `inference.*` messages in protobuf's default descriptor pool, so it cannot
be imported beside our stubs: its descriptors are dumped from a subprocess and compared here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from google.protobuf.descriptor import Descriptor, FileDescriptor

from sluice_inference.common import protogen
from sluice_inference.common.pb.inference import grpc_service_pb2 as ours

_DUMP_TRITON = """
import json
from tritonclient.grpc import service_pb2 as pb
def fields(m):
    return {f.name: [f.number, f.type, f.message_type.full_name if f.message_type else ""] for f in m.fields}
messages = {}
def visit(m):
    messages[m.full_name] = fields(m)
    for n in m.nested_types:
        visit(n)
for m in pb.DESCRIPTOR.message_types_by_name.values():
    visit(m)
service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
methods = {m.name: [m.input_type.full_name, m.output_type.full_name] for m in service.methods}
print(json.dumps({"package": pb.DESCRIPTOR.package, "messages": messages, "methods": methods}))
"""


@pytest.fixture(scope="module")
def triton() -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _DUMP_TRITON], check=True, capture_output=True, text=True)
    dumped: dict[str, object] = json.loads(out.stdout)
    return dumped


def test_committed_stubs_match_a_fresh_generation() -> None:
    stale = protogen.stale_files()
    assert stale == [], f"run `make protos`: stale or missing stubs {stale}"


def _fields(message: Descriptor) -> dict[str, list[object]]:
    return {
        f.name: [f.number, f.type, f.message_type.full_name if f.message_type else ""] for f in message.fields
    }


def _walk(file: FileDescriptor) -> dict[str, Descriptor]:
    found: dict[str, Descriptor] = {}

    def visit(message: Descriptor) -> None:
        found[message.full_name] = message
        for nested in message.nested_types:
            visit(nested)

    for message in file.message_types_by_name.values():
        visit(message)
    return found


def test_every_message_we_define_matches_tritons_wire_format(triton: dict[str, object]) -> None:
    theirs = triton["messages"]
    assert isinstance(theirs, dict)
    assert ours.DESCRIPTOR.package == triton["package"] == "inference"
    for name, message in _walk(ours.DESCRIPTOR).items():
        assert name in theirs, f"{name} is not in the public protocol"
        their_fields = theirs[name]
        for field, signature in _fields(message).items():
            assert their_fields.get(field) == signature, (
                f"{name}.{field}: {signature} vs {their_fields.get(field)}"
            )


def test_our_rpcs_have_the_same_names_and_types_as_tritons(triton: dict[str, object]) -> None:
    theirs = triton["methods"]
    assert isinstance(theirs, dict)
    for method in ours.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        assert theirs[method.name] == [method.input_type.full_name, method.output_type.full_name]
