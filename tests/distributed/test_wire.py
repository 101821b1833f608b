"""The torch engine's byte meter (minipar/distributed/wire.py): a connection's count is
what the process wrote to it, whether or not the kernel has put it on the wire yet, so
that an operation's bytes are booked to it, not to the next one."""

from __future__ import annotations

import socket
import struct

import pytest

from minipar.distributed import wire

pytestmark = pytest.mark.skipif(not wire.available(), reason="needs Linux's TCP_INFO")


@pytest.fixture
def connection():
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    yield sender, receiver
    sender.close()
    receiver.close()


def test_a_socket_counts_the_bytes_written_even_those_not_yet_transmitted(connection):
    sender, receiver = connection
    # a small receive buffer and a receiver that reads nothing: the window shuts, and
    # what the sender writes after that waits in its queue, written but not sent
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    sender.setblocking(False)
    meter = wire._Socket(sender.fileno())
    try:
        written, chunk = 0, b"x" * 65536
        while written < 1 << 20:  # a MiB: far past a 4 KiB window
            try:
                written += sender.send(chunk)
            except BlockingIOError:
                break
        info = meter.handle.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO,
                                       wire.TCP_INFO_SIZE)
        transmitted = struct.unpack_from("Q", info, wire.BYTES_SENT_OFFSET)[0]
        assert transmitted < written  # the kernel holds the rest: counting transmissions
        assert meter.sent() == written  # would miss it; the meter books every byte now
    finally:
        meter.handle.close()
