#!/usr/bin/env python3
"""The real `openai` package as a client of tollgate, for the end-to-end tests.

Requests go to ai_upstream.py (through tollgate); the user message of every request is the JSON
object that scripts the upstream's answer (see ai_upstream.py). Prints one JSON line per request,
then a final line {"summary": {...}}. API errors are data: the exit code is 0 unless the
arguments are wrong.

    ai_client.py --base-url URL --api-key KEY load --clients 50 --seconds 70 --seed 1 [--stream]
        [--min-max-tokens 20] [--max-max-tokens 400] [--min-completion 10]
        [--prompt-tokens-range 10,100] [--extra JSON]
    ai_client.py --base-url URL --api-key KEY ttfb --requests 30 [--stream]   (always streams)
    ai_client.py --base-url URL --api-key KEY one --content JSON [--stream] [--max-tokens N]
        [--abort-after-chunks K]

Per-request lines: load {"t_start", "t_end", "status", "max_tokens", "prompt_tokens",
"completion_tokens", "usage", "retry_after", "error"}; ttfb {"i", "status", "ttfb", "total",
"chunks", "usage", "retry_after", "error"}; one {"status", "chunks", "bytes", "usage", "content_len",
"content" (when at most 4096 characters), "finish_reason", "aborted", "retry_after",
"error_class", "error", "error_body", "error_raw" (the first 4096 characters of an error
answer's body)}. status is null when no HTTP answer came (connection error).
"""
import argparse
import json
import math
import random
import statistics
import sys
import threading
import time

import openai

MODEL = "test"
CONTENT_ECHO_LIMIT = 4096


class Emitter:
    """Prints one JSON object per line; safe to share between threads."""

    def __init__(self):
        self.lock = threading.Lock()

    def emit(self, obj):
        line = json.dumps(obj)
        with self.lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()


def usage_dict(usage):
    return usage.model_dump(exclude_none=True) if usage is not None else None


def error_fields(e):
    """status, retry_after and a description of an exception raised by a request."""
    status = e.status_code if isinstance(e, openai.APIStatusError) else None
    retry_after = e.response.headers.get("retry-after") if isinstance(e, openai.APIStatusError) else None
    return status, retry_after, "%s: %s" % (type(e).__name__, e)


def stream_params(stream):
    return {"stream": True, "stream_options": {"include_usage": True}} if stream else {}


def messages_for(content):
    return [{"role": "user", "content": content if isinstance(content, str) else json.dumps(content)}]


