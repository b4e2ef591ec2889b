"""Resumable checkpoints of a whole PPO run (docs/reliability.md).

    candidates = resume_candidates(config.checkpoint)    # before init: [] or complete ones
    path = checkpoint_store.select_checkpoint(candidates)  # every rank: newest that verifies
    check_compatible(path, config, tokenizer_fingerprint)
    step = load_rl_checkpoint(run, path)                 # every rank; shadows re-synced
    ...
    saver = CheckpointSaver(config.checkpoint)
    saver.save(run, step)                                # every rank; files written behind
    saver.commit()                                       # every rank, after the next step

One checkpoint, ``<save_dir>/step_00000004`` (4 steps done; the data position is the step)::

    manifest.json        written last: size and sha256 of every other file
    rl_state.json        step, KL controller, score moments, each trained model's LR scheduler and
                         update count, prompt and tokenizer fingerprints, world size, plan, config
    optimizer_common.pt  per trained model: optimizer hyper-parameters and Adam's step
    actor/, critic/      megatron dist checkpoints of weights + optimizer state, keyed by global
                         tensor shapes, so they load at any placement and TP/PP/DP; under
                         Megatron-FSDP its DTensor shards (models.fsdp_checkpoint: any DP, the
                         saved TP; an FSDP switch or a TP change is refused)
    rng/rank_00003.pt    each rank's Python, numpy, torch (CUDA) and megatron-tracker RNG states
    experience/          asynchronous runs: the experience produced ahead, step_<k>.pt each
                         (``engine.experience_ahead``)
    answers/             rollout.continue_answers: per generating replica, the finished answers
                         not yet trained on and the prompts waiting (replica_<d>.pt)

Writes are atomic, verified against the manifest on load, and pruned only after a newer
checkpoint is complete (``runtime.checkpoint_store``). Everything is loaded without running pickled
code (JSON, ``torch.load(weights_only=True)``, models.checkpoint's safe loader).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_rlhf.config.ppo_run import CheckpointConfig, RunConfig
from megatron_rlhf.data.prompts import PromptStream
from megatron_rlhf.engine.execution.ppo_engine import PPOEngine
from megatron_rlhf.engine.step.experience_ahead import (
    describe_answers,
    describe_experience_ahead,
    restore_answers,
    restore_experience_ahead,
    write_answers,
    write_experience_ahead,
)
from megatron_rlhf.engine.step.ppo import PPOAlgorithm
from megatron_rlhf.models.background_save import BackgroundSaveQueue, ThreadedSaveStrategy
from megatron_rlhf.models.checkpoint import (
    INFO_FILE,
    CheckpointInfo,
    ModelDescription,
    load_sharded_checkpoint,
    missing_weights,
    model_sharded_state_dict,
    read_checkpoint_info,
    start_sharded_checkpoint,
    without_absent_extra_state,
    write_sharded_checkpoint,
)
from megatron_rlhf.models.fsdp_checkpoint import (
    is_fsdp_checkpoint,
    load_fsdp_checkpoint,
    write_fsdp_checkpoint,
)
from megatron_rlhf.runtime.checkpoint_store import (
    MANIFEST,
    checkpoint_step,
    complete_checkpoints,
    publish,
    read_torch_file,
    removed_when_disk_full,
    shared_temp_dir,
    unfinished_saves,
)
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.topology.models import ACTOR, CRITIC

logger = get_logger(__name__)

FORMAT_VERSION = 1
RL_STATE = "rl_state.json"
OPTIMIZER_COMMON = "optimizer_common.pt"
# Settings that must not change across a resume, and those that may without a word (the
# tokenizer is compared by fingerprint, the placement is resharded on load).
_MUST_MATCH = ("models.arch", "models.params_dtype", "placement.ac_share",
               "models.moe.num_experts", "models.moe.topk", "models.moe.ffn_hidden_size",
               "models.moe.shared_expert_ffn_size")
_MAY_CHANGE = ("steps", "run_dir", "trace", "checkpoint.", "faults.", "placement.", "cluster.",
               "runtime.distributed.", "runtime.log_", "tokenizer.")


@dataclass
class RunState:
    """The live objects of a run that a checkpoint captures."""

    engine: PPOEngine
    algorithm: PPOAlgorithm
    prompts: PromptStream
    config: RunConfig
    tokenizer_fingerprint: str


# ------------------------------------------------------------------ choosing and checking


def resume_candidates(config: CheckpointConfig) -> list[Path]:
    """The checkpoints a run may resume from, newest first ([] for a fresh run). No process
    group needed: it runs before any distributed work.

    A fresh run never writes into a ``save_dir`` that holds complete checkpoints: its saves would
    replace them and its pruning remove them.

    Raises:
        FileNotFoundError: resuming was asked for and there is nothing to resume from.
        ValueError: a fresh run, or a run resumed from another directory, would write over the
            complete checkpoints in ``save_dir``; ``resume_from`` is one model's checkpoint.
    """
    existing = complete_checkpoints(config.save_dir) if config.save_dir else []
    if config.resume_from:
        path = Path(config.resume_from)
        if not (path / MANIFEST).is_file():
            what = "does not exist" if not path.exists() else f"has no {MANIFEST} (incomplete)"
            raise FileNotFoundError(f"checkpoint.resume_from={path} {what}; name a complete "
                                    "step_<k> directory of a save dir")
        _refuse_model_checkpoint(path)
        if existing and path.resolve().parent != Path(config.save_dir).resolve():
            raise ValueError(_occupied(config.save_dir, existing, f"checkpoint.resume_from="
                                       f"{path} is in another directory, and this run's saves"))
        _warn_abandoned(path, existing)
        return [path]
    if config.resume == "off":
        if existing:
            raise ValueError(_occupied(config.save_dir, existing, "a fresh run's saves"))
        return []
    candidates = existing[::-1]
    unfinished = unfinished_saves(config.save_dir)
    for path in unfinished:
        logger.warning("ignoring %s: an unfinished save (the run stopped while writing it)", path)
    if not candidates and config.resume == "latest":
        raise FileNotFoundError(
            f"--resume: no complete checkpoint in checkpoint.save_dir={config.save_dir} "
            f"({len(unfinished)} unfinished saves); start without --resume (or with --resume "
            "auto), or point --save-dir at the directory the run saved to")
    if not candidates:
        logger.info("--resume auto: no complete checkpoint in %s; starting a fresh run",
                    config.save_dir)
    return candidates


def _occupied(save_dir: str, existing: list[Path], who: str) -> str:
    """The refusal to write into a save dir that holds another run's checkpoints."""
    names = ", ".join(p.name for p in existing[-3:])
    return (f"checkpoint.save_dir={save_dir} holds {len(existing)} complete checkpoints "
            f"({'..., ' if len(existing) > 3 else ''}{names}) that {who} would replace and "
            "prune; continue that run with --resume (or --resume auto, which starts fresh when "
            "there is nothing to resume), or give a new --save-dir")


