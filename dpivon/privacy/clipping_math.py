"""The math of book-keeping clipping (`dpivon.privacy.bookkeeping`), one pure function per
quantity: per-example squared gradient norms (ghost norms, Gram inner products) and clipped
sums of per-example gradients, for Linear, Conv2d and GroupNorm layers."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Per-example tensors (Gram matrices, per-example gradients) are made for chunks of
# examples of at most this many elements (64 MB in fp32): their kernels' transient buffers
# then stay small next to the activations, also at batch sizes in the thousands.
_CHUNK_ELEMENTS = 1 << 24


def prefer_ghost_norm(positions: int, outputs: int, inputs: int) -> bool:
    """Mixed ghost clipping's space-time rule: Gram matrices of T x T (two per example)
    are smaller than a p x d per-example gradient when 2 T^2 < p d."""
    return 2 * positions**2 < outputs * inputs


def clip_factors(squared_norms: Tensor, max_grad_norm: float) -> Tensor:
    """Opacus's per-example factor min(1, C / (||g_i|| + 1e-6))."""
    return (max_grad_norm / (squared_norms.sqrt() + 1e-6)).clamp(max=1.0)


def weighted_row_sum(per_example: Tensor, clip: Tensor) -> Tensor:
    """sum_i c_i g_i for per-example gradients stacked along dim 0 (a vector-matrix product)."""
    return (clip.to(per_example.dtype) @ per_example.flatten(1)).view(per_example.shape[1:])


def weighted_chunks_sum(chunks: list[Tensor], clip: Tensor) -> Tensor:
    """`weighted_row_sum` of per-example gradients kept in consecutive chunks of examples."""
    factors = clip.split([len(rows) for rows in chunks])
    return sum(weighted_row_sum(rows, c) for rows, c in zip(chunks, factors, strict=True))


