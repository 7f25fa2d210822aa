"""The demo without a browser: the app builds without launching, path checks, comparisons, one model per base."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from run_folders import make_run

from flowrl.comparison.checkpoints import CheckpointBank, read_run_config
from flowrl.demo.app import DemoState, build_app
from flowrl.demo.registry import RunRegistry
from flowrl.evaluation.table import markdown_table, table_cells
from flowrl.local_launch import free_port

FORM = ("a bold handwritten 3", "0-2", "ode", 4, 1.0, 0.7)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    make_run(root / "run-a", seed=1, guards={"jpeg_incompressibility": {"tolerance": 0.05}})
    make_run(root / "run-b", seed=2)
    return root


@pytest.fixture(scope="module")
def state(runs):
    return DemoState(RunRegistry([runs]), CheckpointBank())


def handler(app: object, name: str) -> object:
    """The function behind the app's event listener ``name`` (e.g. ``on_generate``), to call in-process."""
    return next(f.fn for f in app.fns.values() if f.name == name)


def test_the_app_builds_without_launching(runs):
    import gradio as gr

    app = build_app(RunRegistry([runs]))
    assert isinstance(app, gr.Blocks)
    ids = {getattr(block, "elem_id", None) for block in app.blocks.values()}
    assert {"prompt", "seeds", "sampler", "steps", "generate", "grid", "table", "checkpoints", "curves"} <= ids
    assert not app.is_running


def test_runs_are_found_and_base_comes_first(runs):
    registry = RunRegistry([runs])
    assert registry.labels == ["base", "run-a", "run-b"]
    assert RunRegistry([runs / "run-a"]).labels == ["base", "run-a"]


def test_no_argument_serves_the_embedded_model_and_the_default_runs_folder(tmp_path, monkeypatch, runs):
    monkeypatch.chdir(tmp_path)
    assert RunRegistry().labels == ["base"]  # no runs/ yet: the embedded model alone
    (tmp_path / "runs").mkdir()
    os.symlink(runs / "run-a", tmp_path / "runs" / "digits")
    registry = RunRegistry()
    assert registry.labels == ["base", "digits"]
    assert registry.checkpoints["base"].model_path == "flowrl-digits"


def test_two_start_folders_with_a_run_of_the_same_name_offer_both(runs, tmp_path):
    """A second run-a (under another start folder) is offered as <folder>/run-a beside the first, never over it."""
    other = tmp_path / "other"
    make_run(other / "run-a", seed=3)
    registry = RunRegistry([runs, other])
    assert registry.labels == ["base", "run-a", "run-b", "other/run-a"]
    assert registry.checkpoints["run-a"].run_dir == (runs / "run-a").resolve()
    assert registry.checkpoints["other/run-a"].run_dir == (other / "run-a").resolve()
    both_runs = RunRegistry([runs / "run-a", other / "run-a"])  # start folders that are the runs: their parents
    assert both_runs.labels == ["base", "run-a", "other/run-a"]


def on_model(run: Path, model_path: Path) -> Path:
    """``run`` with its config's ``model.path`` set to ``model_path`` (for labels only: no model is loaded)."""
    data = yaml.safe_load((run / "config.yaml").read_text())
    data["model"]["path"] = str(model_path)
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return run


def test_two_models_in_folders_of_the_same_name_are_both_offered(runs, tmp_path):
    """Runs on m1/model and m2/model offer two base models, base (model) and base (m2/model); the second was dropped
    (one label, kept by setdefault), so r2's own base model could not be chosen."""
    for name, model in (("r1", "m1"), ("r2", "m2")):
        on_model(shutil.copytree(runs / "run-a", tmp_path / "mm" / name), tmp_path / model / "model")
    registry = RunRegistry([tmp_path / "mm"])
    assert registry.labels == ["base (model)", "base (m2/model)", "r1", "r2"]
    bases = [registry.checkpoints[label] for label in registry.labels[:2]]
    assert [c.model_path for c in bases] == [str(tmp_path / "m1" / "model"), str(tmp_path / "m2" / "model")]
    assert [c.run_dir for c in bases] == [registry.checkpoints["r1"].run_dir, registry.checkpoints["r2"].run_dir]


