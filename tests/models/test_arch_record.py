"""``topology.models.ArchSpec`` is the one record of a model's architecture: every one of its
fields (and of ``ExpertSpec``'s) is walked through its three readers, the built network, the
checkpoint description and the Hugging Face ``config.json`` mapping.

The walk takes the fields from the dataclasses themselves, so a field added to the record is
walked too, once it has a value in :data:`OTHER` (the first test asks for one): it must change
the network megatron builds (or be refused by the builder, naming it), survive a checkpoint's
``megatron_rlhf.json`` and be told apart from the default there, and come back from the
``config.json`` it exports to (or be refused, naming it). A field only the record carries fails.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rlhf.models.description import ModelDescription
from megatron_rlhf.models.hf_config import hf_config, read_hf_config
from megatron_rlhf.topology.models import ArchSpec, ExpertSpec
from tests.model_fixtures import TinyArch, whole_world_groups

DENSE = TinyArch(num_layers=2)
MOE = replace(DENSE, qk_norm=True, experts=ExpertSpec(4, 2, 48))
"""Expert fields are walked from here: Qwen3-MoE's layers, the family that names every one."""

OTHER: dict[str, Any] = {
    "name": "other", "num_layers": 3, "hidden_size": 96, "num_attention_heads": 8,
    "vocab_size": 300, "seq_length": 32, "ffn_hidden_size": 96, "gated_mlp": False,
    "num_query_groups": 4, "rotary_base": 500000, "head_dim": 32, "qk_norm": True,
    "qkv_bias": True, "norm_epsilon": 1e-3, "rope_scaling_factor": 8.0,
    "experts": ExpertSpec(4, 2, DENSE.ffn_hidden_size),
}
"""A valid value other than :data:`DENSE`'s, for every field of ``ArchSpec``."""
OTHER_EXPERTS: dict[str, Any] = {"num_experts": 2, "topk": 3, "ffn_hidden_size": 32,
                                 "shared_ffn_size": 16, "renormalize_topk": False}
"""A valid value other than :data:`MOE`'s experts', for every field of ``ExpertSpec``."""
LABELS = {"name"}
"""Fields that name a record and compute nothing."""


def _changed() -> list[tuple[str, ArchSpec, ArchSpec]]:
    """(field, base, the base with that field changed) for every field of both records."""
    walks = [(name, DENSE, replace(DENSE, **{name: value})) for name, value in OTHER.items()]
    return walks + [(f"experts.{name}", MOE, replace(MOE, experts=replace(MOE.experts,
                                                                          **{name: value})))
                    for name, value in OTHER_EXPERTS.items()]


WALKS = _changed()


def test_every_field_of_the_record_is_walked() -> None:
    for record, values in ((ArchSpec, OTHER), (ExpertSpec, OTHER_EXPERTS)):
        names = {spec.name for spec in fields(record)}
        assert names == set(values), (
            f"{record.__name__} gained or lost {sorted(names ^ set(values))}: give each new "
            "field a valid non-default value here, and make the builder (models.gpt) and the "
            "Hugging Face mapping (models.hf_config) read it")


@pytest.mark.parametrize(("name", "base", "changed"), WALKS, ids=[w[0] for w in WALKS])
def test_a_checkpoint_records_the_field_and_tells_it_apart(name, base, changed) -> None:
    saved = ModelDescription(changed, head="lm")
    # what megatron_rlhf.json holds: write_info dumps asdict of the checkpoint's info
    read = ModelDescription.from_dict(json.loads(json.dumps(asdict(saved))), "test")
    assert read == saved
    differ = [field for field, _, _ in ModelDescription(base).mismatches(read)]
    if name in LABELS:
        assert differ == []
    else:  # "experts" on a dense base: every expert field differs
        assert differ and all(f == name or f.startswith(f"{name}.") for f in differ), differ


@pytest.mark.parametrize(("name", "base", "changed"), WALKS, ids=[w[0] for w in WALKS])
def test_the_hugging_face_config_maps_the_field_or_refuses_it(name, base, changed,
                                                              tmp_path: Path) -> None:
    field = name.rsplit(".", 1)[-1]
    try:
        config = hf_config(ModelDescription(changed))
    except ValueError as refusal:
        assert f"{field}=" in str(refusal)
        return
    (tmp_path / "config.json").write_text(json.dumps(config))
    read, _ = read_hf_config(tmp_path)
    assert read.arch == replace(changed, name=read.arch.name)


