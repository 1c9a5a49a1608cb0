"""The output-length predictor: deterministic training, the shipped default, online
adaptation, the distribution helpers and the CLI."""
from __future__ import annotations


import pytest

from sloserve.cluster.lengths import LEVELS, LengthPrediction, SHAREGPT_PRIOR, prediction_for
from sloserve.cluster.predict import (DEFAULT_PATH, HEAD_CHARS, LEN_FEATURES, TAIL_CHARS, GlobalMedianBaseline,
                                      LengthPredictor, LinearLengthBaseline, PredictionBook, TrainConfig, bucket_of,
                                      evaluate, featurize, load_examples, quantiles_from_probs, split, train)
from sloserve.core.types import Request, SamplingParams


@pytest.fixture(scope="module")
def small_slice():
    return load_examples(limit=600)


@pytest.fixture(scope="module")
def default():
    return LengthPredictor.default()


def test_training_is_deterministic(small_slice):
    cfg = TrainConfig(epochs=2, batch_size=64)
    tr, held = split(small_slice)
    assert tr and held and not {e.prompt for e in tr} & {e.prompt for e in held}  # duplicates stay on one side
    a, b = train(tr, cfg), train(tr, cfg)
    assert a.to_json() == b.to_json()
    c = train(tr, TrainConfig(epochs=2, batch_size=64, seed=1))
    assert c.to_json() != a.to_json()
    # the trained model predicts exactly what its saved copy does (weights are stored as float16)
    again = LengthPredictor.from_json(a.to_json())
    for e in held[:20]:
        assert again.predict(e.prompt, e.prompt_tokens) == a.predict(e.prompt, e.prompt_tokens)


def test_the_shipped_default_loads_is_small_and_predicts_sensibly(default):
    assert DEFAULT_PATH.stat().st_size < 1_000_000
    essay = default.predict("Write a detailed 2000 word essay on the history of the Roman Empire, with sections "
                            "on its founding, expansion, government, culture and decline.", 40)
    yes_no = default.predict("Answer with only yes or no: is Paris the capital of France?", 16)
    for p in (essay, yes_no):
        assert p.levels == LEVELS
        assert all(1 <= a <= b for a, b in zip(p.values, p.values[1:]))
    assert essay.median > 2 * yes_no.median
    # held-out quality recorded by train-predictor: better than both baselines on MAE,
    # and calibrated (the 80% interval holds roughly 80%)
    held = default.meta["heldout"]
    model = held["sloserve: text + length"]
    assert model["mae"] < held["global median"]["mae"] and model["mae"] < held["linear on prompt length"]["mae"]
    assert model["bucket_accuracy"] > held["global median"]["bucket_accuracy"]
    assert 0.7 < model["interval_80"] < 0.9


def test_cost_is_bounded_whatever_the_prompt(default):
    """The latency budget, checked as work rather than time: a 400k-character prompt reads only
    its head and tail, so its feature count is that of a short prompt."""
    huge = "lorem ipsum dolor sit amet " * 15000 + "please summarize"
    idx, _ = featurize(huge, 100_000)
    head_tail = featurize(huge[:HEAD_CHARS] + " " + huge[-TAIL_CHARS:], 100_000)[0]
    assert idx == head_tail and len(idx) < LEN_FEATURES + 2 * (HEAD_CHARS + TAIL_CHARS)
    p = default.predict(huge, 100_000)
    assert p.median >= 1
    # without text the length-only head answers, from the token count alone
    assert default.predict(None, 500) == default.predict(prompt_tokens=500)
    assert default.predict("x" * 400).values == default.predict("x" * 400, 100).values  # ~4 chars per token


