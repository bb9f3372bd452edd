"""deploy/ checked against the real CLI: every command, flag, port, env var and mount in the manifests."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from gossamer.tools.cli_parser import build_parser, env_names

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILES = [DEPLOY / "docker" / "Dockerfile", DEPLOY / "docker" / "Dockerfile.cuda"]
SBATCH = sorted((DEPLOY / "slurm").glob("*.sbatch"))
SPOT_LABELS = {
    "cloud.google.com/gke-spot": "true",
    "eks.amazonaws.com/capacityType": "SPOT",
    "kubernetes.azure.com/scalesetpriority": "spot",
}
SPOT_KEYS = {*SPOT_LABELS, "cloud.google.com/gke-preemptible", "karpenter.sh/capacity-type"}
SPOT_TAINTS = {"cloud.google.com/gke-spot", "kubernetes.azure.com/scalesetpriority"}
# What the kubelet's downward API would put in $(VAR), for expanding args.
FIELD_SAMPLES = {"status.podIP": "10.8.0.7", "metadata.name": "gossamer-worker-7d9c", "spec.nodeName": "gke-node-1",
                 "metadata.namespace": "training", "status.hostIP": "10.0.0.3"}


# --- the CLI as the manifests must match it ----------------------------------------------------
def parse_cli(argv: list[str], where: str) -> argparse.Namespace:
    """Parse `gossamer ARGV` with the real parser; an unknown flag or bad value fails the test."""
    # Defaults as in a clean container: GOSSAMER_* in the test's own environment would change them.
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("GOSSAMER_")}
    try:
        parser = build_parser()
    finally:
        os.environ.update(saved)

    def fail(message: str) -> None:  # argparse would print and exit
        raise AssertionError(f"{where}: `gossamer {shlex.join(argv)}` is not accepted by the CLI: {message}")

    def patch(p: argparse.ArgumentParser) -> None:
        p.error = fail  # type: ignore[method-assign,assignment]
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    patch(sub)

    patch(parser)
    return parser.parse_args(argv)


def cli_env_names() -> set[str]:
    """GOSSAMER_<NAME> variables the CLI reads: every option's (each has one; tests/unit/test_cli_env.py)."""
    return env_names(build_parser())


def bound_ports(ns: argparse.Namespace) -> dict[str, int]:
    """The fixed ports a parsed command listens on: every `*port` option with a value > 0."""
    return {k: v for k, v in vars(ns).items() if k.endswith("port") and isinstance(v, int) and v > 0}


def command_key(ns: argparse.Namespace) -> str:
    return f"{ns.command} {getattr(ns, 'action', '')}".strip()


# --- Dockerfiles ---------------------------------------------------------------------------------
@dataclass
class Dockerfile:
    path: Path
    instructions: list[tuple[str, str]]

    @classmethod
    def load(cls, path: Path) -> Dockerfile:
        logical, buf = [], ""
        for line in path.read_text().splitlines():
            if not buf and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.lstrip().startswith("#"):  # a comment inside a continued instruction
                continue
            if line.endswith("\\"):
                buf += line[:-1] + " "
                continue
            logical.append(buf + line)
            buf = ""
        assert not buf, f"{path}: the last instruction ends with a line continuation"
        out = []
        for line in logical:
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        return cls(path, out)

    def all(self, word: str) -> list[str]:
        return [rest for w, rest in self.instructions if w == word]

    def exec_form(self, word: str) -> list[str]:
        (raw,) = self.all(word)[-1:]
        value = json.loads(raw)  # the exec (JSON) form: signals reach the process, no shell in between
        assert isinstance(value, list) and all(isinstance(x, str) for x in value), f"{self.path}: {word} {raw}"
        return value

    def final_stage(self) -> list[tuple[str, str]]:
        starts = [i for i, (w, _) in enumerate(self.instructions) if w == "FROM"]
        return self.instructions[starts[-1]:]

    def expand(self, text: str) -> str:
        """`text` with ${NAME} and $NAME of the file's ARGs replaced by their defaults: what a plain build uses."""
        defaults = dict(rest.partition("=")[::2] for rest in self.all("ARG"))
        return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: defaults.get(m.group(1)) or m.group(0), text)


