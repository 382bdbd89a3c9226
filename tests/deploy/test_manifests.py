"""The Kubernetes deployment (deploy/, docs/kubernetes.md), validated offline.

- Every Kubernetes manifest under deploy/ validates against Kubernetes' own JSON schemas
  (``kubernetes-validate``, which bundles them: no cluster, no network), strict (no unknown
  field), for the oldest and newest Kubernetes versions it bundles: 1.32 and 1.37.
- The zero-to-jupyterhub-k8s values are not a Kubernetes object: their structure is checked
  against the parts of the chart's schema (4.4.0) they use, and the user pod they make
  (KubeSpawner's mapping of the fields we set) is validated as a Kubernetes Pod.
- Checks that matter to Infinijup and that the schemas cannot make: the helper's socket and
  work dir agree between the values, the image and the helper; the notebook container gets
  every capability the helper's CRIU runs need (infinijup_helper.creds) and not more; the seal
  key's Secret is mounted by the init container only; no secret value in any file; the Secrets
  the values name are the ones the docs create.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from infinijup import config as infinijup_config
from infinijup.serverext import remote_tier
from infinijup.serverext.manager import SnapshotManager
from infinijup_helper import config as helper_config
from infinijup_helper import creds

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCS = ROOT / "docs" / "kubernetes.md"
VALUES = DEPLOY / "jupyterhub" / "values.yaml"
DOCKERFILE = DEPLOY / "images" / "singleuser" / "Dockerfile"
START = DEPLOY / "images" / "singleuser" / "start.sh"
NODE_CHECK = DEPLOY / "kubernetes" / "node-check.yaml"
HELM_VALUES = {VALUES}  # YAML under deploy/ that is not a Kubernetes object
K8S_VERSIONS = ("1.32", "1.37")  # the oldest and newest kubernetes-validate 1.37 bundles

# Capabilities the helper needs beyond its CRIU runs: its own bookkeeping (docs/security.md)
# and signalling its users' kernel trees (CAP_KILL: without it, kill/signal answer EPERM).
HELPER_OWN_CAPS = {"SETUID", "CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL"}
SECRETS = {"infinijup-s3", "infinijup-remote-key", "infinijup-seal-key"}


def _yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def _load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in _yaml_files():
        if path in HELM_VALUES:
            continue
        for i, doc in enumerate(_load_all(path)):
            out.append((f"{path.relative_to(ROOT)}#{i}", doc))
    return out


def _values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text())


# -- Kubernetes' schemas -------------------------------------------------------------------

def test_every_yaml_file_under_deploy_is_a_manifest_or_known_helm_values() -> None:
    """A new file is validated, not skipped: it is a Kubernetes object or listed here."""
    files = _yaml_files()
    assert VALUES in files and NODE_CHECK in files
    for path in files:
        docs = _load_all(path)
        assert docs, f"{path} is empty"
        for doc in docs:
            assert isinstance(doc, dict), path
            if path not in HELM_VALUES:
                assert {"apiVersion", "kind"} <= doc.keys(), f"{path}: not a Kubernetes object"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name,doc", _manifests(), ids=lambda x: x if isinstance(x, str) else "")
def test_manifest_validates_against_kubernetes_schema(name: str, doc: dict, version: str) -> None:
    assert kubernetes_validate.validate(doc, version, strict=True) == version


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_user_pod_of_the_values_validates_as_a_pod(version: str) -> None:
    assert kubernetes_validate.validate(_user_pod(_values()), version, strict=True) == version


def test_a_broken_manifest_fails_validation() -> None:
    """The validator is live: a typo'd field and a wrong type are refused."""
    (name, daemonset), = [m for m in _manifests() if m[1]["kind"] == "DaemonSet"]
    typo = copy.deepcopy(daemonset)
    typo["spec"]["template"]["spec"]["nodeSelectr"] = typo["spec"]["template"]["spec"].pop(
        "nodeSelector")
    wrong = copy.deepcopy(daemonset)
    wrong["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsUser"] = "root"
    for bad in (typo, wrong):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


def _expand(obj: Any, username: str) -> Any:
    """KubeSpawner's ``{username}`` expansion in env, volumes and init containers."""
    if isinstance(obj, dict):
        return {k: _expand(v, username) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_expand(v, username) for v in obj]
    if isinstance(obj, str):
        return obj.replace("{username}", username)
    return obj


