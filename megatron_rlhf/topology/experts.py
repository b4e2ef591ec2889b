"""Expert-parallel rank arithmetic of one model: its experts split over ``ep`` of its DP ranks.

    expert_rank_enums(offset=0, tp=1, dp=4, pp=1, ep=2)["ep"]   # [[0, 1], [2, 3]]

``topology.groups`` creates these groups for a placed model whose ``ModelSpec.ep > 1``.

A mixture-of-experts model runs attention on megatron's dense grid (tp, cp, dp, pp) and its
experts on a second decomposition of the same ranks, megatron's expert grid
``(expert tp, ep, expert dp, pp)``: with the expert TP equal to the model's TP (megatron's
default) and cp = 1, ``dp = ep * expert_dp`` and ``ep`` varies faster than expert DP. Each EP
group is therefore ``ep`` consecutive DP ranks, holding ``num_experts / ep`` experts each; the
tokens of its ranks are exchanged by the token dispatcher; the expert-DP group of a rank is the
ranks holding the same experts, over which expert gradients are reduced.
"""

from __future__ import annotations


def expert_rank_enums(offset: int, tp: int, dp: int, pp: int, ep: int
                      ) -> dict[str, list[list[int]]]:
    """Members of every expert group of a model on ranks ``[offset, offset + tp * dp * pp)``.

    Ranks follow the dense grid (``rank = offset + tp_rank + tp * (dp_rank + dp * pp_rank)``,
    ``topology.grid``) with ``dp_rank = ep_rank + ep * expert_dp_rank``.

    Returns:
        ``ep`` (ranks exchanging tokens), ``expt_dp`` (ranks holding the same experts), ``tp_ep``
        (an EP group with its TP ranks) and ``tp_ep_pp`` (that across pipeline stages), each a
        list of increasing rank lists.

    Raises:
        ValueError: ``ep`` does not divide ``dp``.
    """
    if ep < 1 or dp % ep:
        raise ValueError(f"ep({ep}) must divide the model's data-parallel size dp({dp}): choose "
                         f"ep in {[d for d in range(1, dp + 1) if dp % d == 0]}")
    expert_dp = dp // ep

    def rank(t: int, e: int, k: int, p: int) -> int:
        return offset + t + tp * (e + ep * k + dp * p)

    tps, eps, edps, pps = range(tp), range(ep), range(expert_dp), range(pp)
    return {
        "ep": [[rank(t, e, k, p) for e in eps] for p in pps for k in edps for t in tps],
        "expt_dp": [[rank(t, e, k, p) for k in edps] for p in pps for e in eps for t in tps],
        "tp_ep": [sorted(rank(t, e, k, p) for e in eps for t in tps) for p in pps for k in edps],
        "tp_ep_pp": [sorted(rank(t, e, k, p) for e in eps for t in tps for p in pps)
                     for k in edps],
    }

