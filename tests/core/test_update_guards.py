"""Update guards fire: bad rewards, losses, gradients or weights skip the update, are counted, and stop the run."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowrl.checkpoint import load_checkpoint
from flowrl.cli import main
from flowrl.config import load_config
from flowrl.guards import StepSnapshot, UpdateGuard, UpdateGuardError, reward_fault, tensor_fault, weight_fault
from flowrl.policy import build_policy
from flowrl.prompts.sets import load_prompts
from flowrl.rewards import build_multi_reward
from flowrl.rewards.combine import MultiReward
from flowrl.trainer import Trainer

FAST = [
    "prompts.per_iteration=2",
    "prompts.group_size=3",
    "sampler.num_steps=3",
    "sampler.chunk_size=3",
    "train.eval_seeds=1",
    "optim.lr=0.01",
]

SMALL_RUN = [
    "prompts.per_iteration=2",
    "prompts.group_size=2",
    "sampler.num_steps=2",
    "train.save_every=1",
    "train.eval_every=1",
    "train.eval_seeds=1",
    "train.threads=1",
    "train.progress=false",
    "output.grid_seeds=1",
]


def _trainer(model, reward=None, *extra: str) -> Trainer:
    cfg = load_config(None, FAST + list(extra))
    prompts = load_prompts("digits-styles")
    reward = reward or build_multi_reward(cfg.rewards)
    return Trainer(cfg, build_policy(cfg, model=model, trainable=True), reward, prompts, prompts[:2])


def _lora(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.transformer.named_parameters() if "lora_" in n}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the checks themselves ------------------------------------------------------------------


def test_reward_fault_names_the_reward_and_the_bound():
    total = torch.tensor([1.0, 3e38, 0.5])
    fault = reward_fault(total, {"ink": torch.tensor([1.0, 3e38, 0.5]), "ok": torch.zeros(3)}, 1e6)
    assert "'ink' returned 3e+38" in fault and "train.max_abs_reward=1e+06" in fault and "'ok'" not in fault
    assert reward_fault(torch.tensor([1.0, -2.0]), {"ink": torch.tensor([1.0, float("nan")])}, 1e6) is None
    assert "weighted reward total" in reward_fault(torch.tensor([float("inf")]), {"a": torch.tensor([1.0])}, 1e6)


def test_tensor_and_weight_faults():
    assert tensor_fault("the loss", torch.tensor(1.0)) is None
    assert tensor_fault("the loss", torch.tensor(float("nan"))) == "the loss is not finite (1 of 1 values)"
    params = [torch.zeros(3), torch.tensor([1.0, -2.0])]
    assert weight_fault(params, 10.0) is None
    assert "2 > train.max_lora_weight=1" in weight_fault(params, 1.0)
    assert weight_fault([torch.tensor([float("inf")])], 10.0) == "the updated LoRA weights are not finite"


def test_the_bounds_are_inclusive_and_the_fault_names_the_first_bad_total():
    """``|reward| <= max_abs_reward`` and ``|w| <= max_lora_weight`` are sane (the bound itself passes); the
    clause quotes the first bad total of the batch; a NaN ("not applicable") component of a bad sample is not
    blamed; an empty parameter (numel 0) is skipped, not an error.
    """
    assert reward_fault(torch.tensor([1e6, -1e6]), {"a": torch.tensor([1e6, -1e6])}, 1e6) is None
    assert weight_fault([torch.tensor([2.0, -2.0])], 2.0) is None
    fault = reward_fault(torch.tensor([0.0, 2e7, 5e8]), {"a": torch.tensor([0.0, 2e7, 5e8])}, 1e6)
    assert "|total| 2e+07 >" in fault, fault
    nan = float("nan")
    fault = reward_fault(torch.tensor([3e7]), {"big": torch.tensor([3e7]), "style": torch.tensor([nan])}, 1e6)
    assert "'big' returned 3e+07" in fault and "'style'" not in fault, fault
    assert weight_fault([torch.zeros(0), torch.tensor([0.5])], 1.0) is None


def test_guard_stops_after_k_consecutive_and_names_the_first_fault():
    guard = UpdateGuard(3)
    guard.skip("A", 1)
    guard.ok()  # a good step ends the streak
    guard.skip("B", 3)
    guard.skip("C", 4)
    first = "3 consecutive skipped updates; the first bad quantity: B at iteration 3"
    with pytest.raises(UpdateGuardError, match=first):
        guard.skip("D", 5)
    assert guard.total == 4
    twin = UpdateGuard(3)
    twin.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert twin.state_dict() == guard.state_dict()


def test_step_snapshot_restores_the_adam_moments_as_they_were_before_the_step():
    """The snapshot holds a copy of the optimizer state: the undone step's in-place updates of Adam's moments and
    step count are undone too (a snapshot sharing the state tensors would keep them), as are the weights.
    """
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.tensor([0.5, 0.25])
    optimizer.step()  # moments and step exist now
    before = {k: v.clone() for k, v in optimizer.state[w].items()}
    weights = w.detach().clone()
    snapshot = StepSnapshot([w], optimizer)
    w.grad = torch.tensor([1e3, -1e3])
    optimizer.step()
    snapshot.restore()
    assert torch.equal(w.detach(), weights)
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    assert state.keys() == before.keys()
    assert all(torch.equal(state[k], before[k]) for k in before), {k: (state[k], before[k]) for k in before}


# -- the trainer ----------------------------------------------------------------------------


def flaky_once():
    """A reward whose first call returns scores of 1e9 (past train.max_abs_reward), then ordinary ones."""
    calls = {"n": 0}

    def flaky(images, prompts, **_):
        calls["n"] += 1
        scores = torch.linspace(0, 1, images.shape[0])
        return scores * 1e9 if calls["n"] == 1 else scores

    return flaky


def test_exploding_learning_rate_is_undone_and_stops_the_run(tiny_sd3):
    trainer = _trainer(tiny_sd3, None, "train.max_skipped_updates=2")
    trainer.optimizer.param_groups[0]["lr"] = 1e10  # past the config bound (optim.lr <= 1), as a bug could set it
    before = _lora(trainer)
    metrics = trainer.train_step()  # lr 1e10: the step writes |w| ~ 1e10 -> undone
    assert metrics["train/skipped_updates"] == 1.0 and metrics["guard/skipped_total"] == 1.0
    assert _equal(_lora(trainer), before)
    assert all(not v for v in trainer.optimizer.state.values())  # Adam's moments restored too (none yet)
    with pytest.raises(UpdateGuardError, match="first bad quantity: the updated LoRA weights reach"):
        trainer.train_step()
    assert _equal(_lora(trainer), before)


def test_adam_overflow_lr_is_caught(tiny_sd3):
    trainer = _trainer(tiny_sd3, None, "train.max_skipped_updates=1")
    trainer.optimizer.param_groups[0]["lr"] = 3e38
    before = _lora(trainer)
    with pytest.raises(UpdateGuardError, match="optimizer step overflowed"):
        trainer.train_step()
    assert _equal(_lora(trainer), before)


def test_huge_reward_skips_the_update(tiny_sd3):
    def huge(images, prompts, **_):
        return torch.linspace(0, 3e38, images.shape[0])

    reward = MultiReward({"huge": (huge, 1.0)})
    trainer = _trainer(tiny_sd3, reward, "train.max_skipped_updates=2")
    before = _lora(trainer)
    metrics = trainer.train_step()
    assert metrics["train/skipped_updates"] == 1.0 and _equal(_lora(trainer), before)
    with pytest.raises(UpdateGuardError, match=r"reward 'huge' returned 3e\+38 .*at iteration 1"):
        trainer.train_step()


def test_one_bad_iteration_is_skipped_and_training_goes_on(tiny_sd3):
    reward = MultiReward({"flaky": (flaky_once(), 1.0)})
    trainer = _trainer(tiny_sd3, reward, "train.max_skipped_updates=2")
    before = _lora(trainer)
    assert trainer.train_step()["train/skipped_updates"] == 1.0
    assert _equal(_lora(trainer), before)
    second = trainer.train_step()
    assert second["train/skipped_updates"] == 0.0 and not _equal(_lora(trainer), before)
    assert trainer.guard.consecutive == 0 and trainer.guard.total == 1


def test_nan_loss_is_skipped_not_raised(tiny_sd3, monkeypatch):
    trainer = _trainer(tiny_sd3, None, "train.max_skipped_updates=5")
    real_loss = trainer.objective.loss

    def nan_loss(model, batch, mb):
        loss, stats = real_loss(model, batch, mb)
        return loss * float("nan"), stats

    monkeypatch.setattr(trainer.objective, "loss", nan_loss)
    before = _lora(trainer)
    metrics = trainer.train_step()
    assert metrics["train/skipped_updates"] >= 1.0 and _equal(_lora(trainer), before)
    assert "flow_grpo loss is not finite" in trainer.guard.first_fault


def test_healthy_training_never_skips(tiny_sd3):
    trainer = _trainer(tiny_sd3)
    for _ in range(2):
        metrics = trainer.train_step()
        assert metrics["train/skipped_updates"] == 0.0
    assert trainer.guard.total == 0


def test_every_group_dropped_says_so(tiny_sd3, capsys):
    def constant(images, prompts, **_):
        return torch.ones(images.shape[0])

    trainer = _trainer(tiny_sd3, MultiReward({"constant": (constant, 1.0)}))
    before = _lora(trainer)
    trainer.train_step()
    err = capsys.readouterr().err
    assert "iteration 1: every prompt group was dropped" in err and len(err.strip().splitlines()) == 1
    assert _equal(_lora(trainer), before) and trainer.guard.total == 0
    trainer.collective.rank = 1  # another rank of a launch: rank 0 says it once for every rank
    trainer.train_step()
    assert capsys.readouterr().err == ""


# -- through the CLI: one line, and no checkpoint holds bad weights ------------------------


def test_cli_exploding_run_stops_with_one_line_and_good_checkpoints(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "train",
            *SMALL_RUN,
            "train.iterations=6",
            "optim.lr=1",
            "train.max_lora_weight=0.8",
            "train.max_skipped_updates=2",
            f"output.dir={out}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("flowrl: error: stopped after 2 consecutive skipped updates")
    assert "the updated LoRA weights reach" in err[0] and "at iteration 1" in err[0]
    checkpoints = sorted((out / "checkpoints").glob("iter-*"))
    assert [c.name for c in checkpoints] == ["iter-000001"]  # the skip at iteration 2 raised before saving
    state = load_checkpoint(checkpoints[0])
    assert all(torch.isfinite(w).all() and w.abs().max() <= 0.8 for w in state["lora"].values())
    assert state["guard"] == {"consecutive": 1, "total": 1, "first_fault": state["guard"]["first_fault"]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["train/skipped_updates"] == 1.0


def test_cli_huge_plugin_reward_writes_strict_json(tmp_path, monkeypatch, capsys):
    plugin = tmp_path / "plugins" / "huge_reward.py"
    plugin.parent.mkdir()
    plugin.write_text(
        textwrap.dedent(
            """
            import torch

            def factory():
                def huge(images, prompts, **_):
                    return torch.tensor([3e38, 1.0]).repeat(images.shape[0])[: images.shape[0]]
                return huge
            """
        )
    )
    monkeypatch.syspath_prepend(str(plugin.parent))
    out = tmp_path / "run"
    code = main(
        [
            "train",
            *SMALL_RUN,
            "train.iterations=3",
            "rewards={huge: {reward: 'huge_reward:factory'}}",
            "train.max_skipped_updates=3",
            f"output.dir={out}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("flowrl: error: stopped after 3 consecutive skipped updates")
    assert "reward 'huge' returned 3e+38" in err[-1]
    text = (out / "metrics.jsonl").read_text()
    assert "Infinity" not in text and "NaN" not in text
    rows = [json.loads(line) for line in text.splitlines()]  # strict JSON: non-finite values are null
    assert all(v is None or math.isfinite(v) for row in rows for v in row.values())
    lora = load_file(str(out / "checkpoints" / "iter-000002" / "lora.safetensors"))
    assert all(torch.isfinite(w).all() for w in lora.values())


def test_summary_of_guard_metrics_is_logged(tmp_path):
    out = tmp_path / "run"
    assert main(["train", *SMALL_RUN, "train.iterations=1", f"output.dir={out}"]) == 0
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[1])
    assert row["guard/skipped_total"] == 0.0 and row["train/skipped_updates"] == 0.0
    assert Path(out / "summary.json").is_file()


def test_raising_max_skipped_updates_resumes_a_stopped_run(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", *SMALL_RUN, "optim.lr=1", "train.max_lora_weight=0.8", f"output.dir={out}"]
    assert main([*args, "train.iterations=3", "train.max_skipped_updates=2"]) == 2
    capsys.readouterr()
    assert main([*args, "train.iterations=2", "train.max_skipped_updates=4", "--resume", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["guard/skipped_total"] == 2.0


def test_a_skipped_sage_grpo_step_leaves_its_kl_weight_finite(tiny_sd3, monkeypatch):
    """SAGE-GRPO's adaptive beta averages each step's KL_eff: a skipped step's NaN must not reach the next step."""
    trainer = _trainer(tiny_sd3, None, "objective.name=sage_grpo", "objective.updates_per_iteration=2")
    real_velocity, calls = trainer.model.velocity, {"n": 0}

    def nan_once(*args, **kwargs):
        v = real_velocity(*args, **kwargs)
        calls["n"] += torch.is_grad_enabled()
        return v * float("nan") if calls["n"] == 1 and torch.is_grad_enabled() else v

    monkeypatch.setattr(trainer.model, "velocity", nan_once)
    first = trainer.train_step()
    assert first["train/skipped_updates"] == 1.0 and math.isfinite(trainer.objective.beta)
    second = trainer.train_step()
    assert second["train/skipped_updates"] == 0.0 and math.isfinite(trainer.objective.beta)


