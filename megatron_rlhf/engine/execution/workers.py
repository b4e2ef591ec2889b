"""One rank's part of one model, and the operators it runs locally.

A ``ModelWorker`` knows nothing about other models or where its inputs came from: it receives
this replica's rows (already moved by the engine), runs megatron's schedule over micro-batches
and returns this replica's results. The ``PPOEngine`` does the data movement around it; the
worker is the one place where rows are put on the model's device (they arrive on the device the
transfers use, which is the CPU under gloo).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_rlhf.engine.execution.throughput import WorkMeter, training_forwards, work_flops
from megatron_rlhf.generation import GenerationConfig, GenerationOutput, generate_sequences
from megatron_rlhf.generation.answer_pool import AnswerPool
from megatron_rlhf.generation.continuous import release_decode_graphs
from megatron_rlhf.generation.generate import continue_sequences
from megatron_rlhf.generation.lockstep import ExpertLockstep
from megatron_rlhf.models.forward_backward import (
    Batch,
    run_microbatches,
    split_into_microbatches,
    split_microbatches,
    token_budget_microbatches,
)
from megatron_rlhf.models.gpt import (
    last_token_scores,
    split_policy_value,
    without_sequence_parallel,
)
from megatron_rlhf.models.logprobs import vocab_parallel_logprobs
from megatron_rlhf.models.moe import ROUTES, expert_metrics, replays_routes
from megatron_rlhf.models.offload import GRADS, OPTIMIZER, PARTS, WEIGHTS, StateOffloader
from megatron_rlhf.models.trainer import ModelTrainer
from megatron_rlhf.runtime.device import model_device, to_device
from megatron_rlhf.runtime.memory_meter import MemoryMeter
from megatron_rlhf.topology.flops import FORWARD_PASSES

Fields = dict[str, torch.Tensor]


class ModelWorker:
    """This rank's stage/shard of one model, with its trainer when the model is trainable.

    Args:
        role: the PPO role.
        model: this rank's GPTModel part.
        pg_collection: the model's groups.
        trainer: optimizer wrapper for trainable roles.
        micro_batch_size: rows per forward/backward micro-batch.
        max_tokens_per_micro_batch: > 0: micro-batches of at most this many real tokens
            instead (``rollout.max_tokens_per_micro_batch``).
        work: where this rank's share of the model FLOPs and the seconds of its training and
            generation go (``engine.throughput``); None: not recorded.
        offload: ``never`` (always resident) or ``always``: between operators the model's
            weights, gradient buffers and optimizer state live in host memory; an operator
            brings back what it needs (the weights; all three to train) and sends it back after.
            A Megatron-FSDP model is never offloaded; after each operator it frees the weights
            it gathered, so that between operators it holds its shards only.
        meter: the run's memory meter, which counts this model's resident state (default: none).
        keep_graphs: a generating model keeps its captured decode steps and their KV memory
            from one generate call to the next (``engine.run.stage_memory.decode_graph_roles``:
            resident inference-only models on ranks that train nothing); False frees them at
            the end of each call.
        generation_length: the most positions (prompt plus response) a generate call of the
            run decodes: the captured decode steps are sized for it, so one capture serves
            every call (0: each call's own).
    """

    def __init__(self, role: str, model: torch.nn.Module, pg_collection: ProcessGroupCollection,
                 trainer: ModelTrainer | None, micro_batch_size: int,
                 offload: str = "never", meter: MemoryMeter | None = None,
                 max_tokens_per_micro_batch: int = 0, work: WorkMeter | None = None,
                 keep_graphs: bool = False, generation_length: int = 0) -> None:
        self.role = role
        self.model = model
        self.pg_collection = pg_collection
        self.trainer = trainer
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.work = work
        self.device = model_device(model)
        self.offload = offload
        self.keep_graphs = keep_graphs
        self.generation_length = generation_length
        self.offloader = StateOffloader(model, trainer)
        self.meter = meter or MemoryMeter()
        self.meter.track(self.offloader)
        if trainer is not None:
            # Megatron-FSDP gathers a layer's weights just before it computes: where the CPU
            # meter must look to see them.
            for layer in trainer.fsdp_units():
                layer.register_forward_pre_hook(lambda *_: self.meter.observe())
        if offload == "always":
            self.offloader.offload(*PARTS)

    @contextlib.contextmanager
    def resident(self, *parts: str) -> Iterator[None]:
        """Keep ``parts`` of the model's state on its device for the duration (see ``offload``)."""
        self.offloader.onload(*parts)
        self.meter.observe()
        try:
            yield
        finally:
            # Training creates the Adam moments: count them before they may leave the device.
            self.meter.observe()
            if self.trainer is not None:
                self.trainer.release_gathered_weights()
            if self.offload == "always":
                self.offloader.offload(*parts)

    @property
    def is_output_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage (where outputs appear)."""
        return self.pg_collection.pp.rank() == self.pg_collection.pp.size() - 1

    @property
    def head(self) -> str:
        """``lm``, ``scalar`` or ``lm+scalar``."""
        return self.model.head_kind

    def _module(self) -> torch.nn.Module:
        return self.trainer.module if self.trainer is not None else self.model

    def forward(self, fields: Fields, output_fn: Callable[[torch.Tensor, Batch], torch.Tensor]
                ) -> torch.Tensor | None:
        """Forward-only pass; ``output_fn(model_output, micro_batch)`` picks each row's result.

        Returns:
            The concatenated per-row results on the last pipeline stage, None on other stages.
        """
        per_token_loss = self.model.config.calculate_per_token_loss

        def loss_fn(output: torch.Tensor, batch: Batch):
            result = output_fn(output, batch).detach()
            zero = output.new_zeros(())
            if per_token_loss:
                one = torch.ones((), dtype=torch.int, device=output.device)
                return zero, one, {"result": result}
            return zero, {"result": result}

        module = self._module()
        module.eval()
        parts, real = self._lockstep_microbatches(fields, forward_only=True)
        with torch.no_grad(), self.resident(WEIGHTS):
            metrics = run_microbatches(module, self.pg_collection, parts, loss_fn,
                                       forward_only=True)
        if not self.is_output_stage:
            return None
        return torch.cat([m["result"] for m in metrics[:real]])

    def forward_nothing(self) -> None:
        """Take part in a forward-only pass that gives this replica no rows: nothing for a
        dense model or ``ep = 1``; with ``ep > 1`` as many idle forwards as the other ranks of
        the expert-parallel group run micro-batches (each is a collective over the group)."""
        group = self._lockstep_group()
        if group is None or self.trainer is not None and self.trainer.settings.fsdp:
            return
        counts = torch.zeros(2, dtype=torch.long, device=self.device)
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, group=group)
        module = self._module()
        lockstep = ExpertLockstep(module, group, pad_id=0)
        was_training = module.training
        module.eval()
        try:
            with self.resident(WEIGHTS):
                for _ in range(int(counts[0])):
                    lockstep.idle_forward()
        finally:
            module.train(was_training)

    def token_logprobs(self, output: torch.Tensor, batch: Batch, prompt_len: int,
                       temperature: float, with_entropy: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of the response tokens ``[b, R]`` from a model output."""
        logits = split_policy_value(output)[0] if self.head == "lm+scalar" else output
        response = batch["input_ids"][:, prompt_len:]
        return vocab_parallel_logprobs(
            logits[:, prompt_len - 1:-1], response, self.pg_collection.tp,
            self.model.token_vocab_size, temperature, with_entropy)

    def token_values(self, output: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Values ``[b, R]``: the value of the state before each response token."""
        values = split_policy_value(output)[1] if self.head == "lm+scalar" else output[..., 0]
        return values[:, prompt_len - 1:-1].float()

    def compute_log_prob(self, fields: Fields, prompt_len: int, temperature: float
                         ) -> torch.Tensor | None:
        """Log-probs ``[b, R]`` of the response tokens under this model."""
        return self.forward(fields, lambda out, batch: self.token_logprobs(
            out, batch, prompt_len, temperature)[0])

    def compute_log_prob_and_routes(self, fields: Fields, prompt_len: int, temperature: float
                                    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """Log-probs ``[b, R]`` of the response tokens and the experts every MoE layer chose
        for every token, ``[b, s, layers, topk]`` (``models.moe.ROUTES``; -1 at padding), for
        a model that ``replays_routes``; ``(None, None)`` off the last pipeline stage."""
        if not replays_routes(self.model):
            raise ValueError(f"{self.role} cannot record its routes for replay: it needs MoE "
                             "layers with models.moe.router_replay, pp=1, no sequence "
                             "parallelism under TP and no full recomputation; or set "
                             "models.moe.router_replay=false")
        response = fields["attention_mask"].shape[1] - prompt_len

        def both(output: torch.Tensor, batch: Batch) -> torch.Tensor:
            logprobs = self.token_logprobs(output, batch, prompt_len, temperature)[0]
            return torch.cat([logprobs.float(), batch[ROUTES].flatten(1).float()], dim=1)

        results = self.forward(fields, both)
        if results is None:
            return None, None
        rows, seq = fields["attention_mask"].shape
        routes = results[:, response:].round().long().view(rows, seq, -1, self.moe_topk)
        return results[:, :response], routes

    @property
    def moe_topk(self) -> int:
        """Experts per token of this model's MoE layers (0: dense)."""
        return self.model.config.moe_router_topk if self.model.config.num_moe_experts else 0

    def compute_values(self, fields: Fields, prompt_len: int) -> torch.Tensor | None:
        """Critic values ``[b, R]``."""
        return self.forward(fields, lambda out, batch: self.token_values(out, prompt_len))

    def compute_scores(self, fields: Fields) -> torch.Tensor | None:
        """Reward-model score ``[b]``: the scalar head at each sequence's last real token."""
        return self.forward(fields, lambda out, batch: last_token_scores(
            out[..., 0], batch["attention_mask"]).float())

    def generate(self, prompts: Sequence[Sequence[int]], prompt_indices: Sequence[int],
                 config: GenerationConfig, eos_id: int | tuple[int, ...],
                 pad_id: int, weight_updates: Callable[[], bool] | None = None
                 ) -> GenerationOutput:
        """Sample one response per prompt (every TP rank returns the same tokens).

        With ``keep_graphs`` the captured decode steps (and their KV memory) stay for the next
        call; otherwise (a model that trains, is offloaded, or shares its ranks with training)
        they are freed at the end of the call, so they hold no memory through other stages.
        ``weight_updates``: new weights may arrive between decode steps (partial rollouts,
        ``generate_sequences``)."""
        with (self.resident(WEIGHTS), without_sequence_parallel(self.model),
              self._measured("generate") as rows):
            output = generate_sequences(self._module(), self.pg_collection, prompts,
                                        prompt_indices, config, eos_id, pad_id,
                                        on_cache=self.meter.observe,
                                        keep_graphs=self.keep_graphs,
                                        max_length=self.generation_length,
                                        weight_updates=weight_updates)
            rows.append((output.attention_mask, FORWARD_PASSES))
        return output

    def continue_generate(self, answers: AnswerPool, prompts: Sequence[Sequence[int]],
                          prompt_indices: Sequence[int], groups: int, version: int,
                          config: GenerationConfig, eos_id: int | tuple[int, ...], pad_id: int,
                          weight_updates: Callable[[], bool] | None = None
                          ) -> GenerationOutput:
        """Queue ``prompts`` into ``answers`` and go on decoding until ``groups`` groups are
        done (``continue_sequences``; every TP rank returns the same tokens)."""
        with (self.resident(WEIGHTS), without_sequence_parallel(self.model),
              self._measured("generate") as rows):
            output = continue_sequences(self._module(), self.pg_collection, answers, prompts,
                                        prompt_indices, groups, version, config, eos_id, pad_id,
                                        on_cache=self.meter.observe,
                                        max_length=self.generation_length,
                                        weight_updates=weight_updates)
            rows.append((output.attention_mask, FORWARD_PASSES))
        return output

    def release_decode_graphs(self) -> None:
        """Free the decode steps and KV memory kept for this model (before it is dropped: a
        move tears the run down)."""
        release_decode_graphs(self._module())

    def generate_nothing(self, config: GenerationConfig, pad_id: int) -> None:
        """Take part in a generation call that gives this replica no prompts: nothing for a
        dense model or ``ep = 1``; with ``ep > 1`` the forwards the other ranks of the
        expert-parallel group need (``generation.lockstep``)."""
        module = self._module()
        lockstep = ExpertLockstep.of(module, self.pg_collection, pad_id)
        if lockstep is None:
            return
        was_training = module.training
        module.eval()
        try:
            with self.resident(WEIGHTS), without_sequence_parallel(self.model):
                lockstep.idle_call(config.continuous, config.stop_check_interval)
        finally:
            module.train(was_training)

    def train(self, fields: Fields, loss_fn, supervised: Fields | None = None
              ) -> dict[str, Any]:
        """One optimizer step over this replica's rows of a mini-batch (and of ``supervised``
        rows, in micro-batches of their own after them; ``loss_fn`` tells them apart); the
        trainer's result with the routers' metrics under ``moe`` (``models.moe.expert_metrics``,
        empty for a dense model)."""
        if self.trainer is None:
            raise RuntimeError(f"{self.role} is not trainable")
        microbatches = self._microbatches(fields)
        if supervised is not None:
            microbatches += self._microbatches(supervised)
        with (self.resident(WEIGHTS, GRADS, OPTIMIZER), self._measured("train") as rows,
              expert_metrics(self.model, self.pg_collection) as moe):
            passes = training_forwards(self.model)  # 2 with LoRA: no weight gradients
            rows += [(batch["attention_mask"], passes) for batch in microbatches]
            result = self.trainer.train_step(microbatches, loss_fn)
        return {**result, "moe": moe}

    @contextlib.contextmanager
    def _measured(self, stage: str) -> Iterator[list[tuple[torch.Tensor, int]]]:
        """Time ``stage`` and record this rank's share of its model FLOPs; the body appends
        ``(attention_mask, forwards)`` of the rows it ran."""
        rows: list[tuple[torch.Tensor, int]] = []
        start = time.perf_counter()
        yield rows
        if self.work is None:
            return
        if self.device.type == "cuda":  # this stream only: not sends in flight on NCCL's
            torch.cuda.current_stream(self.device).synchronize()
        seconds = time.perf_counter() - start
        ranks = self.pg_collection.tp.size() * self.pg_collection.pp.size()
        self.work.record(stage, work_flops(self.model, rows) / ranks, seconds)

    def _microbatches(self, fields: Fields) -> list[Fields]:
        """This rank's micro-batches of ``fields`` for training: as many as on every rank of
        the lockstep group (:meth:`_lockstep_group`)."""
        return self._lockstep_microbatches(fields)[0]

    def _lockstep_microbatches(self, fields: Fields, forward_only: bool = False
                               ) -> tuple[list[Fields], int]:
        """This rank's micro-batches of ``fields``, as many as on every rank of the lockstep
        group (:meth:`_lockstep_group`), and how many of them are real: a forward-only pass
        whose rows are too few for that count repeats its last micro-batch (the repeats'
        results are to be dropped)."""
        fields = to_device(fields, self.device)
        budget = self.max_tokens_per_micro_batch
        parts = (token_budget_microbatches(fields, budget) if budget
                 else split_microbatches(fields, self.micro_batch_size))
        group = self._lockstep_group()
        if group is None:
            return parts, len(parts)
        # Every rank of ``group`` runs a collective per micro-batch, so all run as many, the
        # most any of them needs, whatever their rows' count and lengths.
        rows = fields["attention_mask"].shape[0]
        counts = torch.tensor([len(parts), -rows], device=self.device)
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, group=group)
        count, fewest_rows = int(counts[0]), -int(counts[1])
        if count > fewest_rows and not forward_only:
            raise ValueError(f"{self.role}: a rank of a group that runs in lockstep (expert "
                             f"parallelism or FSDP) needs {count} micro-batches but another has "
                             f"{fewest_rows} rows: give every data-parallel rank as many rows")
        if count == len(parts):
            return parts, count
        parts = split_into_microbatches(fields, budget or sys.maxsize, min(count, rows))
        return parts + [parts[-1]] * (count - len(parts)), len(parts)

    def _lockstep_group(self) -> torch.distributed.ProcessGroup | None:
        """The ranks that must run as many micro-batches as this one: the DP group under
        Megatron-FSDP (it gathers each layer's weights in every micro-batch), the expert-parallel
        group of an MoE model with ``ep > 1`` (its token dispatcher exchanges tokens in every
        MoE layer), else None."""
        if self.trainer is not None and self.trainer.settings.fsdp:
            return self.pg_collection.dp
        ep = getattr(self.pg_collection, "ep", None)
        return ep if ep is not None and ep.size() > 1 else None
