"""Canaries as training examples through the model's last layer: enrolled in the Poisson
sampler, their per-example gradients computed and clipped by the engine with the batch's,
scored on the privatised gradient (see the package docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from dpivon.errors import DpivonError
from dpivon.privacy.bookkeeping import BookKeepingLoss
from dpivon.privacy.engine import PER_SAMPLE_ENGINES
from dpivon.privacy.sampling import PoissonBatches
from dpivon.runs import TrainingSetup

_CANARY_STREAM = 0xCA7A_2023  # mixed into the seed: canary randomness is a stream of its own
# A canary's per-example gradient norm in clip norms: far outside C, so that an engine that
# clips too little (or reads the norm too small) lets it through at several times C.
CANARY_NORM_IN_CLIPS = 10.0
# Norm of a canary's input to the last layer: its weight gradient then holds all but
# 1 / (1 + HEAD_INPUT_NORM^2) of the squared norm, the rest is on the bias.
HEAD_INPUT_NORM = 10.0


# Canaries per weight of the last layer, at most: each drawn canary adds about C / sqrt(d)
# to the projections of the others on its output row, noise that grows with their number.
CANARIES_PER_HEAD_WEIGHT = 10


def check_canary_count(count: int, head: nn.Linear) -> None:
    limit = CANARIES_PER_HEAD_WEIGHT * head.weight.numel()
    if not 1 <= count <= limit:
        raise DpivonError(
            f"canaries must be in [1, {limit}] ({CANARIES_PER_HEAD_WEIGHT} per weight of the "
            f"model's last layer: more overlap until their noise drowns the signal), got {count}"
        )


def check_auditable_engine(engine: str) -> None:
    """Canaries take the data's path through bk and the per-sample engines; ghost computes
    per-example losses inside Opacus's two-pass loss, which the canaries' loss cannot
    enter (auto never picks it)."""
    if engine not in ("auto", "bk", *PER_SAMPLE_ENGINES):
        raise DpivonError(
            f"the audit cannot put canaries into engine {engine}'s clipping (it computes "
            f"norms inside Opacus's two-pass loss); audit engine bk or one of "
            f"{', '.join(PER_SAMPLE_ENGINES)}"
        )


def last_linear(model: nn.Module) -> nn.Linear:
    """The model's last nn.Linear: the layer whose input the canaries replace."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise DpivonError(f"{type(model).__name__} has no linear layer for the canaries")
    return linears[-1]


@dataclass(frozen=True)
class Canaries:
    """Canary j: an example whose input to the model's last linear layer is
    HEAD_INPUT_NORM * directions[j] and whose loss is linear in logit ``outputs[j]``,
    scaled so that its per-example gradient has L2 norm ``norms[j]``; in the run by its
    fair coin ``included[j]``.

    Its weight gradient is proportional to e_{o_j} v_j^T: random unit directions, so two
    canaries meet only on a shared output row, with inner product about 1 / sqrt(d) there;
    clipping keeps the direction, so a clipped canary adds C (times its weight share) along
    it, an unclipped one ``norms[j]``.
    """

    outputs: Tensor  # (m,) long
    directions: Tensor  # (m, d) float64, unit rows
    norms: Tensor  # (m,) float64
    included: Tensor  # (m,) bool

    @classmethod
    def draw(cls, head: nn.Linear, count: int, norm: float, seed: int) -> Canaries:
        """``count`` canaries of gradient norm ``norm`` on ``head``; outputs, directions and
        coins come from a generator derived from ``seed`` and used for nothing else."""
        check_canary_count(count, head)
        generator = canary_generator(seed, 0)
        outputs = torch.randint(head.out_features, (count,), generator=generator)
        directions = torch.randn(count, head.in_features, generator=generator, dtype=torch.float64)
        directions /= directions.norm(dim=1, keepdim=True)
        included = torch.rand(count, generator=generator) < 0.5
        norms = torch.full((count,), float(norm), dtype=torch.float64)
        return cls(outputs, directions, norms, included)