def _warn_abandoned(path: Path, existing: list[Path]) -> None:
    """Say which later checkpoints of the same directory a resume from ``path`` abandons."""
    later = [p.name for p in existing if checkpoint_step(p) > checkpoint_step(path)]
    if later:
        logger.warning("resuming from %s abandons the later checkpoints %s of the same "
                       "directory; they are removed when this run's first save completes",
                       path, ", ".join(later))


def _refuse_model_checkpoint(path: Path) -> None:
    """Refuse one model's checkpoint (from SFT or RM training) given to resume a PPO run.

    Raises:
        ValueError: naming the ``models.*_checkpoint`` setting that starts a run from it.
    """
    if (path / RL_STATE).is_file() or not (path / INFO_FILE).is_file():
        return
    role = read_checkpoint_info(path).metadata.get("role")
    setting = "models.reward_checkpoint" if role == "reward" else "models.actor_checkpoint"
    raise ValueError(f"checkpoint.resume_from={path} is the checkpoint of one model (role "
                     f"{role!r}), not of a PPO run, so there is no run to continue: start a new "
                     f"run from it with {setting}={path} and no checkpoint.resume_from")


def check_compatible(path: Path, config: RunConfig, tokenizer_fingerprint: str) -> None:
    """Refuse a resume with another model, tokenizer or AC-Share; warn about other changes.

    Raises:
        ValueError: naming the setting, both values and the fix.
    """
    state = read_rl_state(path)
    if state["tokenizer_fingerprint"] != tokenizer_fingerprint:
        raise ValueError(f"checkpoint {path} was trained with another tokenizer (sha256 "
                         f"{state['tokenizer_fingerprint'][:12]}, this run's is "
                         f"{tokenizer_fingerprint[:12]}); resume with the run's tokenizer.* "
                         "settings or start a new run")
    saved, ours, changed = _changed_settings(state, config)
    _refuse_changes(path, state, saved, ours, changed)
    noted = [f"{k}: {saved.get(k)!r} -> {ours.get(k)!r}" for k in changed
             if not k.startswith(_MAY_CHANGE)]
    if noted:
        logger.warning("resuming %s with changed settings, which apply from step %s on (results "
                       "will differ from the uninterrupted run): %s", path, state.get("step"),
                       "; ".join(noted))


