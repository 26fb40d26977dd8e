"""llama.cpp's own functions for the GGUF export and its checks, run in ``.venv-llamacpp`` as a subprocess.

Standard library and ``llama_cpp`` only (the harness is not installed in that venv): one JSON request on
stdin, one JSON answer line on stdout (``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``).

* ``quantize``: ``llama_cpp.llama_model_quantize`` (llama.cpp's quantizer, as llama-quantize runs it) of
  ``source`` to ``out`` with ``llama_cpp.LLAMA_FTYPE_MOSTLY_<type>``;
* ``tokenize``: the written file's vocabulary only (``vocab_only``), each text tokenized as the server
  tokenizes a completion prompt (special tokens parsed, BOS as the file's ``add_bos_token`` says);
* ``logits``: full next-token log-probs of token-id texts (``logits_all``), one float32 ``text<i>.npy`` per text
  in the ``out`` directory: llama.cpp's own distribution, for a KL the server's top-k cannot give (what
  ``llama-perplexity --kl-divergence`` compares; the pip package does not build that binary).
"""
from __future__ import annotations

import json
import sys


def quantize(request: dict) -> dict:
    import llama_cpp

    name = str(request["type"]).upper()
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}", None)
    if ftype is None:
        return {"ok": False, "error": f"llama_cpp has no LLAMA_FTYPE_MOSTLY_{name}"}
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = int(request.get("threads") or 0)
    status = llama_cpp.llama_model_quantize(str(request["source"]).encode(), str(request["out"]).encode(), params)
    if status != 0:
        return {"ok": False, "error": f"llama_model_quantize returned {status}"}
    return {"ok": True, "ftype": int(ftype), "llama_cpp": llama_cpp.__version__}


def tokenize(request: dict) -> dict:
    import llama_cpp

    model = llama_cpp.Llama(model_path=str(request["model"]), vocab_only=True, verbose=False)
    add_bos = bool(model._model.add_bos_token())
    tokens = [model.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True) for text in request["texts"]]
    return {"ok": True, "tokens": tokens}


def logits(request: dict) -> dict:
    import llama_cpp
    import numpy as np

    texts = [list(map(int, ids)) for ids in request["texts"]]
    n_ctx = max(len(ids) for ids in texts) + 8
    model = llama_cpp.Llama(model_path=str(request["model"]), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                            logits_all=True, verbose=False, n_threads=int(request.get("threads") or 0) or None)
    for index, ids in enumerate(texts):
        model.reset()
        model.eval(ids)
        scores = np.array(model.scores[:len(ids)], dtype=np.float64)
        shifted = scores - scores.max(axis=1, keepdims=True)
        logprobs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        np.save(f"{request['out']}/text{index}.npy", logprobs.astype(np.float32))  # row i: next-token after ids[i]
    return {"ok": True, "n": len(texts)}


def main() -> int:
    request = json.loads(sys.stdin.read())
    handlers = {"quantize": quantize, "tokenize": tokenize, "logits": logits}
    try:
        answer = handlers[request["op"]](request)
    except Exception as exc:  # noqa: BLE001 - reported to the caller as one line
        answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(answer), flush=True)
    return 0 if answer.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
