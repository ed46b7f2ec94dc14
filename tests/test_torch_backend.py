"""PyTorch backend against the reference on every generated case (CPU here; any device on GPU machines)."""

import pytest
import torch

from quantmla_core import get_backend
from quantmla_core.testing import generate_cases

from conformance import check_attention_case, check_writer

CASES = generate_cases(get_backend("torch").capabilities, quick=False)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_writer_matches_reference(case, device):
    check_writer(case, "torch", device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_attention_matches_reference(case, device):
    check_attention_case(case, "torch", "torch", device)


@pytest.mark.parametrize("dtype", ["bfloat16"])
@pytest.mark.parametrize("case", CASES[:4], ids=str)
def test_bf16_inputs(case, dtype):
    check_writer(case, "torch", "cpu", dtype)
    check_attention_case(case, "torch", "torch", "cpu", dtype)


@pytest.mark.parametrize("case", CASES[::3], ids=str)
def test_torch_write_reference_read(case):
    check_attention_case(case, "torch", "reference", "cpu")


@pytest.mark.parametrize("case", CASES[::3], ids=str)
def test_reference_write_torch_read(case):
    check_attention_case(case, "reference", "torch", "cpu")


@pytest.mark.parametrize("chunk_tokens", [1, 100, 257])
@pytest.mark.parametrize("case", CASES[::4], ids=str)
def test_attention_in_many_chunks(case, chunk_tokens, monkeypatch):
    """Tiny chunk budgets force the online softmax across many page chunks (and chunks past the
    end of shorter requests)."""
    from quantmla_core.backends.torch import attention as torch_attention

    monkeypatch.setattr(torch_attention, "CHUNK_TOKENS", chunk_tokens)
    check_attention_case(case, "torch", "torch", "cpu")
