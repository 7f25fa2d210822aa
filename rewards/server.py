"""HTTP server for one reward: ``flowrl serve-reward NAME`` (stdlib ``ThreadingHTTPServer``).

Endpoints:

- ``POST /score``: a batch in the :mod:`~flowrl.rewards.wire` format (safetensors, or JSON with
  PNG images); replies with the (B,) float32 scores in the same format. Status 400 for a
  malformed request (bad JSON, too deeply nested, an integer over 4300 digits, wrong types or
  shapes, bad base64, a Content-Length that is not a number), 401 for a missing or wrong token,
  411 without a Content-Length, 413 for a body or images over the limits (image sizes are read
  from the safetensors header or the PNG's IHDR before anything is decoded), 503 while the
  server shuts down, 500 only when the reward itself raises (even KeyboardInterrupt) or breaks
  the contract (the JSON error names the reward). Every error body is ``{"error": "one line"}``,
  also for the faults the stdlib's parser finds (501 unknown method, 400 garbage request line,
  431 header line over 64 KiB); a HEAD request gets the headers only.
- ``GET /health``: ``{"status": "ok", "reward": NAME}`` (never needs the token; HEAD too).
- ``GET /info``: name, ``allows_nan``, wire formats and versions, requests served.

The server binds to 127.0.0.1 unless told otherwise; any non-loopback address needs a token,
which clients send as ``Authorization: Bearer TOKEN``. Batches are scored one at a time (the
reward may hold a GPU); health and info answer while a batch is being scored.

Shutting down (:meth:`RewardServer.stop`, which ``flowrl serve-reward`` calls on SIGINT or SIGTERM)
stops accepting connections, answers 503 to requests that have not started scoring, waits for the
batch being scored (at most ``SHUTDOWN_GRACE_S``), then closes every connection and joins every
handler thread. The interpreter therefore never exits while a handler thread runs torch code: at
exit, Python ends daemon threads with a forced unwind, which aborts the process
("terminate called without an active exception") when it crosses torch's C++ frames.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from .contract import RewardError, RewardFn, check_images, reward_allows_nan, score_reward
from .wire import (
    JSON,
    SAFETENSORS,
    WIRE_VERSION,
    PixelLimits,
    TooLarge,
    WireError,
    check_batch_metadata,
    decode_batch,
    decode_batch_png,
    encode_scores,
    encode_scores_json,
)

if TYPE_CHECKING:
    from torch import Tensor

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
TOKEN_ENV = "FLOWRL_REWARD_TOKEN"
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096  # per image or frame (height x width)
DEFAULT_MAX_REQUEST_PIXELS = 8192 * 8192  # per request: 768 MiB as float32 RGB
SHUTDOWN_GRACE_S = 30.0  # how long stop() waits for the batch being scored


class ShuttingDown(Exception):
    """The server stopped taking work; the request is answered 503."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1 or "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_token(token: str | None, where: str = f"the token (--token or {TOKEN_ENV})") -> None:
    """Refuse a bearer token that no HTTP client can send, in one line that never shows the token.

    A token must be visible ASCII (``!`` to ``~``): HTTP headers cannot carry other characters (``café``),
    and whitespace or a control character (often a trailing newline read from a file) is refused or cut on
    the way, so every request would get 401.

    Args:
        token: the bearer token; None or "" means no token and passes.
        where: where the token came from, starting the message.

    Raises:
        TypeError: ``token`` is not a string.
        ValueError: the token is blank, or has a character that is not visible ASCII (the message names its
            kind and position, never the token).
    """
    if token is None:
        return
    if not isinstance(token, str):
        raise TypeError(f"{where} must be a string (quote it in YAML); got {type(token).__name__}")
    if token and not token.strip():  # "  " would be a guessable secret
        raise ValueError(f"{where} is blank; pass a secret string, or leave it unset")
    for i, char in enumerate(token):
        if not "!" <= char <= "~":
            kind = "a space or control character" if char.isascii() else "a non-ASCII character"
            raise ValueError(
                f"{where} has {kind} at position {i + 1}; HTTP headers carry only visible ASCII: strip it (e.g. a "
                "trailing newline read from a file) or make a new one with "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )


