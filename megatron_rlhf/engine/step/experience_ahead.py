"""Experience produced ahead (asynchronous rollouts) in a checkpoint, so a resume continues with it.

    describe_experience_ahead(algorithm)          # -> rl_state.json's "experience_ahead"
    write_experience_ahead(algorithm, temp)       # every rank; the first trainer rank writes
    restore_experience_ahead(run_engine, algorithm, path, described)   # every rank

An asynchronous run trains step ``k`` on experience the shadows produced during step ``k - 1``
(``rollout.max_staleness`` steps ahead). A checkpoint after step ``k - 1`` stores that experience,
``experience/step_<k>.pt`` with its rows, fields and the metrics of producing it, so a resumed run
trains on exactly what the uninterrupted one would have: regenerating it with the resumed weights
would change every later step. The trainer ranks hold identical copies of every row; the first of
them writes the file and, on resume, every trainer rank of the new placement reads it. The rest
of what decides the next steps is already in the checkpoint or keyed by step: the data position,
the generation noise (a hash of sample id and position), the KL controller and the RNG states.

With answers that go on across steps (``rollout.continue_answers``) the generating replicas also
hold answers not yet trained on: :func:`write_answers` restarts those still decoding and writes
the rest, ``answers/replica_<d>.pt`` per replica, which :func:`restore_answers` reads back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlhf.engine.execution.batch import DistBatch
from megatron_rlhf.engine.execution.experience_fields import (
    EXPERIENCE,
    VERSION_FIELD,
    expected_fields,
)
from megatron_rlhf.engine.execution.ppo_engine import PPOEngine
from megatron_rlhf.engine.step.ppo import Experience, PPOAlgorithm
from megatron_rlhf.runtime.checkpoint_store import read_torch_file
from megatron_rlhf.runtime.device import comm_device
from megatron_rlhf.runtime.logging import get_logger

logger = get_logger(__name__)

EXPERIENCE_DIR = "experience"

LEGACY_FIELDS = frozenset({"gen_logprobs", VERSION_FIELD})
"""Fields that experience saved before they were recorded lacks: it still trains, without the
rollout's agreement metrics or staleness (``Experience.saved_without``)."""


def describe_experience_ahead(algorithm: PPOAlgorithm) -> list[dict[str, int]]:
    """Step, rows, sequence width and field names of each experience produced ahead (known on
    every rank)."""
    return [{"step": experience.step, "rows": experience.batch.batch_size,
             "width": experience.batch.schema["input_ids"][1][0],
             "fields": sorted(experience.batch.schema)}
            for experience in algorithm.experience_ahead]


def write_experience_ahead(algorithm: PPOAlgorithm, temp: Path) -> None:
    """Write every experience produced ahead into ``temp/experience/``; every rank calls it, the
    lowest rank that holds the rows writes."""
    for experience in algorithm.experience_ahead:
        batch = experience.batch
        if batch.fields is None or dist.get_rank() != min(batch.layout.rows):
            continue
        (temp / EXPERIENCE_DIR).mkdir(exist_ok=True)
        torch.save({"step": experience.step, "metrics": experience.metrics,
                    "fields": {name: tensor.cpu() for name, tensor in batch.fields.items()}},
                   temp / EXPERIENCE_DIR / f"step_{experience.step:08d}.pt")


