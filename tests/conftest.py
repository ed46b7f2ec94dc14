"""Test-session set-up.

Without a GPU, Triton kernels run in the interpreter; TRITON_INTERPRET must be set before any
``@triton.jit`` runs, so it is set here, before test modules import the backends.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.pop("QUANTMLA_BACKEND", None)  # tests choose backends explicitly