def _user_pod(values: dict[str, Any], username: str = "alice") -> dict[str, Any]:
    """The pod KubeSpawner 7 makes from these values (zero-to-jupyterhub-k8s 4.4.0's mapping
    of singleuser.* to KubeSpawner traits, then ``make_pod``), for the fields the values set."""
    su = values["singleuser"]
    spawner = values["hub"]["config"]["KubeSpawner"]
    security = {"runAsUser": su["uid"], "allowPrivilegeEscalation": su["allowPrivilegeEscalation"]}
    security.update(spawner["container_security_context"])  # highest priority in KubeSpawner
    env = [{"name": k, "value": v} if isinstance(v, str) else {"name": k, **v}
           for k, v in su["extraEnv"].items()]
    storage = su["storage"]
    volumes = [{"name": "volume-alice", "persistentVolumeClaim": {"claimName": "claim-alice"}},
               *storage["extraVolumes"]]
    mounts = [{"name": "volume-alice", "mountPath": storage["homeMountPath"]},
              *storage["extraVolumeMounts"]]
    for key, f in su.get("extraFiles", {}).items():  # z2jh: one Secret, a subPath per file
        mounts.append({"name": "files", "mountPath": f["mountPath"], "subPath": key})
    if su.get("extraFiles"):
        volumes.append({"name": "files", "secret": {"secretName": "singleuser"}})
    container = {
        "name": "notebook",
        "image": f"{su['image']['name']}:{su['image']['tag']}",
        "args": [su["cmd"]] if isinstance(su["cmd"], str) else su["cmd"],
        "env": env,
        "ports": [{"name": "notebook-port", "containerPort": 8888}],
        "resources": {"limits": su["extraResource"]["limits"]},
        "securityContext": security,
        "volumeMounts": mounts,
    }
    spec = {
        "securityContext": {"fsGroup": su["fsGid"]},
        "initContainers": su["initContainers"],
        "containers": [container],
        "volumes": volumes,
        "nodeSelector": su["nodeSelector"],
        "tolerations": su["extraTolerations"],
        "restartPolicy": "OnFailure",
        **su.get("extraPodConfig", {}),
    }
    return _expand({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": f"jupyter-{username}"}, "spec": spec}, username)


# -- the chart's values ----------------------------------------------------------------------

_STR, _INT, _BOOL, _OBJ, _ARR = ({"type": t} for t in ("string", "integer", "boolean",
                                                         "object", "array"))


def _nullable(t: str) -> dict[str, Any]:
    return {"type": [t, "null"]}


def _keys(names: str, used: dict[str, Any]) -> dict[str, Any]:
    """An object allowing exactly the chart's ``names``, typed where we use them."""
    props = {n: {} for n in names.split()}
    props.update(used)
    assert set(used) <= set(props)
    return {"type": "object", "additionalProperties": False, "properties": props}


_VOLUME = {"type": "object", "required": ["name"], "properties": {"name": _STR}}
_MOUNT = {"type": "object", "required": ["name", "mountPath"],
          "properties": {"name": _STR, "mountPath": _STR}}
_ENV_VALUE = {"anyOf": [_STR, {"type": "object", "minProperties": 1, "additionalProperties": False,
                               "properties": {"name": _STR, "value": _STR, "valueFrom": _OBJ}}]}

# The parts of zero-to-jupyterhub-k8s 4.4.0's values schema (jupyterhub/values.schema.yaml)
# these values use: the key names each level allows, and the types of those we set.
Z2JH_4_4_0_USED = _keys(
    "cull custom debug enabled fullnameOverride global httpRoute hub imagePullSecret "
    "imagePullSecrets ingress nameOverride prePuller proxy rbac scheduling singleuser",
    {
        "singleuser": _keys(
            "allowPrivilegeEscalation cloudMetadata cmd cpu defaultUrl events extraAnnotations "
            "extraContainers extraEnv extraFiles extraLabels extraNodeAffinity extraPodAffinity "
            "extraPodAntiAffinity extraPodConfig extraResource extraTolerations fsGid image "
            "initContainers lifecycleHooks memory networkPolicy networkTools nodeSelector "
            "profileList serviceAccountName startTimeout storage uid podNameTemplate",
            {
                "image": _keys("name tag pullPolicy pullSecrets", {"name": _STR, "tag": _STR}),
                "cmd": {"type": ["array", "string", "null"]},
                "uid": _nullable("integer"),
                "fsGid": _nullable("integer"),
                "allowPrivilegeEscalation": _nullable("boolean"),
                "startTimeout": _nullable("integer"),
                "extraPodConfig": _OBJ,
                "extraEnv": {"type": "object", "additionalProperties": _ENV_VALUE},
                "extraResource": _keys("limits guarantees", {"limits": _OBJ}),
                "nodeSelector": {"type": "object", "additionalProperties": _STR},
                "extraTolerations": {"type": "array", "items": _OBJ},
                "initContainers": {"type": "array", "items": {
                    "type": "object", "required": ["name", "image"]}},
                "extraFiles": {"type": "object", "additionalProperties": _keys(
                    "mountPath data stringData binaryData mode",
                    {"mountPath": _STR, "data": _OBJ})},
                "storage": _keys(
                    "capacity dynamic extraLabels extraVolumeMounts extraVolumes "
                    "homeMountPath static type",
                    {
                        "type": {"enum": ["dynamic", "static", "none"]},
                        "capacity": _nullable("string"),
                        "homeMountPath": _STR,
                        "extraVolumes": {"type": "array", "items": _VOLUME},
                        "extraVolumeMounts": {"type": "array", "items": _MOUNT},
                    }),
            }),
        "hub": {"type": "object", "properties": {"config": {
            "type": "object", "propertyNames": {"pattern": "^[A-Z]"}}}},
        "cull": _keys("adminUsers concurrency enabled every maxAge removeNamedServers timeout "
                      "users", {"enabled": _BOOL, "timeout": _nullable("integer"),
                                "every": _nullable("integer")}),
    })
Z2JH_4_4_0_USED["properties"]["cull"]["required"] = ["enabled"]


def test_values_follow_the_chart_schema_where_we_use_it() -> None:
    jsonschema.Draft7Validator(Z2JH_4_4_0_USED).validate(_values())


def test_the_chart_schema_check_is_live() -> None:
    for path, bad in ((("singleuser", "storage"), {"extraVolumez": []}),
                      (("singleuser",), {"extraEnv": {"A": 1}}),
                      (("cull",), {"enabled": "yes"}),
                      (("hub", "config"), {"kubeSpawner": {}})):
        values = _values()
        target = values
        for key in path:
            target = target[key]
        target.update(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft7Validator(Z2JH_4_4_0_USED).validate(values)


# -- what Infinijup needs of the deployment --------------------------------------------------

def _dockerfile_env(name: str) -> str:
    m = re.search(rf"\b{name}=(\S+)", DOCKERFILE.read_text())
    assert m, f"the Dockerfile sets no {name}"
    return m.group(1)


def test_the_helper_socket_agrees_everywhere() -> None:
    su = _values()["singleuser"]
    socket = su["extraEnv"]["INFINIJUP_HELPER_SOCKET"]
    assert socket == _dockerfile_env("INFINIJUP_HELPER_SOCKET")
    assert socket == infinijup_config.DEFAULT_HELPER_SOCKET == helper_config.DEFAULT_SOCKET
    assert f"socket=${{INFINIJUP_HELPER_SOCKET:-{socket}}}" in START.read_text()
    # its directory is the image's own, root's alone (the helper refuses anything else), not a
    # volume another container or user could write
    socket_dir = str(Path(socket).parent)
    assert re.search(rf"install -d -m 0755 -o root -g root [^\n]*{re.escape(socket_dir)}\b",
                     DOCKERFILE.read_text())
    mounted = [m["mountPath"] for m in _user_pod(_values())["spec"]["containers"][0]
               ["volumeMounts"]]
    assert not any(socket_dir == m or socket_dir.startswith(m + "/") for m in mounted)


def test_the_helper_work_dir_and_seal_key() -> None:
    pod = _user_pod(_values())["spec"]
    work = helper_config.DEFAULT_WORK
    assert f"work=${{INFINIJUP_HELPER_WORK:-{work}}}" in START.read_text()
    volumes = {v["name"]: v for v in pod["volumes"]}
    (notebook,) = pod["containers"]
    (init,) = pod["initContainers"]
    main_mounts = {m["mountPath"]: m["name"] for m in notebook["volumeMounts"]}
    init_mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    # one emptyDir, the helper's work dir in both containers
    assert main_mounts[work] == init_mounts[work] and "emptyDir" in volumes[main_mounts[work]]
    # the seal key's Secret: the init container only, copied root-only under the work dir
    seal = [n for n, v in volumes.items()
            if v.get("secret", {}).get("secretName") == "infinijup-seal-key"]
    assert len(seal) == 1 and seal[0] in init_mounts.values()
    assert seal[0] not in main_mounts.values()
    assert volumes[seal[0]]["secret"]["defaultMode"] == 0o400
    script = init["command"][-1]
    assert "install -m 0600 -o 0 -g 0 " in script and f"{work}/.seal-key" in script
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    # KubeSpawner expands {...} in init containers: a brace in the script would be eaten
    assert "{" not in script and "}" not in script
    # the notebook image
    assert init["image"] == notebook["image"]


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj["spec"]["template"]["spec"] if obj["kind"] != "Pod" else obj["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_the_notebook_container_has_what_the_helper_needs_and_no_more() -> None:
    needed = {creds.CAP_NAMES[c].upper() for c in
              (*creds.CRIU_DUMP_CAPS, *creds.CRIU_RESTORE_CAPS, *creds.NSINIT_CAPS_PIDNS)}
    needed |= HELPER_OWN_CAPS
    (notebook,) = _user_pod(_values())["spec"]["containers"]
    security = notebook["securityContext"]
    assert security["capabilities"]["drop"] == ["ALL"]
    assert set(security["capabilities"]["add"]) == needed
    assert "SYS_RESOURCE" not in security["capabilities"]["add"]
    assert security["runAsUser"] == 0 and security.get("privileged") is False
    # the node check runs with exactly the same privileges, on the same nodes
    (daemonset,) = [d for _, d in _manifests() if d["kind"] == "DaemonSet"]
    (check,) = _containers(daemonset)
    assert check["securityContext"] == security
    pod_spec = daemonset["spec"]["template"]["spec"]
    su = _values()["singleuser"]
    assert pod_spec["nodeSelector"] == su["nodeSelector"]
    assert pod_spec["tolerations"] == su["extraTolerations"]
    assert check["image"] == notebook["image"]


def test_sys_admin_comes_with_privilege_escalation_allowed() -> None:
    """The API server refuses CAP_SYS_ADMIN with allowPrivilegeEscalation: false, a rule the
    JSON schemas do not carry."""
    objects = [doc for _, doc in _manifests() if doc["kind"] in ("DaemonSet", "Pod")]
    for obj in [*objects, _user_pod(_values())]:
        for c in _containers(obj):
            ctx = c.get("securityContext", {})
            if "SYS_ADMIN" in ctx.get("capabilities", {}).get("add", []):
                assert ctx.get("allowPrivilegeEscalation") is not False, c["name"]


def test_culling_hibernates_and_leaves_time_for_it() -> None:
    values = _values()
    su = values["singleuser"]
    assert values["cull"]["enabled"] is True and values["cull"]["timeout"] > 0
    policy = su["extraFiles"]["infinijup-policy"]
    assert policy["mountPath"].startswith("/etc/jupyter/jupyter_server_config.d/")
    assert policy["mountPath"].endswith(".json")
    assert policy["data"]["SnapshotManager"]["hibernate_on_shutdown"] is True
    grace = values["hub"]["config"]["KubeSpawner"]["delete_grace_period"]
    assert grace >= 300 and su["extraPodConfig"]["terminationGracePeriodSeconds"] == grace
    assert su["storage"]["type"] in ("dynamic", "static")  # the store outlives the pod


def test_every_user_store_points_at_the_object_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each user's own prefix, in the variable the server's background push reads
    (SnapshotManager.remote's default) and restore_store.py reads."""
    env = _user_pod(_values(), "alice")["spec"]["containers"][0]["env"]
    remote = {e["name"]: e for e in env}["INFINIJUP_REMOTE"]["value"]
    assert re.fullmatch(r"s3://[a-z0-9][a-z0-9.-]+/\S*alice", remote), remote
    monkeypatch.setenv("INFINIJUP_REMOTE", remote)
    assert remote_tier.remote_from_env() == remote
    assert 'os.environ.get("INFINIJUP_REMOTE"' in (
        DEPLOY / "images" / "singleuser" / "restore_store.py").read_text()
    # a stopping server's wait for its pushes fits in the pod's grace period, with room to
    # hibernate first
    values = _values()
    policy = values["singleuser"]["extraFiles"]["infinijup-policy"]["data"]["SnapshotManager"]
    grace = values["hub"]["config"]["KubeSpawner"]["delete_grace_period"]
    assert 0 < policy["remote_shutdown_wait"] <= grace / 2
    for name in policy:  # every setting is a real one
        assert SnapshotManager.class_traits(config=True).get(name) is not None, name


def test_credentials_come_from_a_secret_file_not_the_environment() -> None:
    """Kernels inherit the server's environment, and a kernel's memory is in every snapshot:
    no credential (the object store's keys, the remote's encryption password) may be an
    environment variable's value; each is a file of a Secret, mounted read-only."""
    pod = _user_pod(_values())["spec"]
    (notebook,) = pod["containers"]
    env = {e["name"]: e for e in notebook["env"]}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        assert name not in env
    for e in env.values():
        assert "secretKeyRef" not in e.get("valueFrom", {}), e["name"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for var, secret in (("AWS_SHARED_CREDENTIALS_FILE", "infinijup-s3"),
                        ("INFINIJUP_STORE_PASSWORD_FILE", "infinijup-remote-key")):
        path = env[var]["value"]
        (mount,) = [m for m in notebook["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        assert mount.get("readOnly") is True
        assert volumes[mount["name"]]["secret"]["secretName"] == secret
        assert volumes[mount["name"]]["secret"]["defaultMode"] == 0o440  # root, the fsGid


def test_the_secrets_the_values_name_are_the_ones_the_docs_create() -> None:
    named = {v["secret"]["secretName"] for v in _values()["singleuser"]["storage"]["extraVolumes"]
             if "secret" in v}
    assert named == SECRETS
    docs = DOCS.read_text()
    created = set(re.findall(r"kubectl [^\n]*create secret generic (\S+)", docs))
    assert created == SECRETS


# Shapes of real credentials; placeholders (..., <...>, EXAMPLE) do not match.
SECRET_SHAPES = [
    re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"),
    re.compile(r"aws_secret_access_key\s*[=:]\s*[A-Za-z0-9/+]{30,}"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"(?<![A-Za-z0-9/+])(?=[A-Za-z0-9/+]*[a-z])(?=[A-Za-z0-9/+]*[A-Z])"
               r"(?=[A-Za-z0-9/+]*[0-9])[A-Za-z0-9/+]{32,}={0,2}"),
]


def _deploy_files() -> list[Path]:
    return [p for p in sorted(DEPLOY.rglob("*")) if p.is_file()] + [DOCS]


def test_no_secret_value_in_any_file() -> None:
    for path in _deploy_files():
        text = path.read_text()
        for shape in SECRET_SHAPES:
            found = shape.search(text)
            assert found is None, f"{path.relative_to(ROOT)}: {found.group(0)[:12]}..."


def test_the_secret_scan_is_live() -> None:
    samples = ["AKIAIOSFODNN7ABCDEFG", "aws_secret_access_key = wJalrXUtnFEMIK7MDENGbPxRfiCYzzzzzzzzzzzz",
               "-----BEGIN OPENSSH PRIVATE KEY-----", "key: q8Zk2mVx9LpR4tYw7NbC3sHd6FgJ1aQe"]
    for sample in samples:
        assert any(shape.search(sample) for shape in SECRET_SHAPES), sample


def test_the_image_builds_criu_from_debians_source_package() -> None:
    text = DOCKERFILE.read_text()
    assert "COPY scripts/setup-criu.sh" in text and re.search(r"RUN \S*setup-criu\.sh", text)
    copies = re.findall(r"^COPY (?!--from=)(.+)$", text, re.M)
    assert not any("criu" in c.lower() and "setup-criu.sh" not in c for c in copies), copies
    # what the image copies from deploy/ exists
    for src in re.findall(r"^COPY (deploy/\S+)", text, re.M):
        assert (ROOT / src).is_file(), src
