"""Per-stage peak memory: the meter, the engine's metrics against the planner's prediction, and
``models.offload.<role>=auto``.

The engine test runs two PPO steps of a tiny bf16 configuration on 2 gloo ranks (flattening and
separation, every model resident or every model offloaded; separation with ``auto`` under a
budget that only the trainers' rank exceeds; and flattening with actor and critic under
Megatron-FSDP, whose shards and gathered layers the planner predicts) and compares step 1's
``memory/<stage>_peak_bytes`` (the largest over ranks; step 0's early stages run before Adam has
created its moments) with ``engine.run.stage_memory.stage_peaks`` over the planner's per-model bytes.
On the CPU the engine counts tensor bytes: model state and the KV cache. The tolerance,
``REL_TOL``, covers what the two count differently: the planner's parameter count includes
attention biases the model does not have (0.3%), and its KV cache per sequence includes one
row of fp32 logits that the engine does not count (2% of a generating stage when only the
generating model is resident).
"""

from __future__ import annotations

import pytest

from megatron_rlhf.config.ppo_run import ModelsConfig, RolloutConfig, RunConfig
from megatron_rlhf.engine.run.stage_memory import (
    RoleBytes,
    budget_bytes,
    offload_policies,
    stage_peaks,
)
from megatron_rlhf.runtime.memory_meter import MemoryMeter
from megatron_rlhf.runtime.tracing import Span, chrome_trace_events
from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool
from megatron_rlhf.topology.placement_config import PlacementConfig
from tests.multirank import run_on_ranks

REL_TOL = 0.05
ROLES = ("actor", "critic", "ref", "reward")


class _State:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def resident_bytes(self) -> int:
        return self.nbytes


def test_cpu_meter_takes_the_largest_observation_of_each_stage() -> None:
    meter = MemoryMeter(enabled=True, cuda=False)
    state = _State(100)
    meter.track(state)
    with meter.stage("train") as outer:
        with meter.stage("generate") as inner:
            meter.observe(transient=50)
        state.nbytes = 400
        meter.observe()
        state.nbytes = 10
    assert (inner.peak_bytes, outer.peak_bytes) == (150, 400)
    assert meter.take() == {"generate": 150, "train": 400}
    assert meter.take() == {}
    disabled = MemoryMeter()
    with disabled.stage("train") as reading:
        disabled.observe(10)
    assert reading is None and disabled.take() == {}


@pytest.mark.gpu
def test_cuda_meter_reads_the_allocator_per_stage() -> None:
    import torch

    meter = MemoryMeter(enabled=True, cuda=True)
    base = torch.cuda.memory_allocated()
    with meter.stage("train") as outer:
        with meter.stage("generate") as inner:
            small = torch.empty(2**20, dtype=torch.uint8, device="cuda")
            del small
        large = torch.empty(2**22, dtype=torch.uint8, device="cuda")
        del large
    assert base + 2**20 <= inner.peak_bytes < base + 2**22
    assert outer.peak_bytes >= base + 2**22
    assert meter.take() == {"generate": inner.peak_bytes, "train": outer.peak_bytes}


def test_a_span_records_its_peak_on_the_meter_and_the_timeline() -> None:
    from megatron_rlhf.runtime.context import RunContext
    from megatron_rlhf.runtime.tracing import Tracer

    context = RunContext(Tracer(enabled=True), memory=MemoryMeter(enabled=True, cuda=False))
    context.memory.track(_State(100))
    with context.span("generate", "actor", 0):
        context.memory.observe(transient=20)
    assert context.tracer.spans[0].peak_bytes == 120
    assert context.memory.take() == {"generate": 120}
    events = chrome_trace_events([[vars(Span("train", "actor", 0, 1.0, 2.0, peak_bytes=7)),
                                   vars(Span("sync_weights", "", -1, 2.0, 3.0))]])
    args = [event["args"] for event in events if event["ph"] == "X"]
    assert args[0]["peak_bytes"] == 7 and "peak_bytes" not in args[1]


