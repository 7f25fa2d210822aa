"""Client for rewards served by ``flowrl serve-reward``: ``remote:http://host:port`` in configs.

A config names a served reward either by its URL or with a label::

    rewards:
      "remote:http://127.0.0.1:8765": {weight: 1.0, timeout_s: 60, retries: 3, batch_size: 16}
      judge: {reward: remote, url: "http://10.0.0.5:8765", weight: 0.5}   # token from FLOWRL_REWARD_TOKEN

Each call splits the batch into requests of at most ``batch_size`` images. ``timeout_s`` is the
deadline of one HTTP attempt *as a whole* (connect, upload, the server's scoring, the whole reply),
not of each socket read: a server that trickles a byte every few seconds is cut off at the
deadline. A request that fails (connection refused, deadline passed, HTTP 502/503/504, a reply that
is not a score tensor, the wrong number of scores) is retried ``retries`` times, each attempt with a
fresh deadline of ``timeout_s``, after an exponential backoff ``backoff_s * 2**attempt`` (capped at
30 s); a 4xx or a 500 (the reward itself failed: deterministic) is not retried. So one request
ends within ``(retries + 1) * timeout_s`` plus the backoffs. When the retries are spent the call
raises :class:`RemoteRewardError` with one line naming the server, the request and the cause; the
trainer adds the reward name and the batch index. The url and the token are checked when the reward
is built (:func:`check_url`, :func:`~flowrl.rewards.server.check_token`); no message ever shows the token or a password.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import threading
import time
from typing import Any, Sequence
from urllib.parse import SplitResult, urlsplit

import torch
from torch import Tensor

from .contract import check_images
from .server import TOKEN_ENV, check_token
from .wire import JSON, SAFETENSORS, WireError, decode_scores, decode_scores_json, encode_batch, encode_batch_png

MAX_BACKOFF_S = 30.0
MAX_REPLY_BYTES = 16 * 2**20
"""The largest reply the client reads: scores are 4 bytes an image, so anything near this is not a reply of scores."""
_RETRY_STATUS = (502, 503, 504)
FORMATS = ("safetensors", "png")


class RemoteRewardError(RuntimeError):
    """The reward server could not score a request (after the retries, where retrying helps)."""


class _Fatal(Exception):
    """A failure that retrying cannot fix (4xx, or the reward itself failed)."""


def _token(token: str | None) -> str | None:
    """The bearer token: ``token``, else ``$FLOWRL_REWARD_TOKEN``, else None; checked by :func:`.server.check_token`."""
    if token is None:
        token, where = os.environ.get(TOKEN_ENV), f"${TOKEN_ENV}"
    else:
        where = "remote reward option token"
    if token is not None:
        check_token(token, where)
    return token or None


_ENDPOINTS = ("/score", "/health", "/info")


def check_url(url: str) -> SplitResult:
    """Split a remote reward's url, refusing one the client cannot use, in one line that never shows a password.

    Args:
        url: ``http(s)://host[:port][/prefix]`` of a ``flowrl serve-reward`` server.

    Returns:
        ``urlsplit(url)``: scheme http or https, a host, a port (if given) in 1..65535, no user or
        password, no query or fragment, a path of visible ASCII that is not an endpoint.

    Raises:
        ValueError: any of those does not hold (the message names the option url and the fix).
    """
    where = "remote reward option url"
    try:
        parts = urlsplit(url)
    except ValueError as err:  # "http://[::1": an unclosed IPv6 bracket
        raise ValueError(f"{where} is not a URL ({err}); use e.g. http://127.0.0.1:8765") from None
    if "@" in parts.netloc:
        raise ValueError(
            f"{where} holds a user name or password (user:password@host); drop it and pass the secret as "
            f"token (or ${TOKEN_ENV}), which the client sends as 'Authorization: Bearer TOKEN'"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where} must look like http://127.0.0.1:8765 (http or https, with a host); got {url!r}")
    _check_port(parts, url, where)
    if parts.query or parts.fragment:
        raise ValueError(f"{where} must not have a query or fragment (the client would drop it); got {url!r}")
    if any(not "!" <= char <= "~" for char in parts.path):
        raise ValueError(f"{where} path has a space, control or non-ASCII character; percent-encode it; got {url!r}")
    endpoint = next((e for e in _ENDPOINTS if parts.path.rstrip("/").endswith(e)), None)
    if endpoint:
        raise ValueError(f"{where} names the endpoint {endpoint}; give the server's base URL without it; got {url!r}")
    return parts


def _check_port(parts: SplitResult, url: str, where: str) -> None:
    """Refuse a port that is not a whole number in 1..65535 (``urlsplit``'s own check allows 0 and fails late)."""
    try:
        valid = parts.port != 0  # None: no port given (80 or 443)
    except ValueError:  # not a whole number, or over 65535
        valid = False
    if valid:
        return
    text = parts.netloc.rpartition("]")[2].rpartition(":")[2]
    raise ValueError(
        f"{where} has port {text!r}, not a whole number in 1..65535; got {url!r}; e.g. http://127.0.0.1:8765"
    )


def _positive(name: str, value: object, *, integer: bool = False, zero: bool = False) -> Any:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"remote reward option {name} must be {kind} {'>= 0' if zero else '> 0'}; got {value!r}")
    return value


