"""A plugin number format for the tests: a symmetric 3-bit integer grid (codes -3..3, scale amax / 3).

A scheme lists this module in ``quant.plugins``; importing it registers the entry. It is built by hand
from ``format_math``'s integer primitives, with no entry maker, and declares nothing but its grid:
its storage, label, ledger and KV-cache bits all come from the table's generic accounting.
"""
from __future__ import annotations

import torch

from harness.quant import format_math, register_format
from harness.quant.format_table import NumberFormat

TOY = "toy_int3"


def toy_entry() -> NumberFormat:
    """The table entry (a fresh object each call, so a test can register and unregister it)."""
    def quantize(x, spec, granularity, include_zero=True):
        return format_math.int_quantize(x, 3, symmetric=True, granularity=granularity,
                                        group_size=spec.group_size if granularity == "group" else None)

    def round_(x, spec, scale, zero):
        return format_math.int_fake_quant(x, scale, torch.zeros_like(scale), 3, symmetric=True)

    def qparams(x, spec, dims, include_zero):
        return format_math.int_qparams(x, 3, symmetric=True, dim=dims)

    return NumberFormat(TOY, max=lambda spec: 3.0, element_bits=lambda spec: 3.0,
                        granularities=frozenset({"tensor", "channel", "group", "token"}), quantize=quantize,
                        round=round_, qparams=qparams)


register_format(toy_entry())
