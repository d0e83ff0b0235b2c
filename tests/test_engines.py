"""Clipping engines against Opacus hooks: the same clipped gradient, the same noise, and
clear refusals of what an engine cannot do exactly."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from opacus import GradSampleModule
from torch import nn
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.config import parse_config
from dpivon.errors import DpivonError
from dpivon.evaluation import Posterior, posterior_draws, predict_bma, predict_probs
from dpivon.models import build_model
from dpivon.optim.dp_ivon import DPIVON
from dpivon.privacy.bookkeeping import BookKeeping, BookKeepingLoss
from dpivon.privacy.clipping_math import conv_patch_gram, prefer_ghost_norm
from dpivon.privacy.engine import (
    make_private,
    plan_privacy,
    resolve_engine,
    wire_grad_sample_mode,
)
from dpivon.privacy.names import ENGINES as ENGINE_TABLE
from dpivon.privacy.names import Engine
from dpivon.privacy.noise import SeededRandomness
from dpivon.runs import build_training, load_data, resolve_device, train, train_step
from dpivon.search.space import load_search_space

ENGINES = ("bk", "functorch", "ew", "ghost")
N_TRAIN = 48


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def per_example_norms(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    module = GradSampleModule(copy.deepcopy(model))
    nn.functional.cross_entropy(module(x), y).backward()
    squares = [p.grad_sample.flatten(1).double().square().sum(1) for p in module.parameters()]
    return torch.stack(squares).sum(0).sqrt()


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.0)


def noise_free_private(model: nn.Module, data, clip: float, engine: str, optimizer=sgd):
    """A deep copy of ``model`` wired for ``engine`` with sigma = 0 and lr = 0: every step
    leaves the clipped mean gradient in p.grad and keeps the weights."""
    plan = plan_privacy(
        target_epsilon=math.inf,
        delta=1e-5,
        max_grad_norm=clip,
        accountant="rdp",
        dataset_size=N_TRAIN,
        batch_size=4,
        epochs=1,
    )
    copy_ = copy.deepcopy(model)
    randomness = SeededRandomness(0, torch.device("cpu"))
    private = make_private(
        copy_, optimizer(copy_.parameters()), *data, plan, engine=engine, randomness=randomness
    )
    return copy_, private


def clipped_means(model: nn.Module, private, batches) -> list[torch.Tensor]:
    out = []
    for x, y in batches:
        private.optimizer.zero_grad()
        private.criterion(private.module(x), y).backward()
        private.optimizer.step()
        out.append(flat_grad(model).clone())
    return out


# Wide-ResNet pools globally: at 16 x 16 it still has every layer kind and layers on both
# of mixed ghost clipping's paths (`prefer_ghost_norm`), at a quarter of the compute.
@pytest.mark.parametrize(("name", "side"), [("small-cnn", 32), ("tanh-cnn", 32), ("wrn-16-4", 16)])
def test_every_engine_gives_the_clipped_mean_gradient_of_hooks(name, side):
    torch.manual_seed(0)
    model = build_model(name)
    data = (torch.randn(N_TRAIN, 3, side, side), torch.randint(0, 10, (N_TRAIN,)))
    # Poisson batches of 0, 1 and a varying number of examples (the loader's own draws).
    _, private = noise_free_private(model, data, 1.0, "hooks")
    drawn = [b for b in private.loader if 2 <= len(b[1]) <= 6][:2]
    assert len(drawn) == 2 and len(drawn[0][1]) != len(drawn[1][1])
    x, y = data
    batches = [(x[:0], y[:0]), (x[:1], y[:1]), *drawn]
    norms = torch.cat([per_example_norms(model, *batch) for batch in drawn])
    active = float(norms.min() + norms.max()) / 2  # some examples clipped, some not
    assert (norms > active * 1.01).any() and (norms < active * 0.99).any()
    for clip in (1e6, active):
        hooks_copy, hooks = noise_free_private(model, data, clip, "hooks")
        expected = clipped_means(hooks_copy, hooks, batches)
        assert expected[0].abs().max() == 0
        for engine in ENGINES:
            copy_, private = noise_free_private(model, data, clip, engine)
            assert private.engine == engine
            got = clipped_means(copy_, private, batches)
            for size, g, e in zip((len(b[1]) for b in batches), got, expected, strict=True):
                error = ((g - e).norm() / e.norm().clamp(min=1e-30)).item()
                assert error <= 1e-4, f"{engine}, C={clip:.3g}, batch of {size}: {error:.2e}"
            assert private.steps_taken == len(batches)  # empty batches are accounted too


def dp_ivon_two_samples(params) -> DPIVON:
    return DPIVON(params, lr=0.0, ess=100.0, grad_noise_std=0.0, mc_samples=2, hess_approx="gradsq")


def test_per_sample_engines_average_mc_samples_before_clipping():
    """DP-IVON with 2 MC samples: functorch and ew give hooks' clipped mean (also empty)."""
    torch.manual_seed(0)
    model = build_model("small-cnn")
    data = (torch.randn(N_TRAIN, 3, 32, 32), torch.randint(0, 10, (N_TRAIN,)))
    results = {}
    for engine in ("hooks", "functorch", "ew"):
        copy_, private = noise_free_private(model, data, 5.0, engine, dp_ivon_two_samples)
        ivon = private.optimizer.original_optimizer
        torch.manual_seed(1)
        results[engine] = []
        for size in (0, 6):
            for _ in range(2):
                with ivon.sampled_params(train=True):
                    private.optimizer.zero_grad()
                    loss = private.criterion(private.module(data[0][:size]), data[1][:size])
                    loss.backward()
            private.optimizer.step()
            results[engine].append(flat_grad(copy_).clone())
    for engine in ("functorch", "ew"):
        for got, expected in zip(results[engine], results["hooks"], strict=True):
            assert (got - expected).norm() <= 1e-4 * expected.norm()
    assert results["hooks"][1].norm() > 0