def check_bind(host: str, token: str | None) -> None:
    """Refuse a token no client can send, and refuse to expose a reward beyond this machine without a token.

    Raises:
        ValueError: the token is blank or not printable ASCII without spaces (:func:`check_token`), or
            ``host`` is not a loopback address and no token is set.
    """
    check_token(token)
    if not is_loopback(host) and not token:
        raise ValueError(
            f"binding the reward server to {host} exposes it to the network; pass --token "
            f"(or set {TOKEN_ENV}) so requests without it are rejected, or bind to 127.0.0.1"
        )


def check_limits(max_body_mb: float, idle_exit_s: float | None) -> None:
    """Refuse a body limit or an idle exit that is not a finite number > 0 (``--max-body-mb``, ``--idle-exit``).

    Raises:
        ValueError: one line naming the flag and the value.
    """
    for flag, value in (("--max-body-mb", max_body_mb), ("--idle-exit", idle_exit_s)):
        if value is None and flag == "--idle-exit":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{flag} must be a finite number > 0; got {value!r}")


def body_length(header: str, limit: int) -> int:
    """The body size a ``Content-Length`` header declares, refused above ``limit`` without converting a huge number.

    Args:
        header: the header's value.
        limit: the largest body accepted, in bytes.

    Returns:
        The declared length, at most ``limit``.

    Raises:
        WireError: the value is not a whole number of bytes in ASCII digits (``²`` passes ``str.isdigit``).
        TooLarge: the declared length exceeds ``limit`` (also a number too long for ``int()``).
    """
    digits = header.strip()
    if not (digits.isascii() and digits.isdigit()):
        shown = digits if len(digits) <= 40 else digits[:40] + "..."
        raise WireError(f"Content-Length {shown!r} is not a whole number of bytes; send the body's length in digits")
    significant = digits.lstrip("0") or "0"
    if len(significant) > len(str(limit)) or int(significant) > limit:
        shown = significant if len(significant) <= 40 else f"a number of {len(significant)} digits"
        raise TooLarge(f"body of {shown} bytes exceeds the server's limit of {limit}; split the batch")
    return int(significant)


_STDLIB_HINTS = {
    400: "send an HTTP/1.1 request such as 'POST /score HTTP/1.1'",
    414: "the request line is over 64 KiB; send a shorter path",
    431: "send fewer headers, each line under 64 KiB",
    501: "use POST /score, GET /health or GET /info",
    505: "send HTTP/1.1",
}


def stdlib_error_line(code: int, reason: str) -> str:
    """The one-line error for a fault the stdlib's request parser found: its reason (cut to 200 chars) and a fix."""
    reason = " ".join(reason.split())
    if len(reason) > 200:
        reason = reason[:200] + "..."
    return f"{reason}; {_STDLIB_HINTS.get(code, 'use POST /score, GET /health or GET /info')}"


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number of pixels >= 1; got {value!r}")
    return value


