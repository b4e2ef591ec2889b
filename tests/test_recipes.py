"""The production recipes (examples/recipes/) are real models that fit their GPUs, and the
planner's figures in their headers are what ``run_ppo.py --plan-only`` prints now."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rlhf.builder.sources import arch_spec, config_arch
from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.run.micro_batching import planner_rollout
from megatron_rlhf.engine.run.plan_only import plan_cluster, plan_run, run_memory_options
from megatron_rlhf.topology.models import resolve_arch
from tests.scripts import REPO, load_script

RECIPES = REPO / "examples" / "recipes"
RUN_PPO = load_script("tools/run_ppo.py")

PUBLIC_PARAMETERS = {"qwen2.5-7b-grpo-math-1x8.yaml": 7_615_616_512,
                     "llama3.1-8b-ppo-async-16x8.yaml": 8_030_261_248,
                     "llama3.1-8b-grpo-lora-1x8.yaml": 8_030_261_248,
                     "llama3.1-70b-ppo-offload-16x8.yaml": 70_553_706_496,
                     "qwen3-30b-a3b-grpo-16x8.yaml": 30_532_122_624}
"""Each recipe's model's parameter count as its model card (safetensors index) gives it."""

HEADER_COMMAND = re.compile(r"^#   (python tools/run_ppo\.py .*--plan-only.*)$")


def test_every_recipe_is_listed() -> None:
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == sorted(PUBLIC_PARAMETERS)


@pytest.mark.parametrize("name", sorted(PUBLIC_PARAMETERS))
def test_recipe_is_the_real_model_on_its_own(name: str) -> None:
    text = (RECIPES / name).read_text()
    assert not re.search(r"^base:", text, re.MULTILINE), "a recipe is complete, not a toy's child"
    config = load_config(RunConfig, RECIPES / name)
    # The planner's count has Megatron's 4h attention biases per layer that these models lack
    # (Qwen2.5 has a QKV bias instead): well under 0.01% of the parameters.
    assert config_arch(config).num_params() == pytest.approx(PUBLIC_PARAMETERS[name], rel=1e-4)
    assert config.models.params_dtype == "bfloat16"
    assert config.models.actor_checkpoint.startswith("/path/to/")


def _plan_only(capsys: pytest.CaptureFixture, argv: list[str]) -> tuple[int, str]:
    status = RUN_PPO.main(argv)
    return status, capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(PUBLIC_PARAMETERS))
def test_recipe_fits_its_gpus(name: str, capsys: pytest.CaptureFixture) -> None:
    status, out = _plan_only(capsys, ["--config", str(RECIPES / name), "--plan-only", "--json"])
    assert status == 0
    lines = out.splitlines()
    assert len(lines) == 1, "--json prints one line"
    result = json.loads(lines[0])
    assert result["fits"] and result["architecture"].startswith("models.arch")
    prediction = result["prediction"]
    assert prediction["peak_gib_per_device"] <= prediction["usable_gib_per_device"]
    assert prediction["step_seconds"] > 0
    plan = result["plan"]
    placed = {rank for groups in result["groups"].values() for group in groups["tp"]
              for rank in group}
    assert placed == set(range(plan["world_size"])), "every GPU holds a model"
    for role, groups in result["groups"].items():
        model = plan["models"][role]
        assert len(groups["tp"]) * model["tp"] == model["size"]
        assert len(groups["dp"]) * model["dp"] == model["size"]


def _header_pairs(path: Path) -> list[tuple[str, str]]:
    """(command, the line it printed) for every --plan-only command a recipe's header quotes."""
    lines = path.read_text().splitlines()
    pairs = []
    for index, line in enumerate(lines):
        match = HEADER_COMMAND.match(line)
        if match:
            pairs.append((match.group(1), lines[index + 1].removeprefix("#   ")))
    return pairs


