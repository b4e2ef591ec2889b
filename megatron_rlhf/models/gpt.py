"""Build the four PPO models as Megatron-Core ``GPTModel``s with their own process groups.

Every role uses the same Llama-style trunk (RMSNorm, SwiGLU, rotary embeddings, no biases; the
Hugging Face families add a QKV bias, QK-norm, Llama-3 RoPE scaling or experts through megatron's
own options, as the architecture record ``topology.models.ArchSpec`` says); only the head differs:

* ``lm``: the language-model head (actor, reference);
* ``scalar``: one value per position (critic values; the reward model reads the value at the last
  real token of each sequence);
* ``lm+scalar``: AC-Share, the critic's value head on the actor's trunk. The model returns the
  local vocabulary shard of the logits with the value appended as one extra channel, so a single
  tensor still flows through megatron's pipeline schedule; :func:`split_policy_value` separates
  them.

No role touches megatron's global parallel state: the model gets a ``ProcessGroupCollection``.

Numerics follow megatron's mixed precision (its ``Float16Module``): every parameter, norms included,
is held in ``params_dtype`` on the rank's device, the optimizer keeps fp32 main copies, and
whatever is reduced or compared (log-probs, values, scores, losses) is computed in fp32.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.utils import set_model_to_sequence_parallel

from megatron_rlhf.models.attention import CachedRopeSelfAttention, SDPAttention
from megatron_rlhf.models.moe import moe_transformer_fields
from megatron_rlhf.models.options import (  # noqa: F401  (re-exported: their home before)
    ATTENTION_BACKENDS,
    HEAD_KINDS,
    PARAMS_DTYPES,
    RECOMPUTE_GRANULARITIES,
    TRANSFORMER_IMPLS,
    HeadKind,
    ModelBuildOptions,
    resolve_params_dtype,
    transformer_engine_importable,
)
from megatron_rlhf.models.te_attention import packed_te_core_attention
from megatron_rlhf.runtime.cpu_compat import seed_model_parallel_rng
from megatron_rlhf.runtime.device import compute_device
from megatron_rlhf.runtime.patches import define_moe_router_gemm
from megatron_rlhf.topology.models import ArchSpec


def resolve_transformer_impl(transformer_impl: str, needs_kv_cache: bool) -> str:
    """The layer implementation a model is built with.

    ``auto`` takes Transformer Engine when it is importable on a CUDA machine and the model does
    not decode with the KV cache: megatron-core 0.16.1 turns TE's masking off for cached decode
    steps (``Attention._adjust_key_value_for_inference``), which is wrong for the left-padded
    batches our generator feeds. Otherwise ``local`` (megatron's own modules).

    Raises:
        ValueError: an unknown name, or ``transformer_engine`` where it cannot work.
    """
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"models.transformer_impl={transformer_impl!r}: use one of "
                         f"{TRANSFORMER_IMPLS}")
    available = torch.cuda.is_available() and transformer_engine_importable()
    if transformer_impl == "auto":
        return "transformer_engine" if available and not needs_kv_cache else "local"
    if transformer_impl == "transformer_engine":
        if not available:
            raise ValueError("models.transformer_impl=transformer_engine needs CUDA and an "
                             "importable transformer_engine; use 'local' or 'auto'")
        if needs_kv_cache:
            raise ValueError("models.transformer_impl=transformer_engine cannot decode with the KV "
                             "cache (megatron drops the padding mask of cached decode steps); set "
                             "models.transformer_impl=auto (TE for the models that do not decode), "
                             "local, or generation.use_kv_cache=false")
    return transformer_impl


class ScalarHead(torch.nn.Module):
    """A replicated ``hidden -> 1`` projection standing where megatron expects its output layer.

    Its output is fp32 whatever the parameter dtype: values and scores are regressed and compared
    across sequences, where bf16's 8-bit mantissa is too coarse. Under sequence parallelism it
    gathers the sequence first (every TP rank then computes every value, as without it); its
    ``sequence_parallel`` follows the model's (``without_sequence_parallel``).
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype,
                 tp_group: torch.distributed.ProcessGroup | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            # every TP rank's loss sees every value: its gradient is whole, split it back
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group)
        return F.linear(hidden_states.float(), self.weight.float()), None


