"""Sol-RL on the embedded task: each side's best time to a reward-and-diversity target, over the settings raced.

Usage::

    python -m bench.solrl_frontier SEED:LOG [SEED:LOG ...] [--targets 1.25:0.85 1.28:0.85 1.28:0.80]

``python -m bench.solrl budget`` races the two arms at one ``objective.kl_beta`` each. A KL moves a run
along a reward-diversity line, and two stage's extreme-seed advantages pull harder against the same KL
than single stage's, so a race at one shared KL can favour two stage by holding single stage on a lower
plateau. This reads the evaluation tables of several such races (each log as printed by ``bench.solrl
budget``, with the train seed it ran) and asks, per seed, how soon each side reaches a target point
(reward >= R with the reader at least the base model's and the diversity ratio >= D,
:func:`bench.solrl.reach_time`) with the best setting it was raced at: the fastest single-stage setting against
the fastest two-stage setting. A setting is an arm's KL and its other overrides (``--set`` / ``--set-single``:
lr, group size, candidates, ...); one raced in several logs counts once, from the first log given.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

from bench.solrl import TABLE_KEYS, reach_time

ARMS = {"single-stage DiffusionNFT": "single", "two-stage Sol-RL": "two"}
COLUMNS = ["train_s", "iteration", *TABLE_KEYS]  # the evaluation table `bench.solrl` prints
OVERRIDES = re.compile(r"overrides (\[.*?\]) / (\[.*?\])")  # the first line's single / two-stage override lists


def arm_kls(first_line: str) -> tuple[float, float]:
    """The single-stage and two-stage ``kl_beta`` of a race, from the first line ``bench.solrl budget`` prints.

    Since 2026-11-27 the line says ``kl_beta A / B``; earlier logs only list the overrides
    (``objective.kl_beta=X`` in the single-stage list, then the two-stage list, the last one winning as
    in the config), the configs then having no KL (0.0) and the single-stage arm not inheriting the
    two-stage one.

    Args:
        first_line: the log's ``Machine: ...`` line.

    Returns:
        ``(single-stage kl_beta, two-stage kl_beta)``.

    Raises:
        ValueError: the line names no overrides, or a KL that is not a number.
    """
    shown = re.search(r"kl_beta (\S+) / (\S+);", first_line)
    if shown:
        try:
            return float(shown.group(1)), float(shown.group(2))
        except ValueError:
            raise ValueError(f"unreadable kl_beta in the log's first line: {shown.group(0)!r}") from None
    lists = OVERRIDES.search(first_line)
    if not lists:
        raise ValueError(f"not a `bench.solrl budget` log: its first line names no overrides: {first_line[:120]!r}")

    def kl(text: str) -> float:
        found = re.findall(r"objective\.kl_beta=([^'\s,\]]+)", text)
        try:
            return float(found[-1]) if found else 0.0
        except ValueError:
            raise ValueError(f"unreadable objective.kl_beta override in the log's first line: {found[-1]!r}") from None

    return kl(lists.group(1)), kl(lists.group(2))


Setting = tuple[float, str]  # (kl_beta, the arm's other overrides as "key=value ..."; "" for none)


def _extras(listed: str) -> str:
    """An arm's overrides other than ``objective.kl_beta``, as ``"lr=6e-3 group_size=8"`` (last key part).

    Raises:
        ValueError: the list is not a printed Python list of strings.
    """
    try:
        items = ast.literal_eval(listed)
    except (ValueError, SyntaxError):
        items = None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ValueError(f"unreadable override list in the log's first line: {listed[:120]!r}")
    last: dict[str, str] = {}  # the last override of a key wins, as in the config
    for item in items:
        key, _, value = item.partition("=")
        if key != "objective.kl_beta":
            last[key.rsplit(".", 1)[-1]] = value
    return " ".join(f"{key}={value}" for key, value in last.items())


def arm_settings(first_line: str) -> tuple[Setting, Setting]:
    """The single-stage and two-stage settings of a race: each arm's ``kl_beta`` and its other overrides.

    Races at one KL with other overrides (``optim.lr``, ``prompts.group_size``, ``solrl.candidates``, ...)
    are other settings, not the same one raced twice.

    Args:
        first_line: the log's ``Machine: ...`` line.

    Returns:
        ``((kl, extras) of single stage, (kl, extras) of two stage)``; see :func:`_extras`.

    Raises:
        ValueError: as :func:`arm_kls`, or an override list that cannot be read.
    """
    kls = arm_kls(first_line)
    lists = OVERRIDES.search(first_line)
    if not lists:
        return (kls[0], ""), (kls[1], "")
    return (kls[0], _extras(lists.group(1))), (kls[1], _extras(lists.group(2)))


def label(setting: Setting) -> str:
    """``"kl 0.3"`` or ``"kl 0.3 lr=6e-3"``: a setting as a table column names it."""
    kl, extras = setting
    return f"kl {kl:g}" + (f" {extras}" if extras else "")


Key = tuple[int, str, Setting]  # (train seed, "single" | "two", setting)
Settings = dict[Key, list[dict[str, float]]]
Best = dict[int, dict[str, tuple[float | None, Setting | None]]]


def read_race(text: str) -> dict[str, tuple[Setting, list[dict[str, float]]]]:
    """One ``bench.solrl budget`` log's arms.

    Args:
        text: the log, as the bench printed it (warnings before it are ignored).

    Returns:
        ``{"single" | "two": (setting, evaluation rows)}`` (:func:`arm_settings`), the rows keyed as
        :func:`bench.solrl.reach_time` reads them.

    Raises:
        ValueError: not such a log, several races in one file, or the race did not finish.
    """
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Machine:")]
    if not starts:
        raise ValueError("not a `bench.solrl budget` log: no 'Machine:' line")
    if len(starts) > 1:
        raise ValueError(f"the log holds {len(starts)} races (appended?): give each race its own file")
    start = starts[0]
    setting = dict(zip(("single", "two"), arm_settings(lines[start])))
    rows: dict[str, list[dict[str, float]]] = {"single": [], "two": []}
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ARMS and len(cells) == len(COLUMNS) + 2:
            rows[ARMS[cells[0]]].append(dict(zip(COLUMNS, map(float, cells[1:-1]))))
    if not rows["single"] or not rows["two"]:
        raise ValueError("the log has no finished evaluation table (the race did not end?)")
    return {side: (setting[side], rows[side]) for side in rows}


def collect(runs: list[tuple[int, str]]) -> Settings:
    """Every raced setting's evaluation rows.

    Args:
        runs: ``(train seed, log text)`` per race.

    Returns:
        Rows per ``(seed, "single" | "two", setting)``; where a setting was raced twice, the first log's.
    """
    out: Settings = {}
    for seed, text in runs:
        for side, (setting, rows) in read_race(text).items():
            out.setdefault((seed, side, setting), rows)
    return out


def _times(settings: Settings, reward: float, diversity: float) -> dict[Key, float | None]:
    """Each setting's time to the target (:func:`bench.solrl.reach_time`), computed once."""
    return {key: reach_time(rows, reward, diversity) for key, rows in settings.items()}