@pytest.mark.parametrize("name", sorted(PUBLIC_PARAMETERS))
def test_recipe_header_is_what_plan_only_prints_now(name: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    pairs = _header_pairs(RECIPES / name)
    assert pairs, f"{name} quotes no --plan-only command in its header"
    for command, quoted in pairs:
        argv = shlex.split(command)[2:]
        assert argv[argv.index("--config") + 1] == f"examples/recipes/{name}"
        argv[argv.index("--config") + 1] = str(RECIPES / name)
        status, out = _plan_only(capsys, argv)
        assert status == 0
        assert out.splitlines()[-1] == quoted, (
            f"{name}'s header is stale; run `{command}` and copy its last line")
        assert re.fullmatch(r"predicted on \d+x\d+ \S+: peak [\d.]+ GiB per GPU of [\d.]+ "
                            r"usable, [\d.]+ s per step \([\d.]+ samples/s\)", quoted)


def test_rope_theta_reaches_a_model_built_from_models_arch() -> None:
    config = load_config(RunConfig, RECIPES / "qwen2.5-7b-grpo-math-1x8.yaml")
    # Without a checkpoint to take it from, the model is built from the arch (its RoPE theta
    # reaching the network: tests/models/test_arch_record.py).
    assert config_arch(config).rotary_base == 1_000_000
    tiny = load_config(RunConfig, REPO / "examples" / "ppo_tiny.yaml")
    assert config_arch(tiny).rotary_base == 10_000, "the presets keep the default"
    fields = dict(config.models.arch)
    with pytest.raises(ValueError, match=r"rotary_base=0 must be an integer >= 1"):
        resolve_arch({**fields, "rotary_base": 0})


def test_llama8b_recipe_is_the_asynchronous_separation() -> None:
    config = load_config(RunConfig, RECIPES / "llama3.1-8b-ppo-async-16x8.yaml")
    assert (config.placement.strategy, config.placement.tp) == ("separation", 8)
    assert config.rollout.async_rollout and config.rollout.max_tokens_per_micro_batch == 8192
    assert config.models.packed_sequences and config.models.sequence_parallel
    assert config.reward.model_weight == 1.0 and config.models.reward_checkpoint
    plan = plan_run(config, plan_cluster(config)).plan
    assert plan["shadow_actor"].tp == 8 and (plan["actor"].tp, plan["critic"].tp) == (4, 4)
    assert plan["actor"].size == plan["shadow_actor"].size == 64, "half the GPUs train"


QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16"}
"""Qwen/Qwen3-30B-A3B's config.json (its architecture fields)."""


def test_qwen3_moe_recipe_is_the_checkpoints_architecture(tmp_path: Path) -> None:
    from transformers import Qwen3MoeConfig

    from megatron_rlhf.models.hf_config import read_hf_config

    # transformers reads the card's config.json as the model it builds (its own defaults are
    # a smaller 24-layer model)
    hf = Qwen3MoeConfig(**{k: v for k, v in QWEN3_30B_A3B_CONFIG.items()
                           if k not in ("architectures", "model_type", "torch_dtype")})
    assert (hf.num_hidden_layers, hf.head_dim, hf.num_experts, hf.num_experts_per_tok) == (
        48, 128, 128, 8)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG))
    description, _ = read_hf_config(tmp_path)
    config = load_config(RunConfig, RECIPES / "qwen3-30b-a3b-grpo-16x8.yaml")
    recipe = config_arch(config)
    checkpoint = arch_spec(description, recipe.name)
    assert checkpoint == recipe
    assert description.moe.renormalize_topk == config.models.moe.renormalize_topk
    assert recipe.num_params(active=True) == pytest.approx(3.35e9, rel=0.01), "A3B"
    run_plan = plan_run(config, plan_cluster(config))
    for role in ("actor", "ref"):
        assert run_plan.plan[role].spec.ep == 8 and run_plan.plan[role].tp == 1
        # the experts' all-to-alls stay on one node: 8 consecutive ranks
        groups = run_plan.groups()[role]["ep"]
        assert len(groups) == 16 and all(g == list(range(g[0], g[0] + 8)) for g in groups)


