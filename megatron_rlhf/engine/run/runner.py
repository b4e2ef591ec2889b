"""A whole PPO run: config -> tokenizer and prompts -> plan -> engine -> steps -> metrics.

Everything that can be refused (config values, placement, data, checkpoints to start or resume
from) is checked before the first process group is created. The run saves resumable checkpoints
(``checkpoint.*``), stops after the current step and saves on SIGTERM, and every rank records its
stage for the fault tracker, so a rank that dies, raises or hangs is named by the others
(docs/reliability.md).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_rlhf.builder.sources import ModelSource, fresh_heads, resolve_sources
from megatron_rlhf.config.loader import to_yaml
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.data import rule_score
from megatron_rlhf.data.demonstrations import DemonstrationStream
from megatron_rlhf.data.prompts import PromptStream
from megatron_rlhf.engine.execution.episodes import EpisodeRollouts
from megatron_rlhf.engine.execution.function_rewards import FunctionRewards
from megatron_rlhf.engine.execution.ppo_engine import RuleReward
from megatron_rlhf.engine.execution.throughput import step_throughput
from megatron_rlhf.engine.run.build import (
    build_engine,
    check_checkpoint_tokenizers,
    check_evaluation_size,
    make_plan,
)
from megatron_rlhf.engine.run.cadence import HeldOutCadence, PlacementCadence, SaveCadence
from megatron_rlhf.engine.run.checkpointing import (
    RunState,
    check_compatible,
    check_resume_settings,
    load_rl_checkpoint,
    resume_candidates,
)
from megatron_rlhf.engine.run.evaluation import HeldOutEvaluator, eval_metrics
from megatron_rlhf.engine.run.export import HFExporter
from megatron_rlhf.engine.run.inputs import load_demonstrations, load_eval_set, load_prompts
from megatron_rlhf.engine.run.move import LiveRun, PlacementMover
from megatron_rlhf.engine.run.replan import HISTORY, RunReplanner, check_replan
from megatron_rlhf.engine.step.ppo import PPOAlgorithm
from megatron_rlhf.generation.episodes import EpisodeConfig
from megatron_rlhf.models.hf_tokenizer import HFTokenizer, checkpoint_tokenizer
from megatron_rlhf.models.prompting import encode_prompt, tool_message_for
from megatron_rlhf.models.tokenizer import Tokenizer, load_tokenizer
from megatron_rlhf.rewards import RewardFunctions
from megatron_rlhf.rewards.tools import CALL_CLOSE, Tools
from megatron_rlhf.runtime.bootstrap import frozen_heap, initialize_runtime
from megatron_rlhf.runtime.checkpoint_store import (
    check_writable_dir,
    is_disk_full,
    remove_unfinished_saves,
    select_checkpoint,
)
from megatron_rlhf.runtime.context import RunContext
from megatron_rlhf.runtime.distributed import live_groups
from megatron_rlhf.runtime.faults import (
    NonFiniteError,
    PreemptionWatcher,
    install_fault_tracker,
)
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.runtime.memory_meter import MemoryMeter
from megatron_rlhf.runtime.metrics import MetricsWriter
from megatron_rlhf.runtime.tracing import Tracer, write_chrome_trace
from megatron_rlhf.topology.cluster import cluster_from_environment
from megatron_rlhf.topology.models import ACTOR, resolve_arch
from megatron_rlhf.topology.plan import PlacementPlan

logger = get_logger(__name__)


def run_tokenizer(config: RunConfig, sources: dict[str, ModelSource]) -> Tokenizer | HFTokenizer:
    """The configured tokenizer, or the actor's own when it starts from a Hugging Face directory
    and no tokenizer is configured.

    Raises:
        FileNotFoundError: that directory has no ``tokenizer.json`` (the message says how to
            write one).
    """
    actor = sources.get(ACTOR)
    configured = config.tokenizer.hf_dir or config.tokenizer.model_path
    if not configured and actor is not None and actor.is_hf:
        return checkpoint_tokenizer(actor.path, "models.actor_checkpoint")
    return load_tokenizer(config.tokenizer)


def load_eval_prompts(config: RunConfig, tokenizer: Tokenizer | HFTokenizer) -> list[list[int]]:
    """Tokenised held-out prompts (``evaluation``), or [] when the run has none."""
    return load_eval_set(config, tokenizer)[0]


def rule_reward_for(config: RunConfig, tokenizer: Tokenizer) -> RuleReward | None:
    """The configured rule-based reward on decoded text, or None."""
    if config.reward.rule == "none":
        return None
    return lambda prompt, response: rule_score(tokenizer.decode(prompt), tokenizer.decode(response))


def function_rewards_for(config: RunConfig, tokenizer: Tokenizer | HFTokenizer
                         ) -> FunctionRewards | None:
    """The configured reward functions (``reward.functions``) on decoded text, or None."""
    reward = config.reward
    if not reward.functions:
        return None
    return FunctionRewards(RewardFunctions(reward.specs, reward.on_error, reward.timeout_s,
                                           reward.workers), tokenizer.decode)


def episode_rollouts_for(config: RunConfig, tokenizer: Tokenizer | HFTokenizer
                         ) -> EpisodeRollouts | None:
    """Multi-turn rollouts with the configured tools (``rollout.tools``) or environment
    (``rollout.environment``), or None."""
    rollout = config.rollout
    if not rollout.multi_turn:
        return None
    environment = rollout.environment_spec
    bounds = EpisodeConfig(rollout.max_turns, rollout.max_episode_tokens,
                           config.generation.max_new_tokens,
                           stop=None if environment else CALL_CLOSE)
    if environment is not None:
        return EpisodeRollouts(bounds, tokenizer.encode, tokenizer.decode,
                               environment=environment,
                               encode_prompt=lambda text: encode_prompt(
                                   tokenizer, text, None, config.prompts.chat_template))
    return EpisodeRollouts(bounds, tokenizer.encode, tokenizer.decode,
                           tools=Tools(rollout.tool_specs, rollout.tool_on_error,
                                       rollout.tool_timeout_s, rollout.tool_workers),
                           tool_message=tool_message_for(tokenizer,
                                                         config.prompts.chat_template),
                           encode_continuation=tokenizer.encode_continuation,
                           overlap_tools=rollout.overlap_tools)


@dataclass
class RunInputs:
    """What a run reads and starts once, whatever its placement: a move keeps them."""

    sources: dict[str, ModelSource]
    tokenizer: Tokenizer | HFTokenizer
    prompts: PromptStream
    eval_prompts: list[list[int]]
    eval_records: list[dict[str, Any]]
    demonstrations: DemonstrationStream | None
    function_rewards: FunctionRewards | None
    episodes: EpisodeRollouts | None
    context: RunContext


def assemble_run(config: RunConfig, plan: PlacementPlan, inputs: RunInputs,
                 load_initial: bool) -> LiveRun:
    """This rank's engine, algorithm, exporter and evaluator at ``plan``. Collective.

    Args:
        load_initial: load the trained models' configured initial checkpoints (a resumed or
            moved run loads its RL checkpoint over them instead).
    """
    tokenizer = inputs.tokenizer
    # A Hugging Face tokenizer ends replies with any of its EOS ids (Llama-3, Qwen).
    eos = getattr(tokenizer, "eos_ids", tokenizer.eos_id)
    engine = build_engine(config, plan, eos, tokenizer.pad_id, load_initial=load_initial,
                          sources=inputs.sources, context=inputs.context,
                          token_vocab_size=tokenizer.vocab_size, episodes=inputs.episodes)
    prompts = inputs.prompts
    algorithm = PPOAlgorithm(engine, config.algorithm, config.rollout, config.reward,
                             config.runtime.seed, prompts.batch, config.steps,
                             rule_reward_for(config, tokenizer),
                             on_nan=config.faults.on_nan, demonstrations=inputs.demonstrations,
                             ptx_coef=config.ptx.coef, function_rewards=inputs.function_rewards,
                             records=prompts.batch_records)
    run = RunState(engine, algorithm, prompts, config, tokenizer.fingerprint)
    evaluator = (HeldOutEvaluator(engine, inputs.eval_prompts, algorithm.rule_reward,
                                  tokenizer.decode, config.evaluation.log_examples,
                                  inputs.function_rewards, inputs.eval_records)
                 if inputs.eval_prompts else None)
    return LiveRun(run, evaluator, HFExporter(config, inputs.sources, tokenizer))


def run_ppo(config: RunConfig) -> Path:
    """Run PPO as configured; returns the run directory. Every rank calls it.

    Args:
        config: the run.

    Raises:
        ValueError, FileNotFoundError: bad configuration, data or checkpoints (before any
            distributed work where possible).
        RankFailure: another rank failed, hung or disagrees (named in the message).
        NonFiniteError: NaN/Inf with ``faults.on_nan=stop``.
    """
    sources = resolve_sources(config)
    tokenizer = run_tokenizer(config, sources)
    if ACTOR not in sources:
        arch = resolve_arch(config.models.arch)
        if tokenizer.vocab_size > arch.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} pieces but models.arch="
                             f"{arch.name!r} embeds {arch.vocab_size}; use a smaller tokenizer "
                             "vocab_size or a larger architecture")
    check_checkpoint_tokenizers(sources, tokenizer)
    candidates = resume_candidates(config.checkpoint)
    check_resume_settings(candidates, config)
    prompts = load_prompts(config, tokenizer)
    eval_prompts, eval_records = load_eval_set(config, tokenizer)
    demonstrations = load_demonstrations(config, tokenizer)
    plan = make_plan(config, cluster_from_environment(config.cluster.pools), sources)
    if eval_prompts:
        check_evaluation_size(plan, config, len(eval_prompts))
    if config.faults.stop_file and Path(config.faults.stop_file).exists():
        raise ValueError(f"faults.stop_file={config.faults.stop_file} exists already, so the run "
                         "would stop after its first step; remove it first")
    check_writable_dir(config.run_dir, "run_dir (--run-dir)")
    check_replan(config, plan.cluster)
    config.check_machine()
    if config.checkpoint.save_dir:
        check_writable_dir(config.checkpoint.save_dir, "checkpoint.save_dir (--save-dir)")
    initialize_runtime(config.runtime)
    kept_groups = live_groups()  # a move destroys every group created after these
    context = RunContext(Tracer(enabled=config.trace or config.placement.replan.enabled),
                         install_fault_tracker(config.faults, config.runtime.distributed.timeout_s),
                         MemoryMeter(enabled=True))
    run_dir = Path(config.run_dir)
    function_rewards = function_rewards_for(config, tokenizer)  # its workers start when used
    episodes = episode_rollouts_for(config, tokenizer)  # so do the tools'
    moves = config.placement.replan.enabled and config.placement.replan.move
    with frozen_heap():  # saves, loads and moves collect only what the run built
        with context.stage("setup", signature=_shape_signature(config)):
            resume_from = select_checkpoint(candidates) if candidates else None
            if resume_from is not None:
                check_compatible(resume_from, config, tokenizer.fingerprint)
            if dist.get_rank() == 0:
                run_dir.mkdir(parents=True, exist_ok=True)
                if resume_from is None:
                    _set_aside_previous_run(run_dir)
                notes = [f"initial weights: {note}" for note in fresh_heads(config, sources)]
                for note in notes:
                    logger.info("%s", note)
                (run_dir / "config.yaml").write_text(
                    to_yaml(config) + "".join(f"# {note}\n" for note in notes))
                (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1))
            inputs = RunInputs(sources, tokenizer, prompts, eval_prompts, eval_records,
                               demonstrations, function_rewards, episodes, context)
            begin = time.perf_counter()
            live = assemble_run(config, plan, inputs, load_initial=resume_from is None)
            build_seconds = time.perf_counter() - begin
        start = 0
        if resume_from is not None:
            with context.stage("checkpoint/load"), live.run.engine.resident():
                start = load_rl_checkpoint(live.run, resume_from, config.checkpoint.resume_skip)
            check_steps_to_go(start, config.steps, resume_from)
        mover = (PlacementMover(
            config, run_dir, kept_groups,
            lambda moved, at: assemble_run(moved, at, inputs, load_initial=False), build_seconds,
            plan) if moves else None)
        try:
            _train(live, start, run_dir, mover)
        except BaseException as error:
            if config.checkpoint.save_dir and is_disk_full(error):
                remove_unfinished_saves(config.checkpoint.save_dir)
            raise
        finally:
            if function_rewards is not None:
                function_rewards.close()  # the worker processes, also when a step raised
            if episodes is not None:
                episodes.close()
    return run_dir


def check_steps_to_go(start: int, steps: int, checkpoint: Path) -> None:
    """Say so when a resumed run has nothing to train: refuse ``steps`` below the checkpoint's
    step, warn when it equals it.

    Raises:
        ValueError: ``steps < start``, naming both and the fix.
    """
    if steps < start:
        raise ValueError(f"steps={steps} (--steps) is below the step of the checkpoint to "
                         f"resume from, {checkpoint} ({start} steps done), so the run would "
                         f"train nothing; give --steps above {start} to train on, or start a new "
                         "run in another --save-dir")
    if steps == start:
        logger.warning("the checkpoint %s has done all steps=%d (--steps): nothing to train; "
                       "give --steps above %d to train on", checkpoint, steps, start)


def algorithm_label(config: RunConfig) -> str:
    """The run's algorithm as ``--algorithm`` names it: ``ppo`` (gae with a critic), ``grpo``,
    ``rloo``, ``reinforce++``."""
    estimator = config.algorithm.advantage_estimator
    return "ppo" if estimator == "gae" else estimator


def run_outputs(config: RunConfig, run_dir: Path) -> str:
    """Where a finished run's outputs are: metrics, the newest checkpoint, the newest Hugging
    Face export (those that exist), for the entry point's last line."""
    parts = [f"metrics in {run_dir / 'metrics.jsonl'}"]
    saves = Path(config.checkpoint.save_dir) if config.checkpoint.save_dir else None
    if saves is None and config.models.export_hf:
        saves = run_dir / "checkpoint"
    newest = _newest(saves, "step_*") if saves is not None else None
    if newest is not None:
        parts.append(f"checkpoints in {saves.absolute()} (newest {newest.name})")
    elif config.checkpoint.save_dir:
        parts.append(f"no checkpoint in {saves.absolute()}")
    else:
        parts.append("no checkpoints (no --save-dir)")
    export = _newest(run_dir / "hf", "step_*") if config.models.export_hf else None
    if export is not None:
        parts.append(f"Hugging Face export in {export.absolute()}")
    return "; ".join(parts)


