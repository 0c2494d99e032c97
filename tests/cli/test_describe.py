"""`aiayn info`'s model description: every parameter counted once, under the paper's names."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aiayn.cli.describe import component_of, describe, parameter_shapes, parameter_table
from aiayn.config import ModelConfig, preset
from aiayn.model import Transformer
from aiayn.model_dir import WEIGHTS_FILE
from model_dirs import tiny_model, tiny_model_dir


def test_base_model_rows_add_up_to_the_table_3_count() -> None:
    config = preset("base", src_vocab_size=37000, share_embeddings="all")
    with torch.device("meta"):  # no memory for 63M parameters
        model = Transformer(config)
    rows = dict(parameter_table(config))
    assert sum(rows.values()) == sum(p.numel() for p in model.parameters()) == 63_082_496
    assert rows["shared embedding: source = target = pre-softmax (§3.4)"] == 37000 * 512
    assert "encoder × 6: self-attention" in rows
    assert "decoder × 6: encoder-decoder attention" in rows
    text = describe(config)
    assert "d_model=512  d_ff=2048  h=8  d_k=64  d_v=64" in text
    assert "post-norm (§3.1)" in text
    assert text.splitlines()[-1].split()[1:] == ["63,082,496", "(63.1M)"]


def test_unshared_embeddings_are_three_rows() -> None:
    model = tiny_model(share_embeddings="none")
    rows = dict(parameter_table(model.config))
    v, d = model.config.src_vocab_size, model.config.d_model
    for row in ("source embedding (§3.4)", "target embedding (§3.4)", "pre-softmax linear (§3.4)"):
        assert rows[row] >= v * d
    assert sum(rows.values()) == sum(p.numel() for p in model.parameters())


def test_pre_norm_and_learned_positions_get_their_own_rows() -> None:
    model = tiny_model(norm_first=True, positional_encoding="learned")
    rows = dict(parameter_table(model.config))
    assert rows["final layer norms (pre-norm)"] == 2 * 2 * model.config.d_model
    assert rows["learned positional embedding (Table 3 E)"] == 64 * model.config.d_model
    assert "pre-norm" in describe(model.config)


def test_component_of_names_the_stack_and_sublayer() -> None:
    config = tiny_model().config
    assert component_of("decoder.layers.1.cross_attn.q_proj.weight", config) == (
        "decoder × 2: encoder-decoder attention"
    )
    assert component_of("encoder.layers.0.feed_forward.w_1.bias", config) == (
        "encoder × 2: feed-forward"
    )


@pytest.mark.parametrize(
    ("share_embeddings", "norm_first", "positional_encoding"),
    list(itertools.product(("all", "decoder", "none"), (False, True), ("sinusoidal", "learned"))),
)
def test_parameter_shapes_are_the_models(
    share_embeddings: str, norm_first: bool, positional_encoding: str
) -> None:
    """`aiayn info` counts from the config alone: the names and shapes the model has, in its
    order, a shared weight once (d_k ≠ d_v and unequal stacks, so no size stands for another)."""
    config = ModelConfig(
        src_vocab_size=50 if share_embeddings == "none" else 40,
        tgt_vocab_size=40,
        d_model=16,
        d_ff=24,
        n_heads=2,
        d_k=4,
        d_v=6,
        n_encoder_layers=2,
        n_decoder_layers=3,
        max_positions=20,
        share_embeddings=share_embeddings,
        norm_first=norm_first,
        positional_encoding=positional_encoding,
    )
    with torch.device("meta"):
        model = Transformer(config)
    expected = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert parameter_shapes(config) == expected


INFO = """
import sys
from aiayn.cli import main
status = main(sys.argv[1:])
print("torch" in sys.modules, file=sys.stderr)
sys.exit(status)
"""


def test_info_imports_no_torch(tmp_path: Path) -> None:
    """`aiayn info`, of a preset or a model directory, answers without PyTorch's 2 s import;
    a model directory's total is its weights file's."""
    model_dir = tiny_model_dir(tmp_path)
    stored = sum(t.numel() for t in load_file(model_dir / WEIGHTS_FILE).values())
    for argv in (["info"], ["info", "--preset", "big"], ["info", "-m", str(model_dir)]):
        done = subprocess.run(
            [sys.executable, "-c", INFO, *argv], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
        assert done.stderr.splitlines()[-1] == "False", argv
        assert "total" in done.stdout
    assert done.stdout.splitlines()[-1].split()[1] == f"{stored:,}"