class RemoteReward:
    """A reward scored by a ``flowrl serve-reward`` server.

    Args:
        url: ``http://host:port`` of the server.
        timeout_s: deadline of each HTTP attempt as a whole (connect, upload, scoring, whole reply).
        retries: extra attempts per request after the first.
        backoff_s: wait before the first retry; doubles each retry (capped at 30 s).
        batch_size: images per request (None: the whole batch in one request).
        format: "safetensors" (exact float32) or "png" (JSON with 8-bit PNGs).
        token: bearer token; default: the ``FLOWRL_REWARD_TOKEN`` environment variable.
        wire_dtype: safetensors pixels as "float32" (exact) or "uint8" (4x smaller, 8-bit).
    """

    bounds_own_time = True  # every attempt has a deadline: MultiReward adds none of its own

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int | None = None,
        format: str = "safetensors",  # noqa: A002 - the config option's name
        token: str | None = None,
        wire_dtype: str = "float32",
    ) -> None:
        parts = check_url(str(url))
        if format not in FORMATS:
            raise ValueError(f"remote reward option format must be one of {FORMATS}; got {format!r}")
        self.url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        self._scheme, self._netloc, self._path = parts.scheme, parts.netloc, parts.path.rstrip("/")
        self.timeout_s = float(_positive("timeout_s", timeout_s))
        self.retries = int(_positive("retries", retries, integer=True, zero=True))
        self.backoff_s = float(_positive("backoff_s", backoff_s, zero=True))
        self.batch_size = None if batch_size is None else int(_positive("batch_size", batch_size, integer=True))
        if wire_dtype not in ("float32", "uint8"):
            raise ValueError(f"remote reward option wire_dtype must be 'float32' or 'uint8'; got {wire_dtype!r}")
        self.format, self.wire_dtype = format, wire_dtype
        self.token = _token(token)
        self.allows_nan = False  # set from each reply (the server's reward declares it)

    # -- transport -------------------------------------------------------------------------------

    def _request(self, path: str, body: bytes | None = None, content_type: str | None = None) -> tuple[bytes, str]:
        """One HTTP exchange within ``timeout_s``; returns (body, content type) or raises (_Fatal: don't retry).

        Talks to the server directly (http.client: never through an http_proxy from the environment).
        """
        headers = {"Content-Type": content_type} if content_type else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        deadline = time.monotonic() + self.timeout_s
        method = "POST" if body is not None else "GET"
        status, reply, reply_type = _exchange(
            self._scheme, self._netloc, method, self._path + path, body, headers, deadline
        )
        if 200 <= status < 300:
            return reply, reply_type
        detail = _error_detail(reply, status)
        if status in _RETRY_STATUS:
            raise RemoteRewardError(f"HTTP {status}: {detail}")
        raise _Fatal(f"HTTP {status}: {detail}")

    def _with_retries(self, what: str, attempt_fn: Any) -> Any:
        """Run ``attempt_fn`` up to 1 + retries times; one-line RemoteRewardError at the end."""
        for attempt in range(self.retries + 1):
            try:
                return attempt_fn()
            except _Fatal as err:
                raise RemoteRewardError(f"server {self.url} rejected {what}: {err}") from None
            except (OSError, http.client.HTTPException, RemoteRewardError, WireError) as err:
                cause = _describe(err, self.timeout_s)
                if attempt == self.retries:
                    tries = f"{self.retries + 1} attempt{'s' if self.retries else ''}"
                    raise RemoteRewardError(f"server {self.url} failed {what} after {tries}: {cause}") from None
                time.sleep(min(self.backoff_s * 2**attempt, MAX_BACKOFF_S))
        raise RemoteRewardError(f"server {self.url}: no attempt made for {what}")  # unreachable: retries >= 0

    # -- API ---------------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """GET /health (with retries)."""
        return self._with_retries("GET /health", lambda: _json_reply(*self._request("/health")))

    def info(self) -> dict[str, Any]:
        """GET /info (with retries): the served reward's name, ``allows_nan``, formats."""
        return self._with_retries("GET /info", lambda: _json_reply(*self._request("/info")))

    def _score_part(self, images: Tensor, prompts: Sequence[str], metadata: dict[str, Any], what: str) -> Tensor:
        """POST one request (with retries); scores (b,) float32."""
        if self.format == "png":
            body, content_type = encode_batch_png(images, prompts, metadata), JSON
        else:
            body, content_type = encode_batch(images, prompts, metadata, dtype=self.wire_dtype), SAFETENSORS

        def attempt() -> Tensor:
            reply, reply_type = self._request("/score", body, content_type)
            if reply_type.split(";")[0].strip() == JSON and content_type == SAFETENSORS:
                raise WireError(f"reply is JSON, not safetensors: {reply[:120]!r}")
            scores, allows_nan = (decode_scores_json if content_type == JSON else decode_scores)(reply)
            if tuple(scores.shape) != (len(prompts),) or scores.dtype != torch.float32:
                raise WireError(
                    f"reply holds scores of shape {tuple(scores.shape)} {scores.dtype} for {len(prompts)} images"
                )
            self.allows_nan = allows_nan
            return scores

        return self._with_retries(what, attempt)

    def __call__(self, images: Tensor, prompts: Sequence[str], **metadata: Any) -> Tensor:
        """Scores (B,) float32 for images (B, 3, H, W) or clips (B, F, 3, H, W) in [0, 1]."""
        check_images(images, video=True)
        total = int(images.shape[0])
        step = self.batch_size or max(total, 1)
        parts = []
        count = math.ceil(total / step)
        for i, start in enumerate(range(0, total, step)):
            part = slice(start, start + step)
            meta = {k: _slice(v, part, total) for k, v in metadata.items()}
            what = f"request {i + 1}/{count} (images {start}-{min(start + step, total) - 1})"
            parts.append(self._score_part(images[part], list(prompts)[part], meta, what))
        return torch.cat(parts).to(images.device) if parts else torch.zeros(0, dtype=torch.float32)

    def __repr__(self) -> str:
        return (
            f"RemoteReward({self.url!r}, timeout_s={self.timeout_s:g}, retries={self.retries}, "
            f"batch_size={self.batch_size})"
        )


