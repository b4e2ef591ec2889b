"""What a checkpoint's weights are, free of megatron-core: :class:`ModelDescription` and the
name of the file that records it (``models.checkpoint`` writes and reads both, and re-exports
them), so that the Hugging Face conversion's reading of a ``config.json`` and a configuration's
checks of a checkpoint directory import no megatron-core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_rlhf.models.moe import MoEConfig
from megatron_rlhf.models.options import ModelBuildOptions
from megatron_rlhf.topology.models import ArchSpec, ModelSpec

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

INFO_FILE = "megatron_rlhf.json"


@dataclass(frozen=True)
class ModelDescription:
    """Everything needed to rebuild a model that a checkpoint's weights fit.

    The first seven fields are the :class:`~megatron_rlhf.models.gpt.Architecture` numbers (so a
    description can be passed to ``build_gpt_model``, with :meth:`build_options`); the others are
    the ``ModelBuildOptions`` that change what the weights compute: ``head`` (``lm``, ``scalar``,
    ``lm+scalar``), ``tie_embeddings``, ``norm_epsilon`` (RMSNorm), ``rotary_base`` (RoPE theta),
    ``params_dtype`` (``float32`` or ``bfloat16``), ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3),
    ``head_dim`` (0 becomes ``hidden_size / num_attention_heads``), ``rope_scaling_factor``
    (Llama-3 RoPE scaling, 0 for none) and a mixture-of-experts model's experts (``num_experts``,
    0 for a dense model; ``moe_topk``, ``moe_ffn_hidden_size`` (each expert's width),
    ``moe_shared_ffn_size`` (0: no shared expert), ``moe_renormalize_topk``, as in
    :class:`~megatron_rlhf.models.moe.MoEConfig`).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    head: str = "lm"
    tie_embeddings: bool = False
    norm_epsilon: float = 1e-5
    rotary_base: int = 10000
    params_dtype: str = "float32"
    qkv_bias: bool = False
    qk_norm: bool = False
    head_dim: int = 0
    rope_scaling_factor: float = 0.0
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_shared_ffn_size: int = 0
    moe_renormalize_topk: bool = True

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @property
    def moe(self) -> MoEConfig | None:
        """The experts' :class:`MoEConfig` (its training fields at their defaults); None when
        dense."""
        if not self.num_experts:
            return None
        return MoEConfig(num_experts=self.num_experts, topk=self.moe_topk,
                         renormalize_topk=self.moe_renormalize_topk,
                         ffn_hidden_size=self.moe_ffn_hidden_size,
                         shared_expert_ffn_size=self.moe_shared_ffn_size)

    def model_spec(self, role: str, tp: int = 1, pp: int = 1) -> ModelSpec:
        """A topology ``ModelSpec`` of this model at a TP/PP layout (validates divisibility)."""
        arch = ArchSpec("checkpoint", self.num_layers, self.hidden_size, self.num_attention_heads,
                        self.vocab_size, self.seq_length, self.ffn_hidden_size, gated_mlp=True,
                        num_query_groups=self.num_query_groups)
        return ModelSpec(role, arch, trainable=False, tp=tp, pp=pp)

    @classmethod
    def from_model(cls, model: GPTModel) -> ModelDescription:
        """Read the description off a model built by ``build_gpt_model`` (any stage, any shard)."""
        config = model.config
        return cls(
            num_layers=config.num_layers, hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups, ffn_hidden_size=config.ffn_hidden_size,
            vocab_size=model.real_vocab_size, seq_length=model.max_sequence_length,
            head=model.head_kind, tie_embeddings=model.share_embeddings_and_output_weights,
            norm_epsilon=config.layernorm_epsilon, rotary_base=model.rotary_base,
            params_dtype=str(config.params_dtype).removeprefix("torch."),
            qkv_bias=config.add_qkv_bias, qk_norm=config.qk_layernorm,
            head_dim=config.kv_channels, rope_scaling_factor=model.rope_scaling_factor,
            num_experts=config.num_moe_experts or 0,
            moe_topk=config.moe_router_topk if config.num_moe_experts else 0,
            moe_ffn_hidden_size=config.moe_ffn_hidden_size if config.num_moe_experts else 0,
            moe_shared_ffn_size=config.moe_shared_expert_intermediate_size or 0,
            moe_renormalize_topk=not config.moe_router_pre_softmax,
        )

    def build_options(self) -> ModelBuildOptions:
        """The ``ModelBuildOptions`` that rebuild this model (dropout 0, local layer spec)."""
        return ModelBuildOptions(head=self.head, tie_embeddings=self.tie_embeddings,
                                 norm_epsilon=self.norm_epsilon, rotary_base=self.rotary_base,
                                 params_dtype=self.params_dtype, qkv_bias=self.qkv_bias,
                                 qk_norm=self.qk_norm, head_dim=self.head_dim,
                                 rope_scaling_factor=self.rope_scaling_factor, moe=self.moe)
