"""The CPU compatibility layer for megatron-core: each patch, its scope, and its absence on GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from megatron.core import package_info
from megatron.core.tensor_parallel import random as mcore_random

from megatron_rlhf.runtime import cpu_compat, patches


@pytest.fixture(scope="module", autouse=True)
def _compat() -> None:
    assert patches.apply_cpu_compat() is True


def test_idempotent_and_cuda_still_reported_absent() -> None:
    assert patches.apply_cpu_compat() is True
    assert patches.cpu_compat_active()
    assert torch.cuda.is_available() is False


def test_cuda_allocations_land_on_cpu() -> None:
    assert torch.zeros(3, device="cuda").device.type == "cpu"
    assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"


def test_generation_leaves_the_redirect_and_enters_it_again() -> None:
    from torch.overrides import TorchFunctionMode

    class Passthrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with patches.cuda_redirect_suspended():
        with pytest.raises((RuntimeError, AssertionError), match="(?i)cuda|nvidia"):
            torch.zeros(1, device="cuda")
    assert torch.zeros(1, device="cuda").device.type == "cpu"
    with Passthrough(), patches.cuda_redirect_suspended():  # not on top: left alone
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    assert torch.zeros(1, device="cuda").device.type == "cpu"


def test_streams_and_events_are_usable_no_ops() -> None:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda.current_stream().wait_stream(stream)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    assert end.elapsed_time(start) <= 0.0 <= start.elapsed_time(end)
    torch.cuda.synchronize()


def test_cuda_type_names_only_inside_megatron_optimizers() -> None:
    tensor = torch.zeros(1)
    assert tensor.type() == "torch.FloatTensor"
    optimizer_scope = {"__name__": "megatron.core.optimizer.distrib_optimizer"}
    exec("def sort_key(p):\n    return p.type()", optimizer_scope)  # noqa: S102
    assert optimizer_scope["sort_key"](tensor) == "torch.cuda.FloatTensor"
    assert optimizer_scope["sort_key"](tensor.bfloat16()) == "torch.cuda.BFloat16Tensor"
    assert tensor.type(torch.float64).dtype == torch.float64


def _dropout_mask(tp_rank: int) -> torch.Tensor:
    cpu_compat.seed_model_parallel_rng(42, tp_rank=tp_rank)
    with mcore_random.get_cuda_rng_tracker().fork():
        return torch.nn.functional.dropout(torch.ones(64), p=0.5) > 0


def test_tensor_parallel_dropout_streams_differ_by_tp_rank_and_repeat() -> None:
    assert isinstance(mcore_random.get_cuda_rng_tracker(), cpu_compat.CpuRNGStatesTracker)
    assert torch.equal(_dropout_mask(0), _dropout_mask(0))
    assert not torch.equal(_dropout_mask(0), _dropout_mask(1))


def test_fork_leaves_the_outer_stream_untouched() -> None:
    cpu_compat.seed_model_parallel_rng(7, tp_rank=0)
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    with mcore_random.get_cuda_rng_tracker().fork():
        torch.rand(100)
    assert torch.equal(torch.rand(4), expected)


def test_unsupported_megatron_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(package_info, "__version__", "0.99.0")
    with pytest.raises(RuntimeError, match=r"0\.99\.0 is installed.*megatron-core==0\.16\.1"):
        patches.apply_cpu_compat()


def test_nothing_is_patched_when_cuda_is_present() -> None:
    script = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "original = torch.cuda.current_device\n"
        "from megatron_rlhf.runtime import patches\n"
        "assert patches.apply_cpu_compat() is False\n"
        "assert torch.cuda.current_device is original\n"
        "assert not patches.cpu_compat_active()\n"
        "print('untouched')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "untouched" in out.stdout


@pytest.mark.parametrize("version,cuda,outcome", [
    ("0.16.0", False, None), ("0.16.1", False, None), ("0.16.1", True, None),
    ("0.17.0", False, "raise"), ("0.15.3", True, "warn")])
def test_megatron_core_outside_the_tested_versions_is_refused_on_cpu_and_warned_on_gpu(
        version: str, cuda: bool, outcome: str | None) -> None:
    from megatron_rlhf.runtime.cpu_compat import megatron_core_version_warning

    tested = "megatron_rlhf is tested with 0.16.0, 0.16.1"
    if outcome == "raise":
        with pytest.raises(RuntimeError, match=rf"megatron-core {version} is installed but "
                                               rf"{tested}.*pip install megatron-core==0.16.1"):
            megatron_core_version_warning(version, cuda)
        return
    warning = megatron_core_version_warning(version, cuda)
    assert (warning and warning.split(";")[0]) == (
        f"megatron-core {version} is installed but {tested}" if outcome == "warn" else None)


def test_the_installed_megatron_core_passes_the_gate() -> None:
    """The suite's own megatron-core is a tested one: the check neither raises nor warns."""
    import warnings

    from megatron_rlhf.runtime.cpu_compat import check_megatron_core_version

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_megatron_core_version()
