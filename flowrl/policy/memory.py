"""Memory controls for GPU users, applied generically through a diffusers pipeline's components.

* gradient checkpointing of the denoiser (``transformer.enable_gradient_checkpointing()``;
  diffusers checkpoints with ``use_reentrant=False``, so LoRA weights still get gradients);
* bf16 / fp16 autocast around the denoiser call only: :meth:`MemoryAdapter.velocity` returns an
  fp32 velocity, and the samplers compute SDE means and log-probs in fp32 outside autocast;
* VAE tiling and slicing (``vae.enable_tiling()`` / ``vae.enable_slicing()``);
* CPU offload of the text encoders and the VAE outside their phase: encoders sit on the CPU
  except inside ``encode_prompt``, the VAE except inside ``decode`` (a no-op on a CPU run);
* freeing the text encoders once every prompt is in the prompt cache;
* the attention backend: torch SDPA (diffusers' default) or xformers (CUDA only);
* ``torch.compile`` of the denoiser (``memory.compile``; off by default: compiled kernels round
  differently from eager ones in the last bits, and compiling costs minutes on a CPU,
  docs/performance.md); ``cudagraphs`` replays CUDA graphs of the eager kernels instead (CUDA only:
  seconds of tracing, no code generation, the eager results).
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..models.adapter import Cond, ModelAdapter, module_device, text_encoders
from .wrapper import AdapterWrapper

AUTOCAST_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
ATTENTION_BACKENDS = ("sdpa", "xformers")
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune", "cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune", "cudagraphs")
"""Compile modes that replay CUDA graphs on a GPU (torch's "max-autotune" turns them on too), whose
outputs live in static buffers the next replay overwrites: :class:`MemoryAdapter` copies them out."""
CUDA_ONLY_MODES = ("cudagraphs",)
"""Compile modes with nothing to gain off CUDA: torch skips the graphs for CPU tensors and keeps only the tracing."""
COMPILE_SCOPES = ("model", "blocks")
COMPILED_GRAPHS = 64
"""Graphs torch.compile may keep per function before it falls back to eager (torch's default is 8).

A training run meets one graph per grad mode x active adapter (policy, reference with LoRA off,
DiffusionNFT's old and EMA adapters) x batch shape (tree rollouts' frontiers, the last chunk,
evaluation), so torch's 8 ran out in a BranchGRPO iteration and the rest ran eager, silently."""
OFFLOAD_DEVICE = torch.device("cpu")
TRAINABLE_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The SDPA kernels :func:`trainable_attention` allows: every one but cuDNN's."""


def check_trainable_precision(dtype: str, autocast: str) -> None:
    """Refuse training in fp16 (``model.dtype: float16`` or ``memory.autocast: fp16``): flowrl has no loss scaling.

    The log-probs are means over a sample's latent elements, so the gradients flowing back through an fp16
    denoiser are tiny and fp16's range loses them: at SD3.5-M's 512 px latent (16 x 64 x 64) 80 % of the
    LoRA's gradient entries came out zero (relative error 0.84 against fp32; bf16: 0.015, none zero).
    Sampling in fp16 (``flowrl sample``) is unaffected.

    Args:
        dtype: the denoiser's weight dtype (``model.dtype``: "float32", "bfloat16" or "float16").
        autocast: ``memory.autocast`` ("none", "bf16" or "fp16").

    Raises:
        ValueError: either setting is fp16 (one line naming it and the fix).
    """
    key = "model.dtype=float16" if dtype == "float16" else "memory.autocast=fp16" if autocast == "fp16" else None
    if key is not None:
        raise ValueError(
            f"{key} can't train: flowrl has no loss scaling, and fp16 gradients underflow (most of a LoRA's gradient "
            "entries become zero); use model.dtype=bfloat16 or memory.autocast=bf16, or float32 on a GPU without bf16 "
            "(fp16 is fine for flowrl sample)"
        )


def enable_gradient_checkpointing(transformer: nn.Module) -> None:
    """Turn on activation checkpointing in a diffusers denoiser.

    Raises:
        ValueError: the model class has no checkpointing support.
    """
    if not getattr(transformer, "_supports_gradient_checkpointing", False):
        raise ValueError(
            f"memory.gradient_checkpointing: {type(transformer).__name__} does not support gradient checkpointing; "
            "set it to false"
        )
    transformer.enable_gradient_checkpointing()


def _uses_backend_dispatch(transformer: nn.Module) -> bool:
    """True for models whose attention processors go through diffusers' backend dispatcher."""
    return any(hasattr(getattr(m, "processor", None), "_attention_backend") for m in transformer.modules())


def set_attention_backend(transformer: nn.Module, backend: str, device: torch.device) -> None:
    """Select the attention kernel of a diffusers denoiser.

    "sdpa" keeps diffusers' default (``torch.nn.functional.scaled_dot_product_attention``);
    a training run's passes (rollouts, training, evaluation) run under :func:`trainable_attention`.
    "xformers" needs the xformers package and a CUDA device; models with the new attention
    dispatcher (FLUX, Wan, Qwen-Image) get ``transformer.set_attention_backend("xformers")``,
    older processors (SD3) ``enable_xformers_memory_efficient_attention()``.

    Raises:
        ValueError: unknown backend, xformers missing, or not on CUDA (one line with the fix).
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"memory.attention_backend must be one of {', '.join(map(repr, ATTENTION_BACKENDS))}; got {backend!r}"
        )
    if backend == "sdpa":
        return
    if importlib.util.find_spec("xformers") is None:
        raise ValueError(
            "memory.attention_backend=xformers needs the xformers package: `pip install xformers` (CUDA builds only), "
            "or set memory.attention_backend=sdpa"
        )
    if torch.device(device).type != "cuda":
        raise ValueError(
            f"memory.attention_backend=xformers runs only on CUDA (model.device is {device}); "
            "set memory.attention_backend=sdpa"
        )
    if _uses_backend_dispatch(transformer):
        transformer.set_attention_backend("xformers")
    else:
        transformer.enable_xformers_memory_efficient_attention()


@contextlib.contextmanager
def trainable_attention() -> Iterator[None]:
    """The SDPA kernels of every pass a training run makes: those whose backward pass works.

    Leaves out PyTorch's cuDNN attention kernel (flash, memory-efficient and math remain): measured
    on an H100 with torch 2.11 + cuDNN 9.19, its backward pass fails on FLUX.1's attention
    (``mha_graph.execute ... is_good()``) at every size tried (docs/gpu-plan.md). The rollouts and
    evaluation samples of a run (:meth:`flowrl.trainer.Trainer.collect`, ``Trainer.sample``) run under it
    too, so a sample's no-grad rollout forward and its training forward use the same kernel and the
    first-update ratio is exactly 1 in bf16 as well: torch's own pick for a no-grad bf16 forward on
    Hopper is cuDNN, the training pass's is flash, and the two differ in the last bits. Measured on
    an H100 (``bench.attention_backends``, 2026-11-27) the kernel this leaves is also the faster rollout
    forward for SD3.5-M (flash 0.77x cuDNN at batch 4) and as fast within 3 % for FLUX.1-dev (flash
    337 ms, cuDNN 328 ms). Off CUDA only a flag no kernel reads changes: torch's CPU attention has no
    cuDNN kernel, so CPU results are the same bits with or without it. The flags are process-wide
    (``torch.nn.attention.sdpa_kernel``) and restored on exit.
    """
    with sdpa_kernel(TRAINABLE_SDPA):
        yield


def repeated_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The denoiser's repeated blocks: every element of each ``nn.ModuleList`` child whose modules are of one class.

    SD3's ``transformer_blocks``, FLUX's ``transformer_blocks`` and ``single_transformer_blocks``, Wan's
    ``blocks``, Qwen-Image's ``transformer_blocks``: found by structure, not by class name. In diffusers
    0.42 these are the only ``nn.ModuleList`` children of those denoisers (other lists sit inside the
    attention modules); a model whose top level held a list of norms or projections would have them
    compiled too, which is harmless but gains little.

    Returns:
        The blocks in model order (empty when the denoiser has no such list).
    """
    blocks = []
    for child in transformer.children():
        if isinstance(child, nn.ModuleList) and len({type(m) for m in child}) == 1:
            blocks.extend(child)
    return blocks


def called_denoisers(transformer: nn.Module) -> list[nn.Module]:
    """The modules a model's velocity calls: Wan2.2's two experts for a :class:`WanExperts`, else the module itself.

    ``WanAdapter.velocity`` calls each expert directly, never the container's ``forward``: compiling
    the container would compile nothing that runs.
    """
    from ..models.wan_experts import WanExperts

    return [transformer.high, transformer.low] if isinstance(transformer, WanExperts) else [transformer]


def compile_denoiser(transformer: nn.Module, mode: str, scope: str = "model") -> None:
    """Compile the denoiser's call in place with ``torch.compile`` (``nn.Module.compile``); "none" leaves it eager.

    The module object stays the same, so LoRA adapters, adapter switches and checkpoints work
    unchanged; each adapter state (and grad / no-grad) is traced once, on its first call. Rollouts
    and training both run the compiled graphs, so the first-update ratio is still computed from
    the same kernels on both sides (tested), but results differ from eager in the last bits.
    Raises torch's per-function graph limit (process-wide) to :data:`COMPILED_GRAPHS`, so a run's
    graphs never fall back to eager on their own.

    ``scope="blocks"`` compiles each repeated block (:func:`repeated_blocks`) instead of the whole
    model ("regional compilation"): the blocks of one class share compiled code, one graph per
    variant of the block's forward (SD3.5-M's 24 joint blocks: 3, with and without dual attention,
    and the ``context_pre_only`` last block) instead of 24 blocks inlined into one graph; embedders and
    the final layer stay eager. For full-size models, whose whole-model compile takes minutes;
    "model" removes more launches on small ones. Every variant counts against the one per-function
    graph limit of the block's ``forward`` (:data:`COMPILED_GRAPHS`).

    ``mode="cudagraphs"`` uses torch's ``cudagraphs`` backend: dynamo and AOT autograd trace the
    forward and backward, and CUDA graph trees replay the traced eager kernels, with no inductor code
    generation. Tracing takes seconds where inductor takes tens of seconds (docs/performance.md), and
    the kernels are the eager ones, so velocities and gradients equal eager (bit for bit on the CPU,
    where torch traces but does not capture; tested). Shapes are static (``dynamic=False``): one graph
    per batch shape, as a CUDA graph needs. For the launch-bound small models; on a CPU tensor torch
    skips the capture, so :func:`apply_memory_settings` refuses it there.

    Raises:
        ValueError: an unknown mode or scope, or ``scope="blocks"`` on a model without repeated blocks.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"memory.compile must be one of {', '.join(map(repr, COMPILE_MODES))}; got {mode!r}")
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"memory.compile_scope must be one of {', '.join(map(repr, COMPILE_SCOPES))}; got {scope!r}")
    if mode == "none":
        return
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, COMPILED_GRAPHS)
    units = called_denoisers(transformer)
    targets = units if scope == "model" else [block for unit in units for block in repeated_blocks(unit)]
    if not targets:
        raise ValueError(
            f"memory.compile_scope=blocks: {type(transformer).__name__} has no list of repeated blocks; "
            "set memory.compile_scope=model"
        )
    for module in targets:
        if mode == "cudagraphs":
            module.compile(backend="cudagraphs", dynamic=False)
        else:
            module.compile(mode=None if mode == "default" else mode)


@contextlib.contextmanager
def eager_calls(module: nn.Module) -> Iterator[None]:
    """Run every compiled part of ``module`` (the model, or its blocks) eager inside the block.

    For counting FLOPs (``FlopCounterMode`` does not see inside compiled kernels) and for timing eager
    against compiled calls of the same compiled module; the compiled calls are restored on exit.
    """
    compiled = {m: m._compiled_call_impl for m in module.modules() if m._compiled_call_impl is not None}
    for part in compiled:
        part._compiled_call_impl = None
    try:
        yield
    finally:
        for part, call in compiled.items():
            part._compiled_call_impl = call


def configure_vae(vae: nn.Module | None, *, tiling: bool, slicing: bool) -> None:
    """Enable VAE tiling / slicing where asked.

    Raises:
        ValueError: the VAE class lacks the method asked for.
    """
    for flag, method in ((tiling, "enable_tiling"), (slicing, "enable_slicing")):
        if not flag:
            continue
        if vae is None or not hasattr(vae, method):
            raise ValueError(f"memory.vae_{method[7:]}: {type(vae).__name__} has no {method}(); set it to false")
        getattr(vae, method)()


@contextlib.contextmanager
def placed(modules: Sequence[nn.Module], device: torch.device, offload: bool) -> Iterator[None]:
    """Move ``modules`` to ``device`` for the block and back to the CPU after it (when ``offload``)."""
    if not offload:
        yield
        return
    for module in modules:
        module.to(device)
    try:
        yield
    finally:
        for module in modules:
            module.to(OFFLOAD_DEVICE)
        if device.type == "cuda":
            torch.cuda.empty_cache()


class MemoryAdapter(AdapterWrapper):
    """Wraps a model adapter with autocast and phase-wise offload; every other member is delegated.

    Args:
        model: the adapter (exposes ``.pipe`` and ``.transformer``).
        autocast: "none", "bf16" or "fp16" — autocast dtype of the denoiser call.
        offload_encoders: keep the text encoders on the CPU outside ``encode_prompt``.
        offload_vae: keep the VAE on the CPU outside ``decode``.
        own_outputs: copy each velocity out of the denoiser's output buffer (``memory.compile`` in
            :data:`CUDA_GRAPH_MODES`: a CUDA graph writes every replay into the same static buffer, so
            a velocity kept across later denoiser calls, as the frozen reference velocities of a KL
            term are, would be overwritten; found on an H100, 2026-11-27, docs/gpu-runs).
    """

    def __init__(
        self,
        model: ModelAdapter,
        *,
        autocast: str = "none",
        offload_encoders: bool = False,
        offload_vae: bool = False,
        own_outputs: bool = False,
    ):
        if autocast not in AUTOCAST_DTYPES:
            raise ValueError(
                f"memory.autocast must be one of {', '.join(map(repr, AUTOCAST_DTYPES))}; got {autocast!r}"
            )
        super().__init__(model)
        self.autocast_dtype = AUTOCAST_DTYPES[autocast]
        self.offload_encoders = offload_encoders
        self.offload_vae = offload_vae
        self.own_outputs = own_outputs
        self.encoders_freed = False
        if offload_encoders:
            for encoder in text_encoders(model.pipe).values():
                encoder.to(OFFLOAD_DEVICE)
        if offload_vae and model.pipe.vae is not None:
            model.pipe.vae.to(OFFLOAD_DEVICE)

    @property
    def compute_device(self) -> torch.device:
        """Where the denoiser runs; encoders and VAE are brought here for their phase."""
        return module_device(self._model.transformer)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """The wrapped velocity; under autocast the denoiser runs in bf16/fp16 and v comes back fp32.

        With ``own_outputs`` the result is always a fresh tensor, never the denoiser's own buffer.
        """
        if self.autocast_dtype is None:
            v = self._model.velocity(x, sigma, cond)
        else:
            with torch.autocast(self.compute_device.type, dtype=self.autocast_dtype):
                v = self._model.velocity(x, sigma, cond)
            if v.dtype != torch.float32:
                return v.float()  # already a copy
        return v.clone() if self.own_outputs else v

    def encode_prompt(self, prompts: Sequence[str]) -> Cond:
        """Encode with the text encoders brought to the compute device for the call.

        Raises:
            ValueError: the encoders were freed (a prompt missing from the warm cache).
        """
        if self.encoders_freed:
            shown = list(prompts)[:1]
            raise ValueError(
                f"prompt {shown[0]!r} is not in the prompt cache and the text encoders were freed "
                "(memory.free_encoders_when_cached); list it in prompts.train/prompts.eval "
                "or set memory.free_encoders_when_cached=false"
            )
        encoders = list(text_encoders(self._model.pipe).values())
        with placed(encoders, self.compute_device, self.offload_encoders):
            return self._model.encode_prompt(prompts)

    def decode(self, latents: Tensor) -> Tensor:
        """Decode with the VAE brought to the compute device for the call."""
        vae = self._model.pipe.vae
        with placed([vae] if vae is not None else [], self.compute_device, self.offload_vae):
            return self._model.decode(latents)

    def decoder(self) -> Any:
        """The wrapped adapter's picklable decoder (``train.rewards_async: process``).

        Raises:
            ValueError: ``memory.offload_vae`` is on (the worker process would decode with a VAE
                left on the CPU while the latents live on the accelerator).
        """
        if self.offload_vae:
            raise ValueError(
                "memory.offload_vae=true and train.rewards_async=process can't be combined (the scoring "
                "process keeps its own VAE placement); set one of them to false"
            )
        return self._model.decoder()

    def free_text_encoders(self) -> int:
        """Drop the text encoders from the pipeline (after the prompt cache is warm).

        A later :meth:`encode_prompt` then fails with a one-line message instead of deep in diffusers.

        Returns:
            The number of encoder parameters released.
        """
        released = self._model.free_text_encoders()
        self.encoders_freed = True
        return released


def apply_memory_settings(model: ModelAdapter, memory: Any) -> MemoryAdapter:
    """Apply a ``memory`` config section to a model adapter.

    Args:
        model: a model adapter exposing ``.pipe`` and ``.transformer``.
        memory: the config section (``flowrl.config.MemoryConfig``).

    Returns:
        The adapter wrapped in a :class:`MemoryAdapter` (autocast and offload live there).

    Raises:
        ValueError: a setting the model or machine cannot honour (one line with the fix).
    """
    if isinstance(model, MemoryAdapter):
        return model
    transformer = model.transformer
    device = module_device(transformer)
    set_attention_backend(transformer, memory.attention_backend, device)
    if memory.compile in CUDA_ONLY_MODES and torch.device(device).type != "cuda":
        raise ValueError(
            f"memory.compile={memory.compile} captures CUDA graphs and the model is on {device}; "
            "set model.device=cuda, or memory.compile=default (or none) on this device"
        )
    if memory.gradient_checkpointing:
        enable_gradient_checkpointing(transformer)
    compile_denoiser(transformer, memory.compile, memory.compile_scope)
    configure_vae(model.pipe.vae, tiling=memory.vae_tiling, slicing=memory.vae_slicing)
    return MemoryAdapter(
        model,
        autocast=memory.autocast,
        offload_encoders=memory.offload_encoders,
        offload_vae=memory.offload_vae,
        own_outputs=memory.compile in CUDA_GRAPH_MODES,
    )
