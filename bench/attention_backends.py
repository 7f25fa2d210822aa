"""Attention kernels side by side: the denoiser's rollout and training passes under each SDPA backend.

diffusers' attention (SD3's processors and the dispatcher of FLUX, Wan and Qwen-Image alike) calls
``torch.nn.functional.scaled_dot_product_attention``, which picks one of several kernels per call:
flash, memory-efficient, cuDNN (CUDA) or the plain math one. This script pins each in turn with
``torch.nn.attention.sdpa_kernel`` around the same passes and times them against torch's own pick
("auto"), so that a choice of backend rests on a measurement:

- ``rollout``: one no-grad forward of a batch (a sampling step), in bf16 autocast on CUDA;
- ``train``: forward + backward of a batch into the LoRA (a training micro-batch).

Each row also gives the largest difference of the rollout output from the math kernel's (the
reference: same inputs, same weights). A backend that cannot run a pass says why in its row
(``No available kernel`` where the device has no such kernel, cuDNN's backward failure on FLUX.1
of docs/gpu-plan.md). A flowrl training run's passes (rollouts, training, evaluation) run under
:func:`flowrl.policy.memory.trainable_attention` (flash, efficient, math: no cuDNN); this table is
what that choice and ``memory.attention_backend`` are checked against. xformers is a row only where
it is installed (``memory.attention_backend=xformers``, CUDA only); it runs after the SDPA rows and
names the xformers operator its forward dispatched to (xformers can fall back to PyTorch's own
kernels when its extension does not match the installed torch).

``--backends`` runs a subset; ratios are over the first one listed ("auto" by default). On FLUX.1 the
"auto" training pass picks cuDNN, whose backward breaks the CUDA context on torch 2.11 (:data:`LAST`),
so a run that must reach the xformers row there leaves "auto" and "cudnn" out.

Usage:
    python -m bench.attention_backends [--models SD3.5-M FLUX.1-dev] [--batch 4 16] [--repeats 3]
        [--backends flash efficient xformers]
        # CUDA: bench.gpu_measure's full-size transformers, random bf16 weights, 512^2
    python -m bench.attention_backends --cpu [--batch 40]
        # the embedded model's denoiser on the CPU, one thread (only flash and math exist there)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.gpu_measure import release

BACKENDS: dict[str, list[SDPBackend] | None] = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "math": [SDPBackend.MATH],
}
"""Row label -> the SDPA kernels allowed (None: torch chooses, as in a plain run)."""
LABELS = (*BACKENDS, "xformers")


@dataclass
class Baseline:
    """What the xformers row of a case is read against: the base backend's medians and the math rollout."""

    label: str
    seconds: dict[bool, float]  # train -> median seconds of the base backend's pass (absent where it failed)
    reference: torch.Tensor


@dataclass
class Case:
    """One model at one batch size: a pass returning the denoiser's output, and the module to clear grads of."""

    model: str
    batch: int
    forward: Callable[[], torch.Tensor]
    module: torch.nn.Module
    device: torch.device


def run_pass(case: Case, backend: list[SDPBackend] | None, train: bool) -> torch.Tensor:
    """The case's forward (and, for ``train``, a backward of the mean square into the LoRA) under ``backend``."""
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        if not train:
            with torch.no_grad():
                return case.forward()
        out = case.forward()
        out.float().square().mean().backward()
    case.module.zero_grad(set_to_none=True)
    return out.detach()


def timed_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn``, synchronised on CUDA."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _failure(err: RuntimeError) -> str:
    """The first line of a kernel's refusal, short enough for a table cell."""
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "No viable backend" in line or "No available kernel" in line:
        return "no such kernel here"
    return line[:90]


LAST = (("cudnn", True), ("auto", True))
"""Run after every other pass, one at a time: cuDNN's SDPA backward (which "auto" picks on an H100) hit an
illegal memory access on FLUX.1 at batch 4 (2026-11-27, torch 2.11.0+cu130), which ends the process's CUDA
context; the passes measured before it keep their rows."""


class ContextLost(RuntimeError):
    """A pass broke the CUDA context (e.g. an illegal memory access): nothing more can run in this process."""


