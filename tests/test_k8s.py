"""Kubernetes manifests of a spec with pools: valid against the Kubernetes OpenAPI schemas, wired together
(Services, selectors, ConfigMap items, launch scripts, orchestrator URLs), the security basics linted, and
the spec combinations a pool layout cannot serve refused before anything is rendered."""
from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest
import yaml

from disagg.cli import main as build_engines
from disagg.k8s import manifests
from disagg.k8s.lint import lint
from disagg.placement.inventory import GpuInventory
from disagg.render import plan_models, repository_files
from disagg.repository import parse_config
from disagg.spec import SpecError
from disagg.trtllm import build
from disagg.trtllm.render import render_launch_script
from disagg.triton import replicas
from tests.trtllm_helpers import ROOT, TOPOLOGY, example_spec, model_dir

KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")  # the oldest and newest the validator's schemas cover that we test


def _spec(tmp_path, edit=None):
    return example_spec("k8s-pools", model_dir(tmp_path), edit)


def _documents(files: dict[str, str]) -> list[dict]:
    return [doc for name, text in files.items() if name.endswith(".yaml") for doc in yaml.safe_load_all(text)]


def _find(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


@pytest.fixture
def rendered(tmp_path):
    spec = _spec(tmp_path)
    files = manifests.render_manifests(spec)
    return spec, files, _documents(files)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_document_is_valid_against_the_kubernetes_openapi_schema(rendered, version):
    _, _, docs = rendered
    assert sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs) == sorted([
        "Namespace/llm-serving", "ConfigMap/repository", "ConfigMap/launch", "ConfigMap/prometheus-scrape",
        "Service/prefill-h200", "StatefulSet/prefill-h200", "PodDisruptionBudget/prefill-h200",
        "Service/decode-h100", "StatefulSet/decode-h100", "PodDisruptionBudget/decode-h100",
        "Service/front", "Deployment/front", "PodDisruptionBudget/front",
        "NetworkPolicy/deny-ingress", "NetworkPolicy/front-ingress", "NetworkPolicy/engines-ingress",
    ])
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes {version}: {exc.message}")


