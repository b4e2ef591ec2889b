"""The trained actor and critic written as Hugging Face directories during a run.

    exporter = HFExporter(config, sources, tokenizer)
    exporter.export(engine, run_dir / "hf" / "step_00000010")   # collective over the world

The actor becomes a ``...ForCausalLM`` (under AC-Share its value head is left out), the critic a
``...ForSequenceClassification``; the family follows the layers (models/hf_config.py), the
source ``config.json``'s other fields (token ids, ...) are kept, and the tokenizer files of the
run's Hugging Face tokenizer are copied next to each model, so ``from_pretrained`` loads both.
A model trained through LoRA adapters (``models.lora``) is written merged (``W + s B A``), and
the actor's adapters also as a PEFT adapter directory, ``actor_adapter`` (its base: the run's
Hugging Face ``actor_checkpoint``, when it has one).
Each model's full state is gathered onto its first rank only, in the parameters' dtype and on the
host (a Megatron-FSDP model's shards over DP first, ``ModelTrainer.full_weights``), which writes
the files; the other DP replicas take no part.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from megatron_rlhf.builder.sources import ModelSource
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.execution.ppo_engine import PPOEngine
from megatron_rlhf.models.checkpoint import ModelDescription
from megatron_rlhf.models.hf_llama import full_state_to_hf, save_hf_checkpoint
from megatron_rlhf.models.hf_tokenizer import HFTokenizer
from megatron_rlhf.models.peft_export import merge_adapters, save_peft_adapter
from megatron_rlhf.models.tokenizer import Tokenizer
from megatron_rlhf.models.weights import gather_full_state_to_first_rank
from megatron_rlhf.topology.models import ACTOR, CRITIC

_VALUE_HEAD = "output_layer.value_head.weight"


class HFExporter:
    """Writes the trained models of a run as Hugging Face directories.

    Args:
        config: the run (``models.export_hf``).
        sources: the run's initial checkpoints; their ``config.json`` is the base of the export.
        tokenizer: the run's tokenizer; a Hugging Face one's files are copied.
    """

    def __init__(self, config: RunConfig, sources: dict[str, ModelSource],
                 tokenizer: Tokenizer | HFTokenizer) -> None:
        self.base_configs = {role: source.hf_config for role, source in sources.items()
                             if source.hf_config is not None}
        self.tokenizer_dir = tokenizer.source if isinstance(tokenizer, HFTokenizer) else None
        self.pad_id = tokenizer.pad_id
        self.lora = config.models.lora
        actor_source = sources.get(ACTOR)
        self.actor_base = actor_source.path if actor_source is not None and actor_source.is_hf \
            else ""

    def export(self, engine: PPOEngine, directory: Path) -> None:
        """Write ``directory/actor`` and ``directory/critic``; every rank calls it."""
        for role in (ACTOR, CRITIC):
            worker = engine.workers.get(role)
            if role not in engine.plan.models or worker is None:
                continue
            pgc = worker.pg_collection
            # Megatron-FSDP holds each weight whole only while a layer computes: gather it.
            weights = worker.trainer.full_weights() if worker.trainer.settings.fsdp else None
            if pgc.dp.rank():
                continue
            full_state = gather_full_state_to_first_rank(worker.model, pgc, weights=weights)
            if full_state is None:
                continue
            description = ModelDescription.from_model(worker.model)
            if description.head == "lm+scalar":
                full_state.pop(_VALUE_HEAD)
                description = replace(description, head="lm")
            # The critic's trunk is the reward model's when it started from it, else the actor's.
            base = dict(self.base_configs.get(role) or self.base_configs.get(ACTOR) or {})
            if base.get("pad_token_id") is None:  # a classifier needs it for batches (Llama-3)
                base["pad_token_id"] = self.pad_id
            if self.lora.applies_to(role):
                if role == ACTOR:
                    save_peft_adapter(directory / f"{role}_adapter", full_state, description,
                                      self.lora, base=self.actor_base)
                full_state = merge_adapters(full_state, self.lora.scaling)
            save_hf_checkpoint(directory / role, description,
                               full_state_to_hf(full_state, description), base_config=base,
                               tokenizer_dir=self.tokenizer_dir)
        # World: every rank calls export; none goes on before each model's first rank has written.
        dist.barrier(group=dist.group.WORLD)
