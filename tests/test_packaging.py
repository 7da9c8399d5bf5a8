"""The package as a user installs it from a wheel, away from any checkout: the addon script, the
demo and the messages must not lean on files beside the repository (a wheel once lacked the addon,
so ``polar-train demo`` failed after building a model, and ``mitmdump -s addons/...`` had no file)."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import setuptools

from polar_train.harnesses import base as harness_base
from polar_train.harnesses.base import HarnessError, find_binary
from tests.support.procs import REPO


def _listed_packages() -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg["options"]["packages"].split()


def test_setup_cfg_lists_every_package_folder_and_the_addons() -> None:
    # setup.cfg lists its packages (find: cannot map addons/ to polar_train.addons): a new
    # sub-package must be listed or a wheel silently lacks it
    found = setuptools.find_packages(str(REPO), include=["polar_train*"])
    assert sorted(_listed_packages()) == sorted([*found, "polar_train.addons"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # from a copy: a build in place writes build/ and *.egg-info into the checkout, and a stale
    # build/lib there could put files in the wheel that the sources no longer have
    source = tmp_path_factory.mktemp("source") / "polar-train"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".harnesses", ".whl", ".cache", "build", "*.egg-info", "__pycache__", ".hypothesis",
        ".pytest_cache", "runs", "node_modules"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (built,) = out.glob("polar_train-*.whl")
    return built


def test_the_wheel_holds_the_addon_the_template_and_the_license(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("polar_train/addons/polar_capture.py", "polar_train/templates/chatml_qwen3.jinja",
                 "polar_train/py.typed"):
        assert name in names
    assert any(".dist-info/" in n and n.endswith("LICENSE") for n in names)  # (licenses/ from setuptools 77)
    assert not any(n.startswith(("tests/", "addons/", "data/")) for n in names)  # nothing at the top level


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the wheel installed and this venv's dependencies visible (not its editable
    polar_train: a .pth names the folder, whose own .pth files Python does not read)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    deps = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir())
    (site / "dependencies.pth").write_text(deps + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                           "--no-deps", str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return venv


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_an_installed_wheel_prints_its_own_addon_script(installed: Path, tmp_path: Path) -> None:
    done = subprocess.run([str(installed / "bin" / "polar-train"), "addon"], capture_output=True, text=True,
                          cwd=tmp_path, env=_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    script = Path(done.stdout.strip())
    assert script.is_file() and script.name == "polar_capture.py"
    assert installed in script.parents  # the wheel's copy, not the checkout's
    imported = subprocess.run([str(installed / "bin" / "python"), "-c", "import polar_train; print(polar_train.__file__)"],
                              capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=60)
    assert installed in Path(imported.stdout.strip()).parents, imported


def test_the_checkout_prints_addons_polar_capture(tmp_path: Path) -> None:
    done = subprocess.run([str(Path(sys.executable).parent / "polar-train"), "addon"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 0 and Path(done.stdout.strip()) == REPO / "addons" / "polar_capture.py", done


@pytest.mark.slow
def test_the_demo_runs_from_an_installed_wheel_without_mitmdump_beside_it(installed: Path, tmp_path: Path) -> None:
    # the wheel's venv has no mitmdump console script (mitmproxy is this venv's): the demo runs
    # mitmproxy's entry point with its own interpreter, and polar-train as python -m polar_train.cli
    assert not (installed / "bin" / "mitmdump").exists()
    done = subprocess.run([str(installed / "bin" / "polar-train"), "demo", "--workdir", str(tmp_path / "demo"),
                           "--rounds", "0", "--group-size", "2", "--max-tokens", "2"],
                          capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[round 0] mean reward" in done.stdout
    assert list((tmp_path / "demo" / "round0" / "captures").rglob("*.parquet"))


def test_a_missing_harness_outside_a_checkout_names_no_checkout_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("POLAR_HARNESS_PREFIX", raising=False)
    monkeypatch.setattr(harness_base, "_IN_CHECKOUT", False)
    monkeypatch.setattr(harness_base, "DEFAULT_HARNESS_PREFIX", tmp_path / ".harnesses")  # as in site-packages
    with pytest.raises(HarnessError) as err:
        find_binary("codex")
    assert str(err.value).startswith("'codex' not found on PATH: run scripts/install-harnesses in a polar-train checkout")
    assert ".harnesses" not in str(err.value)


def test_python_dash_m_gives_one_line_errors(tmp_path: Path) -> None:
    """``python -m polar_train.cli`` (how the demo runs its steps) loaded cli.py as __main__: its
    UserError was another class than the commands raised, so a refusal was a traceback, exit 1."""
    for module in ("polar_train.cli", "polar_train"):
        done = subprocess.run([sys.executable, "-m", module, "inspect", str(tmp_path / "missing")],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr == f"polar-train inspect: error: {tmp_path / 'missing'} not found\n"
