"""Renderings of a :class:`harness.compare.analysis.ComparisonReport`, one module each:

``tables`` (the formatted tables every text rendering shares), ``terminal``, ``markdown``,
``html_page`` (one self-contained page) and ``plots`` (PNG figures). Renderers read the
report's tables and import nothing above :mod:`harness.compare.analysis`.
"""
