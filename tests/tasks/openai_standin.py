"""A deterministic local stand-in for an OpenAI-compatible server, for the task generators' tests.

`OpenAIStandin` serves `POST /v1/chat/completions` and `POST /v1/responses` on 127.0.0.1 (ephemeral
port) from a thread, with structured outputs:

- answers are scripted: `answers` is a queue (each item a dict, sent as its JSON, a raw string, or a
  function of the request body); when it is empty `responder(body)` answers; with neither the request
  gets a 400 that says so;
- every request is recorded (`requests`: path, headers, parsed JSON body);
- usage is reported: prompt tokens = words in the messages, completion tokens = words in the answer;
- `fail_next(status, times)` answers the next requests with that status (429, 500, 401, ...) before
  answering normally; the error message echoes the Authorization header, as some servers do;
- `max_in_flight` is the most requests it has held at once; `hold()` keeps every request waiting until
  `release()`, so a test can see how many a client sends at once without timing anything.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = dict[str, Any] | str | Callable[[dict[str, Any]], "dict[str, Any] | str"]


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]  # lower-case names
    body: dict[str, Any]


def words(text: str) -> int:
    return len(text.split())


def messages_of(body: dict[str, Any]) -> list[dict[str, str]]:
    """(role, content) of a request of either API, system first."""
    if "messages" in body:
        return [{"role": m["role"], "content": m["content"]} for m in body["messages"]]
    out = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    items = body.get("input")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    return out + [{"role": m["role"], "content": m["content"]} for m in items or []]


def schema_of(body: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema a request asks for (either API)."""
    if "response_format" in body:
        return body["response_format"]["json_schema"]["schema"]
    return body["text"]["format"]["schema"]


class OpenAIStandin:
    """Use as a context manager; `base_url` ends in /v1."""

    def __init__(self, responder: Callable[[dict[str, Any]], dict[str, Any] | str] | None = None) -> None:
        self.answers: deque[Answer] = deque()
        self.responder = responder
        self.requests: list[Recorded] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._failures: deque[tuple[int, float | None]] = deque()
        self._lock = threading.Lock()
        self._gate = threading.Event()
        self._gate.set()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="openai-standin", daemon=True)

    # ---- control

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def start(self) -> OpenAIStandin:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._gate.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> OpenAIStandin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def script(self, *answers: Answer) -> None:
        self.answers.extend(answers)

    def fail_next(self, status: int, times: int = 1, retry_after: float | None = None) -> None:
        """Answer the next `times` requests with `status` (an OpenAI-style error body)."""
        self._failures.extend([(status, retry_after)] * times)

    def hold(self) -> None:
        """Keep requests waiting (counted in flight) until `release()`."""
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def wait_in_flight(self, n: int, timeout: float = 30.0) -> bool:
        """Block until at least `n` requests are held (a bound on waiting, not a timed assertion)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.in_flight >= n:
                return True
            time.sleep(0.01)
        return False

    def reset(self) -> None:
        """Forget recorded requests, scripted answers and pending failures."""
        with self._lock:
            self.requests.clear()
            self.answers.clear()
            self._failures.clear()
            self.max_in_flight = 0

    # ---- serving

    def _answer(self, body: dict[str, Any], authorization: str) -> tuple[int, dict[str, Any], dict[str, str]]:
        with self._lock:
            failure = self._failures.popleft() if self._failures else None
            scripted = self.answers.popleft() if self.answers and failure is None else None
        if failure is not None:
            status, retry_after = failure
            kind = "rate_limit_exceeded" if status == 429 else "server_error" if status >= 500 else "invalid_request"
            headers = {"retry-after": str(retry_after)} if retry_after is not None else {}
            # Echo the credentials, as some servers do, so tests can check that errors redact them.
            message = f"stand-in {status} (you sent {authorization!r})"
            return status, {"error": {"message": message, "type": kind, "code": kind}}, headers
        if scripted is None and self.responder is None:
            return 400, {"error": {"message": "stand-in: no scripted answer left", "type": "invalid_request"}}, {}
        answer = scripted if scripted is not None else self.responder
        if callable(answer):
            answer = answer(body)
        text = answer if isinstance(answer, str) else json.dumps(answer)
        prompt = sum(words(m["content"]) for m in messages_of(body))
        completion = words(text)
        model = body.get("model", "")
        if "messages" in body:
            return 200, _chat_completion(model, text, prompt, completion), {}
        return 200, _response(model, text, prompt, completion), {}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw or b"{}")
                except json.JSONDecodeError:
                    self._send(400, {"error": {"message": "body is not JSON"}}, {})
                    return
                with standin._lock:
                    standin.requests.append(Recorded(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    standin.in_flight += 1
                    standin.max_in_flight = max(standin.max_in_flight, standin.in_flight)
                try:
                    standin._gate.wait()
                    if self.path not in ("/v1/chat/completions", "/v1/responses"):
                        self._send(404, {"error": {"message": f"no route {self.path}"}}, {})
                        return
                    self._send(*standin._answer(body, self.headers.get("authorization", "")))
                finally:
                    with standin._lock:
                        standin.in_flight -= 1

            def _send(self, status: int, payload: dict[str, Any], headers: dict[str, str]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        return Handler


def _chat_completion(model: str, text: str, prompt: int, completion: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-standin",
        "object": "chat.completion",
        "created": 1795000000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }


def _response(model: str, text: str, prompt: int, completion: int) -> dict[str, Any]:
    return {
        "id": "resp-standin",
        "object": "response",
        "created_at": 1795000000,
        "model": model,
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": "msg-standin",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "usage": {
            "input_tokens": prompt,
            "output_tokens": completion,
            "total_tokens": prompt + completion,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }
