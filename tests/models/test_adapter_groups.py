"""The store's adapter groups: ``models.toml`` adapters with scales, and the models that share a
base file by identity (not name) resolved with their group, on real files."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from trioshed.core.adapters import runner_model
from trioshed.core.model import ModelSpec
from trioshed.models.catalogue import load_catalogue
from trioshed.models.groups import group_index
from trioshed.models.stores import Stores


def _store(tmp_path: Path, toml: str) -> Path:
    store = tmp_path / "models"
    store.mkdir()
    for name in ("alpha.gguf", "beta.gguf", "l1.gguf", "l2.gguf", "l3.gguf"):
        (store / name).write_bytes(b"GGUF" + name.encode())
    (store / "models.toml").write_text(toml)
    return store


def test_adapters_take_scales_and_a_comma_in_a_path_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path, """
[models.two]
path = "alpha.gguf"
adapters = ["l1.gguf", { path = "l2.gguf", scale = 0.5 }]

[models.comma]
path = "alpha.gguf"
adapters = ["a,b.gguf"]

[models.bad]
path = "alpha.gguf"
adapters = [{ file = "l1.gguf" }]
""")
    catalogue = load_catalogue(store / "models.toml", store)
    two = catalogue.lookup("two:latest")
    assert two is not None and [Path(a).name for a in two.adapters] == ["l1.gguf", "l2.gguf"] and two.adapter_scales == (1.0, 0.5)
    assert catalogue.lookup("comma:latest") is None and catalogue.lookup("bad:latest") is None
    problems = " ".join(str(p) for p in catalogue.problems)
    assert "holds a comma" in problems and "takes path and scale" in problems


def test_models_on_one_base_file_resolve_with_their_group_and_share_a_runner(tmp_path: Path) -> None:
    store = _store(tmp_path, """
[models.a1]
path = "alpha.gguf"
adapters = ["l1.gguf"]

[models.a2]
path = "linked.gguf"
adapters = ["l2.gguf"]

[models.b1]
path = "beta.gguf"
adapters = ["l3.gguf"]
""")
    os.link(store / "alpha.gguf", store / "linked.gguf")  # the same file by another name
    stores = Stores(store)
    a1, a2, alpha, b1, beta = (stores.resolve(n) for n in ("a1", "a2", "alpha", "b1", "beta"))
    assert [Path(a).name for a in a1.group] == ["l1.gguf", "l2.gguf"] == [Path(a).name for a in alpha.group]
    assert a1.path == a2.path == alpha.path and a1.base == a2.base == alpha.base  # one base, one spelling
    assert replace(runner_model(a1), name="") == replace(runner_model(a2), name="")  # one runner for both
    assert [Path(a).name for a in b1.group] == ["l3.gguf"] and b1.base != a1.base and beta.group == b1.group
    # a model added to models.toml joins at once
    with (store / "models.toml").open("a") as f:
        f.write('\n[models.a3]\npath = "alpha.gguf"\nadapters = ["l3.gguf"]\n')
    assert [Path(a).name for a in stores.resolve("a1").group] == ["l1.gguf", "l2.gguf", "l3.gguf"]


def _spec(name: str, *adapters: str) -> ModelSpec:
    return ModelSpec(f"{name}:latest", "/m/base.gguf", adapters=adapters)


def test_the_group_index_orders_adapters_by_model_name_and_keeps_each_once() -> None:
    key = ("base-identity",)
    other = ("other-base",)
    members = [(key, _spec("b", "/m/l2.gguf", "/m/l1.gguf")), (key, _spec("a", "/m/l1.gguf")), (key, _spec("plain")),
               (other, _spec("c", "/m/l3.gguf"))]  # fmt: skip
    index = group_index(members)
    assert index[key].adapters == ("/m/l1.gguf", "/m/l2.gguf") and index[other].adapters == ("/m/l3.gguf",)
    assert index[key].path == "/m/base.gguf"
