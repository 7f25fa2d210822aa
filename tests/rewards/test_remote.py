"""Remote reward server and client: real HTTP on 127.0.0.1 only, every fault ends in one line."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import save

from bench.reward_faults import trickle_server
from flowrl.local_launch import free_port
from flowrl.rewards import MultiReward, RewardError, build_multi_reward, build_reward, ink
from flowrl.rewards.remote import RemoteReward, RemoteRewardError
from flowrl.rewards.server import RewardServer, check_bind, is_loopback
from flowrl.rewards.wire import decode_batch, decode_batch_png, encode_batch, encode_batch_png, encode_scores

PROMPTS = [f"a {'bold' if i % 2 else 'thin'} handwritten {i % 10}" for i in range(7)]


def images(n=7, seed=0):
    return torch.rand(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def serve():
    """Start RewardServers on 127.0.0.1 (free port); all stopped at teardown."""
    servers = []

    def start(reward, name="r", **kwargs):
        server = RewardServer(reward, name, host="127.0.0.1", port=0, **kwargs).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


def test_wire_round_trips():
    x, meta = images(), {"digit": list(range(7)), "style": [None] * 7}
    got, prompts, metadata = decode_batch(encode_batch(x, PROMPTS, meta))
    assert torch.equal(got, x) and prompts == PROMPTS and metadata == meta
    got, prompts, _ = decode_batch_png(encode_batch_png(x, PROMPTS, meta))
    assert torch.equal(got, (x * 255).round() / 255) and prompts == PROMPTS
    clips = torch.rand(2, 3, 3, 8, 8)
    assert torch.equal(decode_batch(encode_batch(clips, ["a", "b"]))[0], clips)
    assert decode_batch_png(encode_batch_png(clips, ["a", "b"]))[0].shape == (2, 3, 3, 8, 8)
    with pytest.raises(TypeError, match="metadata 'obj'"):
        encode_batch(x, PROMPTS, {"obj": [object()] * 7})


def test_remote_scores_equal_in_process_and_split_batches(serve):
    local = ink("prompt")
    server = serve(local, "ink")
    client = build_reward(f"remote:{server.url}", batch_size=3, timeout_s=10)
    x = images()
    meta = {"style": ["bold", None, "thin", None, None, "bold", "thin"]}
    expected = local(x, PROMPTS, **meta)
    got = client(x, PROMPTS, **meta)
    assert torch.equal(got, expected) and client.allows_nan  # exact float32 over safetensors
    assert server.batches == 3  # 7 images in requests of 3, 3, 1
    quantised = local((x * 255).round() / 255, PROMPTS, **meta)
    png = build_reward("remote", url=server.url, format="png")(x, PROMPTS, **meta)
    assert torch.allclose(png, quantised, atol=1e-6, equal_nan=True)
    as_uint8 = build_reward("remote", url=server.url, wire_dtype="uint8")(x, PROMPTS, **meta)
    assert torch.allclose(as_uint8, quantised, atol=1e-6, equal_nan=True)
    assert client.health() == {"status": "ok", "reward": "ink"}
    info = client.info()
    assert info["name"] == "ink" and info["allows_nan"] is True and info["batches_scored"] == 5


def test_frame_wrapped_remote_learns_allows_nan_from_the_server(serve):
    server = serve(ink("prompt"), "ink")
    reward = build_multi_reward({"judge": {"reward": "remote", "url": server.url, "video": "mean"}})
    clips = torch.rand(3, 2, 3, 8, 8)
    out = reward(clips, ["a bold handwritten 1", "a handwritten 2", "a thin handwritten 3"])
    assert out.components["judge"][1].isnan() and not out.components["judge"][[0, 2]].isnan().any()


def test_ipv6_loopback(serve):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    try:
        server = RewardServer(ink("bold"), "ink", host="::1", port=0).start()
    except OSError as err:
        pytest.skip(f"IPv6 loopback unavailable here ({err})")
    try:
        assert server.url.startswith("http://[::1]:")
        assert torch.equal(RemoteReward(server.url)(images(), PROMPTS), ink("bold")(images(), PROMPTS))
    finally:
        server.stop()


def test_remote_video_reward_and_multi_reward(serve):
    server = serve(build_reward("ink", target="bold", video="min"), "ink-video")
    clips = torch.rand(4, 3, 3, 8, 8)
    reward = build_multi_reward(
        {"judge": {"reward": "remote", "url": server.url, "weight": 2.0}, "ink": {"target": "bold", "video": "min"}}
    )
    out = reward(clips, PROMPTS[:4])
    assert torch.equal(out.components["judge"], out.components["ink"])
    assert torch.allclose(out.total, 3 * clips.mean(dim=(2, 3, 4)).amin(1))


def test_token_and_bind_policy(serve, monkeypatch):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    with pytest.raises(ValueError, match="0.0.0.0 exposes it .* --token"):
        RewardServer(ink("bold"), "ink", host="0.0.0.0", port=0)
    check_bind("192.168.1.10", "secret")  # allowed with a token (not bound here: tests stay on loopback)
    server = serve(ink("bold"), "ink", token="s3cret")
    monkeypatch.delenv("FLOWRL_REWARD_TOKEN", raising=False)
    start = time.perf_counter()
    with pytest.raises(RemoteRewardError, match="rejected request 1/1 .*HTTP 401: missing or wrong token"):
        RemoteReward(server.url, retries=3, backoff_s=1.0)(images(), PROMPTS)
    assert time.perf_counter() - start < 1.0  # a 401 is not retried
    with pytest.raises(RemoteRewardError, match="HTTP 401"):
        RemoteReward(server.url, token="wrong").info()
    assert RemoteReward(server.url).health()["status"] == "ok"  # health needs no token
    assert torch.equal(RemoteReward(server.url, token="s3cret")(images(), PROMPTS), ink("bold")(images(), PROMPTS))
    monkeypatch.setenv("FLOWRL_REWARD_TOKEN", "s3cret")
    assert RemoteReward(server.url).info()["auth"] is True


class Garbage(BaseHTTPRequestHandler):
    """A broken server: replies 200 with whatever ``reply(batch_size)`` gives."""

    reply = staticmethod(lambda n: b"certainly not a tensor")

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        data = type(self).reply(len(decode_batch(body)[1]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def started(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """A ThreadingHTTPServer of ``handler`` on 127.0.0.1 (free port), serving in a daemon thread."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return httpd