def test_a_run_deleted_or_broken_after_the_start_fails_only_the_requests_that_choose_it(tmp_path):
    """Every Generate re-read every run's config.yaml, so one run deleted (or its config broken) while the demo runs
    failed all of them, `base` alone included, until a restart. Now a request that chooses the run fails with one
    line naming it; the others still sample, the base model of the deleted run included."""
    import gradio as gr

    for seed, name in enumerate(["a", "b", "c"]):
        make_run(tmp_path / name, seed=seed, guards={"jpeg_incompressibility": {}} if name == "a" else None)
    registry = RunRegistry([tmp_path])
    assert registry.checkpoints["base"].run_dir == (tmp_path / "a").resolve()  # the base samples with a's config
    on_generate = handler(build_app(registry, CheckpointBank()), "on_generate")
    shutil.rmtree(tmp_path / "a")
    (tmp_path / "c" / "config.yaml").write_text("model: {path: 5\n")
    _, table, status, _ = on_generate("a bold handwritten 3", "0, 1", "ode", 2, 1.0, 0.7, ["base", "b"], None)
    assert list(table.iloc[:, 0]) == ["base", "b"] and status.startswith("**2 checkpoints × 2 seeds**")
    assert "guard: jpeg_incompressibility" in table.columns  # a's guard, read at the start, still scores
    with pytest.raises(gr.Error, match=re.escape(f"a: {tmp_path / 'a'} holds no config.yaml any more; untick its")):
        on_generate("a bold handwritten 3", "0", "ode", 2, 1.0, 0.7, ["base", "a"], None)
    with pytest.raises(gr.Error, match=r"c: .*/c/config.yaml line 2: invalid YAML .*; untick its checkpoints"):
        on_generate("a bold handwritten 3", "0", "ode", 2, 1.0, 0.7, ["c"], None)


def test_a_metrics_file_broken_after_the_start_is_a_page_error(tmp_path):
    """The Training-curves metric picker shows a metrics.jsonl broken since the start as its one-line page error (it
    raised a plain ValueError, which the page shows as a generic error)."""
    import gradio as gr

    run = make_run(tmp_path / "run", seed=1)
    on_metrics = handler(build_app(RunRegistry([run])), "on_metrics")
    assert on_metrics(["loss"]) is not None
    with open(run / "metrics.jsonl", "a") as f:
        f.write('garbage\n{"step": 9}\n')
    with pytest.raises(gr.Error, match=r"metrics.jsonl: line 5 is not valid JSON .*; repair or remove that line"):
        on_metrics(["reward_mean"])


@pytest.mark.parametrize("path", ["..", "../..", "/etc", "run-a/../../..", "/tmp", "\x00"])
def test_paths_outside_the_start_folders_are_refused(runs, path):
    registry = RunRegistry([runs / "run-a"])
    with pytest.raises(ValueError, match="outside the folders|enter a path"):
        registry.add(path)
    assert registry.labels == ["base", "run-a"]


@pytest.mark.parametrize("path", ["a" * 300, "run-a/" + "b" * 5000])
def test_a_path_no_filesystem_takes_is_one_line(runs, path):
    registry = RunRegistry([runs])
    with pytest.raises(ValueError, match="not a readable path"):
        registry.add(path)


def test_a_symlink_out_of_the_start_folder_is_refused(runs, tmp_path):
    inside = tmp_path / "start"
    inside.mkdir()
    os.symlink(runs / "run-b", inside / "escape")
    registry = RunRegistry([inside])
    with pytest.raises(ValueError, match="outside the folders"):
        registry.add("escape")


