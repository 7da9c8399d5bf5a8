"""The set-up scripts `make test` runs never delete a folder they did not make."""

from __future__ import annotations

import shutil
import subprocess

from tests.support.procs import REPO


def test_vllm_install_leaves_a_foreign_venv_alone(tmp_path) -> None:
    """A user's own `.venv-vllm` (no mark of this script) was deleted and rebuilt."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "install-vllm-cpu", tmp_path / "scripts")
    theirs = tmp_path / ".venv-vllm" / "their-file"
    theirs.parent.mkdir()
    theirs.write_text("keep me")
    proc = subprocess.run([str(tmp_path / "scripts" / "install-vllm-cpu")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert "was not made by this script" in proc.stderr and "move it away" in proc.stderr
    assert theirs.read_text() == "keep me"


def test_vllm_install_is_done_once_stamped(tmp_path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "install-vllm-cpu", tmp_path / "scripts")
    (tmp_path / ".venv-vllm").mkdir()
    (tmp_path / ".venv-vllm" / ".polar-installed-vllm-cpu-0.32.0").touch()
    proc = subprocess.run([str(tmp_path / "scripts" / "install-vllm-cpu")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout == proc.stderr == ""