@pytest.fixture
def garbage_server():
    servers = []

    def start(reply):
        httpd = started(type("H", (Garbage,), {"reply": staticmethod(reply)}))
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def score_through_trainer_path(url: str, **options) -> RewardError:
    """Score like the trainer does (MultiReward with a batch index) and return the one-line error."""
    reward = build_multi_reward({"judge": {"reward": "remote", "url": url, "backoff_s": 0.01, **options}})
    with pytest.raises(RewardError) as info:
        reward(images(), PROMPTS, batch_index=12)
    one_line(info.value)
    assert "reward 'judge' (batch 12)" in str(info.value)
    return info.value


def test_server_down(serve):
    start = time.perf_counter()
    err = score_through_trainer_path(f"http://127.0.0.1:{free_port()}", retries=2)
    assert "after 3 attempts: connection refused" in str(err) and time.perf_counter() - start < 5


def test_server_too_slow(serve):
    def slow(images, prompts, **metadata):
        time.sleep(3.0)
        return torch.zeros(images.shape[0])

    server = serve(slow, "slow")
    start = time.perf_counter()
    err = score_through_trainer_path(server.url, timeout_s=0.3, retries=1)
    assert "after 2 attempts: timed out (no whole reply within timeout_s=0.3 s, which bounds each attempt" in str(err)
    assert time.perf_counter() - start < 2.5


@pytest.mark.parametrize(
    "reply, fragment",
    [
        (lambda n: b"certainly not a tensor", "not a safetensors file"),
        (lambda n: encode_scores(torch.zeros(n + 1), False), "scores of shape (8,) torch.float32 for 7 images"),
        (lambda n: save({"scores": torch.zeros(n, dtype=torch.float64)}), "torch.float64 for 7 images"),
        (lambda n: json.dumps({"error": "not me"}).encode(), "not a safetensors file"),
    ],
)
def test_server_returns_garbage(garbage_server, reply, fragment):
    err = score_through_trainer_path(garbage_server(reply), retries=1)
    assert "after 2 attempts" in str(err) and fragment in str(err)


def test_non_http_reply():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def answer():
            for _ in range(2):
                conn, _ = listener.accept()
                conn.recv(65536)
                conn.sendall(b"\x00\x01 hello, this is not HTTP\r\n\r\n")
                conn.close()

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        err = score_through_trainer_path(f"http://127.0.0.1:{port}", retries=1, timeout_s=2)
        thread.join(timeout=5)
    assert "after 2 attempts: reply is not HTTP (BadStatusLine)" in str(err)


def _raises(images, prompts, **metadata):
    raise RuntimeError("CUDA out of memory\nsecond line")


def _wrong_shape(images, prompts, **metadata):
    return torch.zeros(images.shape[0], 2)


def _wrong_dtype(images, prompts, **metadata):
    return torch.zeros(images.shape[0], dtype=torch.float64)


