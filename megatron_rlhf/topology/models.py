"""What is placed: the PPO roles, their architectures, parallelism and rough memory needs.

    spec = ModelSpec("actor", arch_preset("llama-65b"), trainable=True, tp=8, pp=2)
    spec.bytes_per_device(dp=4)   # weights + grads + sharded Adam state, per device

``ArchSpec`` is the one record of a model's architecture, mixture of experts included: the
planner counts its parameters and checks divisibility, ``models.gpt`` builds the network from it,
a checkpoint's ``megatron_rlhf.json`` records it and the Hugging Face conversion maps it to and
from ``config.json``. How a model is run (dtype, head, recomputation, layer implementation) is
not architecture: that is ``models.options.ModelBuildOptions``. Presets: ``tiny`` and ``small``
are CPU-sized, ``llama-7b/13b/33b/65b`` carry the public LLaMA numbers. A mixture-of-experts
model's MLPs are an ``ExpertSpec``: its parameters are every expert's, the parameters a token
passes through only its ``topk`` experts'.

Vocabulary sizes need not divide TP: Megatron pads the vocabulary to a multiple of
``make_vocab_size_divisible_by * tp`` (128 * tp here), so the plan counts the padded size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

ACTOR = "actor"
CRITIC = "critic"
REF = "ref"
REWARD = "reward"
SHADOW_ACTOR = "shadow_actor"
SHADOW_CRITIC = "shadow_critic"

ROLES = (ACTOR, CRITIC, REF, REWARD, SHADOW_ACTOR, SHADOW_CRITIC)
"""Every role, in the order the plan lists (and places) them."""

TRAINABLE_ROLES = (ACTOR, CRITIC)
VALUE_HEAD_ROLES = (CRITIC, REWARD, SHADOW_CRITIC)
"""Roles whose output layer is a scalar head instead of the vocabulary projection."""

SHADOW_OF = {SHADOW_ACTOR: ACTOR, SHADOW_CRITIC: CRITIC}
"""Inference-only copy -> the trainable model whose weights it receives."""

VOCAB_DIVISIBLE_BY = 128
"""Megatron's default ``make_vocab_size_divisible_by``."""

_ADAM_STATE_BYTES = 12
"""fp32 master weights + Adam's two moments, bytes per parameter."""
_MAIN_GRAD_BYTES = 4
"""The trainer's DDP keeps fp32 gradient buffers (``grad_reduce_in_fp32``), bytes per parameter."""

