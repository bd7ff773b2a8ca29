"""Where the project's config tree and bundled assets live."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
ASSETS_DIR = PACKAGE_DIR / "assets"
TINY_TOKENIZER_DIR = ASSETS_DIR / "tiny_tokenizer"
SAMPLE_DATA_DIR = ASSETS_DIR / "sample_data"


def project_root() -> Path:
    """The directory holding conf/ and recipes/: $DSRECIPES_HOME, else the checkout the package lives in."""
    env = os.environ.get("DSRECIPES_HOME")
    root = Path(env).resolve() if env else PACKAGE_DIR.parent
    if not (root / "conf" / "train.yaml").is_file():
        from dsrecipes.errors import ConfigError

        raise ConfigError(
            f"cannot find conf/train.yaml under {root}; install dsrecipes from a checkout "
            "(pip install -e .) or set DSRECIPES_HOME to the checkout"
        )
    return root


def conf_dir() -> Path:
    return project_root() / "conf"
