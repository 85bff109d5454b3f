"""deploy/: the Kubernetes manifests are valid against Kubernetes' own schemas, and agree with the
server they run (its flags parse, its probe routes exist, the names and labels line up)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

from radixlm import cli  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def resources() -> dict[str, dict]:
    out = {}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out[doc["kind"]] = doc
    return out


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_each_manifest_is_valid_against_the_kubernetes_schemas(path):
    version = kubernetes_validate.latest_version()
    for doc in yaml.safe_load_all(path.read_text()):
        # strict: a misspelled or misplaced field is an error, not silently dropped
        kubernetes_validate.validate(doc, version, strict=True)


def test_a_broken_manifest_is_refused():
    deployment = resources()["Deployment"]
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["startupProbes"] = []  # misspelled
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_the_manifests_agree_with_each_other_and_with_the_server():
    found = resources()
    assert set(found) == {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"}
    deployment, service = found["Deployment"], found["Service"]
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert found["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    target = found["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])

    (container,) = pod["spec"]["containers"]
    (port,) = container["ports"]
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]

    # the image's entrypoint (the Dockerfile) plus the manifest's args parse as `radixlm serve`
    entrypoint = _dockerfile_entrypoint()
    assert entrypoint[:2] == ["radixlm", "serve"]
    args = cli._build_parser().parse_args([*entrypoint[1:], *container["args"]])
    assert args.port == port["containerPort"] and args.host == "0.0.0.0"
    # SIGTERM lets in-flight requests finish before the pod is killed
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > args.graceful_timeout + pre_stop

    # the probes ask routes the server has, and the ones that need no API key
    from radixlm.server import guard, native

    routes = {route.path for route in native.router.routes}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        path = container[probe]["httpGet"]["path"]
        assert path in routes and path in guard._PUBLIC_PATHS, (probe, path)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health_generate"
    # a readiness probe waits for the longest /health_generate may take before it answers 503
    assert container["readinessProbe"]["timeoutSeconds"] > native.HEALTH_GENERATE_TIMEOUT_S


def _dockerfile_entrypoint() -> list[str]:
    import json

    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("ENTRYPOINT "):
            return json.loads(line.removeprefix("ENTRYPOINT "))
    raise AssertionError("deploy/Dockerfile has no ENTRYPOINT")
