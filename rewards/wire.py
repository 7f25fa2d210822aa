"""Wire format of the remote reward server (``flowrl serve-reward``).

Two encodings of a scoring request, chosen by the request's Content-Type:

- ``application/vnd.flowrl.safetensors`` (what the Python client sends): a safetensors file with
  one tensor ``images`` (float32 (B, 3, H, W) or (B, F, 3, H, W) in [0, 1], or uint8 in [0, 255]);
  its ``__metadata__`` holds ``prompts`` (JSON list of B strings) and ``metadata`` (JSON object of
  per-sample lists). The reply is a safetensors file with ``scores`` (B,) float32; its
  ``__metadata__`` says ``allows_nan``. Bit-exact, no pickle.
- ``application/json`` (for curl and non-Python clients): ``{"prompts": [...], "metadata": {...},
  "images": [PNG as base64, ...]}`` (a clip is a list of PNG frames). The reply is
  ``{"scores": [...], "allows_nan": bool}`` with ``null`` for NaN.

Errors come back as JSON ``{"error": "one line"}`` with a 4xx/5xx status.

Decoding is bounded before any pixel is unpacked: the declared size of every image (the
safetensors header's shape; a PNG's IHDR width and height) is checked against
:class:`PixelLimits`, so a small body that claims 9000x9000 images is refused with
:class:`TooLarge` (HTTP 413) instead of filling the server's memory.
"""

from __future__ import annotations

import base64
import io
import json
import math
import struct
import sys
from typing import Any, NamedTuple, Sequence

import torch
from torch import Tensor

SAFETENSORS = "application/vnd.flowrl.safetensors"
JSON = "application/json"
WIRE_VERSION = "1"


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class WireError(ValueError):
    """A request or reply body that does not follow the wire format."""


class TooLarge(WireError):
    """A request whose images, once decoded, would exceed the server's :class:`PixelLimits`."""


class PixelLimits(NamedTuple):
    """Most pixels (height x width, per frame) a server decodes; None = no limit.

    Attributes:
        per_image: pixels of one image or one frame of a clip (``--max-image-pixels``).
        per_request: pixels of every image and frame of one request (``--max-request-pixels``).
    """

    per_image: int | None = None
    per_request: int | None = None


def check_pixels(sizes: Sequence[tuple[int, int]], limits: PixelLimits | None, count: int = 1) -> None:
    """Refuse a request whose declared image sizes exceed ``limits``, before anything is decoded.

    Arithmetic on the declared sizes only: a header that declares 10^12 images costs no more to refuse
    than one that declares one.

    Args:
        sizes: (height, width) of every image (every frame of every clip) in the request, or of
            every ``count`` of them (a safetensors batch declares one size for all its images).
        limits: the server's limits (None: no limit).
        count: how many images each entry of ``sizes`` stands for.

    Raises:
        TooLarge: an image, or the request as a whole, holds too many pixels.
    """
    if limits is None:
        return
    if limits.per_image is not None:
        for i, (h, w) in enumerate(sizes):
            if h * w > limits.per_image:
                raise TooLarge(
                    f"image {i * count} is {w}x{h} ({h * w} pixels), over the server's limit of {limits.per_image} "
                    "per image (--max-image-pixels); send smaller images"
                )
    total = count * sum(h * w for h, w in sizes)
    if limits.per_request is not None and total > limits.per_request:
        raise TooLarge(
            f"request holds {count * len(sizes)} images of {total} pixels in all, over the server's limit of "
            f"{limits.per_request} per request (--max-request-pixels); send smaller batches (batch_size)"
        )


def _loads(text: bytes | str, what: str) -> Any:
    """``json.loads`` with every failure (bad UTF-8 or JSON, nesting too deep, a too long integer) as one WireError."""
    try:
        return json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WireError(f"{what} is not JSON ({err})") from None
    except RecursionError:
        raise WireError(f"{what} is JSON nested too deeply; send flat lists and objects") from None
    except ValueError:  # an integer over sys.get_int_max_str_digits() digits: Python refuses to convert it
        digits = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        raise WireError(f"{what} holds an integer of over {digits} digits; send shorter numbers") from None


