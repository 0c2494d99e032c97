"""Tests for aiayn.config: Table 3 presets, validation messages, serialisation, replace(), YAML
files."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from aiayn.cli import main
from aiayn.config import (
    PRESETS,
    ConfigError,
    ModelConfig,
    TrainConfig,
    load_yaml_config,
    parse_duration,
    preset,
)

VOCAB = 37000


def test_defaults_are_the_papers_base_model() -> None:
    config = ModelConfig(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB)
    assert config == preset("base", src_vocab_size=VOCAB)
    assert config.norm_first is False  # post-norm, as in §3.1
    assert config.positional_encoding == "sinusoidal"  # §3.5
    assert config.share_embeddings == "all"  # §3.4
    assert config.attention_dropout == 0.0


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # Table 3: N, d_model, d_ff, h, d_k, d_v, P_drop.
        ("base", (6, 512, 2048, 8, 64, 64, 0.1)),
        ("big", (6, 1024, 4096, 16, 64, 64, 0.3)),
    ],
)
def test_presets_match_table_3(name: str, expected: tuple) -> None:
    c = preset(name, src_vocab_size=VOCAB)
    assert c.n_encoder_layers == c.n_decoder_layers
    assert (c.n_encoder_layers, c.d_model, c.d_ff, c.n_heads, c.d_k, c.d_v, c.dropout) == expected


def test_preset_vocab_and_overrides() -> None:
    c = preset("tiny", src_vocab_size=100)
    assert c.tgt_vocab_size == 100
    c = preset("base", src_vocab_size=100, tgt_vocab_size=200, share_embeddings="none")
    assert (c.src_vocab_size, c.tgt_vocab_size) == (100, 200)
    c = preset("base", src_vocab_size=100, n_heads=16)
    assert c.d_k == c.d_v == 32


def test_every_preset_builds() -> None:
    for name in PRESETS:
        c = preset(name, src_vocab_size=VOCAB)
        assert c.d_k * c.n_heads == c.d_model


def test_unknown_preset_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown preset 'huge'.*base, big"):
        preset("huge", src_vocab_size=VOCAB)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"d_model": 500}, "d_model (500) must be divisible by n_heads (8)"),
        ({"n_heads": 7}, "d_model (512) must be divisible by n_heads (7)"),
        ({"dropout": -0.1}, "dropout (-0.1) must be in [0, 1)"),
        ({"dropout": 1.0}, "dropout (1.0) must be in [0, 1)"),
        ({"attention_dropout": 1.5}, "attention_dropout (1.5) must be in [0, 1)"),
        ({"positional_encoding": "rotary"}, "positional_encoding ('rotary') must be one of"),
        ({"share_embeddings": "encoder"}, "share_embeddings ('encoder') must be one of"),
        ({"d_model": "512"}, "d_model ('512') must be of type int"),
        ({"d_model": 512.0}, "d_model (512.0) must be of type int"),
        ({"n_heads": True}, "n_heads (True) must be of type int"),
        ({"dropout": "0.1"}, "dropout ('0.1') must be of type float"),
        ({"norm_first": "yes"}, "norm_first ('yes') must be of type bool"),
        ({"d_k": "64"}, "d_k ('64') must be of type int"),
        ({"d_ff": 0}, "d_ff (0) must be positive"),
        ({"n_heads": -8}, "n_heads (-8) must be positive"),
        ({"n_encoder_layers": 0}, "n_encoder_layers (0) must be >= 1"),
        ({"max_positions": 0}, "max_positions (0) must be >= 1"),
        ({"d_k": 0}, "d_k (0) must be positive"),
        ({"layer_norm_eps": 0.0}, "layer_norm_eps (0.0) must be > 0"),
        ({"pad_id": VOCAB}, f"pad_id ({VOCAB}) must be a valid token index"),
        (
            {"tgt_vocab_size": 32000},
            f"src_vocab_size ({VOCAB}) != tgt_vocab_size (32000)",
        ),
    ],
)
def test_bad_values_name_the_field_and_value(changes: dict[str, Any], message: str) -> None:
    values: dict[str, Any] = dict(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB)
    values.update(changes)
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig(**values)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_different_vocabularies_are_fine_without_full_sharing() -> None:
    for share in ("decoder", "none"):
        c = ModelConfig(src_vocab_size=100, tgt_vocab_size=200, share_embeddings=share)
        assert (c.src_vocab_size, c.tgt_vocab_size) == (100, 200)


def test_d_model_need_not_divide_by_heads_when_head_sizes_are_given() -> None:
    c = ModelConfig(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, d_model=500, d_k=64, d_v=32)
    assert (c.d_k, c.d_v) == (64, 32)


def test_head_sizes_default_to_d_model_over_h() -> None:
    c = ModelConfig(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, n_heads=16)
    assert (c.d_k, c.d_v) == (32, 32)
    c = ModelConfig(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, d_k=16)  # Table 3 row (B)
    assert (c.d_k, c.d_v) == (16, 64)


def test_integer_floats_are_stored_as_floats() -> None:
    c = ModelConfig.from_dict(dict(src_vocab_size=10, tgt_vocab_size=10, dropout=0))
    assert isinstance(c.dropout, float) and c.dropout == 0.0


def test_from_dict_rejects_unknown_keys_and_lists_valid_ones() -> None:
    values = dict(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, d_modle=512)
    with pytest.raises(ConfigError, match=r"unknown model config key\(s\): d_modle") as info:
        ModelConfig.from_dict(values)
    assert "d_model" in str(info.value)


def test_from_dict_requires_the_vocabulary_sizes() -> None:
    with pytest.raises(TypeError, match="src_vocab_size"):
        ModelConfig.from_dict({"tgt_vocab_size": VOCAB})


@pytest.mark.parametrize("name", ["base", "big", "tiny"])
def test_to_dict_from_dict_round_trip_through_json_and_yaml(name: str) -> None:
    config = preset(
        name, src_vocab_size=VOCAB, d_k=16, norm_first=True, positional_encoding="learned"
    )
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert ModelConfig.from_dict(yaml.safe_load(yaml.safe_dump(config.to_dict()))) == config


def test_config_is_frozen() -> None:
    config = preset("base", src_vocab_size=VOCAB)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_model = 1024  # type: ignore[misc]


def test_replace_rederives_head_sizes() -> None:
    base = preset("base", src_vocab_size=VOCAB)
    assert (base.replace(n_heads=16).d_k, base.replace(n_heads=16).d_v) == (32, 32)
    assert (base.replace(d_model=1024).d_k, base.replace(d_model=1024).d_v) == (128, 128)
    explicit = base.replace(d_model=1024, d_k=64)
    assert (explicit.d_k, explicit.d_v) == (64, 128)
    assert base.d_k == 64  # the original is untouched


def test_replace_keeps_explicit_head_sizes_for_other_fields() -> None:
    row_b = preset("base", src_vocab_size=VOCAB, d_k=16)
    assert row_b.replace(d_ff=1024).d_k == 16


def test_replace_validates() -> None:
    base = preset("base", src_vocab_size=VOCAB)
    with pytest.raises(ConfigError, match=re.escape("dropout (2.0) must be in [0, 1)")):
        base.replace(dropout=2.0)
    with pytest.raises(ConfigError, match="unknown model config key"):
        base.replace(heads=4)


# -- TrainConfig ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"d_modle": 256}, "model: unknown model config key(s): d_modle; valid keys:"),
        ({"d_model": 63}, "model: d_model (63) must be divisible by n_heads (4)"),
        ({"dropout": 1.5}, "model: dropout (1.5) must be in [0, 1)"),
        ({"src_vocab_size": 10}, "model.src_vocab_size is set from the tokenizer"),
    ],
)
def test_train_config_checks_the_model_overrides_when_it_is_built(
    model: dict, message: str
) -> None:
    """Not after the vocabulary and the data cache are made, where `model_config` is called."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig(src="a", tgt="b", preset="tiny", model=model)