def _best(times: dict[Key, float | None]) -> Best:
    """Per seed and side, the fastest of ``times`` and its setting; ``(None, None)`` where none reached it."""
    out: Best = {}
    for (seed, side, setting), t in sorted(times.items()):
        best = out.setdefault(seed, {}).get(side, (None, None))
        if t is not None and (best[0] is None or t < best[0]):
            best = (t, setting)
        out[seed][side] = best
    return out


def best_times(settings: Settings, reward: float, diversity: float) -> Best:
    """Per seed and side, the fastest time to the target and the setting that gave it.

    Args:
        settings: :func:`collect`'s rows.
        reward: the target reward (the reader must be at least the base model's too).
        diversity: the target's smallest ``eval/diversity_ratio``.

    Returns:
        ``{seed: {"single" | "two": (seconds, setting)}}``; ``(None, None)`` where no setting reached it.
    """
    return _best(_times(settings, reward, diversity))


def table(settings: Settings, reward: float, diversity: float) -> str:
    """Markdown: per seed, every setting's time to the target, each side's best, and their ratio (:func:`speedup`).

    Args:
        settings: :func:`collect`'s rows.
        reward: the target reward.
        diversity: the target's smallest diversity ratio.
    """
    keys = sorted({(side, setting) for _, side, setting in settings})
    head = " | ".join(f"{side} {label(setting)}" for side, setting in keys)
    lines = [f"| seed | {head} | best single / best two | speed-up |", "|---" * (len(keys) + 3) + "|"]
    reached = _times(settings, reward, diversity)
    for seed, best in _best(reached).items():
        cells = []
        for side, setting in keys:
            t = reached.get((seed, side, setting))
            cells.append("-" if (seed, side, setting) not in reached else "never" if t is None else f"{t:.0f}")
        (t1, _), (t2, _) = best.get("single", (None, None)), best.get("two", (None, None))
        pair = f"{'never' if t1 is None else f'{t1:.0f}'} / {'never' if t2 is None else f'{t2:.0f}'}"
        bound = _budget(settings, seed) if t1 is None and t2 else 0.0  # only a "single stage never" needs it
        lines.append(f"| {seed} | {' | '.join(cells)} | {pair} | {speedup(t1, t2, bound)} |")
    return "\n".join(lines)


