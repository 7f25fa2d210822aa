"""The reward server's HTTP edges: every reply is HTTP with a one-line JSON error, whatever the client or reward did."""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest
import torch
from safetensors.torch import save
from test_server_limits import post  # POST /score: (status, the one-line error)

from flowrl.rewards import ink
from flowrl.rewards.remote import RemoteReward
from flowrl.rewards.server import RewardServer, body_length, check_bind, check_token
from flowrl.rewards.wire import JSON, SAFETENSORS, TooLarge, WireError, encode_batch, encode_batch_png


@pytest.fixture
def server():
    srv = RewardServer(ink("bold"), "ink", host="127.0.0.1", port=0).start()
    yield srv
    srv.stop()


def raw(server: RewardServer, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` as is on a new connection; (status, headers, body) of the reply, read until the server closes."""
    host, port = server.httpd.server_address[:2]
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply, "the server closed the connection without a reply"
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {key.lower(): value.strip() for key, value in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, body


def json_error(headers: dict[str, str], body: bytes) -> str:
    """The one-line message of a JSON error reply (fails on an HTML page or a multi-line message)."""
    assert headers["content-type"] == JSON and int(headers["content-length"]) == len(body), (headers, body)
    error = json.loads(body)["error"]
    assert isinstance(error, str) and "\n" not in error and body.count(b"\n") == 0
    return error


def _healthy(server: RewardServer) -> bool:
    return RemoteReward(server.url).health()["status"] == "ok"


@pytest.mark.parametrize(
    "length, status, fragment",
    [
        ("\u00b2", 400, "Content-Length '\u00b2' is not a whole number of bytes"),  # str.isdigit() says yes
        ("12a", 400, "is not a whole number of bytes; send the body's length in digits"),
        ("-5", 400, "is not a whole number of bytes"),
        ("9" * 5000, 413, "body of a number of 5000 digits bytes exceeds the server's limit"),  # int() refuses it
        ("0" * 5000 + "12", 400, "not a safetensors file"),  # leading zeros: 12 bytes, read and decoded
    ],
    ids=["superscript", "letters", "negative", "5000 digits", "leading zeros"],
)
def test_a_malformed_content_length_gets_a_json_error_and_the_server_lives_on(server, capfd, length, status, fragment):
    """Content-Length is checked as ASCII digits and against the limit without int() of a huge number."""
    head = f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode("latin-1")  # b"\xb2"
    code, headers, body = raw(server, head + b"x" * 12)
    assert code == status and fragment in json_error(headers, body), (code, body)
    assert _healthy(server) and "Traceback" not in capfd.readouterr().err


def test_body_length():
    assert body_length(" 0012 ", 100) == 12 and body_length("100", 100) == 100
    with pytest.raises(TooLarge, match="body of 101 bytes exceeds the server's limit of 100"):
        body_length("101", 100)
    with pytest.raises(WireError, match=r"Content-Length '\+5' is not a whole number"):
        body_length("+5", 100)
    with pytest.raises(WireError, match=r"'xxxxxxxxxx.*\.\.\.' is not"):
        body_length("x" * 5000, 100)  # the message stays short


def _header_with(shape_dim: bytes) -> bytes:
    header = b'{"images":{"dtype":"U8","shape":[1,3,8,' + shape_dim + b'],"data_offsets":[0,24]}}'
    return struct.pack("<Q", len(header)) + header + b"\x00" * 24


_IMAGES = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
_BIG = "1" * 5000
HUGE_INTEGERS = [
    ("safetensors shape", _header_with(_BIG.encode()), SAFETENSORS, "the safetensors header holds an integer"),
    ("safetensors prompts", save({"images": _IMAGES}, metadata={"prompts": f"[{_BIG}]"}), SAFETENSORS, "'prompts'"),
    (
        "safetensors metadata",
        save({"images": _IMAGES}, metadata={"prompts": '["a", "b"]', "metadata": f'{{"d": [{_BIG}, 1]}}'}),
        SAFETENSORS,
        "request 'metadata' holds an integer",
    ),
    (
        "JSON metadata",
        encode_batch_png(_IMAGES, ["a", "b"]).replace(b'"metadata": {}', f'"metadata": {{"d": [{_BIG}, 1]}}'.encode()),
        JSON,
        "request holds an integer",
    ),
]


@pytest.mark.parametrize(
    "body, content_type, fragment", [c[1:] for c in HUGE_INTEGERS], ids=[c[0] for c in HUGE_INTEGERS]
)
def test_a_huge_json_integer_is_a_bad_request_not_a_reward_failure(server, body, content_type, fragment):
    """Python refuses int() of over 4300 digits with a plain ValueError: that is the client's fault (400)."""
    status, error = post(server, body, content_type)
    assert status == 400 and fragment in error and "of over 4300 digits; send shorter numbers" in error, error
    assert "failed" not in error


def test_a_shape_too_large_for_safetensors_is_refused_as_a_shape(server):
    """4000 digits parse, but no u64 holds them: refused as a shape (the pixel count would not even print)."""
    status, error = post(server, _header_with(b"9" * 4000), SAFETENSORS)
    assert status == 400 and "must have shape (B, 3, H, W)" in error, error


def test_a_slow_upload_is_not_idle_time():
    """--idle-exit counts a request from its request line to its reply: a body sent over 3x the idle time is
    scored, and the server stops on its own only after the reply."""
    srv = RewardServer(ink("bold"), "ink", host="127.0.0.1", port=0, idle_exit_s=0.5).start()
    try:
        body = encode_batch(torch.rand(2, 3, 16, 16), ["a", "b"])
        host, port = srv.httpd.server_address[:2]
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
            pieces = [body[i : i + len(body) // 6 + 1] for i in range(0, len(body), len(body) // 6 + 1)]
            for piece in pieces:
                time.sleep(0.3)  # > 1.5 s in all, 3x the idle time
                assert srv.serving, "the server stopped while a body was being uploaded"
                sock.sendall(piece)
            reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
        deadline = time.monotonic() + 10
        while srv.serving and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not srv.serving and srv.stopped_idle  # idle again after the reply: it ends on its own
    finally:
        srv.stop()


BAD_TOKENS = [
    ("s3cr3t-caf\u00e9", "a non-ASCII character at position 11"),
    ("s3cr3t-\u043a\u043b\u044e\u0447", "a non-ASCII character at position 8"),
    ("s3cr3t-key\n", "a space or control character at position 11"),  # read from a file with its newline
    ("s3cr3t key", "a space or control character at position 7"),
    ("s3cr3t\tkey", "a space or control character at position 7"),
    ("s3cr3t\x7fkey", "a space or control character at position 7"),
]


@pytest.mark.parametrize("token, kind", BAD_TOKENS, ids=["cafe", "cyrillic", "newline", "space", "tab", "DEL"])
def test_a_token_no_client_can_send_is_refused_without_showing_it(token, kind):
    for refuse in (
        lambda: check_bind("127.0.0.1", token),
        lambda: RewardServer(ink("bold"), "ink", port=0, token=token),
    ):
        with pytest.raises(ValueError) as info:
            refuse()
        message = str(info.value)
        assert message.startswith(f"the token (--token or FLOWRL_REWARD_TOKEN) has {kind}"), message
        assert "HTTP headers carry only visible ASCII" in message and "s3cr3t" not in message and "\n" not in message


def test_check_token_passes_visible_ascii_and_no_token():
    check_token("abc-DEF_123.~!+/=", "token")
    check_token("", "token")
    check_token(None, "token")
    with pytest.raises(TypeError, match=r"token must be a string \(quote it in YAML\); got int"):
        check_token(5, "token")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "flags, env", [(["--token", "s3cr3t-caf\u00e9"], None), ([], "s3cr3t-key\n")], ids=["flag", "env"]
)
def test_serve_reward_refuses_a_bad_token_from_the_flag_or_the_environment(capsys, monkeypatch, flags, env):
    from flowrl.cli import main

    if env is None:
        monkeypatch.delenv("FLOWRL_REWARD_TOKEN", raising=False)
    else:
        monkeypatch.setenv("FLOWRL_REWARD_TOKEN", env)
    args = ["serve-reward", "jpeg_compressibility", "--port", "0", "--idle-exit", "1", *flags]  # a token let through
    assert main(args) == 2  # would serve for 1 s and return 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flowrl: error: the token (--token or FLOWRL_REWARD_TOKEN) has")
    assert "s3cr3t" not in err


STDLIB_FAULTS = [
    ("PUT", b"PUT /score HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 501, "Unsupported method ('PUT')"),
    ("garbage line", b"GARBAGE\r\n\r\n", 400, "Bad request syntax ('GARBAGE')"),
    ("bad version", b"GET /health HTTP/x.y\r\n\r\n", 400, "Bad request version ('HTTP/x.y')"),
    ("HTTP/2.0", b"GET /health HTTP/2.0\r\n\r\n", 505, "Invalid HTTP version (2.0); send HTTP/1.1"),
    ("long header", b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431, "Line too long"),
    ("long request line", b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414, "Request-URI Too Long"),
]


@pytest.mark.parametrize("data, status, fragment", [f[1:] for f in STDLIB_FAULTS], ids=[f[0] for f in STDLIB_FAULTS])
def test_faults_the_http_parser_finds_get_the_one_line_json_error(server, data, status, fragment):
    """The stdlib's send_error answers an HTML page; the server answers its status with ``{"error": "..."}``."""
    code, headers, body = raw(server, data)
    error = json_error(headers, body)
    assert code == status and fragment in error, (code, error)
    assert headers["connection"] == "close" and _healthy(server)


def test_head_health_answers_like_get_without_a_body(server):
    code, headers, body = raw(server, b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    get = json.dumps({"status": "ok", "reward": "ink"}).encode()
    assert code == 200 and body == b"" and int(headers["content-length"]) == len(get)
    code, headers, body = raw(server, b"HEAD /nope HTTP/1.1\r\nHost: x\r\n\r\n")
    assert code == 404 and body == b"" and headers["content-type"] == JSON  # an error to HEAD: headers only


@pytest.mark.parametrize("content_type", ["application/JSON; charset=utf-8", "Application/Json"])
def test_media_types_are_matched_case_insensitively(server, content_type):
    x = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    assert post(server, encode_batch_png(x, ["a", "b"]), content_type) == (200, "")
    assert post(server, encode_batch(x, ["a", "b"]), SAFETENSORS.upper()) == (200, "")


def _interrupts(images: torch.Tensor, prompts: list[str], **metadata: object) -> torch.Tensor:
    raise KeyboardInterrupt


def test_a_reward_raising_keyboard_interrupt_gets_500_and_the_server_lives_on(capfd):
    """A KeyboardInterrupt on a handler thread is the reward's (a real Ctrl-C reaches only the main thread)."""
    srv = RewardServer(_interrupts, "impatient", host="127.0.0.1", port=0).start()
    try:
        body = encode_batch(torch.rand(2, 3, 8, 8), ["a", "b"])
        for _ in range(2):
            status, error = post(srv, body, SAFETENSORS)
            assert status == 500 and error.startswith("reward 'impatient' raised KeyboardInterrupt"), error
        assert _healthy(srv)
    finally:
        assert srv.stop(grace_s=5.0) is True
    assert "Traceback" not in capfd.readouterr().err
