"""A small OpenAI-compatible ``/v1/completions`` server over an in-memory transformers model, for tests.

It implements the protocol independently of ``harness.engines.openai_endpoint``: it tokenizes text
prompts itself, scores prompt tokens one unbatched forward at a time, generates greedily without a
KV cache, and cuts replies at stop strings, so an endpoint candidate evaluated through it can be
compared item by item with the same model evaluated in process. Faults are switches: ``vocab_shift``
(another vocabulary: every id the server tokenizes or echoes is moved by that much), ``api_key``
(401 without it), ``die_after`` (the server stops, dropping the connection, at that completion
request), ``hang_s`` (each completion waits that long first), ``prompt_logprobs=False`` (echoed prompt
tokens come without log-probs, as from a server that gives none), ``max_logprobs`` (a request asking
for more log-probs per token is refused with HTTP 400, as vLLM's ``--max-logprobs`` does).
``script`` (a function of the prompt text returning ``{"text": ..., "reasoning_content": ..., "finish_reason":
...}``) answers generation requests from a script instead of the model, as a thinking model behind a reasoning
parser would (closed, unclosed, looping traces); prompt tokens are then echoed with log-probs of 0.

``python tests/fake_openai.py --port N`` serves only ``/health`` and ``/v1/models`` (no model): a
stand-in process for the ``candidate.serve`` tests.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeServer:
    def __init__(self, model: Any = None, tokenizer: Any = None, *, name: str = "fake", max_model_len: int = 2048,
                 vocab_shift: int = 0, api_key: str | None = None, die_after: int | None = None,
                 hang_s: float = 0.0, port: int = 0, prompt_logprobs: bool = True, max_logprobs: int | None = None,
                 script: Any = None):
        self.script = script
        self.model, self.tokenizer, self.name, self.max_model_len = model, tokenizer, name, max_model_len
        self.vocab_shift, self.api_key, self.die_after, self.hang_s = vocab_shift, api_key, die_after, hang_s
        self.prompt_logprobs, self.max_logprobs = prompt_logprobs, max_logprobs
        self.completions = 0  # completion requests answered
        self.in_flight = self.max_in_flight = 0  # completion requests being answered at once (and the most seen)
        self._model_lock = threading.Lock()  # one forward (and one tokenizer call) at a time; requests may overlap
        self._count_lock = threading.Lock()
        self.prompts = 0  # prompts scored or generated
        self.seen_headers: list[dict[str, str]] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------------ the model side
    def _vocab(self) -> int:
        return len(self.tokenizer)

    def _shift(self, ids: list[int]) -> list[int]:
        return [(i + self.vocab_shift) % self._vocab() for i in ids] if self.vocab_shift else list(ids)

    def _text(self, token_id: int, as_ids: bool) -> str:
        """A token as the server names it; with ``vocab_shift`` its id means another text."""
        if as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([(token_id - self.vocab_shift) % self._vocab()], skip_special_tokens=False)

    def _logprobs(self, ids: list[int]):
        import torch

        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    def _complete(self, body: dict) -> dict:
        prompts = body["prompt"]
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        k = int(body.get("logprobs") or 0)
        if self.max_logprobs is not None and k > self.max_logprobs:
            raise ValueError(f"Requested sample logprobs of {k}, which is greater than max allowed: "
                             f"{self.max_logprobs}")
        stops = [s for s in (body.get("stop") or []) if s]
        eos = self.tokenizer.eos_token_id
        choices = []
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                ids = self.tokenizer(prompt, add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
                ids = self._shift(ids)
            else:
                ids = list(prompt)
            if len(ids) + int(body.get("max_tokens") or 0) > self.max_model_len:
                raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens")
            generated: list[int] = []
            scripted = None
            if self.script is not None and int(body.get("max_tokens") or 0) > 0:
                scripted = self.script(prompt if isinstance(prompt, str) else self.tokenizer.decode(ids))
                generated = self.tokenizer(scripted.get("text") or "", add_special_tokens=False)["input_ids"]
            for _ in range(0 if scripted is not None else int(body.get("max_tokens") or 0)):
                nxt = int(self._logprobs(ids + generated)[-1].argmax())
                generated.append(nxt)
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                if nxt == eos or any(s in text for s in stops):
                    break
            reply = self.tokenizer.decode(generated, skip_special_tokens=True) if scripted is None \
                else str(scripted.get("text") or "")
            for stop in stops:
                reply = reply.split(stop)[0]
            every = ids + generated
            scores = self._logprobs(every) if body.get("echo") and scripted is None and self.model is not None else None
            token_logprobs, top = [None], [None]
            for pos in range(1, len(every) if scores is not None else 0):
                row = scores[pos - 1]
                token_logprobs.append(float(row[every[pos]]))
                best = row.topk(max(k, 1))
                entry = {self._text(int(i), as_ids): float(v) for v, i in zip(best.values, best.indices)}
                entry[self._text(every[pos], as_ids)] = float(row[every[pos]])
                top.append(entry)
            if scores is None:  # scripted: every echoed token at log-prob 0, itself the top
                token_logprobs = [None] + [0.0] * (len(every) - 1)
                top = [None] + [{self._text(i, as_ids): 0.0} for i in every[1:]]
            if not self.prompt_logprobs:  # the prompt's tokens echoed, their log-probs not given
                token_logprobs[:len(ids)] = [None] * len(ids)
                top[:len(ids)] = [None] * len(ids)
            prompt_text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids, skip_special_tokens=False)
            texts = [self._text(i, as_ids) for i in every]
            offsets, at = [], 0
            for i in every:
                offsets.append(at)
                at += len(self.tokenizer.decode([i], skip_special_tokens=False))
            choice = {"index": index, "text": (prompt_text if body.get("echo") else "") + reply,
                      "finish_reason": "stop" if len(generated) < int(body.get("max_tokens") or 0) else "length"}
            if scripted is not None:
                choice.update({k: v for k, v in scripted.items() if k != "text"})
            if body.get("logprobs") is not None:
                choice["logprobs"] = {"tokens": texts if body.get("echo") else texts[len(ids):],
                                      "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
            choices.append(choice)
            self.prompts += 1
        return {"object": "text_completion", "model": self.name, "choices": choices}

    # ------------------------------------------------------------------ HTTP
    def _handler(self) -> type:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, code: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                server.seen_headers.append(dict(self.headers))
                if server.api_key and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                    self._send(401, {"error": {"message": "invalid API key"}})
                    return False
                return True

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/v1/models" and self._authorized():
                    self._send(200, {"object": "list", "data": [{"id": server.name, "object": "model",
                                                                 "max_model_len": server.max_model_len}]})
                elif self.path != "/v1/models":
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path != "/v1/completions":
                    self._send(404, {"error": {"message": "not found"}})
                    return
                if not self._authorized():
                    return
                if server.die_after is not None and server.completions >= server.die_after:
                    threading.Thread(target=server.stop, daemon=True).start()
                    self.close_connection = True
                    self.connection.close()  # no answer: the client sees the connection drop
                    return
                if server.hang_s:
                    time.sleep(server.hang_s)
                if server.model is None and server.script is None:
                    self._send(400, {"error": {"message": "no model loaded"}})
                    return
                with server._count_lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    with server._model_lock:
                        payload = server._complete(body)
                except ValueError as exc:
                    self._send(400, {"error": {"message": str(exc)}})
                    return
                finally:
                    with server._count_lock:
                        server.in_flight -= 1
                server.completions += 1
                self._send(200, payload)

        return Handler


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fail", default=None, help="print this and exit 3 instead of serving")
    args = parser.parse_args()
    if args.fail:
        print(args.fail, flush=True)
        raise SystemExit(3)
    print(f"stub server on 127.0.0.1:{args.port}", flush=True)
    FakeServer(port=args.port).httpd.serve_forever()
