"""docs/vllm.md's examples parse, and its settings table is the connector's (issue 19.5).

A user copies `--kv-transfer-config '...'` from the docs: it must be valid JSON that names only
settings vLLM and the connector accept (a misspelt `kvoffd_` key is only logged and ignored, so a
typo in the docs would silently do nothing). The table's defaults must be the code's (the job
timeout was documented as 30 s in one place and 10 s in another).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "docs" / "vllm.md", ROOT / "README.md"]


def _settings_fields() -> dict[str, Any]:
    from kvoffd_client.vllm.settings import Settings

    return {f"kvoffd_{f.name}": f.default for f in dataclasses.fields(Settings)}


def _ktc_fields() -> set[str]:
    from vllm.config import KVTransferConfig

    return {f.name for f in dataclasses.fields(KVTransferConfig)}


def _check_config(cfg: dict[str, Any], where: str) -> None:
    from kvoffd_client.vllm.settings import Settings

    assert set(cfg) <= _ktc_fields(), f"{where}: not KVTransferConfig fields: {set(cfg) - _ktc_fields()}"
    assert cfg["kv_connector"] == "KvoffdConnector" and cfg["kv_connector_module_path"] == "kvoffd_client.vllm"
    assert cfg["kv_role"] == "kv_both" and cfg.get("kv_load_failure_policy") == "recompute", where
    extra = cfg["kv_connector_extra_config"]
    unknown = set(extra) - set(_settings_fields())
    assert not unknown, f"{where}: the connector does not know {unknown}"
    Settings.from_extra(extra)  # types convert


def _cli_configs() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for m in re.finditer(r"--kv-transfer-config '([^']*)'", doc.read_text()):
            found.append((f"{doc.name}:{doc.read_text()[:m.start()].count(chr(10)) + 1}", m.group(1)))
    return found


def test_every_kv_transfer_config_example_is_valid_json_with_known_settings() -> None:
    examples = _cli_configs()
    assert len(examples) >= 3  # "Start it", the quick test, README
    for where, text in examples:
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            raise AssertionError(f"{where}: --kv-transfer-config is not JSON: {e}") from None
        _check_config(cfg, where)


def test_the_python_example_names_known_settings() -> None:
    text = DOCS[0].read_text()
    code = re.search(r"```python\n(from vllm import LLM.*?)```", text, re.S).group(1)
    calls = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call)
             and getattr(n.func, "id", "") == "KVTransferConfig"]
    assert len(calls) == 1
    cfg = {}
    for kw in calls[0].keywords:
        if kw.arg == "kv_connector_extra_config":
            cfg[kw.arg] = {ast.literal_eval(k): "x" for k in kw.value.keys}
        else:
            cfg[kw.arg] = ast.literal_eval(kw.value)
    cfg["kv_connector_extra_config"]["kvoffd_address"] = "ipc:///x"
    _check_config(cfg, "vllm.md python example")


def _doc_default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def test_the_settings_table_lists_every_setting_with_the_code_default() -> None:
    rows = dict(re.findall(r"^\| `(kvoffd_\w+)` \| ([^|]+?) \|", DOCS[0].read_text(), re.M))
    fields = _settings_fields()
    assert set(rows) == set(fields), f"table vs code: {set(rows) ^ set(fields)}"
    for key, default in fields.items():
        if key == "kvoffd_address":
            assert rows[key] == "(required)"
        else:
            assert rows[key] == _doc_default(default), f"{key}: docs say {rows[key]}, code {default!r}"


def test_no_doc_states_another_job_timeout() -> None:
    """The connector's job deadline is kvoffd_job_timeout_s; a doc that quotes a number must quote it."""
    default = _doc_default(_settings_fields()["kvoffd_job_timeout_s"]).strip("`")
    for doc in (ROOT / "docs").glob("*.md"):
        for m in re.finditer(r"kvoffd_job_timeout_s`?[^.\n]{0,40}?(\d+) s\b", doc.read_text()):
            assert m.group(1) == default, f"{doc.name}: {m.group(0)!r}, the code's default is {default} s"


def test_the_runbook_quotes_the_connectors_miss_log_line() -> None:
    """docs/operations.md tells operators to take keys from the connector's debug line: that line exists."""
    ops = (ROOT / "docs" / "operations.md").read_text()
    src = (ROOT / "client" / "kvoffd_client" / "vllm" / "sched_lookup.py").read_text()  # the lookup planner
    assert "first missed key" in ops and "first missed key" in src
    assert "kvoffctl explain --namespace" in src