def _json_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in metadata.items():
        value = value.tolist() if isinstance(value, Tensor) else value
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"metadata {key!r} cannot be sent to a remote reward ({err}); use lists of str, numbers, bools or None"
            ) from None
        out[str(key)] = value
    return out


def _header(body: bytes) -> dict[str, Any]:
    """The JSON header of a safetensors buffer (first 8 bytes: little-endian header length)."""
    if len(body) < 8:
        raise WireError(f"body of {len(body)} bytes is not a safetensors file")
    (size,) = struct.unpack("<Q", body[:8])
    if size > len(body) - 8:
        raise WireError(f"body is not a safetensors file (its header length {size} exceeds the {len(body)}-byte body)")
    header = _loads(body[8 : 8 + size], "the safetensors header")
    if not isinstance(header, dict):
        raise WireError("body is not a safetensors file (header is not a JSON object)")
    return header


def _declared_sizes(header: dict[str, Any]) -> tuple[int, tuple[int, int]]:
    """How many images and frames the header's ``images`` tensor declares, and their (height, width)."""
    entry = header.get("images")
    if not isinstance(entry, dict):
        raise WireError(f"request holds tensors {sorted(k for k in header if k != '__metadata__')}; expected 'images'")
    shape, dtype = entry.get("shape"), entry.get("dtype")
    if dtype not in ("F32", "U8"):
        raise WireError(f"images must be float32 in [0, 1] or uint8; got safetensors dtype {dtype!r}")
    ok = isinstance(shape, list) and all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**64 for d in shape
    )  # safetensors dimensions are u64: a larger one is no shape (and its pixel count would be too long to print)
    if not ok or len(shape) not in (4, 5) or shape[-3] != 3:
        raise WireError(f"images must have shape (B, 3, H, W) or (B, F, 3, H, W); got {shape!r}")
    return math.prod(shape[:-3]), (shape[-2], shape[-1])


def _load(body: bytes, limits: PixelLimits | None = None) -> tuple[dict[str, Tensor], dict[str, str]]:
    from safetensors.torch import load

    header = _header(body)
    if limits is not None:
        count, size = _declared_sizes(header)
        check_pixels([size], limits, count)
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise WireError("the safetensors __metadata__ must be an object of strings")
    try:
        tensors = load(body)
    except Exception as err:  # noqa: BLE001 - any parse failure is a malformed body
        raise WireError(
            f"body is not a valid safetensors file ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
        ) from None
    return tensors, meta


def _images_to_float(images: Tensor) -> Tensor:
    if images.dtype == torch.uint8:
        return images.float() / 255.0
    if not images.is_floating_point():
        raise WireError(f"images must be float32 in [0, 1] or uint8; got {images.dtype}")
    return images.float()


def encode_batch(
    images: Tensor, prompts: Sequence[str], metadata: dict[str, Any] | None = None, *, dtype: str = "float32"
) -> bytes:
    """A scoring request as safetensors bytes.

    Args:
        images: (B, 3, H, W) or (B, F, 3, H, W) float in [0, 1].
        prompts: B prompts.
        metadata: per-sample lists (JSON-serialisable).
        dtype: "float32" (exact) or "uint8" (``round(255 x)``: 4x smaller, 8-bit like a PNG).

    Returns:
        The request body.
    """
    from safetensors.torch import save

    header = {
        "flowrl_wire": WIRE_VERSION,
        "prompts": json.dumps(list(prompts)),
        "metadata": json.dumps(_json_metadata(dict(metadata or {}))),
    }
    pixels = images.detach().to("cpu", torch.float32)
    if dtype == "uint8":
        pixels = (pixels.clamp(0, 1) * 255).round().to(torch.uint8)
    elif dtype != "float32":
        raise ValueError(f"wire dtype must be 'float32' or 'uint8'; got {dtype!r}")
    return save({"images": pixels.contiguous()}, metadata=header)


