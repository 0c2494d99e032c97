"""How many calls into PyTorch a search step makes (`bench/step_calls.py` counts them):
none per sentence, and a bounded number per decoder layer, so that the search loop stays as
lean as issue 29 asks. Counts are exact and the same on every machine, unlike timings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.acceleration import use_cpu_attention
from aiayn.decode.packing import pack_linear_layers
from aiayn.decode.search import DecodingOptions, beam_search, greedy_search
from aiayn.model import Transformer
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID
from model_dirs import tiny_model

BENCH = Path(__file__).resolve().parents[2] / "bench"
IDS = {"bos_id": BOS_ID, "eos_id": EOS_ID, "pad_id": PAD_ID}
SOURCE_LENGTH = 7


@pytest.fixture
def bench_step_calls(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))
    import step_calls

    return step_calls


@pytest.fixture
def decoding_model() -> Transformer:
    """A float32 CPU model as `Translator` decodes with it: its linear layers packed (all of
    them: these are below the size `pack_for_decoding` starts at) where packing runs here,
    with the CPU's attention kernels. On MKL's kernel, whose calls do not depend on the number
    of rows (oneDNN's pads some row counts: `decode.packing.padded_rows`)."""
    return use_cpu_attention(pack_linear_layers(tiny_model(), min_features=1, kernel="mkl"))


def sources(n: int) -> torch.Tensor:
    """`n` sentences of the same length (no padding: every batch runs the same operators)."""
    return torch.randint(4, 23, (n, SOURCE_LENGTH))


def counted_search(bench_step_calls: Any, model: Transformer, n: int, beam: int) -> Any:
    options = DecodingOptions(beam_size=beam, max_len_a=0.0, max_len_b=12)
    search = beam_search if beam > 1 else greedy_search
    with torch.inference_mode(), bench_step_calls.count_step_calls() as counted:
        search(model, sources(n), options=options, **IDS)
    return counted


def test_the_counter_counts_every_step_and_puts_calls_down_to_the_step_or_the_search(
    bench_step_calls: Any, decoding_model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = []
    original = Transformer.decode_step

    def decode_step(self: Transformer, *args: Any) -> torch.Tensor:
        steps.append(len(args[0]))
        return original(self, *args)

    monkeypatch.setattr(Transformer, "decode_step", decode_step)
    counted = counted_search(bench_step_calls, decoding_model, 3, beam=4)
    assert Transformer.decode_step is decode_step  # put back as it was
    assert counted.steps == len(steps) == len(counted.per_step) > 1
    places = set(counted.by_place)
    assert bench_step_calls.STEP in places
    assert "decode.search.beam_search" in places
    assert any(place.startswith("decode.search._select_candidates") for place in places)
    assert sum(counted.per_step) < sum(counted.by_place.values())  # encoding came first
    table = bench_step_calls.markdown(counted, 2, "caption")
    assert "| **every call** |" in table and bench_step_calls.STEP in table


@pytest.mark.parametrize("beam", [1, 4])
def test_a_step_makes_no_call_per_sentence(
    bench_step_calls: Any, decoding_model: Transformer, beam: int
) -> None:
    """The model's step makes the same calls for 2 sentences as for 24, and the busiest step
    of the search (finishing, dropping sentences, moving cache rows) about the same: every
    choice between rows and sentences is a batch tensor operation. (The slack is for the
    paths a search may take or not, moving rows in place or gathering them, which depend on
    the numbers; a call per sentence would add 22 or more.)"""
    few = counted_search(bench_step_calls, decoding_model, 2, beam)
    many = counted_search(bench_step_calls, decoding_model, 24, beam)
    step = bench_step_calls.STEP
    assert few.per_search_step(step) == many.per_search_step(step)
    assert many.most_in_one_step <= few.most_in_one_step + 8


def test_a_beam_search_step_stays_within_its_call_budget(
    bench_step_calls: Any, decoding_model: Transformer
) -> None:
    """fdeed3e took a step of the Bible recipe's 2+2 model from 306 calls into PyTorch to 193
    (BENCHMARKS.md). These bounds keep it there: per decoder layer (self-attention with its
    cache, encoder-decoder attention, the feed-forward network, their norms and residuals),
    and for the search's work between two steps."""
    counted = counted_search(bench_step_calls, decoding_model, 8, beam=4)
    layers = decoding_model.config.n_decoder_layers
    in_step = counted.per_search_step(bench_step_calls.STEP)
    assert in_step <= 6 + 40 * layers, in_step  # 84 at 2 layers (1af60c8)
    between = counted.per_search_step() - in_step
    assert between <= 80, between  # 73 (fdeed3e and after)


def test_a_search_over_some_target_ids_counts_its_steps_too(
    bench_step_calls: Any, decoding_model: Transformer
) -> None:
    """A model whose output layer covers the target side, or a shortlist, decodes through
    `RestrictedModel`, whose step calls the model's `decode_step_hidden` and never its
    `decode_step`: its steps are counted all the same, and the classes put back after."""
    from aiayn.decode.restricted import RestrictedModel

    real = RestrictedModel.decode_step
    vocab = torch.arange(decoding_model.config.tgt_vocab_size)[::2]
    vocab[:3] = torch.tensor(sorted(IDS.values()))  # BOS, EOS and padding stay among them
    vocab = vocab.sort().values
    options = DecodingOptions(beam_size=4, max_len_a=0.0, max_len_b=12)
    with torch.inference_mode(), bench_step_calls.count_step_calls() as counted:
        beam_search(RestrictedModel(decoding_model, vocab), sources(3), options=options,
                    vocab=vocab, **IDS)  # fmt: skip
    assert counted.steps > 1 and counted.per_search_step(bench_step_calls.STEP) > 0
    assert RestrictedModel.decode_step is real
