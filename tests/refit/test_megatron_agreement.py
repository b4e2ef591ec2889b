"""Where megatron's own TP planner applies, our plan moves every element to the same place.

megatron's ``_plan_multi_dim_lcm`` is the pure core of ``build_centralized_reshard_plan`` (it
handles TP strides, e.g. SwiGLU fc1 with ``partition_stride=2``); it is fed hand-made
``ParameterMetadata`` here, so no process group is needed.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.resharding.planner import _build_descriptors_for_param, _plan_multi_dim_lcm
from megatron.core.resharding.utils import ParameterMetadata

from megatron_rlhf.refit import ModelLayout, plan_refit
from megatron_rlhf.refit.layout import box_slices
from tests.refit.fake_model import describe

PARAMS = {  # suffix -> (partition_dim, partition_stride)
    "mlp.linear_fc1.weight": (0, 2),
    "mlp.linear_fc2.weight": (1, 1),
    "self_attention.linear_qkv.weight": (0, 1),
}


def _metadata(layout: ModelLayout, rank: int, name: str, shape: tuple[int, ...]
              ) -> ParameterMetadata:
    dim, stride = PARAMS[name.split(".", 3)[-1]]
    return ParameterMetadata(
        name=name, shape=shape, dtype=torch.float32, element_size=4, is_tp=True,
        partition_dim=dim, partition_stride=stride, owner_rank=rank,
        tensor_parallel_group_ranks=list(layout.ranks), data_parallel_group_ranks=[rank])


def _source_values(src_layout: ModelLayout) -> dict[tuple[int, str], torch.Tensor]:
    values = {}
    for r in describe(src_layout, num_layers=1):
        for p in r.params:
            numel = torch.Size(p.shape).numel()
            values[(r.rank, p.local_name)] = (torch.arange(numel) + 1000 * r.rank).reshape(p.shape)
    return values


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 4), (4, 2), (2, 1), (1, 4)])
def test_tp_resharding_matches_megatron_lcm_planner(src_tp: int, dst_tp: int) -> None:
    src_layout, dst_layout = ModelLayout(0, tp=src_tp), ModelLayout(src_tp, tp=dst_tp)
    src, dst = describe(src_layout, num_layers=1), describe(dst_layout, num_layers=1)
    plan = plan_refit(src, dst)
    source = _source_values(src_layout)
    src_shapes = {p.local_name: p.shape for p in src[0].params}
    for r in dst:
        for p in r.params:
            if p.local_name.split(".", 3)[-1] not in PARAMS:
                continue
            ours = torch.full(p.shape, -1)
            for t in plan.receives(r.rank):
                if t.dst_name == p.local_name:
                    ours[box_slices(t.dst_box)] = source[(t.src_rank, t.src_name)][
                        box_slices(t.src_box)]
            src_meta = _metadata(src_layout, 0, p.local_name, src_shapes[p.local_name])
            dst_meta = _metadata(dst_layout, r.rank, p.local_name, p.shape)
            descriptors = _build_descriptors_for_param(src_meta, dst_meta)
            theirs = torch.full(p.shape, -1)
            for src_rank, src_slice, dst_slice in _plan_multi_dim_lcm(
                    p.local_name, src_meta, dst_meta, descriptors, r.rank):
                theirs[dst_slice] = source[(src_rank, p.local_name)][src_slice]
            assert torch.equal(ours, theirs), f"{p.local_name} on rank {r.rank}"
            assert (ours >= 0).all()
