#!/usr/bin/env python3
"""An OpenAI-compatible chat completions upstream for tollgate's end-to-end tests.

The tests run it behind tollgate and drive it with ai_client.py (the real `openai` package).
What it answers is scripted by the request itself: the content of the LAST user message is a
JSON object, e.g. {"prompt_tokens": 120, "completion_tokens": 300, "mode": "ok"}. Fields:

    prompt_tokens       int, default 10
    completion_tokens   int, default min(max_tokens or max_completion_tokens, 50)
    mode                ok (default) | no_usage | status_500 | malformed | big | awkward | slow
    delay_ms            sleep before the response head (default 0)
    gap_ms              stream: sleep before each content event (default 5)
    chunks              stream: number of content events (default ceil(completion/10) in 1..20)
    slow_chunks/slow_ms mode slow: that many content events that far apart (defaults 20, 100);
                        without "stream" the JSON body is trickled in slow_chunks pieces instead
    chunk_gap_ms        mode awkward: sleep after each 1..7-byte chunk (default 1)
    big_bytes           mode big: size of the message content (default 10_000_000)
    seed                mode awkward: seed of the chunk sizes (default 0)

Modes: no_usage leaves out `usage` (also the final usage event of a stream); status_500 answers
HTTP 500 with an OpenAI error body that still carries usage (also when streaming); malformed
answers 200 application/json with broken JSON that holds `"usage": {"total_tokens": N, ...`
partway (streaming: a role event, then an event whose data is that broken JSON); big has
~10 MB of content with usage at the very end; awkward writes the (valid) answer with chunked
transfer encoding in 1..7-byte chunks and puts escapes (\\" \\\\ \\u00e9 \\n, a surrogate pair)
in the content. With "stream": true the answer is server-sent events (one role event, content
events, a finish event, a usage event with "choices": [] if stream_options.include_usage, then
[DONE]), each event written and flushed on its own.

Every answered request appends one JSON line to --log:
    {"t": arrival unix time, "t_end": ..., "mode", "stream", "max_tokens", "prompt_tokens",
     "completion_tokens", "total_tokens", "finished"}
finished is false when the client went away before the whole response was written.

    ai_upstream.py --port 0 --log FILE       (prints "listening <port>", serves until killed)
"""
import argparse
import json
import math
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("ok", "no_usage", "status_500", "malformed", "big", "awkward", "slow")
MODEL = "test-model"
AWKWARD_PHRASE = 'quote " backslash \\ caf\u00e9 tab\tnewline\nemoji \U0001F600 slash / '


class ClientGone(Exception):
    """The client closed the connection while the response was being written."""


def control_of(request):
    """The JSON object in the last user message's content ({} if there is none)."""
    for message in reversed(request.get("messages") or []):
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, list):  # content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        try:
            control = json.loads(content)
        except (TypeError, ValueError):
            return {}
        return control if isinstance(control, dict) else {}
    return {}


def completion_text(tokens, awkward):
    words = ["w%d" % i for i in range(tokens)]
    return (AWKWARD_PHRASE if awkward else "") + " ".join(words)


def split_even(text, parts):
    """text cut in `parts` pieces of about the same length (never empty unless text is)."""
    parts = max(1, min(parts, len(text) or 1))
    size = math.ceil(len(text) / parts) if text else 0
    return [text[i * size:(i + 1) * size] for i in range(parts)] if size else [""]


