"""What a checkpoint's weights are, free of megatron-core: :class:`ModelDescription` and the
name of the file that records it (``models.checkpoint`` writes and reads both, and re-exports
them), so that the Hugging Face conversion's reading of a ``config.json`` and a configuration's
checks of a checkpoint directory import no megatron-core.

A description is the model's architecture, ``topology.models.ArchSpec`` (the one record of it,
mixture of experts included), with the head and dtype its weights were saved with. It is read
field by field off ``ArchSpec``: a field added there is recorded, read back and compared with no
change here, and a checkpoint written before the field existed takes its default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any

from megatron_rlhf.models.moe import MoEConfig
from megatron_rlhf.models.options import ModelBuildOptions
from megatron_rlhf.topology.models import ArchSpec, ExpertSpec, ModelSpec

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

INFO_FILE = "megatron_rlhf.json"

_KINDS = {"int": int, "str": str, "bool": bool, "float": float}
# Format 1 (until the one architecture record) kept the architecture flat, experts as moe_*.
_V1_EXPERTS = {"num_experts": "num_experts", "moe_topk": "topk",
               "moe_ffn_hidden_size": "ffn_hidden_size", "moe_shared_ffn_size": "shared_ffn_size",
               "moe_renormalize_topk": "renormalize_topk"}
_V1_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "vocab_size", "seq_length", "head", "tie_embeddings",
                "norm_epsilon", "rotary_base", "params_dtype")
_NOT_ARCH = ("head", "tie_embeddings", "params_dtype")


@dataclass(frozen=True)
class ModelDescription:
    """Everything needed to rebuild a model that a checkpoint's weights fit.

    Attributes:
        arch: the architecture (its ``name`` and ``seq_length`` do not change the weights).
        head: ``lm``, ``scalar`` or ``lm+scalar`` (``models.gpt``).
        tie_embeddings: the LM head is the input embedding.
        params_dtype: ``float32`` or ``bfloat16``.
    """

    arch: ArchSpec
    head: str = "lm"
    tie_embeddings: bool = False
    params_dtype: str = "float32"

    @property
    def moe(self) -> MoEConfig | None:
        """The experts as a :class:`MoEConfig` (its training fields at their defaults); None
        when dense."""
        experts = self.arch.experts
        if experts is None:
            return None
        return MoEConfig(num_experts=experts.num_experts, topk=experts.topk,
                         renormalize_topk=experts.renormalize_topk,
                         ffn_hidden_size=experts.ffn_hidden_size,
                         shared_expert_ffn_size=experts.shared_ffn_size)

    def model_spec(self, role: str, tp: int = 1, pp: int = 1) -> ModelSpec:
        """A topology ``ModelSpec`` of this model at a TP/PP layout (validates divisibility)."""
        return ModelSpec(role, self.arch, trainable=False, tp=tp, pp=pp)

    def mismatches(self, saved: ModelDescription,
                   ignore: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
        """``(field, saved value, our value)`` of every field in which ``saved`` differs from
        this description (``experts.topk`` for an expert's), less those in ``ignore``; the
        architecture's ``name``, a label, never counts."""
        ours, theirs = _flat(self), _flat(saved)
        skip = {"name", *ignore}
        return [(name, value, ours[name]) for name, value in theirs.items()
                if name not in skip and value != ours[name]]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``arch`` (its fields, ``experts`` an object or null) and the rest."""
        return {"arch": {spec.name: _plain(getattr(self.arch, spec.name))
                         for spec in fields(ArchSpec)},
                **{name: getattr(self, name) for name in _NOT_ARCH}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str,
                  format_version: int = 2) -> ModelDescription:
        """Parse and type-check :meth:`to_dict`'s form (or format 1's flat one); a field
        missing from it that has a default takes it (a checkpoint saved before the field
        existed).

        Raises:
            ValueError: a required field is missing, a field is unknown or of the wrong type,
                or the numbers are inconsistent.
        """
        if format_version == 1:
            data = _from_v1(data, source)
        values = _typed(cls, data, source)
        arch = _typed(ArchSpec, values["arch"], f"{source} (arch)")
        if arch.get("experts") is not None:
            arch["experts"] = ExpertSpec(**_typed(ExpertSpec, arch["experts"],
                                                  f"{source} (arch.experts)"))
        return cls(**values | {"arch": ArchSpec(**arch)})

    @classmethod
    def from_model(cls, model: GPTModel) -> ModelDescription:
        """Read the description off a model built by ``build_gpt_model`` (any stage, any shard):
        the architecture it was built from, its head and its dtype."""
        return cls(arch=model.arch, head=model.head_kind,
                   tie_embeddings=model.share_embeddings_and_output_weights,
                   params_dtype=str(model.config.params_dtype).removeprefix("torch."))

    def build_options(self) -> ModelBuildOptions:
        """The ``ModelBuildOptions`` that rebuild this model with ``arch`` (dropout 0, local
        layer spec, the experts' routing at its defaults)."""
        return ModelBuildOptions(head=self.head, tie_embeddings=self.tie_embeddings,
                                 params_dtype=self.params_dtype)


def _plain(value: Any) -> Any:
    if isinstance(value, ExpertSpec):
        return {spec.name: getattr(value, spec.name) for spec in fields(ExpertSpec)}
    return value


def _flat(description: ModelDescription) -> dict[str, Any]:
    arch = description.to_dict()["arch"]
    experts = arch.pop("experts") or {spec.name: None for spec in fields(ExpertSpec)}
    return {**arch, **{f"experts.{k}": v for k, v in experts.items()},
            **{name: getattr(description, name) for name in _NOT_ARCH}}


def _typed(cls: type, data: Any, source: str) -> dict[str, Any]:
    """``data``'s values of ``cls``'s fields, type-checked; absent ones with a default left
    out (the constructor supplies them)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: {data!r} is not an object")
    names = [spec.name for spec in fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"{source}: unknown fields {unknown}: written by a newer release? "
                         f"this one reads {names}")
    values = {}
    for spec in fields(cls):
        if spec.name not in data:
            if spec.default is MISSING:
                raise ValueError(f"{source}: field {spec.name!r} is missing")
            continue
        value, kind = data[spec.name], _KINDS.get(str(spec.type), Mapping)
        if kind is float and type(value) is int:
            value = float(value)
        nullable = str(spec.type).endswith("| None")
        if not (isinstance(value, kind) and not (kind is int and isinstance(value, bool))
                or (nullable and value is None)):
            raise ValueError(f"{source}: field {spec.name!r}={value!r} is not of type "
                             f"{spec.type}")
        values[spec.name] = value
    return values


def _from_v1(model: Any, source: str) -> dict[str, Any]:
    """Format 1's flat description in :meth:`ModelDescription.to_dict`'s form."""
    if not isinstance(model, Mapping):
        raise ValueError(f"{source}: {model!r} is not an object")
    for name in _V1_REQUIRED:
        if name not in model:
            raise ValueError(f"{source}: field {name!r} is missing")
    arch = {k: v for k, v in model.items() if k not in _V1_EXPERTS and k not in _NOT_ARCH}
    experts = {new: model[old] for old, new in _V1_EXPERTS.items() if old in model}
    return {"arch": {"name": "checkpoint", "gated_mlp": True, **arch,
                     "experts": experts if experts.get("num_experts") else None},
            **{name: model[name] for name in _NOT_ARCH}}
