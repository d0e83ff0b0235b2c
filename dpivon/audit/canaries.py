"""Gradient canaries as training examples: drawn on distinct coordinates, enrolled in the
Poisson sampler, clipped by the engine with the batch and scored on the privatised
gradient (see the package docstring)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import Tensor

from dpivon.errors import DpivonError
from dpivon.privacy.engine import PER_SAMPLE_ENGINES, PrivateTraining
from dpivon.privacy.sampling import PoissonBatches

_CANARY_STREAM = 0xCA7A_2023  # mixed into the seed: canary randomness is a stream of its own
# A canary's gradient norm in clip norms: clipped it adds C to the sum, unclipped 10 C.
CANARY_NORM_IN_CLIPS = 10.0


def check_canary_count(count: int, parameters: int) -> None:
    """Each canary takes a coordinate of its own: at most one per model parameter."""
    if not 1 <= count <= parameters:
        raise DpivonError(
            f"canaries must be in [1, {parameters}] (one coordinate each of the model's "
            f"{parameters} parameters), got {count}"
        )


def check_auditable_engine(engine: str) -> None:
    """Canaries enter the clipping of bk and the per-sample engines; ghost computes norms
    inside Opacus's two-pass loss, where no canary can be added (auto never picks it)."""
    if engine not in ("auto", "bk", *PER_SAMPLE_ENGINES):
        raise DpivonError(
            f"the audit cannot put canaries into engine {engine}'s clipping (it computes "
            f"norms inside Opacus's two-pass loss); audit engine bk or one of "
            f"{', '.join(PER_SAMPLE_ENGINES)}"
        )


@dataclass(frozen=True)
class Canaries:
    """Dirac gradient canaries c_j = norm_j * e_{k_j} on distinct coordinates k_j of the
    model's trainable parameters (flat indices into them, concatenated in order), each in
    the run by its fair coin ``included[j]``.

    Why Dirac: distinct coordinates make the canaries orthogonal, so the coordinate g_dp[k_j]
    a canary is scored on carries no cross-talk from the other canaries (random directions
    would each add about C / sqrt(P) of every other sampled canary) and only the isotropic
    DP noise and the data's own gradient on k_j compete with the signal. Clipping keeps the
    direction: a clipped canary adds exactly C e_{k_j}, an unclipped one norm_j e_{k_j}.
    """

    coordinates: Tensor  # (m,) long
    norms: Tensor  # (m,) float64
    included: Tensor  # (m,) bool

    @classmethod
    def draw(cls, parameters: int, count: int, norm: float, seed: int) -> Canaries:
        """``count`` canaries of L2 norm ``norm`` on random distinct coordinates of
        ``parameters`` ones, each included by a fair coin; coins and coordinates come from
        a generator derived from ``seed`` and used for nothing else."""
        check_canary_count(count, parameters)
        # A stream of its own: the coins must be independent of the run's randomness.
        state = np.random.SeedSequence([seed, _CANARY_STREAM]).generate_state(1, np.uint64)
        generator = torch.Generator().manual_seed(int(state[0]) & (2**63 - 1))
        coordinates = torch.randperm(parameters, generator=generator)[:count]
        included = torch.rand(count, generator=generator) < 0.5
        return cls(coordinates, torch.full((count,), float(norm), dtype=torch.float64), included)


def subsampled_gaussian_log_ratio(x: Tensor, sample_rate: float, noise_multiplier: float) -> Tensor:
    """log [(1 - q) N(x; 0, sigma^2) + q N(x; 1, sigma^2)] / N(x; 0, sigma^2): how much more
    likely one step's coordinate x (in clip norms, x = b g_dp[k] / C) is if a canary of
    clipped norm 1 is in the population, Poisson-sampled at rate q, with noise sigma.

    The Neyman-Pearson statistic of one step, summed over steps: a plain sum of x would
    weigh the steps a canary missed as much as the one it was drawn in.
    """
    shift = (x - 0.5) / noise_multiplier**2
    return torch.logaddexp(
        torch.full_like(x, math.log1p(-sample_rate)), math.log(sample_rate) + shift
    )


def dirac_sum(like: Tensor, rows: Tensor, local: Tensor, norms: Tensor, clip: Tensor) -> Tensor:
    """sum_i clip[rows_i] norms_i e_{local_i}, shaped like ``like``: the clipped sum of
    Dirac per-example gradients (rows: their places among the clip factors)."""
    total = torch.zeros_like(like).view(-1)
    total.index_add_(0, local, (clip[rows].to(norms) * norms).to(total))
    return total.view_as(like)


