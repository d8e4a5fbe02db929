"""The byte-level GPT and its LightningModule: shapes, learning, tying, presets, config and a tiny fit."""

from __future__ import annotations

import copy
import math
import random

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from gasloc_lightning.data import ByteDataModule
from gasloc_lightning.models import (
    GPT,
    PRESETS,
    GPTConfig,
    LanguageModel,
    parameter_groups,
    warmup_cosine_factor,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


def tiny_config(**overrides) -> GPTConfig:
    return GPTConfig(**{"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32, **overrides})


def test_forward_shapes():
    model = GPT(tiny_config())
    idx = torch.randint(0, 256, (3, 17))
    assert model(idx).shape == (3, 17, 256)
    assert model(idx[:, :1]).shape == (3, 1, 256)


def test_forward_rejects_sequences_longer_than_block_size():
    model = GPT(tiny_config(block_size=8))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_attention_is_causal():
    model = GPT(tiny_config()).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10])


def test_loss_decreases_on_a_repeated_batch():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 256, (4, 33))
    x, y = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(256), abs=0.2)
    assert losses[-1] < 0.7 * losses[0]


def test_head_is_tied_to_token_embedding():
    model = GPT(tiny_config())
    assert model.lm_head.weight is model.wte.weight
    parameters = list(model.parameters())
    assert sum(p is model.wte.weight for p in parameters) == 1
    # counted once: total equals the sum over distinct tensors
    assert model.num_parameters() == sum(p.numel() for p in parameters)


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("tiny", 0.1e6, 0.2e6), ("small", 10e6, 12e6), ("gpt2_125m", 84e6, 88e6)],
)
def test_preset_parameter_counts(name, low, high):
    with torch.device("meta"):  # no memory, no init cost
        model = GPT(GPTConfig.preset(name))
    assert low <= model.num_parameters() <= high
    assert model.num_parameters(exclude_embeddings=True) < model.num_parameters()


def test_presets_are_named():
    assert set(PRESETS) == {"tiny", "small", "gpt2_125m"}
    assert GPTConfig.preset("tiny", dropout=0.1).dropout == 0.1
    with pytest.raises(ValueError, match="name"):
        GPTConfig.preset("huge")


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"n_embd": 30, "n_head": 4}, "n_embd"),
        ({"n_layer": 0}, "n_layer"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"block_size": 2.5}, "block_size"),
        ({"dropout": 1.0}, "dropout"),
        ({"bias": "yes"}, "bias"),
    ],
)
def test_config_validation_names_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        GPTConfig(**kwargs)


def test_warmup_cosine_schedule():
    factor = lambda step, max_steps=110: warmup_cosine_factor(  # noqa: E731
        step, warmup_steps=10, max_steps=max_steps, min_lr_ratio=0.1
    )
    assert factor(0) == pytest.approx(0.1)
    assert factor(9) == pytest.approx(1.0)
    assert factor(10) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(0.55)
    assert factor(110) == pytest.approx(0.1)
    assert factor(500) == pytest.approx(0.1)
    assert factor(500, max_steps=None) == 1.0


def test_no_weight_decay_on_embeddings_norms_and_biases():
    model = GPT(tiny_config(bias=True))
    decay, no_decay = parameter_groups(model)
    assert no_decay["weight_decay"] == 0.0 and "weight_decay" not in decay
    decayed = {id(p) for p in decay["params"]}
    assert id(model.wte.weight) not in decayed and id(model.wpe.weight) not in decayed
    assert id(model.blocks[0].ln_1.weight) not in decayed and id(model.blocks[0].mlp.fc.bias) not in decayed
    assert id(model.blocks[0].mlp.fc.weight) in decayed
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_language_model_accepts_config_dict_or_preset_name():
    assert LanguageModel(model=tiny_config()).config == tiny_config()
    fields = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}
    assert LanguageModel(model=fields).config == tiny_config()
    assert LanguageModel(model="tiny").config == GPTConfig.preset("tiny")


def test_language_model_from_a_hydra_config():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    config = OmegaConf.create(
        {
            "_target_": "gasloc_lightning.models.LanguageModel",
            "model": {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
            "optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3, "weight_decay": 0.05},
            "warmup_steps": 5,
        }
    )
    module = instantiate(config)
    optimizer = module.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, torch.optim.AdamW) and module.config == tiny_config()
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.05, 0.0]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 5)  # first warmup step


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"max_steps": 0}, "max_steps"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
        ({"optimizer": 3}, "optimizer"),
        ({"model": 5}, "model"),
        ({"model": {"n_layers": 2}}, "model"),
    ],
)
def test_language_model_validation_names_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        LanguageModel(**kwargs)


@pytest.fixture
def text_folder(tmp_path):
    words = "the gossip round mixes parameters between peers while local steps train each worker".split()
    rng = random.Random(0)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(12):
        text = " ".join(rng.choice(words) for _ in range(500)) + "\n"
        (folder / f"doc{i:02d}.txt").write_text(text)
    return folder


def test_two_epoch_fit_logs_metrics_and_checkpoint_loads(tmp_path, text_folder):
    pl.seed_everything(0)
    batch_size, block_size, steps = 8, 64, 10
    data = ByteDataModule(
        source=text_folder, block_size=block_size, batch_size=batch_size, val_fraction=0.2,
        val_batches=2, samples_per_epoch=5 * batch_size, cache_dir=tmp_path / "cache",
    )
    model = LanguageModel(model="tiny", warmup_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)

    metrics = trainer.callback_metrics
    assert trainer.current_epoch == 2 and trainer.global_step == steps
    assert metrics["train/tokens"].item() == steps * batch_size * block_size
    assert metrics["val/loss"].item() < math.log(256)
    assert metrics["val/ppl"].item() == pytest.approx(math.exp(metrics["val/loss"].item()), rel=1e-4)
    # max_steps=None took trainer.max_steps: the cosine ended at min_lr_ratio * 3e-4
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(3e-5)

    test_metrics = trainer.test(model, datamodule=data, verbose=False)[0]
    assert {"test/loss", "test/ppl"} <= set(test_metrics)

    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    restored = LanguageModel.load_from_checkpoint(path)  # weights_only: hyperparameters are plain
    assert restored.config == model.config and restored.tokens_seen == model.tokens_seen
    torch.testing.assert_close(restored.model.wte.weight, model.model.wte.weight)


def test_evaluation_ignores_metric_states_left_from_an_earlier_one(tmp_path, text_folder):
    """A module that comes back from the spawn launcher holds the metric states of its last validation;
    the next trainer.validate/test must measure the model alone (stale states planted by an update)."""
    data = ByteDataModule(source=text_folder, block_size=64, batch_size=8, val_fraction=0.2, val_batches=2,
                          cache_dir=tmp_path / "cache")
    model = LanguageModel(model="tiny")
    returned = copy.deepcopy(model)
    for metric in (returned.val_loss, returned.test_loss):
        metric.update(torch.tensor(100.0), weight=10_000)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    [clean] = trainer.validate(model, datamodule=data, verbose=False)
    [tested] = trainer.test(model, datamodule=data, verbose=False)
    [again] = trainer.validate(returned, datamodule=data, verbose=False)
    [tested_again] = trainer.test(returned, datamodule=data, verbose=False)
    assert again["val/loss"] == pytest.approx(clean["val/loss"], rel=1e-6)
    assert tested_again["test/loss"] == pytest.approx(tested["test/loss"], rel=1e-6)
