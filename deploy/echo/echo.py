"""The sample upstream of docker-compose.yml: answers every request with 200 and the request as
JSON (method, path, query, headers, body, the answering host), like an echo server. Python's
standard library only; HTTP/1.1 with keep-alive. Listens on $HTTP_PORT (default 8080)."""
import json
import os
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "tollgate-echo"

    def body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def answer(self):
        url = urlsplit(self.path)
        out = json.dumps({
            "method": self.command,
            "path": url.path,
            "query": url.query,
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body": self.body().decode("utf-8", "replace"),
            "hostname": socket.gethostname(),
            "ip": self.client_address[0],
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(out)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_HEAD = answer

    def log_message(self, *args):
        pass  # one line per request would drown the compose logs


if __name__ == "__main__":
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("0.0.0.0", int(os.environ.get("HTTP_PORT", "8080"))), Echo).serve_forever()
