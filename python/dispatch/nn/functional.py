"""dispatch.nn.functional: torch.nn.functional's names over dispatch's ops.

Each function is one op of the library, or a few of them, recorded by
autodiff when an input is tracked; arguments that the ops cannot honour
raise NotImplementedError rather than being ignored."""
from .. import _core
from .._core import _as_tensor

relu = _core.relu
silu = _core.silu
sigmoid = _core.sigmoid
tanh = _core.tanh
softplus = _core.softplus
gelu = _core.gelu                  # approximate='none' | 'tanh'
embedding = _core.embedding        # (input, weight, padding_idx=None)
layer_norm = _core.layer_norm      # (x, normalized_shape, weight, bias, eps)
rms_norm = _core.rms_norm          # (x, normalized_shape, weight, eps)
batch_norm = _core.batch_norm
conv2d = _core.conv2d              # (x, w, stride, padding, dilation, bias)
max_pool2d = _core.max_pool2d
avg_pool2d = _core.avg_pool2d


def linear(input, weight, bias=None):  # noqa: A002 (torch's names)
    """input @ weight.T + bias, weight [out, in] as torch.nn.Linear."""
    y = _core.matmul(input, _core.transpose(weight, 0, 1))
    return y if bias is None else y + bias


def softmax(input, dim):  # noqa: A002
    return _core.softmax(input, dim)


def log_softmax(input, dim):  # noqa: A002
    return _core.log_softmax(input, dim)


def cross_entropy(input, target, ignore_index=-100,  # noqa: A002
                  reduction="mean", label_smoothing=0.0):
    """Class-index targets: input [N, C] or [N, C, d1, ...], target int64;
    reduction 'none', 'sum' or 'mean' (over the targets that are not
    ignore_index)."""
    return _core.cross_entropy(input, target, ignore_index, reduction,
                               label_smoothing)


def mse_loss(input, target, reduction="mean"):  # noqa: A002
    """(input - target)^2, reduced by 'mean' (one op), 'sum' or 'none'."""
    input = _as_tensor(input)
    target = _as_tensor(target, input)
    if reduction == "mean":
        return _core.mse(input, target)
    d = input - target
    if reduction == "sum":
        return (d * d).sum()
    if reduction == "none":
        return d * d
    raise ValueError(f"mse_loss: reduction {reduction!r} is not 'none', "
                     "'sum' or 'mean'")


def dropout(input, p=0.5, training=True, seed=None):  # noqa: A002
    """Zeroes each element with probability p and scales the rest by
    1/(1-p) when training (else returns input). The mask comes from seed
    (an int; None: the next seed of dispatch.nn.init's stream), so the
    same seed drops the same elements on every device; the stream is not
    torch's."""
    if not training or p == 0.0:
        return input
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p = {p} is not in [0, 1)")
    if seed is None:
        from .init import next_seed
        seed = next_seed()
    return _core.dropout(input, p, seed)


def scaled_dot_product_attention(query, key, value, attn_mask=None,
                                 dropout_p=0.0, is_causal=False, scale=None,
                                 key_padding_mask=None):
    """softmax(q k^T * scale [+ causal mask]) v over [B, H, T, d] in one
    fused op (torch 2's function of the same name). key_padding_mask: bool
    [B, Tk], True = attend. A general attn_mask and dropout_p > 0 are not
    supported by the op. A query that attends no key gives 0 (torch:
    NaN)."""
    if attn_mask is not None:
        raise NotImplementedError(
            "scaled_dot_product_attention: a general attn_mask is not "
            "supported; use is_causal and/or key_padding_mask [B, Tk]")
    if dropout_p:
        raise NotImplementedError("scaled_dot_product_attention: dropout_p "
                                  "> 0 is not supported by the fused op")
    return _core.attention(query, key, value, key_padding_mask, is_causal,
                           scale)
