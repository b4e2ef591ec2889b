"""Shared test fixtures: a tiny architecture and one model's process groups over the whole world."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass
class TinyArch:
    """A 4-layer GQA model; the vocabulary is not a multiple of 128*tp, to exercise padding."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    vocab_size: int = 250
    seq_length: int = 64


def whole_world_groups(tp: int, pp: int) -> ProcessGroupCollection:
    """Process groups of one model spread over every rank (DP = world / (tp * pp)).

    Collective: every rank must call it with the same arguments.
    """
    world = dist.get_world_size()
    grid = HyperCommGrid([tp, 1, world // (tp * pp), pp], ["tp", "cp", "dp", "pp"])
    pgs = {name: grid.create_pg(dims) for name, dims in {
        "tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "tp_cp": ["tp", "cp"],
        "dp_cp": ["cp", "dp"], "mp": ["tp", "pp"]}.items()}
    pp_ranks = grid.get_rank_enum("pp")
    pgs["embd"], _ = dist.new_subgroups_by_enumeration([sorted({r[0], r[-1]}) for r in pp_ranks])
    pgs["pos_embd"], _ = dist.new_subgroups_by_enumeration([[r[0]] for r in pp_ranks])
    # A dense model: expert parallelism of one, its groups the dense ones.
    pgs["ep"], _ = dist.new_subgroups_by_enumeration([[r] for r in range(world)])
    pgs.update(expt_dp=pgs["dp"], tp_ep_pp=pgs["mp"])
    # One distributed-optimizer instance spans the whole model: gradient norms reduce over it.
    pgs["intra_dist_opt"] = grid.create_pg(["tp", "cp", "dp", "pp"])
    return ProcessGroupCollection(**pgs)
