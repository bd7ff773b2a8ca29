"""`${oc.env:...}` is enforced where OmegaConf resolves it (config/hydra_app.readable_env), not only by the scan of a
recipe's text (config/safety.py): every escape form a recipe can write - a backslash before `${`, an escaped
backslash before it (`\\\\${`, which OmegaConf reads as a literal backslash and then a live interpolation), nested
inside another resolver, inside a list - resolves through the guarded resolver, so a variable outside READABLE_ENV is
one message naming the key, exit 2, and the secret is in no output. The hole: the scan skipped `${` after a
backslash, `validate` said OK and the secret landed in config.yaml."""

from __future__ import annotations

import pytest

from dsrecipes.cli import main as cli_main
from dsrecipes.config import hydra_app
from dsrecipes.core.errors import ConfigError

SECRET = "dsr-test-secret-7d1f"
FORMS = {
    "escaped backslash": "trainer:\n  experiment: '\\\\${oc.env:DSR_TEST_SECRET}'\n",
    "escaped backslash, flat": "trainer.experiment: 'x\\\\${oc.env:DSR_TEST_SECRET}'\n",
    "nested in oc.select": "trainer:\n  experiment: '\\\\${oc.select:nothing.here,${oc.env:DSR_TEST_SECRET}}'\n",
    "inside a list": "dataset:\n  paths: ['\\\\${oc.env:DSR_TEST_SECRET}']\n",
    "with a default": "trainer:\n  experiment: '\\\\${oc.env:DSR_TEST_SECRET,fallback}'\n",
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_recipe_reads_no_secret_in_any_escape_form(form, tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("DSR_TEST_SECRET", SECRET)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(FORMS[form], encoding="utf-8")
    code = cli_main(["validate", f"recipe={recipe}", "debug=fast"])
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert SECRET not in out + err
    assert "DSR_TEST_SECRET" in err and "Traceback" not in err
    assert "trainer.experiment" in err or "dataset.paths" in err or "r.yaml" in err


def test_the_resolver_itself():
    hydra_app.register_schemas()
    with pytest.raises(ConfigError, match="may read only DSRECIPES_SMOLLM2_DIR"):
        hydra_app.readable_env("HOME")
    assert hydra_app.readable_env("DSRECIPES_SMOLLM2_DIR", "fallback") in ("fallback", *[__import__("os").environ.get(
        "DSRECIPES_SMOLLM2_DIR")])


def test_the_composed_config_never_holds_the_secret(monkeypatch):
    """The check is on what OmegaConf resolves: a composition holding the escaped form refuses at resolution."""
    from omegaconf import OmegaConf

    monkeypatch.setenv("DSR_TEST_SECRET", SECRET)
    hydra_app.register_schemas()
    composed = OmegaConf.create({"trainer": {"experiment": "\\\\${oc.env:DSR_TEST_SECRET}"}})
    with pytest.raises(Exception) as caught:
        OmegaConf.to_container(composed, resolve=True)
    assert SECRET not in str(caught.value) and "may read only" in str(caught.value)
    allowed = OmegaConf.create({"v": "${oc.env:DSRECIPES_SMOLLM2_DIR,somewhere}"})
    monkeypatch.delenv("DSRECIPES_SMOLLM2_DIR", raising=False)
    assert OmegaConf.to_container(allowed, resolve=True) == {"v": "somewhere"}


def test_schemas_are_built_once_per_process_and_stored_again_where_replaced():
    """register_schemas runs on every compose: building the 13 structured schemas again each time was ~30% of a
    compose. They are stored once (ConfigStore hands out deep copies, so an entry stays as stored); an entry that is not
    ours any more (another registration replaced it) is stored again, so a composition never validates against it."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from dsrecipes.config.load import compose, compose_and_load
    from dsrecipes.core.schema import TrainConfig, TrainerConfig

    hydra_app.register_schemas()
    store = ConfigStore.instance()
    trainer, train = store.repo["schema"]["trainer.yaml"], store.repo["train_schema.yaml"]
    compose(["debug=fast"])
    assert store.repo["schema"]["trainer.yaml"] is trainer and store.repo["train_schema.yaml"] is train
    store.store(group="schema", name="trainer", node={"anything": 1})  # someone else's entry, under our name
    with pytest.raises(ConfigError, match="no_such_key"):
        compose_and_load(["debug=fast", "+trainer.no_such_key=1"])  # refused by our schema, stored again first
    again = store.repo["schema"]["trainer.yaml"]
    assert again is not trainer and OmegaConf.get_type(again.node) is TrainerConfig
    assert OmegaConf.get_type(store.repo["train_schema.yaml"].node) is TrainConfig
