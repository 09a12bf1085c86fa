#!/usr/bin/env python3
"""A real OTLP/HTTP (protobuf) traces receiver for the tests and the benchmark.

POST /v1/traces bodies are decoded as ExportTraceServiceRequest with the PyPI package
`opentelemetry-proto`; each span becomes one JSON line in --out (ids as lowercase hex,
attributes as a plain object). With --discard the body is read and thrown away (a cheap sink
for bench/run). The port it listens on is written to --port-file once it accepts connections.

    otlp_receiver.py --port-file PATH [--out SPANS.jsonl | --discard]
"""
import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


def value_of(v):
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [value_of(x) for x in v.array_value.values]
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind)


def spans_of(req):
    for rs in req.resource_spans:
        resource = {a.key: value_of(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                yield {
                    "service_name": resource.get("service.name"),
                    "scope": ss.scope.name,
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex(),
                    "name": s.name,
                    "kind": s.kind,
                    "start_ns": s.start_time_unix_nano,
                    "end_ns": s.end_time_unix_nano,
                    "status_code": s.status.code,
                    "status_message": s.status.message,
                    "attributes": {a.key: value_of(a.value) for a in s.attributes},
                    "events": [e.name for e in s.events],
                }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port-file", required=True)
    p.add_argument("--out")
    p.add_argument("--discard", action="store_true")
    args = p.parse_args()
    if not args.discard and not args.out:
        p.error("--out or --discard")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if not args.discard:
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                req = trace_service_pb2.ExportTraceServiceRequest()
                req.ParseFromString(body)
                with open(args.out, "a") as f:
                    for s in spans_of(req):
                        s["authorization"] = self.headers.get("Authorization")
                        f.write(json.dumps(s) + "\n")
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(srv.server_address[1]))
    os.replace(tmp, args.port_file)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
