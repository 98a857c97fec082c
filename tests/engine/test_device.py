"""Device decisions (engine/device.py) on a faked CUDA: the dtype "auto" picks."""

import pytest
import torch

from engine.device import pick_dtype


@pytest.mark.parametrize("has_bf16, want", [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_dtype_on_cuda_is_bf16_only_where_the_gpu_computes_in_it(monkeypatch, has_bf16, want):
    """Issue 54 row 6: bf16 was picked on any CUDA device; a T4 or V100 only emulates it (slowly),
    so float16 there. torch's own check, without emulation, decides."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: asked.append(including_emulation) or has_bf16)
    assert pick_dtype("auto", torch.device("cuda")) == want
    assert asked == [False]
    assert pick_dtype("float32", torch.device("cuda")) == torch.float32  # asked for: as asked
