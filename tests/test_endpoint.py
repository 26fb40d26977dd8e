"""The openai engine (harness.engines.openai_endpoint) against an independent OpenAI-compatible server
(tests/fake_openai.py).

The fake server holds the same tiny model the in-process side evaluates, so an endpoint candidate
must give the in-process records item by item: log-likelihood choices, greedy flags, replies. Its
fault switches give the bad-server cases: another vocabulary, a dead server mid-slice (then the rerun
resumes from lm-eval's request cache), a hung one, a wrong URL, a wrong or missing API key.
The real engine (vLLM serving the harness's FP8 export) is tests/test_endpoint_vllm.py.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.engines.openai_endpoint import check_tokens, endpoint_lm
from harness.engines.openai_http import Client, EndpointError, EndpointSpec, redact_url
from harness.engines.vllm_serve import ServedProcess, free_port
from harness.evaluation import evaluate
from harness.evaluation.slices import resolve
from harness.job import identity
from harness.config import to_config
from harness.models import loading as models

sys.path.insert(0, str(Path(__file__).parent))
from fake_openai import FakeServer  # noqa: E402

TINY = ["model=tiny_random", "slices=[math]", "slices.math.n_items=12", "slices.math.divergence_texts=4",
        "slices.math.tasks=[harness_math_gen,harness_math_mc]", "quant=none", "eval.max_gen_toks=12"]
KEY_ENV = "HARNESS_TEST_ENDPOINT_KEY"
PLANTED = "sk-planted-4f1c9e2b7d"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, shared_model_cache):
    from harness.config import compose

    root = tmp_path_factory.mktemp("endpoint")
    (root / "cache").mkdir()
    os.symlink(shared_model_cache, root / "cache" / "models")
    cfg = to_config(compose([*TINY, f"paths.cache_dir={root / 'cache'}",
                                      f"paths.results_dir={root / 'results'}", "tracking.enabled=false"]))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    settings = identity.eval_settings(cfg, None)
    slice_ = resolve(cfg.slices)[0]
    twin = evaluate.make_lm(loaded.model, loaded.tokenizer, settings)
    reference, _ = evaluate.evaluate_slice(twin, slice_, settings)
    return loaded, settings, slice_, twin, reference


COMPARED = ["item_id", "output_type", "correct", "response", "prompt", "reply"]


@pytest.mark.slow
def test_an_endpoint_candidate_gives_the_in_process_records(tiny):
    """Same model behind the server: every item's choice, score, prompt and reply as in process."""
    loaded, settings, slice_, twin, reference = tiny
    with FakeServer(loaded.model, loaded.tokenizer) as server:
        lm = endpoint_lm(Client(EndpointSpec(url=server.url, batch_size=4)), twin)
        served, _ = evaluate.evaluate_slice(lm, slice_, settings)
    assert set(reference["output_type"]) == {"generate_until", "multiple_choice"}
    pd.testing.assert_frame_equal(served[COMPARED], reference[COMPARED])
    assert lm.prompt_tokens > 0 and server.prompts > len(reference)


@pytest.mark.slow
def test_a_server_with_another_vocabulary_is_refused_before_any_item(tiny):
    loaded, _, _, twin, _ = tiny
    with FakeServer(loaded.model, loaded.tokenizer, vocab_shift=7) as server:
        with pytest.raises(EndpointError, match="tokenizer probe.*first difference at token 0.*another model") as err:
            endpoint_lm(Client(EndpointSpec(url=server.url)), twin)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_the_token_check_compares_ids_and_texts(tiny):
    tokenizer = tiny[0].tokenizer
    ids = tokenizer("The capital of France", add_special_tokens=False)["input_ids"]
    texts = [tokenizer.decode([i]) for i in ids]
    check_tokens(list(ids), ids, tokenizer, "x")
    check_tokens(texts, ids, tokenizer, "x")
    with pytest.raises(EndpointError, match=r"server's prompt is 5 tokens, the reference's 4; first difference at "
                                            r"token 0: served 1 "):
        check_tokens([1, *ids], ids, tokenizer, "x")  # a BOS the reference did not add
    with pytest.raises(EndpointError, match="first difference at token 2"):
        check_tokens(texts[:2] + ["zz"] + texts[3:], ids, tokenizer, "x")


