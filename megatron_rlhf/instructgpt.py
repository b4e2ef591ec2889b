"""The InstructGPT pipeline in one job: tokenizer -> SFT -> reward model -> PPO.

Every rank runs the three steps in order, in the same processes; each step writes its own run
directory under ``run_dir`` (``sft/``, ``rm/``, ``ppo/``) and the next step starts from the
previous one's checkpoint. The data is the shipped synthetic task (written to ``run_dir/data``)
or the caller's preference files, split into SFT / RM / PPO portions by prompt.

On the synthetic task the held-out prompts of ``data/test.jsonl`` measure each model the same
way (``engine.evaluation``): the untrained policy (``untrained/``, a PPO run of zero steps from
the initialisation), the SFT model (PPO's evaluation before its first step) and PPO's final
policy (its evaluation after the last step).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_run import EvalConfig, RunConfig
from megatron_rlhf.config.supervised_run import RMConfig, SFTConfig
from megatron_rlhf.data import SyntheticTaskConfig, write_task_jsonl
from megatron_rlhf.runtime.bootstrap import initialize_runtime

# The stages, their evaluation and the report's hacking check import megatron-core (seconds per
# process); they are imported where they run, so that check_stage_configs, which every rank
# reaches first, imports none (tools/run_pipeline.py).

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


STEPS = ("sft", "rm", "untrained", "ppo")
"""The run directories under ``run_dir``, in the order they are written."""


@dataclass
class PipelineResult:
    """Where each step wrote its run, its last metrics, and the held-out evaluations."""

    run_dir: Path
    final: dict[str, dict]
    """Last metrics record of each of :data:`STEPS` ({} for a step that did not run)."""
    held_out: dict[str, dict[str, float]]
    """``untrained``, ``sft`` and ``ppo`` (final policy) -> its ``eval/...`` metrics (empty
    without held-out prompts)."""
    kl_target: float | None
    """The adaptive KL controller's target per sequence, or None with a fixed coefficient."""
    evaluation: EvalConfig
    """The PPO run's evaluation settings (its reward-hacking thresholds)."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Wall clock of each stage that ran in this job, in :data:`STAGE_NAMES` order, as this rank
    measured it (the report prints rank 0's)."""


STAGE_NAMES = {"sft": "SFT (data included)", "rm": "reward model",
               "untrained": "untrained model's evaluation", "ppo": "PPO (evaluations included)"}
"""How the report names each timed stage."""


@contextmanager
def _timed(seconds: dict[str, float], stage: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    seconds[stage] = time.perf_counter() - start


def _data_paths(run_dir: Path, paths: Sequence[str]) -> tuple[list[str], list[str]]:
    """Training and held-out files: the caller's, or those of the synthetic task under
    ``run_dir/data``."""
    if paths:
        return list(paths), []
    data_dir = run_dir / "data"
    return [str(data_dir / "train.jsonl")], [str(data_dir / "test.jsonl")]


def _write_data(run_dir: Path, paths: Sequence[str], task: SyntheticTaskConfig
                ) -> tuple[list[str], list[str]]:
    """Training and held-out files: the caller's, or the synthetic task written by rank 0."""
    if not paths:
        if dist.get_rank() == 0:
            write_task_jsonl(run_dir / "data", task)
        # World: every rank reads the files rank 0 writes.
        dist.barrier(group=dist.group.WORLD)
    return _data_paths(run_dir, paths)


def _data_overrides(train: Sequence[str], held_out: Sequence[str]) -> list[str]:
    """The supervised stages' ``data.*`` paths."""
    data = [f"data.paths=[{','.join(train)}]"]
    if held_out:
        data.append(f"data.eval_paths=[{','.join(held_out)}]")
    return data


def check_stage_configs(run_dir: str | Path, data_paths: Sequence[str],
                        ppo_overrides: Sequence[str], sft_overrides: Sequence[str] = (),
                        rm_overrides: Sequence[str] = ()) -> RunConfig:
    """Load each stage's configuration with its overrides, before any stage runs, and return
    the PPO one: a mistake in the reward model's or PPO's overrides is refused at once, not
    after SFT has trained. No process group, no megatron-core.

    Raises:
        ValueError: a stage's configuration is refused; the message names the stage.
    """
    run_dir = Path(run_dir)
    data = _data_overrides(*_data_paths(run_dir, data_paths))
    stages = [("PPO", RunConfig, "ppo_pipeline.yaml", [*ppo_overrides]),
              ("SFT", SFTConfig, "sft_pipeline.yaml",
               [f"out_dir={run_dir / 'sft'}", *data, *sft_overrides]),
              ("reward-model", RMConfig, "rm_pipeline.yaml",
               [f"out_dir={run_dir / 'rm'}", *data, *rm_overrides])]
    configs = []
    for stage, schema, example, overrides in stages:
        try:
            configs.append(load_config(schema, EXAMPLES / example, overrides))
            configs[-1].check_machine()
        except ValueError as error:
            raise ValueError(f"{stage} stage: {error}") from None
    return configs[0]


def _records(path: Path) -> list[dict]:
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.strip()]


