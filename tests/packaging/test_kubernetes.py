"""The Kubernetes manifests (packaging/kubernetes/), rendered and validated without a cluster.

The kustomizations are rendered by a small pure-Python reading of the kustomize fields they use
(any other field fails the test, so the renderer never silently drops one), compared with
``kubectl kustomize`` where kubectl is installed, and every object is validated against the
Kubernetes API's JSON schemas from the ``kubernetes-validate`` package (strict: an unknown field
fails) for the oldest and the newest Kubernetes version the manifests are meant for. The
``InferencePool`` is validated against its CRD's schema, vendored in
``tests/packaging/data/inferencepool-v1.schema.json`` from kubernetes-sigs/gateway-api-inference-extension
v1.6.0 (the file names its commit), with its two CEL rules checked here by hand. Regenerate it
with::

    git show v1.6.0:config/crd/bases/inference.networking.k8s.io_inferencepools.yaml  # then keep
    # spec.versions[name=v1].schema.openAPIV3Schema under "schema"
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import trio
import yaml

from tests.support.paths import REPO
from trioshed.api.pipeline.drain import CUT_GRACE
from trioshed.config_values import parse_duration
from trioshed.testing.server import open_test_server

ROOT = REPO / "packaging" / "kubernetes"
KUSTOMIZATIONS = (ROOT, ROOT / "postgres")
CRD_SCHEMA = Path(__file__).resolve().parent / "data" / "inferencepool-v1.schema.json"
#: The oldest Kubernetes the manifests use fields of (preStop's sleep action is on by default from
#: 1.30) and the newest the schema package knows.
VERSIONS = ("1.30", kubernetes_validate.latest_version())

Obj = dict[str, Any]
_FIELDS = frozenset({"apiVersion", "kind", "labels", "resources", "configMapGenerator", "generatorOptions", "images"})


def render(folder: Path) -> list[Obj]:
    """What ``kustomize build folder`` gives, for the fields these kustomizations use."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(k) <= _FIELDS, f"the test's renderer does not know {set(k) - _FIELDS}"
    objects: list[Obj] = []
    for entry in k.get("resources", ()):
        path = folder / entry
        objects += render(path) if path.is_dir() else [o for o in yaml.safe_load_all(path.read_text()) if o]
    for gen in k.get("configMapGenerator", ()):
        assert k["generatorOptions"] == {"disableNameSuffixHash": True}, "the renderer writes no name hashes"
        data: dict[str, str] = {}
        for env in gen.get("envs", ()):
            for line in (folder / env).read_text().splitlines():
                if line.strip() and not line.startswith("#"):
                    name, _, value = line.partition("=")
                    data[name] = value
        for file in gen.get("files", ()):
            data[Path(file).name] = (folder / file).read_text()
        assert set(gen) <= {"name", "envs", "files"}
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    for pairs in k.get("labels", ()):
        assert set(pairs) == {"pairs"}, "labels on selectors and templates are not rendered here"
        for o in objects:
            o["metadata"].setdefault("labels", {}).update(pairs["pairs"])
    for image in k.get("images", ()):
        for o in objects:
            for c in _pod(o).get("containers", ()):
                if c["image"] == image["name"]:
                    c["image"] = f"{image['newName']}:{image['newTag']}"
    return objects


def _pod(o: Obj) -> Obj:
    return o.get("spec", {}).get("template", {}).get("spec", {})


def _key(o: Obj) -> tuple[str, str, str]:
    return (o["apiVersion"], o["kind"], o["metadata"]["name"])


def _by_key(objects: list[Obj]) -> dict[tuple[str, str, str], Obj]:
    found = {_key(o): o for o in objects}
    assert len(found) == len(objects), "two objects of one kind share a name"
    return found


