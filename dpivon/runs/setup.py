"""Wiring one run: seeds, device, data, model, optimizer and (private runs) Opacus with the
privacy plan; the checks that must pass before a run is opened; one optimizer step."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dpivon.config import SYNTHETIC_IMAGE_BYTES, TrainConfig
from dpivon.data import DataSplits, load_splits
from dpivon.errors import DpivonError
from dpivon.machine import check_memory
from dpivon.models import build_model
from dpivon.optim.build import build_optimizer
from dpivon.optim.ivon import IVON
from dpivon.optim.registry import IVONOptions
from dpivon.optim.rules import beta2_for_horizon_share, curvature_horizon_share
from dpivon.privacy.accounting import (
    check_fixed_noise_fits,
    check_reachable,
    sampling_schedule,
)
from dpivon.privacy.engine import PrivacyPlan, PrivateTraining, make_private, plan_privacy
from dpivon.privacy.noise import Randomness, SeededRandomness, mechanism_randomness
from dpivon.privacy.sampling import PoissonBatches, ShuffledBatches
from dpivon.privacy.tuning import check_tuning_cost


def parameters_finite(model: nn.Module) -> bool:
    """Divergence as a private run may see it: from the parameters (post-processing of the
    privatised gradients), never from the raw batch loss, which is not DP."""
    return bool(torch.stack([p.detach().isfinite().all() for p in model.parameters()]).all())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextmanager
def global_generators_restored() -> Iterator[None]:
    """The global generators (Python's, numpy's, torch's) as they were before the block,
    after it. A run seeds them (:func:`seed_everything`) because what it draws through them,
    the model's initialisation and IVON's weight noise, must repeat; its caller keeps its
    own streams. CUDA's generators are restored where CUDA was in use before the block."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DpivonError(f"device {name!r} requested but CUDA is not available; use cpu or auto")
    device = torch.device(name)
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise DpivonError(
                f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                "(cuda:0 ...); use one of them, or auto"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise DpivonError(f"device {name!r} requested but MPS is not available; use cpu or auto")
    return device


def synthetic_sizes(config: TrainConfig) -> tuple[int, int]:
    """(train, test) images of a synthetic data set: the test set a fifth of the training."""
    return config.data.synthetic_size, max(config.data.synthetic_size // 5, 10)


def load_data(config: TrainConfig) -> DataSplits:
    """The run's splits; synthetic images are made only where they fit in memory now."""
    if config.data.dataset == "synthetic":
        images = sum(synthetic_sizes(config))
        check_memory(f"data.synthetic_size={config.data.synthetic_size:,}",
                     images * SYNTHETIC_IMAGE_BYTES)  # fmt: skip
    return load_splits(
        config.data.dataset,
        data_path=config.data.data_path,
        val_size=config.data.val_size,
        per_class=config.data.per_class,
        seed=config.split_seed,
        synthetic_sizes=synthetic_sizes(config),
    )


@dataclass
class TrainingSetup:
    """The live training objects; ``model`` is the unwrapped network (shared parameters).

    ``randomness`` draws the batches (and, for private runs, the Poisson masks and the DP
    noise: secure unless research mode); ``criterion`` is the loss whose backward the
    engine needs.
    """

    model: nn.Module
    trained_module: nn.Module
    optimizer: torch.optim.Optimizer
    criterion: nn.Module
    ivon: IVON | None
    loader: PoissonBatches | ShuffledBatches
    randomness: Randomness
    private: PrivateTraining | None


def check_batch(config: TrainConfig, n_train: int) -> None:
    if config.training.batch_size > n_train:
        raise DpivonError(
            f"batch size {config.training.batch_size} is larger than the training set "
            f"({n_train} examples); lower --batch-size or use more data"
        )


def check_fits(config: TrainConfig, data: DataSplits) -> None:
    """What would fail once training starts, checked before a run is opened: a batch no
    larger than the training set, the device, and (private runs) the budget's plan."""
    n_train = len(data.train)
    check_batch(config, n_train)
    resolve_device(config.runtime.device)
    if config.is_private:
        privacy_plan(config, n_train)
    if (tuning := config.privacy.tuning) is not None:
        check_tuning_cost(tuning.quoted_rdp, tuning.quoted_epsilon, config.privacy.delta)


# Below this share of h learned by the last step, a run's curvature is as good as frozen:
# said before the run, not refused, since a frozen h is a valid ablation.
FROZEN_CURVATURE_SHARE = 0.5
# The share the warning's suggested beta2 gives.
LEARNING_CURVATURE_SHARE = 0.9


def planned_curvature_share(config: TrainConfig) -> float | None:
    """An IVON-family run's `curvature_horizon_share` at its last step (None for others)."""
    options = config.optimizer
    if not isinstance(options, IVONOptions):
        return None
    return curvature_horizon_share(options.beta2, config.planned_steps)


def frozen_curvature_warning(config: TrainConfig) -> str | None:
    """One line for an IVON-family run whose estimates can make less than
    FROZEN_CURVATURE_SHARE of h by its last step, with the beta2 that makes
    LEARNING_CURVATURE_SHARE of it; None for a run whose curvature learns."""
    share = planned_curvature_share(config)
    if share is None or share >= FROZEN_CURVATURE_SHARE:
        return None
    steps, beta2 = config.planned_steps, config.optimizer.beta2
    suggested = beta2_for_horizon_share(LEARNING_CURVATURE_SHARE, steps)
    return (
        f"{config.optimizer.name}'s curvature can learn at most {100 * share:.3g} % of h in "
        f"its {steps:,} steps (beta2 {beta2:g} keeps {100 - 100 * share:.3g} % of hess_init): h "
        "stays near "
        f"its start; beta2={suggested:.5f} learns {LEARNING_CURVATURE_SHARE:g} of it. The run "
        "goes on (a frozen curvature is a valid ablation)"
    )


def check_plan_reachable(config: TrainConfig, batch_size: int | None = None) -> None:
    """For a private run of ``config`` (at ``batch_size`` if given: the largest of a search
    space), before any data is loaded: `check_reachable`, or for a fixed noise
    multiplier `check_fixed_noise_fits`."""
    batch = config.training.batch_size if batch_size is None else batch_size
    if not 0 < batch <= config.data.train_size:
        return  # no sampling rate; the batch checks say what is wrong
    sample_rate, _ = sampling_schedule(config.data.train_size, batch)
    privacy = config.privacy
    steps = config.steps_at(batch)
    if privacy.fixed_noise_multiplier is not None:
        check_fixed_noise_fits(
            privacy.fixed_noise_multiplier,
            privacy.epsilon,
            privacy.delta,
            sample_rate,
            steps,
            privacy.accountant,
        )
        return
    check_reachable(privacy.epsilon, privacy.delta, sample_rate, steps, privacy.accountant)


def privacy_plan(config: TrainConfig, n_train: int) -> PrivacyPlan:
    """The noise and sampling that spend ``config``'s budget over ``n_train`` records."""
    return plan_privacy(
        target_epsilon=config.privacy.epsilon,
        delta=config.privacy.delta,
        max_grad_norm=config.privacy.max_grad_norm,
        accountant=config.privacy.accountant,
        dataset_size=n_train,
        batch_size=config.training.batch_size,
        epochs=config.training.epochs,
        steps_per_epoch=config.training.steps_per_epoch,
        noise_multiplier=config.privacy.fixed_noise_multiplier,
    )


def build_training(config: TrainConfig, data: DataSplits, device: torch.device) -> TrainingSetup:
    """Model, optimizer and batches for ``config``, private ones wired through Opacus."""
    check_batch(config, len(data.train))
    features, labels = (t.to(device) for t in data.train.tensors)
    n_train = len(labels)
    model = build_model(config.model.name).to(device)
    plan = None
    if config.is_private:
        plan = privacy_plan(config, n_train)
    optimizer = build_optimizer(
        config.optimizer,
        model.parameters(),
        dataset_size=n_train,
        grad_noise_std=plan.grad_noise_std if plan else 0.0,
    )
    ivon = optimizer if isinstance(optimizer, IVON) else None
    # DP noise, Poisson masks and noised validation scores (in non-private runs too)
    randomness = mechanism_randomness(
        config.runtime.seed, device, research=config.privacy.research_mode
    )
    if plan is None:  # no DP for the training records: the batches follow the seed
        shuffling = SeededRandomness(config.runtime.seed, device).generator
        loader = ShuffledBatches(
            features, labels, batch_size=config.training.batch_size, generator=shuffling
        )
        return TrainingSetup(
            model, model, optimizer, nn.CrossEntropyLoss(), ivon, loader, randomness, None
        )
    private = make_private(
        model,
        optimizer,
        features,
        labels,
        plan,
        engine=config.privacy.engine,
        randomness=randomness,
    )
    return TrainingSetup(
        model,
        private.module,
        private.optimizer,
        private.criterion,
        ivon,
        private.loader,
        randomness,
        private,
    )


def lr_scheduler(config: TrainConfig, setup: TrainingSetup) -> torch.optim.lr_scheduler.LambdaLR:
    total = max(config.training.epochs * len(setup.loader), 1)
    base = setup.ivon if setup.ivon is not None else setup.optimizer
    if isinstance(base, torch.optim.Optimizer) and hasattr(base, "original_optimizer"):
        base = base.original_optimizer
    if config.training.lr_schedule == "cosine":
        return torch.optim.lr_scheduler.LambdaLR(
            base, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
        )
    return torch.optim.lr_scheduler.LambdaLR(base, lambda step: 1.0)


def train_step(setup: TrainingSetup, x: torch.Tensor, y: torch.Tensor, mc_samples: int) -> float:
    """One optimizer step; for IVON, backprop at ``mc_samples`` posterior draws first."""
    if setup.ivon is None:
        setup.optimizer.zero_grad()
        loss = setup.criterion(setup.trained_module(x), y)
        loss.backward()
        setup.optimizer.step()
        return loss.item()
    total = 0.0
    for _ in range(mc_samples):
        with setup.ivon.sampled_params(train=True):
            setup.optimizer.zero_grad()
            loss = setup.criterion(setup.trained_module(x), y)
            loss.backward()
        total += loss.item()
    setup.optimizer.step()
    return total / mc_samples
