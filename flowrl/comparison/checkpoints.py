"""Aligned checkpoints of run folders, loaded once into their base model as named LoRA adapters.

A run folder (``flowrl train`` output) offers up to three checkpoints: its final LoRA (``lora/``,
the weights the run ships) and, when its newest checkpoint holds an EMA adapter (DiffusionNFT,
AWM), the trained and the EMA adapters of that checkpoint. :class:`CheckpointBank` loads each base
model once, attaches every checkpoint to its denoiser as a named peft adapter and switches between
them; the policy stack around it comes from :func:`flowrl.policy.build_policy`, the builder that
training and ``flowrl sample`` use, with the run's own config. ``flowrl eval``, ``flowrl gallery``
and ``flowrl demo`` all sample through here.
"""

from __future__ import annotations

import copy
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Iterator, Literal, Sequence

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..config import Config
    from ..models.adapter import ModelAdapter
    from ..policy import Policy

logger = logging.getLogger(__name__)
Kind = Literal["base", "final", "trained", "ema"]
RUN_CONFIG = "config.yaml"
FINAL_LORA = "lora"
EMBEDDED_MODEL = "flowrl-digits"  # its base model is offered as plain "base"


@dataclass(frozen=True)
class Checkpoint:
    """One selectable model: the base model, or a LoRA of a run.

    Attributes:
        label: the name shown in tables and the demo ("base", "<run>", "<run> · ema", ...).
        kind: "base", "final" (the run's ``lora/``), "trained" or "ema" (its newest checkpoint's adapters).
        run_dir: the run folder (None for a base model that belongs to no run).
        model_path: ``model.path`` of the base model.
    """

    label: str
    kind: Kind
    run_dir: Path | None
    model_path: str


def read_run_config(run_dir: str | Path) -> Config:
    """The validated config a run was trained with (its resolved ``config.yaml``).

    Raises:
        FileNotFoundError: the folder holds no ``config.yaml`` (not a run folder).
        ValueError: the config is empty or does not validate (one line naming the file).
    """
    from ..config import load_config
    from ..outputs import check_run_config

    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no {RUN_CONFIG}); pass a folder `flowrl train` wrote")
    return load_config(check_run_config(path, "restore it from the run's backup, or leave the run out"))


def run_guards(run_dir: str | Path) -> dict[str, dict[str, Any]]:
    """The reward guards of a run's ``guards:`` section: name -> reward options ({} when it has none).

    Monitors (``diversity``) are left out: no reward scores them, and the table reports diversity anyway.
    """
    return config_guards(read_run_config(run_dir))


def config_guards(cfg: Config) -> dict[str, dict[str, Any]]:
    """The reward guards of a run config's ``guards:`` section (see :func:`run_guards`)."""
    from ..guard_spec import parse_guards

    return {g.name: dict(g.options) for g in parse_guards(cfg.guards, cfg.rewards) if not g.is_monitor}


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a run folder with a final LoRA (``config.yaml`` and ``lora/``)."""
    return (path / RUN_CONFIG).is_file() and (path / FINAL_LORA).is_dir()


def find_runs(folder: str | Path) -> list[Path]:
    """Run folders at ``folder`` itself or one level below it, sorted by name ([] when there is none)."""
    root = Path(folder)
    if is_run_dir(root):
        return [root]
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and is_run_dir(p))


def _newest_adapters(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest verified checkpoint's folder and state, when it holds extra adapters (EMA); else None.

    A run whose checkpoints all fail verification offers only its final LoRA, with a logged warning
    naming why (a run without checkpoints offers it silently).
    """
    from ..resume import latest_good_checkpoint

    try:
        found = latest_good_checkpoint(run_dir)
    except FileNotFoundError:
        return None
    except ValueError as err:
        logger.warning("%s: only its final LoRA is offered, no checkpoint adapters: %s", run_dir, err)
        return None
    return (found.path, found.state) if found.state.get("adapters", {}).get("ema") else None