def test_online_updates_track_a_shifted_length_distribution(default):
    """The served model answers in ~20 tokens where ChatGPT took hundreds: after a few hundred
    completions the median and the quantiles follow."""
    model = LengthPredictor.from_json(default.to_json())
    prompts = [f"Explain how a {w} works, step by step." for w in ("compiler", "bicycle", "vaccine", "router")]
    before = model.predict(prompts[0], 12).median
    assert before > 80
    for i in range(400):
        model.update(prompts[i % 4], 18 + (i % 5), 12)
    after = model.predict(prompts[0], 12)
    assert after.median < 60 and after.quantile(0.9) >= 18
    assert model.num_updates == 400
    with pytest.raises(ValueError):
        model.update("x", -1)


def test_baselines_and_evaluation(small_slice):
    tr, held = split(small_slice)
    med = GlobalMedianBaseline(tr)
    lin = LinearLengthBaseline(tr)
    r_med = evaluate("median", med.predict, held)
    r_lin = evaluate("linear", lin.predict, held)
    for r in (r_med, r_lin):
        assert r.n == len(held) and r.mae > 0 and 0 <= r.bucket_accuracy <= r.within_one_bucket <= 1
        assert list(r.coverage) == [f"{q:g}" for q in LEVELS]
    assert abs(r_med.coverage["0.5"] - 0.5) < 0.15  # the training median splits held-out data roughly in half


def test_length_prediction_cdf_and_quantiles_agree():
    p = LengthPrediction((0.1, 0.5, 0.9), (20.0, 100.0, 400.0))
    for q in (0.05, 0.1, 0.3, 0.5, 0.7, 0.9, 0.95):
        assert p.cdf(p.quantile(q)) == pytest.approx(q)
    assert p.survival(0) == 1.0 and p.survival(800) == 0.0 and p.median == 100
    xs = [0, 10, 20, 50, 100, 300, 400, 600, 800]
    assert all(p.cdf(a) <= p.cdf(b) for a, b in zip(xs, xs[1:]))
    with pytest.raises(ValueError):
        LengthPrediction((0.1, 0.5), (10.0, 5.0))
    assert LengthPrediction.from_point(100).median == 100
    q = quantiles_from_probs([0.0] * 5 + [1.0] + [0.0] * 7)  # all mass in bucket [192, 256)
    assert all(192 <= v <= 256 for v in q)
    assert bucket_of(0) == 0 and bucket_of(200) == 5 and bucket_of(5000) == 12


def test_prediction_book_annotates_looks_up_and_learns(default):
    model = LengthPredictor.from_json(default.to_json())
    book = PredictionBook(model)
    r = Request("a", list(range(30)), SamplingParams(max_tokens=999, temperature=0))
    pred = book.annotate(r, "Write a poem about the sea.")
    assert r.predicted_output_len == pred.median and book.lookup(r) is pred
    assert prediction_for(r, book.lookup) is pred
    r.output_token_ids.extend([0] * 7)
    book.observe(r)
    assert book.lookup(r) is None and model.num_updates == 1 and book.num_observed == 1
    # a request nobody predicted: a spread around its point, else the prior (never max_tokens)
    bare = Request("b", [1, 2, 3], SamplingParams(max_tokens=7, temperature=0))
    assert prediction_for(bare) is SHAREGPT_PRIOR
    bare.predicted_output_len = 50
    assert prediction_for(bare).median == 50


def test_train_predictor_cli(tmp_path, capsys):
    from sloserve.cli import main

    out = tmp_path / "p.json"
    assert main(["train-predictor", "--limit", "500", "--epochs", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "global median" in text and "linear on prompt length" in text and "MAE" in text
    loaded = LengthPredictor.load(out)
    assert loaded.meta["data"]["records"] == 500 and "heldout" in loaded.meta
    assert main(["train-predictor", "--limit", "500", "--epochs", "0", "--out", str(out)]) == 2


@pytest.mark.slow
def test_the_default_is_reproducible_from_the_command(tmp_path):
    from sloserve.cli import main

    out = tmp_path / "default.json"
    assert main(["train-predictor", "--out", str(out)]) == 0
    assert out.read_bytes() == DEFAULT_PATH.read_bytes()
