"""A LLaMA-Factory user's first day: an LF experiment file whose keys LLaMA-Factory reads together (DataArguments'
__post_init__, its loader) keeps their meaning in the translated file, or is left to a person with the reason."""

from __future__ import annotations

import json

import yaml

from dsrecipes.config.flat_check import flat_problems, in_our_keys

CHAT = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}


def _problems(text: str) -> str:
    return "\n".join(flat_problems(yaml.safe_load(text), "lf.yaml", lambda key: None))


def _ours(text: str) -> str:
    return in_our_keys(yaml.safe_load(text)) or ""


def _registry(tmp_path, **rows):
    """A dataset_info.json beside one ShareGPT file per entry, `rows[name]` rows each."""
    info = {}
    for name, n in rows.items():
        (tmp_path / f"{name}.json").write_text(json.dumps([CHAT] * n))
        info[name] = {"file_name": f"{name}.json", "formatting": "sharegpt"}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    return tmp_path / "dataset_info.json"


def _prepare(tmp_path, *overrides):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.prepare.build import prepare

    cfg = compose_and_load([*overrides, f"data.cache_dir={tmp_path / 'cache'}", "data.preprocess_workers=1"])
    return prepare(cfg, load_tokenizer(cfg), tmp_path / "run").stats


def test_neat_packing_packs_even_beside_packing_false():
    """LF: `if self.neat_packing: self.packing = True`. The translation took `packing: false` (the first key) and
    dropped neat_packing's data.packing: true, so the migrated run did not pack."""
    text = "stage: sft\npacking: false\nneat_packing: true\n"
    ours = _ours(text)
    assert "data.packing: true" in ours and "data.packing: false" not in ours, ours
    assert "neat_packing: true in this file turns packing on" in _problems(text)


def test_plain_packing_says_that_packed_samples_do_not_see_each_other_here():
    said = _problems("packing: true\n")
    assert "data.packing: true" in said and "attend to each other" in said, said


def test_train_on_prompt_with_mask_history_is_left_to_a_person_as_llamafactory_refuses_it():
    """LF raises '`mask_history` is incompatible with `train_on_prompt`'; the translation wrote data.train_on: all
    (the first key) and dropped mask_history without a word."""
    text = "stage: sft\ntrain_on_prompt: true\nmask_history: true\n"
    ours = _ours(text)
    assert "# train_on_prompt: true" in ours and "# mask_history: true" in ours, ours
    assert "data.train_on" not in ours, ours
    said = _problems(text)
    assert said.count("incompatible with `train_on_prompt`") == 2 and "choose one" in said, said


def test_max_samples_over_several_datasets_is_not_taken_for_a_total_cap():
    """LF's max_samples caps each dataset (loader._load_single_dataset); dataset.max_samples caps every source
    together, in order, so `max_samples: 100` over three entries read 100 rows of the first and none of the others."""
    text = "dataset: a,b,c\ndataset_dir: data\nmax_samples: 100\n"
    ours = _ours(text)
    assert "# max_samples: 100" in ours and "dataset.max_samples" not in ours, ours
    said = _problems(text)
    assert "caps each dataset" in said and "up to 300" in said and '"num_samples": 100' in said, said
    one = _ours("dataset: a\ndataset_dir: data\nmax_samples: 100\n")  # one dataset: the same cap
    assert "dataset.max_samples: 100" in one, one


def test_a_run_says_which_named_sources_dataset_max_samples_left_unread(tmp_path, capsys):
    """`dataset.max_samples=4` over entries a (4 rows), b and c read a alone; the per-source line named only a, so
    b and c vanished from the run without a word."""
    registry = _registry(tmp_path, a=4, b=3, c=3)
    stats = _prepare(
        tmp_path, f"dataset.registry={registry}", "dataset.use=[a,b,c]", "dataset.max_samples=4", "dataset.val_size=0"
    )
    assert stats["rows_read"] == 4 and stats["unread_sources"] == ["b", "c"], stats
    said = capsys.readouterr().err
    assert "note: b, c: no row read: dataset.max_samples=4 caps all sources together" in said, said
    assert "LLaMA-Factory's max_samples caps each dataset" in said, said
    _prepare(
        tmp_path / "all",
        f"dataset.registry={registry}",
        "dataset.use=[a,b,c]",
        "dataset.max_samples=8",
        "dataset.val_size=0",
    )
    assert "no row read" not in capsys.readouterr().err


def test_mask_history_says_that_a_long_conversation_loses_its_last_reply_here():
    said = _problems("mask_history: true\n")
    assert "data.train_on: last_assistant" in said and "keeps the last turn and cuts the history" in said, said


def test_a_run_says_why_last_assistant_dropped_rows_llamafactory_keeps(tmp_path, capsys):
    """Under data.train_on=last_assistant (the translation of mask_history: true) a conversation whose last reply
    starts past cutoff_len is dropped (the glaive demo at cutoff 512: 429 of 555 rows, against 39 under assistant),
    where LLaMA-Factory's mask_history keeps the last turn and cuts the history; the note blamed 'a long prompt,
    system prompt or tool schemas' and named neither the key nor the difference. Now (data/render/history_cut.py)
    such rows keep their last reply and lose earlier turns, and the summary counts them."""
    turns = [{"from": r, "value": f"{r} turn {i}: " + "words " * 20} for i in range(3) for r in ("human", "gpt")]
    (tmp_path / "long.json").write_text(json.dumps([{"conversations": turns}] * 3 + [CHAT]))
    (tmp_path / "dataset_info.json").write_text(
        json.dumps({"long": {"file_name": "long.json", "formatting": "sharegpt"}})
    )
    common = (f"dataset.registry={tmp_path / 'dataset_info.json'}", "dataset.use=[long]", "dataset.val_size=0")
    stats = _prepare(tmp_path, *common, "data.train_on=last_assistant", "data.cutoff_len=256")
    assert stats["dropped_all_trained_cut"] == 0 and stats["history_cut"] == 3, stats
    said = capsys.readouterr().err
    assert "3 kept their last reply by dropping earlier turns (data.train_on=last_assistant)" in said, said


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    return Phi3ForCausalLM(config)


