"""The bytes a rank process really put on its TCP sockets, per operation (Linux only).

    meter = WireMeter(store_ports={29500})
    sockets = meter.adopt(socket_fds() - before)   # the sockets a process group just opened
    meter.start(token, "all_reduce", sockets)  # before the call ...
    meter.stop(token, sockets)                 # ... and after it completed
    meter.sent_bytes, meter.by_label           # {"all_reduce": bytes, ...}

The kernel keeps, per TCP socket, the bytes it has transmitted (`tcpi_bytes_sent` of
`struct tcp_info`, RFC 4898's tcpEStatsPerfHCDataOctetsOut, Linux >= 4.19), those among
them sent again (`tcpi_bytes_retrans`) and those written but not yet transmitted
(`tcpi_notsent_bytes`), read with getsockopt(IPPROTO_TCP, TCP_INFO) as `ss -ti` does.
Sent - retransmitted + not yet sent is what the process wrote to the connection, each
byte once: gloo's message headers, its protocol messages and every byte of the payload.
Counting transmissions alone would book to the next operation the bytes an operation
wrote that the kernel had not yet put on the wire when the call returned (on loaded
cores a descheduled peer leaves its window shut for a while), and count retransmissions
twice.

Attribution. Each socket's counter is read when an operation that uses it starts and when
it ends; the bytes in between go to the operations outstanding on that socket: one name
if they all have the same name, "a+b (overlapping)" if not, and "between operations" if
none was outstanding (bytes a socket still sent after the call returned). Every byte
lands in exactly one label, so the labels add up to `sent_bytes`. Each torch process group
has its own connections (gloo connects a full mesh per group), so operations of different
groups never share a socket.

The sockets of the rendezvous store (TCPStore; its port is `store_ports`) are not counted:
their traffic is the set-up, not the training.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading

# Offsets in struct tcp_info (include/uapi/linux/tcp.h): tcpi_notsent_bytes (Linux 4.6)
# follows tcpi_segs_in; tcpi_bytes_sent and tcpi_bytes_retrans follow tcpi_delivered and
# tcpi_delivered_ce (Linux 4.19).
NOTSENT_BYTES_OFFSET = 144
BYTES_SENT_OFFSET = 200  # then tcpi_bytes_retrans
TCP_INFO_SIZE = 256
BETWEEN = "between operations"


def available() -> bool:
    """Whether the OS tells a socket's bytes sent (Linux's TCP_INFO)."""
    return sys.platform.startswith("linux") and hasattr(socket, "TCP_INFO")


def socket_fds() -> set[int]:
    """The file descriptors of this process that are sockets."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.add(int(name))
        except OSError:  # closed meanwhile (the listing itself was one of them)
            continue
    return found


class _Socket:
    """One TCP connection of this process, read through a duplicate of its descriptor (a
    dup shares the connection, so closing it later leaves gloo's own open)."""

    __slots__ = ("handle", "peer", "local")

    def __init__(self, fd: int) -> None:
        self.handle = socket.socket(fileno=os.dup(fd))
        try:
            if self.handle.type != socket.SOCK_STREAM or self.handle.family not in (
                    socket.AF_INET, socket.AF_INET6):
                raise OSError("not a TCP socket")
            self.local = self.handle.getsockname()[:2]
            self.peer = self.handle.getpeername()[:2]  # OSError if not connected
        except OSError:
            self.handle.close()
            raise

    def sent(self) -> int:
        """The bytes this process has written to the connection so far (module
        docstring): transmitted, less transmitted again, plus not yet transmitted."""
        info = self.handle.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_SIZE)
        transmitted, again = struct.unpack_from("QQ", info, BYTES_SENT_OFFSET)
        return transmitted - again + struct.unpack_from("I", info, NOTSENT_BYTES_OFFSET)[0]


class WireMeter:
    """Bytes sent per socket and per operation label (the module docstring)."""

    def __init__(self, store_ports=()) -> None:
        self.store_ports = set(store_ports)
        self.sockets: dict[int, _Socket] = {}  # our fd -> socket
        self._last: dict[int, int] = {}  # fd -> counter at its last reading
        self._open: dict[int, dict[object, str]] = {}  # fd -> {operation token: label}
        self.by_label: dict[str, int] = {}
        self.enabled = available()
        # gloo completes transfers in its own threads, whose callbacks stop operations
        self._lock = threading.Lock()

    # --- which sockets ------------------------------------------------------------------
    def adopt(self, fds) -> tuple[int, ...]:
        """Start counting the connected TCP sockets among `fds` (not the store's);
        returns the ones adopted. Their bytes so far are not counted."""
        adopted = []
        if not self.enabled:
            return ()
        for fd in sorted(fds):
            if fd not in self.sockets:
                try:
                    sock = _Socket(fd)
                except OSError:  # listening, a Unix socket, not connected: nothing to count
                    continue
                if self.store_ports & {sock.local[1], sock.peer[1]}:
                    sock.handle.close()
                    continue
                self.sockets[fd], self._last[fd], self._open[fd] = sock, sock.sent(), {}
            adopted.append(fd)
        return tuple(adopted)

    def peer_of(self, fd: int) -> tuple[str, int]:
        return self.sockets[fd].peer

    # --- counting -------------------------------------------------------------------------
    def _read(self, fds) -> None:
        """Book each socket's bytes since its last reading to what was outstanding on it."""
        for fd in fds:
            now = self.sockets[fd].sent()
            delta, self._last[fd] = now - self._last[fd], now
            if delta:
                labels = sorted(set(self._open[fd].values()))
                label = (BETWEEN if not labels else labels[0] if len(labels) == 1
                         else "+".join(labels) + " (overlapping)")
                self.by_label[label] = self.by_label.get(label, 0) + delta

    def start(self, token, label: str, fds) -> None:
        """Operation `token` (any hashable, unique while it runs) starts on `fds`."""
        if not self.enabled or not fds:
            return
        with self._lock:
            self._read(fds)
            for fd in fds:
                self._open[fd][token] = label

    def stop(self, token, fds) -> None:
        """Operation `token` has completed."""
        if not self.enabled or not fds:
            return
        with self._lock:
            self._read(fds)
            for fd in fds:
                self._open[fd].pop(token, None)

    def flush(self) -> None:
        """Read every socket (at the end: bytes still counted after the last operation)."""
        if self.enabled:
            with self._lock:
                self._read(list(self.sockets))

    @property
    def sent_bytes(self) -> int:
        return sum(self.by_label.values())

    def reset(self) -> None:
        """Count from zero (a new launch on the same processes)."""
        self.flush()
        self.by_label = {}

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.handle.close()
        self.sockets.clear()