def _slice(value: Any, part: slice, total: int) -> Any:
    if isinstance(value, (list, tuple, Tensor)) and len(value) == total:
        return value[part]
    return value


class _Deadline(TimeoutError):
    """An HTTP attempt passed its deadline."""


def _cut(conn: http.client.HTTPConnection, fired: threading.Event) -> None:
    """The deadline passed: shut ``conn``'s socket down, so whatever waits on it returns at once."""
    fired.set()
    sock = conn.sock
    if sock is not None:
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's, under TLS too
        except OSError:
            pass


def _exchange(
    scheme: str, netloc: str, method: str, path: str, body: bytes | None, headers: dict[str, str], deadline: float
) -> tuple[int, bytes, str]:
    """One request and its whole reply before ``deadline`` (``time.monotonic()``), or :class:`_Deadline`.

    Connecting is bounded by the socket timeout (the time left); after that a timer shuts the socket
    down at the deadline, so a server that sends a byte every few seconds cannot stretch the attempt.
    """
    kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = kind(netloc, timeout=max(deadline - time.monotonic(), 1e-3))
    fired = threading.Event()
    timer = threading.Timer(0, _cut, (conn, fired))
    try:
        conn.connect()
        timer.interval = max(deadline - time.monotonic(), 0.0)
        timer.daemon = True
        timer.start()
        _send(conn, method, path or "/", body, headers)
        reply = conn.getresponse()
        data = _read_bounded(reply, fired)
        return reply.status, data, reply.getheader("Content-Type", "")
    except (OSError, http.client.HTTPException):
        if fired.is_set() or time.monotonic() >= deadline:
            raise _Deadline() from None
        raise
    finally:
        timer.cancel()
        conn.close()


