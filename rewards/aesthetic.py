"""LAION aesthetic predictor: a linear MLP head on OpenAI CLIP ViT-L/14 image embeddings.

Reference: C. Schuhmann, "LAION-Aesthetics" / improved-aesthetic-predictor (2022). The head
``sac+logos+ava1-l14-linearMSE.pth`` is a ``torch.save``'d state dict of
``nn.Sequential(Linear(768, 1024), Dropout, Linear(1024, 128), Dropout, Linear(128, 64), Dropout,
Linear(64, 16), Linear(16, 1))`` under keys ``layers.0.*``, ``layers.2.*``, ``layers.4.*``,
``layers.6.*``, ``layers.7.*`` (its ReLUs are commented out, so the head is affine). Its input is
the L2-normalised CLIP ViT-L/14 image embedding; the output is a 1-10 style rating (DDPO and
Flow-GRPO use it as the "aesthetic" reward).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping, Sequence

from torch import Tensor, nn

from .clip_embedder import TransformersClipEmbedder, load_transformers_clip
from .clipscore import CLIP_L_MODEL
from .model_reward import ModelReward
from .weights import WeightSource, load_checkpoint, resolve_file

AESTHETIC_HEAD_FILE = "sac+logos+ava1-l14-linearMSE.pth"
AESTHETIC_HEAD_URL = "https://github.com/christophschuhmann/improved-aesthetic-predictor"
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(weight|bias)$")


def linear_chain_from_state(state: Mapping[str, Tensor], where: str, in_features: int | None = None) -> nn.Sequential:
    """Rebuild a stack of ``nn.Linear`` (dropouts dropped) from ``layers.N.weight/bias`` keys.

    Also accepts a single linear layer saved as ``weight``/``bias``.

    Args:
        state: the head's state dict (already stripped of any outer prefix).
        where: file or prefix named in error messages.
        in_features: expected input width (checked when given).

    Returns:
        ``nn.Sequential`` of the linear layers in index order, mapping (N, in) -> (N, 1), float32, eval mode.

    Raises:
        ValueError: unknown keys, a missing bias, layers whose widths do not chain, or an output width other than 1.
    """
    if set(state) == {"weight", "bias"}:
        pairs = {0: {"weight": state["weight"], "bias": state["bias"]}}
    else:
        pairs: dict[int, dict[str, Tensor]] = {}
        for key, value in state.items():
            match = _LAYER_KEY.match(key)
            if match is None:
                raise ValueError(
                    f"{where}: unexpected key {key!r} in a linear head; expected layers.N.weight / layers.N.bias"
                )
            pairs.setdefault(int(match.group(1)), {})[match.group(2)] = value
    layers: list[nn.Module] = []
    width = in_features
    for index in sorted(pairs):
        params = pairs[index]
        if set(params) != {"weight", "bias"} or params["weight"].ndim != 2:
            raise ValueError(f"{where}: layer {index} needs a 2-D weight and a bias; got {sorted(params)}")
        out_f, in_f = params["weight"].shape
        if width is not None and in_f != width:
            raise ValueError(
                f"{where}: layer {index} takes {in_f} features but receives {width}; the head does not fit this CLIP"
            )
        linear = nn.Linear(in_f, out_f)
        linear.load_state_dict({k: v.float() for k, v in params.items()})
        layers.append(linear)
        width = out_f
    if not layers or width != 1:
        raise ValueError(f"{where}: the head must end in one output; got width {width}")
    return nn.Sequential(*layers).eval().requires_grad_(False)


class AestheticPredictor(ModelReward):
    """``r = head(normalize(e_img))``: the LAION aesthetic rating of each image (prompts are ignored).

    Args:
        embedder: CLIP ViT-L/14 model and preprocessing.
        head: the linear stack from :func:`linear_chain_from_state`.
        batch_size: images per forward pass.
    """

    name = "aesthetic"

    def __init__(self, embedder: TransformersClipEmbedder, head: nn.Sequential, batch_size: int) -> None:
        super().__init__(embedder.device, embedder.dtype, batch_size)
        self.embedder, self.head = embedder, head.to(embedder.device)

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """Differentiable ratings (B,) float32 for images (B, 3, H, W) in [0, 1]."""
        return self.head(self.embedder.image_embeds(images))[:, 0]


def load_aesthetic_head(spec: str | None, in_features: int | None = None) -> nn.Sequential:
    """The LAION head from a ``.pth`` (``torch.load(weights_only=True)``) or ``.safetensors`` file."""
    source = WeightSource("LAION aesthetic head", "rewards.aesthetic.head")
    if spec is None:
        raise FileNotFoundError(
            f"LAION aesthetic head is not set; download {AESTHETIC_HEAD_FILE} from {AESTHETIC_HEAD_URL} "
            f"and set rewards.aesthetic.head=/path/to/{AESTHETIC_HEAD_FILE}"
        )
    path: Path = resolve_file(spec, source, AESTHETIC_HEAD_FILE)
    return linear_chain_from_state(load_checkpoint(path, nested_key="state_dict"), str(path), in_features)


def aesthetic(
    head: str | None = None,
    model: str = CLIP_L_MODEL,
    processor: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    batch_size: int = 16,
) -> AestheticPredictor:
    """LAION aesthetic predictor: a linear MLP head on normalised OpenAI CLIP ViT-L/14 image embeddings.

    Args:
        head: the head checkpoint: a local ``sac+logos+ava1-l14-linearMSE.pth`` (or ``.safetensors``),
            a folder holding it, or a hub reference "owner/repo[/file]". Required: LAION publishes
            it on GitHub, not on the hub.
        model: CLIP ViT-L/14 ``CLIPModel`` folder or hub id.
        processor: CLIP processor folder or hub id; default: the model folder.
        device: torch device.
        dtype: "float32", "bfloat16" or "float16" for CLIP (the head runs in float32).
        batch_size: images per forward pass.

    Returns:
        A reward ``(images (B, 3, H, W) in [0, 1], prompts) -> (B,) float32`` (prompts unused).
    """
    head_net = load_aesthetic_head(head, None)  # before CLIP: a missing head fails fast
    names = ("OpenAI CLIP ViT-L/14 (aesthetic backbone)", "OpenAI CLIP ViT-L/14 processor")
    embedder = load_transformers_clip("aesthetic", model, processor or model, names, device, dtype)
    width = int(embedder.model.config.projection_dim)
    if head_net[0].in_features != width:
        raise ValueError(
            f"aesthetic head takes {head_net[0].in_features}-d embeddings but the CLIP model gives {width}-d; "
            "use the head trained for this CLIP (ViT-L/14: 768)"
        )
    return AestheticPredictor(embedder, head_net, batch_size)