def _warm(case: Case, key: tuple[str, bool], failed: dict, reference: torch.Tensor, diffs: dict) -> Callable | None:
    """The key's call after one warm-up run, or None (its refusal recorded in ``failed``).

    Raises:
        ContextLost: the pass broke the CUDA context (recorded in ``failed`` too).
    """
    label, train = key
    call = functools.partial(run_pass, case, BACKENDS[label], train)
    try:
        out = call()
    except torch.AcceleratorError as err:  # sticky: every later CUDA call of the process fails
        failed[key] = f"{_failure(err)} (CUDA context lost)"
        raise ContextLost(failed[key]) from err
    except RuntimeError as err:  # torch.cuda.OutOfMemoryError included: the math kernel at FLUX's size
        failed[key] = _failure(err)
    if key in failed:  # freed after the except block, whose traceback held the failed pass's activations
        release(case.module)
        return None
    if not train:
        diffs[label] = f"{(out.float() - reference).abs().max().item():.1e}"
    return call


def measure(case: Case, repeats: int, labels: tuple[str, ...] = LABELS) -> tuple[list[str], bool, Baseline]:
    """Table rows for the SDPA backends of ``labels`` on one case, whether the CUDA context was lost, the baseline.

    A row holds rollout ms, train ms, each over the first of ``labels`` (the base), and the rollout's
    difference from math. Every (backend, pass) that runs is warmed up once, then the repeats alternate
    between them, so a change of the host's load falls on every backend alike; the passes of
    :data:`LAST` follow, each warmed up and timed on its own.
    """
    reference = run_pass(case, BACKENDS["math"], train=False).float()
    sdpa = [label for label in labels if label in BACKENDS]
    failed: dict[tuple[str, bool], str] = {}
    diffs: dict[str, str] = {}
    keys = [(label, train) for train in (False, True) for label in sdpa if (label, train) not in LAST]
    calls = {key: call for key in keys if (call := _warm(case, key, failed, reference, diffs)) is not None}
    times: dict[tuple[str, bool], list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        for key, call in calls.items():
            times[key].append(timed_once(call, case.device))
    lost = False
    for key in [key for key in LAST if key[0] in sdpa]:
        if lost:
            failed[key] = "not run: the CUDA context was lost"
            continue
        try:
            call = _warm(case, key, failed, reference, diffs)
        except ContextLost:
            lost = True
            continue
        if call is not None:
            times[key] = [timed_once(call, case.device) for _ in range(repeats)]
    medians = {key: statistics.median(values) for key, values in times.items()}
    base = labels[0]
    baseline = Baseline(
        base, {train: medians[(base, train)] for train in (False, True) if (base, train) in medians}, reference
    )
    rows = []
    for label in sdpa:
        cells = []
        for train in (False, True):
            if (label, train) in failed:
                cells += [failed[(label, train)], ""]
                continue
            cells += time_cells(medians[(label, train)], baseline.seconds.get(train))
        rows.append(f"| {case.model} | {case.batch} | {label} | {' | '.join(cells)} | {diffs.get(label, '')} |")
    return rows, lost, baseline


def time_cells(seconds: float, base: float | None) -> list[str]:
    """A pass's milliseconds and its ratio to the base backend's ("" where the base did not run)."""
    return [f"{seconds * 1e3:,.2f}", f"{seconds / base:.2f}" if base else ""]


def xformers_rows(cases: list[Case], repeats: int, baselines: list[Baseline]) -> list[str]:
    """The same passes with ``memory.attention_backend=xformers`` (after every SDPA row: it stays switched on).

    One row per case, read against its :class:`Baseline`, or one row saying why xformers could not be switched on.
    """
    if not cases or importlib.util.find_spec("xformers") is None or cases[0].device.type != "cuda":
        return []
    from flowrl.policy.memory import set_attention_backend

    try:
        set_attention_backend(cases[0].module, "xformers", cases[0].device)
    except (ValueError, RuntimeError, ImportError) as err:  # diffusers' own check of the installed xformers
        return [f"| {cases[0].model} | | xformers | not switched on: {str(err).splitlines()[0][:90]} | | | | |"]
    return [_xformers_row(case, repeats, baseline) for case, baseline in zip(cases, baselines)]


def _xformers_row(case: Case, repeats: int, baseline: Baseline) -> str:
    cells, diff = [], ""
    for train in (False, True):
        try:
            out = run_pass(case, None, train)
            if not train:
                diff = f"{(out.float() - baseline.reference).abs().max().item():.1e}"
            seconds = statistics.median(
                [timed_once(functools.partial(run_pass, case, None, train), case.device) for _ in range(repeats)]
            )
            cells += time_cells(seconds, baseline.seconds.get(train))
        except RuntimeError as err:
            cells += [_failure(err), ""]
    return f"| {case.model} | {case.batch} | xformers ({xformers_operator(case)}) | {' | '.join(cells)} | {diff} |"


def xformers_operator(case: Case) -> str:
    """The name of the xformers forward operator that a rollout of ``case`` dispatches to, or why none is found."""
    import xformers.ops.fmha as fmha

    names: list[str] = []
    original = getattr(fmha, "_dispatch_fw", None)  # xformers' private dispatcher: absent, the row says "unknown"
    if original is None:
        return "unknown"

    def spy(*args: object, **kwargs: object) -> object:
        op = original(*args, **kwargs)
        names.append(getattr(op, "NAME", type(op).__name__))
        return op

    fmha._dispatch_fw = spy
    try:
        run_pass(case, None, train=False)
    except RuntimeError as err:
        return f"none: {_failure(err)}"
    finally:
        fmha._dispatch_fw = original
    return ", ".join(sorted(set(names))) or "not called"


def cpu_cases(batches: list[int]) -> list[Case]:
    """The embedded model's denoiser with a LoRA r8, built as training builds it (``build_policy``)."""
    from flowrl.config import load_config
    from flowrl.policy import build_policy

    policy = build_policy(load_config(None, ["train.threads=1"]), trainable=True)
    model = policy.model
    cases = []
    for b in batches:
        x = torch.randn(b, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
        sigma = torch.full((b,), 0.5)
        cond = model.encode_prompt(["a bold handwritten 7"] * b)

        def forward(x: torch.Tensor = x, sigma: torch.Tensor = sigma, cond: dict = cond) -> torch.Tensor:
            return model.velocity(x, sigma, cond)

        cases.append(Case("flowrl-digits", b, forward, model.transformer, torch.device("cpu")))
    return cases


def cuda_cases(names: list[str] | None, batches: list[int]) -> list[tuple[str, Callable[[], list[Case]]]]:
    """``bench.gpu_measure``'s full-size transformers (random bf16 weights, the shipped LoRA), built one at a time."""
    from bench.gpu_measure import _build, _models

    def build(name: str, builder: Callable, inputs: Callable[[int], dict], targets: tuple, rank: int) -> list[Case]:
        model = _build(builder, targets, rank)
        cases = []
        for b in batches:
            x = inputs(b)

            def forward(x: dict = x) -> torch.Tensor:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return model(**x, return_dict=False)[0]

            cases.append(Case(name, b, forward, model, torch.device("cuda")))
        return cases

    return [
        (name, lambda n=name, spec=spec: build(n, *spec))
        for name, spec in _models().items()
        if names is None or name in names
    ]


def header(base: str) -> str:
    """The table's header, ratios over ``base``."""
    return (
        f"| model | batch | backend | rollout ms | / {base} | train ms | / {base} | rollout max diff vs math |\n"
        "|---|---:|---|---:|---:|---:|---:|---:|"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the embedded model on the CPU instead of CUDA")
    parser.add_argument("--models", nargs="+", default=None, help="subset of SD3.5-M FLUX.1-dev Wan2.1-1.3B")
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="default: 4 16 on CUDA, 40 on the CPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--backends", nargs="+", default=list(LABELS), choices=LABELS, help="rows to run; ratios over the first"
    )
    args = parser.parse_args(argv)
    labels = tuple(dict.fromkeys(args.backends))
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("bench.attention_backends needs CUDA for the full-size models; --cpu runs the embedded one")
    where = "cpu, 1 thread, fp32" if args.cpu else f"{torch.cuda.get_device_name()}, bf16 autocast, random weights"
    print(f"# attention backends: {where}, torch {torch.__version__}, median of {args.repeats}", flush=True)
    print(header(labels[0]), flush=True)
    if args.cpu:
        torch.set_num_threads(1)
        groups = [("flowrl-digits", lambda: cpu_cases(args.batch or [40]))]
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        groups = cuda_cases(args.models, args.batch or [4, 16])
    for name, build in groups:
        cases = build()
        baselines = []
        for case in cases:
            rows, lost, baseline = measure(case, args.repeats, labels)
            baselines.append(baseline)
            print("\n".join(rows), flush=True)
            if lost:
                print(
                    f"# {name} at batch {case.batch} broke the CUDA context: the cases after it are not run", flush=True
                )
                return
        for row in xformers_rows(cases, args.repeats, baselines) if "xformers" in labels else []:
            print(row, flush=True)
        cases = None  # free one full-size model before building the next
        if not args.cpu:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