def check_resume_settings(candidates: list[Path], config: RunConfig) -> None:
    """Refuse, before any process group, a resume that changes a setting the checkpoint's
    state would override (docs/reliability.md, "Resuming with changed settings"), read from the
    newest candidate whose ``rl_state.json`` reads (a bad one is skipped at selection).

    Raises:
        ValueError: naming the setting, both values and the fix.
    """
    for path in candidates:
        try:
            state = read_rl_state(path)
        except ValueError:
            continue
        _refuse_changes(path, state, *_changed_settings(state, config))
        return


def _changed_settings(state: dict[str, Any], config: RunConfig
                      ) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The saved and this run's flattened settings, and the keys whose values differ."""
    saved, ours = _flatten(state["config"]), _flatten(_config_dict(config))
    return saved, ours, sorted(k for k in saved.keys() | ours.keys()
                               if saved.get(k) != ours.get(k))


def _refuse_changes(path: Path, state: dict[str, Any], saved: dict[str, Any],
                    ours: dict[str, Any], changed: list[str]) -> None:
    """Refuse the changes a resume cannot apply: the model, its precision, AC-Share, and the
    starting coefficient of an adaptive KL controller, which continues from its saved value."""
    for key in changed:
        if key.startswith(_MUST_MATCH):
            raise ValueError(f"checkpoint {path} was saved with {key}="
                             f"{_as_written(saved, key)!r}; this run has "
                             f"{_as_written(ours, key)!r}. Resume with the checkpoint's value, or "
                             "start a new run in another --save-dir")
    if "algorithm.kl_coef" in changed and ours.get("algorithm.adaptive_kl"):
        controller = state.get("ppo", {}).get("kl_controller", {}).get("value", math.nan)
        raise ValueError(
            f"checkpoint {path} was saved with algorithm.kl_coef={saved['algorithm.kl_coef']!r}; "
            f"this run has {ours['algorithm.kl_coef']!r}, but with algorithm.adaptive_kl=true "
            "kl_coef is only the controller's starting value and a resumed run continues from "
            f"the saved coefficient ({controller:.6g}). Resume with algorithm.kl_coef="
            f"{saved['algorithm.kl_coef']!r}, set algorithm.adaptive_kl=false to train at "
            f"{ours['algorithm.kl_coef']!r} from now on, or start a new run in another "
            "--save-dir")