def decode_batch(body: bytes, limits: PixelLimits | None = None) -> tuple[Tensor, list[str], dict[str, Any]]:
    """Inverse of :func:`encode_batch`: (images float32, prompts, metadata).

    Args:
        body: the request body.
        limits: refuse images larger than this, from the header, before loading any tensor.

    Raises:
        TooLarge: the declared images exceed ``limits``.
        WireError: the body is not a request in this format.
    """
    tensors, meta = _load(body, limits)
    if "images" not in tensors:
        raise WireError(f"request holds tensors {sorted(tensors)}; expected one named 'images'")
    prompts = _loads(str(meta.get("prompts", "null")), "request 'prompts'")
    metadata = _loads(str(meta.get("metadata", "{}")), "request 'metadata'")
    return _images_to_float(tensors["images"]), _check_prompts(prompts), _check_metadata(metadata)


def _check_prompts(prompts: Any) -> list[str]:
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise WireError("request 'prompts' must be a list of strings")
    return prompts


def _check_metadata(metadata: Any) -> dict[str, Any]:
    if not isinstance(metadata, dict):
        raise WireError("request 'metadata' must be a JSON object of per-sample lists")
    return metadata


def check_batch_metadata(metadata: dict[str, Any], batch: int) -> None:
    """Refuse request metadata a reward cannot be called with: the contract's per-sample lists of ``batch`` values.

    Raises:
        WireError: a key that is one of the reward's own arguments, or a value that is not a list of ``batch``.
    """
    for key, value in metadata.items():
        if key in ("images", "prompts"):
            raise WireError(f"request metadata may not be named {key!r} (the reward's own argument); rename it")
        if not isinstance(value, list) or len(value) != batch:
            got = f"{len(value)} values" if isinstance(value, list) else f"a value of type {type(value).__name__}"
            raise WireError(f"request metadata {key!r} must be a list of one value per image ({batch}); got {got}")


def encode_scores(scores: Tensor, allows_nan: bool) -> bytes:
    """A reply: scores (B,) float32 as safetensors, with ``allows_nan`` in the metadata."""
    from safetensors.torch import save

    meta = {"flowrl_wire": WIRE_VERSION, "allows_nan": "1" if allows_nan else "0"}
    return save({"scores": scores.detach().to("cpu", torch.float32).contiguous()}, metadata=meta)


def decode_scores(body: bytes) -> tuple[Tensor, bool]:
    """Inverse of :func:`encode_scores`: (scores, allows_nan).

    Raises:
        WireError: not a reply in this format.
    """
    tensors, meta = _load(body)
    if set(tensors) != {"scores"}:
        raise WireError(f"reply holds tensors {sorted(tensors)}; expected one named 'scores'")
    return tensors["scores"], meta.get("allows_nan") == "1"


def _png(image: Tensor) -> str:
    from PIL import Image

    pixels = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def png_size(text: Any) -> tuple[int, int]:
    """(height, width) of a base64 PNG from its IHDR chunk, decoding only its first 24 bytes.

    Raises:
        WireError: ``text`` is not a base64 string starting like a PNG.
    """
    if not isinstance(text, str):
        raise WireError("each image must be a base64 PNG string (a clip: a list of them)")
    try:
        head = base64.b64decode(text[:32], validate=True)
    except ValueError:
        raise WireError("an image is not base64 (send each PNG base64-encoded)") from None
    if len(head) < 24 or head[:8] != PNG_SIGNATURE or head[12:16] != b"IHDR":
        raise WireError("an image is not a PNG (send each image as a base64 PNG)")
    width, height = struct.unpack(">II", head[16:24])
    return height, width


