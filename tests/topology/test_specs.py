"""Cluster, pool, architecture and model specs: numbering, parameter counts, memory, refusals."""

from __future__ import annotations

import pytest

from megatron_rlhf.topology import ARCH_PRESETS, ClusterSpec, DevicePool, ModelSpec, arch_preset
from megatron_rlhf.topology.models import ArchSpec
from tests.topology.helpers import HETERO


def test_hetero_ranks_are_numbered_pool_by_pool_node_by_node() -> None:
    assert HETERO.world_size == 16 and HETERO.num_nodes == 3 and HETERO.is_heterogeneous
    nodes = HETERO.nodes()
    assert [(n.index, n.pool_index, n.first_rank, n.size) for n in nodes] == [
        (0, 0, 0, 8), (1, 1, 8, 4), (2, 1, 12, 4)]
    where = HETERO.locate(13)
    assert (where.pool_index, where.node, where.local_rank) == (1, 2, 1)
    assert HETERO.locate(7).node == 0
    assert HETERO.pool_index("V100-32GB") == 1
    with pytest.raises(ValueError, match=r"rank 16 is outside the cluster's \[0, 16\)"):
        HETERO.locate(16)
    with pytest.raises(ValueError, match="no pool of kind 'H100'"):
        HETERO.pool_index("H100")


def test_pool_parse_and_refusals() -> None:
    pool = DevicePool.parse("V100-32GB:2x4:32:0.4")
    assert (pool.kind, pool.nodes, pool.devices_per_node, pool.memory_gib,
            pool.relative_speed, pool.devices) == ("V100-32GB", 2, 4, 32.0, 0.4, 8)
    assert DevicePool.parse("A100:1x8").memory_gib == 80.0
    with pytest.raises(ValueError, match="must read KIND:NODESxDEVICES"):
        DevicePool.parse("A100:8")
    with pytest.raises(ValueError, match="nodes=0 must be an integer >= 1"):
        DevicePool("A100", nodes=0)
    with pytest.raises(ValueError, match="memory_gib=0 must be positive"):
        DevicePool("A100", memory_gib=0)
    with pytest.raises(ValueError, match="repeat: give each pool its own kind"):
        ClusterSpec((DevicePool("A100"), DevicePool("A100")))
    with pytest.raises(ValueError, match="cluster.pools is empty"):
        ClusterSpec(())


def test_llama_parameter_counts_match_the_published_sizes() -> None:
    published = {"llama-7b": 6.74e9, "llama-13b": 13.0e9, "llama-33b": 32.5e9,
                 "llama-65b": 65.2e9}
    for name, params in published.items():
        assert arch_preset(name).num_params() == pytest.approx(params, rel=0.02), name
    assert {"tiny", "small"} <= set(ARCH_PRESETS)
    with pytest.raises(ValueError, match="model preset 'gpt-5' is unknown"):
        arch_preset("gpt-5")


def test_grouped_query_attention_counts_the_narrower_keys_and_values() -> None:
    """Llama-3-8B (8 key/value heads for 32 query heads): 8.03e9 published; counting full-width
    keys and values, as for multi-head attention, would give 8.8e9."""
    llama3 = ArchSpec("llama-3-8b", num_layers=32, hidden_size=4096, num_attention_heads=32,
                      vocab_size=128256, seq_length=8192, ffn_hidden_size=14336,
                      gated_mlp=True, num_query_groups=8)
    assert llama3.num_params() == pytest.approx(8.03e9, rel=0.005)


def test_vocab_is_padded_not_refused() -> None:
    llama = arch_preset("llama-7b")
    assert llama.padded_vocab_size(1) == 32000
    assert llama.padded_vocab_size(8) == 32768
    ModelSpec("actor", llama, trainable=True, tp=8)  # 32000 % 8 == 0, but 32000 % 1024 != 0


def test_memory_estimate() -> None:
    arch = arch_preset("llama-7b")
    ref = ModelSpec("ref", arch, trainable=False, tp=2)
    assert ref.bytes_per_device(dp=4) == pytest.approx(ref.num_params() / 2 * 2)
    actor = ModelSpec("actor", arch, trainable=True, tp=2, pp=2)
    shard = actor.num_params() / 4
    # bf16 weights (2), fp32 gradient buffer (4), fp32 master + Adam moments (12) over dp = 4.
    assert actor.bytes_per_device(dp=4) == pytest.approx(shard * (2 + 4 + 12 / 4))
    no_zero = ModelSpec("actor", arch, trainable=True, tp=2, pp=2, distributed_optimizer=False)
    assert no_zero.bytes_per_device(dp=4) == pytest.approx(shard * 18)
    assert no_zero.bytes_per_device(dp=4, fully_sharded=True) == pytest.approx(shard * 18 / 4)
    assert ref.bytes_per_device(dp=4, fully_sharded=True) == ref.bytes_per_device(dp=4)
    critic = ModelSpec("critic", arch, trainable=True, tp=2, pp=2)
    assert critic.num_params() < actor.num_params()  # scalar head instead of the vocabulary


def test_model_spec_refusals_name_field_numbers_and_fix() -> None:
    tiny = arch_preset("tiny")
    with pytest.raises(ValueError, match=r"actor.tp\(8\) does not divide num_attention_heads\(4\)"
                                         r" of 'tiny': choose tp in \{1,2,4\}"):
        ModelSpec("actor", tiny, trainable=True, tp=8)
    with pytest.raises(ValueError, match=r"ref.pp\(4\) does not divide num_layers\(2\) of 'tiny':"
                                         r" choose pp in \{1,2\}"):
        ModelSpec("ref", tiny, trainable=False, pp=4)
    with pytest.raises(ValueError, match="model role 'policy' is unknown"):
        ModelSpec("policy", tiny, trainable=True)
    with pytest.raises(ValueError, match=r"num_attention_heads\(5\) does not divide hidden_size"):
        type(tiny)("odd", 2, 64, 5, 512, 128, 256)


def test_an_architecture_can_be_written_out_in_the_config() -> None:
    from dataclasses import asdict, replace

    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.build import make_plan
    from megatron_rlhf.topology.models import resolve_arch

    tiny = arch_preset("tiny")
    # head_dim left out follows hidden_size / num_attention_heads (tiny's is that, 16)
    fields = {k: v for k, v in asdict(tiny).items() if k not in ("name", "experts", "head_dim")}
    assert resolve_arch(fields) == replace(tiny, name="custom")
    wide = {**fields, "hidden_size": 256, "ffn_hidden_size": 688, "num_layers": 4}
    override = "models.arch={" + ", ".join(f"{k}: {str(v).lower()}" for k, v in wide.items()) + "}"
    config = load_config(RunConfig, None, [override])
    plan = make_plan(config, ClusterSpec((DevicePool("local", 1, 4),)))
    assert plan["actor"].spec.arch == resolve_arch(wide)
    assert plan["actor"].spec.arch.hidden_size == 256 and plan["reward"].spec.arch.num_layers == 4
    with pytest.raises(ValueError, match=r"models.arch lacks \['vocab_size'\]"):
        resolve_arch({k: v for k, v in fields.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match=r"models.arch has unknown fields \['layers'\]"):
        resolve_arch({**fields, "layers": 2})
    with pytest.raises(ValueError, match="num_attention_heads\\(3\\) does not divide"):
        resolve_arch({**fields, "num_attention_heads": 3, "num_query_groups": 3})