def test_a_run_under_the_start_folder_can_be_added(runs):
    registry = RunRegistry([runs])
    with pytest.raises(ValueError, match="no finished run"):
        registry.add(str(runs / "run-a" / "lora"))
    assert registry.add(str(runs / "run-a")) == ["run-a"]


def test_a_comparison_samples_the_same_seeds_for_every_checkpoint(state, runs):
    configured = set(read_run_config(runs / "run-a").rewards)
    comparison = state.compare(*FORM, ["base", "run-a", "run-b"], None)
    assert comparison.labels == ["base", "run-a", "run-b"] and comparison.seeds == (0, 1, 2)
    for label in comparison.labels:
        assert comparison.images[label].shape == (3, 3, 8, 8)
        assert set(comparison.scores[label]) == {"total", *configured}
        assert torch.isfinite(comparison.scores[label]["total"]).all()
    assert not torch.equal(comparison.images["base"], comparison.images["run-a"])
    rows = {f.label: f for f in comparison.figures}
    assert rows["base"].drift is None and rows["run-a"].drift.mean > 0
    headers, cells = table_cells(comparison.figures)
    assert headers[:2] == ["checkpoint", "reward total"] and [c[0] for c in cells] == comparison.labels
    assert "guard: jpeg_incompressibility" in headers  # run-a's guards, as flowrl eval reports them
    assert "| run-a |" in markdown_table(comparison.figures)  # the same figures flowrl eval writes
    items = state.gallery_items(comparison)
    assert len(items) == 9 and "seed 0" in items[0][1] and "total" in items[0][1]


def test_checkpoints_share_one_model_as_named_adapters_and_match_flowrl_sample(state, runs):
    from flowrl.policy import build_policy
    from flowrl.rollouts.chunked import sample_images

    comparison = state.compare(*FORM, ["run-a", "run-b", "base"], None)
    assert len(state.bank._models) == 1  # one base model for both runs
    transformer = state.bank._models["flowrl-digits"].transformer
    assert len(transformer.peft_config) == 2  # one named adapter per checkpoint, switched
    cfg = read_run_config(runs / "run-a")
    policy = build_policy(cfg, lora=runs / "run-a")  # what `flowrl sample --lora` builds
    with torch.no_grad():
        expected = sample_images(policy.model, [FORM[0]] * 3, [0, 1, 2], policy.sigmas(4), resolution=policy.resolution)
    torch.testing.assert_close(comparison.images["run-a"], expected, atol=1e-5, rtol=0)


def test_an_sde_sampler_is_reproducible_per_seed(state):
    one = state.compare("a thin handwritten 7", "4, 5", "flow", 4, 1.0, 0.7, ["run-a"], None)
    two = state.compare("a thin handwritten 7", "5", "flow", 4, 1.0, 0.7, ["run-a"], None)
    ode = state.compare("a thin handwritten 7", "5", "ode", 4, 1.0, 0.7, ["run-a"], None)
    torch.testing.assert_close(one.images["run-a"][1:], two.images["run-a"], atol=1e-6, rtol=0)
    assert not torch.allclose(two.images["run-a"], ode.images["run-a"])


def test_a_reward_that_cannot_read_the_prompt_is_reported_not_fatal(state):
    comparison = state.compare(
        "a bold handwritten digit", "0, 1", "ode", 4, 1.0, 0.7, ["base"], ["ink", "digit_correctness"]
    )
    assert any(e.startswith("digit_correctness") for e in comparison.errors)  # no digit in the prompt
    assert torch.isfinite(comparison.scores["base"]["ink"]).all()
    assert torch.isnan(comparison.scores["base"]["total"]).all()


def test_bad_input_raises_one_line(state):
    with pytest.raises(ValueError, match="steps must be an integer between 1 and"):
        state.compare("a bold handwritten 3", "0", "ode", 0, 1.0, 0.7, ["base"], None)


