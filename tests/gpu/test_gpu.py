"""On one CUDA device (NCCL world of one): models, the PPO data path, SFT/RM and generation.

Skipped without CUDA (``tests/conftest.py``); ``scripts/gpu_check.sh`` runs them. Each test runs
in a spawned process, so a CUDA or NCCL failure cannot take pytest down with it. Under NCCL a
collective refuses a CPU tensor, so a PPO step that completes has handed every collective a
device tensor; the tests add what NCCL does not check: parameters and model inputs on the GPU.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megatron_rlhf.models.gpt import transformer_engine_importable
from tests.helpers.metrics import assert_metrics_match
from tests.multirank import run_on_ranks

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def _misplaced_parameters() -> list[str]:
    import torch

    from megatron_rlhf.models.gpt import HEAD_KINDS, ModelBuildOptions, build_gpt_model
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from tests.model_fixtures import TinyArch, whole_world_groups

    initialize_runtime()
    wrong = []
    for head in HEAD_KINDS:
        model = build_gpt_model(TinyArch(), ModelBuildOptions(head=head), whole_world_groups(1, 1))
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.device.type != "cuda" or (tensor.is_floating_point()
                                                and tensor.dtype != torch.bfloat16):
                wrong.append(f"{head}: {name} {tensor.device} {tensor.dtype}")
        ids = torch.randint(0, 250, (2, 8), device="cuda")
        mask = torch.ones(2, 1, 8, 8, dtype=torch.bool, device="cuda").triu(1)
        output = model(ids, torch.arange(8, device="cuda").expand(2, 8), mask)
        if head != "lm" and output[..., -1].dtype != torch.float32:
            wrong.append(f"{head}: value channel is {output.dtype}, not float32")
    return wrong


def test_every_built_model_lives_on_the_gpu_in_bf16() -> None:
    assert run_on_ranks(_misplaced_parameters, 1, timeout_s=180, backend="nccl") == [[]]


def _ppo_steps(ac_share: bool, params_dtype: str = "auto"
               ) -> tuple[list[dict[str, float]], set[str]]:
    import torch

    from megatron_rlhf.config.ppo_run import ModelsConfig, RewardConfig, RolloutConfig, RunConfig
    from megatron_rlhf.engine.execution import workers
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.topology.cluster import cluster_from_environment
    from megatron_rlhf.topology.placement_config import PlacementConfig

    seen: set[str] = set()
    split = workers.split_microbatches

    def recording_split(fields, micro_batch_size):
        seen.update(f"{name}:{tensor.device.type}" for name, tensor in fields.items())
        return split(fields, micro_batch_size)

    workers.split_microbatches = recording_split
    initialize_runtime()
    config = RunConfig(
        placement=PlacementConfig(strategy="flattening", ac_share=ac_share),
        models=ModelsConfig(arch="tiny", init_seed=9, params_dtype=params_dtype),
        rollout=RolloutConfig(prompts_per_step=16, max_prompt_length=8, micro_batch_size=4,
                              ppo_epochs=2, num_minibatches=2),
        generation=GenerationConfig(max_new_tokens=8, seed=3, micro_batch_size=8),
        reward=RewardConfig(model_weight=0.5, rule="none"), steps=2)
    if params_dtype == "auto":
        assert config.models.params_dtype == "bfloat16", "auto is bf16 on CUDA"
    plan = make_plan(config, cluster_from_environment())
    engine = build_engine(config, plan, eos_id=3, pad_id=0)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 500, (int(n),), generator=generator).tolist()
               for n in torch.randint(2, 9, (32,), generator=generator)]
    algorithm = PPOAlgorithm(engine, config.algorithm, config.rollout, config.reward, seed=5,
                         prompts=lambda s: (prompts[16 * s:16 * s + 16], list(range(16 * s,
                                                                                    16 * s + 16))),
                         total_steps=2)
    metrics = [algorithm.step(step) for step in range(2)]
    return metrics, seen


@pytest.mark.parametrize("ac_share", [False, True], ids=["ac-nonshare", "ac-share"])
@pytest.mark.timeout(360)
def test_bf16_flattening_ppo_steps_keep_every_model_input_on_the_gpu(ac_share: bool) -> None:
    metrics, seen = run_on_ranks(_ppo_steps, 1, args=(ac_share,), timeout_s=300,
                                 backend="nccl")[0]
    assert seen and all(entry.endswith(":cuda") for entry in seen), sorted(seen)
    for step in metrics:
        for key in ("reward_mean", "kl", "policy_loss", "value_loss", "actor/grad_norm"):
            assert math.isfinite(step[key]), (key, step)
    assert metrics[1]["kl"] != 0.0, "the second step samples from an updated policy"


@pytest.mark.timeout(660)
def test_bf16_ppo_step_metrics_track_the_float32_run() -> None:
    """Step 0 in bf16 against the same step with float32 weights: same seeds, so the same
    initial weights up to bf16 rounding and the same sampling draws. Sampled tokens may still
    differ where bf16 moves a token across a sampling boundary, so the comparison is of batch
    means with a tolerance (10%, or 0.05 absolute near 0) far above rounding and far below what
    a wrong cast (a score, value or log-prob read in the wrong dtype or scale) would give.
    Step 1 is not compared: it samples from policies that the two runs updated differently."""
    bf16 = run_on_ranks(_ppo_steps, 1, args=(False,), timeout_s=300, backend="nccl")[0][0]
    fp32 = run_on_ranks(_ppo_steps, 1, args=(False, "float32"), timeout_s=300,
                        backend="nccl")[0][0]
    first, reference = bf16[0], fp32[0]
    assert reference["kl"] == pytest.approx(0.0, abs=1e-6), "step 0: the actor is the reference"
    assert first["kl"] == pytest.approx(0.0, abs=1e-3), first
    assert_metrics_match(first, reference, ("reward_mean", "rm_score", "response_length",
                                            "values_mean", "returns_mean", "value_loss"),
                         "bf16 step 0 vs float32", rel=0.1, abs=0.05)
    # A gradient in the wrong scale is off by a factor; one of other tokens, by far less.
    assert first["actor/grad_norm"] == pytest.approx(reference["actor/grad_norm"], rel=0.5)


def _sft_then_rm(root: str) -> tuple[list[dict], list[dict]]:
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.supervised_run import RMConfig, SFTConfig
    from megatron_rlhf.supervised.reward_model import run_reward_training
    from megatron_rlhf.supervised.sft import run_sft

    small = ["data.synthetic.num_test=32", "train.eval_interval=0"]
    sft = run_sft(load_config(SFTConfig, ROOT / "examples" / "sft_tiny.yaml", [
        f"out_dir={root}/sft", "train.max_steps=20", "optimizer.lr=2.0e-3",
        "optimizer.lr_warmup_steps=0", *small])).history
    rm = run_reward_training(load_config(RMConfig, ROOT / "examples" / "rm_tiny.yaml", [
        f"out_dir={root}/rm", f"model.init_checkpoint={root}/sft/checkpoint",
        "train.max_steps=10", *small])).history
    return sft, rm


@pytest.mark.timeout(360)
def test_sft_and_reward_model_steps_run_in_bf16(tmp_path: Path) -> None:
    sft, rm = run_on_ranks(_sft_then_rm, 1, args=(str(tmp_path),), timeout_s=300,
                           backend="nccl")[0]
    losses = [step["loss"] for step in sft]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
    assert all(math.isfinite(step["loss"]) for step in rm)
    assert math.isfinite(rm[-1]["eval_accuracy"])


def _cached_and_recomputed(params_dtype: str) -> dict[str, float]:
    from megatron_rlhf.generation import GenerationConfig, generate_sequences
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import init_weights
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime
    from tests.generation.helpers import make_prompts
    from tests.model_fixtures import TinyArch, whole_world_groups

    initialize_runtime(RuntimeConfig(allow_tf32=False))
    pgc = whole_world_groups(1, 1)
    model = build_gpt_model(TinyArch(), ModelBuildOptions(params_dtype=params_dtype), pgc)
    init_weights(model, pgc, seed=11)
    prompts = make_prompts([5, 1, 12, 7, 3, 9, 2, 6])
    outputs = {}
    for use_kv_cache in (True, False):
        config = GenerationConfig(max_new_tokens=16, greedy=True, stop_at_eos=False,
                                  use_kv_cache=use_kv_cache)
        outputs[use_kv_cache] = generate_sequences(model, pgc, prompts, list(range(8)), config,
                                                   eos_id=None, pad_id=0)
    cached, recomputed = outputs[True], outputs[False]
    return {"device": cached.input_ids.device.type,
            "token_agreement": (cached.input_ids == recomputed.input_ids).float().mean().item(),
            "logprob_gap": (cached.response_policy_logprobs
                            - recomputed.response_policy_logprobs).abs().max().item()}


def test_generation_with_and_without_kv_cache_agree_on_the_gpu() -> None:
    fp32 = run_on_ranks(_cached_and_recomputed, 1, args=("float32",), timeout_s=180,
                        backend="nccl")[0]
    assert fp32["device"] == "cuda"
    assert fp32["token_agreement"] == 1.0, fp32
    assert fp32["logprob_gap"] < 1e-4, fp32


def _train_memory_options(cpu_offload_fraction: float, recompute: str) -> dict:
    """Four bf16 training steps of the tiny model with one optimizer offload and recompute."""
    import torch

    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.logprobs import vocab_parallel_logprobs
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.models.weights import init_weights
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime
    from tests.model_fixtures import TinyArch, whole_world_groups

    initialize_runtime(RuntimeConfig(allow_tf32=False))
    pgc = whole_world_groups(1, 1)
    arch = TinyArch()
    model = build_gpt_model(arch, ModelBuildOptions(recompute=recompute), pgc)
    init_weights(model, pgc, seed=5)
    trainer = ModelTrainer(model, pgc, OptimizerSettings(
        lr=1e-3, weight_decay=0.01, cpu_offload_fraction=cpu_offload_fraction), total_steps=4)

    def loss_fn(logits, batch):
        logprobs, _ = vocab_parallel_logprobs(
            logits[:, :-1], batch["input_ids"][:, 1:], pgc.tp, arch.vocab_size)
        nll = -logprobs.sum()
        return nll, torch.tensor(logprobs.numel(), dtype=torch.int, device="cuda"), {"nll": nll}

    # One batch, seen every step: the loss must fall.
    ids = torch.randint(0, 250, (4, 16), generator=torch.Generator().manual_seed(3)).cuda()
    losses, norms = [], []
    for _ in range(4):
        out = trainer.train_step([{"input_ids": ids, "attention_mask": torch.ones_like(ids)}],
                                 loss_fn)
        losses.append(out["metrics"][0]["nll"].item() / (4 * 15))
        norms.append(out["grad_norm"])
    inner = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])[0].optimizer
    host_state = sum(t.numel() for state in inner.state.values() for t in state.values()
                     if isinstance(t, torch.Tensor) and t.device.type == "cpu")
    return {"losses": losses, "norms": norms, "optimizer": type(inner).__name__,
            "host_state_numel": host_state}


def _memory_options() -> dict[str, dict]:
    return {f"offload={fraction} recompute={recompute}": _train_memory_options(fraction, recompute)
            for fraction, recompute in [(0.0, "none"), (0.5, "none"), (1.0, "none"),
                                        (0.0, "full")]}


@pytest.mark.skipif(not transformer_engine_importable(),
                    reason="optimizer CPU offload needs Transformer Engine (models/trainer.py)")
@pytest.mark.timeout(360)
def test_optimizer_cpu_offload_and_recompute_train_like_the_plain_optimizer() -> None:
    """megatron's HybridDeviceOptimizer (half and all of the optimizer on the host) and full
    recomputation give the plain run's losses: the first step's exactly (same weights), later ones
    to 1e-2 (the host's torch AdamW and the device's Adam round differently)."""
    runs = run_on_ranks(_memory_options, 1, timeout_s=300, backend="nccl")[0]
    plain = runs.pop("offload=0.0 recompute=none")
    assert plain["host_state_numel"] == 0 and plain["optimizer"] != "HybridDeviceOptimizer"
    assert plain["losses"][-1] < plain["losses"][0], plain
    for label, run in runs.items():
        assert run["losses"][0] == plain["losses"][0], (label, run, plain)
        # CUDA attention backward kernels may accumulate in a varying order.
        assert run["norms"][0] == pytest.approx(plain["norms"][0], rel=1e-4), (label, run, plain)
        assert run["losses"] == pytest.approx(plain["losses"], rel=1e-2), (label, run, plain)
        if label.startswith("offload=0.0"):
            continue
        assert run["optimizer"] == "HybridDeviceOptimizer", label
        assert run["host_state_numel"] > 0, label
