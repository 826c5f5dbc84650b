"""The layers of dispatch.nn, with torch.nn's constructor arguments,
parameter names, shapes and default initialisations (see init.py for the
seeds). device: where the parameters are made (default: the default
device); dtype: float32 unless given."""
from collections import OrderedDict

from .._core import _pair2, default_device, float32
from . import functional as F
from . import init
from .module import Module, Parameter


def _uniform_param(shape, bound, device, dtype):
    return Parameter(init.uniform(shape, bound, device, dtype))


class Linear(Module):
    """y = x @ weight.T + bias; weight [out, in] and bias [out] uniform in
    +-1/sqrt(in) (torch's kaiming_uniform(a=sqrt(5)) and its bias rule)."""

    def __init__(self, in_features, out_features, bias=True, device=None,
                 dtype=float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        b = init.fan_in_bound(in_features)
        self.weight = _uniform_param((out_features, in_features), b, device,
                                     dtype)
        self.bias = _uniform_param((out_features,), b, device, dtype) \
            if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features="
                f"{self.out_features}, bias={self.bias is not None}")


class Conv2d(Module):
    """2-D convolution, weight [out, in, kh, kw] and bias [out] uniform in
    +-1/sqrt(in * kh * kw) as torch. groups and padding modes other than
    zeros are not supported."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1,
                 padding=0, dilation=1, bias=True, device=None,
                 dtype=float32):
        super().__init__()
        kh, kw = _pair2(kernel_size)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = (kh, kw)
        self.stride, self.padding = _pair2(stride), _pair2(padding)
        self.dilation = _pair2(dilation)
        b = init.fan_in_bound(in_channels * kh * kw)
        self.weight = _uniform_param((out_channels, in_channels, kh, kw), b,
                                     device, dtype)
        self.bias = _uniform_param((out_channels,), b, device, dtype) \
            if bias else None

    def forward(self, x):
        return F.conv2d(x, self.weight, self.stride, self.padding,
                        self.dilation, self.bias)

    def extra_repr(self):
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size="
             f"{self.kernel_size}, stride={self.stride}")
        if self.padding != (0, 0):
            s += f", padding={self.padding}"
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        return s + ("" if self.bias is not None else ", bias=False")


def _norm_shape(normalized_shape):
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(int(d) for d in normalized_shape)


class LayerNorm(Module):
    """Normalises the last dims normalized_shape; weight ones, bias zeros."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True,
                 device=None, dtype=float32):
        super().__init__()
        self.normalized_shape = _norm_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        dev = device or default_device()
        if elementwise_affine:
            self.weight = Parameter(dev.ones(self.normalized_shape, dtype))
            self.bias = Parameter(dev.zeros(self.normalized_shape, dtype))
        else:
            self.weight = self.bias = None

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias,
                            self.eps)

    def extra_repr(self):
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class RMSNorm(Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dims (torch 2.4's
    RMSNorm; eps None: the dtype's machine epsilon); weight ones."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True,
                 device=None, dtype=float32):
        super().__init__()
        self.normalized_shape = _norm_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        dev = device or default_device()
        self.weight = Parameter(dev.ones(self.normalized_shape, dtype)) \
            if elementwise_affine else None

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self):
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class Embedding(Module):
    """Rows of weight [num_embeddings, embedding_dim], N(0, 1) as torch;
    the padding_idx row starts at zero and gets no gradient."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None,
                 device=None, dtype=float32):
        super().__init__()
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"Embedding: padding_idx {padding_idx} is "
                                 f"not in [-{num_embeddings}, "
                                 f"{num_embeddings})")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        w = init.normal((num_embeddings, embedding_dim), 0.0, 1.0, device,
                        dtype)
        if padding_idx is not None:
            dev = w.device
            rows = dev.arange(num_embeddings, dtype="int64").reshape(
                num_embeddings, 1)
            w = w.masked_fill(rows == padding_idx, 0.0)
        self.weight = Parameter(w)

    def forward(self, idx):
        return F.embedding(idx, self.weight, self.padding_idx)

    def extra_repr(self):
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        return s if self.padding_idx is None else \
            s + f", padding_idx={self.padding_idx}"


class Dropout(Module):
    """F.dropout in training mode, the identity in eval mode. Each call
    draws its mask's seed from dispatch.nn.init's stream."""

    def __init__(self, p=0.5):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p = {p} is not in [0, 1)")
        self.p = p

    def forward(self, x):
        return F.dropout(x, self.p, self.training)

    def extra_repr(self):
        return f"p={self.p}"


class ReLU(Module):
    def forward(self, x):
        return F.relu(x)


class SiLU(Module):
    def forward(self, x):
        return F.silu(x)


class GELU(Module):
    """approximate: 'none' (erf) or 'tanh'."""

    def __init__(self, approximate="none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', "
                             f"got {approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(x, self.approximate)

    def extra_repr(self):
        return f"approximate={self.approximate!r}"


class CausalSelfAttention(Module):
    """Multi-head causal self-attention over x [B, T, embed_dim]: the
    projections q_proj, k_proj, v_proj and out_proj (Linear layers, so
    their weights are [out, in]), the heads split as [B, H, T, d] and one
    fused attention op (causal; key_padding_mask [B, T] bool, True =
    attend)."""

    def __init__(self, embed_dim, num_heads, bias=True, device=None,
                 dtype=float32):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"CausalSelfAttention: embed_dim {embed_dim} "
                             f"is not a multiple of num_heads {num_heads}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self, name, Linear(embed_dim, embed_dim, bias, device,
                                       dtype))

    def forward(self, x, key_padding_mask=None):
        B, T, D = x.shape
        H = self.num_heads

        def heads(proj):
            return proj(x).reshape(B, T, H, D // H).permute(0, 2, 1, 3)
        a = F.scaled_dot_product_attention(
            heads(self.q_proj), heads(self.k_proj), heads(self.v_proj),
            is_causal=True, key_padding_mask=key_padding_mask)
        return self.out_proj(a.permute(0, 2, 1, 3).reshape(B, T, D))

    def extra_repr(self):
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"


class Sequential(Module):
    """Calls its modules in order. Sequential(m0, m1, ...) names them '0',
    '1', ...; Sequential(OrderedDict(name=module)) keeps the names."""

    def __init__(self, *modules):
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], OrderedDict):
            for name, m in modules[0].items():
                self.add_module(name, m)
        else:
            for i, m in enumerate(modules):
                self.add_module(str(i), m)

    def __getitem__(self, i):
        mods = list(self._modules.values())
        if isinstance(i, slice):
            return Sequential(*mods[i])
        return mods[i]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def append(self, module):
        self.add_module(str(len(self)), module)
        return self

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x


class ModuleList(Module):
    """A list of modules, registered as '0', '1', ... (not callable)."""

    def __init__(self, modules=()):
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module):
        self.add_module(str(len(self._modules)), module)
        return self

    def __getitem__(self, i):
        return list(self._modules.values())[i]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class MSELoss(Module):
    def __init__(self, reduction="mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, input, target):  # noqa: A002
        return F.mse_loss(input, target, self.reduction)


class CrossEntropyLoss(Module):
    def __init__(self, ignore_index=-100, reduction="mean",
                 label_smoothing=0.0):
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing

    def forward(self, input, target):  # noqa: A002
        return F.cross_entropy(input, target, self.ignore_index,
                               self.reduction, self.label_smoothing)
