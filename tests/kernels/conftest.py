"""Kernels tests: without a GPU, Triton kernels run under the interpreter (TRITON_INTERPRET=1).

Triton decides when ``triton.language`` is first imported whether its standard library
(tl.zeros, tl.max, ...) is interpreted, so the variable is set here, before anything in this
directory imports triton (``kernels`` itself only imports triton at the first Triton launch).
If triton was already imported without it, the Triton tests skip with a reason
(kernels_testlib.needs_triton); the torch-reference tests still run.
"""

import os
import sys

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
