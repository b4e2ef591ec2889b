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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlhf.engine.execution.batch import DistBatch
from megatron_rlhf.engine.execution.ppo_engine import PPOEngine
from megatron_rlhf.engine.step.ppo import Experience, PPOAlgorithm
from megatron_rlhf.runtime.checkpoint_store import read_torch_file
from megatron_rlhf.runtime.device import comm_device
from megatron_rlhf.runtime.logging import get_logger

logger = get_logger(__name__)

EXPERIENCE_DIR = "experience"


def describe_experience_ahead(algorithm: PPOAlgorithm) -> list[dict[str, int]]:
    """Step, rows and sequence width of each experience produced ahead (known on every rank)."""
    return [{"step": experience.step, "rows": experience.batch.batch_size,
             "width": experience.batch.schema["input_ids"][1][0]}
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
    asynchronous and have the saved rows and sequence width (otherwise that experience is
    generated again, with a warning). Every rank calls it."""
    if not described:
        return
    rows = algorithm.rollout.rows_per_step
    width = engine.prompt_length + engine.generation.max_new_tokens
    misfits = [f"step {d['step']}: {d['rows']} rows of width {d['width']}" for d in described
               if (d["rows"], d["width"]) != (rows, width)]
    if not algorithm.staleness or misfits:
        why = ("this run is synchronous" if not algorithm.staleness else
               f"this run has {rows} rows of width {width}, the checkpoint {'; '.join(misfits)}")
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
        if layout.held_by(dist.get_rank()) is not None:
            saved = read_torch_file(path / EXPERIENCE_DIR / f"step_{entry['step']:08d}.pt")
            fields = {name: tensor.to(comm_device()) for name, tensor in saved["fields"].items()}
            metrics = saved["metrics"]
            schema = {name: (tensor.dtype, tuple(tensor.shape[1:]))
                      for name, tensor in fields.items()}
        experiences.append(Experience(entry["step"], DistBatch(layout, schema, fields), metrics))
    algorithm.restore_experience_ahead(experiences)
    logger.info("continuing with %d steps of experience produced ahead from %s",
                len(experiences), path)