@pytest.mark.slow
def test_a_run_with_an_ema_checkpoint_offers_trained_and_ema(tmp_path):
    run = make_run(tmp_path / "nft", seed=3, config="configs/nft/digits_fast.yaml", ema=True)
    registry = RunRegistry([run])
    assert registry.labels == ["base", "nft", "nft · trained", "nft · ema"]
    state = DemoState(registry, CheckpointBank())
    comparison = state.compare(*FORM, registry.labels, None)
    images = comparison.images
    assert not torch.allclose(images["nft · trained"], images["nft · ema"])
    torch.testing.assert_close(images["nft"], images["nft · ema"], atol=1e-5, rtol=0)  # the run ships its EMA


@pytest.mark.slow
def test_a_run_whose_checkpoint_fails_verification_offers_its_final_lora_and_says_why(tmp_path, caplog):
    run = make_run(tmp_path / "nft", seed=3, config="configs/nft/digits_fast.yaml", ema=True)
    (checkpoint,) = (run / "checkpoints").iterdir()
    (checkpoint / "lora.safetensors").write_bytes(b"not a tensor file")
    with caplog.at_level("WARNING", logger="flowrl.comparison.checkpoints"):
        assert RunRegistry([run]).labels == ["base", "nft"]
    (message,) = [r.getMessage() for r in caplog.records]
    assert f"{run}: only its final LoRA is offered" in message and "lora.safetensors" in message


@pytest.mark.slow
def test_a_bf16_runs_loras_load_in_fp32_with_the_values_it_saved(tmp_path):
    """On a bf16 model the run trained (and evaluated) its LoRA in fp32; its final LoRA, trained and EMA adapters
    load in fp32 with the saved values bit for bit (they were rounded to bf16 before)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from flowrl.comparison.checkpoints import _newest_adapters, run_checkpoints

    run = make_run(
        tmp_path / "nft", seed=3, config="configs/nft/digits_fast.yaml", ema=True, overrides=["model.dtype=bfloat16"]
    )
    state = _newest_adapters(run)[1]
    file = run / "lora" / "pytorch_lora_weights.safetensors"
    final = {k.removeprefix("transformer."): v for k, v in load_file(file).items()}
    saved = {"final": final, "trained": state["lora"], "ema": state["adapters"]["ema"]}
    bank = CheckpointBank()
    for checkpoint in run_checkpoints(run):
        name = bank.adapter_name(checkpoint)
        transformer = bank.model(checkpoint).transformer
        assert transformer.dtype == torch.bfloat16
        loaded = get_peft_model_state_dict(transformer, adapter_name=name)
        assert loaded.keys() == saved[checkpoint.kind].keys()
        for key, value in loaded.items():
            assert value.dtype == torch.float32 and torch.equal(value, saved[checkpoint.kind][key].float()), key


@pytest.mark.slow
def test_video_checkpoints_play_as_clips_with_a_frame_strip(tmp_path):
    from PIL import Image
    from run_folders import make_wan_run

    from flowrl.demo.app import _first_seed
    from flowrl.demo.plots import frame_strip

    run = make_wan_run(tmp_path / "runs" / "wan", tmp_path / "wan-model")
    registry = RunRegistry([tmp_path / "runs"])
    assert registry.labels == ["base (wan-model)", "wan"]
    state = DemoState(registry, CheckpointBank())
    comparison = state.compare("a red fox running", "0, 1", "ode", 2, 1.0, 0.7, registry.labels, None)
    assert comparison.is_video and comparison.images["wan"].shape == (2, 5, 3, 16, 16)
    items = state.gallery_items(comparison)
    assert len(items) == 4 and all(str(path).endswith(".gif") for path, _ in items)
    with Image.open(items[0][0]) as gif:
        assert gif.n_frames == 5  # the clip plays, frame by frame
    strip = frame_strip(_first_seed(comparison), size=16)
    assert strip.shape[1] < strip.shape[2]  # two rows (base, aligned) of five frames
    assert "temporal_consistency" in comparison.scores["wan"]
    assert run.name == "wan"


def test_the_demo_command_binds_loopback_unless_asked():
    from flowrl.cli import build_parser, parse_command_line

    ns = parse_command_line(build_parser(), ["demo"])
    assert ns.host == "127.0.0.1" and ns.share is False and ns.runs == []
    ns = parse_command_line(build_parser(), ["demo", "runs/a", "--host", "0.0.0.0", "--share", "--port", "7861"])
    assert ns.host == "0.0.0.0" and ns.share and ns.port == 7861 and ns.runs == ["runs/a"]


@pytest.mark.parametrize(
    ("device", "line"),
    [
        ("gpu", "flowrl demo: '--device' is not a device torch knows: 'gpu'; use cpu, cuda, cuda:N or mps"),
        ("cuda:3", "--device='cuda:3' but this machine has"),
    ],
)
def test_a_device_the_machine_lacks_is_one_line_at_the_start(runs, capsys, device, line):
    """``--device cuda:3`` on a CPU machine started the demo; Generate then failed with Gradio's generic error
    and a traceback in the terminal. Now the command refuses it before any model loads."""
    if device.startswith("cuda") and torch.cuda.device_count() > 3:
        pytest.skip("this machine has a cuda:3")
    from flowrl.cli import main

    assert main(["demo", str(runs), "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"flowrl: error: {line}"), err


def test_a_port_taken_or_out_of_range_is_one_line(runs, capsys):
    import socket

    import gradio as gr

    from flowrl.cli import main
    from flowrl.demo.app import launch

    assert main(["demo", str(runs), "--port", "99999"]) == 2  # refused before any model loads
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--port 99999 is not a TCP port; pick one in 1-65535" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with gr.Blocks() as app:
            gr.Markdown("x")
        with pytest.raises(ValueError, match=rf"cannot serve the demo on 127.0.0.1:{port} \(.*\); pick another --port"):
            launch(app, host="127.0.0.1", port=port, block=False)
    assert not app.is_running


def test_a_demo_started_in_the_background_stops_on_sigint(tmp_path):
    """A shell's ``flowrl demo &`` starts with SIGINT ignored; the demo re-arms it, so Ctrl-C / kill -INT stop it."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    port = free_port()
    demo = subprocess.Popen(
        [sys.executable, "-m", "flowrl", "demo", str(tmp_path), "--port", str(port)],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=60) in (0, 130)  # 130: the interrupt came before Gradio waits on its server
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()