def run_checkpoints(run_dir: str | Path, label: str | None = None) -> list[Checkpoint]:
    """The checkpoints a run offers: its final LoRA, then its newest checkpoint's trained and EMA adapters.

    Args:
        run_dir: a run folder.
        label: the run's display name (default: the folder name).

    Returns:
        One :class:`Checkpoint` per selectable LoRA.

    Raises:
        FileNotFoundError: not a run folder with a final LoRA.
    """
    run = Path(run_dir)
    if not is_run_dir(run):
        raise FileNotFoundError(
            f"{run} is not a finished run folder (needs {RUN_CONFIG} and {FINAL_LORA}/); "
            "pass a folder `flowrl train` wrote"
        )
    name = label or run.name
    model_path = read_run_config(run).model.path
    out = [Checkpoint(name, "final", run, model_path)]
    if _newest_adapters(run) is not None:
        out += [Checkpoint(f"{name} · trained", "trained", run, model_path)]
        out += [Checkpoint(f"{name} · ema", "ema", run, model_path)]
    return out


def base_checkpoint(model_path: str, run_dir: Path | None = None, taken: Collection[str] = ()) -> Checkpoint:
    """The base model of ``model_path`` (sampled with ``run_dir``'s config when given).

    Labelled "base" for the embedded model, else ``base (<folder name>)``; a label in ``taken`` (another
    model's) makes it ``base (<parent>/<folder name>)`` and so on (:func:`distinct_label`).
    """
    if model_path == EMBEDDED_MODEL and "base" not in taken:
        return Checkpoint("base", "base", run_dir, model_path)
    return Checkpoint(distinct_label(model_path, taken, "base ({})"), "base", run_dir, model_path)


def distinct_label(path: str | Path, taken: Collection[str], template: str = "{}") -> str:
    """The shortest end of ``path`` (its name, then ``parent/name``, ...) whose label no other checkpoint holds.

    Args:
        path: a run folder or a model path (a local one made absolute: ``a`` beside ``../x/a`` becomes ``x/a``).
        taken: the labels already given.
        template: how an end of the path becomes a label, e.g. ``"base ({})"``.

    Returns:
        ``template`` filled with the shortest end not in ``taken`` (the whole path when every end is taken).
    """
    parts = Path(os.path.abspath(path) if Path(path).exists() else path).parts  # a hub id stays as it is
    ends = [Path(*parts[len(parts) - n :]).as_posix() for n in range(1, len(parts) + 1)] or [str(path)]
    labels = [template.format(end) for end in ends]
    return next((label for label in labels if label not in taken), labels[-1])


def offer_run(run_dir: Path, offered: Sequence[Checkpoint]) -> list[Checkpoint]:
    """What a run adds to the checkpoints already offered, every label distinct: its model's base, then its own.

    The base model comes first, and only when no offered base has the run's ``model.path``. A run already
    offered keeps its label (offering it again re-reads its checkpoints); a new run gets the shortest end of its
    path that no offered checkpoint holds (:func:`distinct_label`), so ``runs/a`` and ``dup/a`` are ``a`` and
    ``dup/a``. ``flowrl eval`` and ``flowrl demo`` label through here.

    Args:
        run_dir: a run folder.
        offered: the checkpoints offered so far.

    Raises:
        FileNotFoundError: not a run folder with a final LoRA.
        ValueError: its ``config.yaml`` does not validate.
    """
    taken = {c.label for c in offered}
    model_path = read_run_config(run_dir).model.path
    added = []
    if not any(c.kind == "base" and c.model_path == model_path for c in offered):
        added.append(base_checkpoint(model_path, run_dir, taken))
        taken.add(added[0].label)
    mine = [c.label for c in offered if c.kind == "final" and c.run_dir == run_dir]
    label = mine[0] if mine else distinct_label(run_dir, taken)
    return [*added, *run_checkpoints(run_dir, label)]


