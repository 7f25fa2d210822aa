"""The Gradio app of ``flowrl demo``: a side-by-side checkpoint comparison and the runs' training curves.

Tab "Compare": pick checkpoints (base models first, then each run's final LoRA and, where its
checkpoint has them, the trained and EMA adapters), a prompt, seeds, sampler (ODE or any SDE step),
steps, guidance; every checkpoint samples the same seeds; images carry their scores, and a table
gives the per-checkpoint figures of :mod:`flowrl.evaluation.table`. Video checkpoints play as
looping clips side by side, with a frame strip. Tab "Training curves": the runs' ``metrics.jsonl``.

Generation runs in Gradio's queue (one job at a time, a progress bar in the page), never in the
request thread; a bad input or a refused path becomes a visible error message.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from ..comparison.checkpoints import CheckpointBank
from ..evaluation.table import table_cells
from .generation import Comparison, caption, reward_names, run_comparison, scoring_choices
from .plots import REWARD_KEYS, curves_figure, frame_strip, metric_keys, read_rows, save_gif, to_pil, upscale
from .registry import RunRegistry
from .validation import MAX_PROMPT_CHARS, MAX_SEEDS, MAX_STEPS, samplers, validate_request

DEFAULT_PROMPT = "a bold handwritten 3"
IMAGE_SIZE = 128  # pixels per side shown for each sample (nearest-neighbour upscaling of tiny models)


class DemoState:
    """What the app's handlers share: the registry of checkpoints and the bank of loaded models.

    Args:
        registry: the offered checkpoints and readable folders.
        bank: loaded base models with their adapters.
    """

    def __init__(self, registry: RunRegistry, bank: CheckpointBank):
        self.registry = registry
        self.bank = bank
        self.media = Path(tempfile.mkdtemp(prefix="flowrl-demo-"))

    def run_rows(self) -> dict[str, list[dict[str, float]]]:
        """Each offered run's metrics rows, by run label."""
        labels = {c.run_dir: c.label for c in reversed(self.registry.checkpoints.values()) if c.kind == "final"}
        return {labels[run]: read_rows(run) for run in self.registry.run_dirs if run in labels}

    def compare(self, *inputs: Any, progress: Any = None) -> Comparison:
        """Validate the form and run one comparison (``ValueError``: one line for the page).

        Only the chosen checkpoints' run folders are read again: a run deleted or broken since the demo started
        fails the requests that choose its checkpoints, naming it; the others (the base models included) sample
        with the configs, rewards and guards read when the runs were offered.
        """
        *form, rewards = inputs
        request = validate_request(*form, known=self.registry.labels)
        chosen = [self.registry.checkpoints[label] for label in request.checkpoints]
        for checkpoint in chosen:
            self.registry.check_run(checkpoint)
            if checkpoint.run_dir in self.registry.configs:
                self.bank.use_config(checkpoint.run_dir, self.registry.configs[checkpoint.run_dir])
        spec = self.registry.scoring_spec(rewards or None)
        report = None
        if progress is not None:
            report = lambda i, n, what: progress((i, n), desc=f"sampling {what}" if i < n else what)  # noqa: E731
        return run_comparison(self.bank, chosen, request, spec, progress=report, guards=self.registry.guard_spec())

    def curves(self, keys: list[str] | None, default: list[str]) -> Any:
        """The Training-curves figure of ``keys`` (none chosen: ``default``) from the runs' ``metrics.jsonl`` now.

        Raises:
            ValueError: a ``metrics.jsonl`` that no longer reads (one line naming the file and the fix).
        """
        return curves_figure(self.run_rows(), keys or default)

    def gallery_items(self, comparison: Comparison) -> list[tuple[Any, str]]:
        """(image or GIF path, caption) per checkpoint and seed, checkpoints in rows."""
        items = []
        stamp = time.monotonic_ns()
        for row, label in enumerate(comparison.labels):
            media = comparison.images[label]
            for i in range(len(media)):
                if media.ndim == 5:
                    shown: Any = str(save_gif(media[i], self.media / f"{stamp}-{row}-{i}.gif", size=IMAGE_SIZE))
                else:
                    shown = to_pil(upscale(media[i : i + 1], IMAGE_SIZE)[0])
                items.append((shown, caption(comparison, label, i)))
        return items


def _table(comparison: Comparison) -> Any:
    import pandas as pd

    headers, cells = table_cells(comparison.figures, digits=3)
    return pd.DataFrame(cells, columns=headers)


def _status(comparison: Comparison, seconds: float) -> str:
    lines = [
        f"**{len(comparison.labels)} checkpoints × {len(comparison.seeds)} seeds** in {seconds:.1f} s; "
        "each row of images is one checkpoint, the same seeds in every row."
    ]
    lines += [f"- reward not scored: {e}" for e in comparison.errors]
    return "\n".join(lines)


