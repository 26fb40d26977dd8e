"""Scoring for the code slice: turn a response into a program and run its tests in the sandbox.

The task shows the model the problem (signature and docstring) and asks for the complete
function in a ```python block, with or without a chat template. Responses come as a fenced
new definition (usual for chat models), a bare definition, or a continuation of the body
(base models continuing the prompt); prose may follow. :func:`build_program` handles all of them.
The response is hostile input: it is only ever run by
:func:`harness.sandbox.run_python`, in a throwaway process with time, memory, process,
file-size and network limits.
"""
from __future__ import annotations

import re

from harness.sandbox import SandboxResult, run_python

_FENCE_LINE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[ \t]*$", re.MULTILINE)
_CODE_LINE_STARTS = (" ", "\t", "def ", "class ", "import ", "from ", "@", "return ")
_TRUSTED_PROBE = "pass\n"


def _looks_like_code(text: str) -> bool:
    return any(line.startswith(_CODE_LINE_STARTS) for line in text.splitlines() if line.strip())


def extract_code(response: str) -> str:
    """The code part of a response.

    The first fence line opens a block if it names a language (```python) or only prose precedes it;
    the block's contents (up to the next fence, or the end) are the code. Otherwise the fence closes
    code the response began with (a body continuation), and that code is kept. No fence: all of it.
    """
    text = response.replace("\r\n", "\n")
    fence = _FENCE_LINE.search(text)
    if fence is None:
        return text
    before = text[: fence.start()]
    if fence.group(1) or not _looks_like_code(before):
        after = text[fence.end():].removeprefix("\n")
        closing = _FENCE_LINE.search(after)
        return after if closing is None else after[: closing.start()]
    return before


def redefines(code: str, entry_point: str) -> bool:
    """Whether ``code`` holds a top-level definition of ``entry_point`` (a complete answer, not a body)."""
    return re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def build_program(prompt: str, response: str, test: str, entry_point: str) -> str:
    """The program whose exit status is the verdict: solution, then the tests, then ``check(entry_point)``.

    A body continuation is appended to the prompt. A complete definition is appended after
    the prompt, whose own function (a docstring-only body, valid Python) it then replaces;
    the prompt stays so that its imports and helper functions are defined.
    """
    code = extract_code(response)
    solution = f"{prompt}\n{code}" if redefines(code, entry_point) else prompt + code
    return f"{solution}\n\n{test}\n\ncheck({entry_point})\n"


def run_tests(doc: dict, response: str) -> SandboxResult:
    """Run the response's program for item ``doc`` in the sandbox with the item's limits."""
    program = build_program(doc["prompt"], response, doc["test"], doc["entry_point"])
    result = run_python(program, timeout_s=float(doc.get("timeout_s", 5.0)), memory_mb=int(doc.get("memory_mb", 512)))
    if result.status == "error":
        # "error" means the sandbox did not start; a program can only fake that. A trusted probe tells which.
        probe = run_python(_TRUSTED_PROBE, timeout_s=10.0)
        if probe.status == "error":
            raise RuntimeError(f"the code sandbox cannot run programs here: {probe.stderr.strip()!r}. Fix the "
                               "sandbox setup (see harness/sandbox.py) or drop the code slice (slices=[...]).")
    return result


def process_results(doc: dict, results: list[str]) -> dict[str, int]:
    """lm-eval hook: ``acc`` is pass@1 of the greedy response (1 iff every assert of the item's tests holds)."""
    return {"acc": int(run_tests(doc, results[0]).passed)}
