"""Deciding whether a scheme ships: the gate (reading runs, its criteria, its output)."""