def _newest(folder: Path, pattern: str) -> Path | None:
    """The last complete ``pattern`` entry of ``folder`` by name (temp dirs excluded)."""
    found = sorted(p for p in folder.glob(pattern) if p.is_dir() and ".tmp" not in p.name)
    return found[-1] if found else None


def _shape_signature(config: RunConfig) -> tuple[str, ...]:
    """Settings that decide the number and shape of every collective: ranks must agree."""
    rollout = config.rollout
    return (f"rollout.prompts_per_step={rollout.prompts_per_step}",
            f"rollout.samples_per_prompt={rollout.samples_per_prompt}",
            f"rollout.max_prompt_length={rollout.max_prompt_length}",
            f"rollout.micro_batch_size={rollout.micro_batch_size}",
            f"rollout.ppo_epochs={rollout.ppo_epochs}",
            f"rollout.num_minibatches={rollout.num_minibatches}",
            f"rollout.pipeline_chunks={rollout.pipeline_chunks}",
            f"generation.max_new_tokens={config.generation.max_new_tokens}",
            f"steps={config.steps}", f"placement={config.placement}")


def _train(live: LiveRun, start: int, run_dir: Path, mover: PlacementMover | None) -> None:
    """Steps ``start`` to ``config.steps``; checkpoints by interval, at the end and on SIGTERM;
    with a ``mover``, moves to another placement after a step where re-planning says it pays.

    Held-out evaluations (``evaluation``) go into the record of the step they precede; the one
    after the last step is a record of its own, numbered ``config.steps``. A save's seconds go
    into the next step's record (the last save's are logged); a save written in the background
    is completed after the next step. So do a move's seconds (``replan/move_seconds``).
    """
    config = live.run.config
    context = live.run.engine.context
    first_eval: dict[str, float] = {}
    if dist.get_rank() == 0:
        first_eval = eval_metrics(_drop_metrics_from(run_dir / "metrics.jsonl", start))
    evaluations = HeldOutCadence(config, first_eval)
    saves = SaveCadence(config, run_dir)
    placement = PlacementCadence(
        RunReplanner(config, live.run.engine.plan, context.tracer, run_dir, start)
        if config.placement.replan.enabled else None, mover)
    faults = context.faults
    preemption = PreemptionWatcher(config.faults.stop_file,
                                   faults.stopped_ranks if faults is not None else None)
    writer = MetricsWriter(run_dir, config.steps, label=algorithm_label(config), first_step=start)
    stop = False
    moved: dict[str, float] = {}
    try:
        for step in range(start, config.steps):
            held_out = evaluations.before_step(live, step, start)
            placement.begin_step()
            metrics, seconds, stop = _step(live, step, saves, preemption)
            metrics.update(held_out)
            metrics.update(step_throughput(live.run.engine, metrics,
                                           config.rollout.rows_per_step, seconds))
            metrics.update(placement.after_step(step, metrics, seconds))
            saves.commit(context)
            # Written before the next save is complete: a resume from it keeps this record.
            writer.write(step, {**metrics, **saves.report(), **moved})
            last = stop or step + 1 == config.steps
            saved = saves.after_step(live, step + 1, last)
            if stop:
                logger.warning("%s", stop_message(step + 1, config.checkpoint.save_dir))
                break
            moved = placement.move_if_due(live, step, saves.saver, saved, last)
        if not stop:
            evaluations.after_run(live, writer)
    finally:
        preemption.close()
        writer.close()
    if config.trace:
        write_chrome_trace(context.tracer, run_dir / "timeline.json")


