"""The protobuf bodies of the Tinker protocol, read and written by hand (no generated code).

The SDK sends `forward_backward` as a protobuf `ForwardBackwardRequest` and accepts a
`ForwardBackwardOutput` result only as protobuf. Both messages are small, so this module
speaks the protobuf wire format directly (varints, length-delimited fields, packed
repeated numbers) for just the fields we use; unknown fields are skipped, as protobuf
readers do. Field numbers follow the SDK's `tinker_public.proto`:

    request = decode_forward_backward(body)          # WireForwardBackward, numpy-free lists
    body = encode_forward_backward_output(outputs, metrics)
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from miles.controller.tinker.wire import MAX_ID_CHARS
from miles.utils.types import DatumOutput

# DType enum of the wire.
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 1, 2, 3, 4
_DTYPE_NUMPY: dict[int, np.dtype] = {
    DTYPE_FLOAT32: np.dtype("<f4"), DTYPE_INT64: np.dtype("<i8"), DTYPE_INT32: np.dtype("<i4"),
}

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


class ProtoDecodeError(ValueError):
    """A body that is not the message it should be (HTTP 400)."""


@dataclass
class WireTensor:
    """A `Tensor` as received: flat values (dense; a sparse one is refused) and its shape."""

    values: list[float] | list[int]
    shape: list[int]
    dtype: int


@dataclass
class WireDatum:
    tokens: list[int]
    loss_fn_inputs: dict[str, WireTensor]


@dataclass
class WireForwardBackward:
    model_id: str = ""
    seq_id: int = 0
    data: list[WireDatum] = field(default_factory=list)
    loss_fn: str = ""
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False


# ---- reading ------------------------------------------------------------------------------

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtoDecodeError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ProtoDecodeError("varint longer than 10 bytes")


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value): an int for varints and fixed numbers, bytes otherwise."""
    pos = 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        value: int | bytes
        if wire == _VARINT:
            value, pos = _varint(buf, pos)
        elif wire == _FIXED64:
            value, pos = int.from_bytes(buf[pos:pos + 8], "little"), pos + 8
        elif wire == _FIXED32:
            value, pos = int.from_bytes(buf[pos:pos + 4], "little"), pos + 4
        elif wire == _LEN:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
            if len(value) != size:
                raise ProtoDecodeError("truncated length-delimited field")
        else:
            raise ProtoDecodeError(f"unsupported wire type {wire} (field {number})")
        if pos > len(buf):
            raise ProtoDecodeError(f"truncated field {number}")
        yield number, wire, value


def _text(value: int | bytes) -> str:
    """A string field: a model id, a loss name, a config or input name (refusals name them,
    so a longer one is refused here rather than echoed back)."""
    if not isinstance(value, bytes):
        raise ProtoDecodeError("expected a string field")
    if len(value) > MAX_ID_CHARS:
        raise ProtoDecodeError(f"a string field of {len(value)} bytes: ids and names take at most {MAX_ID_CHARS}")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtoDecodeError(f"string field is not UTF-8 ({exc})") from None


