"""Sampling from a tiny mixture-of-experts model at expert parallelism 2 on 2 gloo ranks whose
work differs: rank 0 decodes 3 prompts, rank 1 one, and many end-of-sequence tokens stop rows
at different steps. Every MoE layer's all-to-all is collective over the two ranks, so the decode
loops run in lockstep (``generation.lockstep``: idle forwards where a rank has nothing left);
the tokens must be those the same model samples at EP 1, with both decode loops, also when
rank 1 has no prompts at all."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rlhf.models.moe import MoEConfig
from tests.model_fixtures import TinyArch
from tests.multirank import run_on_ranks

EOS = tuple(range(0, 256, 3))
"""A third of the vocabulary ends a reply: rows stop after a few tokens, at different steps."""


def _sample(ep: int, batching: str, idle_rank: int | None = None
            ) -> tuple[list[list[int]], list[float], int]:
    from megatron_rlhf.builder.networks import build_model
    from megatron_rlhf.generation.generate import generate_sequences
    from megatron_rlhf.generation.lockstep import ExpertLockstep
    from megatron_rlhf.generation.params import GenerationConfig
    from megatron_rlhf.models.gpt import ModelBuildOptions
    from tests.model_fixtures import whole_world_groups

    pgc = whole_world_groups(1, 1, ep=ep)
    experts = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=48).expert_spec(0)
    model = build_model(TinyArch(num_layers=2, experts=experts), ModelBuildOptions(), pgc,
                        runtime_seed=5, init_seed=9)
    rank = dist.get_rank()
    prompts = ([[5, 6, 7, 8], [9, 10], [11, 12, 13]] if rank == 0 else [[20, 21, 22, 23, 24]])
    indices = [10 * rank + i for i in range(len(prompts))]
    config = GenerationConfig(max_new_tokens=8, micro_batch_size=1, batching=batching, seed=1)
    idle = []
    original = ExpertLockstep.idle_forward

    def counted(self: ExpertLockstep) -> None:
        idle.append(1)
        original(self)

    ExpertLockstep.idle_forward = counted
    try:
        if rank == idle_rank:  # an uneven split left this rank without prompts
            lockstep = ExpertLockstep.of(model, pgc, pad_id=1)
            if lockstep is not None:
                with torch.no_grad():
                    lockstep.idle_call(config.continuous, config.stop_check_interval)
            return [], [], len(idle)
        out = generate_sequences(model, pgc, prompts, indices, config, eos_id=EOS, pad_id=1)
    finally:
        ExpertLockstep.idle_forward = original
    tokens = [row[mask.bool()].tolist() for row, mask in
              zip(out.input_ids[:, -out.response_mask.shape[1]:], out.response_mask, strict=True)]
    logprobs = out.response_logprobs[out.response_mask.bool()].tolist()
    return tokens, logprobs, len(idle)


def _job() -> dict:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    results = {(ep, batching): _sample(ep, batching)
               for batching in ("static", "continuous") for ep in (1, 2)}
    results.update({(ep, batching, "idle"): _sample(ep, batching, idle_rank=1)
                    for batching in ("static", "continuous") for ep in (1, 2)})
    return results


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_expert_parallel_ranks_decode_in_lockstep() -> None:
    per_rank = run_on_ranks(_job, world_size=2, timeout_s=200)
    for rank, results in enumerate(per_rank):
        for batching in ("static", "continuous"):
            tokens1, logprobs1, idle1 = results[(1, batching)]
            tokens2, logprobs2, idle2 = results[(2, batching)]
            assert tokens2 == tokens1, (rank, batching)
            assert logprobs2 == pytest.approx(logprobs1, abs=1e-5), (rank, batching)
            assert idle1 == 0
            lengths = [len(t) for t in tokens1]
            assert min(lengths) < 8, lengths
            if rank == 0:
                assert len(set(lengths)) > 1, lengths  # its rows stop at different steps
            else:  # one prompt against three: rank 1 idles while rank 0 decodes
                assert idle2 > 0, batching
            # rank 1 without prompts: its idle call keeps rank 0's decoding going
            ep2, ep1 = results[(2, batching, "idle")], results[(1, batching, "idle")]
            assert ep2[0] == ep1[0] and ep2[1] == pytest.approx(ep1[1], abs=1e-5)
            if rank == 0:
                assert ep2[0] == tokens1
            else:
                assert ep2[2] > 0
