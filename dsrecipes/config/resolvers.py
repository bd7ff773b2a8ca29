"""The resolvers a composition may call, enforced where OmegaConf resolves interpolations (not by scanning text).

`install()` (config/hydra_app.py, before every composition) replaces OmegaConf's resolver registry with one that
holds only safety.RESOLVERS and keeps refusing every other name, including the ones Hydra registers again for each
job (`hydra`, `python_version`) and OmegaConf's own (`oc.decode`, `oc.create`, `oc.dict.*`, `oc.deprecated`).
`oc.env` is `readable_env`: it reads only the variables in safety.READABLE_ENV. Whatever form a recipe's text takes
(`\\${`, `\\\\${`, nested in another resolver, in a list, in a flat file), an interpolation that resolves goes
through this registry, so a call outside it is one message naming the key (config/hints.py), and nothing else is
ever read. A key (`${oc.env:X}: 1`) is never resolved by OmegaConf: it stays text, and the schema refuses it.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.basecontainer import BaseContainer

from dsrecipes.config.safety import READABLE_ENV, RESOLVERS
from dsrecipes.core.errors import ConfigError
from dsrecipes.core.paths import ASSETS_DIR

_NO_DEFAULT = object()


class AllowedResolvers(dict):
    """OmegaConf's registry (BaseContainer._resolvers) holding only RESOLVERS: registering another name is a no-op,
    so a later `register_new_resolver` (Hydra's setup_globals for each job) cannot add one back."""

    def __setitem__(self, name: str, resolver: Any) -> None:
        if name in RESOLVERS:
            super().__setitem__(name, resolver)

    def setdefault(self, name: str, resolver: Any = None) -> Any:
        if name in RESOLVERS:
            return super().setdefault(name, resolver)
        return None

    def update(self, *args: Any, **kwargs: Any) -> None:
        for name, resolver in dict(*args, **kwargs).items():
            self[name] = resolver


def install() -> None:
    """Only the allowed resolvers from now on in this process (idempotent); `dsr.asset` and `oc.env` are ours."""
    registry = BaseContainer._resolvers
    if not isinstance(registry, AllowedResolvers):
        BaseContainer._resolvers = AllowedResolvers({k: v for k, v in registry.items() if k in RESOLVERS})
    OmegaConf.register_new_resolver("dsr.asset", lambda name: str(ASSETS_DIR / name), replace=True)
    OmegaConf.register_new_resolver("oc.env", readable_env, replace=True)


def readable_env(name: str, default: Any = _NO_DEFAULT) -> Optional[str]:
    """`${oc.env:NAME[,DEFAULT]}` as OmegaConf's own resolver answers it, for the variables in READABLE_ENV only; any
    other name is refused without reading it (the message names the variable, never a value)."""
    if name not in READABLE_ENV:
        raise ConfigError(f"reads the environment variable '{name}' (configuration may read only "
                          f"{', '.join(READABLE_ENV)}; pass other values on the command line, where the shell "
                          "expands $VARIABLES)")
    value = os.environ.get(name)
    if value is not None:
        return value
    if default is _NO_DEFAULT:
        raise ConfigError(f"${{oc.env:{name}}}: the environment variable {name} is not set")
    return None if default is None else str(default)


def refused_resolver(message: str) -> Optional[str]:
    """OmegaConf's message for a resolver outside the registry, as ours (None: another message)."""
    prefix = "Unsupported interpolation type "
    if not message.startswith(prefix):
        return None
    name = message[len(prefix):].split()[0].strip("'\"")
    return f"calls the resolver '{name}' (configuration may call only {', '.join(RESOLVERS)})"