def _plan(strategy: str, ranks: int, **models):
    from megatron_rlhf.engine.run.build import make_plan

    config = RunConfig(placement=PlacementConfig(strategy=strategy),
                       models=ModelsConfig(arch="tiny", params_dtype="bfloat16", **models),
                       rollout=RolloutConfig(prompts_per_step=4, max_prompt_length=8,
                                             micro_batch_size=2))
    cluster = ClusterSpec((DevicePool("local", 1, ranks, memory_gib=1.0),))
    return config, make_plan(config, cluster)


def test_offloaded_models_bring_back_only_what_their_stage_needs() -> None:
    _, plan = _plan("separation", 2)
    roles = {"actor": RoleBytes(1, 2, 4), "critic": RoleBytes(8, 16, 32),
             "shadow_actor": RoleBytes(64, kv_cache=128), "shadow_critic": RoleBytes(256),
             "ref": RoleBytes(512), "reward": RoleBytes(1024)}
    resident = stage_peaks(plan, roles, ())
    assert resident[0] == {"train": 63, "sync_weights": 63}
    assert resident[1] == {"generate": 1984, "experience": 1856, "sync_weights": 1856}
    offloaded = stage_peaks(plan, roles, set(roles))
    assert offloaded[0] == {"train": 56, "sync_weights": 8}
    assert offloaded[1] == {"generate": 192, "experience": 1024, "sync_weights": 256}


def test_auto_offloads_only_the_models_of_ranks_over_the_budget() -> None:
    # Separation: the trainers' rank holds ~6.5 MB resident, the inference rank ~1.6 MB.
    config, plan = _plan("separation", 2, offload=dict.fromkeys(ROLES, "auto"),
                         memory_budget_gib=4e6 / 2**30)
    assert offload_policies(config, plan) == {
        "actor": "always", "critic": "always", "ref": "never", "reward": "never",
        "shadow_actor": "never", "shadow_critic": "never"}
    config, plan = _plan("separation", 2, offload={"ref": "always", "actor": "auto"})
    assert budget_bytes(config, plan, 0) == 2**30  # the pool's memory_gib
    assert offload_policies(config, plan)["actor"] == "never"
    assert offload_policies(config, plan)["ref"] == "always"