def read_rl_state(path: Path) -> dict[str, Any]:
    """``rl_state.json`` of a checkpoint.

    Raises:
        ValueError: missing, not JSON, or another format version.
    """
    try:
        state = json.loads((path / RL_STATE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path / RL_STATE} cannot be read: {error}") from error
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path / RL_STATE}: not format_version={FORMAT_VERSION}; use the "
                         "release that wrote it")
    return state


# ------------------------------------------------------------------------------ saving


class CheckpointSaver:
    """The saves of one run; collective (every rank calls each method at the same point).

    Synchronous (``checkpoint.async_save=false``): :meth:`save` returns once the checkpoint is
    complete. Asynchronous: :meth:`save` gathers the run state, writes the small files, plans the
    model shards and copies them to host memory (the step waits for this much), and a background
    thread writes the shard files while training goes on; :meth:`commit` (the runner calls it
    after the next step, or at once after the last save) waits for the write on every rank,
    writes the metadata, hashes, writes the manifest and renames, as the synchronous save does.
    Until then the save is a ``.tmp-`` directory, which a resume never picks.

    :meth:`report` gives the seconds of the last save: ``checkpoint/save_s`` (what the step
    waited for), and for a background save ``checkpoint/write_s`` (rank 0's write in the
    background) and ``checkpoint/commit_s`` (waiting for every rank's write, then metadata,
    hashing, manifest, rename).

    Args:
        config: where and how to save.
        shards_in_memory: keep the trained models' megatron shards in these processes
            (``models.memory_checkpoint``) for one load by them: a move's hand-over. The other
            files are written as always; synchronous saves only.
    """

    def __init__(self, config: CheckpointConfig, shards_in_memory: bool = False) -> None:
        if shards_in_memory and config.async_save:
            raise ValueError("shards kept in memory are saved synchronously only")
        self.config, self.shards_in_memory = config, shards_in_memory
        self.queue = BackgroundSaveQueue() if config.async_save else None
        self._pending: tuple[Path, Path, list[ThreadedSaveStrategy]] | None = None
        self._seconds: dict[str, float] = {}

    @property
    def pending(self) -> bool:
        """Whether a save is written in the background and not yet committed."""
        return self._pending is not None

    def save(self, run: RunState, step: int) -> None:
        """Save the run's state after ``step`` steps into ``<save_dir>/step_<step>`` (a
        pending background save is committed first)."""
        self.commit()
        begin = time.perf_counter()
        final = Path(self.config.save_dir).absolute() / f"step_{step:08d}"
        temp, requests = _write_run_state(run, step, final, self.queue is not None,
                                          final if self.shards_in_memory else None)
        finish = partial(publish, temp, final, step, self.config.keep_last)
        if requests:
            requests[-1][0].add_finalize_fn(finish)
            for request, _ in requests:
                self.queue.schedule_async_request(request)
            self._pending = (final, temp, [strategy for _, strategy in requests])
        else:
            with removed_when_disk_full(temp):
                finish()
        self._seconds = {"checkpoint/save_s": time.perf_counter() - begin}
        if not requests:
            logger.info("saved checkpoint %s in %.2f s", final, self._seconds["checkpoint/save_s"])

    def commit(self) -> None:
        """Complete the save whose files are being written in the background, if any."""
        if self._pending is None:
            return
        final, temp, strategies = self._pending
        self._pending = None
        begin = time.perf_counter()
        with removed_when_disk_full(temp):
            try:
                self.queue.maybe_finalize_async_calls(blocking=True)
            except BaseException as error:
                # megatron raises the writers' errors on its coordinator rank only
                own = [w.error for s in strategies for w in s.writers if w.error is not None]
                if own:
                    raise own[0] from error
                raise
        self._seconds.update({
            "checkpoint/write_s": sum(writer.write_seconds for strategy in strategies
                                      for writer in strategy.writers),
            "checkpoint/commit_s": time.perf_counter() - begin})
        logger.info("saved checkpoint %s: %s", final, ", ".join(
            f"{key.split('/')[1]} {value:.2f}" for key, value in self._seconds.items()))

    def report(self) -> dict[str, float]:
        """The last save's seconds (see the class), once; {} when none is left to report."""
        seconds, self._seconds = self._seconds, {}
        return seconds