class CheckpointBank:
    """Base models loaded once each, with every checkpoint attached as a named peft adapter.

    Switching a checkpoint is ``set_adapter(name)`` on the denoiser (the base model: adapters
    disabled), so N checkpoints of one model cost one copy of its weights plus N LoRAs.

    Args:
        device: overrides ``model.device`` of every run config (e.g. "cpu" for a demo box); None keeps it.
    """

    def __init__(self, device: str | None = None):
        self.device = device
        self._models: dict[str, ModelAdapter] = {}
        self._configs: dict[Path | None, Config] = {}
        self._adapters: dict[Checkpoint, str] = {}
        self._policies: dict[tuple[str, Path | None, float], Policy] = {}

    def config(self, checkpoint: Checkpoint) -> Config:
        """The config a checkpoint is sampled with: its run's, or the defaults for a bare base model."""
        key = checkpoint.run_dir
        if key not in self._configs:
            from ..config import load_config

            cfg = (
                read_run_config(key) if key is not None else load_config(None, [f"model.path={checkpoint.model_path}"])
            )
            self.use_config(key, cfg)
        return self._configs[key]

    def use_config(self, run_dir: Path | None, cfg: Config) -> None:
        """Sample ``run_dir``'s checkpoints with ``cfg`` (a config read earlier), unless the bank holds one already.

        The demo hands over the configs it read at start, so a base model still samples after the run whose
        config it borrows is deleted.
        """
        if run_dir not in self._configs:
            cfg = copy.deepcopy(cfg)
            if self.device is not None:
                cfg.model.device = self.device
            self._configs[run_dir] = cfg

    def model(self, checkpoint: Checkpoint) -> ModelAdapter:
        """The bare adapter of the checkpoint's base model (loaded on first use)."""
        path = checkpoint.model_path
        if path not in self._models:
            from ..models import load_adapter

            m = self.config(checkpoint).model
            self._models[path] = load_adapter(
                m.path, dtype=m.dtype, device=m.device, distilled_guidance=m.distilled_guidance
            )
        return self._models[path]

    def policy(self, checkpoint: Checkpoint, guidance_scale: float | None = None) -> Policy:
        """The checkpoint's policy stack (``build_policy`` with its run's config) around the shared model.

        Args:
            checkpoint: the checkpoint.
            guidance_scale: true-CFG weight; None keeps the run's ``sampler.guidance_scale``.
        """
        from ..policy import build_policy

        cfg = self.config(checkpoint)
        scale = cfg.sampler.guidance_scale if guidance_scale is None else float(guidance_scale)
        key = (checkpoint.model_path, checkpoint.run_dir, scale)
        if key not in self._policies:
            cfg = copy.deepcopy(cfg)
            cfg.sampler.guidance_scale = scale
            self._policies[key] = build_policy(cfg, model=self.model(checkpoint))
        return self._policies[key]

    def adapter_name(self, checkpoint: Checkpoint) -> str | None:
        """The peft adapter name of a checkpoint, attaching its LoRA on first use (None for a base model)."""
        if checkpoint.kind == "base":
            return None
        if checkpoint not in self._adapters:
            self._adapters[checkpoint] = self._attach(checkpoint)
        return self._adapters[checkpoint]

    def _attach(self, checkpoint: Checkpoint) -> str:
        from ..policy.lora import adapter_names, load_saved_lora

        model = self.model(checkpoint)
        before = set(adapter_names(model.transformer))
        if checkpoint.kind == "final":
            load_saved_lora(model, checkpoint.run_dir)  # the diffusers loader, as `flowrl sample` loads it
            added = [n for n in adapter_names(model.transformer) if n not in before]
            if len(added) != 1:
                raise ValueError(f"loading {checkpoint.run_dir}/lora added {len(added)} adapters; expected one")
            return added[0]
        return self._attach_checkpoint_state(checkpoint, model, before)

    def _attach_checkpoint_state(self, checkpoint: Checkpoint, model: ModelAdapter, taken: set[str]) -> str:
        """Attach the newest checkpoint's trained ("default") or EMA adapter under a fresh name."""
        from peft import LoraConfig
        from peft.tuners.tuners_utils import cast_adapter_dtype

        from ..policy.lora import load_lora_state, several_adapters

        found = _newest_adapters(checkpoint.run_dir)
        if found is None:
            raise FileNotFoundError(f"{checkpoint.run_dir} has no checkpoint with an EMA adapter any more")
        state = found[1]["lora"] if checkpoint.kind == "trained" else found[1]["adapters"]["ema"]
        lora = self.config(checkpoint).lora
        targets = lora.targets or list(model.lora_target_modules)
        name = f"{checkpoint.kind}_{len(taken)}"
        config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(targets))
        with several_adapters():
            model.transformer.add_adapter(config, adapter_name=name)
        cast_adapter_dtype(model.transformer, name)  # fp32 LoRA on a bf16 model, as the run trained and evaluated it
        load_lora_state(model.transformer, {k: v.float() for k, v in state.items()}, name)
        model.transformer.requires_grad_(False)
        return name

    @contextmanager
    def activated(self, checkpoint: Checkpoint, guidance_scale: float | None = None) -> Iterator[Policy]:
        """Run with ``checkpoint``'s adapter active (the base model: every adapter off); yields its policy."""
        name = self.adapter_name(checkpoint)
        policy = self.policy(checkpoint, guidance_scale)
        transformer = self.model(checkpoint).transformer
        if name is None:
            if getattr(transformer, "peft_config", None):
                transformer.disable_adapters()
            try:
                yield policy
            finally:
                if getattr(transformer, "peft_config", None):
                    transformer.enable_adapters()
            return
        transformer.enable_adapters()
        transformer.set_adapter(name)
        yield policy