def test_lora_names_a_model_does_not_have_are_refused_not_half_applied(make_cfg):
    """LLaMA-Factory's `lora_target: all` is every linear layer; the translation wrote the Llama names, and on Phi-3
    (qkv_proj, o_proj, gate_up_proj, down_proj) peft adapted o_proj and down_proj alone, without a word."""
    import pytest

    LLAMA_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    from dsrecipes.core.errors import UserError
    from dsrecipes.modeling.model import add_lora

    cfg = make_cfg("model.lora.enabled=true", f"model.lora.target_modules=[{','.join(LLAMA_NAMES)}]")
    with pytest.raises(UserError) as refused:
        add_lora(cfg, _phi3())
    said = str(refused.value)
    assert "model.lora.target_modules: q_proj, k_proj, v_proj, gate_proj, up_proj name no linear layer" in said, said
    assert "gate_up_proj" in said and "[all-linear]" in said, said


def test_all_linear_adapts_every_linear_layer_but_the_output_as_llamafactorys_all(make_cfg):
    from dsrecipes.modeling.model import add_lora

    cfg = make_cfg("model.lora.enabled=true", "model.lora.target_modules=[all-linear]")
    model = add_lora(cfg, _phi3())
    adapted = sorted({n.split(".lora_A")[0].rpartition(".")[2] for n, _ in model.named_parameters() if "lora_A" in n})
    assert adapted == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"], adapted


def test_a_dataset_entry_near_one_of_our_options_is_an_entry_in_a_file_with_dataset_dir():
    """`dataset: my_alpaca` beside LLaMA-Factory's `dataset_dir` said 'did you mean alpaca?' (our option for alpaca
    files of one's own, which reads no dataset_info.json), not dataset.use."""
    said = _problems("dataset: my_alpaca\ndataset_dir: data\n")
    assert "here: dataset.use: [my_alpaca] with dataset.registry" in said and "did you mean" not in said, said
    assert "did you mean alpaca?" in _problems("dataset: alpaca_e\n")  # no dataset_dir: a typo of ours


def test_a_dataset_info_entry_reads_system_tools_and_history_only_where_its_columns_name_them():
    """LLaMA-Factory (parser.DatasetAttr: system, tools, history default to None) reads a row's `system`, `tools`
    and alpaca `history` only when the entry's `columns` name them; an entry without them trained those fields here
    (a multi-turn alpaca row where LF trains one turn, a system prompt LF never shows)."""
    from dsrecipes.data.sources.registry import _llamafactory_entry as lf_entry
    from dsrecipes.data.sources.sharegpt import normalize_row

    bare = lf_entry("a", {"file_name": "a.json"}, "/data")
    named = lf_entry("b", {"file_name": "b.json", "columns": {"history": "history", "system": "system"}}, "/data")
    row = {"instruction": "q2", "input": "", "output": "a2", "history": [["q1", "a1"]], "system": "Be brief."}
    lf = normalize_row(row, "a.json:0", bare)
    assert [t.content for t in lf.turns] == ["q2", "a2"] and lf.system is None, lf
    ours = normalize_row(row, "b.json:0", named)
    assert [t.content for t in ours.turns] == ["q1", "a1", "q2", "a2"] and ours.system == "Be brief.", ours
    sharegpt = lf_entry("c", {"file_name": "c.json", "formatting": "sharegpt"}, "/data")
    chat = normalize_row({**CHAT, "system": "Be brief.", "tools": '[{"name": "f"}]'}, "c.json:0", sharegpt)
    assert chat.system is None and chat.tools is None, chat


def test_a_run_says_when_num_samples_asks_for_more_rows_than_the_file_has(tmp_path, capsys):
    """LLaMA-Factory's num_samples draws rows again up to the number (loader: permutation + np.random.choice);
    here it is a cap, so `num_samples: 6` over 3 rows trained 3 samples an epoch, without a word."""
    (tmp_path / "three.json").write_text(json.dumps([CHAT] * 3))
    (tmp_path / "dataset_info.json").write_text(
        json.dumps({"three": {"file_name": "three.json", "formatting": "sharegpt", "num_samples": 6}})
    )
    stats = _prepare(
        tmp_path, f"dataset.registry={tmp_path / 'dataset_info.json'}", "dataset.use=[three]", "dataset.val_size=0"
    )
    assert stats["samples"]["train"] == 3 and stats["short_sources"] == {"three": [6, 3]}, stats
    said = capsys.readouterr().err
    assert (
        "note: three: its max_samples (a dataset_info.json entry's num_samples) asks for 6 rows and its files gave 3"
        in said
        and "a source weight of 2 does here" in said
    ), said


def test_gradient_accumulation_says_the_steps_loss_is_normalised_as_in_llamafactory():
    """LF's Trainer (transformers >= 4.46, num_items_in_batch) divides a step's summed loss by all its trained
    tokens; so does objective.loss_average=tokens here (the default), and the line says so."""
    said = _problems("gradient_accumulation_steps: 4\n")
    assert "here: trainer.grad_accum: 4 (each trained token of the step weighs the same" in said, said
    assert "objective.loss_average: tokens, the default" in said, said
    assert "trainer.grad_accum: 4\n" in _ours("gradient_accumulation_steps: 4\n")
    assert "micro-batches" not in _problems("gradient_accumulation_steps: 1\n")