def test_a_skipped_iteration_leaves_no_trace_in_the_per_prompt_history(tiny_sd3):
    """advantage.method=per_prompt: the skipped batch's rewards must not normalise later advantages."""
    reward = MultiReward({"flaky": (flaky_once(), 1.0)})
    trainer = _trainer(tiny_sd3, reward, "advantage.method=per_prompt", "advantage.min_count=2")
    before = trainer.advantage.state_dict()
    assert trainer.train_step()["train/skipped_updates"] == 1.0
    assert trainer.advantage.state_dict() == before  # as if the batch had never been scored
    assert trainer.train_step()["train/skipped_updates"] == 0.0
    assert all(max(abs(r) for r in h) <= 1.0 for h in trainer.advantage.state_dict()["history"].values())


def test_an_iteration_with_every_group_dropped_is_not_a_skipped_update(tiny_sd3: object) -> None:
    """Constant rewards drop every group: nothing is trained, but train/skipped_updates is 0 (no fault)."""

    def constant(images: torch.Tensor, prompts: list[str], **_: object) -> torch.Tensor:
        return torch.ones(images.shape[0])

    trainer = _trainer(tiny_sd3, MultiReward({"constant": (constant, 1.0)}))
    metrics = trainer.train_step()
    assert metrics["train/skipped_updates"] == 0.0 and metrics["guard/skipped_total"] == 0.0


def test_a_dropped_optimizer_step_leaves_no_gradients_behind(tiny_sd3: object) -> None:
    """Every step undone (exploding lr): the LoRA parameters hold no gradient after the iteration (set to None)."""
    trainer = _trainer(tiny_sd3, None, "train.max_skipped_updates=2")
    trainer.optimizer.param_groups[0]["lr"] = 1e10  # every step writes |w| ~ 1e10 -> undone
    metrics = trainer.train_step()
    assert metrics["train/skipped_updates"] == 1.0
    assert all(p.grad is None for p in trainer.params)