def test_the_validator_refuses_a_field_kubernetes_does_not_have(rendered):
    _, _, docs = rendered
    broken = copy.deepcopy(_find(docs, "StatefulSet", "decode-h100"))
    broken["spec"]["template"]["spec"]["containers"][0]["gpus"] = 4
    with pytest.raises(kubernetes_validate.ValidationError, match="'gpus' was unexpected"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_each_pool_is_a_statefulset_with_its_gpus_nodes_and_launch_script(rendered):
    spec, _, docs = rendered
    launch = _find(docs, "ConfigMap", "launch")["data"]
    for pool, gpus, count, product in (("prefill-h200", 8, 2, "NVIDIA-H200"), ("decode-h100", 4, 3, "NVIDIA-H100-80GB-HBM3")):
        sts = _find(docs, "StatefulSet", pool)
        pod = sts["spec"]["template"]["spec"]
        (triton,) = pod["containers"]
        assert sts["spec"]["replicas"] == count and sts["spec"]["serviceName"] == pool
        assert triton["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": product}
        assert sts["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
        assert triton["command"] == ["bash", f"/launch/launch-{pool}.sh"]
        assert triton["lifecycle"]["preStop"] == {"exec": {"command": [
            "python3", "-m", "disagg.k8s.prestop", "--metrics", "http://127.0.0.1:8002/metrics", "--after", "10", "--timeout", "40"]}}
        assert pod["terminationGracePeriodSeconds"] >= 10 + 40  # the hook's waits come out of the grace period
        script = launch[f"launch-{pool}.sh"]
        roles = spec.pools[pool].roles
        loaded = set(re.findall(r"--load-model=(\w+)", script))
        assert loaded == {m for r in roles for m in (["prefill", "prefill_1", "prefill_2", "prefill_3"] if r == "prefill" else ["decode"])}
        assert "mpirun" in script and "--http-port=8000 --grpc-port=8001 --metrics-port=8002" in script
        for role in roles:
            assert f"/engines/{role}/config.json" in script  # where engines_claim is mounted
        service = _find(docs, "Service", pool)
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"http": 8000, "grpc": 8001, "metrics": 8002}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["engines"]["persistentVolumeClaim"] == {"claimName": "llama-8b-engines", "readOnly": True}
        assert {m["name"] for m in triton["volumeMounts"]} <= set(volumes)


def test_the_front_reaches_every_engine_model_at_its_pools_service(rendered):
    spec, _, docs = rendered
    repository = _find(docs, "ConfigMap", "repository")["data"]
    config = parse_config("disagg_orchestrator", repository["disagg_orchestrator__config.pbtxt"])
    urls = dict(item.split("=") for item in config.parameters["engine_urls"].string_value.split(","))
    assert urls == {"prefill": "dns:prefill-h200:8000:8002", "prefill_1": "dns:prefill-h200:8000:8002",
                    "prefill_2": "dns:prefill-h200:8000:8002", "prefill_3": "dns:prefill-h200:8000:8002",
                    "decode": "dns:decode-h100:8000:8002"}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for url in urls.values():
        source = replicas.parse_source(url)  # the orchestrator resolves the headless Service's name
        ports = {p["name"]: p["port"] for p in services[source.host]["spec"]["ports"]}
        assert services[source.host]["spec"]["clusterIP"] == "None"
        assert (ports["http"], ports["metrics"]) == (source.http_port, source.metrics_port)
    front = _find(docs, "Deployment", "front")["spec"]["template"]["spec"]
    assert [c["name"] for c in front["containers"]] == ["triton", "openai"]
    assert front["containers"][0]["command"] == ["bash", "/launch/launch-front.sh"]
    assert front["containers"][1]["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 9000}
    assert {m["mountPath"] for m in front["containers"][0]["volumeMounts"]} >= {"/repository", str(spec.model.path)}
    front_script = _find(docs, "ConfigMap", "launch")["data"]["launch-front.sh"]
    assert set(re.findall(r"--load-model=(\w+)", front_script)) == {"preprocessing", "postprocessing", "disagg_orchestrator", "ensemble"}


def test_the_repository_configmap_is_the_rendered_repository_file_for_file(rendered):
    spec, _, docs = rendered
    pods = manifests.pod_spec(spec)
    files = {str(p.relative_to("repository")): t for p, t in repository_files(pods, manifests.Path("repository")).items()
             if p.parts[0] == "repository"}
    data = _find(docs, "ConfigMap", "repository")["data"]
    items = _find(docs, "StatefulSet", "decode-h100")["spec"]["template"]["spec"]["volumes"][0]["configMap"]["items"]
    assert {i["path"]: data[i["key"]] for i in items} == files
    for model in plan_models(pods):
        parse_config(model.name, files[f"{model.name}/config.pbtxt"])
    assert parse_config("decode", files["decode/config.pbtxt"]).parameters["gpt_model_path"].string_value == "/engines/decode"
    launch = _find(docs, "ConfigMap", "launch")["data"]
    assert launch == render_launch_script(pods, [m.name for m in plan_models(pods)])


def test_only_the_front_is_reachable_from_outside_and_engines_only_from_the_front(rendered):
    _, _, docs = rendered
    types = {d["metadata"]["name"]: d["spec"].get("type", "ClusterIP") for d in docs if d["kind"] == "Service"}
    assert types == {"prefill-h200": "ClusterIP", "decode-h100": "ClusterIP", "front": "LoadBalancer"}
    engines = _find(docs, "NetworkPolicy", "engines-ingress")["spec"]
    front_labels = _find(docs, "Deployment", "front")["spec"]["template"]["metadata"]["labels"]
    pool_labels = _find(docs, "StatefulSet", "prefill-h200")["spec"]["template"]["metadata"]["labels"]
    assert engines["podSelector"]["matchLabels"].items() <= pool_labels.items()
    assert not engines["podSelector"]["matchLabels"].items() <= front_labels.items()
    engine_rule = engines["ingress"][0]
    assert engine_rule["from"][0]["podSelector"]["matchLabels"].items() <= front_labels.items()
    assert engine_rule["ports"] == [{"port": 8000, "protocol": "TCP"}]
    deny = _find(docs, "NetworkPolicy", "deny-ingress")["spec"]
    assert deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Deployment"):
            assert not doc["spec"]["template"]["spec"].get("hostNetwork", False)


def test_metrics_are_scraped_from_every_pod_by_pool(rendered):
    _, _, docs = rendered
    scrape = yaml.safe_load(_find(docs, "ConfigMap", "prometheus-scrape")["data"]["scrape-config.yaml"])
    (job,) = scrape["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": ["llm-serving"]}}]
    keep = {r["source_labels"][0]: r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    assert keep == {"__meta_kubernetes_pod_label_app_kubernetes_io_instance": "k8s-pools",
                    "__meta_kubernetes_pod_container_port_name": "metrics"}
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Deployment"):
            template = doc["spec"]["template"]
            assert template["metadata"]["annotations"]["prometheus.io/port"] == "8002"
            assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == "k8s-pools"
            assert {"name": "metrics", "containerPort": 8002, "protocol": "TCP"} in template["spec"]["containers"][0]["ports"]


def test_the_rendered_manifests_pass_the_lint_and_each_mutation_is_caught(rendered):
    _, _, docs = rendered
    assert lint(docs, allow_host_network=False) == []
    sts = _find(docs, "StatefulSet", "decode-h100")
    cases = [
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(privileged=True), "container triton: privileged"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
         "container triton: allowPrivilegeEscalation is not false"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
         "container triton: adds capability SYS_ADMIN"),
        (lambda d: d["spec"]["template"]["spec"].update(hostNetwork=True), "hostNetwork without kubernetes.host_network"),
        (lambda d: d["spec"]["template"]["spec"].update(hostIPC=True), "hostIPC: true"),
        (lambda d: d["spec"]["template"]["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}}), "volume host: hostPath"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(hostPort=8000), "container triton: hostPort 8000"),
    ]
    for mutate, problem in cases:
        broken = copy.deepcopy(sts)
        mutate(broken)
        assert lint([broken], allow_host_network=False) == [f"StatefulSet llm-serving/decode-h100: {problem}"]
    service = copy.deepcopy(_find(docs, "Service", "decode-h100"))
    service["spec"]["type"] = "NodePort"
    service["spec"].pop("clusterIP")
    assert lint([service], allow_host_network=False) == [
        "Service llm-serving/decode-h100: type NodePort: only the front end's Service may be reached from outside"]


def test_host_network_only_where_the_spec_asks_and_the_transport_needs_it(tmp_path):
    spec = _spec(tmp_path, lambda raw: raw["kubernetes"].update(host_network=True))
    docs = _documents(manifests.render_manifests(spec))
    pool = _find(docs, "StatefulSet", "decode-h100")["spec"]["template"]["spec"]
    assert pool["hostNetwork"] is True and pool["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pool["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert not _find(docs, "Deployment", "front")["spec"]["template"]["spec"].get("hostNetwork", False)
    assert lint(docs, allow_host_network=True) == []
    one_pool = {"both": {"roles": ["prefill", "decode"], "hardware": "h200"}}

    def mpi(raw):
        raw.update(trtllm_release="1.0", pools=one_pool)
        raw["kv_transfer"]["backend"] = "mpi"
        raw["roles"]["decode"]["devices"] = [[4, 5, 6, 7]]
        raw["roles"]["prefill"].update(instances=2, devices=[[0, 1], [2, 3]])
        raw["kubernetes"]["host_network"] = True

    with pytest.raises(SpecError, match=r"^kubernetes.host_network: KV moves over 'mpi', which works on the pod network"):
        _spec(tmp_path, mpi)


def test_a_release_that_pins_mpi_is_refused_across_pools_and_served_in_one(tmp_path):
    with pytest.raises(SpecError, match=r"^kv_transfer.backend: 'mpi' needs prefill and decode in one MPI world, but roles run on "
                                        r"pools prefill-h200, decode-h100 .*set trtllm_release to 0.19 or 0.20 and use ucx "
                                        r"between the pools, or put both roles in one pool"):
        manifests.render_manifests(_spec(tmp_path, lambda raw: raw.update(trtllm_release="1.0") or raw["kv_transfer"].update(backend="mpi")))

    def one_pool(replicas):
        def edit(raw):
            raw.update(trtllm_release="1.0", pools={"h200": {"roles": ["prefill", "decode"], "hardware": "h200", "replicas": replicas}})
            raw["kv_transfer"]["backend"] = "mpi"
            raw["roles"]["prefill"].update(instances=2, devices=[[0, 1], [2, 3]])
            raw["roles"]["decode"]["devices"] = [[4, 5, 6, 7]]
        return edit

    # Replicas of it would not do: a request's decode may go to another pod than its prefill.
    with pytest.raises(SpecError, match=r"^pools.h200.replicas: 2: with 'mpi' KV stays inside one pod's MPI world, .*"
                                        r"use one pool with replicas: 1, or put prefill and decode in pools of their own with ucx"):
        manifests.render_manifests(_spec(tmp_path, one_pool(2)))
    with pytest.raises(SpecError, match=r"^pools.h100: a second pool of prefill and decode beside pools.h200: with 'mpi'"):
        manifests.render_manifests(_spec(tmp_path, lambda raw: one_pool(1)(raw) or raw["pools"].update(
            h100={"roles": ["prefill", "decode"], "hardware": "h100"})))
    docs = _documents(manifests.render_manifests(_spec(tmp_path, one_pool(1))))
    pod = _find(docs, "StatefulSet", "h200")["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    script = _find(docs, "ConfigMap", "launch")["data"]["launch-h200.sh"]
    assert "One MPI world of 9 ranks" in script and "--load-model=prefill --load-model=prefill_1 --load-model=decode" in script


def test_a_role_in_a_fast_and_a_cheap_pool_is_served_by_both_at_their_costs(tmp_path):
    """A second decode pool on H200s (same architecture as the H100 pool: one engine) at a higher cost."""
    def edit(raw):
        raw["pools"]["decode-h100"]["cost"] = 1
        raw["pools"]["decode-h200"] = {"roles": ["decode"], "hardware": "h200", "replicas": 2, "cost": 3,
                                       "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H200"}}
    spec = _spec(tmp_path, edit)
    assert spec.roles["decode"].node == "decode-h100" and [p.name for p in spec.pools_of("decode")] == ["decode-h100", "decode-h200"]
    files = manifests.render_manifests(spec)
    docs = _documents(files)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)
    assert lint(docs, allow_host_network=False) == []
    fast = _find(docs, "StatefulSet", "decode-h200")["spec"]
    assert fast["replicas"] == 2 and fast["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert fast["template"]["spec"]["containers"][0]["command"] == ["bash", "/launch/launch-decode-h100.sh"]  # the same MPI world
    assert set(_find(docs, "ConfigMap", "launch")["data"]) == {"launch-prefill-h200.sh", "launch-decode-h100.sh", "launch-front.sh"}
    repository = _find(docs, "ConfigMap", "repository")["data"]
    config = parse_config("disagg_orchestrator", repository["disagg_orchestrator__config.pbtxt"])
    urls = dict(item.split("=", 1) for item in config.parameters["engine_urls"].string_value.split(","))
    assert urls["decode"] == "dns:decode-h100:8000:8002;cost=1|dns:decode-h200:8000:8002;cost=3"
    assert urls["prefill"] == "dns:prefill-h200:8000:8002"  # one pool: no cost to weigh
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    for part in urls["decode"].split("|"):
        value, _, cost = part.partition(";")
        assert replicas.parse_source(value).host in services and cost.startswith("cost=")


@pytest.mark.parametrize("edit, error", [
    (lambda raw: raw["pools"]["decode-h100"]["roles"].append("prefill"),
     r"^pools.decode-h100.roles: 'prefill' is also served by pools.prefill-h200, whose roles are \['prefill'\]: pools that "
     r"share a role serve the same roles"),
    (lambda raw: raw["pools"].update({"decode-l40s": {"roles": ["decode"], "hardware": "l40s"}}),
     r"^pools.decode-l40s.hardware: l40s is sm89, but 'decode' is also served by pools.decode-h100 on h100 \(sm90\); a TensorRT "
     r"engine runs only on the architecture it was built on: give the pools of 'decode' one architecture \(h100, h200, h20, gh200\)"),
    (lambda raw: raw["pools"]["decode-h100"].update(cost=0), r"^pools.decode-h100.cost: 0 is less than or equal to the minimum of 0"),
    (lambda raw: raw["pools"].pop("decode-h100"), r"^roles.decode: in no pool: with pools, every role needs one \(prefill-h200\)"),
    (lambda raw: raw["pools"]["decode-h100"]["roles"].append("aggregated"),
     r"^pools.decode-h100.roles: 'aggregated' is not a role of this spec \(roles: prefill, decode\)"),
    (lambda raw: raw["roles"]["decode"].update(node="gpu-7"), r"^roles.decode.node: set by pools.decode-h100: with pools, a role's place is its pool"),
    (lambda raw: raw["roles"]["decode"].update(devices=[[4, 5, 6, 7]]),
     r"^pools.decode-h100: its roles use GPUs \[4, 5, 6, 7\]; a pod sees the GPUs it is given as 0..3"),
    (lambda raw: raw["pools"].update(front=raw["pools"].pop("decode-h100")), r"^pools.front: 'front' names the front end's Service"),
    (lambda raw: raw["pools"].update({"Decode": raw["pools"].pop("decode-h100")}), r"^pools: 'Decode' does not match"),
    (lambda raw: raw["pools"]["decode-h100"].update(hardware="mi300x"), r"^pools.decode-h100.hardware: 'mi300x' is not one of"),
    (lambda raw: raw["pools"]["decode-h100"].update(memory="lots"), r"^pools.decode-h100.memory: 'lots' does not match"),
    (lambda raw: raw.pop("pools"), r"^kubernetes: needs pools: the manifests run one StatefulSet per pool"),
    (lambda raw: raw["kubernetes"].pop("engines_claim"), r"^kubernetes.engines_claim: required key is missing"),
    (lambda raw: raw["kubernetes"]["front"].update(service_type="ExternalName"), r"^kubernetes.front.service_type: 'ExternalName' is not one of"),
])
def test_pool_layouts_that_cannot_be_served_are_refused_naming_the_field(tmp_path, edit, error):
    with pytest.raises(SpecError, match=error):
        _spec(tmp_path, edit)


def test_pools_are_refused_for_the_reference_backend():
    from disagg.spec import parse_spec

    raw = yaml.safe_load((ROOT / "configs" / "cpu-tiny.yaml").read_text())
    raw["pools"] = {"cpu": {"roles": list(raw["roles"]), "hardware": "h100"}}
    with pytest.raises(SpecError, match=r"^pools: for backend tensorrt_llm only \(this spec's is 'reference'\)"):
        parse_spec(raw)


def test_a_configmap_over_the_api_servers_limit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(manifests, "CONFIGMAP_LIMIT", 1000)
    with pytest.raises(ValueError, match=r"^ConfigMap repository: \d+ bytes, above the API server's limit of 1000"):
        manifests.render_manifests(_spec(tmp_path))


def test_each_role_is_built_on_its_pools_gpu_architecture(tmp_path):
    spec = _spec(tmp_path, lambda raw: raw["pools"]["decode-h100"].update(hardware="l40s"))
    l40s = GpuInventory.load(TOPOLOGY / "pcie4-l40s.json")
    h200 = GpuInventory.load(TOPOLOGY / "h200x8-nvswitch.json")
    build._check_architecture(spec, ["decode"], l40s)
    with pytest.raises(build.BuildError, match=r"^\[prefill\] pools.prefill-h200 runs on h200 \(sm90\), but this machine's GPUs "
                                               r"are sm89 \(NVIDIA L40S\): an engine built here would not run there"):
        build._check_architecture(spec, ["prefill", "decode"], l40s)
    with pytest.raises(build.BuildError, match=r"^\[decode\] pools.decode-h100 runs on l40s \(sm89\), but this machine's GPUs are sm90"):
        build._check_architecture(spec, ["prefill", "decode"], h200)


def test_build_engines_manifests_writes_the_files_once(tmp_path, capsys):
    model = model_dir(tmp_path)
    raw = yaml.safe_load((ROOT / "configs" / "k8s-pools.yaml").read_text())
    raw["model"]["path"] = str(model)
    raw["output"] = {"model_repository": str(tmp_path / "model_repository")}
    config = tmp_path / "spec.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert build_engines(["manifests", "--config", str(config)]) == 0
    out = tmp_path / "k8s"
    assert sorted(p.name for p in out.iterdir()) == [
        "00-namespace.yaml", "10-pool-decode-h100.yaml", "10-pool-prefill-h200.yaml", "20-front.yaml",
        "30-network.yaml", "40-prometheus.yaml", "Dockerfile", "Dockerfile.dockerignore"]
    assert "FROM nvcr.io/nvidia/tritonserver:25.07-trtllm-python-py3\n" in (out / "Dockerfile").read_text()
    assert build_engines(["manifests", "--config", str(config)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"kubernetes manifests {out}: 8 files written", f"kubernetes manifests {out}: up to date"]
    raw.pop("kubernetes")
    config.write_text(yaml.safe_dump(raw))
    assert build_engines(["manifests", "--config", str(config)]) == 2
    assert "error: kubernetes: required: the spec has no kubernetes section" in capsys.readouterr().err