def test_auto_places_the_moe_recipe_with_experts_split_and_prices_it_as_plan_only() -> None:
    """Qwen3-30B-A3B on 16 x 8 under ``--placement auto``: routing replay refuses TP with
    sequence parallelism, and at TP 1 every expert on every GPU fits only fully sharded, at
    under half the speed, so an expert-parallel layout wins; the search prices it as
    ``--plan-only`` prices that placement (the micro-batches of the run's token budgets there)."""
    from megatron_rlhf.engine.run.auto_placement import ranked_candidates

    config = load_config(RunConfig, RECIPES / "qwen3-30b-a3b-grpo-16x8.yaml")
    cluster = plan_cluster(config)
    auto = plan_run(config, cluster, auto=True)
    assert auto.fits and auto.plan["actor"].tp == 1
    ep = auto.plan["actor"].spec.ep
    assert ep > 1 and auto.plan["ref"].spec.ep == ep and f"ep={ep} wins" in auto.chosen
    ranked = ranked_candidates(config, cluster, None)
    winner = next(c for c in ranked if c.config.to_dict() == auto.config.placement.to_dict())
    assert winner.prediction.samples_per_s == pytest.approx(auto.prediction.samples_per_s,
                                                            rel=1e-9)
    unsplit = [c for c in ranked if c.prediction.feasible
               and c.plan["actor"].tp == 1 and c.plan["actor"].spec.ep == 1]
    assert unsplit and all(c.prediction.memory.options["actor"].sharding == "fsdp"
                           for c in unsplit), "whole experts fit only fully sharded"
    assert max(c.prediction.samples_per_s for c in unsplit) < 0.6 * auto.prediction.samples_per_s
    fixed = plan_run(config, cluster)  # the recipe's own ep 8
    assert auto.prediction.samples_per_s >= fixed.prediction.samples_per_s


def test_oversized_plan_is_refused() -> None:
    """The Qwen recipe on 32 GB GPUs: the actor's states alone do not fit."""
    config = load_config(RunConfig, RECIPES / "qwen2.5-7b-grpo-math-1x8.yaml")
    # At TP 2 x DP 4: bf16 weights and fp32 gradients per parameter shard, Adam's 12 bytes
    # sharded over DP by the distributed optimizer.
    shard = resolve_arch(config.models.arch).num_params(tp=2) / 2
    states_gib = shard * (2 + 4 + 12 / 4) / 2**30
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "run_ppo.py"), "--config",
         str(RECIPES / "qwen2.5-7b-grpo-math-1x8.yaml"), "--plan-only", "--gpu", "V100-32GB"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2
    refusal = result.stderr.strip().splitlines()[-1]
    assert refusal.startswith("run_ppo: predicted on 1x8 V100-32GB: does not fit in memory: ")
    assert (f"actor on ranks [0, 8): its states need {states_gib:.1f} GiB" in refusal
            and "raise actor.tp or actor.pp" in refusal)


def test_refusal_is_the_planner_problem_and_a_larger_gpu_fits() -> None:
    config = load_config(RunConfig, RECIPES / "qwen2.5-7b-grpo-math-1x8.yaml")
    small = plan_run(config, plan_cluster(config, gpu="V100-32GB"))
    large = plan_run(config, plan_cluster(config, gpu="H200-141GB"))
    assert not small.fits and small.prediction.problems
    assert large.fits and large.prediction.memory.usable_gib > 120


def test_plan_cluster_from_flags_and_refusals() -> None:
    config = load_config(RunConfig, REPO / "examples" / "ppo_tiny.yaml")
    with pytest.raises(ValueError, match=r"set cluster.pools in the config, or give --nodes"):
        plan_cluster(config)
    cluster = plan_cluster(config, nodes=16, gpus_per_node=8, gpu="H100-80GB")
    pool = cluster.pools[0]
    assert (cluster.world_size, pool.kind, pool.memory_gib) == (128, "H100-80GB", 80.0)
    with pytest.raises(ValueError, match=r"--gpu 'B300' is not a shipped profile"):
        plan_cluster(config, nodes=1, gpus_per_node=8, gpu="B300")
    recipe = load_config(RunConfig, RECIPES / "llama3.1-8b-ppo-async-16x8.yaml")
    assert plan_cluster(recipe, nodes=2).world_size == 16, "--nodes reshapes the recipe's pool"