class Plan:
    """What one request asked for."""

    def __init__(self, request):
        control = control_of(request)
        self.mode = control.get("mode", "ok")
        if self.mode not in MODES:
            raise ValueError("unknown mode %r" % self.mode)
        self.stream = request.get("stream") is True
        self.include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        mt = request.get("max_tokens")
        self.max_tokens = mt if mt is not None else request.get("max_completion_tokens")
        self.prompt_tokens = int(control.get("prompt_tokens", 10))
        default_completion = min(self.max_tokens, 50) if self.max_tokens is not None else 50
        self.completion_tokens = int(control.get("completion_tokens", default_completion))
        self.total_tokens = self.prompt_tokens + self.completion_tokens
        self.delay = control.get("delay_ms", 0) / 1000
        self.gap = control.get("gap_ms", 5) / 1000
        self.chunks = int(control.get("chunks", min(max(math.ceil(self.completion_tokens / 10), 1), 20)))
        self.slow_chunks = int(control.get("slow_chunks", 20))
        self.slow_gap = control.get("slow_ms", 100) / 1000
        self.chunk_gap = control.get("chunk_gap_ms", 1) / 1000
        self.big_bytes = int(control.get("big_bytes", 10_000_000))
        self.rng = random.Random(control.get("seed", 0))
        self.id = "chatcmpl-%016x" % random.getrandbits(64)
        self.created = int(time.time())
        self.finish_reason = (
            "length" if self.max_tokens is not None and self.completion_tokens >= self.max_tokens else "stop"
        )

    def usage(self):
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }

    def content(self):
        if self.mode == "big":
            line = "lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.\n"
            return (line * (self.big_bytes // len(line) + 1))[: self.big_bytes]
        return completion_text(self.completion_tokens, self.mode == "awkward")

    def completion(self):
        """The non-stream chat.completion object (usage, if any, placed after choices)."""
        body = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": MODEL,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": self.content(), "refusal": None},
                    "logprobs": None,
                    "finish_reason": self.finish_reason,
                }
            ],
        }
        if self.mode != "no_usage":
            body["usage"] = self.usage()
        return body

    def chunk(self, choices, **extra):
        event = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": MODEL,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.include_usage:
            event["usage"] = None
        event.update(extra)
        return event

    def delta(self, delta, finish_reason=None):
        return self.chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])

    def malformed_json(self):
        """Broken JSON (an unterminated string) that holds the usage partway."""
        u = self.usage()
        return (
            '{"id": "%s", "object": "%s", "created": %d, "model": "%s", '
            '"usage": {"total_tokens": %d, "prompt_tokens": %d, "completion_tokens": %d}, '
            '"choices": [{"index": 0, "message": {"role": "assistant", "content": "unterminated, }}]'
            % (
                self.id,
                "chat.completion.chunk" if self.stream else "chat.completion",
                self.created,
                MODEL,
                u["total_tokens"],
                u["prompt_tokens"],
                u["completion_tokens"],
            )
        )

    def events(self):
        """(sleep before, event payload) pairs of the SSE stream, [DONE] included."""
        if self.mode == "malformed":  # a role event, then an event whose data is broken JSON
            yield 0, self.delta({"role": "assistant", "content": "", "refusal": None})
            yield self.gap, self.malformed_json()
            yield 0, "[DONE]"
            return
        if self.mode == "slow":
            pieces, gap = split_even(self.content(), self.slow_chunks), self.slow_gap
        else:
            pieces, gap = split_even(self.content(), self.chunks), self.gap
        yield 0, self.delta({"role": "assistant", "content": "", "refusal": None})
        for piece in pieces:
            yield gap, self.delta({"content": piece})
        yield 0, self.delta({}, self.finish_reason)
        if self.include_usage and self.mode != "no_usage":
            yield 0, self.chunk([], usage=self.usage())
        yield 0, "[DONE]"


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024

    def __init__(self, address, log_path):
        super().__init__(address, Handler)
        self.log_file = open(log_path, "a", encoding="utf-8")
        self.log_lock = threading.Lock()

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client hanging up an idle keep-alive connection is not news
        super().handle_error(request, client_address)

    def log_request_line(self, record):
        line = json.dumps(record) + "\n"
        with self.log_lock:
            self.log_file.write(line)
            self.log_file.flush()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # small flushed writes must leave at once
    server_version = "ai-upstream/1"

    def log_message(self, format, *args):  # no per-request noise on stderr
        pass

    # ---- plumbing -------------------------------------------------------------------------

    def read_body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return body
                body += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def write(self, data):
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError as e:  # BrokenPipe, ConnectionReset, ...
            self.close_connection = True
            raise ClientGone() from e

    def head(self, status, content_type, length=None):
        """Status line and headers; chunked transfer encoding when length is None."""
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            if length is None:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(length))
            if content_type.startswith("text/event-stream"):
                self.send_header("Cache-Control", "no-cache")
            self.send_header("x-request-id", "req-%016x" % random.getrandbits(64))
            self.end_headers()
        except OSError as e:
            self.close_connection = True
            raise ClientGone() from e

    def write_chunk(self, data):
        if data:
            self.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_chunks(self):
        self.write(b"0\r\n\r\n")

    def simple(self, status, body, content_type="application/json"):
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        data = body.encode() if isinstance(body, str) else body
        self.head(status, content_type, len(data))
        self.write(data)

    # ---- routes ---------------------------------------------------------------------------

    def do_GET(self):
        try:
            if self.path.split("?")[0] == "/health":
                self.simple(200, "ok", "text/plain")
            else:
                self.simple(404, {"error": {"message": "not found", "type": "invalid_request_error"}})
        except ClientGone:
            pass

    def do_POST(self):
        body = self.read_body()
        try:
            if self.path.split("?")[0] != "/v1/chat/completions":
                self.simple(404, {"error": {"message": "not found", "type": "invalid_request_error"}})
                return
            try:
                plan = Plan(json.loads(body))
            except (ValueError, TypeError, AttributeError) as e:
                self.simple(400, {"error": {"message": "bad request: %s" % e, "type": "invalid_request_error"}})
                return
        except ClientGone:
            return
        started = time.time()
        finished = False
        try:
            if plan.delay:
                time.sleep(plan.delay)
            if plan.stream and plan.mode != "status_500":
                self.answer_stream(plan)
            else:
                self.answer_plain(plan)
            finished = True
        except ClientGone:
            pass
        finally:
            self.server.log_request_line(
                {
                    "t": started,
                    "t_end": time.time(),
                    "mode": plan.mode,
                    "stream": plan.stream,
                    "max_tokens": plan.max_tokens,
                    "prompt_tokens": plan.prompt_tokens,
                    "completion_tokens": plan.completion_tokens,
                    "total_tokens": plan.total_tokens,
                    "finished": finished,
                }
            )

    def answer_plain(self, plan):
        if plan.mode == "status_500":
            self.simple(
                500,
                {
                    "error": {
                        "message": "The server had an error while processing your request.",
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    },
                    "usage": plan.usage(),
                },
            )
        elif plan.mode == "malformed":
            self.simple(200, plan.malformed_json())
        elif plan.mode == "awkward":
            self.head(200, "application/json")
            self.write_awkward(json.dumps(plan.completion()).encode(), plan)
            self.end_chunks()
        elif plan.mode == "slow":
            data = json.dumps(plan.completion()).encode()
            self.head(200, "application/json", len(data))
            size = math.ceil(len(data) / max(plan.slow_chunks, 1))
            for i in range(0, len(data), size):
                if i:
                    time.sleep(plan.slow_gap)
                self.write(data[i:i + size])
        else:  # ok, no_usage, big
            self.simple(200, plan.completion())

    def write_awkward(self, data, plan):
        """data as chunked-encoding chunks of 1..7 bytes, each flushed on its own."""
        i = 0
        while i < len(data):
            n = plan.rng.randint(1, 7)
            self.write_chunk(data[i:i + n])
            i += n
            if plan.chunk_gap:
                time.sleep(plan.chunk_gap)

    def answer_stream(self, plan):
        self.head(200, "text/event-stream; charset=utf-8")
        for pause, event in plan.events():
            if pause:
                time.sleep(pause)
            payload = event if isinstance(event, str) else json.dumps(event)
            data = ("data: %s\n\n" % payload).encode()
            if plan.mode == "awkward":
                self.write_awkward(data, plan)
            else:
                self.write_chunk(data)
        self.end_chunks()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--log", required=True, help="JSON lines, one per answered request")
    args = p.parse_args()

    server = Server(("127.0.0.1", args.port), args.log)
    print("listening %d" % server.server_address[1], flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