@pytest.mark.parametrize("engine", ["hooks", *ENGINES])
def test_noise_std_is_sigma_c_over_b_for_every_engine(engine):
    """A real step through build_training and train_step: g_dp minus the noise-free clipped
    mean of the same batch and weights has per-coordinate std sigma C / b and mean 0."""
    config = parse_config(
        {
            "dataset": "synthetic",
            "synthetic_size": 600,
            "model": "small-cnn",
            "optimizer": "dp-sgd",
            "batch_size": 16,
            "epochs": 1,
            "epsilon": 2.0,
            "max_grad_norm": 0.5,
            "engine": engine,
            "device": "cpu",
        }
    )
    setup = build_training(config, load_data(config), resolve_device("cpu"))
    assert setup.private.engine == engine
    for group in setup.optimizer.param_groups:
        group["lr"] = 0.0
    x, y = next(iter(setup.loader))
    train_step(setup, x, y, mc_samples=1)
    g_dp = flat_grad(setup.model).clone()
    setup.optimizer.noise_multiplier = 0.0
    train_step(setup, x, y, mc_samples=1)
    noise = g_dp - flat_grad(setup.model)
    plan = setup.private.plan
    std = plan.noise_multiplier * plan.max_grad_norm / plan.expected_batch_size
    n = noise.numel()
    assert setup.private.steps_taken == 2
    assert noise.std().item() == pytest.approx(std, rel=5 / math.sqrt(2 * n))
    assert abs(noise.mean().item()) < 5 * std / math.sqrt(n)


def test_auto_is_bk_where_exact_and_hooks_elsewhere():
    for name in ("small-cnn", "tanh-cnn", "tramer-boneh-cnn", "wrn-16-4"):
        assert resolve_engine("auto", build_model(name)) == "bk"
    assert resolve_engine("auto", build_model("small-cnn"), mc_samples=2) == "hooks"
    assert resolve_engine("auto", nn.Sequential(nn.Conv2d(4, 4, 3, groups=2))) == "hooks"


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def test_layers_an_engine_cannot_handle_are_named():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), Scale(), nn.Flatten(), nn.Linear(4 * 30 * 30, 10))
    for engine in ("bk", "ew"):
        with pytest.raises(DpivonError, match=r"engine .*\b1 \(Scale"):
            resolve_engine(engine, model)
    assert resolve_engine("hooks", model) == "hooks"  # Opacus falls back to functorch
    grouped = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2))
    with pytest.raises(DpivonError, match=r"0 \(Conv2d: groups=2"):
        resolve_engine("bk", grouped)
    batch_norm = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    for engine in ("auto", "bk", "hooks", "ghost"):
        with pytest.raises(DpivonError, match=r"1 \(BatchNorm2d: BatchNorm cannot"):
            resolve_engine(engine, batch_norm)
    with pytest.raises(DpivonError, match="unknown engine 'fast'"):
        resolve_engine("fast", model)


