"""actors/sharding/ without a process group: cpu_copy, the backend make_backend picks, the DeepSpeed engine's
config (tests/orchestration/test_deepspeed_backend.py runs ZeRO ranks on Ray)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from actors.sharding import DeepspeedBackend, NoShardBackend, cpu_copy, make_backend
from configs.schema import DeepspeedConfig

requires_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (extra `deepspeed`)"
)

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_cpu_copy_is_a_detached_copy_on_the_cpu_in_the_dtype_asked(device: str, dtype: torch.dtype | None) -> None:
    param = torch.nn.Parameter(torch.randn(64, 32, device=device))
    out = cpu_copy(param, dtype)
    assert out.device.type == "cpu" and not out.requires_grad
    assert out.dtype == (dtype or torch.float32)
    assert torch.equal(out, param.detach().cpu().to(out.dtype))  # casting on the device rounds the same way
    if device == "cpu":
        assert out.data_ptr() != param.data_ptr()  # a copy: the learner goes on changing the parameter


def test_one_rank_shards_nothing_and_a_missing_deepspeed_says_how_to_install(monkeypatch) -> None:
    kw = {"rank": 0, "device": torch.device("cpu"), "dtype": torch.float32}
    assert isinstance(make_backend("deepspeed", world_size=1, **kw), NoShardBackend)
    with pytest.raises(ValueError, match=r"unknown sharding backend 'zero'.*fsdp2, deepspeed"):
        make_backend("zero", world_size=2, **kw)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now fails
    with pytest.raises(ImportError, match=r"learner.backend deepspeed needs the deepspeed package.*\[deepspeed\]"):
        make_backend("deepspeed", world_size=2, **kw)


@requires_deepspeed
def test_the_engine_config_keeps_the_learners_keys(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "7")  # restored after the test
    options = DeepspeedConfig(stage=3, config={"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}})
    backend = make_backend(
        "deepspeed",
        world_size=2,
        rank=1,
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
        deepspeed=options,
        grad_clip=0.5,
    )
    assert isinstance(backend, DeepspeedBackend) and backend.grad_scale == 2.0
    assert os.environ["LOCAL_RANK"] == "0"  # DeepSpeed's device index; Ray gives each rank its own device
    config = backend.config()
    zero = {"stage": 3, "reduce_bucket_size": 1000, "stage3_param_persistence_threshold": 0}
    assert config["zero_optimization"] == zero
    assert config["gradient_clipping"] == 0.5 and config["managed_gradient_accumulation"] is False