def _budget(settings: Settings, seed: int) -> float:
    """The shortest single-stage training time raced for ``seed``: how long every single-stage setting tried.

    Raises:
        ValueError: no single-stage run for ``seed``.
    """
    times = [rows[-1]["train_s"] for (s, side, _), rows in settings.items() if s == seed and side == "single"]
    if not times:
        raise ValueError(f"seed {seed} has no single-stage run among the logs")
    return min(times)


def speedup(single_s: float | None, two_s: float | None, single_budget: float) -> str:
    """``single_s / two_s`` as text; a lower bound where single stage never reached the target.

    Args:
        single_s: single stage's best time to the target (None: never).
        two_s: two stage's best time (None: never).
        single_budget: the shortest single-stage run raced (:func:`_budget`): "never" means not within it.

    Returns:
        ``"2.00x"``, ``"> 1.50x (single stage never)"``, ``"< 1x (two stage never)"``, or ``"-"`` where the
        ratio means nothing (neither reached it, or two stage at 0 s: a target the base model already meets).
    """
    if two_s is None:
        return "-" if single_s is None else "< 1x (two stage never)"
    if two_s <= 0:
        return "-"
    if single_s is not None:
        return f"{single_s / two_s:.2f}x"
    return f"> {single_budget / two_s:.2f}x (single stage never)"


def _run(spec: str) -> tuple[int, str]:
    """``SEED:LOG`` -> (seed, the log's text)."""
    seed, sep, path = spec.partition(":")
    if not sep or not seed.isdigit():
        raise argparse.ArgumentTypeError(f"{spec!r}: give SEED:LOG, e.g. 0:/tmp/race_s0.log")
    try:
        return int(seed), Path(path).read_text()
    except OSError as err:
        raise argparse.ArgumentTypeError(f"{path}: cannot read the log ({err.strerror})") from None


def _target(spec: str) -> tuple[float, float]:
    """``REWARD:DIVERSITY`` -> (reward, diversity ratio)."""
    reward, _, diversity = spec.partition(":")
    try:
        return float(reward), float(diversity)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: give REWARD:DIVERSITY, e.g. 1.28:0.85") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=_run, help="SEED:LOG of each `bench.solrl budget` race")
    parser.add_argument("--targets", nargs="+", type=_target, default=[(1.25, 0.85), (1.28, 0.85), (1.28, 0.8)])
    args = parser.parse_args()
    try:
        settings = collect(args.runs)
    except ValueError as err:
        parser.error(str(err))
    for reward, diversity in args.targets:
        print(f"\nTarget: reward >= {reward:.3f}, reader >= base, diversity ratio >= {diversity:.2f} (seconds):\n")
        print(table(settings, reward, diversity))


if __name__ == "__main__":
    main()
