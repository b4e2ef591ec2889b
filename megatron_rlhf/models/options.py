"""The settings of a model that a configuration names, free of megatron-core.

``ModelBuildOptions`` (how ``models.gpt.build_gpt_model`` instantiates a model),
``OptimizerSettings`` (how ``models.trainer.ModelTrainer`` trains it) and ``LoRAConfig`` (the
adapters ``models.lora.apply_lora`` adds), with the names their fields take. A configuration validates against them without importing megatron-core, which a process
would otherwise pay about 2 s for before it could report a mistake; ``models.gpt`` and
``models.trainer`` re-export them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import torch

from megatron_rlhf.models.moe import MoERouting
from megatron_rlhf.topology.models import ArchSpec, arch_preset

HeadKind = Literal["lm", "scalar", "lm+scalar"]
HEAD_KINDS: tuple[str, ...] = ("lm", "scalar", "lm+scalar")
PARAMS_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16")
TRANSFORMER_IMPLS: tuple[str, ...] = ("auto", "local", "transformer_engine")
ATTENTION_BACKENDS: tuple[str, ...] = ("sdpa", "megatron")
RECOMPUTE_GRANULARITIES: tuple[str, ...] = ("none", "selective", "full")


def resolve_params_dtype(params_dtype: str) -> str:
    """``auto`` -> ``bfloat16`` on a CUDA machine, ``float32`` on CPU; others unchanged.

    Raises:
        ValueError: not one of :data:`PARAMS_DTYPES`.
    """
    if params_dtype not in PARAMS_DTYPES:
        raise ValueError(f"params_dtype={params_dtype!r}: use one of {PARAMS_DTYPES}")
    if params_dtype == "auto":
        return "bfloat16" if torch.cuda.is_available() else "float32"
    return params_dtype


def transformer_engine_importable() -> bool:
    """Whether Transformer Engine's PyTorch layers can be imported in this process."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