class CanaryExamples:
    """One run's included canaries as training examples (module docstring): enrolled in
    the Poisson sampler's population, their gradients clipped by the engine with the
    batch's, scored on the privatised gradient.

    Built on a run's private training, it enrolls in its sampler and hooks its engine; then
    for every batch the sampler yields, `take` the canary rows out before the training step
    (the data rows go on as usual).
    """

    def __init__(self, canaries: Canaries, private: PrivateTraining) -> None:
        self.canaries = canaries
        self.params = [p for p in private.optimizer.params if p.requires_grad]
        total = sum(p.numel() for p in self.params)
        coordinates = canaries.coordinates
        if coordinates.unique().numel() != coordinates.numel() or not (
            int(coordinates.min()) >= 0 and int(coordinates.max()) < total
        ):
            raise ValueError(f"canary coordinates must be distinct and in [0, {total})")
        device = self.params[0].device
        ends = torch.tensor([p.numel() for p in self.params]).cumsum(0)
        self._owner = torch.bucketize(coordinates, ends, right=True)  # parameter of canary j
        starts = ends - torch.tensor([p.numel() for p in self.params])
        self._local = (coordinates - starts[self._owner]).to(device)  # index inside it
        # per parameter holding canaries: (its index, the ids of its canaries)
        self._groups = [
            (index, ids)
            for index in range(len(self.params))
            if len(ids := (self._owner == index).nonzero().flatten())
        ]
        self._norms = canaries.norms.to(device)
        m = len(coordinates)
        self.plan = private.plan
        self._clips_per_unit = self.plan.expected_batch_size / self.plan.max_grad_norm
        self.transcript: list[Tensor] = []  # per step, x of every canary (`_score_if`)
        self.times_sampled = torch.zeros(m, dtype=torch.long)
        self._drawn = torch.zeros(0, dtype=torch.long)  # the canaries of the current batch
        self._stage = self._wire(private)
        self._enroll(private.loader)

    # sampling
    def _enroll(self, loader: PoissonBatches) -> None:
        """Each included canary j becomes row N + i of the sampler's population: a blank
        input labelled -1 - j (data labels are >= 0)."""
        ids = self.canaries.included.nonzero().flatten()
        blanks = loader.features.new_zeros((len(ids), *loader.features.shape[1:]))
        loader.features = torch.cat([loader.features, blanks])
        loader.labels = torch.cat([loader.labels, (-1 - ids).to(loader.labels)])

    def take(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """The data rows of a sampled batch; its canary rows are staged for the engine."""
        is_canary = y < 0
        self._drawn = (-1 - y[is_canary]).cpu()
        self.times_sampled[self._drawn] += 1
        self._stage()
        return x[~is_canary], y[~is_canary]

    # clipping: the drawn canaries' per-example gradients, as each engine takes them
    def _wire(self, private: PrivateTraining) -> Callable[[], None]:
        """Hook the engine; returns what `take` calls to stage the drawn canaries."""
        optimizer = private.optimizer
        pre_step = optimizer.pre_step
        if private.engine == "bk":
            clipper = optimizer.clipper

            def stage() -> None:
                clipper.add_examples(self._drawn_squared_norms(), self._drawn_sums())

            def step(*args, **kwargs) -> bool:
                return self._score_if(pre_step(*args, **kwargs))

        elif private.engine in PER_SAMPLE_ENGINES:

            def stage() -> None:
                pass

            def step(*args, **kwargs) -> bool:
                self._append_grad_samples()
                return self._score_if(pre_step(*args, **kwargs))

        else:
            check_auditable_engine(private.engine)
        optimizer.pre_step = step
        return stage

    def _drawn_of(self, index: int) -> tuple[Tensor, Tensor]:
        """(rows among the drawn, canary ids) of the drawn canaries on parameter ``index``."""
        rows = (self._owner[self._drawn] == index).nonzero().flatten()
        return rows, self._drawn[rows]

    def _drawn_squared_norms(self) -> Tensor:
        dtype = self.params[0].dtype
        return self._norms[self._drawn.to(self._norms.device)].square().to(dtype)

    def _drawn_sums(self) -> dict[torch.nn.Parameter, Callable[[Tensor], Tensor]]:
        """Per parameter: clip factors of the drawn canaries -> their clipped sum there."""
        sums = {}
        for index, p in enumerate(self.params):
            rows, ids = self._drawn_of(index)
            if len(ids):
                sums[p] = partial(
                    dirac_sum, p, rows.to(p.device), self._local[ids], self._norms[ids]
                )
        return sums

    @torch.no_grad()
    def _append_grad_samples(self) -> None:
        """The drawn canaries as rows after the batch's in every ``p.grad_sample``."""
        for index, p in enumerate(self.params):
            rows, ids = self._drawn_of(index)
            canary_rows = p.grad_sample.new_zeros((len(self._drawn), p.numel()))
            canary_rows[rows.to(p.device), self._local[ids]] = self._norms[ids].to(p.dtype)
            p.grad_sample = torch.cat([p.grad_sample, canary_rows.view(-1, *p.shape)])

    # scoring
    @torch.no_grad()
    def _score_if(self, stepped: bool) -> bool:
        """After pre_step p.grad holds g_dp: record x_j = b g_dp[k_j] / C, the step's
        coordinate of canary j in clip norms (C / b: what a clipped canary adds)."""
        if stepped:
            step = torch.empty(len(self.canaries.norms), dtype=torch.float64)
            for index, ids in self._groups:
                values = self.params[index].grad.view(-1)[self._local[ids]]
                step[ids] = values.to(torch.float64).cpu() * self._clips_per_unit
            self.transcript.append(step)
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
        gradients alone, so the bound stays valid; a run with less noise than accounted
        is scored with the noise it had)."""
        x = torch.stack(self.transcript)
        ratios = subsampled_gaussian_log_ratio(x, self.plan.sample_rate, self.noise_estimate())
        return ratios.sum(0)
