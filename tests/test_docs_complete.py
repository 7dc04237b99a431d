"""What the code defines, the docs name: every error code and every daemon setting (every metric:
tests/test_ops_deploy.py::test_every_exported_metric_is_documented).

An operator reads docs/metrics.md to understand a series and docs/protocol.md to understand an
error; a name missing there is a question the docs cannot answer. These tests fail when code adds
a name without documenting it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvoffd.config import SETTINGS, build_parser
from kvoffd_client.protocol import DropReason, ErrorCode, MissReason, NoticeCode, Op

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _doc(name: str) -> str:
    return (DOCS / name).read_text()


@pytest.mark.parametrize("code", [c.value for c in ErrorCode])
def test_every_error_code_is_documented(code):
    assert f"`{code}`" in _doc("protocol.md"), f"docs/protocol.md does not define error code {code}"
    errors_row = next(line for line in _doc("metrics.md").splitlines() if "`kvoffd_errors_total`" in line)
    assert f"`{code}`" in errors_row, f"docs/metrics.md's kvoffd_errors_total row does not list {code}"


@pytest.mark.parametrize("member", [*NoticeCode, *MissReason, *DropReason, *Op], ids=lambda m: f"{type(m).__name__}.{m.name}")
def test_every_code_reason_and_message_type_is_in_protocol_md(member):
    """The contract's string sets (notice codes, miss and drop reasons, message types) each named in
    docs/protocol.md's list for its enum: a member added in code and not documented fails here."""
    text = _doc("protocol.md")
    section = text[text.index("## Message types, codes and reasons"):text.index("## Errors")]
    if isinstance(member, Op):
        listed = section.split("\n\n")[1]  # the message types paragraph
    else:
        listed = next(item for item in section.split("\n- ") if item.startswith(f"`{type(member).__name__}`"))
    assert f"`{member.value}`" in listed, f"docs/protocol.md does not list {type(member).__name__} {member.value}"


def test_every_daemon_setting_is_in_the_settings_table():
    text = _doc("deployment.md")
    flags = [a.option_strings[0] for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= len(SETTINGS)
    for flag in flags:
        env = "KVOFFD_" + flag[2:].replace("-", "_").upper()
        row = re.search(rf"^\| `{re.escape(flag)}` \| `{env}` \|", text, re.M)
        assert row, f"docs/deployment.md's settings table has no row for {flag} / {env}"


def test_metrics_md_has_no_internal_remarks():
    text = _doc("metrics.md")
    for marker in ("TODO", "FIXME", "XXX", "The issue", "the issue asks", "note to self"):
        assert marker not in text, f"docs/metrics.md contains {marker!r}"