def canary_generator(seed: int, stream: int) -> torch.Generator:
    """A generator derived from ``seed`` and used for nothing else: the canaries' coins
    (stream 0) and signs (stream 1) must be independent of the run's randomness."""
    state = np.random.SeedSequence([seed, _CANARY_STREAM, stream]).generate_state(1, np.uint64)
    return torch.Generator().manual_seed(int(state[0]) & (2**63 - 1))


def subsampled_gaussian_log_ratio(x: Tensor, sample_rate: float, noise_multiplier: float) -> Tensor:
    """log [(1 - q) N(x; 0, sigma^2) + q N(x; 1, sigma^2)] / N(x; 0, sigma^2): how much more
    likely one step's projection x (in clipped canaries) is if a canary is in the
    population, Poisson-sampled at rate q, with noise sigma.

    The Neyman-Pearson statistic of one step, summed over steps: a plain sum of x would
    weigh the steps a canary missed as much as the one it was drawn in.
    """
    shift = (x - 0.5) / noise_multiplier**2
    return torch.logaddexp(
        torch.full_like(x, math.log1p(-sample_rate)), math.log(sample_rate) + shift
    )


class CanaryLoss(nn.Module):
    """The data's mean-reduced loss with the canary rows (labels -1 - j) in the mean:
    canary j adds scales[j] * logit[o_j], whose gradient on the logits is scales[j] e_{o_j}
    (``scales`` is read at every call: the canaries' signs change it each step)."""

    reduction = "mean"

    def __init__(self, criterion: nn.Module, outputs: Tensor, scales: Tensor) -> None:
        super().__init__()
        self.criterion, self.outputs, self.scales = criterion, outputs, scales

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        is_canary = target < 0
        data = ~is_canary
        total = logits.new_zeros(())
        if data.any():
            total = self.criterion(logits[data], target[data]) * data.sum()
        ids = (-1 - target[is_canary]).cpu()
        picked = logits[is_canary].gather(1, self.outputs[ids].to(logits.device)[:, None])
        total = total + (picked.squeeze(1) * self.scales[ids].to(logits)).sum()
        return total / len(logits)