def _write_run_state(run: RunState, step: int, final: Path, background: bool,
                     kept_as: Path | None) -> tuple[Path, list[tuple[AsyncRequest,
                                                                     ThreadedSaveStrategy]]]:
    """Write a checkpoint's files into a new temporary directory; with ``background``, the
    megatron shards of the trained models are left to the returned requests (in role order);
    with ``kept_as`` (``final``), they are kept in memory under ``kept_as / role``.
    Megatron-FSDP shards are always written here."""
    roles = _trained_roles(run.engine)
    fsdp = {role: run.config.optimizer(role).fsdp for role in roles}
    states = {role: ({}, {}, {}) if fsdp[role] else _role_state(run.engine, role, False)
              for role in roles}
    hosts: list = [None] * dist.get_world_size()
    # World: the checkpoint records the host state of every rank.
    dist.all_gather_object(hosts, _host_state(run, {r: s[1] for r, s in states.items()}),
                           group=dist.group.WORLD)
    temp = shared_temp_dir(final, stale="step_*.tmp-*")
    with removed_when_disk_full(temp):
        requests = _write_files(run, step, temp, hosts, states, fsdp, background, kept_as)
    return temp, requests


def _write_files(run: RunState, step: int, temp: Path, hosts: list[dict],
                 states: dict[str, tuple[dict, dict, dict]], fsdp: dict[str, bool],
                 background: bool, kept_as: Path | None
                 ) -> list[tuple[AsyncRequest, ThreadedSaveStrategy]]:
    """:func:`_write_run_state`'s writing into ``temp``."""
    roles = list(states)
    write_experience_ahead(run.algorithm, temp)
    write_answers(run.algorithm, temp)
    requests = []
    for role in roles:
        holder = next(h["roles"][role] for h in hosts if role in h["roles"])
        info = CheckpointInfo(model=holder["description"],
                              tp_size=run.engine.plan[role].tp, pp_size=run.engine.plan[role].pp,
                              metadata={"role": role, "step": step})
        if fsdp[role]:
            write_fsdp_checkpoint(run.engine.workers[role].trainer.fsdp_state(), temp / role, info)
        elif background:
            requests.append(start_sharded_checkpoint(states[role][0], temp / role, info))
        else:
            write_sharded_checkpoint(states[role][0], temp / role, info,
                                     None if kept_as is None else kept_as / role)
    rank = dist.get_rank()
    (temp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), temp / "rng" / f"rank_{rank:05d}.pt")
    if rank == 0:
        _write_run_files(temp, run, step, hosts, roles)
    return requests


def _trained_roles(engine: PPOEngine) -> list[str]:
    return [role for role in (ACTOR, CRITIC) if role in engine.plan.models]


def _role_state(engine: PPOEngine, role: str, is_loading: bool,
                with_optimizer: bool = True) -> tuple[dict, dict, dict]:
    """This rank's state of a trained model, split as megatron's loader splits it: sharded
    tensors (the dist checkpoint), common values (identical on the model's ranks: rank 0 saves
    them) and this rank's local values (never saved); empty where the rank holds none of it."""
    worker = engine.workers.get(role)
    if worker is None:
        return {}, {}, {}
    model_sd = model_sharded_state_dict(worker.model, worker.pg_collection)
    state = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = worker.trainer.optimizer_sharded_state_dict(model_sd, is_loading)
    sharded, rest = extract_sharded_base(state)
    local, common = extract_nonpersistent(rest)
    return sharded, common, dict_list_map_inplace(lambda value: value.unwrap(), local)