def _all_nan(images, prompts, **metadata):
    return torch.full((images.shape[0],), float("nan"))


_all_nan.allows_nan = True
FAULTY = [
    (_raises, "raised RuntimeError: CUDA out of memory"),
    (_wrong_shape, "returned shape (7, 2), expected (7,)"),
    (_wrong_dtype, "returned dtype torch.float64, expected torch.float32"),
    (_all_nan, "returned NaN for every sample"),
]


@pytest.mark.parametrize("fn, fragment", FAULTY)
def test_faulty_reward_in_process(fn, fragment):
    with pytest.raises(RewardError) as info:
        MultiReward({"bad": (fn, 1.0)})(images(), PROMPTS, batch_index=3)
    assert one_line(info.value).startswith("reward 'bad' (batch 3)") and fragment in str(info.value)


@pytest.mark.parametrize("fn, fragment", FAULTY)
def test_faulty_reward_behind_the_server(serve, fn, fragment):
    server = serve(fn, "bad")
    start = time.perf_counter()
    err = score_through_trainer_path(server.url, retries=3, backoff_s=1.0)
    assert fragment in str(err)
    assert time.perf_counter() - start < 1.0  # the reward's own failure is not retried


def test_bad_requests_get_one_line_errors(serve):
    server = serve(ink("bold"), "ink")
    client = RemoteReward(server.url, retries=0)
    assert server.url.startswith("http://127.0.0.1:")
    with pytest.raises(
        RemoteRewardError, match="HTTP 400: bad request for reward 'ink': body of 5 bytes is not a safetensors"
    ):
        client._with_retries("raw", lambda: client._request("/score", b"hello", "application/vnd.flowrl.safetensors"))
    with pytest.raises(RemoteRewardError, match="HTTP 404: no endpoint /nope"):
        client._with_retries("get", lambda: client._request("/nope"))
    with pytest.raises(ValueError, match="url must look like"):
        RemoteReward("127.0.0.1:8765")
    with pytest.raises(ValueError, match="retries must be an integer >= 0"):
        RemoteReward(server.url, retries=-1)


def test_a_trickling_server_is_cut_at_the_deadline():
    url = trickle_server(interval_s=0.2)  # headers and body one byte every 0.2 s: no socket read ever times out
    start = time.perf_counter()
    err = score_through_trainer_path(url, timeout_s=1.0, retries=1)
    elapsed = time.perf_counter() - start
    assert "after 2 attempts: timed out (no whole reply within timeout_s=1 s, which bounds each attempt" in str(err)
    assert 2.0 <= elapsed < 5.0  # two attempts of 1 s (each its own deadline) and a 0.01 s backoff


def test_a_slow_but_steady_reply_within_the_deadline_is_accepted(serve):
    def slowish(images, prompts, **metadata):
        time.sleep(0.3)
        return images.mean(dim=(1, 2, 3))

    server = serve(slowish, "slowish")
    x = images()
    assert torch.equal(RemoteReward(server.url, timeout_s=5, retries=0)(x, PROMPTS), x.mean(dim=(1, 2, 3)))


def _raw_server(head: bytes, body_chunk: bytes, attempts: int) -> tuple[str, threading.Thread]:
    """A socket server answering each of ``attempts`` requests with ``head``, then ``body_chunk`` until hung up."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def answer():
        with listener:
            for _ in range(attempts):
                conn, _ = listener.accept()
                with conn:
                    conn.recv(65536)
                    try:
                        conn.sendall(head)
                        while body_chunk:
                            conn.sendall(body_chunk)
                    except OSError:  # the client gave up: what the test wants
                        pass

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", thread


@pytest.mark.parametrize(
    "head, chunk, fragment",
    [
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", b"\0" * 2**20, "reply longer than 16777216 bytes"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100000000000\r\n\r\n", b"", "reply declares 100000000000 bytes"),
        # "²" passes str.isdigit but not int(): the header is ignored and the body judged (it was a ValueError)
        ("HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\nConnection: close\r\n\r\n".encode(), b"", "body of 0 bytes"),
    ],
)
def test_a_flooding_server_is_refused_before_it_fills_the_trainer_s_memory(head, chunk, fragment):
    url, thread = _raw_server(head, chunk, attempts=2)
    start = time.perf_counter()
    err = score_through_trainer_path(url, retries=1, timeout_s=30)
    thread.join(timeout=5)
    assert f"after 2 attempts: {fragment}" in str(err) and time.perf_counter() - start < 20


def test_retries_back_off_doubling_from_backoff_s_up_to_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retry k waits backoff_s * 2**k, at most MAX_BACKOFF_S (30 s), and nothing follows the last attempt."""
    import importlib
    import types

    remote_module = importlib.import_module("flowrl.rewards.remote")  # the package's ``remote`` is the function
    waits: list[float] = []
    monkeypatch.setattr(remote_module, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=waits.append))
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RemoteRewardError, match="after 4 attempts: connection refused"):
        RemoteReward(url, retries=3, backoff_s=0.5).health()
    assert waits == [0.5, 1.0, 2.0]
    waits.clear()
    with pytest.raises(RemoteRewardError, match="after 3 attempts: connection refused"):
        RemoteReward(url, retries=2, backoff_s=20.0).health()
    assert waits == [20.0, remote_module.MAX_BACKOFF_S]


