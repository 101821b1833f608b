"""Messages between the grader and the processes that run the code under test.

A message is a 4-byte length, a JSON header, then the raw bytes of the arrays the header
lists under "arrays" (dtype and shape of each). Nothing is unpickled: a process running
the code under test can hand the grader only such messages, and the grader checks each
one's sizes and dtypes before it reads its bytes. Values in a header (a call's arguments,
its result) are packed: JSON's own types, tuples, dicts, arrays (by their place in the
message) and instances of the dataclasses the two sides name, rebuilt from their fields.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import struct
import time

import numpy as np

MAX_HEADER = 1 << 20  # bytes of JSON
MAX_PAYLOAD = 1 << 28  # bytes of arrays in one message
MAX_ARRAYS, MAX_NDIM = 8, 8
KINDS = "biufc"  # booleans and numbers; never objects


class WireError(Exception):
    """The other side sent something that is not a message, or closed the pipe."""


def encode(header: dict, arrays=()) -> bytes:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    header = {**header, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}
    text = json.dumps(header).encode()
    return b"".join([struct.pack(">I", len(text)), text, *(a.tobytes() for a in arrays)])


def write(fd: int, header: dict, arrays=()) -> None:
    data = memoryview(encode(header, arrays))
    while data:
        data = data[os.write(fd, data):]


def _layout(header: dict) -> list[tuple[np.dtype, tuple[int, ...]]]:
    listed = header.get("arrays", [])
    if not isinstance(listed, list) or len(listed) > MAX_ARRAYS:
        raise WireError("a message lists too many arrays")
    layout, total = [], 0
    for entry in listed:
        try:
            dtype_text, shape = entry
            dtype = np.dtype(str(dtype_text))
            shape = tuple(int(n) for n in shape)
        except (TypeError, ValueError) as error:
            raise WireError(f"a message lists an array it cannot describe: {error}") from None
        if dtype.kind not in KINDS or dtype.hasobject or len(shape) > MAX_NDIM \
                or any(n < 0 for n in shape):
            raise WireError(f"a message lists an array of dtype {dtype} and shape {shape}")
        total += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if total > MAX_PAYLOAD:
            raise WireError("a message is larger than the grader reads")
        layout.append((dtype, shape))
    return layout


def pack(value, arrays: list, classes: dict):
    """`value` as JSON, its arrays appended to `arrays`; classes: {name: dataclass} that
    may be packed by their fields. TypeError for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        if value.dtype.kind not in KINDS or value.dtype.hasobject:
            raise TypeError(f"an array of {value.dtype} cannot go between processes")
        arrays.append(np.asarray(value))
        return {"array": len(arrays) - 1, "scalar": isinstance(value, np.generic)}
    if isinstance(value, list):
        return [pack(v, arrays, classes) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [pack(v, arrays, classes) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[pack(k, arrays, classes), pack(v, arrays, classes)]
                         for k, v in value.items()]}
    name = type(value).__name__
    if classes.get(name) is type(value):
        return {"object": name, "fields": {f.name: pack(getattr(value, f.name), arrays,
                                                        classes)
                                           for f in dataclasses.fields(value)}}
    raise TypeError(f"a {name} cannot go between processes")


def unpack(packed, arrays: list, classes: dict):
    """The value `pack` made (WireError for anything it cannot have made)."""
    if packed is None or isinstance(packed, (bool, int, float, str)):
        return packed
    if isinstance(packed, list):
        return [unpack(v, arrays, classes) for v in packed]
    if isinstance(packed, dict) and len(packed) == 1 and isinstance(packed.get("tuple"), list):
        return tuple(unpack(v, arrays, classes) for v in packed["tuple"])
    if isinstance(packed, dict) and len(packed) == 1 and isinstance(packed.get("dict"), list):
        return {unpack(k, arrays, classes): unpack(v, arrays, classes)
                for k, v in packed["dict"]}
    if isinstance(packed, dict) and isinstance(packed.get("array"), int) \
            and 0 <= packed["array"] < len(arrays):
        array = arrays[packed["array"]]
        return array[()] if packed.get("scalar") and array.ndim == 0 else array
    if isinstance(packed, dict) and packed.get("object") in classes \
            and isinstance(packed.get("fields"), dict):
        fields = {k: unpack(v, arrays, classes) for k, v in packed["fields"].items()}
        return classes[packed["object"]](**fields)
    raise WireError("a value the grader does not know how to read")


class Reader:
    """Cuts the bytes read from a pipe into messages: feed(bytes), then pop() each
    (header, arrays) until it returns None."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._header: dict | None = None
        self._layout: list = []

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def pop(self):
        if self._header is None:
            if len(self._buffer) < 4:
                return None
            (length,) = struct.unpack(">I", self._buffer[:4])
            if length > MAX_HEADER:
                raise WireError("a message header is larger than the grader reads")
            if len(self._buffer) < 4 + length:
                return None
            try:
                header = json.loads(bytes(self._buffer[4:4 + length]))
            except (ValueError, RecursionError) as error:
                raise WireError(f"a message header is not JSON: {error}") from None
            if not isinstance(header, dict):
                raise WireError("a message header is not a JSON object")
            del self._buffer[:4 + length]
            self._header, self._layout = header, _layout(header)
        need = sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for d, s in self._layout)
        if len(self._buffer) < need:
            return None
        arrays, offset = [], 0
        for dtype, shape in self._layout:
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            data = bytes(self._buffer[offset:offset + size])
            arrays.append(np.frombuffer(data, dtype=dtype).reshape(shape).copy())
            offset += size
        del self._buffer[:need]
        header, self._header = self._header, None
        return header, arrays


def read(fd: int, reader: Reader, timeout: float | None = None, poll: float = 0.05):
    """The next message from fd: (header, arrays); None when `timeout` seconds pass first.
    Waits in slices of `poll` seconds, so an exception raised into this thread (the
    launch watchdog's) is taken between them. WireError when the other side closed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        message = reader.pop()
        if message is not None:
            return message
        left = poll if deadline is None else min(poll, deadline - time.monotonic())
        if left <= 0:
            return None
        if select.select([fd], [], [], left)[0]:
            data = os.read(fd, 1 << 16)
            if not data:
                raise WireError("the process closed its pipe")
            reader.feed(data)
