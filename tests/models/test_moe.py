"""A tiny mixture-of-experts GPTModel (4 experts, top-2, a shared expert) on CPU and gloo.

The 2-rank job builds the model at expert parallelism 1 and 2 with both token dispatchers from
the same layout-independent weights, each rank feeding its own batch (its data-parallel share):
outputs must match exactly, and the gradients too, once the EP 1 expert gradients are summed over
the ranks (at EP 2 each expert sees both ranks' tokens in one place). Then one optimizer step
at EP 2 on packed sequences, the routing replay, and KV-cached sampling at EP 2.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from megatron_rlhf.models.moe import MoEConfig, MoERouting, moe_transformer_fields
from megatron_rlhf.topology.experts import expert_rank_enums
from tests.model_fixtures import TinyArch
from tests.multirank import run_on_ranks

ARCH = TinyArch(num_layers=2)


def _moe(dispatcher: str = "alltoall") -> MoEConfig:
    return MoEConfig(num_experts=4, topk=2, ffn_hidden_size=48, shared_expert_ffn_size=32,
                     aux_loss_coeff=0.01, z_loss_coeff=1e-3, token_dispatcher=dispatcher)


def _batch(rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(31 + rank)
    ids = torch.randint(0, 250, (3, 12), generator=generator)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _build(ep: int, dispatcher: str, packed: bool = False):
    from megatron_rlhf.builder.networks import build_model
    from megatron_rlhf.models.gpt import ModelBuildOptions
    from tests.model_fixtures import whole_world_groups

    pgc = whole_world_groups(1, 1, ep=ep)
    moe = _moe(dispatcher)
    options = ModelBuildOptions(moe=moe.routing(), packed_sequences=packed)
    arch = replace(ARCH, experts=moe.expert_spec(ARCH.ffn_hidden_size))
    return build_model(arch, options, pgc, runtime_seed=5, init_seed=9), pgc


def _square_loss(output: torch.Tensor, outputs: list[torch.Tensor]):
    outputs.append(output.detach())
    loss = output.float().pow(2).mean()
    return loss, {"loss": loss.detach()}


def _forward_backward(model, pgc) -> torch.Tensor:
    """The output of one training pass over this rank's batch through megatron's schedule (which
    also scales the router's load-balancing loss)."""
    from megatron_rlhf.models.forward_backward import run_microbatches

    outputs: list[torch.Tensor] = []
    run_microbatches(model, pgc, [_batch(dist.get_rank())],
                     lambda output, _batch: _square_loss(output, outputs), forward_only=False)
    return outputs[0]


def _output_and_grads(ep: int, dispatcher: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from megatron_rlhf.models.weights import gather_full_state

    model, pgc = _build(ep, dispatcher)
    output = _forward_backward(model, pgc)
    grads = gather_full_state(model, pgc, use_grads=True)
    if ep == 1:  # each rank's experts saw only its own tokens
        for name, grad in grads.items():
            if ".local_experts." in name:
                dist.all_reduce(grad)
    return output.detach(), grads


def _expert_token_counts(model) -> list[torch.Tensor]:
    """Tokens each local expert of each MoE layer received in the next forward (via hooks)."""
    counts: list[torch.Tensor] = []
    for layer in model.decoder.layers:
        experts = layer.mlp.experts.local_experts
        layer_counts = torch.zeros(len(experts), dtype=torch.long)
        for index, expert in enumerate(experts):
            def hook(_module, args, _output, index=index, layer_counts=layer_counts):
                layer_counts[index] += args[0].shape[0]
            expert.register_forward_hook(hook)
        counts.append(layer_counts)
    return counts


def _replay_checks() -> dict[str, bool]:
    from megatron_rlhf.models.forward_backward import model_inputs
    from megatron_rlhf.models.moe import moe_routers, recording_routes, replaying_routes

    model, pgc = _build(2, "alltoall")
    inputs = model_inputs(_batch(dist.get_rank()))
    counts = _expert_token_counts(model)
    with torch.no_grad(), recording_routes(model) as routes:
        before = model(*inputs)
    recorded = [c.clone() for c in counts]
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.mul_(-3.0)  # a different choice for most tokens
    for c in counts:
        c.zero_()
    with torch.no_grad(), recording_routes(model) as new_routes:
        model(*inputs)
    rerouted = [c.clone() for c in counts]
    for c in counts:
        c.zero_()
    with replaying_routes(model, routes):
        replayed = _forward_backward(model, pgc)
    router_grads = [router.weight.grad for router in moe_routers(model)]
    return {
        "recorded_routes_differ_after_change": all(
            not torch.equal(a, b) for a, b in zip(routes, new_routes, strict=True)),
        "replay_sends_tokens_to_recorded_experts": all(
            torch.equal(a, b) for a, b in zip(recorded, counts, strict=True)),
        "new_routing_sends_elsewhere": any(
            not torch.equal(a, b) for a, b in zip(recorded, rerouted, strict=True)),
        "replay_output_differs_from_recording": not torch.equal(before, replayed),
        "router_gradient_flows": all(g is not None and g.abs().sum() > 0 for g in router_grads),
    }


def _train_step_ep2() -> float:
    from megatron_rlhf.models.logprobs import vocab_parallel_logprobs
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.models.weights import gather_full_state

    model, pgc = _build(2, "alltoall", packed=True)
    before = gather_full_state(model, pgc)
    trainer = ModelTrainer(model, pgc, OptimizerSettings(lr=1e-2))

    def loss_fn(logits, batch):
        logprobs, _ = vocab_parallel_logprobs(logits[:, :-1], batch["input_ids"][:, 1:], pgc.tp,
                                              ARCH.vocab_size)
        loss = -logprobs.mean()
        return loss, {"loss": loss.detach()}

    trainer.train_step([_batch(dist.get_rank())], loss_fn)
    after = gather_full_state(trainer.model, pgc)
    moved = {name: (after[name] - before[name]).abs().max().item() for name in before}
    still = [name for name, delta in moved.items() if delta == 0.0]
    assert not still, f"parameters the step did not change: {still}"
    return max(moved.values())


def _generation_gap_ep2() -> float:
    """Largest gap between KV-cached sampling's log-probs and a full forward's, at EP 2 with
    continuous batching (every rank decodes the same number of steps: no EOS stop)."""
    from megatron_rlhf.generation.generate import generate_sequences
    from megatron_rlhf.generation.params import GenerationConfig
    from tests.helpers.models import full_forward_logprobs

    model, pgc = _build(2, "alltoall", packed=True)
    config = GenerationConfig(max_new_tokens=5, temperature=1.0, stop_at_eos=False)
    prompts = [[1, 2, 3, 4], [5, 6, 7]] if dist.get_rank() == 0 else [[9, 8, 7, 6, 5], [3]]
    out = generate_sequences(model, pgc, prompts, [0, 1], config, eos_id=0, pad_id=0)
    assert int(out.response_mask.sum()) == 10
    reference = full_forward_logprobs(model, pgc, out, config.temperature)
    return (reference - out.response_logprobs).abs().max().item()


def _moe_job() -> dict:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    reference, reference_grads = _output_and_grads(1, "alltoall")
    results = {}
    for ep, dispatcher in ((2, "alltoall"), (1, "allgather"), (2, "allgather")):
        output, grads = _output_and_grads(ep, dispatcher)
        assert sorted(grads) == sorted(reference_grads)
        results[f"ep{ep}_{dispatcher}"] = (
            (output - reference).abs().max().item(),
            max((grads[n] - reference_grads[n]).abs().max().item() for n in grads))
    results["expert_grads"] = sum(".local_experts." in n for n in reference_grads)
    results["replay"] = _replay_checks()
    results["step_change"] = _train_step_ep2()
    results["generation_gap"] = _generation_gap_ep2()
    return results


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_moe_expert_parallel_matches_and_replays() -> None:
    for result in run_on_ranks(_moe_job, world_size=2, timeout_s=200):
        for key in ("ep2_alltoall", "ep1_allgather", "ep2_allgather"):
            output_diff, grad_diff = result[key]
            assert output_diff < 1e-6, (key, output_diff)
            assert grad_diff < 1e-7, (key, grad_diff)
        assert result["expert_grads"] == 2 * 4 * 2  # layers x experts x (fc1, fc2)
        assert all(result["replay"].values()), result["replay"]
        assert result["step_change"] > 0
        assert result["generation_gap"] < 1e-5


def test_expert_rank_enums_follow_megatrons_expert_grid() -> None:
    # tp 2, dp 4, pp 2, ep 2: dp ranks of (tp 0, pp 0) are 0, 2, 4, 6
    enums = expert_rank_enums(offset=8, tp=2, dp=4, pp=2, ep=2)
    assert enums["ep"][:3] == [[8, 10], [9, 11], [12, 14]]
    assert enums["expt_dp"][:2] == [[8, 12], [9, 13]]
    assert enums["tp_ep"][:2] == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert enums["tp_ep_pp"] == [[8, 9, 10, 11, 16, 17, 18, 19],
                                 [12, 13, 14, 15, 20, 21, 22, 23]]
    for groups in enums.values():  # every rank in exactly one group of each kind
        assert sorted(r for g in groups for r in g) == list(range(8, 24))
    with pytest.raises(ValueError, match=r"ep\(3\) must divide .* dp\(4\)"):
        expert_rank_enums(offset=0, tp=1, dp=4, pp=1, ep=3)


def test_moe_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="moe.topk=5"):
        MoEConfig(num_experts=4, topk=5)
    with pytest.raises(ValueError, match="moe.token_dispatcher='flex'"):
        MoEConfig(num_experts=4, token_dispatcher="flex")
    with pytest.raises(ValueError, match="moe.load_balancing"):
        MoEConfig(num_experts=4, load_balancing="sinkhorn")
    with pytest.raises(ValueError, match="moe.num_experts=-1"):
        MoEConfig(num_experts=-1)
    with pytest.raises(ValueError, match="not divisible by .* ep=3"):
        moe_transformer_fields(MoEConfig(num_experts=4).expert_spec(64), None, ep_size=3,
                               tp_size=1)
    assert moe_transformer_fields(MoEConfig().expert_spec(64), None, ep_size=1, tp_size=1) == {}
    fields = moe_transformer_fields(MoEConfig(num_experts=8, topk=2).expert_spec(64),
                                    MoERouting(aux_loss_coeff=0.5), ep_size=2, tp_size=1)
    assert (fields["num_moe_experts"], fields["moe_ffn_hidden_size"],
            fields["expert_model_parallel_size"], fields["moe_aux_loss_coeff"]) == (8, 64, 2, 0.5)


def test_moe_settings_split_into_the_architectures_experts_and_the_routing() -> None:
    """``models.moe`` gives the experts to the architecture (``ExpertSpec``) and the rest to
    ``MoERouting`` (``ModelBuildOptions.moe``): every setting lands in exactly one of them."""
    from dataclasses import fields

    from megatron_rlhf.topology.models import ExpertSpec

    moe = MoEConfig(num_experts=8, topk=2, ffn_hidden_size=32, shared_expert_ffn_size=16,
                    renormalize_topk=False, load_balancing="seq_aux_loss", aux_loss_coeff=0.5,
                    z_loss_coeff=1e-3, token_dispatcher="allgather", router_replay=False)
    assert moe.routing() == MoERouting(load_balancing="seq_aux_loss", aux_loss_coeff=0.5,
                                       z_loss_coeff=1e-3, token_dispatcher="allgather",
                                       router_replay=False)
    assert moe.expert_spec(64) == ExpertSpec(8, 2, 32, 16, renormalize_topk=False)
    routing = {f.name for f in fields(MoERouting)}
    # ExpertSpec's names, shared_ffn_size spelled as MoEConfig spells it
    experts = {f.name for f in fields(ExpertSpec)} - {"shared_ffn_size"}
    experts.add("shared_expert_ffn_size")
    assert routing.isdisjoint(experts)
    assert {f.name for f in fields(MoEConfig)} == routing | experts
    with pytest.raises(ValueError, match="moe.token_dispatcher='flex'"):
        MoERouting(token_dispatcher="flex")


def _replay_across_layouts() -> dict[str, float]:
    from megatron_rlhf.models.forward_backward import model_inputs, run_microbatches
    from megatron_rlhf.models.moe import (
        ROUTES,
        expert_metrics,
        moe_routers,
        recording_routes,
        replaying_routes,
        routes_to_rows,
        rows_to_routes,
    )
    from megatron_rlhf.models.packing import pack_rows
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    model, pgc = _build(1, "alltoall")
    batch = _batch(0)
    batch["attention_mask"][2, :4] = 0  # a left-padded row too
    # with gradients: megatron computes the routers' losses for training passes only
    with expert_metrics(model, pgc) as metrics, recording_routes(model) as routes:
        model(*model_inputs(batch))
    loads = [torch.bincount(r.flatten(), minlength=4).double() for r in routes]
    expected_load = max((load.max() / load.mean()).item() for load in loads)
    rows = routes_to_rows(routes, tuple(batch["input_ids"].shape))
    scheduled = dict(batch)  # a pass through the schedule records into the micro-batch
    run_microbatches(model, pgc, [scheduled], lambda out, b: _square_loss(out, []),
                     forward_only=True)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.mul_(-3.0)
        with replaying_routes(model, routes):  # the recording's own layout: the reference
            reference = model(*model_inputs(batch))
        rerouted = model(*model_inputs(batch))
    replayed: list[torch.Tensor] = []  # and one that brings the field replays it
    run_microbatches(model, pgc, [scheduled], lambda out, b: _square_loss(out, replayed),
                     forward_only=True)
    mask = batch["attention_mask"].bool()
    gaps = {"max_load": abs(metrics["moe_max_load"] - expected_load),
            "load_balancing_loss": float(metrics["moe_load_balancing_loss"] <= 0),
            "z_loss": float(metrics["moe_z_loss"] <= 0),
            "schedule_recorded": float(not torch.equal(scheduled[ROUTES], rows)),
            "schedule_replayed": (replayed[0] - reference)[mask].abs().max().item()}
    for name, split in (("padded_1_2", ((0, 1), (1, 3))), ("packed_2_1", ((0, 2), (2, 3)))):
        outputs = []
        for start, stop in split:
            part = {key: value[start:stop] for key, value in batch.items()}
            part_rows = rows[start:stop]
            with torch.no_grad():
                if name.startswith("packed"):
                    packed = pack_rows(part["input_ids"], part["attention_mask"], 32)
                    with replaying_routes(model, rows_to_routes(part_rows, packed.index, 32)):
                        output = model(packed.input_ids, packed.position_ids, None,
                                       packed_seq_params=packed.params)
                    outputs.append(packed.unpack(output))
                else:
                    with replaying_routes(model, rows_to_routes(part_rows)):
                        outputs.append(model(*model_inputs(part)))
        gaps[name] = (torch.cat(outputs) - reference)[mask].abs().max().item()
    gaps["without_replay"] = (rerouted - reference)[mask].abs().max().item()
    return gaps


@pytest.mark.multirank
@pytest.mark.timeout(160)
def test_routes_replay_across_micro_batch_and_packing_layouts() -> None:
    gaps = run_on_ranks(_replay_across_layouts, world_size=1, timeout_s=100)[0]
    assert gaps["padded_1_2"] < 1e-5 and gaps["packed_2_1"] < 1e-5, gaps
    assert gaps["schedule_recorded"] == 0.0 and gaps["schedule_replayed"] == 0.0, gaps
    assert gaps["max_load"] < 1e-12 and not gaps["load_balancing_loss"] and not gaps["z_loss"]
    assert gaps["without_replay"] > 1e-2, gaps
