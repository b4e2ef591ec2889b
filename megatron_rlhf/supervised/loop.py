"""Supervised training of one model over every rank: the loop SFT and reward-model training share.

    result = run_supervised(config, SFT_OBJECTIVE)   # or RM_OBJECTIVE (supervised/reward_model.py)

They differ only in an :class:`Objective` (data portion, head, micro-batches, loss). A step takes
``global_batch_size`` examples of a per-epoch shuffle seeded by ``runtime.seed``; DP replica ``d``
takes the d-th share. Losses are sums with a count (response tokens, pairs) and the trainer divides
the gradients by the step's global count, so updates do not depend on DP size or micro-batching.
Whatever can be refused (config, layout, data, an existing checkpoint) is refused before any
process group exists.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_rlhf.builder.networks import build_model
from megatron_rlhf.builder.sources import (
    ModelSource,
    arch_spec,
    check_source_experts,
    load_initial_weights,
    read_source,
)
from megatron_rlhf.config.loader import to_yaml
from megatron_rlhf.config.supervised_run import SupervisedConfig, SupervisedDataConfig
from megatron_rlhf.data.readers import PreferenceRecord, read_files
from megatron_rlhf.data.schema import DataConfig
from megatron_rlhf.data.splits import load_splits
from megatron_rlhf.data.synthetic import write_task_jsonl
from megatron_rlhf.models.checkpoint import save_model_checkpoint
from megatron_rlhf.models.forward_backward import Batch, LossFn, run_microbatches
from megatron_rlhf.models.gpt import ModelBuildOptions
from megatron_rlhf.models.hf_tokenizer import TOKENIZER_FILES, HFTokenizer, checkpoint_tokenizer
from megatron_rlhf.models.lora import apply_lora, check_no_adapters
from megatron_rlhf.models.moe import expert_metrics
from megatron_rlhf.models.peft_export import load_peft_adapter
from megatron_rlhf.models.tokenizer import Tokenizer, load_tokenizer
from megatron_rlhf.models.trainer import ModelTrainer
from megatron_rlhf.runtime.bootstrap import initialize_runtime
from megatron_rlhf.runtime.checkpoint_store import check_writable_dir
from megatron_rlhf.runtime.device import compute_device
from megatron_rlhf.runtime.logging import get_logger, setup_logging
from megatron_rlhf.runtime.metric_reduce import all_reduce, values
from megatron_rlhf.runtime.metrics import MetricsWriter
from megatron_rlhf.topology.cluster import ClusterSpec, cluster_from_environment
from megatron_rlhf.topology.groups import build_model_process_groups
from megatron_rlhf.topology.models import ArchSpec, ModelSpec, resolve_arch

logger = get_logger(__name__)

CHECKPOINT_DIR = "checkpoint"
TOKENIZER_FILE = "tokenizer.model"


@dataclass(frozen=True)
class Objective:
    """What makes a supervised task; the loop is shared.

    Attributes:
        name: ``sft`` or ``rm`` (logs, checkpoint metadata).
        role: the PPO role trained (``actor``, ``reward``).
        head: its head (``lm``, ``scalar``).
        portion: the split portion trained on (``sft``, ``rm``).
        make_examples: records -> a dataset (``SFTDataset``, ``RMDataset``).
        microbatches: ``(examples, tokenizer, max_length, micro_batch_size,
            use_chat_template)`` -> micro-batches of one common length.
        loss_fn: ``(tp_group, real_vocab_size) -> ((output, batch) -> (sum, count, metrics))``,
            the metrics typed by their reduction (``runtime/metric_reduce.py``).
        metrics: the name and type (``Mean``, ...) of each metric of ``loss_fn``, reduced over
            a step or the held-out set (every rank reduces them, those with no loss too).
        load_checkpoint: ``(model, pg_collection, directory)``: load ``model.init_checkpoint``.
    """

    name: str
    role: str
    head: str
    portion: str
    make_examples: Callable[[list[PreferenceRecord]], Sequence[Any]]
    microbatches: Callable[[Sequence[Any], Tokenizer | HFTokenizer, int, int, bool], list[Batch]]
    loss_fn: Callable[[dist.ProcessGroup, int], LossFn]
    metrics: dict[str, type]
    load_checkpoint: Callable[[torch.nn.Module, ProcessGroupCollection, str], Any]


@dataclass
class TrainingResult:
    """The run directory and per-step metrics, the same on every rank but ``step_seconds``."""

    out_dir: Path
    history: list[dict[str, float]]


def _held_out(prompt: str, data: SupervisedDataConfig) -> bool:
    digest = hashlib.sha256(f"heldout:{data.split.seed}\x00{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < data.eval_fraction


def load_examples(config: SupervisedConfig, objective: Objective, tokenizer: Tokenizer | HFTokenizer
                  ) -> tuple[list[Any], list[Any]]:
    """Training and held-out examples of ``objective``; logs one line per file (the readers
    warn about bad records in detail).

    Raises:
        DataError: an unusable file, or a bad record under ``on_bad_record=error``.
    """
    data, room = config.data, config.train.max_length - 2
    # BOS and one response token must fit after the prompt: longer prompts are bad records.
    reader = replace(data.reader, max_prompt_tokens=min(data.reader.max_prompt_tokens or room,
                                                        room))
    paths, eval_paths = list(data.paths), list(data.eval_paths)
    if not paths:
        # Every rank writes the same bytes atomically: no barrier, and no shared disk needed.
        written = write_task_jsonl(Path(config.out_dir) / "data", data.synthetic)
        paths, eval_paths = [str(written["train"])], eval_paths or [str(written["test"])]
    splits, summaries = load_splits(DataConfig(paths, reader, data.split), tokenizer)
    train = getattr(splits, objective.portion)
    if eval_paths:
        held_out, eval_summaries = read_files(eval_paths, reader, tokenizer)
        summaries += eval_summaries
    else:
        held_out = [record for record in train if _held_out(record.prompt, data)]
        train = [record for record in train if not _held_out(record.prompt, data)]
    logger.info("kept %s", ", ".join(f"{s.num_kept} of {s.num_read} records of {s.path}"
                                     for s in summaries))
    datasets = objective.make_examples(train), objective.make_examples(held_out)
    return tuple([dataset[i] for i in range(len(dataset))] for dataset in datasets)


def data_parallel_size(spec: ModelSpec, cluster: ClusterSpec) -> int:
    """DP of one model spread over every rank of ``cluster``.

    Raises:
        ValueError: tp * pp does not divide the ranks, tp the ranks of a node, or ep the DP.
    """
    mp, world = spec.model_parallel_size, cluster.world_size
    if world % mp:
        raise ValueError(f"model.tp({spec.tp}) x model.pp({spec.pp}) = {mp} does not divide the "
                         f"{world} launched ranks: launch a multiple of {mp}")
    for pool in cluster.pools:
        if pool.devices_per_node % spec.tp:
            raise ValueError(f"model.tp({spec.tp}) does not divide the {pool.devices_per_node} "
                             "ranks of a node: a TP group must stay inside a node")
    dp = world // mp
    if dp % spec.ep:
        raise ValueError(f"model.ep({spec.ep}) does not divide the data-parallel size dp({dp}) = "
                         f"{world} ranks / (tp x pp): launch a multiple of {mp * spec.ep} ranks "
                         "or lower model.ep")
    return dp


def _reduce(per_microbatch: list[dict[str, Any]], kinds: dict[str, type],
            pg_collection: ProcessGroupCollection, device: torch.device) -> dict[str, float]:
    """Combine metrics over micro-batches and replicas onto every rank (default-group
    collective); only last pipeline stages have metrics, equal over TP, so TP rank 0
    contributes."""
    mine = per_microbatch if pg_collection.tp.rank() == 0 else []
    # World: the supervised model spans every rank (dp x tp x pp = world size).
    return values(all_reduce(mine, kinds, dist.group.WORLD, device))


def _check_run(config: SupervisedConfig, objective: Objective, arch: ArchSpec,
               tokenizer: Tokenizer | HFTokenizer, dp: int, num_train: int, num_held_out: int
               ) -> tuple[int, int]:
    """Refuse what cannot run; return the steps and the held-out examples evaluated (equal
    micro-batches on every replica: the remainder of ``dp * micro_batch_size`` is dropped)."""
    train, unit = config.train, dp * config.train.micro_batch_size
    if tokenizer.vocab_size > arch.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} pieces but model.arch="
                         f"{arch.name!r} embeds {arch.vocab_size}: use a smaller vocabulary")
    if train.max_length > arch.seq_length:
        raise ValueError(f"train.max_length({train.max_length}) exceeds model.arch="
                         f"{arch.name!r}'s seq_length({arch.seq_length}): lower it")
    if train.global_batch_size % unit:
        raise ValueError(f"train.global_batch_size({train.global_batch_size}) is not a multiple "
                         f"of dp({dp}) x train.micro_batch_size({train.micro_batch_size})")
    if num_train < train.global_batch_size or num_held_out < unit:
        raise ValueError(f"{num_train} training and {num_held_out} held-out {objective.name} "
                         f"examples do not fill global_batch_size({train.global_batch_size}) and "
                         f"dp x micro_batch_size({unit}): add records, raise data.split."
                         f"{objective.portion} or set data.eval_paths")
    steps = num_train // train.global_batch_size * train.epochs
    return min(steps, train.max_steps or steps), num_held_out // unit * unit


class _Batches:
    """This replica's micro-batches: each training step's, and the held-out set's."""

    def __init__(self, config: SupervisedConfig, objective: Objective,
                 tokenizer: Tokenizer | HFTokenizer,
                 train: list[Any], held_out: list[Any], dp: tuple[int, int],
                 device: torch.device) -> None:
        self.config, self.objective, self.tokenizer = config, objective, tokenizer
        self.train, self.dp, self.device = train, dp, device
        self.held_out = self._replica(held_out)
        self._order: tuple[int, list[int]] | None = None

    def _replica(self, examples: list[Any]) -> list[Batch]:
        share = len(examples) // self.dp[0]
        mine = examples[self.dp[1] * share:(self.dp[1] + 1) * share]
        micro = self.objective.microbatches(mine, self.tokenizer, self.config.train.max_length,
                                            self.config.train.micro_batch_size,
                                            self.config.data.chat_template)
        return [{k: v.to(self.device) for k, v in batch.items()} for batch in micro]

    def step(self, step: int) -> list[Batch]:
        """Micro-batches of training step ``step``."""
        size = self.config.train.global_batch_size
        epoch, index = divmod(step, len(self.train) // size)
        order = self._epoch_order(epoch)
        return self._replica([self.train[i] for i in order[index * size:(index + 1) * size]])

    def _epoch_order(self, epoch: int) -> list[int]:
        """The shuffle of epoch ``epoch``, drawn once per epoch (a draw at every step cost 3 ms
        a rank, about 3% of a tiny model's step; docs/results/wall-clock.md)."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, random.Random(f"{self.config.runtime.seed}:{epoch}").sample(
                range(len(self.train)), len(self.train)))
        return self._order[1]


def _build(config: SupervisedConfig, objective: Objective, spec: ModelSpec, total_steps: int,
           source: ModelSource | None,
           token_vocab_size: int) -> tuple[ModelTrainer, ProcessGroupCollection]:
    pgc = build_model_process_groups(spec, config.runtime.distributed.timeout_s)
    base = source.description.build_options() if source is not None else ModelBuildOptions()
    # Routes are replayed only by RL's experience passes: a recording forward here would leave
    # routes in the held-out batches, which later evaluations would then replay.
    moe = config.model.moe
    options = replace(base, head=objective.head, params_dtype=config.model.params_dtype,
                      moe=replace(moe.routing(), router_replay=False) if moe.enabled else None,
                      tie_embeddings=base.tie_embeddings and objective.head == "lm",
                      recompute=config.model.recompute, token_vocab_size=token_vocab_size,
                      packed_sequences=config.model.packed_sequences,
                      sequence_parallel=(config.model.sequence_parallel
                                         and config.model.packed_sequences))
    if source is not None and not source.is_hf:
        check_no_adapters(source.path, "model.init_checkpoint")
    if config.model.lora.enabled:  # adapters go on megatron's local layers
        options = replace(options, transformer_impl="local")
    model = build_model(spec.arch, options, pgc, runtime_seed=config.runtime.seed,
                        init_seed=config.model.init_seed)
    # Before the trainer exists: the optimizer copies the weights it starts from.
    if source is not None and source.is_hf:
        role = objective.role
        load_initial_weights({role: model}, {role: pgc}, [role], {role: source},
                             config.model.hf_cache_dir)
    elif source is not None:
        objective.load_checkpoint(model, pgc, source.path)
    if config.model.lora.enabled:  # a reward model's new score head trains in full
        apply_lora(model, config.model.lora,
                   trainable=("output_layer",) if objective.head == "scalar" else ())
        if config.model.lora.init_adapter_dir:  # into the adapters, after the base
            load_peft_adapter(model, pgc, spec.arch, config.model.lora, "model.lora")
    return ModelTrainer(model, pgc, config.optimizer, total_steps=total_steps), pgc


def _start(config: SupervisedConfig) -> tuple[ModelSource | None, Tokenizer | HFTokenizer]:
    """The checkpoint to start from and the tokenizer (a Hugging Face start's own by default)."""
    source = read_source(config.model.init_checkpoint) if config.model.init_checkpoint else None
    configured = config.tokenizer.hf_dir or config.tokenizer.model_path
    if source is not None:
        check_source_experts(config.model.moe, source, "model.init_checkpoint", "model.moe")
    if not configured and source is not None and source.is_hf:
        return source, checkpoint_tokenizer(source.path, "model.init_checkpoint")
    return source, load_tokenizer(config.tokenizer)


def _save_tokenizer(tokenizer: Tokenizer | HFTokenizer, out: Path) -> None:
    """Copy the tokenizer (a Hugging Face one's files) next to the checkpoint."""
    if isinstance(tokenizer, HFTokenizer):
        for name in TOKENIZER_FILES:
            if (Path(tokenizer.source) / name).is_file():
                shutil.copyfile(Path(tokenizer.source) / name, out / name)
    else:
        shutil.copyfile(tokenizer.source, out / TOKENIZER_FILE)


def run_supervised(config: SupervisedConfig, objective: Objective) -> TrainingResult:
    """Train ``objective`` as configured and save the final checkpoint. Every rank calls it.

    Raises:
        DataError: unusable data (see :func:`load_examples`).
        ValueError: a config, layout, data shape or existing checkpoint that cannot work;
            raised on every rank before any process group exists.
    """
    setup_logging(config.runtime.log_level, config.runtime.log_all_ranks)
    if (Path(config.out_dir) / CHECKPOINT_DIR).exists():
        raise ValueError(f"{config.out_dir} already holds a {CHECKPOINT_DIR}/: choose another "
                         "out_dir or delete it")
    check_writable_dir(config.out_dir, "out_dir")  # the synthetic data is written there first
    source, tokenizer = _start(config)
    if source is not None and source.is_hf:
        arch = arch_spec(source.description, source.path)
    else:
        arch = resolve_arch(config.model.arch)
        arch = replace(arch, experts=config.model.moe.expert_spec(arch.ffn_hidden_size))
        if source is not None:  # the layers (QKV bias, QK-norm, RoPE, ...) are the checkpoint's
            arch = replace(source.description.arch, name=arch.name, seq_length=arch.seq_length)
    spec = ModelSpec(objective.role, arch, trainable=True, tp=config.model.tp, pp=config.model.pp,
                     distributed_optimizer=config.optimizer.distributed_optimizer,
                     ep=config.model.ep)
    dp = data_parallel_size(spec, cluster_from_environment())
    train, held_out = load_examples(config, objective, tokenizer)
    total_steps, num_evaluated = _check_run(config, objective, arch, tokenizer, dp, len(train),
                                            len(held_out))
    config.check_machine()
    initialize_runtime(config.runtime)
    device = compute_device()
    trainer, pgc = _build(config, objective, spec, total_steps, source, tokenizer.vocab_size)
    batches = _Batches(config, objective, tokenizer, train, held_out[:num_evaluated],
                       (dp, pgc.dp.rank()), device)
    out = Path(config.out_dir)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(to_yaml(config))
        _save_tokenizer(tokenizer, out)
        # metrics.jsonl is appended to: a fresh run replaces the metrics of an unfinished one.
        (out / "metrics.jsonl").unlink(missing_ok=True)
    logger.info("%s: %d steps of %d of %d examples, tp=%d pp=%d dp=%d ep=%d, %d held-out "
                "examples", objective.name, total_steps, config.train.global_batch_size,
                len(train), spec.tp, spec.pp, dp, spec.ep, num_evaluated)
    history = _train_loop(config, objective, trainer, pgc, batches, total_steps, device)
    metadata = {"role": objective.role, "task": objective.name, "steps": total_steps,
                "tokenizer": "tokenizer.json" if isinstance(tokenizer, HFTokenizer)
                else TOKENIZER_FILE, "tokenizer_fingerprint": tokenizer.fingerprint}
    if source is not None and source.hf_config is not None:
        metadata["hf_config"] = source.hf_config  # the base of a later Hugging Face export
    save_model_checkpoint(trainer.model, pgc, out / CHECKPOINT_DIR, metadata)
    logger.info("%s: checkpoint written to %s", objective.name, out / CHECKPOINT_DIR)
    return TrainingResult(out, history)


def _train_loop(config: SupervisedConfig, objective: Objective, trainer: ModelTrainer,
                pgc: ProcessGroupCollection, batches: _Batches, total_steps: int,
                device: torch.device) -> list[dict[str, float]]:
    loss_fn = objective.loss_fn(pgc.tp, trainer.model.token_vocab_size)
    kinds = objective.metrics
    interval = config.train.eval_interval
    writer, history = MetricsWriter(config.out_dir, total_steps,
                                     label=objective.name), []
    try:
        for step in range(total_steps):
            start = time.perf_counter()
            with expert_metrics(trainer.model, pgc) as moe:
                result = trainer.train_step(batches.step(step), loss_fn)
            record = {**_reduce(result["metrics"], kinds, pgc, device), **moe}
            record.update(grad_norm=result["grad_norm"], lr=result["lr"],
                          step_seconds=time.perf_counter() - start)
            if step == total_steps - 1 or (interval and (step + 1) % interval == 0):
                trainer.module.eval()
                with torch.no_grad():
                    metrics = run_microbatches(trainer.module, pgc, batches.held_out, loss_fn,
                                               forward_only=True)
                record.update({f"eval_{k}": v for k, v in
                               _reduce(metrics, kinds, pgc, device).items()})
                logger.info("%s step %d/%d: %s", objective.name, step + 1, total_steps,
                            ", ".join(f"{k}={v:.4g}" for k, v in sorted(record.items())))
            writer.write(step, record)
            history.append(record)
    finally:
        writer.close()
    return history
