"""backends/buffers.py: graph-safe buffers are views of one allocation, aligned and disjoint."""

import pytest
import torch
from quantmla_core.backends.buffers import ALIGN, capturing, carve


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.int32])
def test_carve_views_share_one_aligned_allocation(out_dtype):
    specs = [((3, 5, 16, 512), torch.float32), ((3, 5, 16), torch.float32), ((3, 16, 512), out_dtype), ((7,), torch.uint8)]
    views = carve(specs, torch.device("cpu"))
    base = views[0].untyped_storage().data_ptr()
    for v, (shape, dtype) in zip(views, specs):
        assert v.shape == shape and v.dtype == dtype
        assert v.untyped_storage().data_ptr() == base and (v.data_ptr() - base) % ALIGN == 0
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "views overlap"
    for i, v in enumerate(views):
        v.fill_(i + 1)
    assert all((v == i + 1).all() for i, v in enumerate(views))


def test_capturing_is_false_without_a_capture():
    assert capturing() is False