def restore_experience_ahead(engine: PPOEngine, algorithm: PPOAlgorithm, path: Path,
                             described: list[dict[str, int]]) -> None:
    """Continue with the checkpoint's experience produced ahead, where this run can: it must be
    asynchronous and have the saved rows, sequence width and fields (otherwise that experience
    is generated again, with a warning; a checkpoint from before the fields were described may
    lack :data:`LEGACY_FIELDS`). Every rank calls it."""
    if not described:
        return
    rows = algorithm.rollout.rows_per_step
    width = engine.prompt_length + engine.generation.max_new_tokens
    expected = expected_fields(algorithm.features, EXPERIENCE)
    misfits = [f"step {d['step']}: {d['rows']} rows of width {d['width']}" for d in described
               if (d["rows"], d["width"]) != (rows, width)]
    fields_differ = [f"step {d['step']}: {_difference(d['fields'], expected)}"
                     for d in described if set(d.get("fields", expected)) != expected]
    if not algorithm.staleness or misfits or fields_differ:
        why = ("this run is synchronous" if not algorithm.staleness else
               f"this run has {rows} rows of width {width}, the checkpoint {'; '.join(misfits)}"
               if misfits else f"its fields differ from this run's: {'; '.join(fields_differ)}")
        logger.warning("%s holds %d steps of experience produced ahead that this run generates "
                       "again with the resumed weights (%s): it continues correctly but not "
                       "bit-exactly", path, len(described), why)
        return
    layout = engine.trainer_layout(rows)
    schema = engine.rollout_schema()  # ranks without the rows never read it
    experiences = []
    for entry in described:
        metrics: dict[str, Any] = {}
        fields = None
        saved_without: frozenset[str] = frozenset()
        if layout.held_by(dist.get_rank()) is not None:
            saved = read_torch_file(path / EXPERIENCE_DIR / f"step_{entry['step']:08d}.pt")
            fields = {name: tensor.to(comm_device()) for name, tensor in saved["fields"].items()}
            metrics = saved["metrics"]
            schema = {name: (tensor.dtype, tuple(tensor.shape[1:]))
                      for name, tensor in fields.items()}
            saved_without = frozenset((LEGACY_FIELDS & expected) - set(fields))
        experiences.append(Experience(entry["step"], DistBatch(layout, schema, fields), metrics,
                                      saved_without=saved_without))
    algorithm.restore_experience_ahead(experiences)
    logger.info("continuing with %d steps of experience produced ahead from %s",
                len(experiences), path)


def _difference(saved: list[str], expected: frozenset[str]) -> str:
    """What a saved experience's fields lack and add against this run's."""
    lacks, adds = sorted(expected - set(saved)), sorted(set(saved) - expected)
    return ", ".join(part for part in (f"lacks {lacks}" if lacks else "",
                                       f"has {adds}" if adds else "") if part)


ANSWERS_DIR = "answers"


def describe_answers(algorithm: PPOAlgorithm) -> dict[str, int]:
    """With answers that go on across steps (``rollout.continue_answers``): the last step whose
    prompts they hold and the generating replicas that hold them (known on every rank)."""
    if algorithm.answers is None:
        return {}
    return {"fed_through": algorithm.fed_through,
            "replicas": len(algorithm.engine.generation_replicas())}


def _replica_of(engine: PPOEngine, rank: int) -> tuple[int, list[int]] | None:
    """The index and ranks of the generating replica ``rank`` is in, if any."""
    for index, (_, ranks, _) in enumerate(engine.generation_replicas()):
        if rank in ranks:
            return index, ranks
    return None


def write_answers(algorithm: PPOAlgorithm, temp: Path) -> None:
    """Write the answers that go on across steps into ``temp/answers/``, one file per generating
    replica; every rank calls it. The generating ranks first restart their answers still
    decoding (``AnswerPool.state_dict``: their prompts wait again, their tokens are dropped),
    so the saving run continues exactly as its resume will; the finished answers and the
    waiting prompts are saved."""
    if algorithm.answers is None:
        return
    replica = _replica_of(algorithm.engine, dist.get_rank())
    if replica is None:
        return
    state = algorithm.answers.state_dict()
    index, ranks = replica
    if dist.get_rank() == ranks[0]:
        (temp / ANSWERS_DIR).mkdir(exist_ok=True)
        torch.save(state, temp / ANSWERS_DIR / f"replica_{index:03d}.pt")


def restore_answers(engine: PPOEngine, algorithm: PPOAlgorithm, path: Path,
                    described: dict[str, int]) -> None:
    """Continue with the checkpoint's answers where this run can: it continues answers and
    generates on as many replicas (otherwise its answers start afresh from the next step's
    prompts, with a warning: the saved ones are not trained on). Every rank calls it."""
    if not described:
        return
    replicas = len(engine.generation_replicas())
    if algorithm.answers is None or described["replicas"] != replicas:
        why = ("this run sets rollout.continue_answers=false" if algorithm.answers is None else
               f"this run generates on {replicas} replicas, the checkpoint on "
               f"{described['replicas']}")
        logger.warning("%s holds answers that go on across steps which this run leaves out "
                       "(%s): it continues, without training on them", path, why)
        return
    algorithm.fed_through = described["fed_through"]
    replica = _replica_of(engine, dist.get_rank())
    if replica is not None:
        state = read_torch_file(path / ANSWERS_DIR / f"replica_{replica[0]:03d}.pt")
        algorithm.answers.load_state_dict(state, comm_device())
