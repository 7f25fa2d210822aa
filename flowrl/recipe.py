"""The training recipe: config -> model -> rewards -> Trainer loop -> run folder.

Run folder contents::

    config.yaml                       resolved config
    metrics.jsonl, tensorboard/       per-iteration metrics
    lora/pytorch_lora_weights.safetensors   final LoRA (diffusers ``load_lora_weights`` layout)
    checkpoints/iter-XXXXXX/          full trainer state (resume), verified by its manifest.json;
                                      the newest output.keep_checkpoints are kept
    reward_curve.png                  train and eval reward against iteration (+ guard curves beside it)
    grid_before_after.png             fixed prompts x seeds, before | after
    samples/iter-XXXXXX.png           the held-out evaluation's samples (output.image_every; also TensorBoard)
    checkpoints/best-guard/           with guards: the eval LoRA of the newest evaluation every guard vouched
                                      for (diffusers layout + guard.json; `flowrl sample --lora` takes it)
    summary.json                      start/end eval figures, guards, wall time
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import yaml

from .checkpoint import save_checkpoint
from .config import Config, to_dict, unread_key_lines
from .console import stderr_line
from .distributed import Collective, batch_geometry, check_rank_device, join_launch
from .evaluation.heldout import HeldOutResult
from .models.digits import EVAL_REPORTS
from .outputs import (
    MetricsLogger,
    check_run_dir_free,
    image_grid,
    json_row,
    open_wandb,
    prepare_run_dir,
    require_wandb,
    save_before_after,
    save_reward_curve,
    thumbnails,
    write_json,
    write_text_atomic,
)
from .policy import build_policy
from .prompts.files import Prompt
from .prompts.sets import holdout_split, load_prompts
from .resources import check_machine
from .resume import Resume, check_resume_config, find_resume, prune_checkpoints
from .rollouts.collect import rollout_kind
from .runtime import configure_threads
from .sharding import run_sharding
from .trainer import Trainer, build_objective

GRID_SEED_BASE = 2_000_000
GRID_MAX_PROMPTS = 20


def build_reward(cfg: Config) -> Any:
    """The weighted multi-reward from the config's ``rewards`` section."""
    from .rewards import build_multi_reward

    return build_multi_reward(cfg.rewards)


def load_run_prompts(cfg: Config) -> tuple[list[Prompt], list[Prompt]]:
    """Train and eval prompts: a folder's train/test files, or a hash split of prompts.train."""
    p = cfg.prompts
    if p.test_fraction:
        everything = load_prompts(p.train, split="train")
        return holdout_split(everything, p.test_fraction, "train"), holdout_split(everything, p.test_fraction, "test")
    return load_prompts(p.train, split="train"), load_prompts(p.eval, split="test")


def _grid_inputs(prompts: list[Prompt], seeds: int) -> tuple[list[Prompt], list[int]]:
    chosen = prompts[:GRID_MAX_PROMPTS]
    return [p for p in chosen for _ in range(seeds)], [GRID_SEED_BASE + j for _ in chosen for j in range(seeds)]


def logged_eval(rows: list[dict[str, float]], step: int) -> dict[str, float]:
    """The ``eval/*`` figures a run logged at ``step`` (empty when its metrics hold no such row)."""
    for row in rows:
        if row["step"] == step:
            return {k: v for k, v in row.items() if k.startswith("eval/")}
    return {}


