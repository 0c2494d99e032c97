"""Tests for the attention behind pictures and alignments, and for aiayn.decode.alignment.

The maps that `Translator(..., return_attention=True)` returns are probabilities (rows sum to 1),
causal where they must be, free of padding, and equal to the model's own maps sliced; the
explicit path that computes them gives the same logits as the fused one. Hard alignments pick
the argmax source piece per output token, EOS excluded, and `aiayn translate --alignment`
writes them in the Pharaoh `i-j` format.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from aiayn.cli import main
from aiayn.decode.alignment import alignment_matrix, check_index, format_alignment, hard_alignment
from aiayn.decode.translator import SentenceAttention, TranslationResult, Translator, one_line
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID
from model_dirs import tiny_model, tiny_model_dir

CORPUS = [
    "the cat sat on the mat",
    "a dog barked at the moon all night",
    "die katze sass auf der matte",
    "ein hund bellte die ganze nacht den mond an",
]
# Different lengths, so that one batch holds padding.
SENTENCES = ["the cat sat on the mat", "a dog", "ein hund bellte die ganze nacht den mond an"]
FAST = {"beam_size": 2, "max_len_b": 5}
PAIRS = re.compile(r"^(\d+-\d+( \d+-\d+)*)?$")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("alignment")
    return tiny_model_dir(directory, CORPUS, d_model=32, d_ff=64, max_positions=32)


@pytest.fixture(scope="module")
def translator(model_dir: Path) -> Translator:
    return Translator(model_dir)


@pytest.fixture(scope="module")
def results(translator: Translator) -> list[TranslationResult]:
    return translator.translate(SENTENCES, return_attention=True, **FAST)


def pad(rows: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows))), PAD_ID, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


# -- the maps: shapes, probabilities, causality, padding --------------------------------------


def test_result_maps_have_documented_shapes_sum_to_one_and_are_causal(
    translator: Translator, results: list[TranslationResult]
) -> None:
    config = translator.model.config
    assert len({len(r.src_tokens) for r in results}) == len(SENTENCES)  # a padded batch
    for result in results:
        s, t = len(result.src_tokens), len(result.tgt_tokens)
        assert result.src_tokens[-1] == "</s>" and result.tgt_tokens[-1] == "</s>"
        assert t == len(result.tokens) + 1
        maps = result.attention_maps
        h = config.n_heads
        assert maps.encoder.shape == (config.n_encoder_layers, h, s, s)
        assert maps.decoder.shape == (config.n_decoder_layers, h, t, t)
        assert maps.cross.shape == (config.n_decoder_layers, h, t, s)
        assert result.attention.shape == (t, s)
        # Rows sum to 1 over the sentence's own keys: no weight went to padding.
        for m in (maps.encoder, maps.decoder, maps.cross, result.attention):
            assert (m >= 0).all()
            torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]))
        assert (maps.decoder.triu(diagonal=1) == 0).all()  # §3.2.3: no looking ahead
        allowed = torch.ones(t, t, dtype=torch.bool).tril()
        assert (maps.decoder[..., allowed] > 0).all()


def test_model_maps_of_a_padded_batch_put_no_weight_on_padding(translator: Translator) -> None:
    model = translator.model
    src = pad([[5, 6, 7, 8, EOS_ID], [9, EOS_ID], [5, 9, 6, EOS_ID]])  # (B, S)
    tgt = pad([[BOS_ID, 7, 8], [BOS_ID], [BOS_ID, 6]])  # (B, T)
    with torch.inference_mode():
        _, maps = model.forward_with_attention(src, tgt)
    pad_key = (src == PAD_ID)[None, :, None, None, :]  # (1, B, 1, 1, S)
    assert pad_key.any()
    assert (maps.encoder.masked_select(pad_key.expand_as(maps.encoder)) == 0).all()
    assert (maps.cross.masked_select(pad_key.expand_as(maps.cross)) == 0).all()
    for m in (maps.encoder, maps.decoder, maps.cross):
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]))
    assert (maps.decoder.triu(diagonal=1) == 0).all()


# -- the maps are what the fused path computes ------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
def test_forward_with_attention_gives_the_logits_of_forward(norm_first: bool) -> None:
    model = tiny_model(40, preset="tiny", seed=0, d_model=32, d_ff=64, norm_first=norm_first)
    src = pad([[5, 6, 7, 8, EOS_ID], [9, EOS_ID]])
    tgt = pad([[BOS_ID, 7, 8, 9], [BOS_ID, 6]])
    with torch.inference_mode():
        fused = model(src, tgt)
        explicit, _ = model.forward_with_attention(src, tgt)
    torch.testing.assert_close(explicit, fused, atol=1e-5, rtol=1e-5)


def test_result_maps_are_the_model_maps_sliced(
    translator: Translator, results: list[TranslationResult]
) -> None:
    """Rebuild the batch in input order (the translator sorts by length): padding and batch
    order must not change a sentence's maps."""
    sources = [[*translator.tokenizer.encode(s), EOS_ID] for s in SENTENCES]
    targets = [[BOS_ID, *r.token_ids] for r in results]
    with torch.inference_mode():
        _, maps = translator.model.forward_with_attention(pad(sources), pad(targets))
    for row, result in enumerate(results):
        s, t = len(sources[row]), len(targets[row])
        ours = result.attention_maps
        close = {"atol": 1e-5, "rtol": 1e-4}
        torch.testing.assert_close(ours.encoder, maps.encoder[:, row, :, :s, :s], **close)
        torch.testing.assert_close(ours.decoder, maps.decoder[:, row, :, :t, :t], **close)
        torch.testing.assert_close(ours.cross, maps.cross[:, row, :, :t, :s], **close)
        torch.testing.assert_close(
            result.attention, maps.cross[-1, row, :, :t, :s].mean(0), **close
        )
        torch.testing.assert_close(alignment_matrix(result), result.attention)