class PolicyValueHead(torch.nn.Module):
    """AC-Share head: the LM head's local logits with a value channel appended."""

    def __init__(self, lm_head: torch.nn.Module, hidden_size: int, dtype: torch.dtype,
                 tp_group: torch.distributed.ProcessGroup | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.lm_head = lm_head
        self.value_head = ScalarHead(hidden_size, dtype, tp_group, sequence_parallel)

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        logits, _ = self.lm_head(hidden_states, weight=weight,
                                 runtime_gather_output=runtime_gather_output)
        values, _ = self.value_head(hidden_states)
        # fp32 for the value channel's sake; the log-probs upcast the logits anyway.
        return torch.cat([logits.float(), values], dim=-1), None


def split_policy_value(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an AC-Share model output ``[b, s, v_local + 1]`` into logits and values ``[b, s]``."""
    return output[..., :-1], output[..., -1]


def transformer_config(arch: ArchSpec, options: ModelBuildOptions,
                       pg_collection: ProcessGroupCollection) -> TransformerConfig:
    """The megatron ``TransformerConfig`` of one model under its own TP/PP layout: the layers
    ``arch`` describes, run as ``options`` says.

    Raises:
        ValueError: ``arch`` has a plain MLP (only SwiGLU is built).
    """
    if not arch.gated_mlp:
        raise ValueError(f"arch {arch.name!r}: gated_mlp=false, but the models built here have "
                         "SwiGLU MLPs (Llama's); set gated_mlp: true")
    dtype = getattr(torch, options.params_dtype)
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        tensor_model_parallel_size=pg_collection.tp.size(),
        sequence_parallel=options.sequence_parallel and pg_collection.tp.size() > 1,
        pipeline_model_parallel_size=pg_collection.pp.size(),
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        kv_channels=arch.head_dim,
        hidden_dropout=options.dropout,
        attention_dropout=options.dropout,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        # TE's kernels: fused RoPE (thd included) and jit-fused bias-dropout-add; the local
        # modules run none (no Apex: megatron's masked-softmax and wgrad fusions stay off)
        bias_dropout_fusion=options.transformer_impl == "transformer_engine",
        masked_softmax_fusion=False,
        apply_rope_fusion=options.transformer_impl == "transformer_engine",
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **recompute_fields(options.recompute),
        **moe_transformer_fields(arch.experts, options.moe, pg_collection.ep.size(),
                                 pg_collection.tp.size()),
    )


def recompute_fields(recompute: str) -> dict[str, object]:
    """megatron ``TransformerConfig`` fields of one of :data:`RECOMPUTE_GRANULARITIES`."""
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute_granularity": "selective"}
    return {}


def with_explicit_attention_masks(spec: ModuleSpec) -> ModuleSpec:
    """Make self-attention apply the boolean mask it is given instead of a built-in causal one.

    Our batches are padded per sequence and every call passes a causal + key-padding mask. Under
    megatron's local attention the mask type only names the mask; Transformer Engine's attention
    with type ``causal`` ignores the given mask (padding would be attended), ``arbitrary`` applies
    it.
    """
    spec.submodules.self_attention.params = {
        **spec.submodules.self_attention.params, "attn_mask_type": AttnMaskType.arbitrary}
    return spec


class TorchNorm:
    """megatron's ``WrappedTorchNorm`` (torch's ``RMSNorm`` or ``LayerNorm``) without its refusal
    of sequence parallelism: a norm is per token, so it runs on a sequence chunk unchanged.

    Norms whose input is split along the sequence (:class:`SequenceSplitTorchNorm`: before
    attention and MLP, the final one) mark their weights ``sequence_parallel``, so that megatron
    sums their gradients over the TP ranks (``finalize_model_grads``), as it does for Apex's and
    TE's norms; the query/key norms inside attention see the whole sequence and are not marked.
    """

    splits_sequence = False

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                **_unused) -> torch.nn.Module:
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = cls.splits_sequence and config.sequence_parallel
        return norm


class SequenceSplitTorchNorm(TorchNorm):
    """:class:`TorchNorm` on sequence-split activations (see there)."""

    splits_sequence = True


def _sequence_parallel_spec(spec: ModuleSpec, qk_norm: bool) -> ModuleSpec:
    """The local layer spec with norms that run under sequence parallelism."""
    spec.submodules.input_layernorm = SequenceSplitTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceSplitTorchNorm
    if qk_norm:
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = TorchNorm
    return spec


def _layer_spec(arch: ArchSpec, options: ModelBuildOptions) -> ModuleSpec:
    num_experts = arch.experts.num_experts if arch.experts else None
    if options.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        spec = with_explicit_attention_masks(
            get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts,
                                                       qk_layernorm=arch.qk_norm))
        if options.packed_sequences:
            spec.submodules.self_attention.submodules.core_attention = packed_te_core_attention()
        return spec
    spec = with_explicit_attention_masks(
        get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                 normalization="RMSNorm", qk_layernorm=arch.qk_norm))
    spec.submodules.self_attention.module = CachedRopeSelfAttention
    if options.attention_backend == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if options.sequence_parallel:
        spec = _sequence_parallel_spec(spec, arch.qk_norm)
    return spec


def _decoder_spec(arch: ArchSpec, options: ModelBuildOptions, config: TransformerConfig,
                  pp_rank: int) -> ModuleSpec | TransformerBlockSubmodules:
    """The layer spec, or under sequence parallelism with the local layers the block's (whose
    final norm megatron otherwise takes from its module-level default)."""
    spec = _layer_spec(arch, options)
    if not config.sequence_parallel or options.transformer_impl != "local":
        return spec
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config, pp_rank=pp_rank),
        layer_norm=SequenceSplitTorchNorm)


def build_gpt_model(arch: ArchSpec, options: ModelBuildOptions,
                    pg_collection: ProcessGroupCollection, seed: int = 1234) -> GPTModel:
    """Build this rank's part of one model (its pipeline stage, its TP shard).

    megatron initialises the weights (which also marks their tensor-parallel attributes), but its
    values depend on the TP/PP layout: call :func:`megatron_rlhf.models.weights.init_weights` for
    layout-independent values, or load a checkpoint.

    Args:
        arch: the architecture (recorded as ``model.arch``: checkpoints describe it).
        options: head, dtype and how the layers run.
        pg_collection: the model's own process groups (tp, pp, cp, dp, embd, pos_embd, ...).
        seed: seed of the model's tensor-parallel dropout streams.

    Raises:
        ValueError: ``options.token_vocab_size`` exceeds the embedding's rows.
    """
    if options.token_vocab_size > arch.vocab_size:
        raise ValueError(f"model.token_vocab_size={options.token_vocab_size} exceeds the "
                         f"{arch.vocab_size} rows the architecture embeds; use the model's own "
                         "tokenizer")
    config = transformer_config(arch, options, pg_collection)
    if config.num_moe_experts:
        define_moe_router_gemm()
    seed_model_parallel_rng(seed, tp_rank=pg_collection.tp.rank(),
                            ep_rank=pg_collection.ep.rank(), etp_rank=pg_collection.expt_tp.rank())
    pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
    post_process = pp_rank == pp_size - 1
    model = GPTModel(
        config=config,
        transformer_layer_spec=_decoder_spec(arch, options, config, pp_rank),
        vocab_size=arch.padded_vocab_size(pg_collection.tp.size()),
        max_sequence_length=arch.seq_length,
        pre_process=pp_rank == 0,
        post_process=post_process,
        share_embeddings_and_output_weights=options.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rotary_base,
        rope_scaling=arch.rope_scaling_factor > 0,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        pg_collection=pg_collection,
    )
    if post_process and options.head == "scalar":
        model.output_layer = ScalarHead(arch.hidden_size, config.params_dtype,
                                        pg_collection.tp, config.sequence_parallel)
    elif post_process and options.head == "lm+scalar":
        model.output_layer = PolicyValueHead(model.output_layer, arch.hidden_size,
                                             config.params_dtype, pg_collection.tp,
                                             config.sequence_parallel)
    # megatron leaves some modules on the host whatever use_cpu_initialization says (its torch
    # norm wrapper, our scalar heads) and keeps norms in fp32: one move puts every parameter on
    # the rank's device in params_dtype, as megatron's Float16Module does for bf16.
    model.to(device=compute_device(), dtype=config.params_dtype)
    model.arch = arch
    model.real_vocab_size = arch.vocab_size
    model.token_vocab_size = options.token_vocab_size or arch.vocab_size
    model.head_kind = options.head
    model.transformer_impl = options.transformer_impl
    model.packed_sequences = options.packed_sequences
    return model


@contextmanager
def without_sequence_parallel(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` (a GPTModel built by :func:`build_gpt_model`) without sequence parallelism
    for the duration: decoding steps of one token cannot be split over the TP ranks (megatron's
    own inference turns it off the same way, ``set_model_to_sequence_parallel``)."""
    if not model.config.sequence_parallel:
        yield
        return
    set_model_to_sequence_parallel(model, False)
    try:
        yield
    finally:
        set_model_to_sequence_parallel(model, True)


def last_token_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's value at its last real token: ``[b, s]`` values, ``[b, s]`` mask -> ``[b]``."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (positions * attention_mask).argmax(dim=1)
    return values[torch.arange(values.shape[0], device=values.device), last]
