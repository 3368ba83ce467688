"""The distribution installs exactly one import package, ``draftgraph``, and works installed.

Built and installed the way a user installs it (a wheel; ``pip install .`` into a fresh virtual
environment, not editable), so nothing here leans on the repository being on the path.
"""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_one_top_level_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("draftgraph-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"draftgraph", wheel.name.split("-py")[0] + ".dist-info"}
    top_level = next(n for n in names if n.endswith("top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["draftgraph"]
    for needed in ("draftgraph/__init__.py", "draftgraph/runtime/ir/graph.py", "draftgraph/ops/triton/gemv.py",
                   "draftgraph/tools/cli.py", "draftgraph/tools/data/tiny_v4/model.safetensors",
                   "draftgraph/runtime/native/batch_kernel.c"):
        assert needed in names, f"{needed}: expected in the wheel, got {len(names)} files without it"
    assert not [n for n in names if n.startswith(("draftgraph/tests", "draftgraph/benchmarks"))]


@pytest.mark.slow
def test_pip_install_into_a_fresh_venv_runs_the_demo(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # The same torch as this process (the CPU build on the CI machine, from its local file).
    torch_version = torch.__version__.split("+")[0]
    for args in (["torch==" + torch_version], [str(ROOT)]):
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", *args], capture_output=True, text=True,
                              cwd=tmp_path)
        assert done.returncode == 0, f"pip install {args}: {done.stderr[-2000:]}"
    site = subprocess.run([str(python), "-c", "import draftgraph, sys; print(draftgraph.__file__)"],
                          capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert str(env_dir) in site, f"draftgraph imported from {site!r}, not the venv"
    demo = subprocess.run([str(env_dir / "bin" / "draftgraph"), "demo"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=600, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "propose K=3" in demo.stdout and "free blocks 256/256" in demo.stdout