def _network(arch: ArchSpec, pgc) -> tuple[Any, ...]:
    """What megatron built from ``arch``: its parameters' names and shapes, its positions and
    its logits on a fixed batch (from weights that do not depend on the layout)."""
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import init_weights
    from tests.helpers.models import full_logits

    model = build_gpt_model(arch, ModelBuildOptions(params_dtype="float32"), pgc)
    init_weights(model, pgc, seed=3)
    assert ModelDescription.from_model(model).arch == arch
    ids = torch.randint(0, 250, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = full_logits(model, pgc, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    shapes = tuple((key, tuple(param.shape)) for key, param in model.named_parameters())
    return shapes, model.max_sequence_length, logits.tolist()  # plain values cross processes


def _networks(archs: dict[str, ArchSpec]) -> dict[str, Any]:
    """On one rank: :func:`_network` of every arch, or the message of the builder's refusal."""
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    pgc = whole_world_groups(1, 1)
    built = {}
    for key, arch in archs.items():
        try:
            built[key] = _network(arch, pgc)
        except ValueError as refusal:
            built[key] = str(refusal)
    return built


@pytest.fixture(scope="module")
def networks() -> dict[str, Any]:
    """Every walked network, built in a rank of its own (no process group is left behind)."""
    from tests.multirank import run_on_ranks

    archs = {"dense": DENSE, "moe": MOE, **{name: changed for name, _, changed in WALKS
                                           if name not in LABELS}}
    return run_on_ranks(_networks, world_size=1, args=(archs,), timeout_s=240)[0]


@pytest.mark.multirank
@pytest.mark.parametrize(("name", "base", "changed"), WALKS, ids=[w[0] for w in WALKS])
def test_the_built_network_reads_the_field_or_refuses_it(name, base, changed, networks) -> None:
    if name in LABELS:
        return
    network, reference = networks[name], networks["moe" if base is MOE else "dense"]
    if isinstance(network, str):  # refused
        assert f"{name.rsplit('.', 1)[-1]}=" in network
        return
    assert network != reference, f"{name} does not reach the network"


FORMAT_1 = {
    "ffn_hidden_size": 128, "head": "lm", "head_dim": 16, "hidden_size": 64,
    "moe_ffn_hidden_size": 48, "moe_renormalize_topk": False, "moe_shared_ffn_size": 0,
    "moe_topk": 2, "norm_epsilon": 1e-06, "num_attention_heads": 4, "num_experts": 4,
    "num_layers": 2, "num_query_groups": 2, "params_dtype": "float32", "qk_norm": True,
    "qkv_bias": False, "rope_scaling_factor": 0.0, "rotary_base": 500000, "seq_length": 64,
    "tie_embeddings": False, "vocab_size": 250}
"""A model's description as format 1 wrote it (flat, experts as ``moe_*``)."""


def test_a_format_1_description_reads_as_the_record() -> None:
    read = ModelDescription.from_dict(FORMAT_1, "v1", format_version=1)
    expected = replace(MOE, name="checkpoint", num_query_groups=2, norm_epsilon=1e-6,
                       rotary_base=500000, experts=ExpertSpec(4, 2, 48, renormalize_topk=False))
    assert read == ModelDescription(expected)
    # written before the QKV bias, QK-norm, head_dim, RoPE scaling and experts existed
    early = {k: v for k, v in FORMAT_1.items() if k not in (
        "qkv_bias", "qk_norm", "head_dim", "rope_scaling_factor", "num_experts", "moe_topk",
        "moe_ffn_hidden_size", "moe_shared_ffn_size", "moe_renormalize_topk")}
    assert ModelDescription.from_dict(early, "v1", 1).arch == replace(expected, qk_norm=False,
                                                                       experts=None)
    with pytest.raises(ValueError, match="v1: field 'head' is missing"):
        ModelDescription.from_dict({k: v for k, v in FORMAT_1.items() if k != "head"}, "v1", 1)
    dense = {k: v for k, v in asdict(DENSE).items() if k != "experts"}  # absent: the default
    assert ModelDescription.from_dict({"arch": dense}, "v2") == ModelDescription(DENSE)
    with pytest.raises(ValueError, match=r"unknown fields \[.made_up.\]"):
        ModelDescription.from_dict({"arch": asdict(MOE) | {"made_up": 8}}, "v2")


def test_a_format_1_checkpoint_info_reads_and_is_rewritten_as_format_2(tmp_path: Path) -> None:
    from megatron_rlhf.models.checkpoint import INFO_FILE, read_checkpoint_info, write_info

    (tmp_path / INFO_FILE).write_text(json.dumps({
        "format_version": 1, "model": FORMAT_1, "tp_size": 2, "pp_size": 1,
        "metadata": {"role": "actor"}, "files": {}, "megatron_core_version": "0.16.1"}))
    info = read_checkpoint_info(tmp_path)
    assert info.model == ModelDescription.from_dict(FORMAT_1, "v1", format_version=1)
    assert info.format_version == 2 and info.tp_size == 2
    (tmp_path / "v2").mkdir()
    write_info(tmp_path / "v2", info)
    assert read_checkpoint_info(tmp_path / "v2").model == info.model
    written = json.loads((tmp_path / "v2" / INFO_FILE).read_text())
    assert written["format_version"] == 2 and written["model"]["arch"]["experts"]["topk"] == 2