def _step(live: LiveRun, step: int, saves: SaveCadence, preemption: PreemptionWatcher
          ) -> tuple[dict[str, float], float, bool]:
    """Step ``step``: its metrics (with its seconds and samples/s), its seconds, and whether a
    stop was requested during it."""
    run = live.run
    begin = time.perf_counter()
    # Named as the progress line counts (step k of N, from 1), also in fault reports.
    with run.engine.context.stage(f"step {step + 1}", signature=(step, run.prompts.fingerprint)):
        try:
            metrics = run.algorithm.step(step)
        except NonFiniteError:  # raised by every rank alike: the save can complete
            saves.saver.commit()
            raise
        stop = preemption.requested()
    seconds = time.perf_counter() - begin
    metrics.update(step_seconds=seconds, samples_per_s=run.config.rollout.rows_per_step / seconds)
    return metrics, seconds, stop


def stop_message(steps_done: int, save_dir: str) -> str:
    """What a run stopped on request (SIGTERM, Ctrl-C, the stop file) says after ``steps_done``
    steps: the count the progress line ``step k/N`` shows, and the checkpoint it saved."""
    if not save_dir:
        return (f"stopping after step {steps_done} on request (no checkpoint.save_dir: nothing "
                "was saved)")
    return (f"stopping after step {steps_done} on request; saved "
            f"{Path(save_dir) / f'step_{steps_done:08d}'} (resume with --resume)")


