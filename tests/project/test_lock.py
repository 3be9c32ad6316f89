"""The lock: uv.lock pins every dependency and extra, requirements/*.txt (pip's copy) agree with it,
and the Makefile installs from them."""

from __future__ import annotations

import re
import tomllib

from tests.support.paths import REPO

ROOT = REPO


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for package in tomllib.loads((ROOT / "uv.lock").read_text())["package"]:
        out.setdefault(canonical(package["name"]), set()).add(package.get("version", ""))
    return out


def pins(name: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for line in (ROOT / "requirements" / f"{name}.txt").read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^ ;\\]+)", line):
            out.setdefault(canonical(m[1]), set()).add(m[2])
    return out


def requirement_names(requirements: list[str]) -> set[str]:
    return {canonical(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in requirements}


def test_every_dependency_and_extra_is_locked() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = locked()
    wanted = requirement_names(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted |= requirement_names(extra)
    assert wanted - set(lock) == set()
    root = tomllib.loads((ROOT / "uv.lock").read_text())
    assert root["requires-python"] == project["requires-python"]


def test_pips_copies_pin_what_the_lock_pins_with_hashes() -> None:
    lock = locked()
    serve, dev = pins("serve"), pins("dev")
    for name, versions in {**serve, **dev}.items():
        assert versions <= lock[name], name
    assert set(serve) < set(dev)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert requirement_names(project["dependencies"] + project["optional-dependencies"]["bundled"]) <= set(serve)
    assert requirement_names(project["optional-dependencies"]["test"]) <= set(dev)
    assert requirement_names(project["optional-dependencies"]["test"]).isdisjoint(serve)  # make serve stays small
    for name in ("serve", "dev"):
        text = (ROOT / "requirements" / f"{name}.txt").read_text()
        entries = re.findall(r"^[A-Za-z0-9].*?==", text, flags=re.M)
        assert text.count("--hash=sha256:") >= len(entries)  # pip runs with --require-hashes


def test_the_makefile_installs_from_the_lock() -> None:
    makefile = (ROOT / "Makefile").read_text()
    script = (ROOT / "packaging" / "install.sh").read_text()
    assert "uv.lock" in makefile and "packaging/install.sh" in makefile and "lock:" in makefile
    assert "sync --quiet --locked" in script and "--require-hashes -r" in script
    uv_pin = re.search(r"^UV_VERSION=(\S+)$", script, flags=re.M)
    assert uv_pin is not None and re.fullmatch(r"\d+\.\d+\.\d+", uv_pin[1])
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