@pytest.mark.slow
def test_a_server_that_dies_mid_slice_stops_in_one_line_and_the_rerun_resumes(tiny, tmp_path):
    loaded, settings, slice_, twin, reference = tiny
    checkpoint = tmp_path / "checkpoint" / slice_.name
    with FakeServer(loaded.model, loaded.tokenizer, die_after=4) as server:
        lm = endpoint_lm(Client(EndpointSpec(url=server.url, batch_size=4)), twin)
        with pytest.raises(EndpointError) as err:
            evaluate.evaluate_slice(lm, slice_, settings, checkpoint=checkpoint)
    message = str(err.value)
    assert "\n" not in message and "the same command resumes" in message and redact_url(server.url) in message
    kept = evaluate.checkpoint_rows(checkpoint)
    assert kept > 0
    with FakeServer(loaded.model, loaded.tokenizer) as again:  # another port: the cache is keyed by requests
        lm = endpoint_lm(Client(EndpointSpec(url=again.url, batch_size=4)), twin)
        served, _ = evaluate.evaluate_slice(lm, slice_, settings, checkpoint=checkpoint)
        answered_again = again.prompts - 1  # minus the tokenizer probe
    pd.testing.assert_frame_equal(served[COMPARED], reference[COMPARED])
    total = evaluate.checkpoint_rows(checkpoint)
    assert answered_again == total - kept  # only what the first attempt had not stored


def test_a_wrong_url_is_one_line():
    port = free_port()  # nothing listens there
    with pytest.raises(EndpointError, match=rf"127.0.0.1:{port}/v1: cannot reach the server") as err:
        endpoint_lm(Client(EndpointSpec(url=f"http://127.0.0.1:{port}")), twin=None)  # fails connecting, first
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_hung_server_times_out_in_one_line(tiny):
    loaded, _, _, twin, _ = tiny
    with FakeServer(loaded.model, loaded.tokenizer, hang_s=3.0) as server:
        with pytest.raises(EndpointError, match="no reply to /completions within 1 s .*candidate.endpoint_timeout_s"):
            endpoint_lm(Client(EndpointSpec(url=server.url, timeout_s=1.0)), twin)


@pytest.mark.slow
def test_the_api_key_is_sent_from_the_named_variable_and_never_shown(tiny, monkeypatch):
    loaded, settings, slice_, twin, _ = tiny
    with FakeServer(loaded.model, loaded.tokenizer, api_key=PLANTED) as server:
        monkeypatch.delenv(KEY_ENV, raising=False)
        with pytest.raises(EndpointError, match=f"{KEY_ENV}: that environment variable is not set"):
            endpoint_lm(Client(EndpointSpec(url=server.url, api_key_env=KEY_ENV)), twin)
        monkeypatch.setenv(KEY_ENV, "sk-wrong")
        with pytest.raises(EndpointError, match="HTTP 401.*wrong or missing API key") as err:
            endpoint_lm(Client(EndpointSpec(url=server.url, api_key_env=KEY_ENV)), twin)
        assert "sk-wrong" not in str(err.value)
        monkeypatch.setenv(KEY_ENV, PLANTED)
        spec = EndpointSpec(url=server.url, api_key_env=KEY_ENV)
        lm = endpoint_lm(Client(spec), twin)
        assert server.seen_headers[-1]["Authorization"] == f"Bearer {PLANTED}"
        for held in (repr(spec), repr(vars(lm)), repr(vars(lm.client))):
            assert PLANTED not in held


def test_credentials_in_a_url_are_not_shown():
    assert redact_url("http://user:secret@host:8000/v1") == "http://host:8000/v1"
    assert redact_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000"


# --------------------------------------------------------------------------- candidate.serve
STUB = f"{sys.executable} {Path(__file__).parent / 'fake_openai.py'} --port {{port}}"