def run_pipeline(run_dir: str | Path, data_paths: Sequence[str], ppo_overrides: Sequence[str],
                 sft_overrides: Sequence[str] = (), rm_overrides: Sequence[str] = ()
                 ) -> PipelineResult:
    """SFT, reward-model training and PPO in sequence; every rank calls it.

    Raises:
        ConfigError, ValueError: a stage's configuration is refused, before any stage runs.
    """
    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.supervised.loop import CHECKPOINT_DIR, TOKENIZER_FILE
    from megatron_rlhf.supervised.reward_model import run_reward_training
    from megatron_rlhf.supervised.sft import run_sft

    run_dir = Path(run_dir)
    ppo_settings = check_stage_configs(run_dir, data_paths, ppo_overrides, sft_overrides,
                                       rm_overrides)
    initialize_runtime()
    seconds: dict[str, float] = {}
    with _timed(seconds, "sft"):
        task = ppo_settings.prompts.synthetic
        train, held_out = _write_data(run_dir, data_paths, task)
        data = _data_overrides(train, held_out)
        sft = load_config(SFTConfig, EXAMPLES / "sft_pipeline.yaml",
                          [f"out_dir={run_dir / 'sft'}", *data, *sft_overrides])
        run_sft(sft)
    sft_checkpoint = run_dir / "sft" / CHECKPOINT_DIR
    with _timed(seconds, "rm"):
        rm = load_config(RMConfig, EXAMPLES / "rm_pipeline.yaml",
                         [f"out_dir={run_dir / 'rm'}", f"model.init_checkpoint={sft_checkpoint}",
                          *data, *rm_overrides])
        run_reward_training(rm)
    evaluation = [f"evaluation.paths=[{','.join(held_out)}]"] if held_out else []
    # reward.model_weight=0 runs PPO without a reward model: the trained one is left out.
    reward = ([f"models.reward_checkpoint={run_dir / 'rm' / CHECKPOINT_DIR}"]
              if ppo_settings.reward.model_weight else [])
    ppo = load_config(RunConfig, EXAMPLES / "ppo_pipeline.yaml", [
        f"run_dir={run_dir / 'ppo'}", f"models.actor_checkpoint={sft_checkpoint}", *reward,
        f"tokenizer.model_path={run_dir / 'sft' / TOKENIZER_FILE}",
        f"prompts.paths=[{','.join(train)}]", *evaluation, *ppo_overrides])
    if held_out:
        # The same evaluation of the policy the SFT run started from: zero PPO steps from the
        # initialisation (models.init_seed), every other model as in the PPO run.
        with _timed(seconds, "untrained"):
            run_ppo(dataclasses.replace(
                ppo, steps=0, run_dir=str(run_dir / "untrained"),
                models=dataclasses.replace(ppo.models, actor_checkpoint=""),
                checkpoint=dataclasses.replace(ppo.checkpoint, save_dir="", save_interval=0,
                                               resume="off", resume_from="")))
    with _timed(seconds, "ppo"):
        run_ppo(ppo)
    return dataclasses.replace(read_result(run_dir, ppo), stage_seconds=seconds)


