"""The documents stay true to the code: README.md is a short front door that links every page of
docs/, every link and anchor resolves, every setting the code reads is in docs/settings.md with
its default, every route of /openapi.json is on docs/api.md, and no document names a tracker
issue."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tests.support.paths import REPO
from trioshed.api.openapi.document import document
from trioshed.config import _PARSERS, SETTING_NAMES, Settings
from trioshed.config_values import parse_host

ROOT = REPO
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))

#: ``TRIOSHED_*`` words in the code that are not settings: keys of Quart's ``app.config``.
NOT_SETTINGS = {"TRIOSHED_FAST", "TRIOSHED_METRICS"}

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6}) (.+)$", re.M)
_CODE_BLOCK = re.compile(r"^```.*?^```", re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _CODE_BLOCK.sub("", path.read_text())
    return {_slug(m.group(2)) for m in _HEADING.finditer(text)}


def test_the_readme_is_a_front_door_of_at_most_250_lines() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "make serve" in text and "make test" in text


def test_the_readme_links_every_page_of_docs() -> None:
    linked = {m.group(1).partition("#")[0] for m in _LINK.finditer(README.read_text())}
    assert PAGES, "docs/ has no pages"
    missing = [p.name for p in PAGES if f"docs/{p.name}" not in linked]
    assert not missing, f"README.md does not link {missing}"


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    text = _CODE_BLOCK.sub("", path.read_text())
    broken = []
    for match in _LINK.finditer(text):
        target = match.group(1)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, f"{path.name}: links that lead nowhere: {broken}"


def _code_settings() -> set[str]:
    names = {f"TRIOSHED_{name.upper()}" for name in SETTING_NAMES}
    for source in (ROOT / "trioshed").rglob("*.py"):
        if "testing" in source.parts:
            continue
        names |= set(re.findall(r"\bTRIOSHED_[A-Z0-9_]*[A-Z0-9]\b", source.read_text()))
    return names - NOT_SETTINGS


def _settings_rows() -> dict[str, str]:
    """``TRIOSHED_X`` → the default cell of its row in docs/settings.md."""
    rows: dict[str, str] = {}
    for line in (DOCS / "settings.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3:
            continue
        for name in re.findall(r"`(TRIOSHED_[A-Z0-9_]+)`", cells[0]):
            rows[name] = cells[1]
    return rows


def test_every_setting_the_code_reads_is_in_the_settings_page_with_a_default() -> None:
    rows = _settings_rows()
    missing = sorted(_code_settings() - set(rows))
    assert not missing, f"docs/settings.md lacks {missing}"
    empty = sorted(name for name, default in rows.items() if not default)
    assert not empty, f"docs/settings.md gives no default for {empty}"


def test_the_defaults_on_the_settings_page_are_the_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    defaults = Settings()
    rows = _settings_rows()
    checked = 0
    for name in SETTING_NAMES:
        literal = re.match(r"`([^`]+)`", rows[f"TRIOSHED_{name.upper()}"])
        if literal is None:  # "none", "unset", "localhost origins": no value to parse
            assert dataclasses.asdict(defaults)[name] in (None, ()), name
            continue
        if name == "host":
            assert parse_host(literal.group(1)) == (defaults.host, defaults.port)
        else:
            assert _PARSERS[name](literal.group(1)) == getattr(defaults, name), name
        checked += 1
    assert checked >= 25


def test_every_route_of_the_openapi_document_is_on_the_api_page() -> None:
    page = (DOCS / "api.md").read_text()
    routes = [
        f"{method.upper()} {path}"
        for path, operations in document(ollama_names=True)["paths"].items()
        for method in operations
        if method in {"get", "head", "post", "put", "patch", "delete"}
    ]
    assert len(routes) > 20
    missing = [route for route in routes if f"`{route}`" not in page]
    assert not missing, f"docs/api.md lacks {missing}"


def _documents() -> list[Path]:
    return [README, *PAGES, ROOT / "bench" / "README.md", *sorted((ROOT / "bench" / "results").glob("*.md"))]


@pytest.mark.parametrize("path", _documents(), ids=lambda p: p.name)
def test_no_document_names_an_issue(path: Path) -> None:
    assert "issue" not in path.name.lower()
    found = [m.group(0) for m in re.finditer(r"\b[Ii]ssues? ?#?\d+", path.read_text())]
    assert not found, f"{path.name} names {found}"


def test_no_file_of_results_is_named_after_an_issue() -> None:
    named = [p.name for p in (ROOT / "bench" / "results").iterdir() if "issue" in p.name.lower()]
    assert not named


def test_no_code_comment_names_an_issue() -> None:
    found = []
    for folder in ("trioshed", "tests", "bench"):
        for source in (ROOT / folder).rglob("*.py"):
            for number, line in enumerate(source.read_text().splitlines(), 1):
                if re.search(r"\b[Ii]ssues? ?#?\d+", line):
                    found.append(f"{source.relative_to(ROOT)}:{number}")
    assert not found, f"issue numbers in code: {found}"
