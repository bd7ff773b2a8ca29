"""Resolvers are enforced where OmegaConf resolves them (config/resolvers.py), never by scanning a recipe's text:
only safety.RESOLVERS are registered while recipes compose (Hydra's per-job re-registration cannot add `hydra` or
`python_version` back), and every escape form - `\\${`, `\\\\${`, nested, in a key, in a list, in a flat recipe file
run by path - is checked on the COMPOSED config: resolved, it holds no secret and calls no other resolver.
Before: `oc.decode`, `oc.create`, `oc.dict.*` and `hydra` stayed registered, and the text scan skipped `${` after a
backslash, so `\\\\${oc.create:...}` or `\\\\${hydra:...}` passed `validate`."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from omegaconf.basecontainer import BaseContainer

from dsrecipes.cli import main as cli_main
from dsrecipes.config import hydra_app, safety
from dsrecipes.config.hints import clean_hydra_message

SECRET = "dsr-resolver-secret-91c2"


def _compose_file(tmp_path, text, name="r.yaml"):
    recipe = tmp_path / name
    recipe.write_text(text, encoding="utf-8")
    return hydra_app.compose([f"recipe={recipe}"])


def _resolved(composed):
    """What a run would use: the composition resolved (load.check_composition does the same, key by key)."""
    try:
        return OmegaConf.to_container(composed, resolve=True), ""
    except Exception as exc:  # noqa: BLE001 - the refusal, as the console shows it
        return None, clean_hydra_message(exc)


def test_only_the_allowed_resolvers_are_registered_while_composing(tmp_path):
    from hydra.core.utils import setup_globals

    hydra_app.compose([])
    setup_globals()  # what Hydra's basic launcher does before each job of a sweep
    OmegaConf.register_new_resolver("anything_else", lambda: "x", replace=True)
    assert set(BaseContainer._resolvers) <= set(safety.RESOLVERS), sorted(BaseContainer._resolvers)
    for name in ("oc.decode", "oc.create", "oc.dict.keys", "oc.deprecated", "hydra", "python_version"):
        assert not OmegaConf.has_resolver(name), name


FORMS = {  # name -> (recipe text, what the composed, resolved trainer.experiment may be when it is not refused)
    "backslash: a literal": ("trainer:\n  experiment: '\\${oc.env:DSR_RES_SECRET}'\n", "${oc.env:DSR_RES_SECRET}"),
    "escaped backslash: live": ("trainer:\n  experiment: '\\\\${oc.env:DSR_RES_SECRET}'\n", None),
    "nested in oc.select": ("trainer:\n  experiment: '${oc.select:no.key,${oc.env:DSR_RES_SECRET}}'\n", None),
    "nested, escaped": ("trainer:\n  experiment: 'a\\\\${oc.select:no.key,\\\\${oc.env:DSR_RES_SECRET}}'\n", None),
    "oc.decode of an escaped call": ("trainer:\n  experiment: '\\\\${oc.decode:\"\\${oc.env:DSR_RES_SECRET}\"}'\n",
                                     None),
    "oc.create": ("trainer:\n  experiment: '\\\\${oc.create:\"{a: 1}\"}'\n", None),
    "hydra resolver": ("trainer:\n  experiment: '\\\\${hydra:runtime.cwd}'\n", None),
    "flat file, dotted key": ("trainer.experiment: 'x\\\\${oc.env:DSR_RES_SECRET}'\n", None),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_escape_form_on_the_composed_config(form, tmp_path, monkeypatch):
    monkeypatch.setenv("DSR_RES_SECRET", SECRET)
    text, allowed = FORMS[form]
    data, message = _resolved(_compose_file(tmp_path, text))
    if allowed is not None:
        assert data["trainer"]["experiment"] == allowed
        return
    assert data is None, f"resolved to {data['trainer']['experiment']!r}"
    assert message.startswith("trainer.experiment: ") and SECRET not in message, message
    assert "may read only DSRECIPES_SMOLLM2_DIR" in message or "may call only dsr.asset, now, oc.env" in message


def test_in_a_list_and_in_a_source_list(tmp_path, monkeypatch):
    monkeypatch.setenv("DSR_RES_SECRET", SECRET)
    text = ("dataset:\n  paths: ['ok.jsonl', '\\\\${oc.env:DSR_RES_SECRET}']\n"
            "  sources: [{name: s, paths: ['${oc.env:DSR_RES_SECRET}']}]\n")
    data, message = _resolved(_compose_file(tmp_path, text))
    assert data is None and SECRET not in message and "dataset." in message, message


def test_in_a_key_stays_text_and_the_schema_refuses_it(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("DSR_RES_SECRET", SECRET)
    recipe = tmp_path / "k.yaml"
    recipe.write_text("launcher:\n  env:\n    '${oc.env:DSR_RES_SECRET}': '1'\ndataset:\n  roles:\n"
                      "    '\\\\${oc.env:DSR_RES_SECRET}': user\n", encoding="utf-8")
    data, _ = _resolved(hydra_app.compose([f"recipe={recipe}"]))
    assert SECRET not in repr(data)  # OmegaConf never resolves a key
    assert cli_main(["validate", f"recipe={recipe}"]) == 2
    out, err = capfd.readouterr()
    assert SECRET not in out + err and "Traceback" not in err and "launcher.env" in err, err


@pytest.mark.parametrize("form", ["escaped backslash: live", "oc.create", "hydra resolver"])
def test_a_flat_file_run_by_path_is_refused_by_validate(form, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("DSR_RES_SECRET", SECRET)
    recipe = tmp_path / "flat.yaml"
    recipe.write_text(FORMS[form][0].replace("trainer:\n  experiment:", "trainer.experiment:"), encoding="utf-8")
    assert cli_main(["validate", f"recipe={recipe}"]) == 2
    out, err = capfd.readouterr()
    assert err.startswith("error: ") and "trainer.experiment: " in err and SECRET not in out + err, err
    assert "Traceback" not in err


def test_a_flat_file_given_as_a_word_to_train(tmp_path, monkeypatch, capfd):
    """`dsrecipes train FILE.yaml` (the flat form people pass like --config): refused where it resolves, no run."""
    monkeypatch.setenv("DSR_RES_SECRET", SECRET)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "flat.yaml").write_text("trainer.experiment: 'x\\\\${oc.env:DSR_RES_SECRET}'\ntrainer.max_steps: 1\n")
    assert cli_main(["train", "flat.yaml", f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    out, err = capfd.readouterr()
    assert "trainer.experiment: reads the environment variable 'DSR_RES_SECRET'" in err and SECRET not in out + err
    assert not (tmp_path / "run").exists()
