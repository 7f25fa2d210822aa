"""Adapter for Wan2.1 / Wan2.2 text-to-video pipelines (``WanPipeline`` parts).

Wraps the UMT5 (or any T5) text encoder through the pipeline's own ``encode_prompt``, the
``WanTransformer3DModel`` as the velocity model on video latents (B, C, F, H, W), and the
``AutoencoderKLWan`` for decoding with its per-channel ``latents_mean`` / ``latents_std``.

Timesteps follow ``WanPipeline``: the flow-matching scheduler's timestep is ``1000 * sigma``
(``num_train_timesteps * sigma``) in fp32, and the transformer's output is the velocity
``eps - x0`` directly.

Wan2.2-A14B is a two-expert model: ``transformer`` denoises the high-noise steps
(``timestep >= boundary_ratio * 1000``) and ``transformer_2`` the low-noise ones. ``velocity``
picks the expert per sample by sigma, exactly as the pipeline does. ``lora_expert`` (model card
key) says which expert LoRA trains: "high" (``transformer``), "low" (``transformer_2``) or "both"
(one adapter spanning the two, :class:`~flowrl.models.wan_experts.WanExperts`; the default when the
pipeline has two experts);
an expert without LoRA stays frozen at its base weights. :meth:`WanAdapter.save_lora` writes the
high expert's LoRA as ``pytorch_lora_weights.safetensors`` and the low expert's as
``pytorch_lora_weights_transformer_2.safetensors``; :meth:`WanAdapter.load_lora` (or diffusers'
``pipe.load_lora_weights(dir, weight_name=..., load_into_transformer_2=True)`` for the second file)
loads them back. Wan2.2-TI2V-5B (``expand_timesteps``) gets per-token timesteps as in the pipeline.

References:
    Wan Team, "Wan: Open and Advanced Large-Scale Video Generative Models", 2025.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from .adapter import AdapterBase, Cond, freeze_modules, lora_metadata, select_cond
from .sd3 import card_resolution, read_model_card
from .wan_experts import WanExperts, split_expert_state

WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # self- and cross-attention of every block
DEFAULT_RESOLUTION = (480, 832)  # Wan2.1-T2V-1.3B's native 480p
DEFAULT_FRAMES = 81
DEFAULT_SHIFT = 3.0  # Wan2.1 480p flow_shift (5.0 for 720p; Wan2.2-A14B uses 12.0)
EXPERTS = ("high", "low", "both")
LORA_FILES = {"high": "pytorch_lora_weights.safetensors", "low": "pytorch_lora_weights_transformer_2.safetensors"}


def decode_wan(vae: Any, latents: Tensor) -> Tensor:
    """Latents (B, C, F_lat, h, w) -> videos (B, F, 3, H, W) in [0, 1], float32.

    Decodes through ``AutoencoderKLWan`` with its per-channel mean and std.
    """
    cfg = vae.config
    z = latents.to(vae.device, vae.dtype)
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z)
    video = vae.decode(z / inv_std + mean, return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
    return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).contiguous()


class WanAdapter(AdapterBase):
    """Model adapter over a ``WanPipeline`` (text-to-video).

    Args:
        pipe: a loaded ``WanPipeline``.
        max_sequence_length: text token length (Wan uses 512).
        resolution: default (height, width).
        num_frames: default frame count (``4k + 1``).
        lora_expert: the expert(s) LoRA trains: "high", "low" or "both"; None = "both" for a
            two-expert pipeline (Wan2.2-A14B), "high" (the only one) otherwise.
        shift: the model's recommended flow shift (``default_shift``; configs set
            ``sampler.schedule: shift`` and ``sampler.shift`` from it).
        model_id: name used in the prompt cache's fingerprint (the folder or hub id).

    Raises:
        ValueError: an unknown or missing ``lora_expert``.
    """

    lora_target_modules = WAN_LORA_TARGETS
    guidance = "cfg"
    decode_latents = staticmethod(decode_wan)

    def __init__(
        self,
        pipe: Any,
        *,
        max_sequence_length: int = 512,
        resolution: tuple[int, int] | None = None,
        num_frames: int = DEFAULT_FRAMES,
        lora_expert: str | None = None,
        shift: float | None = None,
        model_id: str | None = None,
    ):
        if lora_expert is None:
            lora_expert = "both" if getattr(pipe, "transformer_2", None) is not None else "high"
        if lora_expert not in EXPERTS:
            raise ValueError(f"Wan lora_expert must be 'high', 'low' or 'both'; got {lora_expert!r}")
        self.pipe = pipe
        self.model_id = model_id or "WanAdapter"
        self.experts = {"high": pipe.transformer, "low": getattr(pipe, "transformer_2", None)}
        if lora_expert != "high" and self.experts["low"] is None:
            raise ValueError(
                f"lora_expert='{lora_expert}' but this Wan pipeline has no transformer_2 (Wan2.1); use 'high'"
            )
        self.lora_expert = lora_expert
        both = lora_expert == "both"
        self.transformer = WanExperts(self.experts["high"], self.experts["low"]) if both else self.experts[lora_expert]
        ratio = pipe.config.boundary_ratio if self.experts["low"] is not None else None
        self.boundary_timestep = None if ratio is None else float(ratio) * pipe.scheduler.config.num_train_timesteps
        self.num_train_timesteps = float(pipe.scheduler.config.num_train_timesteps)
        self.vae = pipe.vae
        self.max_sequence_length = max_sequence_length
        self.dtype = self.transformer.dtype
        self.default_resolution = tuple(resolution) if resolution else DEFAULT_RESOLUTION
        self.default_num_frames = num_frames
        sched = pipe.scheduler.config
        self.default_shift = float(shift or sched.get("flow_shift") or sched.get("shift") or DEFAULT_SHIFT)
        self.latent_shape(*self.default_resolution)  # validates the defaults
        freeze_modules(pipe.transformer, self.experts["low"], pipe.vae, pipe.text_encoder, self.transformer)

    @property
    def transformer(self) -> nn.Module:
        """The trained module: the ``lora_expert`` expert, or both experts in a :class:`WanExperts`."""
        return self._transformer

    @transformer.setter
    def transformer(self, module: nn.Module) -> None:
        """Swap the trained module (e.g. Sol-RL's explore copy); :meth:`velocity` runs the experts it holds."""
        if isinstance(module, WanExperts):
            self.experts = {"high": module.high, "low": module.low}
        elif self.lora_expert == "both":
            raise TypeError(f"a two-expert Wan model's transformer is a WanExperts; got {type(module).__name__}")
        else:
            self.experts = {**self.experts, self.lora_expert: module}
        self._transformer = module

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", model_id: str | None = None
    ) -> "WanAdapter":
        """Load a local diffusers ``WanPipeline`` folder (or hub id).

        Dtype policy: transformer(s) and text encoder in ``dtype``; the VAE stays fp32 (Wan's video
        VAE degrades in half precision and is small next to the transformer).

        Raises:
            FileNotFoundError: weights are missing or incomplete (one line with the download command).
            ValueError: a component needs the folder's own code (``trust_remote_code`` stays off).
        """
        from diffusers import AutoencoderKLWan, WanPipeline

        from .hub import KNOWN_REPOS, missing_weights_message

        card = read_model_card(path) if Path(path).is_dir() else {}
        try:
            vae = AutoencoderKLWan.from_pretrained(str(path), subfolder="vae", dtype=torch.float32)
            pipe = WanPipeline.from_pretrained(str(path), vae=vae, dtype=dtype)
        except (OSError, ValueError) as err:
            if "trust_remote_code" in str(err):  # custom code, not missing weights: load_adapter says so in one line
                raise
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise FileNotFoundError(missing_weights_message(str(path), reason, KNOWN_REPOS["WanPipeline"])) from None
        pipe = pipe.to(device)
        pipe.vae.to(torch.float32)
        pipe.set_progress_bar_config(disable=True)
        return cls(
            pipe,
            max_sequence_length=int(card.get("max_sequence_length", 512)),
            resolution=card_resolution(card),
            num_frames=int(card.get("num_frames", DEFAULT_FRAMES)),
            lora_expert=card.get("lora_expert"),
            shift=card.get("shift"),
            model_id=model_id or str(path),
        )

    @torch.no_grad()
    def encode_prompt(self, prompts: Sequence[str]) -> Cond:
        """Encode B prompts in one call with the T5 encoder (padding beyond each prompt is zero).

        Returns:
            ``{"encoder_hidden_states": (B, max_sequence_length, D)}`` in the model dtype.
        """
        embeds, _ = self.pipe.encode_prompt(
            prompt=list(prompts),
            do_classifier_free_guidance=False,
            num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return {"encoder_hidden_states": embeds.to(self.dtype)}

    def expert_for(self, sigma: Tensor) -> Tensor:
        """(B,) bool: True where the high-noise expert (``transformer``) denoises."""
        t = (sigma * self.num_train_timesteps).float()
        if self.boundary_timestep is None:
            return torch.ones_like(t, dtype=torch.bool)
        return t >= self.boundary_timestep

    def _run(self, transformer: Any, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        timestep = (sigma * self.num_train_timesteps).float().to(x.device)  # fp32 (UniPC would floor it)
        if self.pipe.config.expand_timesteps:  # Wan2.2-TI2V: one timestep per latent token
            _, p_h, p_w = transformer.config.patch_size
            tokens = x.shape[2] * (x.shape[3] // p_h) * (x.shape[4] // p_w)
            timestep = timestep[:, None].expand(-1, tokens)
        return transformer(
            hidden_states=x.to(transformer.dtype),
            timestep=timestep,
            encoder_hidden_states=cond["encoder_hidden_states"].to(transformer.dtype),
            return_dict=False,
        )[0]

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """Velocity (B, C, F, H, W) at sigma (B,), from the expert that owns each sample's sigma."""
        sigma = sigma.to(x.device)
        high = self.expert_for(sigma)
        if bool(high.all()):
            return self._run(self.experts["high"], x, sigma, cond)
        if not bool(high.any()):
            return self._run(self.experts["low"], x, sigma, cond)
        v_high = self._run(self.experts["high"], x[high], sigma[high], select_cond(cond, high))
        v_low = self._run(self.experts["low"], x[~high], sigma[~high], select_cond(cond, ~high))
        out = v_high.new_empty((x.shape[0], *v_high.shape[1:]))
        out[high] = v_high
        out[~high] = v_low.to(v_high.dtype)
        return out

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """(C, (frames - 1) / t + 1, H / s, W / s) with Wan's VAE factors (t = 4, s = 8 for Wan2.1).

        Raises:
            ValueError: frames not of the form ``t k + 1``, or a resolution the patches do not tile.
        """
        frames = self.default_num_frames if frames is None else frames
        t, s = self.pipe.vae_scale_factor_temporal, self.pipe.vae_scale_factor_spatial
        if frames < 1 or (frames - 1) % t:
            raise ValueError(f"Wan model.num_frames must be {t}k + 1 (e.g. 33, 81); got {frames}")
        _, p_h, p_w = self.transformer.config.patch_size
        if height % (s * p_h) or width % (s * p_w):
            raise ValueError(f"Wan resolution must be a multiple of {s * p_h}x{s * p_w}; got {height}x{width}")
        return (self.transformer.config.in_channels, (frames - 1) // t + 1, height // s, width // s)

    def _lora_parts(self, lora_state: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
        """The LoRA state per trained expert ("high" / "low")."""
        if self.lora_expert == "both":
            return split_expert_state(lora_state)
        return {self.lora_expert: lora_state}

    def save_lora(self, directory: str | Path, lora_state: dict[str, Tensor]) -> Path:
        """Write the LoRA in the layout ``WanPipeline.load_lora_weights`` reads, one file per expert.

        Returns:
            The path of the first file written (the high expert's, or the low expert's when only
            it is trained). The low expert's file loads with ``load_into_transformer_2=True``.
        """
        from diffusers import WanPipeline

        config = lora_metadata(self.transformer)
        written = []
        for expert, weights in self._lora_parts(lora_state).items():
            WanPipeline.save_lora_weights(
                str(directory),
                transformer_lora_layers=weights,
                weight_name=LORA_FILES[expert],
                transformer_lora_adapter_metadata=config,
            )
            written.append(Path(directory) / LORA_FILES[expert])
        return written[0]

    def load_lora(self, directory: str | Path) -> None:
        """Load LoRA files written by :meth:`save_lora` into the pipeline's experts (diffusers' loader).

        A single ``.safetensors`` file goes to the expert its name says: the low-noise expert for
        ``pytorch_lora_weights_transformer_2.safetensors``, the high-noise expert for any other name.

        Raises:
            FileNotFoundError: no LoRA file for this model's experts in ``directory``, or a low-noise-expert
                LoRA for a pipeline without ``transformer_2``.
        """
        path = Path(directory)
        if path.is_file():
            expert = "low" if path.name == LORA_FILES["low"] else "high"
            self._load_expert_lora(path.parent, path.name, expert)
            return
        found = [e for e, name in LORA_FILES.items() if (path / name).is_file()]
        if not found:
            raise FileNotFoundError(
                f"no Wan LoRA ({' or '.join(LORA_FILES.values())}) in {directory}; pass the run's lora/ folder"
            )
        for expert in found:
            self._load_expert_lora(path, LORA_FILES[expert], expert)

    def _load_expert_lora(self, folder: Path, weight_name: str, expert: str) -> None:
        """``pipe.load_lora_weights`` of ``folder / weight_name`` into the "high" or "low" expert."""
        if expert == "low" and self.experts["low"] is None:
            raise FileNotFoundError(
                f"{folder / weight_name} is a low-noise-expert LoRA but this Wan pipeline has no transformer_2"
            )
        self.pipe.load_lora_weights(str(folder), weight_name=weight_name, load_into_transformer_2=expert == "low")