def _host_state(run: RunState, commons: dict[str, dict]) -> dict[str, Any]:
    """What rank 0 needs from this rank to write the run files."""
    roles = {}
    for role, common in commons.items():
        worker = run.engine.workers.get(role)
        if worker is not None:
            roles[role] = {"description": ModelDescription.from_model(worker.model),
                           "trainer": worker.trainer.state_dict(),
                           "optimizer_common": common.get("optimizer", {})}
    return {"roles": roles, "ppo": run.algorithm.state_dict() if roles else None}


def _write_run_files(temp: Path, run: RunState, step: int, hosts: list[dict],
                     roles: list[str]) -> None:
    holders = {role: next(h["roles"][role] for h in hosts if role in h["roles"])
               for role in roles}
    state = {
        "format_version": FORMAT_VERSION, "step": step,
        "ppo": next(h["ppo"] for h in hosts if h["ppo"] is not None),
        "trainers": {role: holder["trainer"] for role, holder in holders.items()},
        "prompts_fingerprint": run.prompts.fingerprint,
        "tokenizer_fingerprint": run.tokenizer_fingerprint,
        "world_size": dist.get_world_size(), "plan": run.engine.plan.to_dict(),
        "config": _config_dict(run.config),
        "experience_ahead": describe_experience_ahead(run.algorithm),
        "answers": describe_answers(run.algorithm),
    }
    (temp / RL_STATE).write_text(json.dumps(state, indent=1, sort_keys=True))
    torch.save({role: holder["optimizer_common"] for role, holder in holders.items()},
               temp / OPTIMIZER_COMMON)


# ----------------------------------------------------------------------------- loading


def load_rl_checkpoint(run: RunState, path: Path, skip: Collection[str] = ()) -> int:
    """Restore a run's state from a checkpoint, at this run's placement; collective.

    Weights and optimizer state are resharded to this run's TP/PP/DP; shadows are rebuilt by
    weight sync; RNG states are restored where the world size and plan are the ones saved.

    Args:
        run: the freshly built run.
        path: a complete, verified checkpoint.
        skip: pieces of ``RESUME_PIECES`` to leave out (``checkpoint.resume_skip`` of a resume;
            a move leaves nothing out).

    Returns:
        The step to continue from.

    Raises:
        ValueError: the checkpoint lacks a model this run trains, or holds another model.
    """
    state = read_rl_state(path)
    commons = read_torch_file(path / OPTIMIZER_COMMON)
    for role in _trained_roles(run.engine):
        if role not in state["trainers"]:
            raise ValueError(f"checkpoint {path} holds no {role} (saved with placement.ac_share="
                             f"{state['config']['placement']['ac_share']}); resume with that")
        _load_role(run.engine, role, path, commons[role], state["trainers"][role], skip,
                   run.config.optimizer(role).fsdp)
    if "kl_controller" not in skip:
        run.algorithm.load_state_dict(state["ppo"])
    if state["prompts_fingerprint"] != run.prompts.fingerprint:
        logger.warning("checkpoint %s was saved with other prompts (rollout.prompts_per_step, "
                       "prompts.*, runtime.seed): the batches from step %d on differ from the "
                       "original run's", path, state["step"] + 1)  # counted from 1, as progress
    run.engine.sync_weights()
    if "rng" not in skip:
        _restore_rng(path, state, run.engine)
    if "experience" not in skip:
        restore_experience_ahead(run.engine, run.algorithm, path,
                                 state.get("experience_ahead", []))
        restore_answers(run.engine, run.algorithm, path, state.get("answers", {}))
    logger.info("resumed from %s after %d steps", path, state["step"])
    return 0 if "data_position" in skip else int(state["step"])