_GIB = 1024**3


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron's vocabulary padding: the multiple of ``divisible_by * tp`` at or above
    ``vocab_size`` (the embedding's rows at that TP)."""
    multiple = divisible_by * tp
    return math.ceil(vocab_size / multiple) * multiple


@dataclass(frozen=True)
class ExpertSpec:
    """The mixture-of-experts MLP of every layer (megatron's MoE layer, ``models.moe``).

    Attributes:
        num_experts: routed experts per layer, each a ``ffn_hidden_size``-wide MLP.
        topk: experts each token is routed to.
        ffn_hidden_size: width of one expert's MLP.
        shared_ffn_size: width of a shared expert every token also passes through; 0: none.
        renormalize_topk: the chosen experts' weights are the softmax over their own router
            logits, summing to 1 (Mixtral; Qwen3-MoE with ``norm_topk_prob``); false: their
            probabilities in the softmax over every expert (megatron's
            ``moe_router_pre_softmax``). The planner does not read it.
    """

    num_experts: int
    topk: int
    ffn_hidden_size: int
    shared_ffn_size: int = 0
    renormalize_topk: bool = True

    def __post_init__(self) -> None:
        for name in ("num_experts", "topk", "ffn_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"experts: {name}={value!r} must be an integer >= 1")
        if self.topk > self.num_experts:
            raise ValueError(f"experts: topk({self.topk}) exceeds num_experts({self.num_experts})")
        if not isinstance(self.shared_ffn_size, int) or self.shared_ffn_size < 0:
            raise ValueError(f"experts: shared_ffn_size={self.shared_ffn_size!r} must be an "
                             "integer >= 0")


@dataclass(frozen=True)
class ArchSpec:
    """A transformer's architecture: what its weights are and what they compute.

    Every field reaches the planner (through the numbers it counts), the built network
    (``models.gpt.transformer_config``), a checkpoint's description (``models.description``) and
    the Hugging Face ``config.json`` mapping (``models.hf_config``); a new field is added here, in
    the builder and in that mapping (CONTRIBUTING.md, "Add a layer field").

    Attributes:
        name: preset name, or any label for a custom architecture.
        num_layers: transformer layers.
        hidden_size: model width.
        num_attention_heads: attention heads.
        vocab_size: tokenizer vocabulary (unpadded).
        seq_length: maximum sequence length.
        ffn_hidden_size: MLP width.
        gated_mlp: SwiGLU MLP (three matrices, LLaMA) instead of two (GPT); ``models.gpt``
            builds the SwiGLU one only.
        num_query_groups: key/value heads (grouped-query attention); 0 means one per attention
            head (multi-head attention).
        rotary_base: RoPE theta, the base of the rotary position embedding; the planner does
            not read it.
        head_dim: channels per attention head (megatron's ``kv_channels``; Qwen3 has 128 at
            ``hidden_size`` 2048 and 32 heads); 0 (given) becomes ``hidden_size /
            num_attention_heads``.
        qk_norm: RMSNorm of each query and key head before RoPE (Qwen3; megatron's
            ``qk_layernorm``).
        qkv_bias: a bias on the fused QKV projection only (Qwen2; megatron's ``add_qkv_bias``);
            the planner does not count it.
        norm_epsilon: the RMSNorms' epsilon.
        rope_scaling_factor: Llama-3 RoPE frequency scaling factor (megatron's ``rope_scaling``,
            with its fixed low/high frequency factors 1 and 4 and original context 8192); 0: no
            scaling.
        experts: the MoE MLP replacing the dense one in every layer; None: dense. Not a
            ``models.arch`` field: set from ``models.moe``.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int
    ffn_hidden_size: int
    gated_mlp: bool = False
    num_query_groups: int = 0
    rotary_base: int = 10000
    head_dim: int = 0
    qk_norm: bool = False
    qkv_bias: bool = False
    norm_epsilon: float = 1e-5
    rope_scaling_factor: float = 0.0
    experts: ExpertSpec | None = None

    def __post_init__(self) -> None:
        if self.num_query_groups == 0:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.head_dim == 0 and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"arch {self.name!r}: num_attention_heads({self.num_attention_heads}) does not "
                f"divide hidden_size({self.hidden_size}): choose a divisor of hidden_size, or "
                "give head_dim"
            )
        if not isinstance(self.head_dim, int) or self.head_dim < 0:
            raise ValueError(f"arch {self.name!r}: head_dim={self.head_dim!r} must be an integer "
                             ">= 0 (0: hidden_size / num_attention_heads)")
        if self.head_dim == 0:  # one spelling per architecture, so that records compare equal
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"arch {self.name!r}: num_query_groups({self.num_query_groups}) must divide "
                f"num_attention_heads({self.num_attention_heads})"
            )
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "seq_length", "ffn_hidden_size", "rotary_base"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"arch {self.name!r}: {name}={value!r} must be an integer >= 1")
        numbers = (self.norm_epsilon, self.rope_scaling_factor)
        if (not all(isinstance(x, int | float) and not isinstance(x, bool) for x in numbers)
                or not self.norm_epsilon > 0 or not self.rope_scaling_factor >= 0):
            raise ValueError(f"arch {self.name!r}: norm_epsilon={self.norm_epsilon!r} must be > 0 "
                             f"and rope_scaling_factor={self.rope_scaling_factor!r} >= 0 (0: none)")

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary size after Megatron's padding to a multiple of ``128 * tp``."""
        return padded_vocab_size(self.vocab_size, tp)

    @property
    def head_channels(self) -> int:
        """Channels per attention head: ``head_dim``, or ``hidden_size / num_attention_heads``."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def query_width(self) -> int:
        """Width of the queries (and of the attention output): ``heads * head_channels``."""
        return self.num_attention_heads * self.head_channels

    @property
    def kv_width(self) -> int:
        """Width of the keys (or values) of one layer: ``num_query_groups * head_channels``."""
        return self.num_query_groups * self.head_channels

    def _mlp(self, width: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * width

    def mlp_params(self, active: bool = False) -> int:
        """Parameters of one layer's MLP: the dense MLP, or the router (``hidden x
        num_experts``), the routed experts and the shared expert.

        Args:
            active: count only the experts one token passes through (``topk`` of them).
        """
        experts = self.experts
        if experts is None:
            return self._mlp(self.ffn_hidden_size)
        routed = experts.topk if active else experts.num_experts
        return (self.hidden_size * experts.num_experts + routed * self._mlp(experts.ffn_hidden_size)
                + self._mlp(experts.shared_ffn_size))

    def expert_params(self) -> int:
        """Parameters of every routed expert of every layer (0 for a dense model): the part
        megatron splits over the expert-parallel group."""
        if self.experts is None:
            return 0
        return self.num_layers * self.experts.num_experts * self._mlp(self.experts.ffn_hidden_size)

    def num_params(self, tp: int = 1, value_head: bool = False, active: bool = False) -> int:
        """Parameter count with untied input/output embeddings.

        Args:
            tp: tensor-parallel size, which sets the vocabulary padding.
            value_head: the output layer is a scalar head (critic, reward) instead of the
                vocabulary projection.
            active: of a mixture-of-experts model, the parameters one token passes through
                (its ``topk`` experts of each layer, not every expert).
        """
        h, q, kv = self.hidden_size, self.query_width, self.kv_width
        attention = h * (q + 2 * kv) + q * h + 4 * h + (2 * self.head_channels if self.qk_norm else 0)
        per_layer = attention + self.mlp_params(active) + 2 * h
        embedding = self.padded_vocab_size(tp) * h
        output = h if value_head else embedding
        return self.num_layers * per_layer + embedding + output + h


ARCH_PRESETS: dict[str, ArchSpec] = {
    arch.name: arch
    for arch in (
        ArchSpec("tiny", 2, 64, 4, 512, 128, 256, gated_mlp=True),
        ArchSpec("small", 4, 128, 4, 512, 128, 512, gated_mlp=True),
        ArchSpec("llama-7b", 32, 4096, 32, 32000, 2048, 11008, gated_mlp=True),
        ArchSpec("llama-13b", 40, 5120, 40, 32000, 2048, 13824, gated_mlp=True),
        ArchSpec("llama-33b", 60, 6656, 52, 32000, 2048, 17920, gated_mlp=True),
        ArchSpec("llama-65b", 80, 8192, 64, 32000, 2048, 22016, gated_mlp=True),
    )
}


def arch_preset(arch: str | ArchSpec) -> ArchSpec:
    """Look an architecture up by preset name (an ``ArchSpec`` passes through).

    Raises:
        ValueError: unknown preset name.
    """
    if isinstance(arch, ArchSpec):
        return arch
    if arch not in ARCH_PRESETS:
        raise ValueError(f"model preset {arch!r} is unknown: choose one of {list(ARCH_PRESETS)}")
    return ARCH_PRESETS[arch]


def resolve_arch(arch: str | ArchSpec | Mapping[str, Any]) -> ArchSpec:
    """An architecture from a configuration: a preset name, or a mapping of ``ArchSpec``'s
    fields (``num_layers``, ``hidden_size``, ``num_attention_heads``, ``vocab_size``,
    ``seq_length``, ``ffn_hidden_size``; optionally the others, such as ``gated_mlp``,
    ``num_query_groups``, ``rotary_base``, ``head_dim``, ``qk_norm`` and a ``name``), as
    ``models.arch`` takes it.
    Experts are not among them: they come from ``models.moe``.

    Raises:
        ValueError: an unknown preset, an unknown or missing field, or an inconsistent shape.
    """
    if isinstance(arch, str | ArchSpec):
        return arch_preset(arch)
    names = [f.name for f in fields(ArchSpec) if f.name != "experts"]
    unknown = sorted(set(arch) - set(names))
    if unknown:
        raise ValueError(f"models.arch has unknown fields {unknown}: use {names[1:]}")
    required = [f.name for f in fields(ArchSpec)
                if f.default is MISSING and f.name != "name" and f.name not in arch]
    if required:
        raise ValueError(f"models.arch lacks {required}: give every one of them, or a preset "
                         f"name from {list(ARCH_PRESETS)}")
    return ArchSpec(**{"name": "custom", **dict(arch)})


@dataclass(frozen=True)
class ModelSpec:
    """One model to place: role, architecture, trainability and parallelism.

    DP is not part of the spec: it is derived from the devices the placement gives the model,
    ``dp = devices / (tp * pp)``.

    Attributes:
        role: one of ``ROLES``.
        arch: architecture numbers.
        trainable: holds gradients and optimizer state (actor, critic).
        tp: tensor-parallel size (inside one node).
        pp: pipeline-parallel size.
        distributed_optimizer: shard the optimizer state over DP (Megatron's distributed
            optimizer, ZeRO-1 style); only meaningful when trainable.
        bytes_per_param: bytes of one weight (2 for bf16).
        ep: expert-parallel size of a mixture-of-experts model (1 for a dense one): groups of
            ``ep`` data-parallel ranks split the experts (``topology.experts``); must divide DP.
        adapter_params: elements of the model's LoRA adapters (``models.lora``; all of its
            parts together), held beside its frozen base weights; a trainable model then trains
            them alone (gradients and optimizer state for them only) and a shadow's weight sync
            moves them alone after the first. 0: no adapters, every weight trains.
    """

    role: str
    arch: ArchSpec
    trainable: bool
    tp: int = 1
    pp: int = 1
    distributed_optimizer: bool = True
    bytes_per_param: int = 2
    ep: int = 1
    adapter_params: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"model role {self.role!r} is unknown: choose one of {ROLES}")
        for name in ("tp", "pp", "bytes_per_param", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.role}.{name}={value!r} must be an integer >= 1")
        if not isinstance(self.adapter_params, int) or self.adapter_params < 0:
            raise ValueError(f"{self.role}.adapter_params={self.adapter_params!r} must be an "
                             "integer >= 0 (0: no LoRA adapters)")
        heads, layers = self.arch.num_attention_heads, self.arch.num_layers
        if heads % self.tp:
            raise ValueError(
                f"{self.role}.tp({self.tp}) does not divide num_attention_heads({heads}) of "
                f"{self.arch.name!r}: choose tp in {divisors_text(heads)}"
            )
        groups = self.arch.num_query_groups
        if groups % self.tp:
            raise ValueError(
                f"{self.role}.tp({self.tp}) does not divide num_query_groups({groups}) of "
                f"{self.arch.name!r}: choose tp in {divisors_text(groups)}"
            )
        if layers % self.pp:
            raise ValueError(
                f"{self.role}.pp({self.pp}) does not divide num_layers({layers}) of "
                f"{self.arch.name!r}: choose pp in {divisors_text(layers)}"
            )
        experts = self.arch.experts
        if experts is not None and experts.num_experts % self.ep:
            raise ValueError(
                f"{self.role}.ep({self.ep}) does not divide num_experts({experts.num_experts}) "
                f"of {self.arch.name!r}: choose ep in {divisors_text(experts.num_experts)}")

    @property
    def model_parallel_size(self) -> int:
        """Devices in one replica: ``tp * pp``."""
        return self.tp * self.pp

    def num_params(self) -> int:
        """Parameter count, with vocabulary padding for this TP and the role's output head."""
        return self.arch.num_params(self.tp, value_head=self.role in VALUE_HEAD_ROLES)

    def device_params(self) -> float:
        """Parameters one device holds: the dense ones split over ``tp * pp``, the routed
        experts over ``tp * pp * ep`` (megatron's expert grid, expert TP = TP)."""
        experts = self.arch.expert_params()
        dense = self.num_params() - experts
        return (dense + experts / self.ep) / self.model_parallel_size

    def bytes_per_device(self, dp: int, fully_sharded: bool = False) -> float:
        """Rough lower bound of the memory one device needs for this model's states.

        Inference models hold their weights, ``psi * bytes_per_param`` with ``psi`` the
        ``device_params`` (``params / (tp * pp)`` for a dense model). Trainable models add the
        fp32 gradient buffer of the trainer's DDP (4 bytes per parameter) and 12 bytes of fp32
        master weights and Adam moments, divided by ``dp`` with the distributed optimizer: in
        bf16 ``psi * (6 + 12 / dp)`` bytes, ``18 psi`` without sharding. ``fully_sharded``
        (FSDP, ZeRO-3) divides all of a trainable model's states by ``dp``: ``18 psi / dp``.
        An expert's optimizer state is split over its expert-DP group (``dp / ep`` devices
        holding the same experts), so either way the sharded state of a device is that of
        ``params / (tp * pp * dp)`` parameters. Activations, the KV cache and framework buffers
        are not counted. With LoRA adapters (``adapter_params``, ``a`` of them per device over
        ``tp * pp``) the base is frozen: its weights alone, plus the adapters' weights,
        gradients (``6 a``) and Adam state (``12 a``, over ``dp`` with the distributed
        optimizer).

        Args:
            dp: data-parallel size of the model.
            fully_sharded: shard weights and gradients over DP as well (trainable models).
        """
        shard = self.device_params()
        adapters = self.adapter_params / self.model_parallel_size
        if not self.trainable:
            return (shard + adapters) * self.bytes_per_param
        states = self.bytes_per_param + _MAIN_GRAD_BYTES
        if adapters:
            base = shard * self.bytes_per_param / (dp if fully_sharded else 1)
            optimizer = _ADAM_STATE_BYTES * adapters / (
                dp if fully_sharded or self.distributed_optimizer else 1)
            return base + adapters * states / (dp if fully_sharded else 1) + optimizer
        sharded = self.num_params() / self.model_parallel_size / dp
        if fully_sharded:
            return sharded * (states + _ADAM_STATE_BYTES)
        optimizer = _ADAM_STATE_BYTES * (sharded if self.distributed_optimizer else shard)
        return shard * states + optimizer

    def gib_per_device(self, dp: int, fully_sharded: bool = False) -> float:
        """``bytes_per_device`` in GiB."""
        return self.bytes_per_device(dp, fully_sharded) / _GIB

    def gib_with_host_optimizer(self) -> float:
        """GiB per device of a trainable model whose optimizer shard lives on the host
        (optimizer CPU offload): its weights and fp32 gradient buffer, ``6 psi`` in bf16."""
        return self.device_params() * (self.bytes_per_param + _MAIN_GRAD_BYTES) / _GIB

    def to_dict(self) -> dict:
        """JSON-ready description."""
        return {
            "role": self.role, "arch": self.arch.name, "trainable": self.trainable,
            "tp": self.tp, "pp": self.pp, "distributed_optimizer": self.distributed_optimizer,
            "num_params": self.num_params(), **({"ep": self.ep} if self.ep > 1 else {}),
            **({"adapter_params": self.adapter_params} if self.adapter_params else {}),
        }


def divisors_text(n: int) -> str:
    """The divisors of ``n`` as ``{1,2,4,8}``, for error messages that suggest a fix."""
    return "{" + ",".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"