def test_one_backward_engines_refuse_mc_samples():
    for engine in ("bk", "ghost"):
        with pytest.raises(DpivonError, match="mc_samples"):
            parse_config({"optimizer": "dp-ivon-gradsq", "mc_samples": 2, "engine": engine})
        with pytest.raises(DpivonError, match="mc_samples=2"):
            resolve_engine(engine, build_model("small-cnn"), mc_samples=2)


def test_bk_keeps_nothing_outside_a_training_step():
    torch.manual_seed(0)
    model = build_model("small-cnn")
    clipper = BookKeeping(model, max_grad_norm=1.0)
    criterion = BookKeepingLoss(nn.CrossEntropyLoss(), clipper)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    model.eval()
    model(x)
    model.train()
    with torch.no_grad():
        model(x)
    assert not clipper._saved and not clipper._roots  # no hook stored anything
    criterion(model(x), y).backward()
    assert not clipper._saved and not clipper._roots and not clipper._sums
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(RuntimeError, match="second backward"):
        criterion(model(x), y).backward()
    clipper.take_clipped_sum()
    with pytest.raises(RuntimeError, match="without a book-keeping backward"):
        clipper.take_clipped_sum()


def test_bk_refuses_what_it_would_get_wrong():
    shared = nn.Linear(4, 4)
    twice = nn.Sequential(shared, nn.Tanh(), shared)
    BookKeeping(twice, max_grad_norm=1.0)
    with pytest.raises(DpivonError, match="ran twice"):
        twice(torch.randn(2, 4))
    inplace = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    criterion = BookKeepingLoss(nn.CrossEntropyLoss(), BookKeeping(inplace, 1.0))
    with pytest.raises(DpivonError, match="modified in place"):
        criterion(inplace(torch.randn(3, 4)), torch.tensor([0, 1, 0])).backward()


def test_space_time_rule_matches_the_brief():
    """Materialise convs 1-4 of the tanh CNN, ghost norms for convs 5-6 (design brief)."""
    convs = [(32, 3), (32, 32), (16, 32), (16, 64), (8, 64), (8, 128)]  # (size, in)
    outs = [32, 32, 64, 64, 128, 128]
    ghost = [prefer_ghost_norm(s * s, p, c * 9) for (s, c), p in zip(convs, outs, strict=True)]
    assert ghost == [False, False, False, False, True, True]


@pytest.mark.parametrize(
    ("size", "kernel", "stride", "padding", "dilation"),
    [(9, 3, 1, 1, 1), (10, 3, 2, 1, 1), (11, 3, 1, 2, 2), (8, 1, 2, 0, 1), (40, 5, 2, 2, 1)],
)
def test_patch_gram_is_the_gram_of_the_unfolded_input(size, kernel, stride, padding, dilation):
    """Both paths (unfolding, and shifted views of the padded input's Gram) are exact."""
    conv = nn.Conv2d(2, 3, kernel, stride=stride, padding=padding, dilation=dilation)
    a = torch.randn(3, 2, size, size, dtype=torch.float64)
    u = nn.functional.unfold(a, kernel, dilation, padding, stride)
    torch.testing.assert_close(conv_patch_gram(a, conv), u.transpose(1, 2) @ u)


def test_bma_is_one_forward_pass_per_sample_and_the_same_draws():
    torch.manual_seed(0)
    model = build_model("small-cnn")
    hess = {name: torch.rand_like(p) for name, p in model.named_parameters()}
    posterior = Posterior(hess, ess=500.0, weight_decay=1e-4)
    images = torch.randn(50, 3, 32, 32)
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    bma = predict_bma(
        model,
        posterior,
        images,
        3,
        generator=torch.Generator().manual_seed(1),
        batch_size=20,
        draws_per_call=1,  # one draw after another (the CPU's plan; GPUs batch draws)
    )
    handle.remove()
    assert len(calls) == 3 * 3  # 3 draws x 3 batches, no other forward
    with posterior_draws(model, posterior, torch.Generator().manual_seed(1)) as draw:
        by_hand = []
        for _ in range(3):
            draw()
            by_hand.append(predict_probs(model, images, batch_size=20))
    torch.testing.assert_close(bma, (by_hand[0] + by_hand[1] + by_hand[2]) / 3, rtol=0, atol=0)
    mean = predict_probs(model, images)
    assert not torch.equal(mean, bma)  # the parameters are the mean again after the draws
    torch.testing.assert_close(predict_probs(model, images), mean, rtol=0, atol=0)