class _HTTPServer(ThreadingHTTPServer):
    """Threading HTTP server that records each connection and its handler thread (to close and join them)."""

    daemon_threads = True
    block_on_close = False  # stop() joins the handlers itself, within a bound

    def __init__(self, address: tuple, handler: type[BaseHTTPRequestHandler], owner: "RewardServer") -> None:
        self.owner = owner
        super().__init__(address, handler)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        self.owner._track(request, add=True)
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.owner._track(request, add=False)


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class RewardServer:
    """Serve one reward over HTTP.

    Args:
        reward: the reward callable.
        name: its name (in replies and error messages).
        host: address to bind; non-loopback addresses need ``token``.
        port: TCP port; 0 picks a free one (see :attr:`url`).
        token: shared secret required as ``Authorization: Bearer TOKEN`` on /score and /info.
        max_body_mb: largest request body accepted.
        max_image_pixels: largest image (or frame) accepted, height x width, checked before decoding.
        max_request_pixels: most pixels of all images of one request, checked before decoding.
        idle_exit_s: stop serving after this many seconds without a request (None: never); a request
            counts from its request line to its reply (a slow upload is not idle time). Lets a server
            started by a job or a test end on its own.
        log: print one line per request to stderr.
    """

    def __init__(
        self,
        reward: RewardFn,
        name: str,
        *,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        token: str | None = None,
        max_body_mb: float = 1024.0,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS,
        log: bool = False,
        idle_exit_s: float | None = None,
    ) -> None:
        check_bind(host, token)
        check_limits(max_body_mb, idle_exit_s)
        if not callable(reward):
            raise TypeError(f"RewardServer needs a callable reward; got {type(reward).__name__}")
        self.reward, self.name, self.token, self.log = reward, name, token or None, log
        self.max_body = int(max_body_mb * 1024 * 1024)
        self.limits = PixelLimits(
            _positive_int("--max-image-pixels", max_image_pixels),
            _positive_int("--max-request-pixels", max_request_pixels),
        )
        self.requests = 0
        self.idle_exit_s = idle_exit_s
        self.last_request = time.monotonic()
        self.stopped_idle = False
        self.batches = 0
        self._score_lock = threading.Lock()
        self._state = threading.Condition()  # guards the fields below
        self._draining, self._in_flight = False, 0
        self._receiving = 0  # requests between their request line and their reply (for idle_exit_s)
        self._connections: dict[Any, threading.Thread] = {}
        self._thread: threading.Thread | None = None
        self._served = threading.Event()  # serve_forever ran (so httpd.shutdown() can't block)
        server_class = _HTTPServer6 if ":" in host else _HTTPServer
        self.httpd = server_class((host, port), _make_handler(self), self)

    @property
    def url(self) -> str:
        """``http://host:port`` of the bound socket."""
        host, port = self.httpd.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in str(host) else host}:{port}"

    def info(self) -> dict[str, Any]:
        """What GET /info returns."""
        from .. import __version__

        return {
            "name": self.name,
            "allows_nan": reward_allows_nan(self.reward),
            "formats": [SAFETENSORS, JSON],
            "wire": WIRE_VERSION,
            "flowrl": __version__,
            "batches_scored": self.batches,
            "auth": self.token is not None,
        }

    def score(self, body: bytes, content_type: str) -> tuple[bytes, str]:
        """Decode a request, score it, encode the reply (in the request's format).

        Raises:
            TooLarge: images over :attr:`limits` (HTTP 413).
            WireError: malformed request (HTTP 400).
            ShuttingDown: the server began to stop before this batch's turn came (HTTP 503).
            RewardError: the reward raised or broke the contract (HTTP 500).
        """
        as_json = content_type == JSON
        images, prompts, metadata = (decode_batch_png if as_json else decode_batch)(body, self.limits)
        try:
            check_images(images, video=True)
        except (TypeError, ValueError) as err:
            raise WireError(str(err)) from None
        if len(prompts) != images.shape[0]:
            raise WireError(f"got {len(prompts)} prompts for {images.shape[0]} images; send one prompt per image")
        check_batch_metadata(metadata, len(prompts))
        while not self._score_lock.acquire(timeout=0.05):  # waiting in line: give way to a shutdown
            if self._draining:
                raise ShuttingDown()
        try:
            scores = self._score_batch(images, prompts, metadata)
        finally:
            self._score_lock.release()
        allows_nan = reward_allows_nan(self.reward)
        if as_json:
            return encode_scores_json(scores, allows_nan), JSON
        return encode_scores(scores, allows_nan), SAFETENSORS

    def _score_batch(self, images: Tensor, prompts: list[str], metadata: dict[str, Any]) -> Tensor:
        """Score one decoded batch; a KeyboardInterrupt the reward raises on a handler thread is its failure.

        A real Ctrl-C raises KeyboardInterrupt only on the main thread (where the command's signal handler
        stops the server), never on a handler thread, so there it is the reward's own doing: answered 500.
        """
        try:
            scores = score_reward(self.name, self.reward, images, prompts, metadata, allow_all_nan=True)
        except KeyboardInterrupt:
            if threading.current_thread() is threading.main_thread():
                raise
            raise RewardError(
                f"reward {self.name!r} raised KeyboardInterrupt; a reward returns scores or raises an Exception"
            ) from None
        self.batches += 1
        return scores

    def serve_forever(self) -> None:
        """Serve until :meth:`stop`, Ctrl-C in the caller, or ``idle_exit_s`` without requests."""
        self._served.set()
        if self.idle_exit_s is not None:
            threading.Thread(target=self._watch_idle, name="reward-server-idle", daemon=True).start()
        self.httpd.serve_forever(poll_interval=0.1)

    def _watch_idle(self) -> None:
        while True:
            with self._state:
                idle = time.monotonic() - self.last_request
                busy = self._receiving > 0 or self._in_flight > 0
            if idle >= self.idle_exit_s and not busy:
                self.stopped_idle = True
                self.httpd.shutdown()
                return
            time.sleep(min(0.2, max(self.idle_exit_s - idle, 0.01)))

    def begin_activity(self) -> None:
        """A request line arrived: the server is not idle until :meth:`end_activity` (its reply is sent)."""
        with self._state:
            self._receiving += 1
            self.last_request = time.monotonic()

    def end_activity(self) -> None:
        """The request counted by :meth:`begin_activity` is answered (or its connection failed)."""
        with self._state:
            self._receiving -= 1
            self.last_request = time.monotonic()

    def start(self) -> "RewardServer":
        """Serve from a daemon thread; returns self."""
        self._thread = threading.Thread(target=self.serve_forever, name=f"reward-server-{self.name}", daemon=True)
        self._thread.start()
        return self

    @property
    def serving(self) -> bool:
        """Whether the server thread of :meth:`start` still accepts connections."""
        return self._thread is not None and self._thread.is_alive()

    def _track(self, connection: Any, *, add: bool) -> None:
        with self._state:
            if add:
                self._connections[connection] = threading.current_thread()
            else:
                self._connections.pop(connection, None)

    def begin_request(self) -> bool:
        """Count a request as in flight; False once the server is stopping (answer 503)."""
        with self._state:
            if self._draining:
                return False
            self._in_flight += 1
            return True

    def end_request(self) -> None:
        """The in-flight request counted by :meth:`begin_request` is answered."""
        with self._state:
            self._in_flight -= 1
            self._state.notify_all()

    def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> bool:
        """Stop cleanly: no new connections, 503 for waiting requests, in-flight batches finished, threads joined.

        Args:
            grace_s: how long to wait for the batch being scored.

        Returns:
            True when every handler thread ended; False when a reward was still scoring after ``grace_s``
            (the caller must then not run interpreter finalization: see the module docstring).
        """
        with self._state:
            self._draining = True
        if self._served.is_set():
            self.httpd.shutdown()  # the accept loop ends within its poll interval
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.httpd.server_close()  # the listening socket: new connections are refused
        with self._state:
            finished = self._state.wait_for(lambda: self._in_flight == 0, timeout=grace_s)
            open_connections = dict(self._connections)
        for connection in open_connections:  # idle keep-alive or a stalled upload: wake its thread up
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if finished:
            for thread in open_connections.values():
                thread.join(timeout=5.0)
        return finished and not any(t.is_alive() for t in open_connections.values())

    def __enter__(self) -> "RewardServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _make_handler(server: RewardServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "flowrl-reward"
        timeout = 120  # seconds a client may stall while sending (a stuck client never holds a thread for good)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            if server.log:
                sys.stderr.write(f"{self.address_string()} {format % args}\n")

        def handle_one_request(self) -> None:
            self._active = False
            try:
                super().handle_one_request()
            finally:
                if self._active:  # the reply is sent (or the connection failed): idle time counts from now
                    server.end_activity()

        def parse_request(self) -> bool:
            server.begin_activity()  # the request line arrived: --idle-exit waits until the reply is sent
            self._active = True
            return super().parse_request()

        def _send(self, status: int, body: bytes, content_type: str = JSON, *, close: bool = False) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                if close:
                    self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout): nothing to answer
                self.close_connection = True
                self.log_message("client left before the reply (%d)", status)

        def _error(self, status: int, message: str) -> None:
            self.close_connection = True
            self._send(status, json.dumps({"error": message}).encode(), close=True)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """Errors the stdlib finds (unknown method, bad request line, header line too long) as one JSON line.

            The stdlib's own ``send_error`` answers an HTML page; this keeps its status code.
            """
            reason = message or self.responses.get(code, ("error",))[0]
            self.log_error("code %d, message %s", code, reason)
            if self.request_version in ("", "HTTP/0.9"):  # garbage, not an HTTP/0.9 request: send a status line
                self.request_version = "HTTP/1.0"
            self._error(code, stdlib_error_line(code, reason))

        def _authorised(self) -> bool:
            if server.token is None:
                return True
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {server.token}".encode()):
                return True
            self._error(401, "missing or wrong token; send 'Authorization: Bearer TOKEN'")
            return False

        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            server.requests += 1
            if self.path == "/health":
                self._send(200, json.dumps({"status": "ok", "reward": server.name}).encode())
            elif self.path == "/info":
                if self._authorised():
                    self._send(200, json.dumps(server.info()).encode())
            else:
                self._error(404, f"no endpoint {self.path}; use POST /score, GET /health or GET /info")

        do_HEAD = do_GET  # noqa: N815 - stdlib name; the same status and headers, no body (see _send)

        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            server.requests += 1
            if self.path != "/score":
                self._error(404, f"no endpoint {self.path}; POST batches to /score")
                return
            if not self._authorised():
                return
            body = self._body()
            if body is None:
                return
            content_type = self.headers.get("Content-Type", SAFETENSORS).split(";")[0].strip().lower()
            if content_type not in (SAFETENSORS, JSON):
                self._error(400, f"Content-Type {content_type!r} not supported; send {SAFETENSORS} or {JSON}")
                return
            if not server.begin_request():
                self._error(503, "the reward server is shutting down; retry on another server")
                return
            try:
                self._score(body, content_type)
            finally:
                server.end_request()

        def _score(self, body: bytes, content_type: str) -> None:
            try:
                reply, reply_type = server.score(body, content_type)
            except TooLarge as err:
                self._error(413, f"request too large for reward {server.name!r}: {err}")
            except WireError as err:
                self._error(400, f"bad request for reward {server.name!r}: {err}")
            except ShuttingDown:
                self._error(503, "the reward server is shutting down; retry on another server")
            except RewardError as err:
                self._error(500, str(err).splitlines()[0])
            except Exception as err:  # noqa: BLE001 - the server must answer, whatever the reward does
                self._error(
                    500,
                    f"reward {server.name!r} failed: {type(err).__name__}: "
                    f"{str(err).splitlines()[0] if str(err) else ''}",
                )
            else:
                self._send(200, reply, reply_type)

        def _body(self) -> bytes | None:
            header = self.headers.get("Content-Length")
            if header is None:
                self._error(411, "send the request body with a Content-Length header")
                return None
            try:
                length = body_length(header, server.max_body)
            except TooLarge as err:
                self._error(413, str(err))
                return None
            except WireError as err:
                self._error(400, f"bad request for reward {server.name!r}: {err}")
                return None
            return self.rfile.read(length)

    return Handler