class Flaky(BaseHTTPRequestHandler):
    """Answers the first POST with ``status`` (a JSON error line unless 200), every later one with zero scores.

    Records each request's path and batch size.
    """

    status = 503
    posts: list[int] = []
    paths: list[str] = []

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).posts.append(len(decode_batch(body)[1]))
        type(self).paths.append(self.path)
        failed = len(type(self).posts) == 1 and type(self).status != 200
        status = type(self).status if failed else 200
        data = json.dumps({"error": "busy"}).encode() if failed else encode_scores(torch.zeros(self.posts[-1]), False)
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def flaky_server(status: int) -> tuple[ThreadingHTTPServer, type[Flaky]]:
    """A started :class:`Flaky` server on 127.0.0.1 (free port) and its handler class (the records)."""
    handler = type("H", (Flaky,), {"status": status, "posts": [], "paths": []})
    return started(handler), handler


@pytest.mark.parametrize("status, retried", [(502, True), (503, True), (504, True), (500, False), (400, False)])
def test_only_gateway_and_unavailable_statuses_are_retried(status: int, retried: bool) -> None:
    """HTTP 502/503/504 get another attempt (which scores); a 500 (the reward failed) or a 4xx is final at once."""
    httpd, handler = flaky_server(status)
    client = RemoteReward(f"http://127.0.0.1:{httpd.server_address[1]}", retries=2, backoff_s=0.0)
    try:
        if retried:
            assert torch.equal(client(images(), PROMPTS), torch.zeros(7))
        else:
            with pytest.raises(RemoteRewardError, match=f"rejected request 1/1 \\(images 0-6\\): HTTP {status}: busy"):
                client(images(), PROMPTS)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert handler.posts == ([7, 7] if retried else [7])


def test_a_url_path_prefix_is_kept_without_its_trailing_slash() -> None:
    """``http://host:port/reward/`` (a server behind a path prefix) posts to ``/reward/score``, not ``//score``."""
    httpd, handler = flaky_server(200)
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        client = RemoteReward(base + "/reward/", retries=0)
        assert client.url == base + "/reward"
        assert torch.equal(client(images(), PROMPTS), torch.zeros(7))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert handler.paths == ["/reward/score"]


def _by_digit(images: torch.Tensor, prompts: list[str], digit: list[int]) -> torch.Tensor:
    return torch.tensor(digit, dtype=torch.float32) + images.mean(dim=(1, 2, 3))


def test_tensor_metadata_is_split_with_the_batch(serve: Callable[..., RewardServer]) -> None:
    """Per-sample metadata given as a tensor goes with its own rows into each request of ``batch_size``."""
    server = serve(_by_digit, "digit")
    x, digit = images(), torch.arange(7) * 10
    got = RemoteReward(server.url, batch_size=3, retries=0)(x, PROMPTS, digit=digit)
    assert server.batches == 3
    assert torch.equal(got, _by_digit(x, PROMPTS, digit.tolist()))


def test_client_options_must_be_finite_and_positive_where_zero_means_nothing() -> None:
    """timeout_s and batch_size must be > 0 and finite; retries and backoff_s may be 0 (no retry, no wait)."""
    url = "http://127.0.0.1:8765"
    for option, value, kind in [
        ("timeout_s", 0, "a number > 0"),
        ("timeout_s", float("inf"), "a number > 0"),
        ("timeout_s", float("nan"), "a number > 0"),
        ("backoff_s", float("inf"), "a number >= 0"),
        ("batch_size", 0, "an integer > 0"),
        ("batch_size", True, "an integer > 0"),
    ]:
        with pytest.raises(ValueError, match=f"remote reward option {option} must be {kind}; got {value!r}"):
            RemoteReward(url, **{option: value})
    client = RemoteReward(url, retries=0, backoff_s=0)
    assert (client.retries, client.backoff_s, client.batch_size) == (0, 0.0, None)