@torch.no_grad()
def generate(
    policy: Policy,
    prompts: list[str],
    seeds: list[int],
    *,
    steps: int,
    sampler: str = "ode",
    noise_level: float = 0.7,
    frames: int | None = None,
) -> Tensor:
    """Samples for prompt/seed pairs; sample i depends only on (prompts[i], seeds[i]) and the settings.

    ``sampler="ode"`` is the Euler ODE that evaluation uses
    (:func:`flowrl.rollouts.chunked.sample_images`). Any SDE name of :data:`flowrl.samplers.SDE_STEPS`
    runs :func:`flowrl.samplers.rollout` with that step on every step but the last, its initial noise
    and step noises drawn from a generator seeded with the sample's seed, so the same seed gives the
    same sample on every checkpoint.

    Args:
        policy: the checkpoint's policy (adapter active).
        prompts: B prompts.
        seeds: B seeds.
        steps: sampling steps T.
        sampler: "ode" or an SDE step name.
        noise_level: the SDE's noise level ``a``.
        frames: frames per clip for video models (None: the run's ``model.num_frames``/default).

    Returns:
        (B, 3, H, W) images or (B, F, 3, H, W) clips in [0, 1].
    """
    from ..models.adapter import model_latent_shape
    from ..rollouts.chunked import sample_images
    from ..samplers import rollout, sde_noise_levels

    sigmas = policy.sigmas(steps)
    if sampler == "ode":
        return sample_images(policy.model, prompts, seeds, sigmas, resolution=policy.resolution, frames=frames)
    model = policy.model
    shape = model_latent_shape(model, policy.resolution, frames)
    x_init, noises = _seeded_noises(shape, seeds, steps)
    cond = model.encode_prompt(list(prompts))
    levels = sde_noise_levels(steps, noise_level)
    traj = rollout(
        lambda x, s: model.velocity(x, s, cond), x_init.to(model.device), sigmas, levels, sde=sampler, noises=noises
    )
    return model.decode(traj.latents[:, -1])


def _seeded_noises(shape: tuple[int, ...], seeds: list[int], steps: int) -> tuple[Tensor, Tensor]:
    """Per-seed initial noise (the same as :func:`flowrl.runtime.seeded_noise`) and (T, ...) step noises."""
    x, eps = [], []
    for seed in seeds:
        gen = torch.Generator().manual_seed(int(seed))
        x.append(torch.randn(shape, generator=gen))
        eps.append(torch.randn((steps, *shape), generator=gen))
    return torch.stack(x), torch.stack(eps)