def _load_role(engine: PPOEngine, role: str, path: Path, common: dict, trainer_state: dict,
               skip: Collection[str], fsdp: bool) -> None:
    info = read_checkpoint_info(path / role)
    _check_same_sharding(info, path / role, role, fsdp, engine.plan[role].tp)
    worker = engine.workers.get(role)
    if worker is not None:
        ours = ModelDescription.from_model(worker.model)
        differ = [f"{name}={value!r} (ours {mine!r})"
                  for name, value, mine in ours.mismatches(info.model)]
        if differ:
            raise ValueError(f"checkpoint {path / role} holds another model: {', '.join(differ)}"
                             "; resume with the checkpoint's models.* settings")
    with_optimizer = "optimizer" not in skip
    if fsdp:
        worker.trainer.load_fsdp_state(lambda state: load_fsdp_checkpoint(state, path / role),
                                       with_optimizer)
    else:
        sharded, _, local = _role_state(engine, role, is_loading=True,
                                        with_optimizer=with_optimizer)
        if "model" in sharded:  # saved by the other layer implementation: no TE extra state
            sharded["model"] = without_absent_extra_state(sharded["model"], path / role)
        loaded = load_sharded_checkpoint(sharded, path / role)
        if worker is None:
            return
        missing, unexpected = worker.model.load_state_dict(loaded["model"], strict=False)
        if missing_weights(missing) or unexpected:
            raise ValueError(f"checkpoint {path / role} does not fill the {role}: missing "
                             f"{missing_weights(missing)[:4]}, unexpected {unexpected[:4]}")
        if with_optimizer:
            worker.trainer.load_optimizer_state(
                merge(merge(loaded["optimizer"], common), local.get("optimizer", {})))
        else:
            worker.trainer.reload_main_params()
    if "scheduler" not in skip:
        worker.trainer.load_state_dict(trainer_state)


def _check_same_sharding(info: CheckpointInfo, directory: Path, role: str, fsdp: bool,
                         tp: int) -> None:
    """Refuse a Megatron-FSDP checkpoint into a run without it, the reverse, and an FSDP
    checkpoint at another TP size (its DTensors hold SwiGLU's [gate; up] per TP shard)."""
    saved = is_fsdp_checkpoint(info)
    field_ = f"{role}_optimizer.fsdp"
    if saved != fsdp:
        raise ValueError(
            f"checkpoint {directory} was saved with {field_}={str(saved).lower()} but this run "
            f"has {field_}={str(fsdp).lower()}: Megatron-FSDP's DTensor checkpoints and megatron "
            f"dist checkpoints do not load into each other; resume with {field_}="
            f"{str(saved).lower()}, or start a new run in another checkpoint.save_dir")
    if fsdp and info.tp_size != tp:
        raise ValueError(
            f"checkpoint {directory} holds the {role} under Megatron-FSDP at tp={info.tp_size}, "
            f"this run places it at tp={tp}: an FSDP checkpoint loads at another DP size but "
            f"not another TP size; resume with placement.tp={info.tp_size} (or a "
            f"placement.parallel.{role}.tp override), or start a new run")


def _rng_state() -> dict[str, Any]:
    name, keys, position, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss,
                       cached),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(path: Path, state: dict, engine: PPOEngine) -> None:
    """Restore this rank's RNG streams if it is the same rank of the same layout."""
    same_plan = json.loads(json.dumps(engine.plan.to_dict())) == state["plan"]
    if state["world_size"] != dist.get_world_size() or not same_plan:
        logger.warning("not restoring RNG states: %s was saved with another world size or "
                       "placement; the run continues correctly but not bit-exactly", path)
        return
    saved = read_torch_file(path / "rng" / f"rank_{dist.get_rank():05d}.pt")
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, position, has_gauss, cached = saved["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(saved["torch"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    get_cuda_rng_tracker().set_states(saved["tracker"])


def _config_dict(config: RunConfig) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(config)))


def _as_written(flat: dict[str, Any], key: str) -> Any:
    """``key``'s value in a flattened config; a mapping given whole (``models.arch``) whole."""
    if key in flat:
        return flat[key]
    return {name[len(key) + 1:]: value for name, value in flat.items()
            if name.startswith(f"{key}.")} or None


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: tree}