# -- hard alignments ---------------------------------------------------------------------------


def fake_result(cross: torch.Tensor) -> TranslationResult:
    """A result whose encoder-decoder attention is `cross` (L, H, T, S), set by hand."""
    n_layers, n_heads, t, s = cross.shape
    maps = SentenceAttention(
        encoder=torch.full((n_layers, n_heads, s, s), 1 / s),
        decoder=torch.full((n_layers, n_heads, t, t), 1 / t),
        cross=cross,
    )
    tokens = [f"y{j}" for j in range(t - 1)]
    return TranslationResult(
        text=" ".join(tokens),
        tokens=tokens,
        token_ids=list(range(10, 10 + t - 1)),
        score=0.0,
        log_prob=0.0,
        hypotheses=[],
        src_tokens=[*(f"x{i}" for i in range(s - 1)), "</s>"],
        tgt_tokens=[*tokens, "</s>"],
        attention=cross[-1].mean(0),
        attention_maps=maps,
    )


def test_hard_alignment_takes_the_head_averaged_argmax_without_eos() -> None:
    # 2 layers, 2 heads, T = 4 (3 tokens + EOS), S = 4 (3 pieces + EOS).
    cross = torch.full((2, 2, 4, 4), 0.1)
    last = cross[-1]
    last[0, 0, 2], last[1, 0, 0] = 0.9, 0.2  # head 0 wants 2, head 1 wants 0: mean picks 2
    last[:, 1, 3] = 0.95  # token 1 attends most to EOS: ignored, next best is piece 1
    last[:, 1, 1] = 0.5
    last[:, 2, 0] = 0.6
    last[:, 3, 1] = 0.99  # the output's EOS row: no pair
    cross[0, :, :, 1] = 0.9  # layer 0 attends to piece 1 everywhere
    result = fake_result(cross)

    assert hard_alignment(result) == [(2, 0), (1, 1), (0, 2)]
    assert hard_alignment(result, layer=-1) == hard_alignment(result, layer=1)
    assert hard_alignment(result, layer=0) == [(1, 0), (1, 1), (1, 2)]
    assert format_alignment(hard_alignment(result)) == "2-0 1-1 0-2"


def test_hard_alignment_of_a_tiny_model_has_one_pair_per_output_token(
    results: list[TranslationResult],
) -> None:
    for result in results:
        pairs = hard_alignment(result)
        assert len(pairs) == len(result.tokens)  # every token but EOS
        assert [j for _, j in pairs] == list(range(len(result.tokens)))
        assert all(0 <= i < len(result.src_tokens) - 1 for i, _ in pairs)  # never the EOS
        assert PAIRS.match(format_alignment(pairs))


def test_hard_alignment_errors_and_edge_cases(translator: Translator) -> None:
    result = translator.translate(["the cat"], **FAST)[0]
    with pytest.raises(ValueError, match="return_attention=True"):
        hard_alignment(result)
    [blank] = translator.translate([""], return_attention=True)
    assert hard_alignment(blank) == []
    assert format_alignment([]) == ""
    [result] = translator.translate(["the cat"], return_attention=True, **FAST)
    with pytest.raises(ValueError, match=r"layer 2 is out of range.*valid: 0, 1, or -2, -1"):
        hard_alignment(result, layer=2)
    with pytest.raises(ValueError, match=r"head 4 is out of range.*valid: 0, 1, 2, 3"):
        alignment_matrix(result, head=4)
    assert check_index(-1, 6, "layer", "layers") == 5


# -- aiayn translate --alignment ---------------------------------------------------------------


def test_translate_alignment_writes_text_tab_pharaoh_pairs(
    model_dir: Path, translator: Translator, tmp_path: Path
) -> None:
    lines = ["the cat sat", "", "a dog barked at the moon"]
    src = tmp_path / "in.txt"
    src.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    out = tmp_path / "out.txt"
    argv = ["translate", "-m", str(model_dir), "-i", str(src), "-o", str(out), "--alignment"]
    assert main([*argv, "--beam-size", "2", "--max-len-b", "5"]) == 0

    written = out.read_text(encoding="utf-8").split("\n")
    assert written[-1] == "" and len(written) == len(lines) + 1
    expected = translator.translate(lines, return_attention=True, **FAST)
    for line, result in zip(written[:-1], expected, strict=True):
        text, alignment = line.split("\t")
        assert text == one_line(result.text)
        assert PAIRS.match(alignment)
        pairs = [tuple(map(int, p.split("-"))) for p in alignment.split()]
        assert len(pairs) == len(result.tokens)  # one per non-EOS target token
        assert all(0 <= i < len(result.src_tokens) - 1 for i, _ in pairs)
        assert [j for _, j in pairs] == list(range(len(result.tokens)))
        assert pairs == hard_alignment(result)
    assert written[1] == "\t"  # an empty line keeps both fields


def test_translate_alignment_layer_choice_and_bad_input(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.txt"
    src.write_text("the cat sat\n", encoding="utf-8")
    base = ["translate", "-m", str(model_dir), "-i", str(src), "--alignment", "--max-len-b", "3"]
    assert main([*base, "--alignment-layer", "0"]) == 0
    assert PAIRS.match(capsys.readouterr().out.rstrip("\n").split("\t")[1])
    assert main([*base, "--alignment-layer", "2"]) == 2
    err = capsys.readouterr().err
    assert "layer 2 is out of range" in err and "valid: 0, 1, or -2, -1" in err
    assert main([*base, "--n-best", "2"]) == 2
    assert "--alignment cannot be combined with --n-best" in capsys.readouterr().err
