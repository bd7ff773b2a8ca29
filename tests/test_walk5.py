"""Fifth user walkthrough: estimate's CPU figure under LoRA, re-running a finished sweep, qwen's tool turns."""

from __future__ import annotations

import json
import re

import pytest

from dsrecipes.commands.estimate import main as estimate_main

GIB = 1024**3


def _rows(capsys, *argv):
    assert estimate_main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    return data, {(r["stage"], r["offload"]): r for r in data["rows"]}


def test_estimate_lora_zero3_optimizer_offload_cpu_is_never_below_loading_the_model(capsys):
    """LoRA r=16 on Llama-3-8B, 8 GPUs, ZeRO-3 + optimizer=cpu. Was: 0.30 GiB CPU per node (16 bytes x 13.6M adapter
    parameters x 1.5), below the 23.48 GiB the same table gave ZeRO-3 without offload (zero.Init: the largest layer
    in fp32 on each of 8 ranks): offloading the optimizer seemed to need less CPU than not offloading it."""
    data, rows = _rows(capsys, "recipe=sharegpt_lora_llama3_8b_zero3", "offload=cpu_optimizer")
    s = data["shape"]
    T, L, P = s["trainable_params"], s["largest_layer_params"], s["total_params"]
    assert T == 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024))  # r=16 on q/k/v/o of 32 layers: 13,631,488
    assert L == 128256 * 4096 and P == 8_030_261_248 + T
    load, states = L * 4 * 8 * 1.5, 16 * T * 1.5  # DeepSpeed's zero.Init figure; fp32 master+grad+Adam of T
    opt = rows[(3, "optimizer=cpu")]
    assert (opt["cpu_load"], opt["cpu_offloaded"], opt["cpu_per_node"]) == (load, states, load)
    assert round(opt["cpu_per_node"] / GIB, 2) == 23.48 and round(states / GIB, 2) == 0.30
    both = rows[(3, "optimizer=cpu,param=cpu")]  # + the frozen base's 2-byte weights on the CPU
    assert both["cpu_offloaded"] == (2 * P + 16 * T) * 1.5 and both["cpu_per_node"] == max(load, both["cpu_offloaded"])
    for stage in (1, 2, 3):  # offloading never needs less CPU than the same stage without it
        none = rows[(stage, "none")]["cpu_per_node"]
        assert all(r["cpu_per_node"] >= none for (st, _), r in rows.items() if st == stage)


def test_estimate_table_says_what_the_cpu_figure_counts_under_lora(capsys):
    assert estimate_main(["recipe=sharegpt_lora_llama3_8b_zero3", "offload=cpu_optimizer"]) == 0
    out = capsys.readouterr().out
    assert "| stage3 * | optimizer=cpu | 3.83 | 56.62 | 16.96 | 23.48 (23.48 / 0.30) |" in out
    assert "CPU per node: the larger of loading the model" in out and "16 bytes per trainable parameter" in out
    assert "LoRA: the offloaded optimizer states are the 13.63M trainable adapter parameters' only" in out
    assert "8030.3M frozen base parameters" in out


# ---------------------------------------------------------------------------------------------------------------
# 2. A sweep run again into its own hydra.sweep.dir