def test_a_search_space_can_choose_the_engine(tmp_path):
    path = tmp_path / "dp-ivon-gradsq.yaml"
    path.write_text(
        "optimizer: dp-ivon-gradsq\n"
        "params:\n"
        "  lr: {type: float, low: 0.5, high: 5.0, log: true}\n"
        "  engine: {type: categorical, choices: [bk, hooks]}\n"
    )
    space = load_search_space(path)
    config = parse_config(space.trial_config({"lr": 1.0, "engine": "bk"}))
    assert config.privacy.engine == "bk"


SHORT_RUN = {
    "dataset": "synthetic",
    "synthetic_size": 300,
    "model": "small-cnn",
    "optimizer": "dp-ivon-gradsq",
    "batch_size": 32,
    "epochs": 1,
    "bma_samples": 2,
    "research_mode": True,  # the same seeded noise in every run: engines compare exactly
}


def test_cli_engine_hooks_and_the_default_train_the_same_model(tmp_path):
    """Noise comes from the same generator and the clipped sums agree: same parameters."""
    config = parse_config(SHORT_RUN)
    data = load_data(config)
    default = train(config, data=data, evaluate_test=False)
    hooks = train(config.replace(engine="hooks"), data=data, evaluate_test=False)
    assert (default.engine, hooks.engine) == ("bk", "hooks")
    assert default.summary()["engine"] == "bk"
    a, b = (
        torch.cat([p.flatten() for p in r.model.state_dict().values()]) for r in (hooks, default)
    )
    assert ((a - b).norm() / a.norm()).item() < 1e-4

    out, config_file = tmp_path / "out.json", tmp_path / "run.yaml"
    config.save(config_file)
    result = CliRunner().invoke(
        app,
        [
            "train",
            f"--config={config_file}",
            "--engine=hooks",
            f"--json={out}",
            "--no-log-model",
            f"--tracking-uri=sqlite:///{tmp_path}/mlflow.db",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert summary["engine"] == "hooks"
    assert summary["val_nll"] == pytest.approx(hooks.val["nll"], rel=1e-9)
    assert summary["val_nll"] == pytest.approx(default.val["nll"], rel=1e-4)


WIRED: list[str] = []


def counting_hooks_wiring(engine, model, optimizer, noise):
    """A toy engine: Opacus hooks, recording that it was the one wired."""
    WIRED.append(engine)
    return wire_grad_sample_mode("hooks", model, optimizer, noise)


def test_an_engine_is_one_entry_in_one_table(monkeypatch):
    keys = {
        "dataset": "synthetic", "synthetic_size": 200, "optimizer": "dp-sgd", "epsilon": 8.0,
        "epochs": 1, "batch_size": 32, "device": "cpu", "engine": "toy",
    }  # fmt: skip
    with pytest.raises(DpivonError, match="unknown engine 'toy'"):
        parse_config(keys)
    monkeypatch.setitem(ENGINE_TABLE, "toy", Engine(f"{__name__}:counting_hooks_wiring", False))
    WIRED.clear()
    result = train(parse_config(keys), evaluate_test=False)
    assert WIRED == ["toy"] and result.engine == "toy"
    assert result.history[-1]["steps"] == parse_config(keys).planned_steps
    # the entry's one flag carries the engine's one rule: one backward, one posterior sample
    monkeypatch.setitem(ENGINE_TABLE, "toy", Engine(f"{__name__}:counting_hooks_wiring", True))
    ivon = {**keys, "optimizer": "dp-ivon-gradsq", "mc_samples": 2}
    with pytest.raises(DpivonError, match="engine toy clips the gradients of one backward"):
        parse_config(ivon)