def strip_init(argv: list[str]) -> list[str]:
    """`tini -- gossamer ...` -> `gossamer ...`."""
    if argv and Path(argv[0]).name in ("tini", "tini-static", "dumb-init"):
        argv = argv[1:]
        if argv and argv[0] == "--":
            argv = argv[1:]
    return argv


@cache
def entrypoint() -> tuple[str, ...]:
    """The image's ENTRYPOINT, the same in every Dockerfile (k8s containers set only args)."""
    eps = {tuple(Dockerfile.load(p).exec_form("ENTRYPOINT")) for p in DOCKERFILES}
    assert len(eps) == 1, f"the Dockerfiles disagree on ENTRYPOINT: {eps}"
    return eps.pop()


# --- Kubernetes ------------------------------------------------------------------------------------
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@cache
def k8s_docs(pattern: str = "*.yaml") -> list[tuple[Path, dict[str, Any]]]:
    """Every YAML document under deploy/k8s (parsed once; callers must not mutate them)."""
    out = []
    for path in sorted(K8S.glob(pattern)):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.load_all(path.read_text(), Loader=_LOADER):
            if doc is not None:
                out.append((path, doc))
    return out


def workloads() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p, d in k8s_docs() if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job")]


def expand_k8s(value: str, env: dict[str, str], where: str) -> str:
    """The kubelet's $(VAR) expansion of command/args from the container's env."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        name = m.group(1)
        assert name in env, f"{where}: $({name}) is not in the container's env, the kubelet would pass it literally"
        return env[name]

    return re.sub(r"\$\$?\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


def container_env(c: dict[str, Any]) -> dict[str, str]:
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        else:
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = FIELD_SAMPLES[field]
    return env


@dataclass
class Container:
    path: Path
    workload: dict[str, Any]
    spec: dict[str, Any]  # the container
    argv: list[str]  # after `gossamer`
    args: argparse.Namespace

    @property
    def pod(self) -> dict[str, Any]:
        return self.workload["spec"]["template"]["spec"]

    @property
    def where(self) -> str:
        return f"{self.path.name}: {self.workload['kind']}/{self.workload['metadata']['name']}/{self.spec['name']}"

    def port(self, name: str) -> int:
        ports = {p["name"]: p["containerPort"] for p in self.spec.get("ports", [])}
        assert name in ports, f"{self.where}: no containerPort named {name!r} ({ports})"
        return int(ports[name])

    def mounts(self) -> dict[str, dict[str, Any]]:
        """mountPath -> the pod volume mounted there."""
        vols = {v["name"]: v for v in self.pod.get("volumes", [])}
        out = {}
        for m in self.spec.get("volumeMounts", []):
            assert m["name"] in vols, f"{self.where}: volumeMount {m['name']!r} has no volume"
            out[m["mountPath"]] = vols[m["name"]]
        return out


def gossamer_argv(argv: list[str], where: str) -> list[str]:
    argv = strip_init(argv)
    assert argv and Path(argv[0]).name == "gossamer", f"{where}: runs {argv[:1]}, not gossamer"
    return argv[1:]


@cache
def containers() -> list[Container]:
    out = []
    for path, w in workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            where = f"{path.name}: {w['kind']}/{w['metadata']['name']}/{c['name']}"
            env = container_env(c)
            # No `command`: the image's ENTRYPOINT runs with `args` appended.
            argv = [expand_k8s(str(a), env, where) for a in [*(c.get("command") or entrypoint()), *c.get("args", [])]]
            rest = gossamer_argv(argv, where)
            out.append(Container(path, w, c, rest, parse_cli(rest, where)))
    return out


def by_command(key: str) -> list[Container]:
    found = [c for c in containers() if command_key(c.args) == key]
    assert found, f"no container runs `gossamer {key}`"
    return found


def coordinator() -> Container:
    (c,) = by_command("coordinator serve")
    return c


@cache
def secret_keys() -> dict[str, set[str]]:
    """Secret name -> its keys, from the template (the real ones are created from files)."""
    return {d["metadata"]["name"]: set(d.get("stringData") or d.get("data") or {})
            for _, d in k8s_docs() if d["kind"] == "Secret"}


def file_in_secret(c: Container, file: str, what: str) -> None:
    """`file` lies in a mounted Secret that has a key of that name."""
    for mount, vol in c.mounts().items():
        if file.startswith(mount.rstrip("/") + "/"):
            assert "secret" in vol, f"{c.where}: {what} {file} is on a {set(vol) - {'name'}} volume, not a Secret"
            name = vol["secret"]["secretName"]
            key = file[len(mount.rstrip("/")) + 1:]
            assert key in secret_keys().get(name, set()), f"{c.where}: {what} {file}: Secret {name!r} has no key {key!r}"
            return
    raise AssertionError(f"{c.where}: {what} {file} is not under any volumeMount")


# --- Slurm ---------------------------------------------------------------------------------------
def shell_lines(path: Path) -> list[str]:
    """Logical lines (continuations joined, comments dropped) of a shell script."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") and not buf:
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append(buf + line)
        buf = ""
    return out


