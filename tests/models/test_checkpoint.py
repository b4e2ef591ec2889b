"""Model checkpoints: save at TP=2, load at TP=1 and PP=2 with identical weights and logits;
atomic directories, clear errors for missing, corrupted or mismatched checkpoints, and loading
that runs no pickled code."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.helpers.models import full_logits
from tests.model_fixtures import TinyArch, whole_world_groups
from tests.multirank import run_on_ranks

# 300 pads to 384 at TP=1 and to 512 at TP=2: loading crosses a vocabulary-padding change.
_ARCH = TinyArch(num_layers=2, vocab_size=300)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, _ARCH.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _build(arch, head: str, tie: bool, tp: int, pp: int, seed: int):
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import init_weights

    pgc = whole_world_groups(tp, pp)
    model = build_gpt_model(arch, ModelBuildOptions(head=head, tie_embeddings=tie), pgc)
    init_weights(model, pgc, seed=seed)
    return model, pgc


def _expect_error(fn, error: type[Exception], *fragments: str) -> None:
    with pytest.raises(error) as info:
        fn()
    assert all(f in str(info.value) for f in fragments), str(info.value)


def _save_and_reload(root: str, head: str, tie: bool) -> str:
    from megatron_rlhf.models.checkpoint import load_model_checkpoint, save_model_checkpoint
    from megatron_rlhf.models.weights import gather_full_state

    saved, pgc = _build(_ARCH, head, tie, tp=2, pp=1, seed=3)
    expected_state = gather_full_state(saved, pgc)
    expected_logits = full_logits(saved, pgc, _batch())
    directory = os.path.join(root, head.replace("+", "_") + ("_tied" if tie else ""))
    save_model_checkpoint(saved, pgc, directory, {"role": "critic", "step": 7})
    assert not [p for p in os.listdir(root) if ".tmp-" in p], "temporary directory left behind"
    for tp, pp in [(1, 1), (1, 2)]:
        model, pgc = _build(_ARCH, head, tie, tp, pp, seed=99)
        info = load_model_checkpoint(model, pgc, directory)
        saved_with = (info.metadata["role"], info.metadata["step"], info.tp_size, info.pp_size)
        assert saved_with == ("critic", 7, 2, 1)
        state = gather_full_state(model, pgc)
        assert state.keys() == expected_state.keys()
        for name, tensor in state.items():
            assert torch.equal(tensor, expected_state[name]), f"tp{tp} pp{pp} {name} differs"
        logits = full_logits(model, pgc, _batch())
        if logits is not None:
            torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    return directory


def _check_errors(directory: str) -> None:
    from megatron_rlhf.models.checkpoint import (
        INFO_FILE,
        load_model_checkpoint,
        save_model_checkpoint,
    )

    model, pgc = _build(_ARCH, "lm", False, tp=1, pp=1, seed=1)
    _expect_error(lambda: save_model_checkpoint(model, pgc, directory, {"role": "actor"}),
                  OSError, "already exists")
    _expect_error(lambda: save_model_checkpoint(model, pgc, directory + "_x", {"step": 1}),
                  ValueError, "'role'")
    _expect_error(lambda: load_model_checkpoint(model, pgc, directory), ValueError,
                  "head='lm+scalar'", "head='lm'")
    deeper, pgc = _build(TinyArch(num_layers=4, vocab_size=300), "lm+scalar", False, 1, 1, 1)
    _expect_error(lambda: load_model_checkpoint(deeper, pgc, directory), ValueError,
                  "num_layers=2", "num_layers=4")
    broken = directory + "_broken"
    if dist.get_rank() == 0:
        shutil.copytree(directory, broken)
        shard = sorted(Path(broken).glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:100])
    dist.barrier()
    shard_name = sorted(Path(broken).glob("*.distcp"))[0].name
    model, pgc = _build(_ARCH, "lm+scalar", False, tp=1, pp=1, seed=1)
    _expect_error(lambda: load_model_checkpoint(model, pgc, broken), ValueError, "corrupted",
                  shard_name)
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(broken) / INFO_FILE).unlink()
    dist.barrier()
    _expect_error(lambda: load_model_checkpoint(model, pgc, broken), ValueError, INFO_FILE,
                  "missing")
    _expect_error(lambda: load_model_checkpoint(model, pgc, broken + "_nowhere"),
                  FileNotFoundError, "does not exist")


def _checkpoint_job(root: str) -> None:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    directory = _save_and_reload(root, "lm+scalar", tie=False)
    _save_and_reload(root, "lm", tie=True)
    _check_errors(directory)


@pytest.mark.multirank
def test_save_tp2_load_tp1_and_pp2_with_same_weights_and_logits(tmp_path: Path) -> None:
    run_on_ranks(_checkpoint_job, world_size=2, args=(str(tmp_path),), timeout_s=150)
    info = json.loads((tmp_path / "lm_scalar" / "megatron_rlhf.json").read_text())
    assert info["model"]["head"] == "lm+scalar" and info["format_version"] == 2
    assert {".metadata", "metadata.json", "common.pt"} <= info["files"].keys()


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_unpickling_refuses_code(tmp_path: Path) -> None:
    from megatron_rlhf.models.checkpoint import read_dcp_metadata

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    _expect_error(lambda: read_dcp_metadata(tmp_path), ValueError, "posix.system",
                  "not allowed")


def test_sharded_objects_load_weights_only() -> None:
    from megatron_rlhf.models.checkpoint import _WeightsOnlyLoadPlanner

    planner = _WeightsOnlyLoadPlanner()
    planner.original_state_dict = {}
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="layer._extra_state"))
    buffer = io.BytesIO()
    torch.save([None, torch.ones(2)], buffer)
    buffer.seek(0)
    planner.load_bytes(item, buffer)
    assert torch.equal(planner.original_state_dict["layer._extra_state"][1], torch.ones(2))
    evil = io.BytesIO()
    torch.save(_Exploit(), evil)
    evil.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, evil)


def test_info_file_errors_name_the_problem(tmp_path: Path) -> None:
    from megatron_rlhf.models.checkpoint import INFO_FILE, read_checkpoint_info

    (tmp_path / "ckpt.tmp-1234").mkdir()
    _expect_error(lambda: read_checkpoint_info(tmp_path / "ckpt"), FileNotFoundError,
                  "ckpt.tmp-1234", "unfinished save")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / INFO_FILE).write_text("{not json")
    _expect_error(lambda: read_checkpoint_info(ckpt), ValueError, "is not JSON")
    (ckpt / INFO_FILE).write_text(json.dumps({"format_version": 1, "metadata": {"role": "a"}}))
    _expect_error(lambda: read_checkpoint_info(ckpt), ValueError, "'model' is missing")
    (ckpt / INFO_FILE).write_text(json.dumps({"format_version": 9}))
    _expect_error(lambda: read_checkpoint_info(ckpt), ValueError, "format_version=9")


def _load_on_a_subset(directory: str) -> float:
    """Interleaving on 2 ranks puts ref on rank 0 only; rank 1 joins the load with no model."""
    from megatron_rlhf.models.checkpoint import load_model_checkpoint, save_model_checkpoint
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import gather_full_state, init_weights
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.topology.cluster import ClusterSpec
    from megatron_rlhf.topology.groups import build_process_groups
    from megatron_rlhf.topology.placement import plan_placement
    from megatron_rlhf.topology.placement_config import PlacementConfig

    initialize_runtime()
    everywhere = whole_world_groups(2, 1)
    saved = build_gpt_model(_ARCH, ModelBuildOptions(), everywhere)
    init_weights(saved, everywhere, seed=5)
    save_model_checkpoint(saved, everywhere, f"{directory}/ckpt", {"role": "actor"})
    expected = gather_full_state(saved, everywhere)
    plan = plan_placement(ClusterSpec.homogeneous(1, 2), PlacementConfig("interleaving"), _ARCH)
    groups = build_process_groups(plan)
    model = None
    if groups["ref"] is not None:
        model = build_gpt_model(_ARCH, ModelBuildOptions(), groups["ref"])
        init_weights(model, groups["ref"], seed=6)
    load_model_checkpoint(model, groups["ref"], f"{directory}/ckpt")
    if model is None:
        return -1.0
    got = gather_full_state(model, groups["ref"])
    return max((got[name] - expected[name]).abs().max().item() for name in expected)


@pytest.mark.multirank
def test_ranks_without_the_model_join_a_load(tmp_path) -> None:
    assert run_on_ranks(_load_on_a_subset, world_size=2, args=(str(tmp_path),),
                        timeout_s=180) == [0.0, -1.0]
