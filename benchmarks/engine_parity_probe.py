"""Simulation vs served (issue 34): token log-probs of the same ids from the harness's simulation of a scheme and
from a server serving its export, beside the simulation's own sensitivity to a 1-ulp input perturbation.

``python benchmarks/engine_parity_probe.py <scheme> <port>`` with a server on 127.0.0.1:<port> serving
``python -m harness.export model=smollm2_135m quant=<scheme>`` (e.g. vLLM CPU, fp32, --enforce-eager). Six chat
prompts (278 scored positions); prints mean / median / max |Δ log p| for served vs simulation, simulation vs
the same simulation with its embeddings jittered by 2^-23 relative (the arithmetic-noise floor: how far a
last-bit difference anywhere moves this scheme), and both against the unquantized reference.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from harness.config import compose
from harness.config import to_config
from harness.models import loading as models
from harness import quant
from harness.engines.openai_http import Client, EndpointSpec
torch.set_num_threads(1)
scheme, port = sys.argv[1], sys.argv[2]
cfg = to_config(compose(["model=smollm2_135m", f"quant={scheme}"]))
loaded = models.load(cfg.model, cfg.paths.cache_dir)
tok, model = loaded.tokenizer, loaded.model
qs = ["What is 17 times 23?", "Name three primary colors.", "Write a Python function that reverses a string.",
      "Give a JSON object with keys name and age for Alice, 30.", "Why is the sky blue?", "Translate 'good morning' to French."]
ids = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True) + "Sure. Here is the answer: ", add_special_tokens=False)["input_ids"] for q in qs]
def lp(x):
    with torch.no_grad():
        out = torch.log_softmax(model(torch.tensor([x])).logits[0].float(), -1)
    return out[:-1].gather(1, torch.tensor(x[1:])[:, None])[:, 0].double()
def jitter(module, inputs, out):
    g = torch.Generator().manual_seed(7)
    return out * (1 + (torch.rand(out.shape, generator=g) - 0.5) * 2 ** -22)
ref = [lp(x) for x in ids]
quant.apply(model, cfg.quant, None)
sim = [lp(x) for x in ids]
h = model.get_input_embeddings().register_forward_hook(jitter); simj = [lp(x) for x in ids]; h.remove()
c = Client(EndpointSpec(url=f"http://127.0.0.1:{port}", timeout_s=900)); c.connect()
served = [torch.tensor(ch["logprobs"]["token_logprobs"][1:], dtype=torch.float64) for ch in c.complete(prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)]
d = lambda a, b: torch.cat([(x - y).abs() for x, y in zip(a, b)])
for name, (a, b) in {"served vs simulation": (served, sim), "simulation vs 1-ulp-jittered simulation": (sim, simj),
                     "served vs reference": (served, ref), "simulation vs reference": (sim, ref)}.items():
    x = d(a, b); print(f"{scheme}: {name:42s} mean |Δlog p| {x.mean():.4f}  median {x.median():.4f}  max {x.max():.3f}  (n={len(x)})")
