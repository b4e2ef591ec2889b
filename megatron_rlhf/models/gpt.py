"""Build the four PPO models as Megatron-Core ``GPTModel``s with their own process groups.

Every role uses the same Llama-style trunk (RMSNorm, SwiGLU, rotary embeddings, no biases; the
Hugging Face families add a QKV bias, QK-norm or Llama-3 RoPE scaling through megatron's own
options, see ``ModelBuildOptions``); only the head differs:

* ``lm``: the language-model head (actor, reference);
* ``scalar``: one value per position (critic values; the reward model reads the value at the last
  real token of each sequence);
* ``lm+scalar``: AC-Share, the critic's value head on the actor's trunk. The model returns the
  local vocabulary shard of the logits with the value appended as one extra channel, so a single
  tensor still flows through megatron's pipeline schedule; :func:`split_policy_value` separates
  them.

No role touches megatron's global parallel state: the model gets a ``ProcessGroupCollection``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

from megatron_rlhf.runtime.cpu_compat import seed_model_parallel_rng

HeadKind = Literal["lm", "scalar", "lm+scalar"]
HEAD_KINDS: tuple[str, ...] = ("lm", "scalar", "lm+scalar")


class Architecture(Protocol):
    """The architecture numbers a model is built from (see ``topology`` for the presets)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int


@dataclass
class ModelBuildOptions:
    """How a model is instantiated, beyond its architecture.

    Attributes:
        head: which output head the model carries (see module docstring).
        tie_embeddings: share the input embedding and the LM head (``lm`` heads only).
        dropout: hidden and attention dropout (PPO usually runs with 0).
        norm_epsilon: RMSNorm epsilon.
        rotary_base: base of the rotary position embedding.
        params_dtype: ``float32`` (CPU default) or ``bfloat16`` (GPU default).
        use_transformer_engine: use Transformer Engine layers (GPU with TE installed only).
        qkv_bias: a bias on the fused QKV projection only (Qwen2; megatron's ``add_qkv_bias``).
        qk_norm: RMSNorm of each query and key head before RoPE (Qwen3; megatron's
            ``qk_layernorm``).
        head_dim: channels per attention head (megatron's ``kv_channels``); 0 means
            ``hidden_size / num_attention_heads``.
        rope_scaling_factor: Llama-3 RoPE frequency scaling factor (megatron's ``rope_scaling``,
            with its fixed low/high frequency factors 1 and 4 and original context 8192); 0 means
            no scaling.
    """

    head: str = "lm"
    tie_embeddings: bool = False
    dropout: float = 0.0
    norm_epsilon: float = 1e-5
    rotary_base: int = 10000
    params_dtype: str = "float32"
    use_transformer_engine: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    head_dim: int = 0
    rope_scaling_factor: float = 0.0

    def __post_init__(self) -> None:
        if self.head not in HEAD_KINDS:
            raise ValueError(f"model.head={self.head!r} is not one of {HEAD_KINDS}")
        if self.tie_embeddings and self.head != "lm":
            raise ValueError("model.tie_embeddings=True needs head='lm'; set tie_embeddings=False")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.params_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"model.params_dtype={self.params_dtype!r}: use 'float32' or 'bfloat16'"
            )
        if self.head_dim < 0 or self.rope_scaling_factor < 0:
            raise ValueError(f"model.head_dim={self.head_dim} and model.rope_scaling_factor="
                             f"{self.rope_scaling_factor} must be >= 0 (0: the default)")


class ScalarHead(torch.nn.Module):
    """A replicated ``hidden -> 1`` projection standing where megatron expects its output layer."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        return F.linear(hidden_states, self.weight), None


class PolicyValueHead(torch.nn.Module):
    """AC-Share head: the LM head's local logits with a value channel appended."""

    def __init__(self, lm_head: torch.nn.Module, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.lm_head = lm_head
        self.value_head = ScalarHead(hidden_size, dtype)

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        logits, _ = self.lm_head(hidden_states, weight=weight,
                                 runtime_gather_output=runtime_gather_output)
        values, _ = self.value_head(hidden_states)
        return torch.cat([logits, values.to(logits.dtype)], dim=-1), None


def split_policy_value(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an AC-Share model output ``[b, s, v_local + 1]`` into logits and values ``[b, s]``."""
    return output[..., :-1], output[..., -1]


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron's vocabulary padding: a multiple of ``divisible_by * tp_size``."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def transformer_config(arch: Architecture, options: ModelBuildOptions,
                       pg_collection: ProcessGroupCollection) -> TransformerConfig:
    """The megatron ``TransformerConfig`` of one model under its own TP/PP layout."""
    dtype = getattr(torch, options.params_dtype)
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        tensor_model_parallel_size=pg_collection.tp.size(),
        pipeline_model_parallel_size=pg_collection.pp.size(),
        normalization="RMSNorm",
        layernorm_epsilon=options.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=options.qkv_bias,
        qk_layernorm=options.qk_norm,
        kv_channels=options.head_dim or None,
        hidden_dropout=options.dropout,
        attention_dropout=options.dropout,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def _layer_spec(options: ModelBuildOptions):
    if options.use_transformer_engine:
        if not torch.cuda.is_available():
            raise ValueError("model.use_transformer_engine=True needs a GPU; set it to False on CPU")
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=options.qk_norm)
    return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=options.qk_norm)


def build_gpt_model(arch: Architecture, options: ModelBuildOptions,
                    pg_collection: ProcessGroupCollection, seed: int = 1234) -> GPTModel:
    """Build this rank's part of one model (its pipeline stage, its TP shard).

    megatron initialises the weights (which also marks their tensor-parallel attributes), but its
    values depend on the TP/PP layout: call :func:`megatron_rlhf.models.weights.init_weights` for
    layout-independent values, or load a checkpoint.

    Args:
        arch: architecture numbers.
        options: head and numerics.
        pg_collection: the model's own process groups (tp, pp, cp, dp, embd, pos_embd, ...).
        seed: seed of the model's tensor-parallel dropout streams.
    """
    config = transformer_config(arch, options, pg_collection)
    seed_model_parallel_rng(seed, tp_rank=pg_collection.tp.rank())
    pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
    post_process = pp_rank == pp_size - 1
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(options),
        vocab_size=padded_vocab_size(arch.vocab_size, pg_collection.tp.size()),
        max_sequence_length=arch.seq_length,
        pre_process=pp_rank == 0,
        post_process=post_process,
        share_embeddings_and_output_weights=options.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=options.rotary_base,
        rope_scaling=options.rope_scaling_factor > 0,
        rope_scaling_factor=options.rope_scaling_factor or 8.0,
        pg_collection=pg_collection,
    )
    if post_process and options.head == "scalar":
        model.output_layer = ScalarHead(arch.hidden_size, config.params_dtype)
    elif post_process and options.head == "lm+scalar":
        model.output_layer = PolicyValueHead(model.output_layer, arch.hidden_size,
                                             config.params_dtype)
    model.real_vocab_size = arch.vocab_size
    model.rope_scaling_factor = options.rope_scaling_factor
    model.head_kind = options.head
    return model