def test_the_demo_offers_only_rewards_it_can_build_by_name():
    """``remote`` needs a url: offered only where a run configures it (picking it gave 'cannot build')."""
    from flowrl.demo.generation import scoring_choices
    from flowrl.rewards import required_options

    choices = scoring_choices([])
    assert choices[:2] == ["ink_band", "digit_correctness"]  # the default job's first
    assert "remote" not in choices and required_options("remote") == ["url"]
    assert "pickscore" in choices and required_options("ink_band") == []


def test_a_start_folder_that_does_not_exist_is_refused(tmp_path) -> None:
    """flowrl demo with a folder that does not exist refuses it with one line instead of serving no runs."""
    with pytest.raises(FileNotFoundError, match="missing is not a folder; pass run folders"):
        RunRegistry([tmp_path / "missing"])


def test_the_curves_tab_reads_each_runs_metrics_under_its_label(state, runs) -> None:
    """run_rows: every run's metrics.jsonl rows under the run's label (the final LoRA's), bases have none."""
    from flowrl.demo.plots import read_rows

    rows = state.run_rows()
    assert list(rows) == ["run-a", "run-b"]
    assert rows["run-a"] == read_rows(runs / "run-a") and rows["run-b"] == read_rows(runs / "run-b")
    assert [r["reward_mean"] for r in rows["run-b"]] == pytest.approx([0.7, 0.72, 0.74, 0.76])