_RUN_OUTPUTS = ("metrics.jsonl", "tensorboard", "config.yaml", "plan.json", "timeline.json",
                HISTORY, "hf")
"""What a run writes into its ``run_dir``."""


def _set_aside_previous_run(run_dir: Path) -> None:
    """Move a previous run's outputs (its metrics and what belongs to them) into
    ``run_dir/previous/<time>/``, so a fresh run in the same directory overwrites nothing."""
    if not (run_dir / "metrics.jsonl").is_file():
        return
    target = run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
    while target.exists():
        target = target.with_name(target.name + "-1")
    target.mkdir(parents=True)
    for name in _RUN_OUTPUTS:
        if (run_dir / name).exists():
            (run_dir / name).rename(target / name)
    logger.warning("run_dir %s held a previous run's metrics: moved them, with its TensorBoard "
                   "events, config, plan, timeline and exports, to %s", run_dir, target)


def _drop_metrics_from(path: Path, step: int) -> dict:
    """Keep only the records of steps before ``step`` (a resumed run writes the rest again).

    Returns:
        The first kept record (the run's first evaluation is in it), or {}.
    """
    if not path.is_file():
        return {}
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() and json.loads(line)["step"] < step]
    path.write_text("".join(kept))
    return json.loads(kept[0]) if kept else {}
