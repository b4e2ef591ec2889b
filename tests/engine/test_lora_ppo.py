"""PPO with LoRA on the actor (``models.lora``): the reference is the actor's frozen base.

Two gloo ranks run two PPO steps of the tiny model (the critic trained in full), actor at TP=2
with adapters. The reference
log-probs come from the actor with its adapters off, so the first step's KL is exactly zero
(``B`` starts at zero) and no reference model is placed or built (the actor's ranks score the
answers in its stead); after training, the actor's
base weights still equal a reference model built as the run would have to the bit while its
adapters moved, and its log-probs with the adapters off equal that model's (rounding: the
reference model's weights require gradients, which changes torch's matmul kernel, see
``tests/models/test_lora.py``). A run that also places and builds the reference model, as
before, gives the same metrics to the bit.
Its adapters, exported as a PEFT adapter and given as ``models.lora.init_adapter_dir``, start
another run's actor bit for bit. A run saved after two steps and resumed for a third gives the uninterrupted run's metrics to the
bit: run checkpoints hold the adapters (split as their base layers) and their Adam state. Under
separation the shadows receive only what trains after their first sync, and flattening,
interleaving and separation give the same per-step metrics.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multirank import run_on_ranks


def _config(run_dir: str, *overrides: str):
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    return load_config(RunConfig, Path("examples/ppo_tiny.yaml"), [
        f"run_dir={run_dir}", "steps=2", "placement.strategy=flattening", "placement.tp=2",
        "rollout.prompts_per_step=4", "rollout.num_minibatches=1",
        "rollout.ppo_epochs=1", "generation.max_new_tokens=6", "models.lora.rank=4",
        "models.lora.alpha=8", "actor_optimizer.lr=1e-2", *overrides])


def test_lora_config_refusals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"models\.lora\.roles=\['actor', 'critic'\] names the "
                                         r"critic, but this run has no critic"):
        _config(str(tmp_path), "models.lora.roles=[actor, critic]", "algorithm.advantage_estimator=grpo",
                "rollout.samples_per_prompt=2")
    with pytest.raises(ValueError, match=r"models.transformer_impl=local"):
        _config(str(tmp_path), "models.transformer_impl=transformer_engine")
    with pytest.raises(ValueError, match=r"actor_optimizer.fsdp=true with models.lora"):
        _config(str(tmp_path), "actor_optimizer.fsdp=true",
                "actor_optimizer.distributed_optimizer=true",
                "placement.distributed_optimizer=true")


def _run(root: str) -> dict:
    from megatron_rlhf.engine.run import runner
    from megatron_rlhf.models.lora import adapters_disabled, is_adapter_param
    from megatron_rlhf.topology.models import resolve_arch
    from tests.helpers.metrics import run_metrics
    from tests.helpers.models import full_logits
    from tests.helpers.runs import capture_engine
    from tests.models.batches import global_batch

    captured = capture_engine()
    runner.run_ppo(_config(root, "models.export_hf=true"))
    engine = captured["engine"]
    actor = engine.workers["actor"]
    placed = (engine.plan.roles, sorted(engine.workers), engine.scorer)
    ref = _reference_model(_config(root), engine.plan["actor"].spec.arch, actor)
    actor_state = dict(actor.model.named_parameters())
    ref_state = dict(ref.model.named_parameters())
    base = {n: p for n, p in actor_state.items() if not is_adapter_param(n)}
    assert base.keys() == ref_state.keys()
    assert all(torch.equal(p, ref_state[n]) for n, p in base.items())
    assert all(not p.requires_grad for p in base.values())
    moved = [n for n, p in actor_state.items() if n.endswith("lora_b") and p.abs().sum() > 0]
    batch = {k: v[:4] for k, v in global_batch(0).items()}
    with adapters_disabled(actor.model):
        off = actor.compute_log_prob(batch, 4, 1.0)
    on = actor.compute_log_prob(batch, 4, 1.0)
    whole = {"input_ids": batch["input_ids"], "attention_mask": torch.ones_like(batch["input_ids"])}
    logits = full_logits(actor.model, actor.pg_collection, whole)
    reference = ref.compute_log_prob(batch, 4, 1.0)

    # the trained adapters as a PEFT adapter, then the starting point of another run
    import torch.distributed as dist

    from megatron_rlhf.models.description import ModelDescription
    from megatron_rlhf.models.peft_export import save_peft_adapter
    from megatron_rlhf.models.weights import gather_full_state

    config = _config(root)
    trained = gather_full_state(actor.model, actor.pg_collection)
    if dist.get_rank() == 0:
        save_peft_adapter(f"{root}/adapter", trained,
                          ModelDescription(arch=resolve_arch(config.models.arch)),
                          config.models.lora)
    dist.barrier()
    runner.run_ppo(_config(f"{root}/again", "steps=0", f"models.lora.init_adapter_dir={root}/adapter"))
    again = captured["engine"].workers["actor"]
    started = gather_full_state(again.model, again.pg_collection)
    from megatron_rlhf.engine.execution.throughput import training_forwards

    return {"passes": engine.experience_passes(), "placed": placed, "moved": len(moved),
            "training_forwards": {role: training_forwards(worker.model)
                                  for role, worker in engine.workers.items()},
            "logits": None if logits is None else logits.numpy(),
            "same_start": all(torch.equal(started[k], trained[k]) for k in trained),
            "adapters": sum(1 for n in actor_state if n.endswith("lora_b")),
            "off_vs_ref": (off - reference).abs().max().item(),
            "on_vs_ref": (on - reference).abs().max().item(),
            "metrics": run_metrics(Path(root))}


def _reference_model(config, arch, actor):
    """The reference model the run no longer builds: the role's options, the actor's layout."""
    from dataclasses import replace

    from megatron_rlhf.builder.networks import build_model
    from megatron_rlhf.builder.sources import resolve_sources, role_options
    from megatron_rlhf.engine.execution.workers import ModelWorker

    options = role_options(config, resolve_sources(config), "ref")
    model = build_model(arch, replace(options, recompute=config.models.recompute_of("ref")),
                        actor.pg_collection, runtime_seed=config.runtime.seed,
                        init_seed=config.models.init_seed)
    return ModelWorker("ref", model, actor.pg_collection, None, config.rollout.micro_batch_size)


@pytest.mark.multirank
def test_ppo_with_lora_uses_the_base_as_reference(tmp_path: Path) -> None:
    results = run_on_ranks(_run, world_size=2, args=(str(tmp_path),), timeout_s=240)
    for result in results:
        assert result["placed"] == (("actor", "critic"), ["actor", "critic"], "actor")
        assert ("actor", "ref_logprobs") in result["passes"]
        assert ("actor", "scores") in result["passes"]
        assert result["moved"] == result["adapters"] > 0
        assert result["same_start"]
        # the MFU's FLOPs: the actor trains its adapters on a frozen base, the critic in full
        assert result["training_forwards"] == {"actor": 2, "critic": 3}
        assert result["off_vs_ref"] < 1e-5
        assert result["on_vs_ref"] > 1e-4
    metrics = results[0]["metrics"]
    assert len(metrics) == 2
    # Exact by construction: the old and the reference log-probs are the same actor's forwards
    # of the same rows, its adapters on (B = 0 adds exact zeros) and off, on one kernel path
    # (its base weights are frozen in both).
    assert metrics[0]["kl"] == 0.0

    # the run's export: the actor merged, loaded by transformers, and its PEFT adapter files
    import transformers

    from tests.models.batches import global_batch

    exported = tmp_path / "hf" / "step_00000002"
    assert {p.name for p in (exported / "actor_adapter").iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors"}
    merged = transformers.AutoModelForCausalLM.from_pretrained(exported / "actor",
                                                               dtype=torch.float32)
    with torch.no_grad():
        hf_logits = merged(input_ids=global_batch(0)["input_ids"][:4]).logits
    want = torch.from_numpy(results[0]["logits"])
    torch.testing.assert_close(hf_logits[..., :want.shape[-1]], want, rtol=1e-4, atol=1e-4)


def _resume(root: str) -> tuple[list[dict], list[dict]] | None:
    import torch.distributed as dist

    from megatron_rlhf.engine.run.runner import run_ppo
    from tests.helpers.metrics import run_metrics

    save = [f"checkpoint.save_dir={root}/ckpt", "checkpoint.save_interval=1",
            "checkpoint.async_save=false"]
    run_ppo(_config(f"{root}/A", "steps=3"))
    run_ppo(_config(f"{root}/B", "steps=2", *save))
    run_ppo(_config(f"{root}/B", "steps=3", *save, "checkpoint.resume=latest"))
    if dist.get_rank() != 0:
        return None
    return run_metrics(f"{root}/A"), run_metrics(f"{root}/B")


@pytest.mark.multirank
@pytest.mark.timeout(360)
def test_a_run_with_adapters_resumes_bit_exactly(tmp_path: Path) -> None:
    uninterrupted, resumed = run_on_ranks(_resume, world_size=2, args=(str(tmp_path),),
                                          timeout_s=300)[0]
    assert [m["step"] for m in resumed] == [m["step"] for m in uninterrupted]
    assert resumed == uninterrupted


def _separated(root: str) -> dict:
    from megatron_rlhf.engine.run import runner
    from megatron_rlhf.models.lora import is_adapter_param
    from megatron_rlhf.refit.sync import FirstFullSync
    from tests.helpers.runs import capture_engine

    captured = capture_engine()
    runner.run_ppo(_config(root, "placement.strategy=separation", "placement.tp=1",
                           "models.lora.roles=[actor, critic]"))
    engine = captured["engine"]
    engine.sync_weights()  # the shadows as of the last step
    syncs = [engine.weight_syncs[role] for role in ("actor", "critic")]
    assert all(isinstance(s, FirstFullSync) and s.syncs == 4 for s in syncs)  # built, 2 steps
    actor_names, critic_names = ({t.global_name for t in s.then.plan.transfers} for s in syncs)
    assert actor_names and all(is_adapter_param(name) for name in actor_names)
    # the critic's new value head trains in full, so its later syncs carry it too
    assert {n for n in critic_names if not is_adapter_param(n)} == {"output_layer.weight"}
    sent = (sum(syncs[0].full.plan.remote_elements_sent().values()),
            sum(syncs[0].then.plan.remote_elements_sent().values()))
    # numpy arrays travel by value (torch tensors would by a shared memory the rank takes along)
    return {"sent": sent, **{role: {n: p.detach().numpy().copy()
                                    for n, p in engine.workers[role].model.named_parameters()}
                             for role in ("actor", "shadow_actor", "critic", "shadow_critic")
                             if role in engine.workers}}


@pytest.mark.multirank
def test_a_shadow_keeps_the_adapters_and_receives_only_them(tmp_path: Path) -> None:
    """Under separation the shadow actor and critic carry the same adapters: the first sync
    copies every weight, the later ones the adapters alone (and the critic's value head), and
    each shadow ends equal to its trained model to the bit."""
    from megatron_rlhf.models.lora import is_adapter_param

    results = run_on_ranks(_separated, world_size=2, args=(str(tmp_path),), timeout_s=240)
    for role in ("actor", "critic"):
        trained = next(r[role] for r in results if role in r)
        shadow = next(r[f"shadow_{role}"] for r in results if f"shadow_{role}" in r)
        assert trained.keys() == shadow.keys()
        assert all((trained[n] == shadow[n]).all() for n in trained), role
    critic = next(r["critic"] for r in results if "critic" in r)
    assert any(n.endswith("lora_b") and abs(critic[n]).sum() > 0 for n in critic)
    actor = next(r["actor"] for r in results if "actor" in r)
    assert any(is_adapter_param(n) and n.endswith("lora_b") and abs(actor[n]).sum() > 0
               for n in actor)
    full, adapters = results[0]["sent"]
    adapter_elements = sum(p.size for n, p in actor.items() if is_adapter_param(n))
    assert adapters == adapter_elements < full / 5


PLACEMENTS = ("flattening", "interleaving", "separation")
COMPARED = ("reward_mean", "rule_score", "kl", "policy_loss", "value_loss", "response_length",
            "actor/grad_norm")


def _placing_the_reference(make_plan):
    """``make_plan`` that also places the reference model the run no longer needs, where the
    placement put it before (the engine then builds it, and it scores the answers)."""
    from dataclasses import replace

    from megatron_rlhf.topology.placement import plan_placement

    def planned(config, cluster, sources=None):
        plan = make_plan(config, cluster, sources)  # every model is the tiny one here
        return plan_placement(cluster, replace(plan.config, reference=True),
                              plan["actor"].spec.arch)

    return planned


def _placements(root: str) -> dict | None:
    import torch.distributed as dist

    from megatron_rlhf.engine.run import runner
    from tests.helpers.metrics import run_metrics
    from tests.helpers.runs import capture_engine

    captured = capture_engine()
    for placement in PLACEMENTS:
        runner.run_ppo(_config(f"{root}/{placement}", f"placement.strategy={placement}",
                               "placement.tp=1", "models.lora.roles=[actor, critic]"))
    # as before the reference model was left out: placed on rank 0, built, scoring there
    make_plan, runner.make_plan = runner.make_plan, _placing_the_reference(runner.make_plan)
    try:
        runner.run_ppo(_config(f"{root}/with_ref", "placement.strategy=interleaving",
                               "placement.tp=1", "models.lora.roles=[actor, critic]"))
    finally:
        runner.make_plan = make_plan
    built = sorted(captured["engine"].workers)
    if dist.get_rank() != 0:
        return None
    return {"built": built, "with_ref": run_metrics(f"{root}/with_ref"),
            **{placement: run_metrics(f"{root}/{placement}") for placement in PLACEMENTS}}


@pytest.mark.multirank
def test_adapters_train_the_same_under_every_placement(tmp_path: Path) -> None:
    """Actor and critic with adapters: flattening, interleaving and separation (whose shadows
    receive adapter-only syncs) give the same per-step metrics, and a run that also places and
    builds the reference model (it scores the answers) gives the same metrics to the bit."""
    from tests.helpers.metrics import assert_metrics_match, is_measurement

    runs = run_on_ranks(_placements, world_size=2, args=(str(tmp_path),), timeout_s=240)[0]
    assert runs.pop("built") == ["actor", "critic", "ref"]
    with_ref = runs.pop("with_ref")
    reference = runs["flattening"]
    assert abs(reference[1]["kl"]) > 1e-4, "the policy moved: step 2 must show a KL"
    for placement, steps in runs.items():
        for step, (metrics, want) in enumerate(zip(steps, reference, strict=True)):
            assert_metrics_match(metrics, want, COMPARED, f"{placement} step {step}")
    for got, want in zip(runs["interleaving"], with_ref, strict=True):
        assert ({k: v for k, v in got.items() if not is_measurement(k)}
                == {k: v for k, v in want.items() if not is_measurement(k)})