@pytest.mark.parametrize(("models", "message"), [
    ({"offload": {"actor": "sometimes"}}, r"models.offload.actor='sometimes': use one of"),
    ({"offload": {"actor": "auto"}, "memory_budget_gib": -1}, r"memory_budget_gib=-1 must be"),
    ({"memory_budget_gib": 8}, r"memory_budget_gib=8 is used only by models.offload"),
])
def test_bad_offload_settings_are_refused(models: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelsConfig(**models)


def _measure(strategy: str, offload: str, budget_gib: float = 0.0, generation_micro_batch: int = 0,
             fsdp: bool = False) -> tuple[dict[str, float], dict[int, dict]]:
    """Step 1's memory metrics and the prediction for the same configuration (actor and critic
    under Megatron-FSDP with ``fsdp``)."""
    from megatron_rlhf.config.ppo_run import RewardConfig
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.engine.run.stage_memory import planner_role_bytes
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.models.trainer import OptimizerSettings
    from megatron_rlhf.runtime.context import RunContext
    from megatron_rlhf.topology.cluster import cluster_from_environment

    config = RunConfig(
        placement=PlacementConfig(strategy=strategy),
        models=ModelsConfig(arch="tiny", init_seed=9, params_dtype="bfloat16",
                            offload=dict.fromkeys(ROLES, offload),
                            memory_budget_gib=budget_gib),
        rollout=RolloutConfig(prompts_per_step=4, max_prompt_length=8, micro_batch_size=2),
        # Full-length prompts and responses: the KV cache is as long as the planner's.
        generation=GenerationConfig(max_new_tokens=6, seed=3, stop_at_eos=False,
                                    micro_batch_size=generation_micro_batch),
        reward=RewardConfig(model_weight=0.5, rule="none", rule_weight=1.0), steps=2,
        actor_optimizer=OptimizerSettings(fsdp=fsdp), critic_optimizer=OptimizerSettings(fsdp=fsdp))
    plan = make_plan(config, cluster_from_environment(None))
    context = RunContext(memory=MemoryMeter(enabled=True))
    engine = build_engine(config, plan, eos_id=3, pad_id=0, context=context)
    prompts = [[5 + i] * 8 for i in range(8)]
    algorithm = PPOAlgorithm(engine, config.algorithm, config.rollout, config.reward, seed=5,
                             prompts=lambda s: (prompts[4 * s:4 * s + 4], list(range(4 * s,
                                                                                    4 * s + 4))),
                             total_steps=2)
    metrics = [algorithm.step(step) for step in range(2)][1]
    offloaded = {role for role, policy in offload_policies(config, plan).items()
                 if policy == "always"}
    predicted = stage_peaks(plan, planner_role_bytes(plan, config), offloaded)
    return {k: v for k, v in metrics.items() if k.startswith("memory/")}, predicted


def _measure_all() -> dict:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    results = {(strategy, offload): _measure(strategy, offload)
               for strategy in ("flattening", "separation") for offload in ("never", "always")}
    # The trainers' rank is over 4 MB resident, the inference rank under: only actor and critic
    # are offloaded.
    results["separation", "auto"] = _measure("separation", "auto", 4e6 / 2**30)
    # One row per generation round instead of each replica's two: half the KV cache.
    results["flattening", "never, generation micro-batch 1"] = _measure(
        "flattening", "never", generation_micro_batch=1)
    # Actor and critic under Megatron-FSDP: sharded state, plus the layers it gathers.
    results["flattening", "never, fsdp"] = _measure("flattening", "never", fsdp=True)
    return results


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_recorded_stage_peaks_agree_with_the_planner() -> None:
    per_rank = run_on_ranks(_measure_all, world_size=2, timeout_s=540)
    assert per_rank[0] == per_rank[1], "memory metrics are the same on every rank"
    for (strategy, offload), (measured, predicted) in per_rank[0].items():
        stages = {stage for peaks in predicted.values() for stage in peaks}
        for stage in stages:
            expected = max(peaks.get(stage, 0.0) for peaks in predicted.values())
            got = measured[f"memory/{stage}_peak_bytes"]
            assert got == pytest.approx(expected, rel=REL_TOL), (
                f"{strategy} offload={offload} {stage}: recorded {got:.0f} bytes, "
                f"planned {expected:.0f}")
    for strategy in ("flattening", "separation"):
        resident, offloaded = (per_rank[0][strategy, o][0] for o in ("never", "always"))
        assert offloaded and offloaded.keys() == resident.keys(), strategy
        assert all(offloaded[key] < resident[key] for key in offloaded)
    resident, auto = per_rank[0]["separation", "never"][0], per_rank[0]["separation", "auto"][0]
    assert auto["memory/train_peak_bytes"] < resident["memory/train_peak_bytes"]
    assert auto["memory/generate_peak_bytes"] == resident["memory/generate_peak_bytes"]
    # Between stages an FSDP model holds its shards only: the rank's state at rest is smaller.
    fsdp = per_rank[0]["flattening", "never, fsdp"][0]
    resident = per_rank[0]["flattening", "never"][0]
    assert fsdp["memory/advantages_peak_bytes"] < 0.85 * resident["memory/advantages_peak_bytes"]
    whole = per_rank[0]["flattening", "never"][0]["memory/generate_peak_bytes"]
    bounded = per_rank[0]["flattening", "never, generation micro-batch 1"][0]
    assert bounded["memory/generate_peak_bytes"] < whole