def test_train_config_types_come_from_the_annotations() -> None:
    assert TrainConfig(src="a", tgt="b", lr_scale=2).lr_scale == 2.0  # an int is a float
    assert TrainConfig(tsv="a").src is None  # str | None
    for values, message in [
        ({"src": 1, "tgt": "b"}, "src (1) must be of type str | None"),
        ({"src": "a", "tgt": "b", "max_steps": "9"}, "max_steps ('9') must be of type int"),
        ({"src": "a", "tgt": "b", "model": []}, "model ([]) must be of type dict"),
        ({"src": "a", "tgt": "b", "progress": 1}, "progress (1) must be of type bool"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            TrainConfig(**values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"patience_metric": "bleu"}, "patience_metric ('bleu') needs valid_bleu"),
        ({"patience_metric": "acc"}, "patience_metric ('acc') must be one of loss, bleu"),
        ({"patience": -1}, "patience (-1) must be >= 0"),
        ({"seed": -1}, "seed (-1) must be >= 0"),
        ({"patience": 3}, "patience (3) needs a validation set: give valid_src and valid_tgt"),
        ({"patience": 3, "valid_tsv": "v", "valid_every": 0}, "patience (3) needs valid_every > 0"),
    ],
)
def test_early_stopping_settings_are_checked(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig(src="a", tgt="b", **values)


def test_early_stopping_on_bleu_with_valid_bleu_is_accepted() -> None:
    config = TrainConfig(
        src="a", tgt="b", valid_tsv="v", valid_bleu=True, patience=3, patience_metric="bleu"
    )
    assert (config.patience, config.patience_metric) == (3, "bleu")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("8h", 28800), ("1d", 86400), ("1h30m", 5400),
     (" 2.5h ", 9000), ("1H 30M", 5400), (".5m", 30)],
)  # fmt: skip
def test_a_duration_is_a_number_and_a_unit(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["30", "abc", "30x", "m30", "1h30", "", "-5m", "1.5.2h"])
def test_what_is_not_a_duration_is_refused_with_the_units(text: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"time_budget ({text!r}) must be a duration")):
        TrainConfig(src="a", tgt="b", time_budget=text)


