"""Choosing a scheme before a sweep: the sweep's time and memory plan (:mod:`.plan`), per-layer
sensitivity (:mod:`.sensitivity`) and the scheme that fits a budget (:mod:`.recommend`)."""
