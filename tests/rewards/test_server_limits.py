"""The reward server survives hostile input: sizes checked before decoding, a 4xx JSON line for every client fault."""

from __future__ import annotations

import base64
import http.client
import json
import math
import struct
import threading
import time
import zlib

import pytest
import torch
from safetensors.torch import save

from flowrl.rewards import ink
from flowrl.rewards.remote import RemoteReward
from flowrl.rewards.server import RewardServer
from flowrl.rewards.wire import JSON, SAFETENSORS, PixelLimits, TooLarge, check_pixels, encode_batch, encode_batch_png


@pytest.fixture
def server():
    srv = RewardServer(ink("bold"), "ink", host="127.0.0.1", port=0).start()
    yield srv
    srv.stop()


def post(server: RewardServer, body: bytes, content_type: str = "application/json") -> tuple[int, str]:
    """POST /score; (status, the one-line error, or "" on 200)."""
    host, port = server.httpd.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request("POST", "/score", body=body, headers={"Content-Type": content_type})
        reply = conn.getresponse()
        data = reply.read()
    finally:
        conn.close()
    if reply.status == 200:
        return 200, ""
    error = json.loads(data)["error"]
    assert isinstance(error, str) and "\n" not in error
    return reply.status, error


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def big_png(width: int, height: int) -> str:
    """A valid base64 RGB PNG of zeros, compressed row by row (never held decoded here)."""
    packer, row, parts = zlib.compressobj(9), b"\x00" * (1 + 3 * width), []
    for _ in range(height):
        parts.append(packer.compress(row))
    parts.append(packer.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", b"".join(parts)) + _chunk(b"IEND", b"")
    return base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def huge_png():
    return big_png(9000, 9000)  # 243 MB of pixels in ~330 KB of base64


def test_huge_pngs_are_refused_before_decoding(server, huge_png):
    body = json.dumps({"prompts": ["a"] * 8, "images": [huge_png] * 8}).encode()
    assert len(body) < 4_000_000
    start = time.perf_counter()
    status, error = post(server, body)
    assert status == 413 and time.perf_counter() - start < 5
    assert error == (
        "request too large for reward 'ink': image 0 is 9000x9000 (81000000 pixels), over the server's limit "
        "of 16777216 per image (--max-image-pixels); send smaller images"
    )
    assert RemoteReward(server.url).health()["status"] == "ok"  # and the server lives on


def test_request_pixels_are_bounded_as_a_whole(server):
    tiny = big_png(64, 64)
    server.limits = PixelLimits(per_image=64 * 64, per_request=64 * 64 * 10)
    status, error = post(server, json.dumps({"prompts": ["a"] * 11, "images": [tiny] * 11}).encode())
    assert status == 413 and "request holds 11 images of 45056 pixels in all" in error and "batch_size" in error
    assert post(server, json.dumps({"prompts": ["a"] * 10, "images": [tiny] * 10}).encode())[0] == 200


def _declared(shape: list) -> bytes:
    """A safetensors body whose header declares uint8 ``images`` of ``shape`` over 4 bytes of data."""
    raw = json.dumps({"images": {"dtype": "U8", "shape": shape, "data_offsets": [0, 4]}}).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\x00" * 4


def test_safetensors_shape_is_checked_from_the_header(server):
    status, error = post(server, _declared([1000, 3, 4096, 4096]), SAFETENSORS)
    assert status == 413 and "request holds 1000 images" in error  # refused before safetensors reads a byte


def _safetensors(images, **meta) -> bytes:
    return save({"images": images}, metadata={"prompts": json.dumps(["a"] * images.shape[0]), **meta})


ok_png = encode_batch_png(torch.rand(1, 3, 8, 8), ["a"])
BAD = [
    ("deep JSON", b"[" * 100_000 + b"]" * 100_000, JSON, "nested too deeply"),
    ("deep in images", json.dumps({"images": [[[["x"]]]]}).encode(), JSON, "base64 PNG string"),
    ("not JSON", b"\xff\xfe", JSON, "request is not JSON"),
    ("not an object", b"[1, 2]", JSON, "must be an object with a non-empty 'images' list"),
    ("images not a list", json.dumps({"images": "abc"}).encode(), JSON, "non-empty 'images' list"),
    ("image not a string", json.dumps({"images": [3]}).encode(), JSON, "base64 PNG string"),
    ("bad base64", json.dumps({"images": ["!" * 40]}).encode(), JSON, "not base64"),
    (
        "not a PNG",
        json.dumps({"images": [base64.b64encode(b"GIF89a" + b"\x00" * 40).decode()]}).encode(),
        JSON,
        "not a PNG",
    ),
    ("truncated PNG", json.dumps({"images": [big_png(8, 8)[:60]]}).encode(), JSON, "not a base64 PNG"),
    ("empty clip", json.dumps({"images": [[]]}).encode(), JSON, "empty list"),
    (
        "sizes differ",
        json.dumps({"prompts": ["a", "b"], "images": [big_png(8, 8), big_png(4, 4)]}).encode(),
        JSON,
        "images differ in size",
    ),
    (
        "prompts wrong",
        ok_png.replace(b'"prompts": ["a"]', b'"prompts": 5'),
        JSON,
        "'prompts' must be a list of strings",
    ),
    ("prompt count", ok_png.replace(b'"prompts": ["a"]', b'"prompts": ["a", "b"]'), JSON, "2 prompts for 1 images"),
    (
        "metadata wrong",
        ok_png.replace(b'"metadata": {}', b'"metadata": [1]'),
        JSON,
        "'metadata' must be a JSON object",
    ),
    (
        "metadata named images",
        ok_png.replace(b'"metadata": {}', b'"metadata": {"images": [1]}'),
        JSON,
        "may not be named 'images'",
    ),
    (
        "metadata not per sample",
        ok_png.replace(b'"metadata": {}', b'"metadata": {"seed": 5}'),
        JSON,
        "'seed' must be a list of one value per image (1); got a value of type int",
    ),
    (
        "metadata too short",
        ok_png.replace(b'"metadata": {}', b'"metadata": {"seed": []}'),
        JSON,
        "'seed' must be a list of one value per image (1); got 0 values",
    ),
    ("not safetensors", b"hello", SAFETENSORS, "not a safetensors file"),
    ("header overflow", struct.pack("<Q", 2**63) + b"{}", SAFETENSORS, "header length"),
    ("rank 3", _safetensors(torch.rand(3, 8, 8)), SAFETENSORS, "shape (B, 3, H, W) or (B, F, 3, H, W); got [3, 8, 8]"),
    ("4 channels", _safetensors(torch.rand(1, 4, 8, 8)), SAFETENSORS, "got [1, 4, 8, 8]"),
    ("float64", _safetensors(torch.rand(1, 3, 8, 8, dtype=torch.float64)), SAFETENSORS, "dtype 'F64'"),
    ("NaN pixels", _safetensors(torch.full((1, 3, 8, 8), float("nan"))), SAFETENSORS, "must lie in [0, 1]"),
    (
        "prompts not JSON",
        _safetensors(torch.rand(1, 3, 8, 8)).replace(b'[\\"a\\"]', b'[\\"a\\" '),
        SAFETENSORS,
        "not JSON",
    ),
]


@pytest.mark.parametrize("body, content_type, fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_client_faults_get_a_4xx_json_line(server, body, content_type, fragment):
    status, error = post(server, body, content_type)
    assert 400 <= status < 500 and fragment in error, (status, error)


def test_the_server_still_scores_after_hostile_requests(server):
    for _, body, content_type, _ in BAD[:3]:
        post(server, body, content_type)
    x = torch.rand(3, 3, 8, 8)
    assert torch.equal(RemoteReward(server.url)(x, ["a"] * 3), ink("bold")(x, ["a"] * 3))
    assert post(server, encode_batch(x, ["a"] * 3), SAFETENSORS)[0] == 200


@pytest.mark.parametrize("batch, status", [(60_000_000, 400), (10**12, 413)])
def test_a_header_declaring_a_huge_batch_is_refused_at_once(server, batch, status):
    """A ~150-byte header declaring 10^12 images of 1x1: refused by arithmetic, not a list per image."""
    header = {
        "__metadata__": {"prompts": "[]"},
        "images": {"dtype": "U8", "shape": [batch, 3, 1, 1], "data_offsets": [0, 0]},
    }
    text = json.dumps(header).encode()
    start = time.perf_counter()
    code, error = post(server, struct.pack("<Q", len(text)) + text, SAFETENSORS)
    assert code == status and time.perf_counter() - start < 10.0  # was 13.7 s quiet; ms now
    assert ("request holds 1000000000000 images" in error) if status == 413 else ("not a valid safetensors" in error)


def test_check_pixels():
    check_pixels([(10, 10)] * 3, None)
    check_pixels([(10, 10)] * 3, PixelLimits(100, 300))
    with pytest.raises(TooLarge, match="image 1 is 11x10"):
        check_pixels([(10, 10), (10, 11)], PixelLimits(100, None))
    with pytest.raises(TooLarge, match="request holds 300 images of 30000 pixels"):
        check_pixels([(10, 10)], PixelLimits(100, 20_000), count=300)
    with pytest.raises(ValueError, match="--max-image-pixels must be a whole number of pixels >= 1; got 0"):
        RewardServer(ink("bold"), "ink", port=0, max_image_pixels=0)


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--idle-exit", "-3"], "--idle-exit must be a finite number > 0; got -3.0"),  # it started, then stopped
        (["--idle-exit", "nan"], "--idle-exit must be a finite number > 0; got nan"),  # it never stopped
        (["--max-body-mb", "-5"], "--max-body-mb must be a finite number > 0; got -5.0"),
        (["--max-body-mb", "nan"], "--max-body-mb must be a finite number > 0; got nan"),  # "cannot convert ... NaN"
        (["--host", "0.0.0.0", "--token", " "], "the token (--token or FLOWRL_REWARD_TOKEN) is blank"),
    ],
)
def test_serve_reward_refuses_a_limit_or_token_that_cannot_work_in_one_line(capsys, flags, line):
    from flowrl.cli import main

    assert main(["serve-reward", "jpeg_compressibility", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"flowrl: error: {line}"), err
    with pytest.raises(ValueError, match="--idle-exit must be a finite number > 0; got inf"):
        RewardServer(ink("bold"), "ink", port=0, idle_exit_s=math.inf)  # the class checks as the command does


def test_every_frame_of_a_clip_counts_toward_the_request_limit():
    """A (B, F, 3, H, W) header declares B x F images: 2 clips of 50 frames of 64 x 64 are 100 images of the
    request's pixels, refused from the header alone (TooLarge, not a later parse error)."""
    from flowrl.rewards.wire import decode_batch

    with pytest.raises(TooLarge, match="request holds 100 images"):
        decode_batch(_declared([2, 50, 3, 64, 64]), PixelLimits(per_request=20 * 64 * 64))


def test_a_header_length_past_the_body_is_named():
    """A safetensors length prefix claiming more bytes than follow it is refused with that reason."""
    from flowrl.rewards.wire import WireError, decode_batch

    raw = json.dumps({"images": {"dtype": "U8", "shape": [1, 3, 1, 1], "data_offsets": [0, 3]}}).encode()
    body = struct.pack("<Q", len(raw) + 4) + raw + b"\x00" * 3  # claims 1 byte more than the body has
    with pytest.raises(WireError, match="exceeds the"):
        decode_batch(body)


def test_a_reply_with_more_than_scores_is_refused():
    """A safetensors reply must hold exactly one tensor, ``scores``: an extra tensor means it is not our format."""
    from flowrl.rewards.wire import WireError, decode_scores

    body = save({"scores": torch.zeros(2), "extra": torch.zeros(1)}, metadata={"allows_nan": "0"})
    with pytest.raises(WireError, match=r"reply holds tensors \['extra', 'scores'\]"):
        decode_scores(body)


def test_png_size_needs_the_ihdr_chunk_first():
    """png_size reads the size only from an IHDR chunk right after the signature; other bytes there are refused."""
    from flowrl.rewards.wire import WireError, png_size

    good = base64.b64decode(json.loads(encode_batch_png(torch.rand(1, 3, 5, 7), ["a"]))["images"][0])
    assert png_size(base64.b64encode(good).decode()) == (5, 7)
    bad = good[:12] + b"XXXX" + good[16:]
    with pytest.raises(WireError, match="not a PNG"):
        png_size(base64.b64encode(bad).decode())


def test_json_scores_write_nan_as_null_and_default_to_no_nan():
    """A JSON reply is strict JSON (NaN as ``null``, read back as NaN); a reply without ``allows_nan`` allows none."""
    from flowrl.rewards.wire import decode_scores_json, encode_scores_json

    body = encode_scores_json(torch.tensor([0.5, float("nan")]), True)
    assert json.loads(body) == {"scores": [0.5, None], "allows_nan": True}
    scores, allows_nan = decode_scores_json(body)
    assert scores[0].item() == 0.5 and math.isnan(scores[1].item()) and allows_nan is True
    assert decode_scores_json(b'{"scores": [1.0]}')[1] is False


@pytest.mark.parametrize("key", ["images", "prompts"])
def test_request_metadata_may_not_shadow_the_reward_s_own_arguments(key):
    """Metadata named ``images`` or ``prompts`` is refused (it would collide with the reward's own arguments)."""
    from flowrl.rewards.wire import WireError, check_batch_metadata

    with pytest.raises(WireError, match=f"may not be named '{key}'"):
        check_batch_metadata({key: ["a"]}, 1)


def test_request_encoding_and_decoding_refuse_what_the_format_cannot_carry():
    """NaN metadata cannot be sent as strict JSON (TypeError naming the key); integer images other than uint8 and an
    empty JSON 'images' list are refused with their own reasons."""
    from flowrl.rewards.wire import WireError, decode_batch, decode_batch_png

    with pytest.raises(TypeError, match="metadata 'w' cannot be sent"):
        encode_batch(torch.rand(1, 3, 4, 4), ["a"], {"w": [float("nan")]})
    with pytest.raises(WireError, match=r"float32 in \[0, 1\] or uint8; got torch.int32"):
        decode_batch(_safetensors(torch.zeros(1, 3, 4, 4, dtype=torch.int32)))
    with pytest.raises(WireError, match="non-empty 'images' list"):
        decode_batch_png(json.dumps({"prompts": [], "images": []}).encode())


@pytest.mark.parametrize("shape", [[1, 3, "4", 4], [1, 3, -4, 4], [1, 3, True, 4], [1, 3, 4.0, 4]])
def test_a_header_shape_of_non_integers_is_refused_before_the_limits(shape):
    """Every declared dimension must be an int >= 0 (not a bool, float or string) before the pixel arithmetic."""
    from flowrl.rewards.wire import WireError, decode_batch

    with pytest.raises(WireError, match="must have shape"):
        decode_batch(_declared(shape), PixelLimits(per_image=10**6))


def _post_raw(server: RewardServer, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    """POST /score with exactly ``headers``; (status, reply body)."""
    host, port = server.httpd.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.putrequest("POST", "/score", skip_accept_encoding=True)
        for key, value in headers.items():
            conn.putheader(key, value)
        conn.endheaders(body)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def test_max_body_mb_counts_mebibytes_and_a_body_at_the_limit_is_read() -> None:
    """max_body_mb=1/1024 is 1024 bytes: a body of 1024 bytes is read (then refused as not safetensors), 1025 is 413."""
    srv = RewardServer(ink("bold"), "ink", host="127.0.0.1", port=0, max_body_mb=1 / 1024).start()
    try:
        status, error = post(srv, b"x" * 1024, SAFETENSORS)
        assert status == 400 and "not a safetensors" in error, (status, error)
        assert post(srv, b"x" * 1025, SAFETENSORS) == (
            413,
            "body of 1025 bytes exceeds the server's limit of 1024; split the batch",
        )
    finally:
        srv.stop()


def test_a_body_without_content_type_is_read_as_safetensors(server: RewardServer) -> None:
    """No Content-Type header means the safetensors format: the batch is scored and the reply is safetensors."""
    from flowrl.rewards.wire import decode_scores

    x = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    body = encode_batch(x, ["a"] * 3)
    status, reply = _post_raw(server, body, {"Content-Length": str(len(body))})
    assert status == 200, reply
    scores, allows_nan = decode_scores(reply)
    assert torch.equal(scores, ink("bold")(x, ["a"] * 3)) and allows_nan is False


def test_an_empty_token_means_no_token() -> None:
    """token="" (an unset --token) serves without auth: /info says so and requests without a token are scored."""
    srv = RewardServer(ink("bold"), "ink", host="127.0.0.1", port=0, token="").start()
    try:
        client = RemoteReward(srv.url, token="", retries=0)
        assert srv.token is None and client.info()["auth"] is False
        x = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        assert torch.equal(client(x, ["a", "b"]), ink("bold")(x, ["a", "b"]))
    finally:
        srv.stop()


def test_a_stopped_server_counts_no_new_request() -> None:
    """After stop(), begin_request answers False (the handler's 503) and counts nothing in flight."""
    srv = RewardServer(ink("bold"), "ink", host="127.0.0.1", port=0).start()
    assert srv.begin_request() is True
    srv.end_request()
    assert srv.stop(grace_s=5.0) is True
    assert srv.begin_request() is False
    assert srv._in_flight == 0


def test_a_batch_waiting_in_line_gets_503_when_the_server_stops() -> None:
    """stop() answers 503 to a batch queued behind the one being scored, and lets that one finish with its scores."""
    started, release = threading.Event(), threading.Event()

    def blocking(images: torch.Tensor, prompts: list[str], **metadata: object) -> torch.Tensor:
        started.set()
        release.wait(30)
        return images.mean(dim=(1, 2, 3))

    srv = RewardServer(blocking, "blocking", host="127.0.0.1", port=0).start()
    body = encode_batch(torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)), ["a", "b"])
    results: dict[str, object] = {}

    def call(name: str) -> None:
        results[name] = post(srv, body, SAFETENSORS)

    first = threading.Thread(target=call, args=("first",))
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=call, args=("second",))
    second.start()
    for _ in range(3000):  # until the second batch is read and waits for the scoring lock
        if srv._in_flight == 2:
            break
        time.sleep(0.01)
    assert srv._in_flight == 2
    stopper = threading.Thread(target=lambda: results.update(stopped=srv.stop(grace_s=30)))
    stopper.start()
    second.join(timeout=60)  # answered while the first batch still scores; 60 s only bounds a failure
    done = results.get("second")
    release.set()
    first.join(timeout=30)
    stopper.join(timeout=60)
    assert done == (503, "the reward server is shutting down; retry on another server")
    assert results["first"] == (200, "") and results["stopped"] is True