class CanaryExamples:
    """One run's included canaries as training examples (module docstring).

    Built on a run's training setup, it enrolls them in the Poisson sampler, replaces
    their input to the last layer (a forward pre-hook), puts their loss into the
    criterion, and records every canary's projection of each privatised gradient. `take`
    is the run's batch filter: it notes which rows of a sampled batch are canaries and
    draws every canary's sign for the step.

    Why signs: the data's gradient along a canary's direction drifts slowly, so over the
    steps it would add up like a signal of its own, different for every canary; a canary
    whose gradient flips with a fresh secret sign each step (the projection is multiplied
    back) turns that drift, and the other canaries' overlap, into noise that averages out.
    """

    def __init__(self, canaries: Canaries, setup: TrainingSetup, seed: int) -> None:
        private = setup.private
        if private is None:
            raise ValueError("canaries need a private run")
        check_auditable_engine(private.engine)
        self.canaries = canaries
        self.plan = private.plan
        self.head = last_linear(setup.model)
        device = self.head.weight.device
        bias = self.head.bias is not None
        # per-example norm = scale * sqrt(s^2 + bias): s^2 on the weight, 1 on the bias
        spread = math.sqrt(HEAD_INPUT_NORM**2 + bias)
        self._scales = canaries.norms / spread
        self._signs = canary_generator(seed, 1)
        self.signs = torch.ones(len(canaries.norms), dtype=torch.float64)  # this step's
        self._step_scales = self._scales.clone()  # the loss's scales, signed for the step
        self._inputs = (HEAD_INPUT_NORM * canaries.directions).to(device)
        self._outputs = canaries.outputs.to(device)
        self._directions = canaries.directions.to(device)
        # x in clipped canaries: a clipped canary adds C s / spread along its direction
        self._unit = self.plan.max_grad_norm * HEAD_INPUT_NORM / spread
        self.transcript: list[Tensor] = []  # per step, x of every canary (`_score_if`)
        self.times_sampled = torch.zeros(len(canaries.norms), dtype=torch.long)
        self._rows = torch.zeros(0, dtype=torch.long)  # canary rows of the current batch
        self._drawn = torch.zeros(0, dtype=torch.long)  # and their canary ids
        self.head.register_forward_pre_hook(self._replace_inputs)
        self._install_loss(setup)
        self._wrap_step(private.optimizer)
        self._enroll(private.loader)

    def _enroll(self, loader: PoissonBatches) -> None:
        """Each included canary j becomes row N + i of the sampler's population: a blank
        input labelled -1 - j (data labels are >= 0)."""
        ids = self.canaries.included.nonzero().flatten()
        blanks = loader.features.new_zeros((len(ids), *loader.features.shape[1:]))
        loader.features = torch.cat([loader.features, blanks])
        loader.labels = torch.cat([loader.labels, (-1 - ids).to(loader.labels)])

    def _install_loss(self, setup: TrainingSetup) -> None:
        """bk clips in its loss's backward: the canaries' loss goes inside it."""
        scales = self._step_scales
        if isinstance(setup.criterion, BookKeepingLoss):
            inner = setup.criterion.criterion
            setup.criterion.criterion = CanaryLoss(inner, self.canaries.outputs, scales)
        else:
            setup.criterion = CanaryLoss(setup.criterion, self.canaries.outputs, scales)

    def take(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """The batch as sampled; its canary rows are noted for the forward pre-hook, and
        the step's signs drawn."""
        is_canary = y < 0
        self._rows = is_canary.nonzero().flatten()
        self._drawn = (-1 - y[is_canary]).cpu()
        self.times_sampled[self._drawn] += 1
        coins = torch.rand(len(self.signs), generator=self._signs) < 0.5
        self.signs = 1.0 - 2.0 * coins.to(torch.float64)
        self._step_scales.copy_(self._scales * self.signs)
        return x, y

    def _replace_inputs(self, module: nn.Module, inputs: tuple[Tensor, ...]) -> tuple[Tensor]:
        """The canary rows' input to the last layer, detached: no layer before it gets a
        gradient from a canary, and the engine computes its norm where it computes the
        data's."""
        (a,) = inputs
        if not (module.training and len(self._rows)):
            return (a,)
        rows = self._rows.to(a.device)
        crafted = self._inputs[self._drawn.to(a.device)].to(a.dtype)
        return (a.index_put((rows,), crafted),)

    def _wrap_step(self, optimizer: torch.optim.Optimizer) -> None:
        pre_step = optimizer.pre_step

        def step(*args, **kwargs) -> bool:
            return self._score_if(pre_step(*args, **kwargs))

        optimizer.pre_step = step

    @torch.no_grad()
    def _score_if(self, stepped: bool) -> bool:
        """After pre_step the weight's p.grad holds g_dp: record x_j = b <g_dp, e_o v_j> /
        unit times the step's sign of canary j, its projection in clipped canaries (unit /
        b: what one adds)."""
        if stepped:
            rows = self.head.weight.grad.to(torch.float64)[self._outputs]
            projection = (rows * self._directions).sum(1).cpu() * self.signs
            self.transcript.append(projection * self.plan.expected_batch_size / self._unit)
        return stepped

    @property
    def steps(self) -> int:
        return len(self.transcript)

    def noise_estimate(self) -> float:
        """sigma read off the transcript: 1.4826 x the median absolute deviation of every
        recorded x (robust to the few steps a canary was drawn in), floored at 1e-3 (a
        noise-off control may have nothing but the data's gradient there)."""
        x = torch.stack(self.transcript)
        deviation = (x - x.median()).abs().median()
        return max(1.4826 * float(deviation), 1e-3)

    def scores(self) -> Tensor:
        """score_j = sum_t `subsampled_gaussian_log_ratio`(x_tj; q, sigma_hat): the
        accounted q, and the noise the transcript shows (a function of the released
        gradients alone; a run with less noise than accounted is scored with the noise
        it had)."""
        x = torch.stack(self.transcript)
        ratios = subsampled_gaussian_log_ratio(x, self.plan.sample_rate, self.noise_estimate())
        return ratios.sum(0)
