"""A first day, third pass: what `dsrecipes show`, `validate` and `debug=fast` said to a new user, and what they
say now."""

from __future__ import annotations

from dsrecipes.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return code, captured.out + captured.err


def _optimizer_lr_line(said: str) -> str:
    lines = said.splitlines()
    start = lines.index("optimizer:")
    return next(line for line in lines[start:] if line.startswith("  lr:"))


def test_show_prints_the_learning_rate_the_run_uses(capsys):
    """`dsrecipes show` printed `optimizer: lr: null` for the default config, though the run trains at the tiny
    model's 0.003 (config/defaults.py; the DeepSpeed JSON further down said 0.003). Now the resolved config says
    what the run directory's config.yaml will say, and where the value came from; an explicit rate is printed as
    set, without a note."""
    code, said = _run(capsys, "show")
    assert code == 0, said
    assert _optimizer_lr_line(said) == "  lr: 0.003  # model.tiny.finetune_lr (optimizer.lr unset)", said
    code, said = _run(capsys, "show", "optimizer.lr=1e-4")
    assert code == 0 and _optimizer_lr_line(said) == "  lr: 0.0001", said