def read_result(run_dir: Path, ppo: RunConfig) -> PipelineResult:
    """The result of a finished pipeline, from the metrics its steps wrote under ``run_dir``."""
    from megatron_rlhf.engine.run.evaluation import eval_metrics

    records = {step: _records(run_dir / step / "metrics.jsonl") for step in STEPS}
    # PPO's last record is the evaluation after its last step, a record of its own.
    final = {step: next((r for r in reversed(rows) if set(r) - {"step"} - set(eval_metrics(r))),
                        {}) for step, rows in records.items()}
    held = {"untrained": eval_metrics(records["untrained"][-1] if records["untrained"] else {}),
            "sft": eval_metrics(records["ppo"][0] if records["ppo"] else {}),
            "ppo": eval_metrics(records["ppo"][-1] if records["ppo"] else {})}
    algorithm = ppo.algorithm
    return PipelineResult(run_dir, final, held,
                          algorithm.kl_target if algorithm.adaptive_kl else None,
                          ppo.evaluation)


MODE_NOTES = {
    "sampled": "what PPO optimises",
    "greedy": "the policy's argmax, which PPO does not optimise: docs/results/main-job.md",
}
"""What each decoding mode's held-out score means, printed beside its ordering."""


def _rule_score_ordering(held: dict[str, dict[str, float]], mode: str) -> str:
    """``untrained 0.029 < SFT 0.451 < PPO final 0.800``: whether each stage raised the held-out
    rule score of ``mode`` answers over the previous one."""
    key, text = f"eval/{mode}/rule_score", ""
    previous = None
    for stage, name in (("untrained", "untrained"), ("sft", "SFT"), ("ppo", "PPO final")):
        value = held[stage].get(key, float("nan"))
        if previous is not None:
            text += " < " if value > previous else " > " if value < previous else " = "
        text += f"{name} {value:.3f}"
        previous = value
    return f"  {mode} answers, rule score: {text} ({MODE_NOTES[mode]})"


def _step(record: dict) -> str:
    """The step of a metrics record as the progress lines count it, from 1 (``?`` without one);
    the records number their steps from 0."""
    return str(record["step"] + 1) if "step" in record else "?"


def format_report(result: PipelineResult) -> str:
    """The closing summary: each step's last metrics, the held-out comparison, where to look."""
    from megatron_rlhf.engine.run.evaluation import hacking_report

    sft, rm, ppo = (result.final[k] for k in ("sft", "rm", "ppo"))
    nan = float("nan")
    lines = [
        f"run directory: {result.run_dir.resolve()}",
        f"SFT: step {_step(sft)}, held-out loss {sft.get('eval_loss', nan):.3f}",
        f"reward model: step {_step(rm)}, held-out pairwise accuracy "
        f"{rm.get('eval_accuracy', nan):.3f}",
    ]
    if "rm_score" in ppo:
        lines.append(f"PPO: step {_step(ppo)}, reward-model score "
                     f"{ppo['rm_score']:.3f}, rule score {ppo['rule_score']:.3f}, "
                     f"KL {ppo['kl']:.3f}")
    held = result.held_out
    if held["ppo"]:
        lines.append("held-out prompts, rule score / reward-model score (greedy | sampled):")
        names = {"untrained": "untrained model", "sft": "SFT model (PPO start)",
                 "ppo": f"PPO final (after {_step(ppo)} steps)"}
        for key, name in names.items():
            lines.append(f"  {name:<28}" + " | ".join(
                f"{held[key].get(f'eval/{mode}/rule_score', nan):.3f} / "
                f"{held[key].get(f'eval/{mode}/rm_score', nan):.3f}"
                for mode in ("greedy", "sampled")))
        target = (f" (adaptive controller, target {result.kl_target:g})"
                  if result.kl_target is not None else " (fixed coefficient)")
        lines.append(f"  KL of the final policy to the SFT model on held-out prompts: "
                     f"{held['ppo'].get('eval/sampled/kl', nan):.3f} nats per answer{target}")
        lines += [_rule_score_ordering(held, mode) for mode in MODE_NOTES]
        hacking = hacking_report(held["sft"], held["ppo"], result.evaluation.hacking_tolerance,
                                 result.evaluation.hacking_rm_rise)
        lines += ([f"WARNING reward hacking: {line}" for line in hacking] or
                  ["reward hacking: not seen (the held-out rule score did not fall while the "
                   "reward-model score rose)"])
    if result.stage_seconds:
        lines.append("wall clock: " + ", ".join(
            f"{STAGE_NAMES[stage]} {seconds:.0f} s"
            for stage, seconds in result.stage_seconds.items()))
    lines.append(f"curves: {result.run_dir / 'curves.png'}")
    return "\n".join(lines)