def strict(schema: Any) -> Any:
    """A CRD's structural schema as kubectl's strict field validation reads it: an object's
    unknown field is an error (the API server would prune it, silently)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validate_inference_pool(pool: Obj) -> None:
    schema = strict(json.loads(CRD_SCHEMA.read_text())["schema"])
    jsonschema.Draft202012Validator(schema).validate(pool)
    ref = pool["spec"].get("endpointPickerRef")
    if ref is not None:
        assert ref.get("kind", "Service") != "Service" or "port" in ref, "port is required when kind is Service"
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers)), "port number must be unique"


def test_the_crd_schema_carries_only_the_rules_checked_by_hand() -> None:
    rules: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            rules.extend(r["rule"] for r in node.get("x-kubernetes-validations", ()))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    vendored = json.loads(CRD_SCHEMA.read_text())
    walk(vendored["schema"])
    assert vendored["bundle-version"] == "v1.6.0"
    assert sorted(rules) == [
        "self.all(p1, self.exists_one(p2, p1.number==p2.number))",
        "self.kind != 'Service' || has(self.port)",
    ]


@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: p.name)
@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_against_the_api_schemas(folder: Path, version: str) -> None:
    objects = render(folder)
    assert objects
    for o in objects:
        if o["kind"] == "InferencePool":
            assert o["apiVersion"] == "inference.networking.k8s.io/v1"
            validate_inference_pool(o)
        else:
            kubernetes_validate.validate(o, version, strict=True)


def test_the_validation_catches_mistakes() -> None:
    objects = _by_key(render(ROOT))
    deployment = copy.deepcopy(objects[("apps/v1", "Deployment", "trioshed")])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)
    pool = copy.deepcopy(objects[("inference.networking.k8s.io/v1", "InferencePool", "trioshed")])
    pool["spec"]["targetPort"] = pool["spec"].pop("targetPorts")
    with pytest.raises(jsonschema.ValidationError):
        validate_inference_pool(pool)
    pool = copy.deepcopy(objects[("inference.networking.k8s.io/v1", "InferencePool", "trioshed")])
    del pool["spec"]["endpointPickerRef"]["port"]
    with pytest.raises(AssertionError, match="port is required"):
        validate_inference_pool(pool)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_the_renderer_agrees_with_kustomize(folder: Path) -> None:
    kubectl = shutil.which("kubectl")
    assert kubectl is not None
    built = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120, check=True)
    assert _by_key([o for o in yaml.safe_load_all(built.stdout) if o]) == _by_key(render(folder))


def test_the_pool_is_wired_together() -> None:
    objects = _by_key(render(ROOT))
    deployment = objects[("apps/v1", "Deployment", "trioshed")]
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    container = pod["spec"]["containers"][0]
    port = next(p for p in container["ports"] if p["name"] == "http")
    settings = objects[("v1", "ConfigMap", "trioshed-settings")]["data"]
    # the pool, its Service, its disruption budget and the picker's pool select the same pods
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    assert objects[("v1", "Service", "trioshed")]["spec"]["selector"] == selector
    assert objects[("policy/v1", "PodDisruptionBudget", "trioshed")]["spec"]["selector"]["matchLabels"] == selector
    pool = objects[("inference.networking.k8s.io/v1", "InferencePool", "trioshed")]["spec"]
    assert pool["selector"]["matchLabels"] == selector
    assert pool["targetPorts"] == [{"number": port["containerPort"]}]
    assert settings["TRIOSHED_HOST"] == f"0.0.0.0:{port['containerPort']}"
    # the picker: its Service and port, its config, and the engine label on the pods
    epp = objects[("apps/v1", "Deployment", "trioshed-epp")]
    service = objects[("v1", "Service", pool["endpointPickerRef"]["name"])]
    assert pool["endpointPickerRef"]["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    assert service["spec"]["selector"] == epp["spec"]["selector"]["matchLabels"]
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == "trioshed"
    config = yaml.safe_load(objects[("v1", "ConfigMap", "trioshed-epp-config")]["data"]["epp-config.yaml"])
    assert args[args.index("--config-file") + 1] == "/config/epp-config.yaml"
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]
    assert labels["llm-d.ai/engine-type"] == extractor["defaultEngine"] == extractor["engineConfigs"][0]["name"]
    # readiness is the drain (GET / answers 503 once it begins), liveness the event loop
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/", "port": "http"}
    # the whole stop fits in the grace period: preStop, the drain, its cut, the slot saves
    stop = (
        container["lifecycle"]["preStop"]["sleep"]["seconds"] + parse_duration(settings["TRIOSHED_SHUTDOWN_TIMEOUT"])
        + CUT_GRACE + parse_duration(settings["TRIOSHED_KV_SAVE_TIMEOUT"])
    )  # fmt: skip
    assert stop < pod["spec"]["terminationGracePeriodSeconds"]
    # the keys and the shared database come from the Secret, never from the ConfigMap
    env = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert env == {"TRIOSHED_API_KEY": "trioshed", "TRIOSHED_DATABASE": "trioshed", "TRIOSHED_FLEET_SECRET": "trioshed"}
    assert not set(env) & set(settings)
    # a fleet of pods: each is reached at its own address, on the port it listens on
    values = {e["name"]: e for e in container["env"]}
    assert values["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert values["TRIOSHED_FLEET_URL"]["value"] == f"http://$(POD_IP):{port['containerPort']}"
    assert list(values).index("POD_IP") < list(values).index("TRIOSHED_FLEET_URL")  # $(...) sees only earlier variables
    assert settings["TRIOSHED_METRICS_PUBLIC"] == "true"  # the picker scrapes without a key


async def test_the_probe_path_turns_503_when_the_pod_drains(model_store: Path) -> None:
    """Readiness follows the drain; the path needs no key (the kubelet sends none)."""
    probe = _by_key(render(ROOT))[("apps/v1", "Deployment", "trioshed")]["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    path = probe["httpGet"]["path"]
    with trio.fail_after(30):
        async with open_test_server(model_store, api_key="probe-test-key") as server, httpx.AsyncClient(base_url=server.base_url) as http:
            assert (await http.get(path)).status_code == 200
            server.drain.begin()
            r = await http.get(path)
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
