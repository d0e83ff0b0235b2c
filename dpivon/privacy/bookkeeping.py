"""Book-keeping per-example clipping: a private step in one backward pass.

Bu, Wang, Zha & Karypis, "Differentially private optimization on large model at small
cost" (ICML 2023), with the per-layer choice of mixed ghost clipping (Bu, Mao & Xu 2022).
Opacus keeps what it does well: the division by the expected batch size and the
accountant's step hook happen in `BookKeepingDPOptimizer`, an Opacus
``DPOptimizerFastGradientClipping`` that takes the clipped sum from ``p.grad`` and draws
its noise from the run's randomness (`dpivon.privacy.noise`), as every engine does.

One step, top to bottom:

1. Forward. Every supported layer (Conv2d, Linear, GroupNorm) keeps its input A, only in
   training mode with gradients enabled, so evaluation and ``no_grad`` forwards cost
   nothing. The outputs of the layers whose input needs no gradient (the first layer) are
   the *roots*.
2. Backward: ``torch.autograd.grad(B * loss, roots)``. To reach the roots autograd computes
   every layer's output gradient G (a tensor hook catches each), but no parameter
   gradient: the weight-gradient kernels, about a third of a backward pass, never run.
   ``B *`` undoes the mean reduction, as Opacus does with the actual batch size B.
3. As each G arrives, the layer's per-example squared gradient norms, and what step 5 will
   need (the rest is freed at once):
   - Conv2d: the ghost norm <U^T U, G^T G> over the unfolded input U when 2 T^2 < p d
     (T output positions, p outputs, d inputs per patch), keeping A and G; otherwise the
     per-example gradients themselves (one grouped convolution), keeping those;
   - Linear: ||a||^2 ||g||^2 without a sequence dimension, else the Conv2d rule;
   - GroupNorm: its per-example affine gradients, directly; biases: G summed over positions.
4. Clip factors c_i = min(1, C / (||g_i|| + 1e-6)), Opacus's formula.
5. The clipped sum sum_i c_i g_i of every parameter into ``p.grad``, one weighted
   contraction per layer: a weight-gradient kernel on the c-scaled G (G^T diag(c) A) for
   ghost layers, c^T [g_i] for materialised ones. Nothing stored survives this step.

Limits: each layer runs once per forward (no shared weights), inputs need no gradient, and
one backward per optimizer step (Poisson sampling accounts one batch per step). DP-IVON's
mc_samples > 1 averages per-example gradients over posterior samples before clipping,
which needs per-example gradients of every sample: the facade picks Opacus hooks for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F
from opacus.optimizers import DPOptimizerFastGradientClipping
from torch import Tensor, nn

from dpivon.errors import DpivonError
from dpivon.privacy.noise import NoiseFromRandomness

# The clipped sum of one parameter as a function of the clip factors c (shape (B,)).
WeightedSum = Callable[[Tensor], Tensor]
# Per-example tensors (Gram matrices, per-example gradients) are made for chunks of
# examples of at most this many elements (64 MB in fp32): their kernels' transient buffers
# then stay small next to the activations, also at batch sizes in the thousands.
_CHUNK_ELEMENTS = 1 << 24


# --- the math, one pure function per quantity ---------------------------------------------


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
        gram_inner(conv_patch_gram(a_c, conv), _positions_gram(g_c.flatten(2)))
        for a_c, g_c in example_chunks(padded**2 + 2 * positions**2, a, g)
    ]
    return torch.cat(norms)


def _positions_gram(g: Tensor) -> Tensor:
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


# --- per-layer rules: per-example squared norms and the clipped sums ------------------------


LayerResult = tuple[Tensor, dict[nn.Parameter, WeightedSum]]


def _trainable(param: nn.Parameter | None) -> bool:
    return param is not None and param.requires_grad


def _conv2d(conv: nn.Conv2d, a: Tensor, g: Tensor) -> LayerResult:
    squared = a.new_zeros(len(a))
    sums: dict[nn.Parameter, WeightedSum] = {}
    if _trainable(conv.bias):
        bias_grads = g.flatten(2).sum(2)
        squared += row_squared_norms(bias_grads)
        sums[conv.bias] = partial(weighted_row_sum, bias_grads)
    if _trainable(conv.weight):
        out_ch, in_ch, kh, kw = conv.weight.shape
        if prefer_ghost_norm(g.shape[2] * g.shape[3], out_ch, in_ch * kh * kw):
            squared += conv_ghost_squared_norms(a, g, conv)
            sums[conv.weight] = lambda clip: conv_clipped_weight_sum(a, g, clip, conv)
        else:
            chunks = [
                conv_per_example_weight_grads(a_c, g_c, conv)
                for a_c, g_c in example_chunks(conv.weight.numel(), a, g)
            ]
            squared += torch.cat([row_squared_norms(rows) for rows in chunks])
            sums[conv.weight] = partial(weighted_chunks_sum, chunks)
    return squared, sums


def _linear(linear: nn.Linear, a: Tensor, g: Tensor) -> LayerResult:
    batch = len(a)
    positions = math.prod(a.shape[1:-1])  # T: 1 without a sequence dimension
    a, g = a.reshape(batch, positions, a.shape[-1]), g.reshape(batch, positions, g.shape[-1])
    squared = a.new_zeros(batch)
    sums: dict[nn.Parameter, WeightedSum] = {}
    if _trainable(linear.bias):
        bias_grads = g.sum(1)
        squared += row_squared_norms(bias_grads)
        sums[linear.bias] = partial(weighted_row_sum, bias_grads)
    if _trainable(linear.weight):
        if positions == 1:  # g a^T has norm ||g|| ||a||
            squared += row_squared_norms(a) * row_squared_norms(g)
        elif prefer_ghost_norm(positions, *linear.weight.shape):
            squared += gram_inner(
                _positions_gram(a.transpose(1, 2)), _positions_gram(g.transpose(1, 2))
            )
        else:
            squared += row_squared_norms(torch.bmm(g.transpose(1, 2), a))
        sums[linear.weight] = lambda clip: (
            scale_examples(g, clip).flatten(0, 1).t() @ a.flatten(0, 1)
        )
    return squared, sums


def _group_norm(norm: nn.GroupNorm, saved: tuple[Tensor, ...], g: Tensor) -> LayerResult:
    a, mean, rstd = saved
    weight_grads, bias_grads = group_norm_per_example_grads(a, g, mean, rstd)
    squared = a.new_zeros(len(a))
    sums: dict[nn.Parameter, WeightedSum] = {}
    for param, grads in ((norm.weight, weight_grads), (norm.bias, bias_grads)):
        if _trainable(param):
            squared += row_squared_norms(grads)
            sums[param] = partial(weighted_row_sum, grads)
    return squared, sums


def _conv2d_limits(conv: nn.Conv2d) -> str | None:
    if conv.groups != 1:
        return f"groups={conv.groups} (only groups=1)"
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return f"padding {conv.padding!r}/{conv.padding_mode} (only numeric zero padding)"
    return None


def _save_input(module: nn.Module, a: Tensor, output: Tensor) -> Tensor:
    return a


def _save_group_norm(norm: nn.GroupNorm, a: Tensor, output: Tensor) -> tuple[Tensor, ...]:
    """The input and its group statistics, taken from autograd's GroupNorm node where it
    has them (no second pass over the input)."""
    node = output.grad_fn
    if type(node).__name__ == "NativeGroupNormBackward0":
        return a, node._saved_result1.detach(), node._saved_result2.detach()
    return (a, *group_statistics(a, norm.num_groups, norm.eps))


# Per layer type: what the forward keeps, the rule run on its output gradient, its limits.
_SAVE: dict[type[nn.Module], Callable[[nn.Module, Tensor, Tensor], object]] = {
    nn.GroupNorm: _save_group_norm,
}
_RULES: dict[type[nn.Module], Callable[[nn.Module, object, Tensor], LayerResult]] = {
    nn.Conv2d: _conv2d,
    nn.Linear: _linear,
    nn.GroupNorm: _group_norm,
}
_LIMITS: dict[type[nn.Module], Callable[[nn.Module], str | None]] = {nn.Conv2d: _conv2d_limits}


def trainable_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module that owns a trainable parameter directly."""
    for name, module in model.named_modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            yield name or type(model).__name__, module