def example_chunks(elements_per_example: int, *tensors: Tensor) -> Iterator[tuple[Tensor, ...]]:
    """Consecutive chunks of examples of the tensors, sized by ``_CHUNK_ELEMENTS``."""
    size = max(1, _CHUNK_ELEMENTS // max(elements_per_example, 1))
    return zip(*(t.split(size) for t in tensors), strict=True)


def row_squared_norms(per_example: Tensor) -> Tensor:
    """||g_i||^2 per row (vector_norm: one pass, no squared copy)."""
    return torch.linalg.vector_norm(per_example.flatten(1), dim=1).square()


def gram_inner(gram_a: Tensor, gram_g: Tensor) -> Tensor:
    """<A_i^T A_i, G_i^T G_i> per example = ||G_i^T A_i||_F^2 (the ghost norm)."""
    return (gram_a * gram_g).flatten(1).sum(1)


def conv_output_size(conv: nn.Conv2d, height: int, width: int) -> tuple[int, int]:
    return tuple(
        (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
        for size, pad, dil, k, stride in zip(
            (height, width),
            conv.padding,
            conv.dilation,
            conv.kernel_size,
            conv.stride,
            strict=True,
        )
    )


def conv_patch_gram(a: Tensor, conv: nn.Conv2d) -> Tensor:
    """U_i^T U_i per example (T x T), U_i the d x T unfolded input of ``conv``.

    Unfolding copies each input value k_h k_w times. Where it is cheaper, the Gram comes
    from the padded input instead: with M = A_pad^T A_pad over padded positions,
    (U^T U)[t, t'] = sum_k M[s t + k, s t' + k] over the kernel offsets k, i.e. shifted
    (strided) views of M summed over kernel rows, then over kernel columns.
    """
    batch, _, height, width = a.shape
    kh, kw = conv.kernel_size
    (ph, pw), (sh, sw), (dh, dw) = conv.padding, conv.stride, conv.dilation
    out_h, out_w = conv_output_size(conv, height, width)
    padded_h, padded_w = height + 2 * ph, width + 2 * pw
    if (padded_h * padded_w) ** 2 > kh * kw * (out_h * out_w) ** 2:
        u = F.unfold(a, conv.kernel_size, conv.dilation, conv.padding, conv.stride)
        return torch.bmm(u.transpose(1, 2), u)
    a_pad = F.pad(a, (pw, pw, ph, ph)).flatten(2)
    m = torch.bmm(a_pad.transpose(1, 2), a_pad).view(batch, padded_h, padded_w, padded_h, padded_w)
    rows = _paired_shift_sum(m, 1, kh, dh, sh, out_h)  # (B, out_h, padded_w, out_h, padded_w)
    gram = _paired_shift_sum(rows, 2, kw, dw, sw, out_w)
    return gram.reshape(batch, out_h * out_w, out_h * out_w)


def _paired_shift_sum(
    m: Tensor, dim: int, taps: int, dilation: int, stride: int, size: int
) -> Tensor:
    """sum_k m[..., s t + k dil, ..., s t' + k dil, ...] over k < taps, along the paired
    dimensions ``dim`` and ``dim + 2`` (t, t' < size)."""
    total = None
    for k in range(taps):
        index = [slice(None)] * m.dim()
        index[dim] = index[dim + 2] = slice(
            k * dilation, k * dilation + stride * (size - 1) + 1, stride
        )
        view = m[tuple(index)]
        total = view.clone() if total is None else total.add_(view)
    return total


def conv_ghost_squared_norms(a: Tensor, g: Tensor, conv: nn.Conv2d) -> Tensor:
    """||G_i U_i^T||_F^2 per example from two T x T Gram matrices, in batch chunks that
    bound the transient memory."""
    positions = g.shape[2] * g.shape[3]
    _, _, height, width = a.shape
    padded = (height + 2 * conv.padding[0]) * (width + 2 * conv.padding[1])
    norms = [
        gram_inner(conv_patch_gram(a_c, conv), positions_gram(g_c.flatten(2)))
        for a_c, g_c in example_chunks(padded**2 + 2 * positions**2, a, g)
    ]
    return torch.cat(norms)


def positions_gram(g: Tensor) -> Tensor:
    """G_i^T G_i for G_i of shape (p, T): (B, T, T)."""
    return torch.bmm(g.transpose(1, 2), g)


def _weight_grad_kernel(
    a: Tensor, g: Tensor, conv: nn.Conv2d, weight_shape: tuple[int, ...], groups: int
) -> Tensor:
    """The weight gradient of a convolution with ``conv``'s geometry, input ``a`` and output
    gradient ``g``: aten's backward kernel, asked for the weight gradient alone."""
    weight = a.new_empty(1).expand(weight_shape)  # only its shape is read
    return torch.ops.aten.convolution_backward(
        g,
        a,
        weight,
        None,
        conv.stride,
        conv.padding,
        conv.dilation,
        False,
        [0, 0],
        groups,
        [False, True, False],
    )[1]


def conv_per_example_weight_grads(a: Tensor, g: Tensor, conv: nn.Conv2d) -> Tensor:
    """Per-example weight gradients (B, *weight.shape) in one grouped convolution: the B
    examples become B groups of one convolution's weight-gradient kernel (no unfolding)."""
    batch = len(a)
    if batch == 0:
        return a.new_zeros((0, *conv.weight.shape))
    out_ch, in_ch, kh, kw = conv.weight.shape
    grads = _weight_grad_kernel(
        a.reshape(1, batch * in_ch, *a.shape[2:]),
        g.reshape(1, batch * out_ch, *g.shape[2:]),
        conv,
        (batch * out_ch, in_ch, kh, kw),
        groups=batch,
    )
    return grads.view(batch, out_ch, in_ch, kh, kw)


def conv_weight_grad(a: Tensor, g: Tensor, conv: nn.Conv2d) -> Tensor:
    """sum_i G_i U_i^T: the ordinary weight-gradient kernel."""
    return _weight_grad_kernel(a, g, conv, tuple(conv.weight.shape), groups=1)


def scale_examples(g: Tensor, clip: Tensor) -> Tensor:
    """c_i G_i: the clip factor broadcast over each example's other dimensions."""
    return g * clip.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))


def conv_clipped_weight_sum(a: Tensor, g: Tensor, clip: Tensor, conv: nn.Conv2d) -> Tensor:
    """sum_i c_i G_i U_i^T, the factors applied to the smaller of A and G."""
    if a.shape[1:].numel() <= g.shape[1:].numel():
        return conv_weight_grad(scale_examples(a, clip), g, conv)
    return conv_weight_grad(a, scale_examples(g, clip), conv)


def group_statistics(a: Tensor, num_groups: int, eps: float) -> tuple[Tensor, Tensor]:
    """GroupNorm's mean and 1/std per (example, group), biased variance like GroupNorm."""
    grouped = a.reshape(len(a), num_groups, a.shape[1:].numel() // num_groups)
    var, mean = torch.var_mean(grouped, dim=2, correction=0)
    return mean, (var + eps).rsqrt()


def group_norm_per_example_grads(
    a: Tensor, g: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-example (weight, bias) gradients of GroupNorm's affine map y = x_hat w + b:
    sum_s G x_hat and sum_s G over positions s. With x_hat = (x - mu) rstd per group,
    sum_s G x_hat = rstd (sum_s G x - mu sum_s G): one batched dot product and no
    normalised copy of x."""
    batch, channels, positions = *a.shape[:2], a.shape[2:].numel()
    per_group = channels // mean.shape[1]
    g_dot_x = torch.bmm(
        g.reshape(batch * channels, 1, positions), a.reshape(batch * channels, positions, 1)
    ).view(batch, channels)
    bias_grads = g.reshape(batch, channels, positions).sum(2)
    mean = mean.repeat_interleave(per_group, dim=1)
    rstd = rstd.repeat_interleave(per_group, dim=1)
    return rstd * (g_dot_x - mean * bias_grads), bias_grads