def sbatch_values(path: Path) -> dict[str, str]:
    """Each variable's first assignment, expanded with its defaults: what a plain run uses."""
    values: dict[str, str] = {"SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": "/shared/me", "1": "exp.toml", "2": "exp-1"}
    for line in shell_lines(path):
        m = re.match(r"^\s*(?:export\s+|local\s+)?([A-Za-z_][A-Za-z0-9_]*)=(\S.*)?$", line)
        if m and m.group(1) not in values:
            values[m.group(1)] = expand_shell(m.group(2) or "", values)
    return values


def expand_shell(text: str, values: dict[str, str]) -> str:
    """Enough of bash's expansion for these scripts: $(...) -> a host name, ${A:-B}, ${A:?m}, $A, "$@" -> nothing."""
    text = text.replace('"$@"', "")
    prev = None
    while prev != text:
        prev = text
        text = re.sub(r"\$\([^()]*\)", "node-0", text)
        text = re.sub(r"\$\{([A-Za-z0-9_]+)(?::-([^{}]*)|:\?[^{}]*)?\}",
                      lambda m: values.get(m.group(1), m.group(2) if m.group(2) is not None else "x"), text)
        text = re.sub(r"\$([A-Za-z_][A-Za-z0-9_]*|[0-9])", lambda m: values.get(m.group(1), "x"), text)
    return text


@dataclass
class ShellCall:
    line: str
    prefix: list[str]  # what runs gossamer: [] or srun and its options
    argv: list[str]
    args: argparse.Namespace


def sbatch_calls(path: Path) -> list[ShellCall]:
    values = sbatch_values(path)
    calls = []
    lines = shell_lines(path)
    # A gossamer call inside $(...) is a call too (expansion would replace it with its output).
    lines += [m for line in lines for m in re.findall(r"\$\(([^()]*\bgossamer\b[^()]*)\)", line)]
    for line in lines:
        words = shlex.split(expand_shell(line, values), comments=True)
        if "gossamer" not in words:
            continue
        i = words.index("gossamer")
        rest = words[i + 1:]
        for j, w in enumerate(rest):
            if w in ("&", "&&", "||", ";", "|", ")", "2>/dev/null"):
                rest = rest[:j]
                break
        prefix = [w for w in words[:i] if w not in ("exec", "then", "do", "if", "!")]
        prefix = prefix[prefix.index("srun"):] if "srun" in prefix else []
        calls.append(ShellCall(line, prefix, rest, parse_cli(rest, f"{path.name}: {line.strip()}")))
    return calls