def test_a_served_command_starts_answers_health_and_stops(tmp_path):
    with ServedProcess(STUB, tmp_path / "serve.log", startup_timeout_s=60) as served:
        assert served.url.startswith("http://127.0.0.1:") and served.exit_line() is None
        pid = served.process.pid
    assert served.process.poll() is not None  # stopped on leaving
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_served_command_that_exits_gives_its_last_log_lines(tmp_path):
    with pytest.raises(EndpointError, match=r"exited with code 3; last log lines: bad flag --frobnicate"):
        ServedProcess(f"{STUB} --fail 'bad flag --frobnicate'", tmp_path / "serve.log", startup_timeout_s=60).start()


def test_a_served_command_needs_a_port_placeholder(tmp_path):
    with pytest.raises(EndpointError, match=r"has no \{port\}"):
        ServedProcess("vllm serve /models/x --port 8000", tmp_path / "serve.log")


def test_a_server_killed_mid_run_is_named_with_its_exit(tmp_path):
    served = ServedProcess(STUB, tmp_path / "serve.log", startup_timeout_s=60).start()
    client = Client(EndpointSpec(url=served.url), served)
    assert client.connect()["id"] == "fake"
    served.process.kill()
    served.process.wait()
    with pytest.raises(EndpointError, match=r"exited with code -9; last log lines: stub server on"):
        client.complete(prompt="x", max_tokens=1)



def test_stopping_a_server_that_died_alone_stops_its_children(tmp_path):
    """A server killed by itself (a crash) leaves its children (vLLM's engine core) in its process group; stopping
    it ends them too."""
    command = f"bash -c 'sleep 300 & exec {STUB}'"
    served = ServedProcess(command, tmp_path / "serve.log", startup_timeout_s=60).start()
    group = served.process.pid
    served.process.kill()
    served.process.wait()
    os.killpg(group, 0)  # the child still runs
    served.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)
    # a second stop (the atexit one) signals nothing: the group's number may belong to another group by then
    sent: list = []
    real_killpg = os.killpg
    os.killpg = lambda *args: sent.append(args)
    try:
        served.stop()
    finally:
        os.killpg = real_killpg
    assert sent == []

@pytest.mark.slow
def test_concurrent_generation_requests_give_the_same_records_in_order(tiny):
    """candidate.endpoint_concurrency > 1: requests overlap at the server, records stay item by item in process's."""
    loaded, settings, slice_, twin, reference = tiny
    with FakeServer(loaded.model, loaded.tokenizer, hang_s=0.05) as server:
        lm = endpoint_lm(Client(EndpointSpec(url=server.url, batch_size=4, concurrency=4)), twin)
        served, _ = evaluate.evaluate_slice(lm, slice_, settings)
    pd.testing.assert_frame_equal(served[COMPARED], reference[COMPARED])
    assert server.max_in_flight > 1  # the requests did overlap


@pytest.mark.slow
def test_a_server_that_dies_under_concurrent_requests_keeps_the_answers_before_it(tiny, tmp_path):
    loaded, settings, slice_, twin, reference = tiny
    checkpoint = tmp_path / "checkpoint" / slice_.name
    with FakeServer(loaded.model, loaded.tokenizer, die_after=6) as server:
        lm = endpoint_lm(Client(EndpointSpec(url=server.url, batch_size=4, concurrency=3)), twin)
        with pytest.raises(EndpointError) as err:
            evaluate.evaluate_slice(lm, slice_, settings, checkpoint=checkpoint)
    assert "\n" not in str(err.value) and "the same command resumes" in str(err.value)
    with FakeServer(loaded.model, loaded.tokenizer) as again:
        lm = endpoint_lm(Client(EndpointSpec(url=again.url, batch_size=4, concurrency=3)), twin)
        served, _ = evaluate.evaluate_slice(lm, slice_, settings, checkpoint=checkpoint)
    pd.testing.assert_frame_equal(served[COMPARED], reference[COMPARED])
