"""Deciding whether a scheme ships: the gate (reading runs, its criteria, its output), the
memory and speed ledger, and the quantization report of a scheme's weights."""