def _earlier_sweep(root, jobs, age_s=3600.0):
    """A finished sweep of ours as an earlier invocation left it: marker, each job's .hydra record and result.json,
    written `age_s` seconds ago."""
    import os
    import time

    import yaml

    root.mkdir()
    (root / "dsrecipes_sweep.json").write_text(json.dumps({"dsrecipes_sweep": 1, "created": "2026-12-01 10:00:00"}))
    for n, overrides in enumerate(jobs):
        (root / str(n) / ".hydra").mkdir(parents=True)
        (root / str(n) / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
        result = root / str(n) / "result.json"
        result.write_text(json.dumps({"status": "ok", "error": None, "final_loss": 1.0 + n}))
        os.utime(result, (time.time() - age_s, time.time() - age_s))
    return root


def test_a_sweep_with_other_jobs_is_refused_before_hydra_rewrites_the_earlier_jobs_records(
    tmp_path, monkeypatch, capsys
):
    """Was: `-m zero=stage2,stage3` into a finished `zero=stage0,stage1` sweep's directory ran: Hydra rewrote job 0's
    .hydra/overrides.yaml to zero=stage2 before the job (then refused by the resume contract) started, so the table
    said 'job 0 | stage2 | ok' with stage0's numbers and the earlier record was gone."""
    from tests.test_run_ownership import snapshot
    from tests.test_sweep import dsrecipes_in_process

    monkeypatch.chdir(tmp_path)
    earlier = _earlier_sweep(tmp_path / "sw", [["launcher.dry_run=true", f"zero=stage{z}"] for z in (0, 1)])
    before = snapshot(earlier)
    code = dsrecipes_in_process("-m", "launcher.dry_run=true", "zero=stage2,stage3", f"hydra.sweep.dir={earlier}")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert (
        f"error: hydra.sweep.dir: {earlier} holds an earlier sweep whose job 0 ran zero=stage0, but job 0 of this "
        "one is zero=stage2 (2 of 2 jobs differ)"
    ) in err, err
    assert "or choose a new hydra.sweep.dir for this sweep; nothing was changed" in err
    assert snapshot(earlier) == before


def test_the_same_sweep_may_run_again_into_its_directory_with_settings_all_jobs_share_changed(tmp_path):
    from dsrecipes.core.errors import UserError
    from dsrecipes.observe.sweep import refuse_other_jobs

    earlier = _earlier_sweep(tmp_path / "sw", [["debug=fast", f"zero=stage{z}"] for z in (0, 1)])
    refuse_other_jobs(earlier, [["debug=fast", f"zero=stage{z}"] for z in (0, 1, 2)])  # a job added at the end
    refuse_other_jobs(earlier, [["debug=fast", f"zero=stage{z}", "trainer.max_steps=16"] for z in (0, 1)])  # further
    refuse_other_jobs(earlier, [["debug=fast", "zero=stage0"]])  # the first job alone
    swept_lr = [["debug=fast", f"zero=stage{z}", f"optimizer.lr={lr}"] for z in (0, 1) for lr in ("1e-3", "3e-3")]
    with pytest.raises(
        UserError, match=r"job 0 ran zero=stage0, but job 0 of this one is zero=stage0 optimizer.lr=1e-3"
    ):
        refuse_other_jobs(earlier, swept_lr)  # a key swept now that the earlier jobs did not sweep
    with pytest.raises(UserError, match=r"job 0 ran zero=stage0, but job 0 of this one is zero=stage1"):
        refuse_other_jobs(earlier, [["debug=fast", "zero=stage1"], ["debug=fast", "zero=stage0"]])


def test_the_sweep_table_tells_jobs_finished_earlier_from_jobs_run_now(tmp_path):
    """Was: every job with a result.json was listed 'ok', as if it had run now, though the rerun trained nothing."""
    from dsrecipes.observe import sweep

    sw = _earlier_sweep(tmp_path / "sw", [["zero=stage0"], ["zero=stage1"]])
    (sw / "1" / "result.json").write_text(json.dumps({"status": "ok", "error": None, "final_loss": 0.5}))  # ran now
    rows = sweep.write_summary(sw, {(sw / "0").resolve()})  # job 0 was skipped (commands/train.sweep_job)
    assert [(r["status"], r["earlier"]) for r in rows] == [("ok", True), ("ok", False)]
    md = (sw / "summary.md").read_text()
    assert "| 0 | stage0 | ok (earlier) |" in md and "| 1 (best) | stage1 | ok |" in md
    assert "(earlier) = finished before this run of the sweep and not run again, its numbers from then: job 0" in md
    assert json.loads((sw / "summary.json").read_text())["earlier"] == 1


@pytest.mark.slow
def test_a_finished_sweep_run_again_skips_its_jobs_and_says_so(tmp_path, monkeypatch, capsys):
    """Was: each finished job said 'error: nothing to train ...', the sweep exited 2, and the table listed every job
    'ok' as if it had run now. Now a finished job is skipped (said, not a failure), the table marks it `(earlier)`; a
    sweep where every job had finished exits 2 once, saying so; a job added to it runs (exit 0)."""
    from tests.test_sweep import dsrecipes_in_process

    monkeypatch.chdir(tmp_path)
    sw, cache = tmp_path / "sw", f"data.cache_dir={tmp_path / 'cache'}"
    common = ("-m", "debug=fast", "trainer.export=false", "trainer.max_steps=2", cache, f"hydra.sweep.dir={sw}")
    assert dsrecipes_in_process(*common, "zero=stage0") == 0, capsys.readouterr().err[-3000:]
    capsys.readouterr()
    code = dsrecipes_in_process(*common, "zero=stage0")
    out, err = capsys.readouterr()
    assert code == 2 and f"skipped (finished before this run of the sweep): nothing to train: {sw}/0/" in err, err
    assert err.rstrip().splitlines()[-1].startswith("error: nothing to train: every job of this sweep (1) had finished")
    assert "| ok (earlier) |" in out, out
    code = dsrecipes_in_process(*common, "zero=stage0,stage1")
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert re.search(r"\| 0( \(best\))? \| stage0 \| ok \(earlier\) \|", out), out
    assert re.search(r"\| 1( \(best\))? \| stage1 \| ok \|", out), out
    jobs = json.loads((sw / "summary.json").read_text())["jobs"]
    assert [(j["status"], j["earlier"]) for j in jobs] == [("ok", True), ("ok", False)]


# ---------------------------------------------------------------------------------------------------------------
# 3. Tool results under chatml vs LLaMA-Factory's qwen and Qwen2.5's own chat template

TOOLS = '[{"name": "weather", "description": "the weather", "parameters": {"type": "object", "properties": {}}}]'


def _tool_conversation():
    from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

    call = '{"name": "weather", "arguments": {"city": "Oslo"}}'
    turns = [Turn(Role.user, "Weather in Oslo?"), Turn(Role.tool_call, call), Turn(Role.observation, '{"temp": 3}'),
             Turn(Role.assistant, "3 degrees.")]  # fmt: skip
    return Conversation("t", turns, tools=TOOLS)


def test_chatml_renders_a_tool_result_as_llama_factorys_chatml_does(make_cfg):
    """Pinned: chatml (LLaMA-Factory's chatml, not its qwen) writes a ShareGPT observation as role `tool`; only the
    tool call and the answer are trained. The README and the template say so, with template=auto for Qwen's format."""
    from dsrecipes.core.schema import TrainOn
    from dsrecipes.data.render.template import render

    class Tok:
        bos_token, eos_token = None, "<|im_end|>"

    cfg = make_cfg("template=chatml", check_files=False)
    segments = render(_tool_conversation(), cfg.template, Tok(), TrainOn.assistant)
    text = "".join(s.text for s in segments)
    assert text == (
        f"<|im_start|>system\nTools: {TOOLS}<|im_end|>\n<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>tool\n{"temp": 3}<|im_end|>\n<|im_start|>assistant\n3 degrees.<|im_end|>\n'
    ), text
    trained = [s.text for s in segments if s.trained]
    assert trained == ['<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
                       "3 degrees.<|im_end|>"], trained  # fmt: skip


@pytest.mark.parametrize("name", ["qwen", "qwen3", "qwen3_nothink"])
def test_a_translated_qwen_recipe_says_its_tool_rows_differ_under_chatml(name):
    """Was: LLaMA-Factory's qwen templates became template: chatml without a word about tool rows, which LF (like
    Qwen2.5's own chat template) renders as a user turn around <tool_response> and chatml as role `tool`."""
    from dsrecipes.config.flat_check import flat_problems

    (problem,) = [
        p for p in flat_problems({"stage": "sft", "template": name}, "f.yaml", lambda _: None) if "templ" in p
    ]
    assert "\n" not in problem
    assert (
        f"tool-calling rows differ: LLaMA-Factory's {name} puts a tool result (role observation/tool) in a user turn "
        "'<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>'"
    ) in problem, problem
    assert (
        "template: chatml writes a tool result '<|im_start|>tool\\n...<|im_end|>' (as LLaMA-Factory's chatml)"
        in problem
    )
    assert "so for tool data take template: auto on a Qwen model" in problem
    (yi,) = [p for p in flat_problems({"stage": "sft", "template": "yi"}, "f.yaml", lambda _: None) if "templ" in p]
    assert "tool_response" not in yi


# A model's own template that puts tool results in a user turn the way Qwen2.5's does (written here, not copied):
QWEN_LIKE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif m['role'] == 'assistant' and m['tool_calls'] -%}{{- '<|im_start|>assistant' -}}"
    "{%- for tc in m['tool_calls'] -%}{{- '\\n<tool_call>\\n' + (tc['function'] | tojson) + '\\n</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_the_models_own_template_trains_a_tool_result_as_llama_factorys_qwen_renders_it(make_cfg):
    """template=tokenizer (what template=auto picks for a Qwen model) renders the observation as the model's template
    does: untrained, in a user turn; the prompt after the tool call is LF qwen's format_observation slot exactly."""
    from dsrecipes.core.schema import TrainOn
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.render.template import render

    cfg = make_cfg("template=tokenizer", check_files=False)
    tok = load_tokenizer(cfg)
    tok.chat_template = QWEN_LIKE
    segments = render(_tool_conversation(), cfg.template, tok, TrainOn.assistant)
    lf_observation = (
        '<|im_start|>user\n<tool_response>\n{"temp": 3}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    )
    assert [(s.text, s.trained) for s in segments[1:4]] == [
        ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>', True),
        ("\n" + lf_observation, False),
        ("3 degrees.<|im_end|>", True),
    ], segments