def _message(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise ProtoDecodeError("expected a message field")
    return value


def _double(value: int | bytes) -> float:
    if not isinstance(value, int):
        raise ProtoDecodeError("expected a double field")
    return float(struct.unpack("<d", value.to_bytes(8, "little"))[0])


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _ints(wire: int, value: int | bytes) -> list[int]:
    """A repeated integer field: packed (one bytes value) or not (one varint)."""
    if isinstance(value, int):
        return [_signed(value)]
    out, pos = [], 0
    while pos < len(value):
        number, pos = _varint(value, pos)
        out.append(_signed(number))
    return out


def _tensor(buf: bytes, name: str) -> WireTensor:
    dense: bytes | None = None
    dtype, shape = 0, []
    for number, wire, value in _fields(buf):
        if number == 1:
            dense = _message(value)
        elif number == 2:
            raise ProtoDecodeError(f"loss_fn_inputs[{name!r}] is a sparse tensor; send it dense")
        elif number == 3 and isinstance(value, int):
            dtype = value
        elif number == 4:
            shape.extend(_ints(wire, value))
    if dtype not in _DTYPE_NUMPY:
        raise ProtoDecodeError(f"loss_fn_inputs[{name!r}] has unsupported dtype {dtype}; use float32 or int64")
    raw = dense or b""
    width = _DTYPE_NUMPY[dtype].itemsize
    if len(raw) % width:
        raise ProtoDecodeError(f"loss_fn_inputs[{name!r}]: {len(raw)} bytes is not a whole number of values")
    array = np.frombuffer(raw, dtype=_DTYPE_NUMPY[dtype])
    values = array.astype(np.float64).tolist() if dtype == DTYPE_FLOAT32 else array.astype(np.int64).tolist()
    return WireTensor(values=values, shape=shape or [len(values)], dtype=dtype)


def _chunk_tokens(buf: bytes) -> list[int]:
    for number, _, value in _fields(buf):
        if number == 1:
            for inner, _, tokens in _fields(_message(value)):
                if inner == 1:
                    raw = _message(tokens)
                    if len(raw) % 4:
                        raise ProtoDecodeError("encoded_text tokens are not whole int32 values")
                    return np.frombuffer(raw, dtype="<i4").astype(np.int64).tolist()
            return []
        if number in (2, 3):
            raise ProtoDecodeError("image and audio chunks are not supported; send encoded text tokens")
    raise ProtoDecodeError("empty model_input chunk")


def _datum(buf: bytes) -> WireDatum:
    tokens: list[int] = []
    inputs: dict[str, WireTensor] = {}
    for number, _, value in _fields(buf):
        if number == 1:
            tokens.extend(_chunk_tokens(_message(value)))
        elif number == 2:
            key, tensor = "", b""
            for inner, _, item in _fields(_message(value)):
                if inner == 1:
                    key = _text(item)
                elif inner == 2:
                    tensor = _message(item)
            inputs[key] = _tensor(tensor, key)
    return WireDatum(tokens=tokens, loss_fn_inputs=inputs)


def _config_value(buf: bytes) -> float | str:
    for number, _, value in _fields(buf):
        if number == 1:
            return _double(value)
        if number == 2:
            return _text(value)
    raise ProtoDecodeError("empty loss_fn_config value")


def decode_forward_backward(body: bytes) -> WireForwardBackward:
    """A `ForwardBackwardRequest` body; raises `ProtoDecodeError` saying what is wrong."""
    out = WireForwardBackward()
    legacy: dict[str, float] = {}
    for number, _, value in _fields(body):
        if number == 1:
            out.model_id = _text(value)
        elif number == 2 and isinstance(value, int):
            out.seq_id = _signed(value)
        elif number == 3:
            out.data.append(_datum(_message(value)))
        elif number == 4:
            out.loss_fn = _text(value)
        elif number in (5, 7):
            key: str = ""
            item: float | str | None = None
            for inner, _, part in _fields(_message(value)):
                if inner == 1:
                    key = _text(part)
                elif inner == 2:
                    item = _double(part) if number == 5 else _config_value(_message(part))
            if isinstance(item, float) and number == 5:
                legacy[key] = item
            elif item is not None:
                out.loss_fn_config[key] = item
        elif number == 6 and isinstance(value, int):
            out.forward_only = bool(value)
    for key, number_value in legacy.items():
        out.loss_fn_config.setdefault(key, number_value)  # v2 wins where both are sent
    return out


# ---- writing ------------------------------------------------------------------------------

def put_varint(out: bytearray, value: int) -> None:
    """A varint; a negative value as protobuf writes an int32/int64 (two's complement, 64 bits)."""
    value &= (1 << 64) - 1
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def put_len(out: bytearray, number: int, payload: bytes) -> None:
    """Field `number`, length-delimited (bytes, a packed array or a nested message)."""
    put_varint(out, number << 3 | _LEN)
    put_varint(out, len(payload))
    out += payload


def put_varint_field(out: bytearray, number: int, value: int) -> None:
    """Field `number`, an integer or enum."""
    put_varint(out, number << 3 | _VARINT)
    put_varint(out, value)


def _put_double_field(out: bytearray, number: int, value: float) -> None:
    put_varint(out, number << 3 | _FIXED64)
    out += struct.pack("<d", value)


def _batched_tensor(arrays: list[np.ndarray]) -> bytes:
    """One field of every datum: float32 values back to back, byte offsets (n + 1 int64)."""
    offsets = np.zeros(len(arrays) + 1, dtype="<i8")
    offsets[1:] = np.cumsum([a.size * 4 for a in arrays])
    data = b"".join(np.asarray(a, dtype="<f4").tobytes() for a in arrays)
    out = bytearray()
    put_len(out, 1, data)
    put_len(out, 2, offsets.tobytes())
    put_varint_field(out, 3, DTYPE_FLOAT32)
    return bytes(out)  # no trailing shape: every field is one value per position


def encode_forward_backward_output(outputs: list[DatumOutput], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput`: one `ArrayRecord` holding each output field of every datum."""
    out = bytearray()
    put_len(out, 1, b"ArrayRecord")
    names = sorted({name for o in outputs for name in o.outputs})
    missing = [(i, n) for i, o in enumerate(outputs) for n in names if n not in o.outputs]
    if missing:
        raise ValueError(f"every datum needs the same output fields; datum {missing[0][0]} lacks {missing[0][1]!r}")
    record = bytearray()
    put_len(record, 1, b"ArrayRecord")
    for name in names:
        entry = bytearray()
        put_len(entry, 1, name.encode())
        put_len(entry, 2, _batched_tensor([np.asarray(o.outputs[name], dtype=np.float32) for o in outputs]))
        put_len(record, 2, bytes(entry))
    put_varint_field(record, 3, len(outputs))
    put_len(out, 2, bytes(record))
    for key, value in sorted(metrics.items()):
        entry = bytearray()
        put_len(entry, 1, key.encode())
        _put_double_field(entry, 2, float(value))
        put_len(out, 3, bytes(entry))
    return bytes(out)
