"""Tests for the model registry: Opacus compatibility, shapes, per-sample gradients, seeding."""

from __future__ import annotations

import pytest
import torch
from opacus import GradSampleModule
from opacus.validators import ModuleValidator
from torch import nn

from dpivon.errors import DpivonError
from dpivon.models import MODEL_NAMES, build_model

# Exact counts at 10 classes; they pin the architectures documented in the model docstrings.
EXPECTED_PARAMS = {
    "small-cnn": 24_458,
    "tanh-cnn": 551_466,
    "tramer-boneh-cnn": 550_570,
    "wrn-16-4": 2_748_890,
}
WITHOUT_NORMALISATION = {"tramer-boneh-cnn"}  # the reference network, as published


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_registry_names() -> None:
    assert set(MODEL_NAMES) == set(EXPECTED_PARAMS)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_opacus_validator_accepts(name: str) -> None:
    assert ModuleValidator.validate(build_model(name), strict=True) == []


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_no_batchnorm(name: str) -> None:
    modules = list(build_model(name).modules())
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules)
    has_group_norm = any(isinstance(m, nn.GroupNorm) for m in modules)
    assert has_group_norm == (name not in WITHOUT_NORMALISATION)


def test_tramer_boneh_cnn_is_the_reference_network_layer_for_layer() -> None:
    """ftramer/Handcrafted-DP models.py, CIFAR10_CNN: cfg [32, 32, M, 64, 64, M, 128, 128, M],
    conv3x3 padding 1 then tanh, max-pool 2, Linear(128 * 4 * 4, 128), tanh, Linear(128, 10)."""
    layers = [m for m in build_model("tramer-boneh-cnn").modules() if not list(m.children())]
    shapes = []
    for layer in layers:
        if isinstance(layer, nn.Conv2d):
            assert (layer.kernel_size, layer.padding, layer.stride) == ((3, 3), (1, 1), (1, 1))
            shapes.append(layer.out_channels)
        elif isinstance(layer, nn.MaxPool2d):
            assert layer.kernel_size == 2
            shapes.append("M")
        elif isinstance(layer, nn.Linear):
            shapes.append((layer.in_features, layer.out_features))
        else:
            shapes.append(type(layer).__name__)
    assert shapes == [
        32, "Tanh", 32, "Tanh", "M", 64, "Tanh", 64, "Tanh", "M", 128, "Tanh", 128, "Tanh", "M",
        "Flatten", (2048, 128), "Tanh", (128, 10),
    ]  # fmt: skip


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("num_classes", [10, 7])
def test_output_shape(name: str, num_classes: int) -> None:
    model = build_model(name, num_classes=num_classes)
    out = model(torch.randn(4, 3, 32, 32))
    assert out.shape == (4, num_classes)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_param_count(name: str) -> None:
    assert _num_params(build_model(name)) == EXPECTED_PARAMS[name]


# Opacus' hooks always trigger this torch warning when the input does not require grad.
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_per_sample_gradients_match_loop(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name)
    x = torch.randn(3, 3, 32, 32)
    y = torch.tensor([0, 3, 9])

    # Reference: one backward per example, before Opacus attaches its hooks.
    expected: list[list[torch.Tensor]] = []
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        expected.append([p.grad.detach().clone() for p in model.parameters()])

    model.zero_grad()
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    nn.functional.cross_entropy(gsm(x), y, reduction="sum").backward()
    for j, param in enumerate(model.parameters()):
        assert param.grad_sample.shape == (3, *param.shape)
        for i in range(len(x)):
            torch.testing.assert_close(param.grad_sample[i], expected[i][j], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_seeded_construction_is_reproducible(name: str) -> None:
    torch.manual_seed(123)
    first = build_model(name).state_dict()
    torch.manual_seed(123)
    second = build_model(name).state_dict()
    torch.manual_seed(124)
    third = build_model(name).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert any(not torch.equal(first[k], third[k]) for k in first)


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(DpivonError, match="unknown model 'resnet-9'") as info:
        build_model("resnet-9")
    for name in MODEL_NAMES:
        assert name in str(info.value)


def test_too_few_classes() -> None:
    with pytest.raises(DpivonError, match="num_classes"):
        build_model("small-cnn", num_classes=1)
