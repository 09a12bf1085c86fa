#!/usr/bin/env python3
"""bench/idle-conns.py — the client of bench/idle-conns (standard library only).

  open  PORT N PROTO CONC   open N connections (PROTO h1 or h2c), at most CONC of them
                            connecting or waiting for their answer at a time; send one GET on
                            each and read the whole response; then print "ready OK CLOSED" and
                            hold them all idle (answering HTTP/2 PINGs, counting closes) until
                            stdin is closed, then print "closed-while-idle N" and exit.
  probe PORT K GAP_MS       K sequential GETs on one keep-alive HTTP/1.1 connection, GAP_MS
                            apart (so the connection is idle between them); prints
                            "probe p50_us p99_us max_us errors".
"""

import os
import selectors
import socket
import struct
import sys
import time

PATH = b"/bench/item"
HOST = b"127.0.0.1"

H1_REQ = b"GET " + PATH + b" HTTP/1.1\r\nHost: " + HOST + b"\r\nUser-Agent: idle-conns\r\n\r\n"


def hpack_literal(name_index, value):
    # literal header field without indexing, indexed name (RFC 7541 6.2.2), no Huffman
    assert name_index < 15 and len(value) < 127
    return bytes([name_index, len(value)]) + value


H2_BLOCK = (
    bytes([0x82])  # :method GET
    + bytes([0x86])  # :scheme http
    + hpack_literal(4, PATH)  # :path
    + hpack_literal(1, HOST)  # :authority
)


def frame(ftype, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", stream) + payload


H2_OPEN = (
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    + frame(4, 0, 0)  # SETTINGS, empty
    + frame(1, 0x5, 1, H2_BLOCK)  # HEADERS, END_STREAM | END_HEADERS, stream 1
)


class Conn:
    __slots__ = ("sock", "proto", "state", "buf", "out", "done")

    def __init__(self, sock, proto):
        self.sock = sock
        self.proto = proto
        self.state = "connecting"
        self.buf = b""
        self.out = b""
        self.done = False

    def h1_complete(self):
        """True once self.buf holds one whole response."""
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0:
            return False
        head = self.buf[:head_end].lower()
        body = self.buf[head_end + 4:]
        for line in head.split(b"\r\n")[1:]:
            if line.startswith(b"content-length:"):
                return len(body) >= int(line.split(b":", 1)[1])
        if b"transfer-encoding: chunked" in head:
            return body.endswith(b"0\r\n\r\n")
        return False

    def h2_feed(self):
        """Consume whole frames; queue SETTINGS/PING acks; True once stream 1 has ended."""
        while len(self.buf) >= 9:
            length = int.from_bytes(self.buf[:3], "big")
            if len(self.buf) < 9 + length:
                break
            ftype, flags = self.buf[3], self.buf[4]
            stream = int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
            payload = self.buf[9:9 + length]
            self.buf = self.buf[9 + length:]
            if ftype == 4 and not flags & 1:  # SETTINGS -> ACK
                self.out += frame(4, 1, 0)
            elif ftype == 6 and not flags & 1:  # PING -> PONG
                self.out += frame(6, 1, 0, payload)
            elif ftype == 7:  # GOAWAY
                raise ConnectionError("GOAWAY")
            elif stream == 1 and ftype in (0, 1) and flags & 1:  # DATA/HEADERS, END_STREAM
                self.done = True
        return self.done


def open_conns(port, n, proto, conc):
    sel = selectors.DefaultSelector()
    conns = []
    active = 0
    opened = 0
    ok = 0
    failed = 0

    def start():
        nonlocal active, opened
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.connect_ex(("127.0.0.1", port))
        c = Conn(s, proto)
        c.out = H1_REQ if proto == "h1" else H2_OPEN
        sel.register(s, selectors.EVENT_WRITE, c)
        conns.append(c)
        active += 1
        opened += 1

    def finish(c, good):
        nonlocal active, ok, failed
        active -= 1
        c.state = "idle" if good else "failed"
        if good:
            ok += 1
            sel.modify(c.sock, selectors.EVENT_READ, c)
        else:
            failed += 1
            sel.unregister(c.sock)
            c.sock.close()

    deadline = time.monotonic() + 60 + n / 200
    while (opened < n or active > 0) and time.monotonic() < deadline:
        while opened < n and active < conc:
            start()
        for key, ev in sel.select(timeout=1.0):
            c = key.data
            if c.state in ("idle", "failed"):
                continue  # a late frame on an idle connection: handled by hold()
            try:
                if ev & selectors.EVENT_WRITE and c.out:
                    sent = c.sock.send(c.out)
                    c.out = c.out[sent:]
                    c.state = "reading"
                    if not c.out:
                        sel.modify(c.sock, selectors.EVENT_READ, c)
                    continue
                data = c.sock.recv(65536)
                if not data:
                    finish(c, False)
                    continue
                c.buf += data
                done = c.h1_complete() if proto == "h1" else c.h2_feed()
                if c.out:
                    c.sock.send(c.out)  # small acks: the socket buffer is empty here
                    c.out = b""
                if done:
                    c.buf = b""
                    finish(c, True)
            except (ConnectionError, OSError):
                finish(c, False)
    return sel, [c for c in conns if c.state == "idle"], ok, failed


def hold(sel, conns):
    """Keep the connections open: answer PINGs, count closes, until stdin closes."""
    closed = 0
    sel.register(sys.stdin, selectors.EVENT_READ, None)
    while True:
        for key, _ in sel.select(timeout=5.0):
            if key.data is None:
                if not os.read(sys.stdin.fileno(), 4096):
                    print(f"closed-while-idle {closed}", flush=True)
                    return
                continue
            c = key.data
            try:
                data = c.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                closed += 1
                sel.unregister(c.sock)
                c.sock.close()
                continue
            if c.proto == "h2c":
                c.buf += data
                try:
                    c.h2_feed()
                except ConnectionError:
                    pass
                if c.out:
                    try:
                        c.sock.send(c.out)
                    except OSError:
                        pass
                    c.out = b""


def probe(port, k, gap_ms):
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    lat = []
    errors = 0
    for _ in range(k):
        time.sleep(gap_ms / 1000)
        c = Conn(s, "h1")
        t0 = time.perf_counter()
        s.sendall(H1_REQ)
        while not c.h1_complete():
            data = s.recv(65536)
            if not data:
                errors += 1
                s = socket.create_connection(("127.0.0.1", port))
                break
            c.buf += data
        lat.append((time.perf_counter() - t0) * 1e6)
        if not c.buf.startswith(b"HTTP/1.1 200"):
            errors += 1
    lat.sort()
    pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]
    print(f"probe {pick(0.5):.0f} {pick(0.99):.0f} {lat[-1]:.0f} {errors}", flush=True)


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "open":
        port, n, proto, conc = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
        sel, conns, ok, failed = open_conns(port, n, proto, conc)
        print(f"ready {ok} {failed}", flush=True)
        hold(sel, conns)
    elif len(sys.argv) >= 2 and sys.argv[1] == "probe":
        probe(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
