"""quant.calibration.format (issue 24): calibration windows laid out as the model is prompted.

The chat windows are checked against the chat template rendered here by the tokenizer itself
(system prompt, user and assistant headers), the cache keys against the plain format's (which
must stay what they were), and the bad input (chat on a model without a chat template) against
the one-line error raised before any model is loaded.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from harness.models import loading as models
from harness.job import pipeline as run_mod
from harness.infra.cache import Cache, stable_hash
from harness.config import CalibrationConfig, compose, load_model_config
from harness.config import to_config
from harness.quant import SchemeError
from harness.quant.calibrated_cache import calibrated_key
from harness.quant.calibration import (CalibrationContext, calibration_tokens, check_format, resolved_format,
                                       validate_calibration)
from tests.conftest import TINY_MATH


@pytest.fixture(scope="module")
def tokenizer(shared_model_cache):
    return models.load_tokenizer(load_model_config("smollm2_135m"), Cache(shared_model_cache.parent))


@pytest.mark.slow
def test_chat_windows_follow_the_chat_template(tokenizer):
    config = CalibrationConfig(num_samples=4, seq_len=256, format="chat")
    chat = calibration_tokens(tokenizer, config, chat=True)
    assert tuple(chat.shape) == (4, 256)
    assert calibration_tokens(tokenizer, config, chat=True).equal(chat)  # seeded
    plain = calibration_tokens(tokenizer, config)
    assert not plain.equal(chat)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    system = rendered[: rendered.index("<|im_start|>user")]  # the template's own system prompt
    system_ids = tokenizer(system, add_special_tokens=False)["input_ids"]
    for window in chat.tolist():
        assert window[: len(system_ids)] == system_ids
        text = tokenizer.decode(window)
        assert text.count("<|im_start|>user\n") >= 1 and "<|im_end|>\n<|im_start|>assistant\n" in text
        # the user turn is the source text that the plain window of the same start begins with
    for chat_window, plain_window in zip(chat.tolist(), plain.tolist()):
        user = tokenizer.decode(chat_window).split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        assert user and user in tokenizer.decode(plain_window[:80])


def test_two_exchanges_fill_a_512_window(tokenizer):
    [window] = calibration_tokens(tokenizer, CalibrationConfig(num_samples=1, seq_len=512), chat=True).tolist()
    text = tokenizer.decode(window)
    assert text.count("<|im_start|>user\n") == 2 and text.count("<|im_start|>assistant\n") == 2


def test_format_resolution_and_bad_values():
    assert resolved_format(CalibrationConfig(), chat_template=True) == "chat"
    assert resolved_format(CalibrationConfig(), chat_template=False) == "plain"
    assert resolved_format(CalibrationConfig(format="plain"), chat_template=True) == "plain"
    with pytest.raises(SchemeError, match=r"format='dialog' is unknown; use chat .*plain .*auto"):
        validate_calibration(CalibrationConfig(format="dialog"))
    with pytest.raises(SchemeError) as error:
        check_format(CalibrationConfig(format="chat"), chat_template=False, model_name="tiny_random")
    assert "\n" not in str(error.value) and "quant.calibration.format=plain" in str(error.value)
    check_format(CalibrationConfig(format="chat"), chat_template=True, model_name="smollm2_135m")


def test_chat_on_a_model_without_a_template_fails_before_any_work(make_cfg, monkeypatch):
    loads = []
    monkeypatch.setattr(run_mod.models, "load", lambda *a, **k: loads.append(a))
    with pytest.raises(SchemeError, match=r"format=chat: model 'tiny_random' is not evaluated with a chat template"):
        run_mod.run(make_cfg(*TINY_MATH, "quant=gptq_w4g128", "quant.calibration.format=chat"))
    assert loads == []


@pytest.mark.slow
def test_the_chat_format_is_part_of_the_calibrated_key():
    scheme = to_config(compose(["quant=gptq_w4g128"])).quant
    plain = calibrated_key("m", scheme, "h")
    assert calibrated_key("m", scheme, "h", chat=True) != plain
    code = replace(scheme, calibration=replace(scheme.calibration, source="code"))
    assert calibrated_key("m", code, "h", chat=True) not in (plain, calibrated_key("m", code, "h"))
    # the plain format's key is the one from before the option existed (format is not in the scheme identity)
    assert calibrated_key("m", replace(scheme, calibration=replace(scheme.calibration, format="plain")), "h") == plain


@pytest.mark.slow
def test_context_follows_the_model_and_hashes_the_chat_windows(tokenizer, tmp_path):
    config = CalibrationConfig(num_samples=2, seq_len=128)
    scheme = to_config(compose(["quant=gptq_w4g128"])).quant
    chat = CalibrationContext("m", tokenizer, config, "cpu", Cache(tmp_path), scheme, chat_template=True)
    base = CalibrationContext("m", tokenizer, config, "cpu", Cache(tmp_path), scheme)
    assert chat.format == "chat" and base.format == "plain"
    assert chat.calibration_hash == stable_hash(calibration_tokens(tokenizer, config, chat=True).tolist(), 16)
    assert chat.calibration_hash != base.calibration_hash
