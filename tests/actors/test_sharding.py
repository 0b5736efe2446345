"""actors/sharding/ helpers that need no process group."""

from __future__ import annotations

import pytest
import torch

from actors.sharding import cpu_copy

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
