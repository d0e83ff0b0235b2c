"""Raw images to model input, predictions with uncertainty, the public optimizer API, and
the sweep's progress tally: fast checks of what the served model and the CLI are built on."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from ray.tune.experiment import Trial

from dpivon.data import ImageArrays, to_tensor_dataset
from dpivon.data.images import model_input, read_images
from dpivon.errors import DpivonError
from dpivon.evaluation import Posterior, predict_bma, predict_probs
from dpivon.evaluation.prediction import entropy, predict_with_uncertainty, predictions_frame
from dpivon.models import build_model
from dpivon.search.progress import SweepProgress, tally, tally_line
from dpivon.search.trial import COMPLETE, DIVERGED, GROUP_KEY

PIXELS = np.random.default_rng(0).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)


def test_model_input_takes_uint8_and_floats_in_either_layout_like_training():
    training = to_tensor_dataset(ImageArrays(PIXELS, np.zeros(5, np.int64), ("a",))).tensors[0]
    assert torch.equal(model_input(PIXELS), training)
    assert torch.equal(model_input(PIXELS.transpose(0, 3, 1, 2)), training)
    assert torch.equal(model_input(PIXELS.astype(np.int64)), training)  # JSON integers
    assert torch.allclose(model_input(PIXELS / 255.0), training, atol=1e-5)
    assert torch.equal(model_input(training.numpy(), cifar_normalised=True), training)


@pytest.mark.parametrize(
    ("images", "message"),
    [
        (PIXELS[0], "must be a batch"),
        (PIXELS[:, :16], "must be a batch"),
        (PIXELS * 1.0, "float images are in [0, 1]"),
        (PIXELS.astype(np.int64) + 1, "integer images are 0-255"),
        (np.full((1, 3, 32, 32), np.nan, np.float32), "NaN"),
        (PIXELS.astype(str), "dtype"),
    ],
)
def test_model_input_rejects_what_it_cannot_read_in_one_line(images, message):
    with pytest.raises(DpivonError, match=message.replace("[", r"\[")):
        model_input(images)


def test_read_images_reads_files_folders_and_batches(tmp_path):
    from PIL import Image

    for i in range(2):
        Image.fromarray(PIXELS[i]).save(tmp_path / f"{i}.png")
    np.save(tmp_path / "batch.npy", PIXELS[2:].transpose(0, 3, 1, 2))
    names, images = read_images([tmp_path, tmp_path / "batch.npy"])
    assert names == [str(tmp_path / "0.png"), str(tmp_path / "1.png")] + [
        f"{tmp_path / 'batch.npy'}[{i}]" for i in range(3)
    ]
    assert images.dtype == np.uint8 and np.array_equal(images, PIXELS)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "small.png")
    with pytest.raises(DpivonError, match="8x8 pixels"):
        read_images([tmp_path / "small.png"])
    with pytest.raises(DpivonError, match="does not exist"):
        read_images([tmp_path / "missing.jpg"])


def test_a_16_bit_png_is_scaled_to_8_bits_not_clipped_to_white(tmp_path):
    from PIL import Image

    wide = (np.arange(32 * 32, dtype=np.uint16).reshape(32, 32) * 64).astype(np.uint16)
    Image.fromarray(wide).save(tmp_path / "wide.png")  # Pillow's mode I;16
    _, images = read_images([tmp_path / "wide.png"])
    expected = np.round(wide / 257.0).astype(np.uint8)
    assert images.shape == (1, 32, 32, 3) and images.dtype == np.uint8
    assert all(np.array_equal(images[0, :, :, c], expected) for c in range(3))
    assert (images == 255).mean() < 0.01  # clipping would make nearly every pixel white


def test_read_images_names_an_npz_archive_and_a_file_that_is_no_image(tmp_path):
    np.savez(tmp_path / "arrays.npz", images=PIXELS)
    (tmp_path / "arrays.npz").rename(tmp_path / "arrays.npy")  # np.load opens it by content
    with pytest.raises(DpivonError, match=r"arrays\.npy is an \.npz archive"):
        read_images([tmp_path / "arrays.npy"])
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(DpivonError, match=r"cannot read the image .*notes\.png"):
        read_images([tmp_path / "notes.png"])


def _posterior(model: torch.nn.Module, hess: float) -> Posterior:
    return Posterior({n: torch.full_like(p, hess) for n, p in model.named_parameters()}, 500, 1e-4)


def test_uncertainty_is_the_bma_and_splits_its_entropy():
    torch.manual_seed(0)
    model = build_model("small-cnn")
    images = model_input(PIXELS)
    wide = _posterior(model, 0.05)
    got = predict_with_uncertainty(
        model, wide, images, 4, generator=torch.Generator().manual_seed(3)
    )
    bma = predict_bma(model, wide, images, 4, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(got.probs, bma, atol=1e-6)
    assert torch.allclose(got.entropy, entropy(bma))
    assert (got.mutual_information > 1e-4).all() and (got.mutual_information <= got.entropy).all()
    # a posterior without width: the draws agree, nothing to disagree about
    narrow = predict_with_uncertainty(model, _posterior(model, 1e9), images, 4)
    assert narrow.mutual_information.max() < 1e-5
    point = predict_with_uncertainty(model, None, images, 4)
    assert point.mutual_information is None
    assert torch.equal(point.probs, predict_probs(model, images))
    frame = predictions_frame(got, tuple("abcdefghij"))
    assert list(frame.columns[:5]) == ["class", "label", "probability", "entropy",
                                       "mutual_information"]  # fmt: skip
    assert (frame["probability"] == frame[[f"prob_{c}" for c in "abcdefghij"]].max(axis=1)).all()


def test_dpivon_optim_exports_its_optimizers_without_importing_torch_for_the_registry():
    import dpivon.optim
    from dpivon.optim import DPIVON, IVON, DPAdamBC
    from dpivon.optim.adambc import DPAdamBC as adambc_home
    from dpivon.optim.dp_ivon import DPIVON as dpivon_home
    from dpivon.optim.ivon import IVON as ivon_home

    assert sorted(dpivon.optim.__all__) == ["DPAdamBC", "DPIVON", "IVON"]
    assert (IVON, DPIVON, DPAdamBC) == (ivon_home, dpivon_home, adambc_home)
    with pytest.raises(ImportError):
        exec("from dpivon.optim import NotAnOptimizer", {})
    code = "import sys, dpivon.optim.registry; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _trial(trial_id: str, group: str, status: str, **result) -> Trial:
    trial = Trial("t", config={GROUP_KEY: group}, stub=True, trial_id=trial_id)
    trial.set_status(status)
    trial.run_metadata.last_result = result
    return trial


def test_progress_counts_the_whole_sweep_and_the_group_and_adds_up(capsys):
    trials = [
        _trial("a1", "a", Trial.TERMINATED, **{COMPLETE: True, "val_accuracy": 0.5}),
        _trial("a2", "a", Trial.TERMINATED),  # stopped by ASHA
        _trial("a3", "a", Trial.RUNNING),
        _trial("b1", "b", Trial.TERMINATED, **{DIVERGED: 1}),
        _trial("b2", "b", Trial.ERROR),
        _trial("b3", "b", Trial.RUNNING),
        _trial("b4", "b", Trial.PENDING),
    ]
    sweep = tally(trials, 10)
    assert sweep == {"completed": 1, "stopped early": 1, "failed": 2, "running": 2, "waiting": 4}
    assert tally(trials, 4, "a") == {
        "completed": 1, "stopped early": 1, "failed": 0, "running": 1, "waiting": 1
    }  # fmt: skip
    # the trial whose event is handled counts as what it became, though Tune still says RUNNING
    now = tally(trials, 10, now={"b3": "completed"})
    assert now["completed"] == 2 and now["running"] == 1 and sum(now.values()) == 10
    assert tally_line(sweep) == (
        "4/10 finished (1 completed, 1 stopped early, 2 failed), 2 running, 4 waiting"
    )
    # a private trial count (the random-trials bound): no total, nothing counted as waiting
    hidden = tally(trials, None)
    assert hidden["waiting"] is None and tally_line(hidden) == (
        "4 finished (1 completed, 1 stopped early, 2 failed), 2 running"
    )
    progress = SweepProgress("a", 4, 10, "val_accuracy", "max")
    trials[2].run_metadata.last_result = {COMPLETE: True, "val_accuracy": 0.75}
    progress.on_trial_complete(0, trials, trials[2])
    line = " ".join(capsys.readouterr().err.split())
    assert "a 3/4 finished (2 completed, 1 stopped early, 0 failed), 0 running, 1 waiting" in line
    assert "sweep 5/10 finished (2 completed, 1 stopped early, 2 failed), 1 running, 4 wait" in line


def test_a_model_file_that_dpivon_did_not_save_is_named_in_one_line(tmp_path):
    from dpivon.config import TrainConfig
    from dpivon.tracking.model_file import load_model_file, save_model_file

    config = TrainConfig(optimizer="dp-sgd", dataset="synthetic", model="small-cnn")
    save_model_file(tmp_path / "good.pt", config, build_model("small-cnn"), None)
    assert load_model_file(tmp_path / "good.pt")[0] == config
    saved = torch.load(tmp_path / "good.pt", weights_only=True)
    other_model = {**saved, "config": {**saved["config"], "model": {"name": "tanh-cnn"}}}
    cases = {
        "cut short": (tmp_path / "good.pt").read_bytes()[:500],
        "not a file dpivon wrote": bytes(range(256)) * 8,
        "holds a tuple": (1, 2),
        "lacks 'config', 'model_state', 'posterior'": {"weight": torch.zeros(2)},
        "layout version 2": {**saved, "format": 2},
        "does not hold a model dpivon saved": other_model,
    }
    for reason, content in cases.items():
        path = tmp_path / "model.pt"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            torch.save(content, path)
        with pytest.raises(DpivonError, match=r"model file .*model\.pt") as refused:
            load_model_file(path)
        assert reason in str(refused.value) and "\n" not in str(refused.value)