@dataclass
class ModelBuildOptions:
    """How a model is instantiated, beyond its architecture (``topology.models.ArchSpec``,
    which holds every number and layer choice the weights depend on).

    Attributes:
        head: which output head the model carries (see ``models.gpt``).
        tie_embeddings: share the input embedding and the LM head (``lm`` heads only).
        dropout: hidden and attention dropout (PPO usually runs with 0).
        params_dtype: ``float32``, ``bfloat16`` or ``auto`` (bf16 with CUDA, fp32 on CPU);
            resolved on construction.
        transformer_impl: ``local`` (megatron's modules) or ``transformer_engine`` (its TE
            layer spec; CUDA with TE installed only). Resolve ``auto`` first with
            ``models.gpt.resolve_transformer_impl``.
        attention_backend: core attention of the ``local`` implementation: ``sdpa`` (torch's
            fused scaled-dot-product attention, ``models.attention``) or ``megatron`` (its
            ``DotProductAttention``, which materialises the score matrix).
        recompute: activation recomputation in training passes (megatron's
            ``recompute_granularity``): ``none``; ``selective`` (megatron's default module list,
            the core attention); ``full`` (every transformer layer keeps only its input and is
            recomputed in the backward pass, ``recompute_method=uniform``, one layer per unit).
            Forward-only passes never recompute.
        token_vocab_size: ids the tokenizer has, when the embedding has more rows (Hugging Face
            checkpoints pad it, Qwen2.5's by hundreds of rows): LM logits at or past it are never
            sampled and take no part in any log-probability or loss; 0: every row is a token.
        packed_sequences: full forwards (training and scoring, not decoding) pack each
            micro-batch's real tokens into one row with sequence boundaries instead of computing
            padding (``models.packing``); needs attention that takes boundaries (``sdpa`` or
            Transformer Engine).
        sequence_parallel: with TP > 1, megatron's sequence parallelism: the activations
            outside attention and MLP (norms, dropout, residuals) are split along the sequence
            over the TP ranks instead of replicated. Needs ``packed_sequences`` (the packed row
            is padded to a multiple of TP); generation runs without it
            (``models.gpt.without_sequence_parallel``).
        moe: how the mixture-of-experts layers are trained and routed (load balancing,
            token dispatcher, routing replay: ``models.moe.MoERouting``, which
            ``MoEConfig.routing`` gives); the experts themselves are the architecture's
            ``experts``. None: the defaults; a dense architecture reads none of it.
    """

    head: str = "lm"
    tie_embeddings: bool = False
    dropout: float = 0.0
    params_dtype: str = "auto"
    transformer_impl: str = "local"
    attention_backend: str = "sdpa"
    recompute: str = "none"
    token_vocab_size: int = 0
    packed_sequences: bool = True
    sequence_parallel: bool = False
    moe: MoERouting | None = None

    def __post_init__(self) -> None:
        if self.head not in HEAD_KINDS:
            raise ValueError(f"model.head={self.head!r} is not one of {HEAD_KINDS}")
        if self.tie_embeddings and self.head != "lm":
            raise ValueError("model.tie_embeddings=True needs head='lm'; set tie_embeddings=False")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.params_dtype not in PARAMS_DTYPES:
            raise ValueError(f"model.params_dtype={self.params_dtype!r}: use one of "
                             f"{PARAMS_DTYPES}")
        self.params_dtype = resolve_params_dtype(self.params_dtype)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"model.attention_backend={self.attention_backend!r}: use one of "
                             f"{ATTENTION_BACKENDS}")
        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ValueError(f"model.transformer_impl={self.transformer_impl!r}: use 'local' or "
                             "'transformer_engine' (resolve 'auto' with resolve_transformer_impl)")
        if self.recompute not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"model.recompute={self.recompute!r}: use one of "
                             f"{RECOMPUTE_GRANULARITIES}")
        if (self.packed_sequences and self.transformer_impl == "local"
                and self.attention_backend != "sdpa"):
            raise ValueError(f"packed sequences need attention that takes sequence boundaries "
                             f"(attention_backend='sdpa' or Transformer Engine), got "
                             f"attention_backend={self.attention_backend!r}; set "
                             "packed_sequences=false")
        if self.sequence_parallel and not self.packed_sequences:
            raise ValueError("sequence_parallel splits a packed row over the TP ranks; padded "
                             "rows are not a multiple of TP: set packed_sequences=true or "
                             "sequence_parallel=false")
        if self.token_vocab_size < 0:
            raise ValueError(f"model.token_vocab_size={self.token_vocab_size} must be >= 0 (0: "
                             "the embedding's rows)")


_SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class OptimizerSettings:
    """Optimizer, gradient and learning-rate settings of one trainable model.

    Attributes:
        lr: peak learning rate.
        min_lr: learning rate at the end of the decay.
        weight_decay: decoupled weight decay (AdamW).
        adam_beta1: Adam beta1.
        adam_beta2: Adam beta2.
        adam_eps: Adam epsilon.
        clip_grad: global gradient-norm clip (0 disables).
        lr_warmup_steps: linear warm-up steps.
        lr_decay_steps: steps of the decay after warm-up (0: as long as the run).
        lr_schedule: ``constant``, ``linear`` or ``cosine``.
        distributed_optimizer: shard optimizer state over DP (megatron's distributed optimizer,
            ZeRO-1); False keeps plain DDP with replicated optimizer state.
        cpu_offload_fraction: the share of this rank's optimizer shard whose fp32 main weights,
            Adam moments and update live on the host (megatron's ``HybridDeviceOptimizer``:
            ``optimizer_cpu_offload``, ``optimizer_offload_fraction``); 0 keeps all of it on
            the device. Needs CUDA, Transformer Engine and ``distributed_optimizer``; the update
            is AdamW (decoupled weight decay), as megatron requires and as every setting here
            runs.
        fsdp: Megatron-FSDP (ZeRO-3): weights, gradients and optimizer state sharded over DP,
            each transformer layer's weights gathered while it computes. Needs
            ``distributed_optimizer``, and the model alone on every rank of the job with pp=1
            (megatron-core 0.16.1's adapter lays its DP x TP mesh over the whole world). Its
            checkpoints hold its DTensor shards (:meth:`ModelTrainer.fsdp_state`,
            ``models.fsdp_checkpoint``).
        overlap_grad_reduce: reduce each gradient bucket over DP as soon as the last
            micro-batch's backward pass has filled it, while the rest of the backward pass
            runs (megatron DDP's ``overlap_grad_reduce``); None: on with CUDA, off on CPU, where
            gloo gains nothing from it. The gradients are the same either way.
        grad_reduce_dtype: dtype the gradients are accumulated and reduced over DP in:
            ``float32`` (megatron's ``grad_reduce_in_fp32``) or ``bfloat16``, half the bytes
            on the wire and in the gradient buffers at the cost of bf16 rounding of the sums;
            only a bf16 model differs.
    """

    SECTION: ClassVar[str] = "optimizer"
    """The configuration section these settings are read from, named by the refusals (a run's
    ``actor_optimizer`` and ``critic_optimizer`` are subclasses that name themselves)."""

    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 0
    lr_schedule: str = "constant"
    distributed_optimizer: bool = True
    cpu_offload_fraction: float = 0.0
    fsdp: bool = False
    overlap_grad_reduce: bool | None = None
    grad_reduce_dtype: str = "float32"

    def __post_init__(self) -> None:
        section = self.SECTION
        if self.overlap_grad_reduce is None:
            self.overlap_grad_reduce = torch.cuda.is_available()
        if self.grad_reduce_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"{section}.grad_reduce_dtype={self.grad_reduce_dtype!r}: use "
                             "'float32' or 'bfloat16'")
        if not self.lr > 0:
            raise ValueError(f"{section}.lr={self.lr} must be positive")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"{section}.min_lr={self.min_lr} must be in [0, lr={self.lr}]")
        if self.clip_grad < 0:
            raise ValueError(f"{section}.clip_grad={self.clip_grad} must be >= 0 (0 disables)")
        if self.lr_schedule not in _SCHEDULES:
            raise ValueError(f"{section}.lr_schedule={self.lr_schedule!r} is not one of "
                             f"{_SCHEDULES}")
        if self.lr_warmup_steps < 0 or self.lr_decay_steps < 0:
            raise ValueError(f"{section}.lr_warmup_steps and lr_decay_steps must be >= 0")
        self._check_cpu_offload()
        if self.fsdp and not self.distributed_optimizer:
            raise ValueError(f"{section}.fsdp=true needs {section}.distributed_optimizer=true "
                             "(megatron steps Megatron-FSDP's shards with its distributed "
                             "optimizer)")
        if self.fsdp and self.cpu_offload_fraction:
            raise ValueError(f"{section}.fsdp=true with {section}.cpu_offload_fraction="
                             f"{self.cpu_offload_fraction}: the optimizer CPU offload is wired for "
                             "the distributed optimizer only; set one of them off")

    def _check_cpu_offload(self) -> None:
        fraction, section = self.cpu_offload_fraction, self.SECTION
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{section}.cpu_offload_fraction={fraction} must be in [0, 1]")
        if fraction and not self.distributed_optimizer:
            raise ValueError(f"{section}.cpu_offload_fraction={fraction} needs "
                             f"{section}.distributed_optimizer=true (megatron offloads the "
                             "distributed optimizer's shards)")

    def check_machine(self) -> None:
        """Refuse what this machine cannot run: checked where a run starts, not where the
        settings load, so that ``--plan-only`` on a laptop prices a GPU job that offloads.

        Raises:
            ValueError: an optimizer offload without CUDA or Transformer Engine.
        """
        fraction, section = self.cpu_offload_fraction, self.SECTION
        if fraction and not torch.cuda.is_available():
            raise ValueError(f"{section}.cpu_offload_fraction={fraction} moves optimizer state "
                             "from a CUDA device to the host and needs CUDA, which this machine "
                             "lacks; set it to 0")
        if fraction and not transformer_engine_importable():
            raise ValueError(f"{section}.cpu_offload_fraction={fraction} needs Transformer "
                             "Engine: megatron-core 0.16.1 offloads through its precision-aware "
                             "optimizer, whose config reads TE's version; install "
                             "transformer-engine or set it to 0")


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                "experts.linear_fc1", "experts.linear_fc2")
"""What ``LoRAConfig.target_modules`` may name: the attention projections, the dense MLP (and a
shared expert), the routed experts' MLPs."""
LORA_ROLES = ("actor", "critic")
PEFT_ADAPTER_CONFIG = "adapter_config.json"
PEFT_ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""The two files of a Hugging Face PEFT adapter directory (``models.peft_export``)."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on the trained models (``models.lora.*``).

    Attributes:
        rank: the adapters' rank ``r``; 0: no adapters (every weight trains).
        alpha: the adapters' output is scaled by ``alpha / rank``.
        dropout: dropout on an adapter's input (the base layer sees the input unchanged).
        target_modules: which linear layers take adapters, among :data:`LORA_TARGETS`.
        roles: which trained models take adapters: ``actor``, and optionally ``critic`` (whose
            value head then trains in full, as a new head must).
        init_seed: seed of the ``A`` matrices' layout-independent initialisation.
        init_adapter_dir: a Hugging Face PEFT adapter directory (``adapter_config.json``,
            ``adapter_model.safetensors``) the adapters start from instead, loaded after the
            base (PPO: the actor's; SFT and RM: the model's); its ``r`` and ``lora_alpha`` must
            be ``rank`` and ``alpha``, and its fused layers' adapters must share ``A`` (as
            ``models.peft_export`` writes them).
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    roles: list[str] = field(default_factory=lambda: ["actor"])
    init_seed: int = 0
    init_adapter_dir: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"models.lora.rank={self.rank!r} must be an integer >= 0 "
                             "(0: no adapters)")
        if not isinstance(self.alpha, int | float) or self.alpha <= 0:
            raise ValueError(f"models.lora.alpha={self.alpha!r} must be a number > 0 "
                             "(the adapters' output is scaled by alpha / rank)")
        if not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ValueError(f"models.lora.dropout={self.dropout!r} must be in [0, 1)")
        self.target_modules = list(self.target_modules)
        self.roles = list(self.roles)
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if unknown or not self.target_modules:
            raise ValueError(f"models.lora.target_modules={self.target_modules}: "
                             f"{'unknown ' + str(unknown) if unknown else 'empty'}; "
                             f"name some of {list(LORA_TARGETS)}")
        if self.init_adapter_dir and not self.enabled:
            raise ValueError(f"models.lora.init_adapter_dir={self.init_adapter_dir} needs "
                             "models.lora.rank > 0 (the adapter's r)")
        bad_roles = [r for r in self.roles if r not in LORA_ROLES]
        if bad_roles or (self.enabled and not self.roles):
            raise ValueError(f"models.lora.roles={self.roles}: adapters go on trained models; "
                             f"name some of {list(LORA_ROLES)}")

    @property
    def enabled(self) -> bool:
        """Whether any model takes adapters."""
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """The factor on the adapters' output, ``alpha / rank``."""
        return self.alpha / self.rank

    def applies_to(self, role: str) -> bool:
        """Whether ``role``'s model takes adapters."""
        return self.enabled and role in self.roles

    def check_adapter_dir(self, section: str = "models.lora") -> dict:
        """The ``adapter_config.json`` of ``init_adapter_dir``, checked against these settings
        before any weight is read (a run's configuration calls it, ``read_peft_adapter`` too).

        Args:
            section: where these settings sit in the run's configuration (``models.lora`` in
                PPO, ``model.lora`` in SFT and RM), for the messages.

        Raises:
            ValueError: the directory holds no PEFT LoRA adapter, or its ``r`` or
                ``lora_alpha`` differ from ``rank`` and ``alpha``.
        """
        path = Path(self.init_adapter_dir).expanduser()
        missing = [name for name in (PEFT_ADAPTER_CONFIG, PEFT_ADAPTER_WEIGHTS)
                   if not (path / name).is_file()]
        if missing:
            raise ValueError(f"{section}.init_adapter_dir={self.init_adapter_dir} holds no "
                             f"{' and no '.join(missing)}: give a Hugging Face PEFT LoRA adapter "
                             "directory (as models.peft_export.save_peft_adapter or peft's "
                             "save_pretrained write one)")
        try:
            settings = json.loads((path / PEFT_ADAPTER_CONFIG).read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"{section}.init_adapter_dir={self.init_adapter_dir}: "
                             f"{PEFT_ADAPTER_CONFIG} is not readable JSON ({error})") from None
        if not isinstance(settings, dict) or settings.get("peft_type", "LORA") != "LORA":
            kind = settings.get("peft_type") if isinstance(settings, dict) else settings
            raise ValueError(f"{section}.init_adapter_dir={self.init_adapter_dir} holds a "
                             f"{kind!r} adapter, not a LoRA one: give a LoRA adapter")
        for ours, theirs in (("rank", "r"), ("alpha", "lora_alpha")):
            if float(settings.get(theirs, -1)) != float(getattr(self, ours)):
                raise ValueError(f"{path / PEFT_ADAPTER_CONFIG} has {theirs}="
                                 f"{settings.get(theirs)}, but {section}.{ours}="
                                 f"{getattr(self, ours)}: set it to the adapter's")
        return settings

    def adapter_params(self, arch: ArchSpec | str) -> int:
        """Elements of the adapters of a whole model of ``arch`` (a preset name or an
        ``ArchSpec``, its routed and shared experts included): :func:`adapter_numel`."""
        arch = arch_preset(arch)
        moe = arch.experts
        if moe is None:
            return adapter_numel(arch, self)
        return adapter_numel(arch, self, (moe.num_experts, moe.ffn_hidden_size),
                             moe.shared_ffn_size)

    def role_adapters(self, archs: ArchSpec | str | Mapping[str, ArchSpec | str]
                      ) -> dict[str, int]:
        """The adapter elements of each role that takes adapters, for ``plan_placement``.

        Args:
            archs: one architecture for every model, or one per role (as ``plan_placement``
                takes them).
        """
        def arch_of(role: str) -> ArchSpec | str:
            return archs if isinstance(archs, ArchSpec | str) else archs[role]

        return {role: self.adapter_params(arch_of(role)) for role in self.roles
                if self.applies_to(role)}


