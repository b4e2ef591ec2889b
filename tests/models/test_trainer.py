"""Training steps give the same weights under every TP/PP/DP layout and optimizer sharding.

A global batch of 8 sequences is split over the DP replicas and into micro-batches; with the
per-token loss normalisation the update must not depend on that split.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.model_fixtures import TinyArch, whole_world_groups
from tests.models.batches import GLOBAL_BATCH, global_batch
from tests.multirank import run_on_ranks


def _train(tp: int, pp: int, distributed_optimizer: bool, steps: int = 2):
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.logprobs import vocab_parallel_logprobs
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.models.weights import gather_full_state, init_weights

    pgc = whole_world_groups(tp, pp)
    arch = TinyArch()
    model = build_gpt_model(arch, ModelBuildOptions(), pgc)
    init_weights(model, pgc, seed=5)
    trainer = ModelTrainer(model, pgc, OptimizerSettings(
        lr=1e-2, clip_grad=0.5, distributed_optimizer=distributed_optimizer, lr_warmup_steps=1,
        lr_schedule="cosine", weight_decay=0.01), total_steps=steps)

    def loss_fn(logits, batch):
        logprobs, _ = vocab_parallel_logprobs(
            logits[:, :-1], batch["input_ids"][:, 1:], pgc.tp, arch.vocab_size)
        mask = batch["attention_mask"][:, 1:].float()
        tokens = mask.sum()
        return -(logprobs * mask).sum(), tokens.int(), {"nll_sum": -(logprobs * mask).sum()}

    dp_size, dp_rank = pgc.dp.size(), pgc.dp.rank()
    per_replica = GLOBAL_BATCH // dp_size
    norms = []
    for step in range(steps):
        batch = global_batch(step)
        mine = {k: v[dp_rank * per_replica:(dp_rank + 1) * per_replica] for k, v in batch.items()}
        micro = max(1, per_replica // 2)
        microbatches = [{k: v[i:i + micro] for k, v in mine.items()}
                        for i in range(0, per_replica, micro)]
        out = trainer.train_step(microbatches, loss_fn)
        assert out["update_successful"]
        norms.append(out["grad_norm"])
    return norms, gather_full_state(trainer.model, pgc)


def _compare() -> None:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    ref_norms, ref_weights = _train(1, 1, distributed_optimizer=False)
    for tp, pp, dist_opt in [(1, 1, True), (2, 1, True), (1, 2, False), (2, 2, True)]:
        norms, weights = _train(tp, pp, dist_opt)
        label = f"tp{tp} pp{pp} distopt={dist_opt}"
        assert norms == pytest.approx(ref_norms, rel=1e-4), f"{label}: {norms} vs {ref_norms}"
        for name, tensor in weights.items():
            torch.testing.assert_close(tensor, ref_weights[name], rtol=1e-4, atol=2e-6,
                                       msg=lambda m, n=f"{label} {name}": f"{n}: {m}")
    assert ref_norms[0] > 0.5, "clip at 0.5 must be active for the test to cover clipping"
    assert dist.get_world_size() == 4


@pytest.mark.multirank
@pytest.mark.timeout(360)
def test_update_is_independent_of_layout_and_optimizer_sharding() -> None:
    run_on_ranks(_compare, world_size=4, timeout_s=300)


@pytest.mark.parametrize(("settings", "message"), [
    ({"cpu_offload_fraction": 1.5}, r"optimizer.cpu_offload_fraction=1.5 must be in \[0, 1\]"),
    ({"cpu_offload_fraction": 0.5, "distributed_optimizer": False},
     r"optimizer.cpu_offload_fraction=0.5 needs optimizer.distributed_optimizer=true"),
])
def test_bad_optimizer_cpu_offload_settings_are_refused(settings: dict, message: str) -> None:
    from megatron_rlhf.models.trainer import OptimizerSettings

    with pytest.raises(ValueError, match=message):
        OptimizerSettings(**settings)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_optimizer_cpu_offload_loads_on_the_cpu_but_is_refused_where_a_run_starts() -> None:
    from pathlib import Path

    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.config.supervised_run import SFTConfig

    examples = Path(__file__).resolve().parents[2] / "examples"
    refusal = r"cpu_offload_fraction=0.25 moves optimizer state from a CUDA device to the host"
    config = load_config(RunConfig, examples / "ppo_tiny.yaml",
                         ["critic_optimizer.cpu_offload_fraction=0.25"])  # --plan-only prices it
    with pytest.raises(ValueError, match=rf"critic_optimizer\.{refusal} and needs CUDA"):
        config.check_machine()
    sft = load_config(SFTConfig, examples / "sft_arithmetic.yaml",
                      ["optimizer.cpu_offload_fraction=0.25"])
    with pytest.raises(ValueError, match=rf"optimizer\.{refusal}"):
        sft.check_machine()
