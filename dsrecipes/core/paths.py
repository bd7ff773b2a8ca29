"""Where the project's config tree and bundled assets live.

The config tree's source is the checkout's top-level `conf/` (its `conf/recipe` links to `recipes/`).
`dsrecipes/conf` links to `../conf`, so the code finds it beside itself in a checkout or an editable install, and a
wheel (`pip install .`) carries it as real files (package data, see pyproject.toml). `DSRECIPES_HOME=DIR` points at
another tree (`DIR/conf/train.yaml`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

from dsrecipes.core.errors import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # dsrecipes/ (this file is dsrecipes/core/paths.py)
ASSETS_DIR = PACKAGE_DIR / "assets"
TINY_TOKENIZER_DIR = ASSETS_DIR / "tiny_tokenizer"
SAMPLE_DATA_DIR = ASSETS_DIR / "sample_data"
HOME_ENV = "DSRECIPES_HOME"


def user_cache_dir(environ: Optional[Mapping[str, str]] = None) -> Path:
    """The user's cache folder, as torch, pip and Hugging Face read it: $XDG_CACHE_HOME, else $HOME/.cache (`environ`:
    another environment than this process's, e.g. the one a rank will get)."""
    environ = os.environ if environ is None else environ
    home = environ.get("HOME") or os.path.expanduser("~")
    return Path(environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"))


def conf_dir() -> Path:
    """The config tree: $DSRECIPES_HOME/conf, else the one installed with the package."""
    env = os.environ.get(HOME_ENV)
    conf = Path(env).expanduser().resolve() / "conf" if env else PACKAGE_DIR / "conf"
    if not (conf / "train.yaml").is_file():
        where = f"{HOME_ENV}={env}" if env else f"the installed package ({PACKAGE_DIR})"
        raise ConfigError(f"cannot find conf/train.yaml in {where}; reinstall dsrecipes (pip install .) "
                          f"or set {HOME_ENV} to a checkout")
    return conf


def shipped_recipes_dir() -> Path:
    """The recipes that come with dsrecipes (conf/recipe, a link to the checkout's recipes/)."""
    return conf_dir() / "recipe"