def adapter_numel(arch, config: LoRAConfig, experts: tuple[int, int] = (0, 0),
                  shared_ffn: int = 0) -> int:
    """Elements of a whole model's adapters (every TP/PP part together): ``rank * (in + out)``
    per adapted layer, the number a planner prices the adapters' gradients, optimizer state and
    weight syncs by (``LoRAConfig.adapter_params`` reads it off an ``ArchSpec``).

    Args:
        arch: an architecture (``num_layers``, ``hidden_size``, ``num_attention_heads``,
            ``num_query_groups``, ``ffn_hidden_size``, ``gated_mlp`` and optionally
            ``head_dim``; 0 or absent: ``hidden_size / num_attention_heads``).
        config: the adapters.
        experts: ``(routed experts per layer, their MLP width)``; ``(0, 0)``: a dense model,
            whose ``linear_fc*`` targets are its MLP.
        shared_ffn: width of an MoE layer's shared expert, which the ``linear_fc*`` targets
            adapt; 0: none.
    """
    if not config.enabled:
        return 0
    h, heads = arch.hidden_size, arch.num_attention_heads
    head_dim = getattr(arch, "head_dim", 0) or h // heads
    groups = getattr(arch, "num_query_groups", 0) or heads
    gated = 2 if getattr(arch, "gated_mlp", True) else 1
    num_experts, expert_ffn = experts

    def mlp(ffn: int) -> dict[str, int]:
        return {"linear_fc1": h + gated * ffn, "linear_fc2": ffn + h} if ffn else {}

    per_layer = {"linear_qkv": h + (heads + 2 * groups) * head_dim,
                 "linear_proj": heads * head_dim + h}
    per_layer |= mlp(shared_ffn) if num_experts else mlp(arch.ffn_hidden_size)
    per_layer |= {f"experts.{k}": num_experts * v for k, v in mlp(expert_ffn).items()}
    width = sum(v for k, v in per_layer.items() if k in config.target_modules)
    return arch.num_layers * config.rank * width
