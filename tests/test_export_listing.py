"""Loading an export (issue 50 items 3 and 5, fast): only the files its signed marker lists, and generation settings
of a model directory reduced to greedy decoding with checked token ids.

- an adapter_config.json + adapter_model.safetensors added to a signed export used to make chat load an adapter onto
  a base of the adder's choosing: now one message naming the added file (also through the run directory, whose
  export must keep its marker);
- `num_beams: 64` in generation_config.json ended chat in a traceback: generation is greedy whatever the file says;
  a token id that is not one is one message naming the file.
"""

from __future__ import annotations

import json
import shutil

import pytest

from dsrecipes.cli import main as cli


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.rank.export import export_initial

    cfg = compose_and_load(["debug=fast"])
    return export_initial(cfg, load_tokenizer(cfg), tmp_path_factory.mktemp("listing") / "export")


def chat(path, capsys):
    code = cli(["chat", str(path), "--message", "hi", "--max-new-tokens", "2"])
    captured = capsys.readouterr()
    return code, captured.err


def test_an_adapter_added_to_a_signed_export_is_refused(export, tmp_path, capsys):
    out = tmp_path / "export"
    shutil.copytree(export, out)
    (out / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(export),
                                                         "peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]}))
    (out / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    code, err = chat(out, capsys)
    assert code == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert "adapter_config.json: not part of the export as it was written (added later)" in err
    (out / "adapter_config.json").unlink()
    code, err = chat(out, capsys)
    assert code == 2 and "adapter_model.safetensors: not part of the export as it was written" in err


def test_a_runs_export_without_its_marker_is_refused(export, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("trainer: {}\n")
    shutil.copytree(export, run / "export")
    (run / "export" / "dsrecipes_export.json").unlink()
    code, err = chat(run, capsys)
    assert code == 2 and "the run's export has no dsrecipes_export.json" in err and "Traceback" not in err


def _with_generation(export, tmp_path, **settings):
    """A plain model directory (no marker: a base model) whose generation_config.json says `settings`."""
    out = tmp_path / "model"
    shutil.copytree(export, out)
    (out / "dsrecipes_export.json").unlink()
    path = out / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    return out


@pytest.mark.parametrize("settings", [{"num_beams": 64}, {"num_beams": -3, "num_beam_groups": 7},
                                      {"do_sample": True, "temperature": -1.0, "top_k": "x"},
                                      {"min_new_tokens": 10 ** 9, "max_length": -1}])
def test_out_of_range_generation_settings_do_not_reach_generation(export, tmp_path, capsys, settings):
    code, err = chat(_with_generation(export, tmp_path, **settings), capsys)
    assert code == 0 and "Traceback" not in err and "[2 tokens" in err, err


@pytest.mark.parametrize("eos", ["abc", 10 ** 9, [0, -1]])
def test_a_token_id_that_is_not_one_is_one_message(export, tmp_path, capsys, eos):
    code, err = chat(_with_generation(export, tmp_path, eos_token_id=eos), capsys)
    assert code == 2 and "generation_config.json: eos_token_id: expected a token id" in err, err
    assert "Traceback" not in err and err.count("error:") == 1
