"""Megatron-FSDP training gives the resident run's losses and weights, with sharded state.

Two data-parallel replicas (on 2 gloo ranks, and on 4 with TP=2) train the tiny model for three
steps twice from the same weights: DDP with the distributed optimizer (weights and gradients
resident on every rank), then Megatron-FSDP (``optimizer.fsdp=true``). Both runs reduce the same fp32 gradients in a different order, so the
figures agree to fp32 rounding, not to the bit.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.model_fixtures import TinyArch, whole_world_groups
from tests.models.batches import GLOBAL_BATCH, global_batch
from tests.multirank import run_on_ranks

STEPS = 3
RTOL = 1e-5
"""Losses and gradient norms: relative agreement of the two runs (observed: 3.4e-7; the first
step's are equal to the bit)."""
WEIGHT_ATOL = 1e-5
"""Final weights: absolute agreement (observed: 4.3e-6, where Adam divides a gradient near zero
by its small second moment; one step moves a weight by up to lr = 1e-2)."""


def _trainer(fsdp: bool, tp: int = 1, pp: int = 1, params_dtype: str = "auto"):
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.models.weights import init_weights

    pgc = whole_world_groups(tp, pp)
    model = build_gpt_model(TinyArch(), ModelBuildOptions(params_dtype=params_dtype), pgc)
    init_weights(model, pgc, seed=5)
    settings = OptimizerSettings(lr=1e-2, clip_grad=0.5, weight_decay=0.01, fsdp=fsdp)
    return ModelTrainer(model, pgc, settings, total_steps=STEPS), pgc


def _train(fsdp: bool, tp: int
           ) -> tuple[list[float], list[float], dict[str, torch.Tensor], object]:
    """Per-step loss sums (this rank's micro-batches), gradient norms, final weights, trainer."""
    from megatron_rlhf.models.logprobs import vocab_parallel_logprobs

    trainer, pgc = _trainer(fsdp, tp=tp)
    vocab = trainer.model.real_vocab_size

    def loss_fn(logits, batch):
        logprobs, _ = vocab_parallel_logprobs(logits[:, :-1], batch["input_ids"][:, 1:], pgc.tp,
                                              vocab)
        mask = batch["attention_mask"][:, 1:].float()
        nll = -(logprobs * mask).sum()
        return nll, mask.sum().int(), {"nll_sum": nll.detach()}

    per_replica = GLOBAL_BATCH // pgc.dp.size()
    start = pgc.dp.rank() * per_replica
    losses, norms = [], []
    for step in range(STEPS):
        mine = {k: v[start:start + per_replica] for k, v in global_batch(step).items()}
        microbatches = [{k: v[i:i + 2] for k, v in mine.items()} for i in range(0, per_replica, 2)]
        out = trainer.train_step(microbatches, loss_fn)
        assert out["update_successful"]
        losses.append(float(sum(m["nll_sum"] for m in out["metrics"])))
        norms.append(out["grad_norm"])
    return losses, norms, trainer.full_weights(), trainer


def _fsdp_bytes(trainer) -> dict[str, int]:
    """Bytes of this rank's FSDP weight and gradient buffers."""
    return {"weights": sum(t.nbytes for t in trainer.weight_buffers()),
            "grads": sum(t.nbytes for t in trainer.gradient_buffers())}


def _compare(tp: int) -> dict[str, object]:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    ref_losses, ref_norms, ref_weights, resident = _train(fsdp=False, tp=tp)
    losses, norms, weights, sharded = _train(fsdp=True, tp=tp)
    assert losses == pytest.approx(ref_losses, rel=RTOL), f"{losses} vs {ref_losses}"
    assert norms == pytest.approx(ref_norms, rel=RTOL), f"{norms} vs {ref_norms}"
    assert ref_norms[0] > 0.5, "clip at 0.5 must be active for the test to cover clipping"
    assert weights.keys() == ref_weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, ref_weights[name], rtol=0.0, atol=WEIGHT_ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
    initial, _ = _trainer(fsdp=False, tp=tp)
    assert all(not torch.equal(initial.full_weights()[n], weights[n]) for n in weights), \
        "every weight must have been trained"

    full = sum(t.numel() * t.element_size() for t in ref_weights.values())
    held = _fsdp_bytes(sharded)
    totals = {kind: torch.tensor([n]) for kind, n in held.items()}
    for tensor in totals.values():
        dist.all_reduce(tensor, group=sharded.pg_collection.dp)
    resident_params = sum(t.nbytes for t in resident.weight_buffers())
    assert resident_params >= full, "the resident run holds every weight on every rank"
    return {"losses": losses, "full": full, "held": held,
            "totals": {k: int(v) for k, v in totals.items()}}


@pytest.mark.multirank
@pytest.mark.parametrize(("world_size", "tp"), [(2, 1), (4, 2)])
def test_fsdp_matches_the_resident_run_and_shards_its_state(world_size: int, tp: int) -> None:
    results = run_on_ranks(_compare, world_size=world_size, args=(tp,), timeout_s=240)
    for rank in results:
        full = rank["full"]
        for kind, held in rank["held"].items():
            # A rank holds half of its TP shard's buffers (dp=2), padded to the shard alignment.
            assert 0.45 * full <= held <= 0.55 * full, f"{kind}: {held} of {full} bytes"
            assert rank["totals"][kind] >= full
    assert results[0]["losses"] != results[-1]["losses"], "the replicas trained on different data"


def _bytes_at_rest() -> dict[str, dict[str, int]]:
    """This rank's state bytes per part after a bf16 step and a forward-only pass, DDP with the
    distributed optimizer and Megatron-FSDP; checks that FSDP holds its shards only."""
    from torch.distributed.tensor import DTensor

    from megatron_rlhf.models.forward_backward import run_microbatches
    from megatron_rlhf.models.offload import PARTS, StateOffloader
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    batch = {k: v[:2] for k, v in global_batch(0).items()}

    def loss_fn(logits, _batch):
        return logits.float().mean(), torch.tensor(1), {}

    held = {}
    for name, fsdp in (("ddp", False), ("fsdp", True)):
        trainer, pgc = _trainer(fsdp=fsdp, params_dtype="bfloat16")
        offloader = StateOffloader(trainer.model, trainer)
        trainer.train_step([batch], loss_fn)
        if fsdp:
            assert sum(t.nbytes for t in trainer.gathered_weight_buffers()) > 0, \
                "megatron starts gathering the next forward's layers after a step"
        trainer.release_gathered_weights()
        after_step = {part: offloader.resident_bytes((part,)) for part in PARTS}
        with torch.no_grad():
            run_microbatches(trainer.module, pgc, [batch], loss_fn, forward_only=True)
        trainer.release_gathered_weights()
        assert {part: offloader.resident_bytes((part,)) for part in PARTS} == after_step
        held[name] = after_step
        if not fsdp:
            continue
        shards = sum(t.nbytes for t in trainer.weight_buffers())
        # Adam's moments and step counters, each a DTensor over this rank's unpadded shard.
        adam = sum(value.to_local().nbytes if isinstance(value, DTensor) else value.nbytes
                   for inner in trainer._inner_optimizers()
                   for state in inner.optimizer.state.values() for value in state.values())
        assert all(t.untyped_storage().nbytes() == 0 for t in trainer.gathered_weight_buffers())
        expected = {"weights": shards, "grads": sum(t.nbytes for t in trainer.gradient_buffers()),
                    # the fp32 main-weight shard buffer, twice the bf16 one
                    "optimizer": 2 * shards + adam}
        assert after_step == expected, f"{after_step} != {expected}"
    return held


@pytest.mark.multirank
def test_fsdp_holds_only_its_shards_at_rest() -> None:
    held = run_on_ranks(_bytes_at_rest, world_size=2, timeout_s=240)[0]
    ddp, fsdp = held["ddp"], held["fsdp"]
    # dp=2: half the bf16 weights and fp32 gradients (padding aside); the distributed
    # optimizer already shards the optimizer state.
    assert fsdp["weights"] == pytest.approx(ddp["weights"] / 2, rel=0.01)
    assert fsdp["grads"] == pytest.approx(ddp["grads"] / 2, rel=0.01)
    assert fsdp["optimizer"] == pytest.approx(ddp["optimizer"], rel=0.01)


def _refusals_and_skipped_update() -> None:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    with pytest.raises(ValueError, match=r"optimizer.fsdp=true needs the model on every rank "
                                         r"with pp=1 .* tp=1 pp=2 dp=1 on a world of 2 ranks"):
        _trainer(fsdp=True, pp=2)
    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    current_device, te_linear = torch.cuda.current_device, mcore_fsdp_adapter.TELinear
    trainer, _ = _trainer(fsdp=True)
    # What megatron_fsdp_wrapping changed while the model was wrapped is back.
    assert parallel_state.get_tensor_model_parallel_group(check_initialized=False) is None
    assert parallel_state.get_expert_tensor_parallel_group(check_initialized=False) is None
    assert torch.cuda.current_device is current_device
    assert mcore_fsdp_adapter.TELinear is te_linear
    for call in (lambda: trainer.optimizer_sharded_state_dict({}),
                 lambda: trainer.load_optimizer_state({}), trainer.reload_main_params):
        with pytest.raises(NotImplementedError, match="checkpoints of a Megatron-FSDP model"):
            call()

    # Megatron-FSDP leaves its gradient shards' padding uninitialised: NaN there is no
    # gradient's, and the finiteness check must not see it.
    buffers = trainer.gradient_buffers()
    for buffer in buffers:
        buffer.fill_(math.nan)
    for group in trainer.module.param_and_grad_buffer.parameter_groups:
        grad = group.main_grad_buffer
        for param in grad.params:
            grad.get_item(grad.param_idx[param]).zero_()
    padding = torch.tensor([sum(int(b.isnan().sum()) for b in buffers)])
    dist.all_reduce(padding)
    assert padding.item() > 0, "the shards must have padding"
    assert trainer._gradients_finite()

    # A non-finite gradient on one rank only skips the update on both.
    before = trainer.full_weights()
    batch = {k: v[:2] for k, v in global_batch(0).items()}

    def poisoned(logits, _batch):
        loss = logits.float().sum() * (math.nan if dist.get_rank() == 1 else 1.0)
        return loss, torch.tensor(1), {}

    out = trainer.train_step([batch], poisoned)
    assert not out["update_successful"] and math.isnan(out["grad_norm"])
    after = trainer.full_weights()
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.multirank
def test_fsdp_refuses_pipeline_layouts_and_checkpoints_and_skips_nonfinite_updates() -> None:
    run_on_ranks(_refusals_and_skipped_update, world_size=2, timeout_s=180)


@pytest.mark.parametrize(("settings", "message"), [
    ({"fsdp": True, "distributed_optimizer": False},
     r"optimizer.fsdp=true needs optimizer.distributed_optimizer=true"),
])
def test_bad_fsdp_settings_are_refused(settings: dict, message: str) -> None:
    from megatron_rlhf.models.trainer import OptimizerSettings

    with pytest.raises(ValueError, match=message):
        OptimizerSettings(**settings)


def test_supervised_runs_refuse_fsdp() -> None:
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.supervised_run import RMConfig, SFTConfig

    for schema in (SFTConfig, RMConfig):
        with pytest.raises(ValueError, match=r"optimizer.fsdp=true: a supervised run ends by "
                                             r"saving the model's whole weights"):
            load_config(schema, None, ["optimizer.fsdp=true"])
