"""Megatron-FSDP training gives the resident run's losses and weights, with sharded state.

Two data-parallel replicas (on 2 gloo ranks, and on 4 with TP=2) train the tiny model for three
steps twice from the same weights: DDP with the distributed optimizer (weights and gradients
resident on every rank), then Megatron-FSDP (``optimizer.fsdp=true``). Both runs reduce the same fp32 gradients in a different order, so the
figures agree to fp32 rounding, not to the bit.

A Megatron-FSDP checkpoint (``models.fsdp_checkpoint``: the DTensor shards of the weights and Adam
state through torch.distributed.checkpoint) saved after one step and loaded into a model
initialised otherwise continues with the same losses, gradient norms and weights, to the bit; it
loads whole on 1 rank and on 4, where the next step agrees with the 2-rank run to fp32 rounding.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.model_fixtures import TinyArch, whole_world_groups
from tests.models.batches import GLOBAL_BATCH, global_batch, nll_loss_fn
from tests.multirank import run_on_ranks

STEPS = 3
RTOL = 1e-5
"""Losses and gradient norms: relative agreement of the two runs (observed: 3.4e-7; the first
step's are equal to the bit)."""
WEIGHT_ATOL = 1e-5
"""Final weights: absolute agreement (observed: 4.3e-6, where Adam divides a gradient near zero
by its small second moment; one step moves a weight by up to lr = 1e-2)."""


def _trainer(fsdp: bool, tp: int = 1, pp: int = 1, params_dtype: str = "auto", seed: int = 5):
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.models.weights import init_weights

    pgc = whole_world_groups(tp, pp)
    model = build_gpt_model(TinyArch(), ModelBuildOptions(params_dtype=params_dtype), pgc)
    init_weights(model, pgc, seed=seed)
    settings = OptimizerSettings(lr=1e-2, clip_grad=0.5, weight_decay=0.01, fsdp=fsdp)
    return ModelTrainer(model, pgc, settings, total_steps=STEPS), pgc


def _train(fsdp: bool, tp: int
           ) -> tuple[list[float], list[float], dict[str, torch.Tensor], object]:
    """Per-step loss sums (this rank's micro-batches), gradient norms, final weights, trainer."""
    trainer, _ = _trainer(fsdp, tp=tp)
    losses, norms = _steps(trainer, range(STEPS))
    return losses, norms, trainer.full_weights(), trainer


def _steps(trainer, steps) -> tuple[list[float], list[float]]:
    """Train on the global batches of ``steps``, this DP rank's share of each."""
    pgc = trainer.pg_collection
    loss_fn = nll_loss_fn(pgc, trainer.model.real_vocab_size)
    per_replica = GLOBAL_BATCH // pgc.dp.size()
    start = pgc.dp.rank() * per_replica
    losses, norms = [], []
    for step in steps:
        mine = {k: v[start:start + per_replica] for k, v in global_batch(step).items()}
        microbatches = [{k: v[i:i + 2] for k, v in mine.items()} for i in range(0, per_replica, 2)]
        out = trainer.train_step(microbatches, loss_fn)
        assert out["update_successful"]
        losses.append(float(sum(m["nll_sum"] for m in out["metrics"])))
        norms.append(out["grad_norm"])
    return losses, norms


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


def _checkpoint_info(trainer):
    from megatron_rlhf.models.checkpoint import CheckpointInfo, ModelDescription

    pgc = trainer.pg_collection
    return CheckpointInfo(ModelDescription.from_model(trainer.model), pgc.tp.size(),
                          pgc.pp.size(), {"role": "actor"})


def _save_and_resume(root: str) -> dict[str, bool]:
    """Save after step 0, train steps 1-2; load into a model initialised otherwise, train the
    same steps; and once more loading the weights without the Adam state."""
    from megatron_rlhf.models.fsdp_checkpoint import load_fsdp_checkpoint, write_fsdp_checkpoint
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    ckpt = Path(root) / "ckpt"
    trainer, _ = _trainer(fsdp=True)
    _steps(trainer, [0])
    info = write_fsdp_checkpoint(trainer.fsdp_state(), ckpt, _checkpoint_info(trainer))
    saved, schedule = trainer.full_weights(), trainer.state_dict()
    losses, norms = _steps(trainer, [1])
    after_one = trainer.full_weights()
    more_losses, more_norms = _steps(trainer, [2])
    want = trainer.full_weights()
    if dist.get_rank() == 0:
        torch.save({"saved": saved, "schedule": schedule, "norm": norms[0],
                    "after_one": after_one}, Path(root) / "two_ranks.pt")

    resumed, _ = _trainer(fsdp=True, seed=6)
    resumed.load_fsdp_state(lambda state: load_fsdp_checkpoint(state, ckpt))
    resumed.load_state_dict(schedule)
    loaded = resumed.full_weights()
    got_losses, got_norms = _steps(resumed, [1, 2])

    weights_only, _ = _trainer(fsdp=True, seed=6)
    weights_only.load_fsdp_state(lambda state: load_fsdp_checkpoint(state, ckpt),
                                 with_optimizer=False)
    weights_only.load_state_dict(schedule)
    _steps(weights_only, [1, 2])
    return {
        "marked": info.metadata == {"role": "actor", "fsdp": True} and bool(info.files),
        "loaded_equal": all(torch.equal(loaded[n], saved[n]) for n in saved),
        "metrics_equal": (got_losses, got_norms) == (losses + more_losses, norms + more_norms),
        "weights_equal": all(torch.equal(resumed.full_weights()[n], want[n]) for n in want),
        "without_adam_equal": all(torch.equal(weights_only.full_weights()[n], want[n])
                                  for n in want),
    }


def _load_at_another_dp_size(root: str) -> dict[str, object]:
    """Load the 2-rank checkpoint on this job's ranks (DCP reshards) and train step 1."""
    from megatron_rlhf.models.fsdp_checkpoint import load_fsdp_checkpoint
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    two = torch.load(Path(root) / "two_ranks.pt", weights_only=True)
    trainer, _ = _trainer(fsdp=True, seed=6)
    trainer.load_fsdp_state(lambda state: load_fsdp_checkpoint(state, Path(root) / "ckpt"))
    trainer.load_state_dict(two["schedule"])
    loaded = trainer.full_weights()
    _, norms = _steps(trainer, [1])
    after = trainer.full_weights()
    return {"loaded_equal": all(torch.equal(loaded[n], two["saved"][n]) for n in loaded),
            "norms": (norms[0], two["norm"]),
            "max_diff": max(float((after[n] - two["after_one"][n]).abs().max()) for n in after)}


@pytest.mark.multirank
@pytest.mark.timeout(780)
def test_fsdp_checkpoint_resumes_bit_exactly_and_loads_at_another_dp_size(
        tmp_path: Path) -> None:
    for rank in run_on_ranks(_save_and_resume, world_size=2, args=(str(tmp_path),),
                             timeout_s=300):
        assert rank["marked"], "megatron_rlhf.json marks the checkpoint as FSDP with its files"
        assert rank["loaded_equal"], "loaded weights differ from the saved ones"
        assert rank["metrics_equal"], "resumed losses or gradient norms differ"
        assert rank["weights_equal"], "resumed weights differ"
        assert not rank["without_adam_equal"], "leaving out the Adam state changed nothing"
    # dp=1 only loads: megatron-core 0.16.1's Megatron-FSDP does not scale the gradients of a
    # single DP rank (its step-0 gradient norm is 9x the resident run's), so no step is compared.
    (one,) = run_on_ranks(_load_at_another_dp_size, world_size=1, args=(str(tmp_path),),
                          timeout_s=180)
    assert one["loaded_equal"], "the 2-rank weights did not load whole on 1 rank"
    for rank in run_on_ranks(_load_at_another_dp_size, world_size=4, args=(str(tmp_path),),
                             timeout_s=240):
        assert rank["loaded_equal"], "the 2-rank weights did not load whole on 4 ranks"
        got, want = rank["norms"]
        assert got == pytest.approx(want, rel=RTOL)
        assert rank["max_diff"] <= WEIGHT_ATOL, rank["max_diff"]


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
        with pytest.raises(NotImplementedError, match="a Megatron-FSDP model's state is not a "
                                                      "megatron sharded state dict"):
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
def test_fsdp_refuses_pipelines_and_sharded_state_dicts_and_skips_nonfinite_updates() -> None:
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
