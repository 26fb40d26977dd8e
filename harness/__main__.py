"""``python -m harness model=... quant=... slices=...`` — see README.md."""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from harness.config import CONF_DIR, register_configs

register_configs()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from harness.run import run

    result = run(cfg)
    return result.get("metrics", {}).get("overall/kl_mean")


if __name__ == "__main__":
    main()
