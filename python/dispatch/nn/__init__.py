"""dispatch.nn: torch.nn's module system and layers over dispatch tensors.

    import dispatch, dispatch.nn as nn
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = dispatch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.step(loss.backward())

See python/README.md ("Modules") for the differences from torch.
"""
from . import functional, init, utils  # noqa: F401
from .layers import (  # noqa: F401
    CausalSelfAttention, Conv2d, CrossEntropyLoss, Dropout, Embedding, GELU,
    LayerNorm, Linear, ModuleList, MSELoss, ReLU, RMSNorm, Sequential, SiLU)
from .module import Module, Parameter  # noqa: F401

__all__ = ["functional", "init", "utils", "Module", "Parameter",
           "CausalSelfAttention", "Conv2d", "CrossEntropyLoss", "Dropout",
           "Embedding", "GELU", "LayerNorm", "Linear", "ModuleList",
           "MSELoss", "ReLU", "RMSNorm", "Sequential", "SiLU"]
