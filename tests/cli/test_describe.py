"""`aiayn info`'s model description: every parameter counted once, under the paper's names."""

from __future__ import annotations

from collections.abc import Callable

import torch

from aiayn.cli.describe import component_of, describe, parameter_table
from aiayn.config import preset
from aiayn.model import Transformer

MakeModel = Callable[..., Transformer]


def test_base_model_rows_add_up_to_the_table_3_count() -> None:
    config = preset("base", src_vocab_size=37000, share_embeddings="all")
    with torch.device("meta"):  # no memory for 63M parameters
        model = Transformer(config)
    rows = dict(parameter_table(model, config))
    assert sum(rows.values()) == sum(p.numel() for p in model.parameters()) == 63_082_496
    assert rows["shared embedding: source = target = pre-softmax (§3.4)"] == 37000 * 512
    assert "encoder × 6: self-attention" in rows
    assert "decoder × 6: encoder-decoder attention" in rows
    text = describe(model, config)
    assert "d_model=512  d_ff=2048  h=8  d_k=64  d_v=64" in text
    assert "post-norm (§3.1)" in text
    assert text.splitlines()[-1].split()[1:] == ["63,082,496", "(63.1M)"]


def test_unshared_embeddings_are_three_rows(make_model: MakeModel) -> None:
    model = make_model(share_embeddings="none")
    rows = dict(parameter_table(model, model.config))
    v, d = model.config.src_vocab_size, model.config.d_model
    for row in ("source embedding (§3.4)", "target embedding (§3.4)", "pre-softmax linear (§3.4)"):
        assert rows[row] >= v * d
    assert sum(rows.values()) == sum(p.numel() for p in model.parameters())


def test_pre_norm_and_learned_positions_get_their_own_rows(make_model: MakeModel) -> None:
    model = make_model(norm_first=True, positional_encoding="learned")
    rows = dict(parameter_table(model, model.config))
    assert rows["final layer norms (pre-norm)"] == 2 * 2 * model.config.d_model
    assert rows["learned positional embedding (Table 3 E)"] == 64 * model.config.d_model
    assert "pre-norm" in describe(model, model.config)


def test_component_of_names_the_stack_and_sublayer(make_model: MakeModel) -> None:
    config = make_model().config
    assert component_of("decoder.layers.1.cross_attn.q_proj.weight", config) == (
        "decoder × 2: encoder-decoder attention"
    )
    assert component_of("encoder.layers.0.feed_forward.w_1.bias", config) == (
        "encoder × 2: feed-forward"
    )
