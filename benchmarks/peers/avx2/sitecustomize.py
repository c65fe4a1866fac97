"""On vLLM's path only under `offline.py --isa avx2`: every process of the peer venv, vLLM's
spawned engine and workers included, finds no AVX-512, so vLLM loads its AVX2 kernels."""

import torch

torch.cpu._is_avx512_supported = lambda: False