def percentile(values, q):
    """Nearest-rank percentile of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


# ---- load ---------------------------------------------------------------------------------


def load_call(client, rng, args):
    mt = rng.randint(args.min_max_tokens, args.max_max_tokens)
    completion = rng.randint(min(args.min_completion, mt), mt)
    prompt = rng.randint(*args.prompt_tokens_range)
    content = dict(args.extra, prompt_tokens=prompt, completion_tokens=completion)
    record = {
        "t_start": time.time(),
        "t_end": None,
        "status": None,
        "max_tokens": mt,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "usage": None,
        "retry_after": None,
        "ratelimit": None,
        "error": None,
    }
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages_for(content), max_tokens=mt, **stream_params(args.stream)
        )
        # The gateway's `RateLimit` field says which window decided the request (its `t`).
        record["ratelimit"] = raw.headers.get("ratelimit")
        result = parse_once_safely(raw)
        record["status"] = 200
        if args.stream:
            for chunk in result:
                if chunk.usage is not None:
                    record["usage"] = usage_dict(chunk.usage)
        else:
            record["usage"] = usage_dict(result.usage)
    except Exception as e:  # API errors and broken streams are data
        status, retry_after, error = error_fields(e)
        record["status"] = status if status is not None else record["status"]
        record["retry_after"] = retry_after
        record["error"] = error
    record["t_end"] = time.time()
    return record


def run_load(client, args, out):
    deadline = time.monotonic() + args.seconds
    records = []
    records_lock = threading.Lock()

    def worker(index):
        rng = random.Random(args.seed * 100_003 + index)
        while time.monotonic() < deadline:
            record = load_call(client, rng, args)
            out.emit(record)
            with records_lock:
                records.append(record)
            if record["status"] != 200 or record["error"]:
                lo, hi = args.sleep_after_failure_ms
                time.sleep(rng.uniform(lo, hi) / 1000.0)  # use the budget promptly, don't hammer

    started = time.time()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    by_status = {}
    for r in records:
        key = "null" if r["status"] is None else str(r["status"])
        by_status[key] = by_status.get(key, 0) + 1
    ok = [r for r in records if r["status"] == 200 and not r["error"]]
    with_usage = [r for r in ok if r["usage"]]
    return {
        "scenario": "load",
        "clients": args.clients,
        "seconds": args.seconds,
        "stream": args.stream,
        "elapsed": time.time() - started,
        "requests": len(records),
        "by_status": by_status,
        "ok": len(ok),
        "ok_without_usage": len(ok) - len(with_usage),
        "errors": sum(1 for r in records if r["error"]),
        "ok_prompt_tokens": sum(r["usage"].get("prompt_tokens", 0) for r in with_usage),
        "ok_completion_tokens": sum(r["usage"].get("completion_tokens", 0) for r in with_usage),
        "ok_total_tokens": sum(r["usage"].get("total_tokens", 0) for r in with_usage),
        "ok_max_tokens": sum(r["max_tokens"] for r in ok),
    }


# ---- ttfb ---------------------------------------------------------------------------------


def run_ttfb(client, args, out):
    content = {"mode": "ok", "gap_ms": 20, "prompt_tokens": 10, "completion_tokens": 30}
    ttfbs, totals, by_status = [], [], {}
    for i in range(args.requests):
        record = {"i": i, "status": None, "ttfb": None, "total": None, "chunks": 0, "usage": None, "retry_after": None, "error": None}
        start = time.monotonic()
        try:
            stream = client.chat.completions.create(
                model=MODEL, messages=messages_for(content), max_tokens=30, **stream_params(True)
            )
            record["status"] = 200
            for chunk in stream:
                if record["chunks"] == 0:
                    record["ttfb"] = time.monotonic() - start
                record["chunks"] += 1
                if chunk.usage is not None:
                    record["usage"] = usage_dict(chunk.usage)
            record["total"] = time.monotonic() - start
        except Exception as e:
            status, record["retry_after"], record["error"] = error_fields(e)
            record["status"] = status if status is not None else record["status"]
        out.emit(record)
        key = "null" if record["status"] is None else str(record["status"])
        by_status[key] = by_status.get(key, 0) + 1
        if record["ttfb"] is not None and not record["error"]:
            ttfbs.append(record["ttfb"])
            totals.append(record["total"])
    return {
        "scenario": "ttfb",
        "requests": args.requests,
        "by_status": by_status,
        "measured": len(ttfbs),
        "ttfb_median": statistics.median(ttfbs) if ttfbs else None,
        "ttfb_p90": percentile(ttfbs, 0.9) if ttfbs else None,
        "ttfb_max": max(ttfbs) if ttfbs else None,
        "total_median": statistics.median(totals) if totals else None,
    }


# ---- one ----------------------------------------------------------------------------------


def run_one(client, args, out):
    params = dict(model=MODEL, messages=messages_for(args.content), **stream_params(args.stream))
    if args.max_tokens is not None:
        params["max_tokens"] = args.max_tokens
    limit = args.abort_after_chunks
    record = {
        "status": None,
        "chunks": 0,
        "bytes": None,
        "usage": None,
        "content_len": None,
        "finish_reason": None,
        "aborted": False,
        "retry_after": None,
        "error_class": None,
        "error": None,
        "error_body": None,
    }
    pieces = []
    try:
        if args.stream:
            raw = client.chat.completions.with_raw_response.create(**params)
            record["status"] = raw.status_code
            stream = raw.parse()
            try:
                for chunk in stream:
                    record["chunks"] += 1
                    if chunk.usage is not None:
                        record["usage"] = usage_dict(chunk.usage)
                    for choice in chunk.choices:
                        pieces.append(choice.delta.content or "")
                        record["finish_reason"] = choice.finish_reason or record["finish_reason"]
                    if limit is not None and record["chunks"] >= limit:
                        record["aborted"] = True
                        break
            finally:
                stream.close()
        elif limit is not None:
            # Read the body as it arrives: `limit` network chunks, then hang up.
            with client.chat.completions.with_streaming_response.create(**params) as response:
                record["status"] = response.status_code
                record["bytes"] = 0
                for data in response.iter_bytes():
                    record["chunks"] += 1
                    record["bytes"] += len(data)
                    if record["chunks"] >= limit:
                        record["aborted"] = True
                        break
                response.close()
        else:
            raw = client.chat.completions.with_raw_response.create(**params)
            record["status"] = raw.status_code
            record["bytes"] = len(raw.content)
            record["chunks"] = 1
            completion = raw.parse()  # raises on a body that is not JSON
            record["usage"] = usage_dict(completion.usage)
            for choice in completion.choices:
                pieces.append(choice.message.content or "")
                record["finish_reason"] = choice.finish_reason
    except Exception as e:
        status, record["retry_after"], record["error"] = error_fields(e)
        record["status"] = status if status is not None else record["status"]
        record["error_class"] = type(e).__name__
        record["error_body"] = getattr(e, "body", None)
        if isinstance(e, openai.APIStatusError):
            record["error_raw"] = e.response.text[:CONTENT_ECHO_LIMIT]
    if pieces or record["finish_reason"]:
        content = "".join(pieces)
        record["content_len"] = len(content)
        if len(content) <= CONTENT_ECHO_LIMIT:
            record["content"] = content
    out.emit(record)
    return dict({"scenario": "one", "requests": 1}, **record)


# ---- main ---------------------------------------------------------------------------------


def int_range(text):
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("expected LOW,HIGH")
    if low > high:
        raise argparse.ArgumentTypeError("LOW must not exceed HIGH")
    return low, high


def json_object(text):
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError("not JSON: %s" % e)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:PORT/v1")
    p.add_argument("--api-key", required=True)
    p.add_argument("--timeout", type=float, default=30.0)
    sub = p.add_subparsers(dest="scenario", required=True)

    load = sub.add_parser("load", help="concurrent clients until a deadline")
    load.add_argument("--clients", type=int, default=50)
    load.add_argument("--seconds", type=float, default=70.0)
    load.add_argument("--seed", type=int, default=1)
    load.add_argument("--stream", action="store_true")
    load.add_argument("--min-max-tokens", type=int, default=20)
    load.add_argument("--max-max-tokens", type=int, default=400)
    load.add_argument("--min-completion", type=int, default=10)
    load.add_argument("--prompt-tokens-range", type=int_range, default=(10, 100), metavar="LOW,HIGH")
    load.add_argument("--sleep-after-failure-ms", type=int_range, default=(20, 80), metavar="LOW,HIGH")
    load.add_argument("--extra", type=json_object, default={}, help="more fields for the upstream, e.g. delay_ms")

    ttfb = sub.add_parser("ttfb", help="sequential streamed requests, time to first chunk")
    ttfb.add_argument("--requests", type=int, default=30)
    ttfb.add_argument("--stream", action="store_true", help="accepted; ttfb always streams")

    one = sub.add_parser("one", help="a single request")
    one.add_argument("--content", type=json_object, required=True, help="the user message (upstream script)")
    one.add_argument("--stream", action="store_true")
    one.add_argument("--max-tokens", type=int)
    one.add_argument("--abort-after-chunks", type=int, metavar="K")

    args = p.parse_args()
    if args.scenario == "load" and not 1 <= args.min_max_tokens <= args.max_max_tokens:
        p.error("need 1 <= --min-max-tokens <= --max-max-tokens")
    if args.scenario == "one" and args.abort_after_chunks is not None and args.abort_after_chunks < 1:
        p.error("--abort-after-chunks must be at least 1")
    return args


# pydantic builds a model's validators the first time it is used, and that first use is not
# safe from several threads at once ("BaseModel cannot be instantiated directly"): the first
# parse is made under a lock, and the models are built before the workers start.
_PARSE_LOCK = threading.Lock()
_parsed_once = threading.Event()


def parse_once_safely(raw):
    if _parsed_once.is_set():
        return raw.parse()
    with _PARSE_LOCK:
        result = raw.parse()
        _parsed_once.set()
        return result


def warm_models():
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    ChatCompletion.model_validate({
        "id": "warm", "object": "chat.completion", "created": 0, "model": MODEL, "usage": usage,
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"}}],
    })
    ChatCompletionChunk.model_validate({
        "id": "warm", "object": "chat.completion.chunk", "created": 0, "model": MODEL, "usage": usage,
        "choices": [{"index": 0, "finish_reason": None, "delta": {"role": "assistant", "content": "x"}}],
    })


def main():
    args = parse_args()
    warm_models()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=args.timeout)
    out = Emitter()
    run = {"load": run_load, "ttfb": run_ttfb, "one": run_one}[args.scenario]
    summary = run(client, args, out)
    out.emit({"summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
