"""The sampling fields' one list: the worker proto's ``SamplingParams`` message. The engine's
``SamplingParams``, the SDK's, the public gRPC API and the HTTP models carry the same names
(vLLM's); the engine and the SDK convert through the two functions here, driven by the
message's own field list, so that a field added to the proto cannot be forgotten in one of
them (tests/test_sampling_fields.py checks every copy, field by field). Torch-free: the SDK
imports it."""

from __future__ import annotations

from proto import worker_pb2 as pb

FIELDS = tuple(pb.SamplingParams.DESCRIPTOR.fields)
# protobuf >= 6 says is_repeated; the older releases the SDK also accepts say it with label
_REPEATED = {field.name for field in FIELDS
             if getattr(field, "is_repeated", None) or getattr(field, "label", None) == field.LABEL_REPEATED}
FIELD_NAMES = tuple(field.name for field in FIELDS)


def sampling_to_proto(params: object) -> pb.SamplingParams:
    """``params``: any object with the message's field names as attributes (the engine's or
    the SDK's SamplingParams). None leaves an optional field unset (the receiver's default)."""
    message = pb.SamplingParams()
    for field in FIELDS:
        value = getattr(params, field.name, None)  # a copy may lack a field it never sends (tested)
        if field.name in _REPEATED:
            getattr(message, field.name).extend(value)
        elif value is not None:
            setattr(message, field.name, value)
    return message


def sampling_from_proto(message: pb.SamplingParams) -> dict[str, object]:
    """field name -> value: every field the sender set (optional fields it left unset are
    absent, so the receiver's defaults apply); repeated fields as tuples."""
    values: dict[str, object] = {}
    for field in FIELDS:
        if field.name in _REPEATED:
            values[field.name] = tuple(getattr(message, field.name))
        elif not field.has_presence or message.HasField(field.name):
            values[field.name] = getattr(message, field.name)
    return values