# =================================================================================================
# Tests
# =================================================================================================
def test_every_yaml_document_parses_and_names_its_kind() -> None:
    docs = k8s_docs()
    assert docs
    for path, d in docs:
        assert d.get("apiVersion") and d.get("kind") and d.get("metadata", {}).get("name"), f"{path}: {d}"
        assert "namespace" not in d["metadata"], f"{path}: manifests stay namespace-agnostic (kubectl -n)"
    kinds = {d["kind"] for _, d in docs}
    assert {"Deployment", "DaemonSet", "Service", "PersistentVolumeClaim", "Secret"} <= kinds


def test_kustomization_lists_every_manifest_but_the_secret_template() -> None:
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(k["resources"])
    for name in listed:
        assert (K8S / name).is_file(), name
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    # The Secret template holds placeholders: it is documentation, never applied.
    assert listed == {n for n in on_disk if "example" not in n}
    images = {i["name"] for i in k.get("images", [])}
    used = {c.spec["image"].split(":")[0] for c in containers()}
    assert used <= images


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (kustomize rendering not checked)")
def test_kustomize_renders_the_manifests() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert sorted(d["kind"] for d in rendered) == sorted(d["kind"] for _, d in k8s_docs() if d["kind"] != "Secret")


def test_every_container_command_is_accepted_by_the_cli() -> None:
    keys = [command_key(c.args) for c in containers()]
    assert keys.count("coordinator serve") == 1
    assert keys.count("worker join") >= 2  # spot Deployment and on-demand DaemonSet