def test_progress_reports_each_checkpoint_bases_first_then_scoring(state) -> None:
    """The page's progress gets (done, total) and 'sampling <label>' per checkpoint, bases first, then 'scoring'."""
    calls = []

    def progress(pair: tuple[int, int], desc: str | None = None) -> None:
        calls.append((pair, desc))

    state.compare("a bold handwritten 3", "0", "ode", 2, 1.0, 0.7, ["run-a", "base"], None, progress=progress)
    assert calls == [((0, 2), "sampling base"), ((1, 2), "sampling run-a"), ((2, 2), "scoring")]


def test_gallery_items_are_checkpoint_rows_of_each_seeds_upscaled_sample_and_caption(state) -> None:
    """gallery_items: (checkpoint, seed) row-major; item k is that seed's own sample at IMAGE_SIZE with its caption."""
    import numpy as np

    from flowrl.demo.app import IMAGE_SIZE
    from flowrl.demo.generation import caption
    from flowrl.demo.plots import to_pil, upscale

    comparison = state.compare("a bold handwritten 3", "5, 2", "ode", 2, 1.0, 0.7, ["base", "run-a"], None)
    items = state.gallery_items(comparison)
    assert len(items) == 4
    for k, (image, text) in enumerate(items):
        label, i = comparison.labels[k // 2], k % 2
        assert image.size == (IMAGE_SIZE, IMAGE_SIZE)
        expected = to_pil(upscale(comparison.images[label][i : i + 1], IMAGE_SIZE)[0])
        assert np.array_equal(np.asarray(image), np.asarray(expected)), k
        assert text == caption(comparison, label, i) and text.startswith(f"{label} · seed {(5, 2)[i]} · total ")
    assert not np.array_equal(np.asarray(items[0][0]), np.asarray(items[1][0]))  # seeds 5 and 2 differ


def test_caption_gives_the_seed_then_each_score_to_three_places_or_n_a() -> None:
    """caption: 'label · seed s · name value...' in the scores' order, 3 decimals, 'n/a' for a NaN score."""
    from flowrl.demo.generation import Comparison, caption

    scores = {"run": {"total": torch.tensor([0.5124, float("nan")]), "ink": torch.tensor([0.25, 1.0])}}
    comparison = Comparison(["run"], {"run": torch.zeros(2, 3, 4, 4)}, scores, [], (7, 9), [])
    assert caption(comparison, "run", 0) == "run · seed 7 · total 0.512 · ink 0.250"
    assert caption(comparison, "run", 1) == "run · seed 9 · total n/a · ink 1.000"


def test_status_counts_checkpoints_and_seeds_and_lists_unscored_rewards() -> None:
    """The status line: N checkpoints × S seeds, the seconds to one decimal, one line per reward not scored."""
    from flowrl.demo.app import _status
    from flowrl.demo.generation import Comparison

    comparison = Comparison(["base", "a", "b"], {}, {}, [], (0, 1), ["digit_correctness: no digit in the prompt"])
    assert _status(comparison, 1.26).splitlines() == [
        "**3 checkpoints × 2 seeds** in 1.3 s; each row of images is one checkpoint, the same seeds in every row.",
        "- reward not scored: digit_correctness: no digit in the prompt",
    ]


def test_the_frame_strip_shows_each_checkpoints_first_seed() -> None:
    """_first_seed: the first seed's clip of every checkpoint, in the comparison's order (a strip row each)."""
    from flowrl.demo.app import _first_seed
    from flowrl.demo.generation import Comparison

    gen = torch.Generator().manual_seed(0)
    clips = {label: torch.rand(2, 3, 3, 4, 4, generator=gen) for label in ("base", "run")}
    comparison = Comparison(["run", "base"], clips, {}, [], (0, 1), [])
    assert comparison.is_video
    assert torch.equal(_first_seed(comparison), torch.stack([clips["run"][0], clips["base"][0]]))


@pytest.mark.parametrize("port", [0, -1, 65536])
def test_a_port_outside_1_to_65535_is_refused(port: int) -> None:
    """check_port refuses 0, negatives and 65536 and accepts both ends, 1 and 65535, and no port at all."""
    from flowrl.demo.app import check_port

    with pytest.raises(ValueError, match=f"--port {port} is not a TCP port"):
        check_port(port)
    for ok in (1, 65535, None):
        check_port(ok)


def test_the_generate_handler_fills_grid_table_status_and_turns_bad_input_into_a_page_error(runs, state) -> None:
    """on_generate: a gallery with one column per seed, a table row per checkpoint, the status, no strip for
    images; a bad input becomes a gr.Error with its first line."""
    import gradio as gr

    app = build_app(RunRegistry([runs]), state.bank)
    on_generate = handler(app, "on_generate")
    grid, table, status, strip = on_generate("a bold handwritten 3", "0-2", "ode", 2, 1.0, 0.7, ["base", "run-a"], None)
    assert isinstance(grid, gr.Gallery) and grid.columns == 3
    assert list(table.iloc[:, 0]) == ["base", "run-a"]
    assert status.startswith("**2 checkpoints × 3 seeds** in ")
    assert isinstance(strip, gr.Image) and strip.visible is False
    with pytest.raises(gr.Error, match="steps must be an integer between 1 and"):
        on_generate("a bold handwritten 3", "0", "ode", 0, 1.0, 0.7, ["base"], None)


def test_the_total_comes_first_and_is_the_weighted_sum_of_the_runs_rewards(state) -> None:
    """scores: 'total' first (captions lead with it), equal to ink + 0.1 * jpeg_compressibility (the run's weights)."""
    comparison = state.compare(*FORM, ["run-a"], None)
    scores = comparison.scores["run-a"]
    assert list(scores) == ["total", "ink", "jpeg_compressibility"]
    expected = scores["ink"] + 0.1 * scores["jpeg_compressibility"]
    torch.testing.assert_close(scores["total"], expected, atol=1e-6, rtol=0)
    assert not torch.allclose(scores["total"], scores["ink"] + scores["jpeg_compressibility"])


def test_guidance_and_noise_level_reach_the_sampler(state, runs) -> None:
    """The form's guidance is the true-CFG scale `flowrl sample` would use; the SDE noise level changes the samples."""
    from flowrl.policy import build_policy
    from flowrl.rollouts.chunked import sample_images

    guided = state.compare(FORM[0], "0, 1", "ode", 4, 3.0, 0.7, ["run-a"], None).images["run-a"]
    cfg = read_run_config(runs / "run-a")
    cfg.sampler.guidance_scale = 3.0
    policy = build_policy(cfg, lora=runs / "run-a")
    with torch.no_grad():
        expected = sample_images(policy.model, [FORM[0]] * 2, [0, 1], policy.sigmas(4), resolution=policy.resolution)
    torch.testing.assert_close(guided, expected, atol=1e-5, rtol=0)
    plain = state.compare(FORM[0], "0, 1", "ode", 4, 1.0, 0.7, ["run-a"], None).images["run-a"]
    assert not torch.allclose(guided, plain, atol=1e-3)
    low, high = (state.compare(FORM[0], "3", "flow", 4, 1.0, a, ["run-a"], None).images["run-a"] for a in (0.2, 0.7))
    assert not torch.allclose(low, high, atol=1e-3)


def test_each_checkpoints_table_row_scores_its_seeds_as_one_prompt_with_the_runs_guards(state) -> None:
    """figures: the seeds are one prompt's samples (diversity over them), rewards and guards without 'total'."""
    from flowrl.evaluation.metrics import mean_ci, prompt_diversity

    comparison = state.compare(*FORM, ["base", "run-a"], None)
    for figures in comparison.figures:
        images, scores = comparison.images[figures.label], comparison.scores[figures.label]
        assert figures.samples == 3 and set(figures.rewards) == {"ink", "jpeg_compressibility"}
        assert set(figures.guards) == {"jpeg_incompressibility"}  # run-a's guard, its total left out
        assert figures.total.mean == pytest.approx(float(scores["total"].mean()), abs=1e-6)
        assert figures.rewards["ink"].mean == pytest.approx(float(scores["ink"].mean()), abs=1e-6)
        diversity = mean_ci(prompt_diversity(images, torch.zeros(3, dtype=torch.long)))
        assert figures.diversity is not None and figures.diversity.n == 1
        assert figures.diversity.mean == pytest.approx(diversity.mean, abs=1e-6)


def test_a_reward_failing_on_every_checkpoint_is_reported_once(state) -> None:
    """errors: a reward that cannot read the prompt fails for each checkpoint but is listed once."""
    comparison = state.compare(
        "a bold handwritten digit", "0", "ode", 2, 1.0, 0.7, ["base", "run-a"], ["ink", "digit_correctness"]
    )
    assert len(comparison.errors) == 1 and comparison.errors[0].startswith("digit_correctness: ")


def test_the_add_run_handler_offers_a_new_run_and_turns_a_refused_path_into_a_page_error(state, tmp_path) -> None:
    """on_add: a run written under the start folder after launch joins the checkbox choices; an outside path is a
    gr.Error with its first line."""
    import gradio as gr

    app = build_app(RunRegistry([tmp_path]), state.bank)
    on_add = handler(app, "on_add")
    with pytest.raises(gr.Error, match="outside the folders this demo was started with"):
        on_add("/etc")
    make_run(tmp_path / "late", seed=4)
    choices = on_add(str(tmp_path / "late"))
    assert isinstance(choices, gr.CheckboxGroup)
    assert [value for _, value in choices.choices] == ["base", "late"]


def test_the_runs_rewards_are_the_default_scoring_set(runs, state) -> None:
    """reward_names: every reward the runs configure, in order, is the 'score with' default; no run: the default's."""
    from flowrl.config import Config
    from flowrl.demo.generation import reward_names

    registry = RunRegistry([runs])
    assert reward_names(list(registry.checkpoints.values())) == ["ink", "jpeg_compressibility"]
    assert reward_names([]) == list(Config().rewards)
    app = build_app(registry, state.bank)
    (scored,) = [b for b in app.blocks.values() if getattr(b, "elem_id", None) == "rewards"]
    assert scored.value == ["ink", "jpeg_compressibility"]


@pytest.mark.slow
def test_a_video_run_samples_its_configured_frame_count(tmp_path) -> None:
    """A run whose config sets model.num_frames (9) samples clips of that length, not the model card's default (5)."""
    from run_folders import make_wan_run

    run = make_wan_run(tmp_path / "runs" / "wan", tmp_path / "wan-model")
    cfg_file = run / "config.yaml"
    data = yaml.safe_load(cfg_file.read_text())
    data["model"]["num_frames"] = 9
    cfg_file.write_text(yaml.safe_dump(data, sort_keys=False))
    state = DemoState(RunRegistry([tmp_path / "runs"]), CheckpointBank())
    comparison = state.compare("a red fox running", "0", "ode", 2, 1.0, 0.7, ["wan"], ["temporal_consistency"])
    assert comparison.images["wan"].shape == (1, 9, 3, 16, 16)


def test_launch_without_blocking_serves_on_the_asked_host_and_port_and_returns_its_url() -> None:
    """launch(block=False): the app serves on host:port through the queue and the call returns the local URL."""
    import socket
    import threading

    import gradio as gr

    from flowrl.demo.app import launch

    port = free_port()
    with gr.Blocks() as app:
        gr.Markdown("x")
    result: list[str] = []
    caller = threading.Thread(target=lambda: result.append(launch(app, host="127.0.0.1", port=port, block=False)))
    caller.daemon = True
    caller.start()
    caller.join(timeout=120)  # bounds only a failure: a launch that blocks would hang the suite
    try:
        assert not caller.is_alive(), "launch(block=False) did not return: it blocked the caller"
        url = result[0]
        assert url.rstrip("/") == f"http://127.0.0.1:{port}" and app.is_running
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        app.close()
    assert not app.is_running
