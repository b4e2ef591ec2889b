"""The configuration of supervised runs (SFT and the reward model): one dataclass per section.

``tools/train_sft.py`` and ``tools/train_reward_model.py`` load YAML files (``examples/sft_tiny.yaml``,
``examples/rm_tiny.yaml``) into :class:`SFTConfig` / :class:`RMConfig` with ``config.loader``; each
dataclass validates itself on construction. ``supervised.loop`` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from megatron_rlhf.config.paths import check_paths
from megatron_rlhf.data.schema import ReaderConfig, SplitConfig
from megatron_rlhf.data.synthetic import SyntheticTaskConfig
from megatron_rlhf.models.hf_import import checkpoint_moe, is_hf_dir
from megatron_rlhf.models.moe import MoEConfig
from megatron_rlhf.models.options import (
    RECOMPUTE_GRANULARITIES,
    LoRAConfig,
    OptimizerSettings,
    resolve_params_dtype,
)
from megatron_rlhf.models.tokenizer import TokenizerConfig
from megatron_rlhf.runtime.bootstrap import RuntimeConfig
from megatron_rlhf.topology.models import resolve_arch


@dataclass
class SupervisedDataConfig:
    """Where training and held-out examples come from.

    Attributes:
        paths: JSONL/Parquet files in the rm-static schema; training uses the objective's portion
            of their split. Empty: the synthetic task, written to ``<out_dir>/data``.
        eval_paths: held-out files, evaluated whole. Empty: the synthetic task's ``test.jsonl``,
            or with ``paths`` an ``eval_fraction`` of the training portion, chosen by prompt.
        eval_fraction: the held-out share of the training portion (see ``eval_paths``).
        reader: field names and bad-record policy.
        split: SFT/RM/PPO fractions of ``paths``.
        synthetic: size and seed of the synthetic task.
        chat_template: with a tokenizer that has a chat template (a Hugging Face checkpoint's),
            wrap each plain-text prompt as one user turn, as PPO does (``prompts.chat_template``);
            conversation records always go through the template.
    """

    paths: list[str] = field(default_factory=list)
    eval_paths: list[str] = field(default_factory=list)
    eval_fraction: float = 0.05
    reader: ReaderConfig = field(default_factory=ReaderConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    chat_template: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction={self.eval_fraction} must be in (0, 1)")


@dataclass
class SupervisedModelConfig:
    """The trained network and its layout.

    Attributes:
        arch: architecture preset (``tiny``, ``small``, ``llama-7b``, ...) or a mapping of the
            architecture's fields (``topology.models.resolve_arch``).
        tp: tensor-parallel size.
        pp: pipeline-parallel size; DP is what remains of the launched ranks.
        params_dtype: ``auto`` (``bfloat16`` with CUDA, ``float32`` on CPU; resolved when the
            config is built), ``float32`` or ``bfloat16``.
        init_seed: seed of the layout-independent initialisation.
        init_checkpoint: checkpoint to start from, or empty. The objective decides how it loads
            (a reward model takes an SFT checkpoint's trunk and keeps its new head). A Hugging
            Face directory works too: its config.json replaces ``arch``, its weights are
            converted (cached in ``hf_cache_dir``) and its tokenizer is used unless one is
            configured.
        hf_cache_dir: where a Hugging Face ``init_checkpoint`` is converted to, once.
        recompute: activation recomputation in training passes: ``none``, ``selective`` (the
            core attention) or ``full`` (every layer; ``models.gpt.ModelBuildOptions``).
        packed_sequences: train and evaluate on each micro-batch's real tokens packed into one
            row with sequence boundaries, computing no padding (``models.packing``); false: the
            padded rows.
        sequence_parallel: megatron's sequence parallelism when ``tp > 1`` and
            ``packed_sequences`` is on (ignored otherwise).
        moe: mixture-of-experts MLPs (``models.moe.MoEConfig``, as a PPO run's ``models.moe``;
            ``num_experts=0``: dense). A Hugging Face ``init_checkpoint`` gives its experts
            (``num_experts``, ``topk``, ``ffn_hidden_size``, ``shared_expert_ffn_size``,
            ``renormalize_topk``) as it gives the architecture: a setting left at its default
            takes the checkpoint's value, one set to another value is refused naming both. A
            megatron_rlhf ``init_checkpoint`` with experts needs the same experts here. The
            router's balancing losses join the training loss; routing replay is an RL matter,
            so ``router_replay`` is ignored.
        ep: expert-parallel size: groups of ``ep`` data-parallel ranks split the experts; must
            divide ``moe.num_experts`` and the data-parallel size (1 for a dense model); needs
            the ``alltoall`` dispatcher.
        lora: train low-rank adapters instead of every weight (``models.lora.LoRAConfig``:
            ``model.lora.rank=8``; ``roles`` is not read); a reward model's new score head trains
            in full beside them. The model is built with megatron's local layers.
            ``init_adapter_dir``: the adapters start from a PEFT adapter, loaded into them after
            the base (``model.init_checkpoint`` or the initialisation).
    """

    arch: Any = "tiny"
    tp: int = 1
    pp: int = 1
    params_dtype: str = "auto"
    init_seed: int = 1234
    init_checkpoint: str = ""
    hf_cache_dir: str = "~/.cache/megatron_rlhf/converted"
    recompute: str = "none"
    packed_sequences: bool = True
    sequence_parallel: bool = True
    moe: MoEConfig = field(default_factory=MoEConfig)
    ep: int = 1
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        resolve_arch(self.arch)
        if self.tp < 1 or self.pp < 1 or self.ep < 1:
            raise ValueError(f"model.tp={self.tp}, model.pp={self.pp} and model.ep={self.ep} "
                             "must be >= 1")
        if self.init_checkpoint and is_hf_dir(self.init_checkpoint):
            self.moe = checkpoint_moe(self.moe, self.init_checkpoint, "model.init_checkpoint",
                                      "model.moe")
        self.moe.check_expert_parallel({"model": self.ep}, ep_field="model.ep",
                                       moe_field="model.moe")
        if self.recompute not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"model.recompute={self.recompute!r}: use one of "
                             f"{RECOMPUTE_GRANULARITIES}")
        self.params_dtype = resolve_params_dtype(self.params_dtype)
        if self.lora.init_adapter_dir:
            self.lora.check_adapter_dir("model.lora")


@dataclass
class SupervisedTrainConfig:
    """Batch shapes, run length and evaluation cadence.

    Attributes:
        global_batch_size: examples (pairs for RM) per optimizer step over all replicas; a
            multiple of ``dp * micro_batch_size``.
        micro_batch_size: examples per forward/backward pass on one replica.
        epochs: passes over the training examples (a partial last batch is dropped).
        max_steps: stop after this many steps; 0: ``epochs`` decide.
        max_length: longest sequence (BOS prompt response EOS, in tokens; longer responses are
            cut), at most the architecture's ``seq_length``.
        eval_interval: evaluate every this many steps and after the last; 0: after the last.
    """

    global_batch_size: int = 16
    micro_batch_size: int = 4
    epochs: int = 1
    max_steps: int = 0
    max_length: int = 64
    eval_interval: int = 20

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            minimum = 0 if name in ("max_steps", "eval_interval") else 1
            if value < minimum:
                raise ValueError(f"train.{name}={value} must be >= {minimum}")


@dataclass
class SupervisedConfig:
    """Everything one supervised run needs; ``SFTConfig`` and ``RMConfig`` set the defaults.

    Attributes:
        runtime: seed (also of the data order), logging and distributed start-up.
        data: training and held-out examples.
        tokenizer: the shared tokenizer (copied to ``<out_dir>/tokenizer.model``).
        model: architecture, layout and initial weights.
        optimizer: AdamW and learning-rate schedule.
        train: batch shapes and run length.
        out_dir: ``config.yaml``, ``metrics.jsonl``, ``tokenizer.model``, ``checkpoint/`` (and
            ``data/`` for the synthetic task); must not hold a checkpoint yet.
    """

    INPUT_PATHS: ClassVar[tuple[str, ...]] = (
        "data.paths", "data.eval_paths", "model.init_checkpoint", "model.lora.init_adapter_dir",
        "tokenizer.hf_dir", "tokenizer.model_path", "tokenizer.corpus_path")
    """What the run reads; relative values are relative to the YAML file that gives them
    (``config.loader``)."""
    OUTPUT_PATHS: ClassVar[tuple[str, ...]] = (
        "out_dir", "model.hf_cache_dir", "tokenizer.cache_dir")
    """Where the run writes (its outputs, its caches): never empty (``config.paths``)."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    data: SupervisedDataConfig = field(default_factory=SupervisedDataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: SupervisedModelConfig = field(default_factory=SupervisedModelConfig)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    train: SupervisedTrainConfig = field(default_factory=SupervisedTrainConfig)
    out_dir: str = "runs/supervised"

    def __post_init__(self) -> None:
        check_paths(self, self.OUTPUT_PATHS, self.INPUT_PATHS)
        if self.optimizer.fsdp:
            raise ValueError("optimizer.fsdp=true: a supervised run ends by saving the model's "
                             "whole weights as a checkpoint, which a Megatron-FSDP model does "
                             "not hold; set optimizer.fsdp=false")

    def check_machine(self) -> None:
        """Refuse settings this machine cannot run (``OptimizerSettings.check_machine``)."""
        self.optimizer.check_machine()


@dataclass
class SFTConfig(SupervisedConfig):
    """An SFT run (fields as :class:`SupervisedConfig`) on the ``sft`` data portion; records
    need only a prompt and a response, or in place of the response tool-calling ``turns``
    (``reader.fields.turns``; the loss leaves the tools' answers out)."""

    data: SupervisedDataConfig = field(default_factory=lambda: SupervisedDataConfig(
        reader=ReaderConfig(required=["prompt", "response"])))
    out_dir: str = "runs/sft"


@dataclass
class RMConfig(SupervisedConfig):
    """A reward-model run (fields as :class:`SupervisedConfig`; batch sizes count pairs) on the
    ``rm`` data portion; records need a prompt, a chosen and a rejected response."""

    data: SupervisedDataConfig = field(default_factory=lambda: SupervisedDataConfig(
        reader=ReaderConfig(required=["prompt", "chosen", "rejected"])))
    out_dir: str = "runs/rm"