def unsupported_layers(model: nn.Module) -> list[str]:
    """The trainable layers book-keeping cannot clip exactly, each with the reason."""
    problems = []
    for name, module in trainable_layers(model):
        if type(module) not in _RULES:
            problems.append(f"{name} ({type(module).__name__}: no book-keeping rule)")
        elif (limit := _LIMITS.get(type(module), lambda m: None)(module)) is not None:
            problems.append(f"{name} ({type(module).__name__}: {limit})")
    return problems


# --- the hooks -----------------------------------------------------------------------------


class BookKeeping:
    """Forward and tensor hooks on ``model`` that turn one backward pass into the clipped
    per-example gradient sum in every trainable ``p.grad`` (module docstring, steps 1-5)."""

    def __init__(self, model: nn.Module, max_grad_norm: float) -> None:
        problems = unsupported_layers(model)
        if problems:
            raise DpivonError(
                "engine bk cannot clip these layers exactly: "
                + "; ".join(problems)
                + " (use engine hooks, or auto, which picks it)"
            )
        self.max_grad_norm = max_grad_norm
        self._names = {module: name for name, module in trainable_layers(model)}
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._saved: dict[nn.Module, object] = {}  # what each layer's rule needs from forward
        self._roots: dict[nn.Module, Tensor] = {}
        self._squared_norms: list[Tensor] = []
        self._sums: dict[nn.Parameter, WeightedSum] = {}
        self._clipped_sum_ready = False
        self._handles = [model.register_forward_pre_hook(self._start_forward)]
        self._handles += [m.register_forward_hook(self._keep_input) for m in self._names]

    def remove(self) -> None:
        """Detach every hook from the model."""
        for handle in self._handles:
            handle.remove()
        self._clear()

    # step 1
    def _start_forward(self, model: nn.Module, inputs: tuple) -> None:
        if not (model.training and torch.is_grad_enabled()):
            return
        if any(isinstance(t, Tensor) and t.requires_grad for t in inputs):
            raise RuntimeError(
                "engine bk takes parameter gradients only: inputs must not require grad"
            )
        self._clear()  # a training forward that was never backpropagated leaves nothing behind

    def _keep_input(self, module: nn.Module, inputs: tuple, output: Tensor) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if module in self._saved:
            raise DpivonError(
                f"layer {self._names[module]!r} ran twice in one forward pass (shared "
                "weights): engine bk needs each layer once per step; use engine hooks"
            )
        (a,) = inputs
        self._saved[module] = _SAVE.get(type(module), _save_input)(module, a.detach(), output)
        if not a.requires_grad:
            self._roots[module] = output
        output.register_hook(partial(self._on_output_grad, module))

    # step 3
    def _on_output_grad(self, module: nn.Module, grad_output: Tensor) -> None:
        with torch.no_grad():
            squared, sums = _RULES[type(module)](
                module, self._saved.pop(module), grad_output.detach()
            )
        self._squared_norms.append(squared)
        self._sums.update(sums)

    # steps 2, 4, 5
    def backward(self, loss: Tensor, batch_size: int) -> None:
        """Backpropagate the mean-reduced ``loss`` of ``batch_size`` examples and leave the
        clipped per-example gradient sum in every trainable ``p.grad``."""
        if self._clipped_sum_ready:
            raise RuntimeError(
                "a second backward before optimizer.step(): each Poisson batch is one "
                "accounted step with one backward pass"
            )
        if not self._roots:
            raise RuntimeError(
                "backward without a recorded forward: the model must run in training mode "
                "with gradients enabled"
            )
        try:
            scale = torch.full_like(loss, float(batch_size))
            roots = list(self._roots.items())
            root_grads = torch.autograd.grad(
                loss, [output for _, output in roots], grad_outputs=scale, allow_unused=True
            )
            self._check_roots_reached(roots, root_grads)
            del roots, root_grads
            squared = loss.new_zeros(batch_size)
            for layer_squared in self._squared_norms:
                squared += layer_squared
            clip = clip_factors(squared, self.max_grad_norm)
            with torch.no_grad():
                for p in self._params:
                    weighted_sum = self._sums.get(p)
                    p.grad = torch.zeros_like(p) if weighted_sum is None else weighted_sum(clip)
        finally:
            self._clear()
        self._clipped_sum_ready = True

    def _check_roots_reached(
        self, roots: list[tuple[nn.Module, Tensor]], grads: tuple[Tensor | None, ...]
    ) -> None:
        """A root whose gradient came back although its rule never ran was modified in
        place after its layer (an inplace activation): autograd then stops past the layer."""
        for (module, _), grad in zip(roots, grads, strict=True):
            if grad is not None and module in self._saved:
                raise DpivonError(
                    f"the output of layer {self._names[module]!r} is modified in place (an "
                    "inplace activation?): engine bk needs it intact; use inplace=False or "
                    "engine hooks"
                )

    def take_clipped_sum(self) -> None:
        """Called by the optimizer's step: the clipped sum in p.grad is used up."""
        if not self._clipped_sum_ready:
            raise RuntimeError(
                "optimizer.step() without a book-keeping backward: call backward() on the "
                "loss of the private criterion first"
            )
        self._clipped_sum_ready = False

    def discard_clipped_sum(self) -> None:
        self._clipped_sum_ready = False

    def _clear(self) -> None:
        self._saved.clear()
        self._roots.clear()
        self._squared_norms.clear()
        self._sums.clear()