def test_coordinator_deployment_is_single_writer_on_a_persistent_volume() -> None:
    c = coordinator()
    spec = c.workload["spec"]
    assert c.workload["kind"] == "Deployment" and spec["replicas"] == 1
    assert spec["strategy"]["type"] == "Recreate"
    assert c.args.host == "0.0.0.0", "bound to loopback, the Service could not reach it"
    vol = c.mounts().get(c.args.state_dir)
    assert vol is not None, f"--state-dir {c.args.state_dir} is not a mounted volume"
    claim = vol["persistentVolumeClaim"]["claimName"]
    pvcs = {d["metadata"]["name"]: d for _, d in k8s_docs() if d["kind"] == "PersistentVolumeClaim"}
    assert claim in pvcs and pvcs[claim]["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_coordinator_ports_match_its_flags_and_the_service() -> None:
    c = coordinator()
    ports = bound_ports(c.args)
    assert c.port("grpc") == c.args.port == 7070
    if "http_port" in ports:
        assert c.port("http") == ports["http_port"]
        # The HTTP side binds loopback unless asked: a declared http port must ask for all addresses.
        assert c.args.http_host == "0.0.0.0", "the HTTP side binds loopback: the Service could not reach it"
    declared = {p["containerPort"] for p in c.spec["ports"]}
    assert declared == set(ports.values()), f"containerPorts {declared} vs ports the flags bind {ports}"
    (svc,) = [d for _, d in k8s_docs() if d["kind"] == "Service"]
    labels = c.workload["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items(), "the Service selects no coordinator pod"
    for p in svc["spec"]["ports"]:
        target = p["targetPort"]
        number = c.port(target) if isinstance(target, str) else target
        # Clients dial the Service port: it must be the port the coordinator serves on.
        assert p["port"] == number, p
    assert {p["name"] for p in svc["spec"]["ports"]} == {p["name"] for p in c.spec["ports"]}


def test_coordinator_probes_check_the_grpc_port() -> None:
    c = coordinator()
    assert c.spec.get("readinessProbe") and c.spec.get("livenessProbe")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c.spec.get(kind)
        if not probe:
            continue
        if getattr(c.args, "tls_cert", None):
            # The kubelet's grpc probe is plaintext: against a TLS port it would always fail.
            assert "grpc" not in probe, f"{kind}: a kubelet grpc probe cannot speak TLS"
            argv = gossamer_argv(probe["exec"]["command"], f"{c.where} {kind}")
            ns = parse_cli(argv, f"{c.where} {kind}")
            host, _, port = ns.coordinator.rpartition(":")
            assert host in ("127.0.0.1", "localhost") and int(port) == c.args.port, ns.coordinator
            check_client_credentials(c, ns, f"{kind}")
        else:
            assert probe["grpc"]["port"] == c.args.port, f"{kind} probes {probe['grpc']['port']}"


def check_client_credentials(server: Container, ns: argparse.Namespace, what: str, holder: Container | None = None) -> None:
    """A client of the coordinator carries what the coordinator demands, from mounted Secrets."""
    holder = holder or server
    if getattr(server.args, "tls_cert", None):
        assert getattr(ns, "tls_ca", None), f"{what}: the coordinator speaks TLS, the client has no --tls-ca"
        if getattr(server.args, "tls_ca", None):  # mutual TLS
            assert ns.tls_cert and ns.tls_key, f"{what}: mutual TLS needs --tls-cert and --tls-key"
    if getattr(server.args, "token_file", None):
        assert getattr(ns, "token_file", None), f"{what}: the coordinator wants a token, no --token-file"
    for flag in ("tls_cert", "tls_key", "tls_ca", "token_file"):
        value = getattr(ns, flag, None)
        if value:
            file_in_secret(holder, value, f"{what} --{flag.replace('_', '-')}")


def test_coordinator_credentials_come_from_mounted_secrets() -> None:
    c = coordinator()
    for flag in ("tls_cert", "tls_key", "tls_ca", "token_file"):
        value = getattr(c.args, flag, None)
        if value:
            file_in_secret(c, value, f"--{flag.replace('_', '-')}")


def test_workers_reach_the_coordinator_service_with_its_credentials() -> None:
    co = coordinator()
    (svc,) = [d for _, d in k8s_docs() if d["kind"] == "Service"]
    for w in by_command("worker join"):
        host, _, port = w.args.coordinator.rpartition(":")
        assert host == svc["metadata"]["name"], f"{w.where}: dials {host}, the Service is {svc['metadata']['name']}"
        assert int(port) == co.args.port, f"{w.where}: dials port {port}, the coordinator serves {co.args.port}"
        check_client_credentials(co, w.args, w.where, holder=w)


def test_workers_advertise_their_pod_ip() -> None:
    for w in by_command("worker join"):
        assert w.args.address == FIELD_SAMPLES["status.podIP"], f"{w.where}: --address {w.args.address!r}"


def test_worker_grace_period_outlasts_the_graceful_leave_and_a_prestop_hook_starts_it() -> None:
    for w in by_command("worker join"):
        period = w.pod["terminationGracePeriodSeconds"]
        assert period > w.args.grace, f"{w.where}: pod grace {period} s <= --grace {w.args.grace} s"
        hook = w.spec["lifecycle"]["preStop"]["exec"]["command"]
        assert "TERM" in " ".join(hook), f"{w.where}: preStop does not signal the agent: {hook}"


def node_terms(pod: dict[str, Any]) -> list[list[dict[str, Any]]]:
    req = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return [t["matchExpressions"] for t in req["nodeSelectorTerms"]]


def requires_spot(pod: dict[str, Any]) -> bool:
    """Whether the pod's required node affinity mentions a spot label with `In`."""
    return any(e["operator"] == "In" and e["key"] in SPOT_KEYS for exprs in node_terms(pod) for e in exprs)


def test_spot_workers_carry_spot_flag_affinity_and_tolerations() -> None:
    workers = by_command("worker join")
    for w in workers:
        assert w.args.spot == requires_spot(w.pod), f"{w.where}: --spot {w.args.spot} but scheduled on spot nodes: " \
                                                    f"{requires_spot(w.pod)}"
    spot = [w for w in workers if w.args.spot]
    assert spot, "no spot workers"
    for w in spot:
        assert w.workload["kind"] == "Deployment", f"{w.where}: spot workers scale as a Deployment"
        terms = node_terms(w.pod)
        # Every term (they are ORed) requires a spot label, and each cloud's label has a term.
        selected = set()
        for exprs in terms:
            spot_exprs = [e for e in exprs if e["operator"] == "In" and e["key"] in SPOT_KEYS]
            assert spot_exprs, f"{w.where}: a nodeSelectorTerm admits non-spot nodes: {exprs}"
            selected |= {(e["key"], v) for e in spot_exprs for v in e["values"]}
        assert set(SPOT_LABELS.items()) <= selected
        tolerated = {t["key"] for t in w.pod["tolerations"]}
        assert SPOT_TAINTS <= tolerated, f"{w.where}: no toleration for {SPOT_TAINTS - tolerated}"


def test_on_demand_gpu_workers_avoid_spot_nodes_and_use_every_gpu() -> None:
    ds = [w for w in by_command("worker join") if w.workload["kind"] == "DaemonSet"]
    assert ds
    for w in ds:
        assert not w.args.spot
        for exprs in node_terms(w.pod):
            excluded = {(e["key"], v) for e in exprs if e["operator"] == "NotIn" for v in e["values"]}
            assert set(SPOT_LABELS.items()) <= excluded, f"{w.where}: may land on spot nodes"


def test_gpu_workers_run_one_local_rank_per_gpu() -> None:
    for w in by_command("worker join"):
        limits = w.spec["resources"].get("limits", {})
        if "nvidia.com/gpu" in limits:
            assert w.args.nproc_per_node == int(limits["nvidia.com/gpu"]), w.where
            assert w.spec["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
            shm = w.mounts().get("/dev/shm")
            assert shm and shm["emptyDir"]["medium"] == "Memory", f"{w.where}: NCCL needs a real /dev/shm"


def test_checkpoints_are_on_one_shared_volume_at_the_coordinators_path() -> None:
    co = coordinator()
    # Nodes write under the path the coordinator hands out: <state-dir>/checkpoints.
    path = co.args.state_dir.rstrip("/") + "/checkpoints"
    claims = set()
    for c in [co, *by_command("worker join")]:
        vol = c.mounts().get(path)
        assert vol and "persistentVolumeClaim" in vol, f"{c.where}: {path} is not the shared checkpoint volume"
        claims.add(vol["persistentVolumeClaim"]["claimName"])
    (claim,) = claims
    pvc = {d["metadata"]["name"]: d for _, d in k8s_docs() if d["kind"] == "PersistentVolumeClaim"}[claim]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_prometheus_annotations_and_container_ports_match_the_metrics_flags() -> None:
    for c in containers():
        ports = bound_ports(c.args)
        declared = {p["containerPort"] for p in c.spec.get("ports", [])}
        assert declared == set(ports.values()), f"{c.where}: containerPorts {declared} vs flags {ports}"
        ann = c.workload["spec"]["template"]["metadata"].get("annotations", {})
        if ann.get("prometheus.io/scrape") == "true":
            scraped = int(ann["prometheus.io/port"])
            http = {v for k, v in ports.items() if k in ("http_port", "metrics_port")}
            assert scraped in http, f"{c.where}: scrapes {scraped}, the metrics flags bind {ports}"


def test_gossamer_env_vars_are_ones_the_cli_reads() -> None:
    known = cli_env_names()
    assert "GOSSAMER_PORT" in known  # the grep itself works
    texts = [p.read_text() for p in [*K8S.glob("*.yaml"), *DOCKERFILES, *SBATCH]]
    used = {m for t in texts for m in re.findall(r"\bGOSSAMER_[A-Z0-9_]+", t)}
    assert used, "no GOSSAMER_* variable in deploy/ at all?"
    assert used <= known, f"not read by the CLI: {sorted(used - known)}"


def test_containers_run_as_non_root_with_a_read_only_root() -> None:
    for c in containers():
        pod_sc = c.pod.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") and pod_sc.get("runAsUser", 0) != 0, c.where
        assert c.spec["securityContext"]["readOnlyRootFilesystem"] is True, c.where
        assert "/tmp" in c.mounts(), f"{c.where}: a read-only root needs a writable /tmp"


# --- Docker --------------------------------------------------------------------------------------
def all_k8s_ports() -> set[int]:
    return {p for c in containers() for p in bound_ports(c.args).values()}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_entrypoint_cmd_and_expose_match_the_cli(path: Path) -> None:
    df = Dockerfile.load(path)
    assert df.expand(df.final_stage()[0][1]).startswith("python:3.11-slim")
    argv = gossamer_argv([*df.exec_form("ENTRYPOINT"), *df.exec_form("CMD")], path.name)
    ns = parse_cli(argv, f"{path.name} CMD")
    exposed = {int(p.split("/")[0]) for line in df.all("EXPOSE") for p in line.split()}
    bound = set(bound_ports(ns).values())
    assert bound <= exposed, f"{path.name}: CMD binds {bound}, EXPOSE {exposed}"
    # Every port EXPOSEd is one a gossamer command in deploy/ binds, and the reverse.
    assert exposed == all_k8s_ports() | bound, f"{path.name}: EXPOSE {exposed} vs {all_k8s_ports() | bound}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_pins_torch_runs_as_non_root_and_copies_what_exists(path: Path) -> None:
    df = Dockerfile.load(path)
    runs = df.expand(" ".join(df.all("RUN"))).replace('"', "")
    assert re.search(r"pip install torch==2\.13\.0\b", runs), "torch is pinned like the Makefile pins it"
    if path.name == "Dockerfile":
        assert "--index-url https://download.pytorch.org/whl/cpu" in runs
    user = [rest for w, rest in df.final_stage() if w == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0")
    ignored = (ROOT / ".dockerignore").read_text().split()
    for rest in df.all("COPY"):
        if rest.startswith("--from"):
            continue
        *sources, _dest = shlex.split(rest)
        for src in sources:
            assert (ROOT / src).exists(), f"{path.name}: COPY {src}: not in the repository"
            assert f"!{src.rstrip('/')}/" in ignored or f"!{src}" in ignored, f".dockerignore leaves out {src}"


# --- Slurm ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_script_is_valid_bash(path: Path) -> None:
    out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_script_passes_shellcheck(path: Path) -> None:
    out = subprocess.run(["shellcheck", "-s", "bash", "-S", "warning", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_gossamer_calls_are_accepted_by_the_cli_and_agree(path: Path) -> None:
    calls = sbatch_calls(path)
    keys = [command_key(c.args) for c in calls]
    assert keys.count("coordinator serve") == 1 and "submit" in keys
    (co,) = [c for c in calls if command_key(c.args) == "coordinator serve"]
    assert co.prefix == [] and co.args.host == "0.0.0.0" and co.args.ready_file
    head = sbatch_values(path)["HEAD"]
    joins = [c for c in calls if command_key(c.args) == "worker join"]
    srun = [c for c in joins if c.prefix]
    assert len(srun) == 1, "one `srun ... gossamer worker join` on all nodes"
    assert "--ntasks-per-node=1" in srun[0].prefix, srun[0].prefix
    assert any(c.args.command == "nodes" for c in calls), "the $(gossamer nodes ...) call was not found"
    for c in calls:
        if c.args.command in ("worker", "submit", "watch", "nodes"):
            assert c.args.coordinator == f"{head}:{co.args.port}", c.line
            # Clients of a secured coordinator carry its client credentials.
            if getattr(co.args, "secure", None):
                assert c.args.secure == co.args.secure.rstrip("/") + "/client", c.line
            if getattr(co.args, "tls_cert", None):
                assert c.args.tls_ca or c.args.secure, c.line
        if c.args.command == "worker":
            assert c.args.grace == float(sbatch_values(path)["GRACE"])


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_warns_nodes_before_the_time_limit_with_room_for_the_grace(path: Path) -> None:
    text = path.read_text()
    m = re.search(r"^#SBATCH --signal=(?:B:)?TERM@(\d+)", text, re.M)
    assert m, "no #SBATCH --signal: at the time limit nodes would be killed, not leave"
    assert int(m.group(1)) > float(sbatch_values(path)["GRACE"])
    assert re.search(r"^trap \S+ TERM", text, re.M), "the batch script does not trap SIGTERM"
