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

The per-layer math is `dpivon.privacy.clipping_math`. Limits: each layer runs once per
forward (no shared weights), inputs need no gradient, and one backward per optimizer step
(Poisson sampling accounts one batch per step). DP-IVON's mc_samples > 1 averages
per-example gradients over posterior samples before clipping, which needs per-example
gradients of every sample: the facade picks Opacus hooks for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import partial

import torch
from opacus.optimizers import DPOptimizerFastGradientClipping
from torch import Tensor, nn

from dpivon.errors import DpivonError
from dpivon.privacy.clipping_math import (
    clip_factors,
    conv_clipped_weight_sum,
    conv_ghost_squared_norms,
    conv_patch_gram,
    conv_per_example_weight_grads,
    example_chunks,
    gram_inner,
    group_norm_per_example_grads,
    group_statistics,
    positions_gram,
    prefer_ghost_norm,
    row_squared_norms,
    scale_examples,
    weighted_chunks_sum,
    weighted_row_sum,
)
from dpivon.privacy.noise import NoiseFromRandomness

# The clipped sum of one parameter as a function of the clip factors c (shape (B,)).
WeightedSum = Callable[[Tensor], Tensor]

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
                positions_gram(a.transpose(1, 2)), positions_gram(g.transpose(1, 2))
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