class Run:
    """One training run, set up and validated before anything is written.

    Args:
        cfg: validated config.
        overwrite: replace an existing run folder.
        resume: a run folder (its latest checkpoint that verifies) or a checkpoint folder to
            continue from; its config must match ``cfg`` outside the resumable keys
            (:data:`flowrl.resume.RESUMABLE_KEYS`).
        collective: the launch this process is part of; default :func:`flowrl.distributed.join_launch`
            (an ``accelerate.Accelerator`` under ``accelerate launch`` with several processes).

    On several processes every rank trains on its rows of the global batch (``docs/scale-out.md``);
    only rank 0 evaluates, logs and writes the run folder, and every rank resumes from its checkpoints.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        overwrite: bool = False,
        resume: str | None = None,
        collective: Collective | None = None,
    ):
        self.cfg = cfg
        self.collective = collective or join_launch(cfg.train.collective_timeout_s)
        self.is_main = self.collective.is_main
        self.device_given = cfg.model.device  # what the run folder records: "cuda", not rank 0's "cuda:0"
        check_rank_device(cfg.model.device, self.collective.world_size)  # not every rank on one GPU
        if self.collective.world_size > 1 and cfg.model.device == "cuda":  # one GPU per rank
            cfg.model.device = str(self.collective.accelerator.device)
        kind = rollout_kind(build_objective(cfg).rollout, cfg.sampler.solver)  # SAGE-GRPO's depends on its options
        batch_geometry(cfg, self.collective, kind)  # an impossible split fails before the model loads
        run_sharding(cfg, self.collective)  # a combination sharding does not support yet fails here too
        check_machine(cfg, processes=self.collective.world_size)  # devices, threads, work, memory: before any build
        if cfg.output.wandb and self.is_main:
            require_wandb()  # enabled but not installed: one line, before the model loads
        for line in unread_key_lines(cfg) if self.is_main else []:  # a feature left off: its keys are inert
            stderr_line(f"flowrl: warning: {line}")
        self.out = Path(cfg.output.dir)
        check_run_dir_free(self.out, overwrite, resume)
        self.overwrite = overwrite
        self.resume = self._find_resume(resume) if resume else None
        self.threads = configure_threads(cfg.train.threads)
        torch.manual_seed(cfg.train.seed)
        train_prompts, eval_prompts = load_run_prompts(cfg)
        reward = build_reward(cfg)
        policy = build_policy(cfg, trainable=True)
        self.trainer = Trainer(cfg, policy, reward, train_prompts, eval_prompts, collective=self.collective)
        if self.resume is not None:  # a LoRA that does not fit fails before the run folder is touched
            try:
                self.trainer.check_state_dict(self.resume.state)
            except ValueError as err:
                raise ValueError(f"--resume {self.resume.path}: {err}") from None
        self.eval_report = EVAL_REPORTS.get(cfg.model.path)  # model-specific figures, e.g. the embedded style report
        self.heldout: HeldOutResult | None = None  # the last held-out evaluation, recorded once the row is logged
        self.stop_reason: str | None = None  # a guard with on_trip: stop tripped
        self.collective.barrier()  # every rank checked the folder before rank 0 writes to it

    def config_dict(self) -> dict[str, Any]:
        """The resolved config as ``config.yaml`` and checkpoints record it, the same on every rank.

        On several GPUs each rank trains on its own (``model.device: cuda`` becomes ``cuda:LOCAL_RANK``);
        the record keeps ``cuda``, so a resume compares like with like on every rank and in
        ``flowrl train --processes N --resume``.
        """
        config = to_dict(self.cfg)
        config["model"]["device"] = self.device_given
        return config

    def _find_resume(self, path: str) -> Resume:
        found = find_resume(path)
        for warning in found.warnings if self.is_main else []:  # every rank finds the same: rank 0 says it
            stderr_line(f"flowrl: warning: {warning}")
        check_resume_config(found.state.get("config"), self.config_dict())
        return found

    def _grid(self) -> torch.Tensor:
        prompts, seeds = _grid_inputs(self.trainer.eval_prompts, self.cfg.output.grid_seeds)
        return self.trainer.sample(prompts, seeds)

    def _evaluate(self) -> dict[str, float]:
        self.heldout = self.trainer.evaluate_heldout()
        metrics = dict(self.heldout.metrics)
        if self.eval_report is not None:
            metrics.update({f"eval/{k}": v for k, v in self.eval_report(self.trainer.sample).items()})
        return metrics

    def _record_eval(self, logger: MetricsLogger) -> None:
        """After an evaluation's row is logged: guard warnings (and stop), the best-guard LoRA, the image grid."""
        result, self.heldout = self.heldout, None
        if result is None:
            return
        for trip in result.trips:
            stderr_line(f"flowrl: warning: {trip.message()}")
            if trip.on_trip == "stop" and self.stop_reason is None:
                self.stop_reason = trip.message()
        if self.trainer.heldout.has_guards and result.healthy:
            self._save_best_guard(result)
        every = self.cfg.output.image_every
        if every != 0 and result.iteration % (every or self.cfg.train.eval_every) == 0:
            seeds = self.cfg.train.eval_seeds
            rows = min(len(self.trainer.eval_prompts), GRID_MAX_PROMPTS)
            scale = max(1, 64 // self.trainer.resolution[0])
            logger.log_images(result.iteration, image_grid(thumbnails(result.images[: rows * seeds]), rows, scale))

    def _save_best_guard(self, result: HeldOutResult) -> None:
        """``checkpoints/best-guard/``: the eval LoRA (diffusers layout) of an evaluation every guard vouches for."""
        trainer = self.trainer
        folder = self.out / "checkpoints" / "best-guard"
        folder.mkdir(parents=True, exist_ok=True)
        trainer.model.save_lora(folder, trainer.adapter_weights(trainer.objective.eval_adapter))
        figures = {k: v for k, v in result.metrics.items() if k.startswith(("guard/", "eval/"))}
        write_json(folder / "guard.json", {"iteration": result.iteration, "metrics": json_row(figures)})

    def execute(self) -> dict[str, Any]:
        """Train, writing the run folder (rank 0); returns the summary dict (rank 0's; other ranks: no figures)."""
        trainer = self.trainer
        try:
            logger, before, start_eval = self._start() if self.is_main else (None, None, {})
            self._meet()  # a sharded model: the other ranks made rank 0's start evaluation with it
            if self.resume is not None:
                try:
                    trainer.load_state_dict(self.resume.state)
                except (RuntimeError, ValueError, TypeError, KeyError, AttributeError) as err:
                    detail = str(err).splitlines()[0] if str(err) else type(err).__name__
                    raise ValueError(
                        f"--resume {self.resume.path}: its state does not load into this run ({detail}); "
                        "resume from another checkpoint or start a new run"
                    ) from None
            self.collective.barrier()  # every rank's clock (train.time_budget_s) starts after rank 0's start evaluation
            t0 = time.perf_counter()
            failed = True
            try:
                end_eval = self._loop(logger, t0)
                if not end_eval and logger is not None:
                    # a run resumed from its final checkpoint trains no step: its end figures are the ones
                    # logged at that step (or evaluated now, when that step logged none)
                    end_eval = logged_eval(logger.rows, trainer.iteration) or self._evaluate()
                failed = False
            finally:
                if logger is not None:
                    logger.close()
                trainer.close(abandon=failed)  # a failed or interrupted run does not wait for a chunk's reward
            wall = time.perf_counter() - t0
            if not self.is_main:
                self._meet()  # a sharded model: rank 0's end evaluation, final LoRA and grid
                self.collective.barrier()  # rank 0 writes the final outputs
                return {"iterations": trainer.iteration, "samples_seen": trainer.samples_seen, "start": {}, "end": {}}
            summary = self._finish(self.out, logger, before, start_eval, end_eval, wall)
            self._meet()
            self.collective.barrier()
            return summary
        finally:
            self.collective.close()

    def _meet(self) -> None:
        """A sharded model: rank 0 lets the other ranks go on after its model calls (they made them too)."""
        if self.trainer.lockstep is not None:
            self.trainer.lockstep.meet()

    def _start(self) -> tuple[MetricsLogger, torch.Tensor, dict[str, float]]:
        """Rank 0: the base model's grid, the run folder and its metrics, and the start evaluation."""
        before = self._grid()  # the base model's grid, on resume too (the LoRA is loaded after this)
        if self.resume is None:
            start_eval = self._evaluate()  # also probes every reward before the folder is touched
            out = prepare_run_dir(self.out, self.overwrite)
            logger = self._open_logger(out, resume_step=None)
            logger.log(self.trainer.iteration, start_eval)
            self._record_eval(logger)
        else:  # the run keeps its rows up to the checkpoint and logs no extra row
            self.out.mkdir(parents=True, exist_ok=True)
            logger = self._open_logger(self.out, resume_step=int(self.resume.state["iteration"]))
            start_eval = logged_eval(logger.rows, 0) or self._evaluate()
        return logger, before, start_eval

    def _open_logger(self, out: Path, resume_step: int | None) -> MetricsLogger:
        """Write the resolved config and open the metrics (cut back to ``resume_step`` on resume; wandb if enabled)."""
        config = self.config_dict()
        write_text_atomic(out / "config.yaml", yaml.safe_dump(config, sort_keys=False))
        o = self.cfg.output
        wandb_run = open_wandb(out, o.wandb_project, config, resume_step is not None) if o.wandb else None
        return MetricsLogger(out, resume_step=resume_step, wandb_run=wandb_run)

    def _save_checkpoint(self) -> None:
        """Write ``checkpoints/iter-N`` (state + resolved config); keep the newest ``output.keep_checkpoints``."""
        it = self.trainer.iteration
        state = {**self.trainer.state_dict(), "config": self.config_dict()}
        save_checkpoint(state, self.out / "checkpoints" / f"iter-{it:06d}")
        prune_checkpoints(self.out, self.cfg.output.keep_checkpoints, upto=it)

    def _loop(self, logger: MetricsLogger | None, t0: float) -> dict[str, float]:
        from tqdm import tqdm

        cfg, trainer = self.cfg, self.trainer
        budget = cfg.train.time_budget_s
        bar = tqdm(
            total=cfg.train.iterations,
            initial=trainer.iteration,
            disable=not (cfg.train.progress and self.is_main),
            unit="it",
            dynamic_ncols=True,
        )
        end_eval: dict[str, float] = {}
        while trainer.iteration < cfg.train.iterations:
            metrics = trainer.train_step()
            done = (
                trainer.iteration >= cfg.train.iterations
                or (budget is not None and time.perf_counter() - t0 >= budget)
                or self.stop_reason is not None  # a guard tripped at rank 0's last evaluation (several ranks)
            )
            done = self.collective.any(done) if self.collective.world_size > 1 else done  # every rank stops together
            if logger is None:  # another rank: rank 0 evaluates, logs and checkpoints
                self._meet()
                if done:
                    break
                continue
            evaluated = trainer.iteration % cfg.train.eval_every == 0 or done
            if evaluated:
                end_eval = self._evaluate()
                metrics.update(end_eval)
            logger.log(trainer.iteration, metrics)
            if evaluated:
                self._record_eval(logger)
            # one process stops at the evaluation that tripped, or whose time ran past the budget (that
            # evaluation is the final one); several ranks stop together at the next iteration's check
            spent = evaluated and budget is not None and time.perf_counter() - t0 >= budget
            done = done or ((self.stop_reason is not None or spent) and self.collective.world_size == 1)
            if trainer.iteration % cfg.train.save_every == 0 or done:
                self._save_checkpoint()
            bar.set_postfix(reward=f"{metrics['reward_mean']:.4f}", s_per_it=f"{metrics['time/iteration_s']:.2f}")
            bar.update(1)
            self._meet()
            if done:
                break
        bar.close()
        return end_eval

    def _finish(
        self, out: Path, logger: MetricsLogger, before: torch.Tensor, start: dict, end: dict, wall: float
    ) -> dict[str, Any]:
        trainer = self.trainer
        (out / "lora").mkdir(exist_ok=True)
        eval_adapter = trainer.objective.eval_adapter  # e.g. DiffusionNFT ships its EMA weights
        trainer.model.save_lora(out / "lora", trainer.adapter_weights(eval_adapter))
        after = self._grid()
        rows = min(len(trainer.eval_prompts), GRID_MAX_PROMPTS)
        scale = max(1, 64 // trainer.resolution[0])
        save_before_after(before, after, rows, out / "grid_before_after.png", scale=scale)
        save_reward_curve(
            logger.rows, out / "reward_curve.png", title=f"{self.cfg.objective['name']} on {self.cfg.model.path}"
        )
        summary = {
            "iterations": trainer.iteration,
            "samples_seen": trainer.samples_seen,
            "train_wall_s": round(wall, 2),  # this session's (a resumed run: since it resumed)
            "threads": self.threads,
            "start": start,
            "end": end,
        }
        if trainer.heldout.has_guards:
            guards = trainer.heldout.tracker.summary()
            kept = guards["kept_iteration"]
            guards["kept_lora"] = None if kept is None else str(Path("checkpoints") / "best-guard")
            summary["guards"] = {**guards, "stopped": self.stop_reason}
        if self.resume is not None:  # train_wall_s counts the iterations after this one
            summary["resumed_at_iteration"] = int(self.resume.state["iteration"])
        write_json(out / "summary.json", summary)
        return summary