class ClippedLoss:
    """The mean loss of a batch whose ``backward()`` is book-keeping's (steps 2-5)."""

    def __init__(self, loss: Tensor, clipper: BookKeeping, batch_size: int) -> None:
        self.loss, self.clipper, self.batch_size = loss, clipper, batch_size

    def backward(self) -> None:
        self.clipper.backward(self.loss, self.batch_size)

    def item(self) -> float:
        return self.loss.item()

    def detach(self) -> Tensor:
        return self.loss.detach()


class BookKeepingLoss(nn.Module):
    """Wraps a mean-reduced criterion so that ``loss.backward()`` clips per example."""

    def __init__(self, criterion: nn.Module, clipper: BookKeeping) -> None:
        super().__init__()
        if getattr(criterion, "reduction", "mean") != "mean":
            raise ValueError("book-keeping expects a mean-reduced criterion")
        self.criterion, self.clipper = criterion, clipper

    def forward(self, logits: Tensor, target: Tensor) -> ClippedLoss:
        return ClippedLoss(self.criterion(logits, target), self.clipper, len(logits))


class BookKeepingDPOptimizer(NoiseFromRandomness, DPOptimizerFastGradientClipping):
    """Noise sigma C from the run's randomness, Opacus's division by the expected
    batch size and accountant hook, on the clipped sum a book-keeping backward left in
    ``p.grad`` (``pre_step`` copies it to ``p.summed_grad``, which ``add_noise`` reads).

    A step must follow exactly one such backward: under Poisson sampling a second one would
    add an example's contribution twice to one accounted step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, clipper: BookKeeping, **kwargs) -> None:
        super().__init__(optimizer, **kwargs)
        self.clipper = clipper

    def zero_grad(self, set_to_none: bool = False) -> None:
        super().zero_grad(set_to_none)
        self.clipper.discard_clipped_sum()

    def pre_step(self, closure: Callable[[], float] | None = None) -> bool:
        self.clipper.take_clipped_sum()
        return super().pre_step(closure)


__all__ = [
    "BookKeeping",
    "BookKeepingDPOptimizer",
    "BookKeepingLoss",
    "ClippedLoss",
    "clip_factors",
    "conv_ghost_squared_norms",
    "conv_patch_gram",
    "conv_per_example_weight_grads",
    "prefer_ghost_norm",
    "unsupported_layers",
]