def _unpng(text: Any) -> Tensor:
    from PIL import Image

    if not isinstance(text, str):
        raise WireError("each image must be a base64 PNG string (a clip: a list of them)")
    try:
        with Image.open(io.BytesIO(base64.b64decode(text, validate=True))) as img:
            rgb = img.convert("RGB")
            pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).reshape(rgb.height, rgb.width, 3)
    except WireError:
        raise
    except Exception as err:  # noqa: BLE001 - PIL/base64 raise many types for bad input
        raise WireError(
            f"an image is not a base64 PNG ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        ) from None
    return pixels.permute(2, 0, 1).float() / 255.0


def encode_batch_png(images: Tensor, prompts: Sequence[str], metadata: dict[str, Any] | None = None) -> bytes:
    """A scoring request as JSON with base64 PNG images (8 bits per channel: lossy).

    Args:
        images: (B, 3, H, W) or (B, F, 3, H, W) float in [0, 1].
        prompts: B prompts.
        metadata: per-sample lists (JSON-serialisable).

    Returns:
        The UTF-8 JSON request body.
    """
    encoded = [[_png(f) for f in item] if images.ndim == 5 else _png(item) for item in images]
    body = {"prompts": list(prompts), "metadata": _json_metadata(dict(metadata or {})), "images": encoded}
    return json.dumps(body).encode()


def _png_sizes(items: list[Any]) -> list[tuple[int, int]]:
    """(height, width) of every PNG in a request's ``images`` (strings, or non-empty lists of them)."""
    sizes = []
    for item in items:
        if isinstance(item, list) and not item:
            raise WireError("a clip in 'images' is an empty list; send at least one base64 PNG frame")
        sizes.extend(png_size(frame) for frame in (item if isinstance(item, list) else [item]))
    return sizes


def decode_batch_png(body: bytes, limits: PixelLimits | None = None) -> tuple[Tensor, list[str], dict[str, Any]]:
    """Inverse of :func:`encode_batch_png`: (images float32 in [0, 1], prompts, metadata).

    Args:
        body: the UTF-8 JSON request body.
        limits: refuse images larger than this, from each PNG's IHDR, before decoding any.

    Raises:
        TooLarge: the declared images exceed ``limits``.
        WireError: malformed JSON, images of different sizes, or an image that is not a PNG.
    """
    data = _loads(body, "request")
    if not isinstance(data, dict) or not isinstance(data.get("images"), list) or not data["images"]:
        raise WireError("JSON request must be an object with a non-empty 'images' list of base64 PNGs")
    check_pixels(_png_sizes(data["images"]), limits)
    try:
        items = [
            torch.stack([_unpng(f) for f in item]) if isinstance(item, list) else _unpng(item)
            for item in data["images"]
        ]
        images = torch.stack(items)
    except RuntimeError as err:
        raise WireError(f"images differ in size or frame count ({str(err).splitlines()[0]})") from None
    return images, _check_prompts(data.get("prompts")), _check_metadata(data.get("metadata", {}))


def encode_scores_json(scores: Tensor, allows_nan: bool) -> bytes:
    """A JSON reply ``{"scores": [...], "allows_nan": bool}`` (NaN written as null)."""
    values = [None if math.isnan(v) else v for v in scores.detach().double().cpu().tolist()]
    return json.dumps({"scores": values, "allows_nan": allows_nan}).encode()


def decode_scores_json(body: bytes) -> tuple[Tensor, bool]:
    """Inverse of :func:`encode_scores_json`: (scores (B,) float32, allows_nan).

    Raises:
        WireError: not a reply in this format.
    """
    try:
        data = json.loads(body)
        values = [math.nan if v is None else float(v) for v in data["scores"]]
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, KeyError, TypeError, ValueError) as err:
        raise WireError(f"reply is not a JSON object with a 'scores' list of numbers ({type(err).__name__})") from None
    return torch.tensor(values, dtype=torch.float32), bool(data.get("allows_nan", False))