def _send(
    conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None, headers: dict[str, str]
) -> None:
    """``conn.request``, but a request that cannot be encoded fails without quoting its headers (the token).

    Raises:
        _Fatal: a header or the path holds a character HTTP cannot carry (http.client's own error would
            print the header's value, e.g. ``Invalid header value b'Bearer TOKEN'``).
    """
    try:
        conn.request(method, path, body=body, headers=headers)
    except ValueError:  # UnicodeEncodeError included
        raise _Fatal(
            "the request cannot be sent: a header or the url path holds a character HTTP cannot carry; "
            "check the url and the token (visible ASCII only)"
        ) from None


def _read_bounded(reply: http.client.HTTPResponse, fired: threading.Event) -> bytes:
    """The reply's body in chunks, at most :data:`MAX_REPLY_BYTES`, given up when the deadline fires.

    A server that streams without end would otherwise be read past the deadline (a shut-down socket
    still returns what is queued) and into the trainer's memory.

    Raises:
        WireError: the reply is (or says it is) larger than :data:`MAX_REPLY_BYTES`.
        _Deadline: the deadline passed while reading.
    """
    declared = reply.getheader("Content-Length", "")
    if declared.strip().isascii() and declared.strip().isdigit() and int(declared) > MAX_REPLY_BYTES:
        raise WireError(f"reply declares {int(declared)} bytes, over the {MAX_REPLY_BYTES} a reply of scores can need")
    chunks, total = [], 0
    while chunk := reply.read(65536):
        if fired.is_set():  # the cut may end a read early without an error: never trust that reply
            raise _Deadline()
        total += len(chunk)
        if total > MAX_REPLY_BYTES:
            raise WireError(f"reply longer than {MAX_REPLY_BYTES} bytes, more than a reply of scores can need")
        chunks.append(chunk)
    if fired.is_set():
        raise _Deadline()
    return b"".join(chunks)


def _error_detail(body: bytes, status: int) -> str:
    try:
        message = json.loads(body[:2000]).get("error")
        if message:
            return str(message).splitlines()[0]
    except Exception:  # noqa: BLE001 - the error body is best effort
        pass
    return http.client.responses.get(status, "error")


def _json_reply(body: bytes, content_type: str) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise WireError(f"reply is not JSON: {body[:120]!r}") from None
    if not isinstance(data, dict):
        raise WireError(f"reply is not a JSON object: {body[:120]!r}")
    return data


def _describe(err: BaseException, timeout_s: float) -> str:
    if isinstance(err, (socket.timeout, TimeoutError)):
        return (
            f"timed out (no whole reply within timeout_s={timeout_s:g} s, which bounds each attempt; "
            "raise timeout_s if the reward is just slow)"
        )
    if isinstance(err, ConnectionRefusedError):
        return "connection refused (is `flowrl serve-reward` running there?)"
    if isinstance(err, socket.gaierror):
        return f"unreachable ({err})"
    if isinstance(err, http.client.HTTPException) and not isinstance(err, ConnectionError):
        return f"reply is not HTTP ({type(err).__name__})"
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{text}" if isinstance(err, (WireError, RemoteRewardError)) else f"{type(err).__name__}: {text}"


def remote(url: str, **options: Any) -> RemoteReward:
    """A reward scored over HTTP by `flowrl serve-reward` (timeouts, retries with backoff, batch splitting).

    Args:
        url: ``http://host:port`` of the server (in a config also ``"remote:http://host:port"``).
        **options: the client options of :class:`RemoteReward`: ``timeout_s``, ``retries``,
            ``backoff_s``, ``batch_size``, ``format``, ``token`` (default ``$FLOWRL_REWARD_TOKEN``: keep
            tokens out of config files) and ``wire_dtype``.

    Returns:
        A reward ``(images (B, 3, H, W) or clips (B, F, 3, H, W), prompts, **metadata) -> (B,) float32``.
    """
    return RemoteReward(url, **options)


remote.bounds_own_time = True  # type: ignore[attr-defined] # build_multi_reward hands it timeout_s per attempt