def build_app(registry: RunRegistry, bank: CheckpointBank | None = None) -> Any:
    """Build the ``gr.Blocks`` app (nothing is loaded or launched until a request comes).

    Args:
        registry: the checkpoints offered and the folders that may be opened.
        bank: loaded models (default: a new :class:`CheckpointBank`).

    Returns:
        The ``gradio.Blocks``; :func:`launch` serves it.
    """
    import gradio as gr

    state = DemoState(registry, bank or CheckpointBank())
    reward_choices = scoring_choices(list(registry.checkpoints.values()))
    rewards = reward_names(list(registry.checkpoints.values()))

    with gr.Blocks(title="flowrl: compare aligned checkpoints") as app:
        gr.Markdown("## flowrl: compare aligned checkpoints")
        with gr.Tab("Compare"):
            with gr.Row():
                with gr.Column(scale=1):
                    checkpoints = gr.CheckboxGroup(
                        registry.labels, value=registry.labels, label="checkpoints", elem_id="checkpoints"
                    )
                    prompt = gr.Textbox(
                        DEFAULT_PROMPT, label=f"prompt (≤ {MAX_PROMPT_CHARS} characters)", elem_id="prompt", lines=2
                    )
                    seeds = gr.Textbox("0, 1, 2, 3", label=f"seeds (≤ {MAX_SEEDS}; e.g. 0, 1, 5-7)", elem_id="seeds")
                    with gr.Row():
                        sampler = gr.Dropdown(samplers(), value="ode", label="sampler", elem_id="sampler")
                        steps = gr.Number(10, label=f"steps (1–{MAX_STEPS})", precision=0, elem_id="steps")
                    with gr.Row():
                        guidance = gr.Number(1.0, label="guidance (1 = no CFG)", elem_id="guidance")
                        noise = gr.Number(0.7, label="SDE noise level", elem_id="noise")
                    scored = gr.Dropdown(
                        reward_choices, value=rewards, multiselect=True, label="score with", elem_id="rewards"
                    )
                    generate = gr.Button("Generate", variant="primary", elem_id="generate")
                    with gr.Accordion("open another run folder", open=False):
                        run_path = gr.Textbox(label="run folder (under the folders the demo was started with)")
                        add_run = gr.Button("add run", elem_id="add_run")
                with gr.Column(scale=3):
                    status = gr.Markdown("Pick checkpoints and press Generate.", elem_id="status")
                    grid = gr.Gallery(
                        label="samples (rows: checkpoints; columns: seeds)",
                        columns=4,
                        elem_id="grid",
                        height="auto",
                        object_fit="contain",
                    )
                    table = gr.Dataframe(label="per-checkpoint figures (mean ± 95% CI)", elem_id="table")
                    strip = gr.Image(label="frame strip (first seed)", visible=False, elem_id="strip")

        with gr.Tab("Training curves"):
            rows = state.run_rows()
            keys = metric_keys(rows)
            chosen_keys = [k for k in REWARD_KEYS if k in keys] or keys[:2]
            metrics = gr.Dropdown(keys, value=chosen_keys, multiselect=True, label="metrics", elem_id="metrics")
            plot = gr.Plot(curves_figure(rows, chosen_keys) if rows else None, label="runs", elem_id="curves")

            def on_metrics(keys: list[str] | None) -> Any:
                try:
                    return state.curves(keys, chosen_keys)
                except (ValueError, OSError) as err:  # a metrics.jsonl broken since the start
                    raise gr.Error(str(err).splitlines()[0]) from None

            metrics.change(on_metrics, metrics, plot)

        def on_generate(*inputs: Any, progress: gr.Progress = gr.Progress()) -> tuple[Any, ...]:
            t0 = time.perf_counter()
            try:
                comparison = state.compare(*inputs, progress=progress)
            except (ValueError, FileNotFoundError) as err:
                raise gr.Error(str(err).splitlines()[0]) from None
            shown = (
                gr.Image(to_pil(frame_strip(_first_seed(comparison))), visible=True) if comparison.is_video else None
            )
            return (
                gr.Gallery(state.gallery_items(comparison), columns=len(comparison.seeds)),
                _table(comparison),
                _status(comparison, time.perf_counter() - t0),
                shown if shown is not None else gr.Image(visible=False),
            )

        def on_add(path: str) -> Any:
            try:
                added = state.registry.add(path)
            except (ValueError, FileNotFoundError) as err:
                raise gr.Error(str(err).splitlines()[0]) from None
            gr.Info(f"added {', '.join(added)}")
            return gr.CheckboxGroup(choices=state.registry.labels)

        generate.click(
            on_generate,
            [prompt, seeds, sampler, steps, guidance, noise, checkpoints, scored],
            [grid, table, status, strip],
            concurrency_limit=1,
        )
        add_run.click(on_add, run_path, checkpoints)
    return app


def _first_seed(comparison: Comparison) -> Any:
    import torch

    return torch.stack([comparison.images[label][0] for label in comparison.labels])


def check_port(port: int | None) -> None:
    """Refuse a ``--port`` no server can bind, before the demo loads any model.

    Raises:
        ValueError: ``port`` outside 1-65535.
    """
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port; pick one in 1-65535, or leave --port out for a free one")


def launch(app: Any, *, host: str = "127.0.0.1", port: int | None = None, share: bool = False, block: bool = True):
    """Serve the app through Gradio's queue (one generation at a time).

    Args:
        app: from :func:`build_app`.
        host: address to bind; 127.0.0.1 unless the user asks for another.
        port: TCP port (None: Gradio picks a free one from 7860).
        share: a public Gradio link (explicit opt-in only).
        block: wait until the server stops (False: return at once, e.g. in tests).

    Returns:
        The app's local URL.

    Raises:
        ValueError: ``port`` outside 1-65535, or ``host:port`` not free to bind (one line, no traceback).
    """
    check_port(port)
    app.queue(default_concurrency_limit=1, max_size=16)
    try:
        _, url, _ = app.launch(
            server_name=host, server_port=port, share=share, prevent_thread_lock=not block, quiet=not block
        )
    except OSError as err:  # the port is taken (Gradio's own error names no errno) or the host is not ours
        reason = err.strerror or str(err).split(". ")[0]
        raise ValueError(f"cannot serve the demo on {host}:{port} ({reason}); pick another --port or --host") from None
    return url