def test_memory_options_and_rows_are_the_configured_ones() -> None:
    config = load_config(RunConfig, RECIPES / "llama3.1-70b-ppo-offload-16x8.yaml")
    run_plan = plan_run(config, plan_cluster(config))
    options = run_memory_options(config, run_plan.plan)
    assert options == run_plan.prediction.memory.options
    assert {role for role, o in options.items() if o.offload} == {"ref", "reward"}
    assert {role for role, o in options.items() if o.recompute} == {"actor", "critic"}
    # 8192 tokens per micro-batch over 1024 + 1024-token sequences: 4 rows.
    assert planner_rollout(config).micro_batch_size == 8192 // 2048
    without = load_config(RunConfig, RECIPES / "llama3.1-70b-ppo-offload-16x8.yaml",
                          ["models.offload.ref=never", "models.offload.reward=never"])
    resident = plan_run(without, plan_cluster(without))
    assert not any(o.offload for o in resident.prediction.memory.options.values())
    # Offloaded between their forward passes, ref and reward leave the shadow actor, which
    # shares their GPUs, room for more sequences per generation round.
    rounds = [p.prediction.memory.sequences_per_round["shadow_actor"]
              for p in (resident, run_plan)]
    assert rounds[0] < rounds[1]


def test_plan_only_flags_need_plan_only(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        RUN_PPO.parse_args(["--nodes", "2"])
    assert "--nodes is a --plan-only flag" in capsys.readouterr().err


def test_existing_checkpoints_give_the_architecture(tmp_path: Path) -> None:
    """With every checkpoint there, the plan is of the checkpoints' models, as the run's is."""
    from tools.make_tiny_hf import TINY_QWEN, make_tiny_qwen_pair

    actor, reward, _ = make_tiny_qwen_pair(tmp_path)
    config = load_config(RunConfig, REPO / "examples" / "ppo_tiny.yaml", [
        f"models.actor_checkpoint={actor}", f"models.reward_checkpoint={reward}",
        "models.arch=llama-7b", "reward.model_weight=1.0"])
    run_plan = plan_run(config, plan_cluster(config, nodes=1, gpus_per_node=4, gpu="H100-80GB"))
    assert run_plan.architecture.startswith("the checkpoints' configs: ")
    assert run_plan.fits
    for role in run_plan.plan.roles:
        arch = run_plan.plan[role].spec.arch
        assert (arch.num_layers, arch.hidden_size, arch.vocab_size) == (
            TINY_QWEN["num_hidden_layers"], TINY_QWEN["hidden_size"], TINY_QWEN["vocab_size"])
    missing = load_config(RunConfig, REPO / "examples" / "ppo_tiny.yaml", [
        f"models.actor_checkpoint={actor}", f"models.reward_checkpoint={tmp_path / 'none'}",
        "reward.model_weight=1.0"])
    assert plan_run(missing, plan_cluster(missing, nodes=1, gpus_per_node=4)).architecture == (
        f"models.arch (tiny); checkpoints not found, so not read: {tmp_path / 'none'}")


def test_the_lora_recipe_trains_adapters_alone_and_places_no_reference_model(
        capsys: pytest.CaptureFixture) -> None:
    name = "llama3.1-8b-grpo-lora-1x8.yaml"
    config = load_config(RunConfig, RECIPES / name)
    assert config.models.lora.applies_to("actor") and not config.placement.reference
    status, out = _plan_only(capsys, ["--config", str(RECIPES / name), "--plan-only", "--json"])
    assert status == 0
    result = json.loads(out)
    actor = result["plan"]["models"]["actor"]
    assert set(result["plan"]["models"]) == {"actor"}
    # 32 layers x rank 16 x (qkv 4096 + 6144, proj 4096 + 4096, fc1 4096 + 28672, fc2 14336 + 4096)
    assert actor["adapter_params"] == 32 * 16 * (10240 + 8192 + 32768 + 18432)
