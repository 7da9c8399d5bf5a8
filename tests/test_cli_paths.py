"""Every path a command takes expands ``~`` as the shell would have: a quoted ``'~/run'``, or
``--output=~/run`` (bash expands no ``~`` after ``=``), reached train as it was, and it wrote half a
run into a folder named ``~`` in the working folder while TRL wrote the other half into $HOME."""

from __future__ import annotations

import pytest

from polar_train.cli import build_parser, main

#: (sub-command line, the path options' destinations) for each command that takes paths
COMMANDS = [
    (["tiny-model", "~/m"], ["dir"]),
    (["serve", "--model", "~/m", "--ssl-certfile", "~/c", "--ssl-keyfile", "~/k", "--script", "~/s",
      "--adapter", "~/a"], ["model", "ssl_certfile", "ssl_keyfile", "script", "adapter"]),
    (["inspect", "~/caps"], ["dir"]),
    (["build", "~/caps", "--out=~/out", "--rewards", "~/r", "--tasks", "~/t", "--tokenizer", "~/m"],
     ["captures", "out", "rewards", "tasks", "tokenizer"]),
    (["train", "~/traj", "--model", "~/m", "--output=~/run", "--config", "~/c.yaml"],
     ["data", "model", "output", "config"]),
    (["harness", "codex", "p", "--server", "http://127.0.0.1:1", "--workdir", "~/w", "--home", "~/h",
      "--ca-cert", "~/ca"], ["workdir", "home", "ca_cert"]),
    (["demo", "--workdir=~/d"], ["workdir"]),
]


@pytest.mark.parametrize("argv, dests", COMMANDS, ids=[c[0][0] for c in COMMANDS])
def test_every_path_option_expands_the_home_folder(argv, dests, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    args = build_parser().parse_args(argv)
    for dest in dests:
        value = getattr(args, dest)
        assert value.startswith(str(tmp_path) + "/") and "~" not in value, (dest, value)


def test_an_unknown_users_home_is_one_line(capsys):
    """``~nouser/x`` was a RuntimeError traceback (pathlib's expanduser) in inspect, build, tiny-model."""
    for argv in (["inspect", "~no-such-user-here/x"], ["build", "c", "--out", "~no-such-user-here/o"],
                 ["tiny-model", "~no-such-user-here/t"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "cannot expand ~no-such-user-here (no home folder of user 'no-such-user-here')" in err
        assert "Traceback" not in err


def test_train_output_given_with_equals_is_the_home_folder_not_a_local_tilde(tmp_path, monkeypatch, capsys):
    """The command as a user typed it: data and model under ``~``, both found (they were "not
    found"), and no folder named ``~`` made in the working folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["train", "~/no-traj", "--model", "~/m", "--output=~/run"]) == 2
    assert f"trajectory data not found: {tmp_path / 'home' / 'no-traj'}" in capsys.readouterr().err
    assert list(work.iterdir()) == []


def test_init_adapter_in_set_or_yaml_expands_the_home_folder(tmp_path, monkeypatch):
    """``--set init_adapter=~/runs/r1/adapter`` passes no shell that expands it."""
    from polar_train.cli import UserError
    from polar_train.train.config import load_config

    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(None, ["init_adapter=~/runs/r1/adapter"], str(tmp_path / "r"))
    assert config.init_adapter == str(tmp_path / "runs" / "r1" / "adapter")
    yaml_file = tmp_path / "t.yaml"
    yaml_file.write_text("init_adapter: ~/runs/r2/adapter\n")
    assert load_config(str(yaml_file), [], str(tmp_path / "r")).init_adapter == str(tmp_path / "runs/r2/adapter")
    with pytest.raises(UserError, match="init_adapter ~no-such-user-here/a: cannot expand ~no-such-user-here"):
        load_config(None, ["init_adapter=~no-such-user-here/a"], str(tmp_path / "r"))


def test_main_from_python_returns_a_usage_errors_status_and_takes_paths(tmp_path, capsys):
    """README: `main([...])` returns the exit status - but argparse's usage errors escaped as
    SystemExit, a Path in the list failed inside argparse (not subscriptable), and one string was
    taken letter by letter (`invalid choice: 'b'`)."""
    assert main(["build", str(tmp_path)]) == 2  # no --out
    assert "the following arguments are required: --out" in capsys.readouterr().err
    assert main(["inspect", "--help"]) == 0
    assert main(["inspect", tmp_path / "nope"]) == 2
    assert "nope not found" in capsys.readouterr().err
    with pytest.raises(TypeError, match="argv: a list of arguments, e.g. \\['inspect', 'captures'\\], not one string"):
        main("inspect captures")


def test_serve_takes_vllms_forms_of_the_context_length(capsys):
    """A vLLM command line copied to serve was refused at `--max-model-len 32k` (vLLM's
    human-readable integers: k = 1,000, K = 1,024; a probe)."""
    for given, length in (("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("4096", 4096), ("1M", 1 << 20)):
        assert build_parser().parse_args(["serve", "--model", "m", "--max-model-len", given]).max_model_len == length
    for auto in ("auto", "AUTO", "-1"):  # vLLM's: the model's max_position_embeddings
        assert build_parser().parse_args(["serve", "--model", "m", "--max-model-len", auto]).max_model_len == -1
    for bad, said in (("3x", "invalid int value: '3x' (an integer, 32k / 32K, or auto)"),
                      ("1.5K", "Decimals are not allowed with binary suffixes like K. Did you mean to use 1.5k")):
        assert main(["serve", "--model", "m", "--max-model-len", bad]) == 2
        assert said in capsys.readouterr().err


def test_a_training_runs_folder_given_as_the_model_names_its_adapter(tmp_path, monkeypatch, capsys):
    """`--model runs/r1` said "no tokenizer" / "no config.json" and not a word of the adapter inside,
    where init_adapter and serve --adapter given the same folder already said where it is (a probe)."""
    run = tmp_path / "runs" / "r1"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    traj = tmp_path / "traj"
    traj.mkdir()
    (traj / "part-0.parquet").write_bytes(b"x")
    assert main(["serve", "--model", str(run)]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"(no config.json); a training run's folder? give its base model as --model, with --adapter {run / 'adapter'}")
    assert main(["train", str(traj), "--model", str(run), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "the model folder supplies the tokenizer too; a training run's folder? give its base model as --model, with "
        f"--set init_adapter={run / 'adapter'}")
    (run / "checkpoint-4").mkdir()  # a checkpoint: an adapter without a tokenizer
    (run / "checkpoint-4" / "adapter_config.json").write_text("{}")
    assert main(["train", str(traj), "--model", str(run / "checkpoint-4"), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "; it holds a peft adapter (a checkpoint?): give its base model as --model, with --set "
        f"init_adapter={run / 'checkpoint-4'}")
