"""Before/after of the sampler cuts (docs/performance.md), interleaved in one process, with a bit-identity check.

Usage: ``python -m bench.sampler_ab --base REV [--repeats 9]``. The "before" code is
``samplers/rollout.py`` and ``samplers/gaussian.py`` as committed at git revision ``REV``, loaded
beside the current ones; both run the same inputs alternately:

- ``sampler only``: ``samplers.rollout`` with a velocity that costs nothing (a stored tensor), so
  the time is the sampler's own (SDE steps, log-probs, trajectory storage);
- ``rollout``: ``flowrl.rollouts.chunked.chunked_rollout`` of the embedded model, 160 samples x 10
  Flow-SDE steps in chunks of 40 (the default job's rollout).

Prints the medians, after/before, the load average, and whether latents and log-probs are
bit-identical for the same seed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import time
from typing import Any, Callable, Iterator

import torch

import flowrl.rollouts.chunked as chunked
import flowrl.samplers.sde_finish as sde_finish
from flowrl.samplers import linear_sigmas, sde_noise_levels
from flowrl.samplers.gaussian import gaussian_log_prob
from flowrl.samplers.rollout import rollout


def _old(rev: str, path: str, name: str) -> Callable:
    """Function ``name`` of ``path`` as committed at ``rev`` (relative imports read from flowrl.samplers)."""
    src = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
    namespace: dict[str, Any] = {}
    exec(compile(src.replace("from .", "from flowrl.samplers."), f"{rev}:{path}", "exec"), namespace)
    return namespace[name]


@contextlib.contextmanager
def _code(rollout_fn: Callable, log_prob_fn: Callable) -> Iterator[None]:
    """Run the block with this rollout and log-prob (patched where the rollout and the SDE steps look them up)."""
    old_rollout, old_lp = chunked.rollout, sde_finish.gaussian_log_prob
    chunked.rollout, sde_finish.gaussian_log_prob = rollout_fn, log_prob_fn
    try:
        yield
    finally:
        chunked.rollout, sde_finish.gaussian_log_prob = old_rollout, old_lp


def main(argv: list[str] | None = None) -> None:
    from flowrl.models import load_adapter

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", required=True, help="git revision of the 'before' code")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--cases", default="both", choices=["both", "sampler"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    versions = {
        "before": (
            _old(args.base, "samplers/rollout.py", "rollout"),
            _old(args.base, "samplers/gaussian.py", "gaussian_log_prob"),
        ),
        "after": (rollout, gaussian_log_prob),
    }
    model = load_adapter("flowrl-digits")
    shape = model.latent_shape(*model.default_resolution)
    cond = model.encode_prompt(["a bold handwritten 7"] * 160)
    x = torch.randn(160, *shape, generator=torch.Generator().manual_seed(1))
    sigmas, levels = linear_sigmas(10), sde_noise_levels(10, 0.7)
    v = torch.randn(40, *shape, generator=torch.Generator().manual_seed(2))

    def sampler_only() -> Any:
        return chunked.rollout(lambda x_, s: v, x[:40], sigmas, levels, generator=torch.Generator().manual_seed(0))

    def full() -> Any:
        return chunked.chunked_rollout(
            model, cond, x, sigmas, levels, chunk_size=40, generator=torch.Generator().manual_seed(0)
        )

    cases = {"sampler only (B=40, 10 steps)": sampler_only, "rollout 160 x 10 steps (embedded model)": full}
    inner = {"sampler only (B=40, 10 steps)": 20, "rollout 160 x 10 steps (embedded model)": 1}  # calls per timing
    if args.cases == "sampler":
        cases.pop("rollout 160 x 10 steps (embedded model)")
    load = open("/proc/loadavg").read().split()[:3]
    times: dict[tuple[str, str], list[float]] = {(c, k): [] for c in cases for k in versions}
    identical = {}
    for case, fn in cases.items():
        outs = {}
        for name, code in versions.items():
            with _code(*code):
                outs[name] = fn()  # warm-up, and the outputs compared below
        identical[case] = torch.equal(outs["before"].latents, outs["after"].latents) and torch.equal(
            outs["before"].log_probs, outs["after"].log_probs
        )
        for _ in range(args.repeats):
            for name, code in versions.items():
                with _code(*code):
                    t0 = time.perf_counter()
                    for _ in range(inner[case]):
                        fn()
                    times[(case, name)].append((time.perf_counter() - t0) / inner[case])
    load_end = open("/proc/loadavg").read().split()[:3]
    span = f"{' '.join(load)} -> {' '.join(load_end)}"
    print(f"base {args.base}; {args.repeats} interleaved repeats; 1 thread; load {span}")
    print("| case | before median s | after median s | after / before | bit-identical |")
    print("|---|---|---|---|---|")
    for case in cases:
        b, a = (statistics.median(times[(case, k)]) for k in ("before", "after"))
        print(f"| {case} | {b:.4f} | {a:.4f} | {a / b:.3f} | {identical[case]} |")


if __name__ == "__main__":
    main()
