"""Initialisations as PyTorch's defaults, from dispatch's seeded generators.

Every layer draws its tensors from one stream of seeds: manual_seed(s)
restarts it, so a model built twice after the same manual_seed has the
same weights, on every device (dispatch_uniform / dispatch_normal give the
same bits for a seed everywhere). The values are NOT those of torch for
torch.manual_seed(s): the distributions are the same, the streams differ.
To reproduce a torch model, copy its state_dict (Module.load_state_dict).
"""
import math

from .._core import default_device, float32

_MASK64 = (1 << 64) - 1
_state = [0]


def manual_seed(seed):
    """Restarts the stream of seeds the layers draw from."""
    _state[0] = int(seed) & _MASK64


def next_seed():
    """The next seed of the stream (splitmix64 of a counter)."""
    _state[0] = (_state[0] + 0x9E3779B97F4A7C15) & _MASK64
    z = _state[0]
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(shape, bound, device=None, dtype=float32):
    """U(-bound, bound) of shape, a new plain tensor."""
    return (device or default_device()).uniform(
        shape, -bound, bound, next_seed(), dtype)


def normal(shape, mean=0.0, std=1.0, device=None, dtype=float32):
    return (device or default_device()).normal(shape, mean, std,
                                               next_seed(), dtype)


def fan_in_bound(fan_in):
    """1 / sqrt(fan_in): the bound of torch's kaiming_uniform_(a=sqrt(5))
    for a Linear / Conv weight (gain sqrt(2 / (1 + 5)) times
    sqrt(3 / fan_in)), and of their bias; 0 when fan_in is 0."""
    return 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
