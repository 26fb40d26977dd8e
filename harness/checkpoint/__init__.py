"""Checkpoints in and out: external candidates (:mod:`.candidate`), export to compressed-tensors
(:mod:`.export`, :mod:`.export_grids`) and the round-trip check (:mod:`.export_check`)."""