def test_a_time_budget_without_a_unit_or_of_nothing_is_refused() -> None:
    with pytest.raises(ConfigError, match=re.escape("time_budget (1800) needs a unit: 1800s")):
        TrainConfig.from_dict({"src": "a", "tgt": "b", "time_budget": 1800})  # YAML's 1800
    with pytest.raises(ConfigError, match=re.escape("time_budget ('0s') must be longer than 0 s")):
        TrainConfig(src="a", tgt="b", time_budget="0s")
    assert TrainConfig(src="a", tgt="b", time_budget="30m").budget_seconds == 1800
    assert TrainConfig(src="a", tgt="b").budget_seconds is None


@pytest.mark.parametrize("text", ["none", "None", " NONE "])
def test_a_time_budget_of_none_is_no_budget(text: str) -> None:
    """How `--time-budget none` (or YAML's `none`, a string there) drops a recipe's budget."""
    config = TrainConfig(src="a", tgt="b", time_budget=text)
    assert (config.time_budget, config.budget_seconds) == (None, None)
    assert config.resolved_schedule == "inverse_sqrt"
    assert TrainConfig.from_dict({"src": "a", "tgt": "b", "time_budget": None}).time_budget is None


def test_schedule_auto_is_eq3_without_a_time_budget_and_linear_with_one() -> None:
    """The paper's recipes set no budget: their schedule stays Eq. 3."""
    assert TrainConfig(src="a", tgt="b").schedule == "auto"
    assert TrainConfig(src="a", tgt="b").resolved_schedule == "inverse_sqrt"
    assert TrainConfig(src="a", tgt="b", time_budget="1h").resolved_schedule == "linear"
    for name in ("inverse_sqrt", "linear", "cosine", "inverse_sqrt_cooldown"):
        config = TrainConfig(src="a", tgt="b", schedule=name, time_budget="1h")
        assert config.resolved_schedule == name
    with pytest.raises(ConfigError, match=re.escape("schedule ('exp') must be one of auto, inv")):
        TrainConfig(src="a", tgt="b", schedule="exp")


def test_ema_decay_and_precision_are_checked() -> None:
    with pytest.raises(ConfigError, match=re.escape("ema_decay (1.0) must be in [0, 1)")):
        TrainConfig(src="a", tgt="b", ema_decay=1)
    message = "precision ('fp16') must be one of auto, fp32, bf16"
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig(src="a", tgt="b", precision="fp16")
    assert TrainConfig(src="a", tgt="b").precision == "auto"


@pytest.mark.parametrize(
    ("old", "precision"),
    [
        ({"bf16": True}, "auto"),  # the old default: bf16 on a GPU (which auto now checks)
        ({"bf16": True, "cpu_bf16": False}, "auto"),
        ({"bf16": False}, "fp32"),
        ({"bf16": False, "cpu_bf16": False}, "fp32"),
        ({"cpu_bf16": True}, "bf16"),
        ({"bf16": True, "cpu_bf16": True}, "bf16"),
        ({"bf16": False, "cpu_bf16": True, "device": "cpu"}, "bf16"),  # bf16 on the CPU only
        ({"bf16": False, "cpu_bf16": True, "device": "cuda"}, "fp32"),
    ],
)
def test_the_precision_keys_of_earlier_releases_are_read_as_precision(
    old: dict[str, Any], precision: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="aiayn.config"):
        config = TrainConfig.from_dict({"src": "a", "tgt": "b", **old}, source="old.yaml")
    assert config.precision == precision
    assert f"old.yaml: {next(iter(old))}: " in caplog.text
    assert f"is read as precision: {precision}" in caplog.text
    assert "replaced by precision" in caplog.text


def test_old_and_new_precision_keys_together_are_refused_naming_both() -> None:
    values = {"src": "a", "tgt": "b", "cpu_bf16": True, "precision": "fp32"}
    message = (
        "x.yaml: cpu_bf16: True and precision ('fp32') both given: cpu_bf16 is replaced by "
        "precision; give precision alone"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig.from_dict(values, source="x.yaml")
    with pytest.raises(ConfigError, match=re.escape("bf16 ('yes') must be true or false")):
        TrainConfig.from_dict({"src": "a", "tgt": "b", "bf16": "yes"})


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("max_steps: 10\nsrc: a.txt\n  tgt: [b\n", "3:6", "mapping values are not allowed here"),
        (
            'max_steps: 10\nsrc: "a.txt\n',
            "3:1",
            "found unexpected end of stream (while scanning a quoted scalar at 2:6)",
        ),
        ("a: 1\n\tb: 2\n", "2:1", "found character '\\t' that cannot start any token"),
    ],
    ids=["mapping", "unclosed-quote", "tab"],
)
def test_a_yaml_syntax_error_is_one_line_with_file_line_and_column(
    text: str, where: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_yaml_config(path)
    assert str(raised.value) == f"{path}:{where}: not valid YAML: {problem}"
    assert main(["train", "-c", str(path)]) == 2
    assert capsys.readouterr().err == f"aiayn train: error: {raised.value}\n"
