"""CLIP image and text embeddings for rewards, through transformers' ``CLIPModel``.

PickScore, CLIPScore, the LAION aesthetic predictor and HPSv2 (conversion path) all reduce to
unit-norm CLIP embeddings: ``e_img = normalize(visual_projection(vision_model(pixels).pooler_output))``
and ``e_txt = normalize(text_projection(text_model(ids).pooler_output))`` (Radford et al. 2021,
"Learning Transferable Visual Models From Natural Language Supervision").
"""

from __future__ import annotations

import pickle
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .image_preprocess import clip_pixels
from .weights import WeightSource, pickle_refusal, resolve_model_folder, torch_dtype


class ClipEmbedder:
    """Unit-norm CLIP embeddings with differentiable preprocessing.

    Subclasses implement ``_encode_image(pixels) -> (B, D)`` and ``_encode_text(prompts) -> (U, D)``
    (raw projected features). Identical prompts in a batch are encoded once.

    Args:
        image_size: shorter-side resize (or output side with ``longest_pad``).
        crop: (h, w) centre crop.
        mean: per-channel normalisation mean.
        std: per-channel normalisation std.
        longest_pad: resize the longer side and zero-pad (open_clip ``ResizeMaxSize``).
        device: where the model runs.
        dtype: the model's parameter dtype (pixels are cast to it).
    """

    def __init__(
        self,
        *,
        image_size: int,
        crop: tuple[int, int],
        mean: Sequence[float],
        std: Sequence[float],
        longest_pad: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.image_size, self.crop = image_size, crop
        self.mean, self.std, self.longest_pad = tuple(mean), tuple(std), longest_pad
        self.device, self.dtype = device, dtype

    def pixels(self, images: Tensor) -> Tensor:
        """Model inputs (B, 3, h, w) in the model dtype from images (B, 3, H, W) in [0, 1]."""
        x = clip_pixels(
            images.to(self.device),
            self.image_size,
            crop=self.crop,
            mean=self.mean,
            std=self.std,
            longest_pad=self.longest_pad,
        )
        return x.to(self.dtype)

    def image_embeds(self, images: Tensor) -> Tensor:
        """Unit image embeddings (B, D) float32 (differentiable)."""
        return F.normalize(self._encode_image(self.pixels(images)).float(), dim=-1)

    def text_embeds(self, prompts: Sequence[str]) -> Tensor:
        """Unit text embeddings (B, D) float32; each distinct prompt is encoded once."""
        unique = list(dict.fromkeys(prompts))
        feats = F.normalize(self._encode_text(unique).float(), dim=-1)
        index = torch.tensor([unique.index(p) for p in prompts], device=feats.device)
        return feats[index]

    def _encode_image(self, pixels: Tensor) -> Tensor:
        raise NotImplementedError

    def _encode_text(self, prompts: list[str]) -> Tensor:
        raise NotImplementedError


class TransformersClipEmbedder(ClipEmbedder):
    """:class:`ClipEmbedder` over a transformers ``CLIPModel`` and its tokenizer.

    Args:
        model: a ``transformers.CLIPModel`` (eval mode, no grad on its parameters).
        tokenizer: the CLIP tokenizer; prompts are truncated to the model's text positions.
        **geometry: :class:`ClipEmbedder` arguments.
    """

    def __init__(self, model: Any, tokenizer: Any, **geometry: Any) -> None:
        super().__init__(**geometry)
        self.model, self.tokenizer = model, tokenizer
        self.max_length = int(model.config.text_config.max_position_embeddings)

    @property
    def logit_scale(self) -> Tensor:
        """``exp(logit_scale)`` of the model, float32 scalar."""
        return self.model.logit_scale.detach().float().exp()

    def _encode_image(self, pixels: Tensor) -> Tensor:
        pooled = self.model.vision_model(pixel_values=pixels).pooler_output
        return self.model.visual_projection(pooled)

    def _encode_text(self, prompts: list[str]) -> Tensor:
        tokens = self.tokenizer(prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        out = self.model.text_model(
            input_ids=tokens["input_ids"].to(self.device), attention_mask=tokens["attention_mask"].to(self.device)
        )
        return self.model.text_projection(out.pooler_output)


def quiet_transformers() -> None:
    """Hide transformers' loading bars and info logs (warnings and errors still show)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def load_clip_model(spec: str, source: WeightSource, device: torch.device, dtype: torch.dtype) -> Any:
    """A frozen ``transformers.CLIPModel`` from a local folder or hub id, on ``device`` in ``dtype``."""
    folder = resolve_model_folder(spec, source)  # before importing transformers: missing weights fail fast
    from transformers import CLIPModel

    quiet_transformers()
    try:
        model = CLIPModel.from_pretrained(str(folder), dtype=dtype)
    except pickle.UnpicklingError as err:  # a pytorch_model.bin torch's weights_only loader refuses
        raise ValueError(pickle_refusal(source.model, folder, err)) from None
    return model.to(device).eval().requires_grad_(False)


def load_clip_processor(spec: str, source: WeightSource) -> tuple[Any, dict[str, Any]]:
    """The tokenizer and pixel geometry of a CLIP processor folder (or hub id).

    Returns:
        ``(tokenizer, geometry)`` where geometry holds ``image_size`` (shorter side), ``crop``
        (h, w), ``mean`` and ``std`` read from the folder's ``preprocessor_config.json``.
    """
    folder = resolve_model_folder(spec, source, weights=False)
    from transformers import AutoImageProcessor, AutoTokenizer

    quiet_transformers()
    if not (folder / "preprocessor_config.json").is_file():
        raise FileNotFoundError(
            f"{source.model}: {folder} has no preprocessor_config.json; "
            f"set {source.config_key} to a CLIP processor folder"
        )
    image_processor = AutoImageProcessor.from_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    size, crop = image_processor.size, image_processor.crop_size
    short = size.shortest_edge or size.height
    geometry = {
        "image_size": int(short),
        "crop": (int(crop.height), int(crop.width)),
        "mean": tuple(float(m) for m in image_processor.image_mean),
        "std": tuple(float(s) for s in image_processor.image_std),
    }
    return tokenizer, geometry


def load_transformers_clip(
    reward: str, model: str, processor: str, names: tuple[str, str], device: str, dtype: str
) -> TransformersClipEmbedder:
    """Load a reward's CLIP model and its processor into a :class:`TransformersClipEmbedder`.

    Args:
        reward: the reward's name; errors name its options ``rewards.<reward>.model`` and ``.processor``.
        model: local ``CLIPModel`` folder or hub id.
        processor: local CLIP processor folder or hub id.
        names: (model, processor) as named in messages, e.g. ("PickScore_v1", "PickScore's CLIP-H processor").
        device: torch device for the model.
        dtype: "float32", "bfloat16" or "float16" for the model weights.
    """
    device, dtype = torch.device(device), torch_dtype(dtype)
    model_source = WeightSource(names[0], f"rewards.{reward}.model")
    processor_source = WeightSource(names[1], f"rewards.{reward}.processor")
    resolve_model_folder(model, model_source)  # both folders are checked before anything heavy loads
    tokenizer, geometry = load_clip_processor(processor, processor_source)
    clip = load_clip_model(model, model_source, device, dtype)
    return TransformersClipEmbedder(clip, tokenizer, longest_pad=False, device=device, dtype=dtype, **geometry)
