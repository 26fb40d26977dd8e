"""``python -m harness model=... quant=... slices=...`` — see README.md."""
from __future__ import annotations

import re
import sys

import hydra
from omegaconf import DictConfig

from harness.config import CONF_DIR, register_configs

register_configs()
GROUPS = ("model", "quant", "slices")


def check_group_options(argv: list[str]) -> str | None:
    """Name unknown config-group options and list the available ones (Hydra does not for lists)."""
    for arg in argv:
        match = re.fullmatch(r"(?:\+|~)?(model|quant|slices)=(.+)", arg)
        if not match:
            continue
        group, value = match.groups()
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        chosen = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
        unknown = [v for v in chosen if v not in options]
        if unknown:
            return f"unknown {group} option(s) {unknown}; available {group} options: {', '.join(options)}"
    return None


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from harness.run import run

    result = run(cfg)
    return result.get("metrics", {}).get("overall/kl_mean")


if __name__ == "__main__":
    problem = check_group_options(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
