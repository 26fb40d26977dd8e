"""The pairwise judge against a scripted OpenAI-compatible chat server on loopback.

The server (an ``http.server`` thread written here) answers ``/v1/chat/completions`` by a rule the test picks: prefer
the longer response, always say A (a judge with pure position bias), or prefer B only when it is at least twice as
long as A (a judge that is consistent on some items and not on others). It can answer HTTP 429 once, reply with
garbage for marked items, and check the API key. Every expected count is derived by hand from the replies' lengths,
not from the code under test.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from harness.config import JudgeConfig
from harness.engines.openai_http import EndpointError, RateLimit
from harness.evaluation import judge, judge_client, judge_stats
from harness.evaluation.judge_client import JudgeClient, JudgeConfigError, check_config, parse_verdict

KEY = "sk-test-7f3a9c0e5d1b"  # what the scripted server expects in the Authorization header
_SECTION = re.compile(r"\[Response (A|B)\]\n(.*?)\n\[End of Response \1\]", re.DOTALL)


class Script:
    """What the scripted server does; the test sets the rule and reads what it saw."""

    def __init__(self, rule: str = "longer", fail_first: int = 0, retry_after: str | None = "0",
                 key: str | None = None, echo_auth_on_error: bool = False,
                 models: tuple[str, ...] = ("scripted-judge",)):
        self.rule, self.fail_first, self.retry_after, self.key = rule, fail_first, retry_after, key
        self.models = models  # what /v1/models lists
        self.echo_auth_on_error = echo_auth_on_error
        self.chats: list[dict] = []  # every chat request body that was answered
        self.arrivals: list[float] = []  # monotonic time of every chat request (answered or refused)
        self.refused = 0
        self.lock = threading.Lock()

    def verdict(self, first: str, second: str) -> str:
        if "GARBLE" in first or "GARBLE" in second:
            return "Both responses have merits, it depends on the user."
        if self.rule == "always_a":
            return "A"
        if self.rule == "double":
            return "B" if len(second) >= 2 * len(first) else "A"
        if len(first) == len(second):
            return "tie"
        return "A" if len(first) > len(second) else "B"


def _handler(script: Script) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            if script.key is None:
                return True
            given = self.headers.get("Authorization", "")
            if given == f"Bearer {script.key}" and not script.echo_auth_on_error:
                return True
            message = f"bad key: {given}" if script.echo_auth_on_error else "bad key"
            self._send(500 if script.echo_auth_on_error else 401, {"error": {"message": message}})
            return False

        def do_GET(self) -> None:
            if self.path in ("/health", "/v1/health"):
                self._send(200, {})
            elif self.path == "/v1/models" and self._authorized():
                self._send(200, {"data": [{"id": name} for name in script.models]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with script.lock:
                script.arrivals.append(time.monotonic())
                refuse = script.fail_first > 0
                if refuse:
                    script.fail_first -= 1
                    script.refused += 1
            if refuse:
                self._send(429, {"error": {"message": "slow down"}},
                           {"Retry-After": script.retry_after} if script.retry_after is not None else {})
                return
            if not self._authorized():
                return
            user = body["messages"][-1]["content"]
            sections = dict(_SECTION.findall(user))
            with script.lock:
                script.chats.append(body)
            self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant",
                                                                  "content": script.verdict(sections["A"], sections["B"])}}]})

    return Handler


@pytest.fixture
def serve():
    servers = []

    def start(script: Script) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(script))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _items(lengths: list[tuple[int, int]], marks: dict[int, str] | None = None) -> pd.DataFrame:
    """A paired items table: item i's reference reply has lengths[i][0] characters, its candidate's lengths[i][1];
    equal lengths give different texts unless ``marks`` says "same"; "garble" marks a reply the judge cannot read."""
    rows = []
    for index, (ref_len, quant_len) in enumerate(lengths):
        mark = (marks or {}).get(index, "")
        ref = ("r" * ref_len) if mark != "garble" else "GARBLE" + "r" * ref_len
        quant = ref if mark == "same" else "q" * quant_len
        rows.append({"item_id": f"harness_prompts/row-{index:06d}", "slice": "prompts",
                     "sub_slice": "support" if index % 2 else "code", "cluster": f"user-{index // 3}",
                     "stratum": "support" if index % 2 else "code", "response_ref": ref, "response_quant": quant,
                     "prompt": f"question {index}"})
    return pd.DataFrame(rows)


def _config(url: str, **extra: Any) -> JudgeConfig:
    return JudgeConfig(endpoint=url, **{"concurrency": 2, **extra})


def test_a_judge_preferring_the_longer_reply_gives_the_hand_counted_wins_ties_and_losses(serve, tmp_path):
    rng = np.random.default_rng(3)
    lengths = [(int(a), int(b)) for a, b in rng.integers(5, 40, size=(30, 2))]
    lengths[4] = (12, 12)  # equal length, different text: a tie in both orders
    marks = {7: "same", 11: "same", 20: "garble"}
    script = Script("longer")
    url = serve(script)
    result = judge.run_judge(_config(url), _items(lengths, marks), {}, log_dir=tmp_path)
    # by hand: the longer reply wins in both orders; identical replies are not asked; a garbled item has no outcome
    judged = [i for i in range(30) if i not in marks]
    wins = sum(lengths[i][1] > lengths[i][0] for i in judged)
    losses = sum(lengths[i][1] < lengths[i][0] for i in judged)
    ties = sum(lengths[i][1] == lengths[i][0] for i in judged) + 2  # + the two identical items
    frame = result.frame
    assert (frame["outcome"] == "win").sum() == wins and (frame["outcome"] == "loss").sum() == losses
    assert (frame["outcome"] == "tie").sum() == ties and (frame["outcome"] == "unparsable").sum() == 1
    assert len(script.chats) == 2 * (30 - 2)  # both orders of every item whose replies differ
    m = result.metrics
    decided = 30 - 1
    assert m["prompts/judge_identical"] == 2 and m["prompts/judge_unparsable"] == 1 and m["prompts/judge_decided"] == decided
    assert m["prompts/judge_win"] == pytest.approx(wins / decided)
    assert m["prompts/judge_loss_minus_win"] == pytest.approx((losses - wins) / decided)
    assert m["prompts/judge_loss_minus_win_ci_low"] <= (losses - wins) / decided <= m["prompts/judge_loss_minus_win_ci_high"]
    assert m["prompts/judge_consistency"] == 1.0 and m["prompts/judge_consistency_n"] == 28 - 1
    # per stratum: the same hand count within each
    table = result.table.set_index("sub_slice")
    for stratum, parity in (("support", 1), ("code", 0)):
        cells = [i for i in judged if i % 2 == parity]
        assert table.loc[stratum, "loss_minus_win"] == pytest.approx(
            (sum(lengths[i][1] < lengths[i][0] for i in cells) - sum(lengths[i][1] > lengths[i][0] for i in cells))
            / (len(cells) + sum(1 for i in marks if marks[i] == "same" and i % 2 == parity)))
    assert result.params["judge.model"] == "scripted-judge" and result.params["judge.requests"] == 1 + 56


def test_a_judge_that_always_says_a_is_inconsistent_on_every_item_and_so_ties_them_all(serve, tmp_path):
    lengths = [(10 + i, 30 - i) for i in range(12)]
    result = judge.run_judge(_config(serve(Script("always_a"))), _items(lengths, {3: "same"}), {}, log_dir=tmp_path)
    m = result.metrics
    assert set(result.frame["outcome"]) == {"tie"}  # ref preferred in one order, the candidate in the other
    assert m["prompts/judge_consistency"] == 0.0 and m["prompts/judge_consistency_n"] == 11
    assert m["prompts/judge_first_chosen"] == 1.0 and m["prompts/judge_decisive"] == 22
    assert m["prompts/judge_win"] == 0.0 and m["prompts/judge_loss"] == 0.0


def test_order_consistency_matches_a_hand_count_for_a_partly_position_biased_judge(serve, tmp_path):
    # The judge says B only when B is at least twice as long as A, else A. By hand, per item (r, q lengths):
    # q >= 2r: the candidate in both orders (win, consistent); r >= 2q: the reference in both (loss, consistent);
    # otherwise the reference first, the candidate second: a tie, inconsistent.
    lengths = [(5, 12), (5, 9), (20, 8), (20, 11), (7, 7), (3, 30), (30, 14), (9, 18), (10, 19), (40, 20), (4, 40)]
    result = judge.run_judge(_config(serve(Script("double"))), _items(lengths), {}, log_dir=tmp_path)
    wins = sum(q >= 2 * r for r, q in lengths)
    losses = sum(r >= 2 * q for r, q in lengths)
    consistent = wins + losses
    m = result.metrics
    assert (wins, losses) == (4, 3)  # the table above, counted once more by eye
    assert m["prompts/judge_win"] == pytest.approx(wins / 11) and m["prompts/judge_loss"] == pytest.approx(losses / 11)
    assert m["prompts/judge_consistency"] == pytest.approx(consistent / 11)
    assert list(result.frame["consistent"]) == [float(q >= 2 * r or r >= 2 * q) for r, q in lengths]


def test_http_429_is_retried_after_the_servers_retry_after(serve):
    script = Script("longer", fail_first=1, retry_after="2")
    url = serve(script)
    waits: list[float] = []
    client = JudgeClient(url, _config(url), sleep=waits.append)
    client.connect()
    verdict = parse_verdict(client.chat(judge_client.judge_messages("User: hi", "short", "a longer reply")))
    assert verdict == "B" and waits == [2.0] and client.retries == 1 and script.refused == 1
    assert len(script.arrivals) == 2  # the refused request and its retry


def test_retry_after_as_an_http_date_and_a_backoff_without_one(serve):
    when = time.time() + 30
    from email.utils import formatdate

    assert judge_client.retry_after(formatdate(when, usegmt=True)) == pytest.approx(30, abs=1.5)
    assert judge_client.retry_after("7") == 7.0 and judge_client.retry_after("soon") is None
    script = Script("longer", fail_first=2, retry_after=None)
    url = serve(script)
    waits: list[float] = []
    client = JudgeClient(url, _config(url), sleep=waits.append)
    client.connect()
    client.chat(judge_client.judge_messages("User: hi", "a", "bb"))
    assert waits == [1.0, 2.0]  # 2 ** attempt seconds


def test_a_server_that_keeps_answering_429_ends_in_one_line(serve):
    script = Script("longer", fail_first=100)
    url = serve(script)
    client = JudgeClient(url, _config(url), sleep=lambda s: None)
    client.connect()
    with pytest.raises(EndpointError, match=r"judge endpoint .*still HTTP 429 after 5 retries: lower "
                                            r"judge\.max_requests_per_s or judge\.concurrency"):
        client.chat(judge_client.judge_messages("User: hi", "a", "bb"))
    assert script.refused == judge_client.RETRIES + 1


def test_the_judge_model_is_the_servers_only_one_or_named_and_checked(serve):
    url = serve(Script(models=("judge-a",)))
    assert JudgeClient(url, _config(url)).connect() == "judge-a"
    url = serve(Script(models=("judge-a", "judge-b")))
    with pytest.raises(EndpointError, match=r"^judge endpoint .* serves \['judge-a', 'judge-b'\]: name one with "
                                            r"judge\.model=<id>$"):
        JudgeClient(url, _config(url)).connect()
    assert JudgeClient(url, _config(url, model="judge-b")).connect() == "judge-b"
    with pytest.raises(EndpointError, match=r"^judge\.model='judge-c' is not served at .*; it serves"):
        JudgeClient(url, _config(url, model="judge-c")).connect()


def test_the_rate_limit_spaces_request_starts():
    now = [0.0]
    slept: list[float] = []
    limit = RateLimit(4.0, clock=lambda: now[0], sleep=slept.append)
    for _ in range(4):
        limit.wait()
    assert slept == pytest.approx([0.25, 0.5, 0.75])  # four starts at 0, 0.25, 0.5, 0.75 s


def test_the_rate_limit_holds_against_a_real_server(serve, tmp_path):
    script = Script("longer")
    lengths = [(3, 9), (9, 3), (4, 5), (6, 2)]
    judge.run_judge(_config(serve(script), max_requests_per_s=10.0, concurrency=4), _items(lengths), {},
                    log_dir=tmp_path)
    arrivals = sorted(script.arrivals)
    assert len(arrivals) == 8
    # at most 10 starts per second, 4 threads or not: 8 requests span at least 7 x 100 ms (less the jitter between a
    # start and its arrival at the two ends; one gap alone can shrink by it); unpaced they arrive within a few ms
    assert arrivals[-1] - arrivals[0] >= 0.7 - 0.05


@pytest.mark.parametrize("text, expected", [
    ("A", "A"), (" b\n", "B"), ("Tie.", "tie"), ("**A**", "A"), ("'B'", "B"), ("Response A", "A"),
    ("<think>A looks longer, but B is right</think>\nB", "B"), ("TIE", "tie"),
    ("A.\nBecause it is longer", "unparsable"), ("Both are good", "unparsable"), ("", "unparsable"),
    (None, "unparsable"), ("A or B", "unparsable"), ("C", "unparsable"), ("<think>unfinished A", "unparsable"),
])
def test_a_verdict_is_one_word_or_unparsable(text, expected):
    assert parse_verdict(text) == expected


def test_the_prompt_is_blind_and_shows_each_order(serve, tmp_path):
    script = Script("longer")
    conversation = {"harness_prompts/row-000000": "System: be brief\n\nUser: why is my bill higher?"}
    judge.run_judge(_config(serve(script)), _items([(4, 8)]), conversation, log_dir=tmp_path)
    users = [chat["messages"][-1]["content"] for chat in script.chats]
    assert all("User: why is my bill higher?" in text and "System: be brief" in text for text in users)
    shown = sorted(tuple(_SECTION.findall(text)) for text in users)
    assert shown == [(("A", "qqqqqqqq"), ("B", "rrrr")), (("A", "rrrr"), ("B", "qqqqqqqq"))]
    for text in users + [chat["messages"][0]["content"] for chat in script.chats]:
        assert not re.search(r"reference|candidate|quantiz", text, re.IGNORECASE)  # nothing says which is which
    assert all(chat["temperature"] == 0 and chat["model"] == "scripted-judge" for chat in script.chats)


def test_the_api_key_reaches_the_header_and_nothing_else(serve, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    script = Script("longer", fail_first=1, key=KEY)
    url = serve(script)
    caplog.set_level(logging.DEBUG)
    cfg = _config(url, api_key_env="JUDGE_TEST_KEY")
    result = judge.run_judge(cfg, _items([(3, 9), (9, 3), (5, 5)]), {}, log_dir=tmp_path / "out")
    judge.write(result, tmp_path / "out")
    assert len(script.chats) == 6  # the key was accepted on every request
    assert KEY not in caplog.text and KEY not in repr(result.params) and KEY not in repr(result.metrics)
    for path in (tmp_path / "out").rglob("*"):
        assert KEY.encode() not in path.read_bytes()
    # a server whose error echoes the header: the message carries *** in its place
    echo = Script("longer", key=KEY, echo_auth_on_error=True)
    echo_url = serve(echo)
    with pytest.raises(EndpointError) as err:
        JudgeClient(echo_url, _config(echo_url, api_key_env="JUDGE_TEST_KEY")).connect()
    assert KEY not in str(err.value) and "Bearer ***" in str(err.value)


@pytest.mark.parametrize("settings, message", [
    ({"endpoint": "http://judge:s3cret@127.0.0.1:9"}, r"credentials in the URL"),
    ({"endpoint": "http://127.0.0.1:9", "slices": ["prompts", "mth"]}, r"judge.slices names \['mth'\]"),
    ({"endpoint": "http://127.0.0.1:9", "slices": []}, r"judge.slices is empty"),
    ({"endpoint": "127.0.0.1:9"}, r"not an http\(s\) URL"),
    ({"endpoint": "http://127.0.0.1:9", "serve": "x --port {port}"}, r"both set"),
    ({"serve": "vllm serve m --port 8000"}, r"has no \{port\}"),
    ({"serve": "vllm serve m --port {port} --api-key abc"}, r"--api-key"),
    ({"endpoint": "http://127.0.0.1:9", "api_key_env": "sk-live-123"}, r"NAME of an environment variable"),
    ({"endpoint": "http://127.0.0.1:9", "api_key_env": "JUDGE_UNSET_VAR_X"}, r"not set"),
    ({"endpoint": "http://127.0.0.1:9", "concurrency": 0}, r"judge.concurrency=0"),
    ({"endpoint": "http://127.0.0.1:9", "max_requests_per_s": 0.0}, r"max_requests_per_s"),
])
def test_bad_judge_config_is_refused_in_one_line(settings, message):
    with pytest.raises(JudgeConfigError, match=message) as err:
        check_config(JudgeConfig(**settings), ["prompts", "math"])
    assert "\n" not in str(err.value) and "s3cret" not in str(err.value)


def test_a_gate_limit_without_a_judge_or_out_of_range_is_refused():
    with pytest.raises(JudgeConfigError, match="no judge is"):
        check_config(JudgeConfig(), ["prompts"], 0.05)
    with pytest.raises(JudgeConfigError, match=r"judge_loss_max=1.5"):
        check_config(JudgeConfig(endpoint="http://127.0.0.1:9"), ["prompts"], 1.5)
    check_config(JudgeConfig(), ["prompts"])  # no judge, no limit: nothing to check


def _saved_run(directory: Path, log: Path, items: pd.DataFrame) -> Path:
    directory.mkdir(parents=True)
    config = {"slices": {"prompts": {"tasks": ["harness_prompts"], "size": "quick",
                                     "metadata": {"path": str(log), "sample": None, "field": None, "max_tokens": 16}}},
              "eval": {"seed": 1234}, "compare": {"ci_level": 0.95}}
    (directory / "config.json").write_text(json.dumps(config))
    items.to_parquet(directory / "items.parquet", index=False)
    return directory


def test_the_command_judges_a_saved_run_with_its_logged_conversations(serve, tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    rows = [{"id": f"r{i}", "group": f"g{i // 2}", "stratum": "support",
             "messages": [{"role": "system", "content": "You are Tidewave's assistant."},
                          {"role": "user", "content": f"question number {i}?"}]} for i in range(6)]
    log.write_text("\n".join(json.dumps(row) for row in rows))
    items = _items([(3, 9), (9, 3), (4, 4), (2, 8), (5, 5), (1, 7)], {4: "same"})
    items["item_id"] = [f"harness_prompts/r{i}" for i in range(6)]
    run = _saved_run(tmp_path / "run", log, items)
    script = Script("longer")
    status = judge.main([str(run), f"judge.endpoint={serve(script)}"])
    assert status == 0
    saved = json.loads((run / "judge" / "judge.json").read_text())
    assert saved["metrics"]["prompts/judge_win"] == pytest.approx(3 / 6)  # hand count: items 0, 3, 5 win
    assert saved["metrics"]["prompts/judge_loss"] == pytest.approx(1 / 6)  # item 1 loses
    assert (run / "judge" / "judge.parquet").exists() and "Pairwise judge by scripted-judge" in capsys.readouterr().out
    assert all("You are Tidewave's assistant." in chat["messages"][-1]["content"] for chat in script.chats)


def test_the_command_refuses_bad_config_before_any_request(serve, tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"id": "r0", "messages": [{"role": "user", "content": "hi"}]}))
    run = _saved_run(tmp_path / "run", log, _items([(3, 9)]))
    script = Script("longer")
    url = serve(script)
    assert judge.main([str(run), f"judge.endpoint={url}", "judge.slices=[math]"]) == 2
    assert judge.main([str(run), url.replace("http://", "judge.endpoint=http://u:pw@")]) == 2
    err = capsys.readouterr().err
    assert "judge.slices names ['math']" in err and "credentials in the URL" in err and "pw@" not in err
    assert script.arrivals == [] and script.chats == []  # nothing reached the server


def test_gate_criterion_reads_the_interval_against_the_limit(tmp_path):
    from harness.config import GateConfig
    from harness.decision.criteria import FAIL, INCONCLUSIVE, PASS
    from harness.decision.gate_inputs import RunResults
    from harness.decision.criteria import judge_criteria

    def run(value: float, low: float, high: float, decided: int = 100) -> RunResults:
        metrics = {"prompts/judge_n": decided, "prompts/judge_decided": decided, "prompts/judge_unparsable": 0,
                   "prompts/judge_loss_minus_win": value, "prompts/judge_loss_minus_win_ci_low": low,
                   "prompts/judge_loss_minus_win_ci_high": high}
        return RunResults(tmp_path, {"metrics": metrics}, {}, pd.DataFrame())

    gate = GateConfig(judge_loss_max=0.05)
    assert [c.outcome for c in judge_criteria(run(-0.02, -0.08, 0.04), gate, ["prompts"])] == [PASS]
    assert [c.outcome for c in judge_criteria(run(0.12, 0.06, 0.18), gate, ["prompts"])] == [FAIL]
    assert [c.outcome for c in judge_criteria(run(0.03, -0.01, 0.07), gate, ["prompts"])] == [INCONCLUSIVE]
    assert [c.outcome for c in judge_criteria(run(-0.02, -0.08, 0.04, decided=12), gate, ["prompts"])] == [INCONCLUSIVE]
    assert judge_criteria(run(0.5, 0.4, 0.6), GateConfig(), ["prompts"]) == []  # no limit set
    assert judge_criteria(run(0.5, 0.4, 0.6), gate, ["math"]) == []  # a slice the judge did not read


def test_the_report_section_names_the_numbers(serve, tmp_path):
    result = judge.run_judge(_config(serve(Script("longer"))), _items([(3, 9), (9, 3), (2, 8), (4, 4)], {3: "same"}),
                             {}, log_dir=tmp_path)
    text = judge_stats.markdown(result.metrics, "prompts", result.table, "scripted-judge")
    assert "## Pairwise judge by scripted-judge: prompts" in text
    assert "identical replies (a tie, the judge not asked): 1" in text and "wins 50.0" in text
    assert "| support |" in text and "| code |" in text


def _tiny_log(tmp_path: Path) -> Path:
    log = tmp_path / "log.jsonl"
    rows = [{"id": f"r{i}", "group": f"user-{i // 2}", "stratum": ["support", "code"][i % 2],
             "messages": [{"role": "user", "content": f"Question {i}: how do I reset my password?"}],
             "max_tokens": 6} for i in range(10)]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return log


@pytest.mark.slow
def test_a_job_with_a_judge_writes_its_verdicts_metrics_and_report_section(make_cfg, serve, tmp_path, monkeypatch):
    from harness.job import pipeline

    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    script = Script("longer", key=KEY)
    url = serve(script)
    result = pipeline.run(make_cfg("model=tiny_random", "quant=int4_g32", "slices=prompts",
                                   f"prompts.path={_tiny_log(tmp_path)}", f"judge.endpoint={url}",
                                   "judge.api_key_env=JUDGE_TEST_KEY", "tracking.enabled=false",
                                   "gate.enabled=true", "gate.judge_loss_max=0.5"))
    results_dir = next((tmp_path / "results").iterdir())
    gated = json.loads((results_dir / "gate.json").read_text())
    assert "judge_loss" in json.dumps(gated)  # the gate reads the judge's criterion beside accuracy
    items = pd.read_parquet(results_dir / "items.parquet")
    differ = int((items["response_ref"] != items["response_quant"]).sum())
    assert differ > 0  # int4 on the tiny model changes replies: the judge has something to read
    # by hand from the saved replies: the scripted judge prefers the longer one, equal lengths tie
    wins = int((items["response_quant"].str.len() > items["response_ref"].str.len()).sum())
    losses = int((items["response_quant"].str.len() < items["response_ref"].str.len()).sum())
    metrics = result["metrics"]
    assert metrics["prompts/judge_n"] == 10 and metrics["prompts/judge_identical"] == 10 - differ
    assert metrics["prompts/judge_win"] == pytest.approx(wins / 10)
    assert metrics["prompts/judge_loss"] == pytest.approx(losses / 10)
    assert len(script.chats) == 2 * differ and result["judge"]["judge.model"] == "scripted-judge"
    assert set(pd.read_parquet(results_dir / "judge.parquet")["item_id"]) == set(items["item_id"])
    assert "## Pairwise judge by scripted-judge: prompts" in (results_dir / "report.md").read_text()
    for path in results_dir.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


def test_a_job_with_a_bad_judge_config_stops_before_loading_the_model(make_cfg, serve, tmp_path):
    from harness.job import pipeline

    script = Script("longer")
    url = serve(script)
    with pytest.raises(JudgeConfigError, match=r"judge.slices names \['math'\]"):
        pipeline.run(make_cfg("model=tiny_random", "slices=prompts", f"prompts.path={_tiny_log(tmp_path)}",
                              f"judge.endpoint={url}", "judge.slices=[math]", "tracking.enabled=false"))
    assert script.arrivals == [] and not (tmp_path / "results").exists()


SERVED_JUDGE = '''
import json, re, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
SECTION = re.compile(r"\\[Response (A|B)\\]\\n(.*?)\\n\\[End of Response \\1\\]", re.DOTALL)
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        print("request", self.path, flush=True)
    def send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.send({"data": [{"id": "served-judge"}]} if self.path == "/v1/models" else {})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        shown = dict(SECTION.findall(body["messages"][-1]["content"]))
        verdict = "tie" if len(shown["A"]) == len(shown["B"]) else "A" if len(shown["A"]) > len(shown["B"]) else "B"
        self.send({"choices": [{"message": {"content": verdict}}]})
HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
'''


def test_judge_serve_starts_the_judge_on_a_free_port_and_stops_it(tmp_path):
    import sys

    from harness.engines.openai_http import healthy

    script = tmp_path / "served_judge.py"
    script.write_text(SERVED_JUDGE)
    cfg = JudgeConfig(serve=f"{sys.executable} {script} {{port}}", serve_startup_s=60)
    seen: list[str] = []
    original = judge.judge_client

    def spy(*args, **kwargs):  # the URL the stage talked to, to check the server is gone afterwards
        manager = original(*args, **kwargs)
        client = manager.__enter__()
        seen.append(client.base.removesuffix("/v1"))
        return _Entered(manager, client)

    class _Entered:
        def __init__(self, manager, client):
            self.manager, self.client = manager, client

        def __enter__(self):
            return self.client

        def __exit__(self, *exc):
            return self.manager.__exit__(*exc)

    judge.judge_client = spy
    try:
        result = judge.run_judge(cfg, _items([(3, 9), (9, 3), (5, 5)]), {}, log_dir=tmp_path)
    finally:
        judge.judge_client = original
    assert list(result.frame["outcome"]) == ["win", "loss", "tie"]  # the longer reply preferred, by hand
    assert result.params["judge.model"] == "served-judge" and result.params["judge.endpoint"] == "serve"
    assert (tmp_path / "judge_serve.log").read_text().count("request /v1/chat/completions") == 6
    assert seen and not healthy(seen[0])  # stopped on leaving


def test_a_judge_serve_command_that_dies_is_one_line_naming_judge_serve(tmp_path):
    import sys

    cfg = JudgeConfig(serve=f"{sys.executable} -c 'import sys; print(\"no model here\"); sys.exit(3)' {{port}}",
                      serve_startup_s=30)
    with pytest.raises(EndpointError, match=r"judge.serve did not come up: .*exited with code 3.*no model here"):
        judge.run_judge(cfg, _items([(3, 9)]), {}, log_dir=tmp_path)


def test_the_judge_metrics_reach_mlflow_under_detail():
    from harness.results.mlflow_views import detail_metrics

    shown = detail_metrics({"metrics": {"prompts/judge_loss_minus_win": 0.04, "prompts/judge_consistency": 0.8}})
    assert shown == {"detail/prompts/judge_loss_minus_win": 0.04, "detail/prompts/judge_consistency": 0.8}


# (verdict with the reference shown first, verdict with the candidate shown first) -> (outcome, consistent), by hand
HAND_TABLE = {
    ("B", "A"): ("win", 1.0), ("B", "tie"): ("win", 0.0), ("tie", "A"): ("win", 0.0),
    ("A", "B"): ("loss", 1.0), ("A", "tie"): ("loss", 0.0), ("tie", "B"): ("loss", 0.0),
    ("tie", "tie"): ("tie", 1.0), ("A", "A"): ("tie", 0.0), ("B", "B"): ("tie", 0.0),
}


@pytest.mark.parametrize("first", ["A", "B", "tie", "unparsable"])
@pytest.mark.parametrize("second", ["A", "B", "tie", "unparsable"])
def test_every_pair_of_verdicts_gives_the_hand_tabled_outcome(first, second):
    outcome, consistent = judge_stats.item_outcome(first, second)
    if "unparsable" in (first, second):
        assert outcome == "unparsable" and np.isnan(consistent)  # no outcome, not guessed from the other order
    else:
        assert (outcome, consistent) == HAND_TABLE[(first, second)]
