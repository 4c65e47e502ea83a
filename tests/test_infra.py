"""infra/ validated offline: compose file, Dockerfile, Kubernetes manifests, and the server auth
files, which must match what rlboost/auth.py generates and must run on the real servers."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from rlboost import auth, metrics, wire
from rlboost.config import Settings, load_settings
from rlboost.services import find_binary, free_port

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
K8S = INFRA / "k8s"
sys.path.insert(0, str(INFRA))
import sync  # noqa: E402  (infra/sync.py)

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?[-?][^}]*)?\}")


def compose() -> dict:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())


def k8s_docs() -> list[dict]:
    docs = []
    for f in sorted(K8S.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        for d in yaml.safe_load_all(f.read_text()):
            if d:
                d["_file"] = f.name
                docs.append(d)
    return docs


def env_example() -> dict[str, str]:
    out = {}
    for line in (INFRA / ".env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def settings_from(env: dict[str, str]) -> Settings:
    """The RLBOOST_* names must be settings of rlboost/config.py (unknown ones are refused)."""
    rl = {k: v for k, v in env.items() if k.startswith("RLBOOST_")}
    for k in rl:
        assert "__" in k or k in ("RLBOOST_NATS_URL", "RLBOOST_REDIS_URL", "RLBOOST_DATA_DIR", "RLBOOST_LOG_JSON",
                                  "RLBOOST_LOG_LEVEL", "RLBOOST_CONFIG"), f"{k} is not a setting"
    return load_settings(environ=rl)


def interpolate(value: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        name, whole = m.group(1), m.group(0)
        if name in env:
            return env[name]
        default = re.match(r"\$\{[^:}]+:?-(.*)\}$", whole)
        return default.group(1) if default else ""

    return _VAR.sub(sub, value)


# ---------------------------------------------------------------- generated files in step


def test_generated_auth_files_are_current():
    for path, text in sync.rendered().items():
        assert path.read_text() == text, f"{path} is stale: run `.venv/bin/python infra/sync.py`"
    assert os.access(INFRA / "redis" / "start-redis.sh", os.X_OK)


def test_no_secrets_in_files():
    env = env_example()
    assert set(env) >= {auth.ENV_TRAINER_PASSWORD, auth.ENV_WORKER_PASSWORD, auth.ENV_ENV_PASSWORD}
    texts = {p: p.read_text() for p in [*INFRA.rglob("*.yaml"), *INFRA.rglob("*.conf"), INFRA / "compose.yaml"]}
    for p, text in texts.items():
        for example in (env[auth.ENV_TRAINER_PASSWORD], env[auth.ENV_WORKER_PASSWORD], env[auth.ENV_ENV_PASSWORD]):
            assert example not in text, p
        assert "password: \"" not in text, p  # nats.conf: only $ENV references
    assert not [d for d in k8s_docs() if d["kind"] == "Secret"], "Secrets are created by hand, never committed"
    assert "infra/.env" in (ROOT / ".gitignore").read_text()


# ---------------------------------------------------------------- compose


def test_compose_services_and_scaling():
    c = compose()
    svc = c["services"]
    assert set(svc) >= {"nats", "redis", "trainer", "worker", "env-worker"}
    for name in svc:
        assert "healthcheck" in svc[name], f"{name} has no health check"
    # NATS: JetStream on a persistent volume, the config file mounted
    vols = svc["nats"]["volumes"]
    assert any(v.startswith("./nats/nats.conf:/etc/nats/nats.conf") for v in vols)
    assert any(v.split(":")[0] in c["volumes"] and v.split(":")[1] == "/data" for v in vols)
    assert svc["nats"]["command"] == ["-c", "/etc/nats/nats.conf"]
    assert "store_dir" in (INFRA / "nats" / "nats.conf").read_text()
    # one image from infra/Dockerfile for trainer, worker and env-worker
    for name in ("trainer", "worker", "env-worker"):
        assert svc[name]["build"]["dockerfile"] == "infra/Dockerfile"
        assert (INFRA / svc[name]["build"]["context"] / svc[name]["build"]["dockerfile"]).resolve() == INFRA / "Dockerfile"
    # scalable workers: nothing that pins one instance
    for name in ("worker", "env-worker"):
        w = svc[name]
        assert "container_name" not in w and "ports" not in w, name
        assert all(not v.startswith("/") for v in w.get("volumes", [])), name  # no host paths
        assert w["stop_signal"] == "SIGTERM", name
        assert "/metrics" in " ".join(w["healthcheck"]["test"]), name  # it serves them (RLBOOST_METRICS__PORT)
    # the server secrets: every role's password reaches NATS and Redis
    for name in ("nats", "redis"):
        assert set(svc[name]["environment"]) >= {auth.ENV_TRAINER_PASSWORD, auth.ENV_WORKER_PASSWORD,
                                                 auth.ENV_ENV_PASSWORD}, name


def test_compose_matches_embedded_mode():
    """Same settings (RLBOOST_* of rlboost/config.py) and the same commands as the embedded mode."""
    env = env_example()
    svc = compose()["services"]
    for name, role in (("trainer", "trainer"), ("worker", "worker"), ("env-worker", "env")):
        e = {k: interpolate(str(v), env) for k, v in svc[name]["environment"].items()}
        s = settings_from(e)
        assert s.services.nats_url.startswith("nats://nats:") and s.services.redis_url.startswith("redis://redis:")
        assert s.services.nats_user == role and s.services.redis_user == role
        secret = env[f"RLBOOST_SERVICES__AUTH__{role.upper()}_PASSWORD"]
        assert s.services.nats_password == s.services.redis_password == secret
        assert s.metrics.port > 0 and s.metrics.bind == "0.0.0.0"
        assert getattr(Settings().services.auth, f"{role}_user") == role  # the role's user name in the server configs
    cmd = interpolate(svc["worker"]["command"], env).split()
    assert cmd[:2] == ["rlboost", "worker"]
    a = cmd[2:]
    assert a[a.index("--pool") + 1] == env["RLBOOST_WORKER__POOL"] and a[a.index("--engine") + 1] in ("emulated", "torch", "vllm")
    from rlboost.cli import COMMANDS

    assert "worker" in COMMANDS and "run" in COMMANDS and "env-worker" in COMMANDS
    assert interpolate(svc["trainer"]["command"], env).split()[:2] == ["rlboost", "run"]
    ecmd = interpolate(svc["env-worker"]["command"], env).split()
    assert ecmd[:2] == ["rlboost", "env-worker"] and ecmd[ecmd.index("--model-dir") + 1] == a[a.index("--model-dir") + 1]
    # the workers' drain fits inside the stop grace period
    for name in ("worker", "env-worker"):
        grace = float(svc[name]["stop_grace_period"].rstrip("s"))
        drain = settings_from({k: interpolate(str(v), env) for k, v in svc[name]["environment"].items()}).worker.drain_grace_s
        assert grace >= drain + 5, name
    # the generation workers hand tool calls to the env-worker service when .env says so
    ws = settings_from({k: interpolate(str(v), {**env, "RLBOOST_ENV__INLINE": "false"})
                        for k, v in svc["worker"]["environment"].items()})
    assert ws.env.inline is False
    # every ${VAR} without a default is in .env.example
    text = (INFRA / "compose.yaml").read_text()
    for m in _VAR.finditer(text):
        if ":-" not in m.group(0):
            assert m.group(1) in env, m.group(0)


def test_docker_compose_config_when_available(tmp_path):
    docker = shutil.which("docker")
    if not docker or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("docker compose client not installed (validated with PyYAML above)")
    envf = tmp_path / ".env"
    envf.write_text((INFRA / ".env.example").read_text())
    r = subprocess.run([docker, "compose", "-f", str(INFRA / "compose.yaml"), "--env-file", str(envf), "config", "-q"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_dockerfile():
    text = (INFRA / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines()]
    stages = [line.split()[-1] for line in lines if line.startswith("FROM ")]
    assert stages[-1] == "cpu" and "cuda" in stages  # cpu is the default (last) target
    cpu = text[text.index("AS cpu"):]
    assert "ARG TORCH_VERSION=2.13.0" in cpu
    assert cpu.index('pip install "torch==${TORCH_VERSION}"') < cpu.index("RUN pip install .")
    assert "vllm" in text[text.index("AS cuda"):text.index("AS cpu")]
    assert "USER rlboost" in cpu
    # every folder the package installs from is in the image and its build context (a missing
    # one fails `pip install .`: setuptools' package-dir names it)
    import tomllib

    folders = {"rlboost", *tomllib.loads((INFRA.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
               ["package-dir"].values()}
    ignore = (INFRA / "Dockerfile.dockerignore").read_text()
    for stage in (text[text.index("AS cuda"):text.index("AS cpu")], cpu):
        assert all(f"COPY {f} ./{f}" in stage for f in folders), folders
    assert all(f"!{f}/**" in ignore for f in folders)


# ---------------------------------------------------------------- Kubernetes

API_VERSIONS = {
    "Namespace": "v1", "ConfigMap": "v1", "Service": "v1", "PersistentVolumeClaim": "v1",
    "Deployment": "apps/v1", "StatefulSet": "apps/v1", "ScaledObject": "keda.sh/v1alpha1",
}
REQUIRED_SPEC = {
    "Service": ("selector", "ports"), "Deployment": ("selector", "template"),
    "StatefulSet": ("selector", "template", "serviceName"), "ScaledObject": ("scaleTargetRef", "triggers"),
    "PersistentVolumeClaim": ("accessModes", "resources"),
}


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in k8s_docs() if d["kind"] == kind}


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def test_k8s_schema():
    docs = k8s_docs()
    kinds = {d["kind"] for d in docs}
    assert kinds >= {"Namespace", "ConfigMap", "Service", "StatefulSet", "Deployment", "ScaledObject"}
    for d in docs:
        where = f"{d['_file']}: {d['kind']}"
        assert d.get("apiVersion") == API_VERSIONS.get(d["kind"]), where
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", d["metadata"]["name"]), where
        for field in REQUIRED_SPEC.get(d["kind"], ()):
            assert field in d["spec"], f"{where}: spec.{field}"
        if d["kind"] in ("Deployment", "StatefulSet"):
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert d["spec"]["selector"]["matchLabels"].items() <= labels.items(), where
            for c in containers(d):
                assert c["name"] and c["image"], where
                for e in c.get("env", []):
                    assert "value" in e or "valueFrom" in e, (where, e)
                    assert not (e["name"].endswith("PASSWORD") and "value" in e), f"{where}: literal {e['name']}"
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    assert sorted(kust["resources"]) == sorted(f.name for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml")


def test_k8s_references_resolve():
    workloads = {**by_kind("Deployment"), **by_kind("StatefulSet")}
    configmaps, pvcs = by_kind("ConfigMap"), by_kind("PersistentVolumeClaim")
    for svc in by_kind("Service").values():
        sel = svc["spec"]["selector"]
        assert any(sel.items() <= w["spec"]["template"]["metadata"]["labels"].items() for w in workloads.values()), svc
        for port in svc["spec"]["ports"]:
            named = [p["name"] for w in workloads.values() for c in w["spec"]["template"]["spec"]["containers"]
                     for p in c.get("ports", [])]
            assert port["targetPort"] in named, port
    for name, w in workloads.items():
        claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        vols = {v["name"]: v for v in w["spec"]["template"]["spec"].get("volumes", [])}
        for v in vols.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, (name, v)
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs, (name, v)
        for c in containers(w):
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols or m["name"] in claims, (name, m)
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == "rlboost-auth" and ref["key"] in PASSWORDS
    # the scripts and configs the containers run are the generated ones
    assert "nats.conf" in configmaps["rlboost-nats-config"]["data"]
    assert "start-redis.sh" in configmaps["rlboost-redis-start"]["data"]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "from-secret") for e in container.get("env", [])}


def test_k8s_worker_on_spot_with_drain():
    w = by_kind("Deployment")["rlboost-worker"]
    spec = w["spec"]["template"]["spec"]
    keys = {t["key"] for t in spec["tolerations"]}
    assert {"cloud.google.com/gke-spot", "eks.amazonaws.com/capacityType", "kubernetes.azure.com/scalesetpriority"} <= keys
    (c,) = spec["containers"]
    assert c["command"][:2] == ["rlboost", "worker"]
    s = settings_from(_env(c))
    assert s.services.nats_user == "worker" and s.services.redis_user == "worker"
    pre = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -TERM 1" in pre
    assert spec["terminationGracePeriodSeconds"] >= s.worker.drain_grace_s + 10
    # the trainer is not on spot nodes and has the admin identity
    t = by_kind("Deployment")["rlboost-trainer"]["spec"]["template"]["spec"]
    assert "tolerations" not in t
    assert settings_from(_env(t["containers"][0])).services.nats_user == "trainer"


def test_k8s_env_worker_on_cpu_spot_with_drain():
    """The environment workers: CPU nodes (no GPU asked for, GPU nodes ruled out), spot allowed,
    the env identity, the drain within the grace, ready once /metrics answers."""
    d = by_kind("Deployment")["rlboost-env-worker"]
    spec = d["spec"]["template"]["spec"]
    worker = by_kind("Deployment")["rlboost-worker"]["spec"]["template"]["spec"]
    assert {t["key"] for t in spec["tolerations"]} == {t["key"] for t in worker["tolerations"]}  # spot, as the workers
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {(m["key"], m["operator"]) for m in term["matchExpressions"]} >= {("nvidia.com/gpu.present", "DoesNotExist")}
    (c,) = spec["containers"]
    assert c["command"][:2] == ["rlboost", "env-worker"]
    assert "nvidia.com/gpu" not in str(c.get("resources", {}))
    s = settings_from(_env(c))
    assert s.services.nats_user == "env" and s.services.redis_user == "env"
    keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"] if "valueFrom" in e}
    assert keys == {auth.ENV_ENV_PASSWORD}  # its own secret, not the worker's
    assert "kill -TERM 1" in " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert spec["terminationGracePeriodSeconds"] >= s.worker.drain_grace_s + 10
    assert c["readinessProbe"]["httpGet"]["path"] == "/metrics" and s.metrics.port == c["ports"][0]["containerPort"]
    for name in ("nats", "redis"):  # the servers know the env role's password
        (server,) = by_kind("StatefulSet")[name]["spec"]["template"]["spec"]["containers"]
        assert auth.ENV_ENV_PASSWORD in _env(server), name


def test_k8s_keda_scales_env_workers_on_the_environment_lane():
    so = by_kind("ScaledObject")["rlboost-env-worker"]
    assert so["spec"]["scaleTargetRef"]["name"] == "rlboost-env-worker" in by_kind("Deployment")
    (t,) = so["spec"]["triggers"]
    m = t["metadata"]
    assert t["type"] == "nats-jetstream" and m["consumer"] == wire.ENV_CONSUMER and m["stream"] == wire.STREAM_REQUESTS
    worker_so = by_kind("ScaledObject")["rlboost-worker"]
    same = next(w for w in worker_so["spec"]["triggers"] if w["type"] == "nats-jetstream")  # the same NATS
    assert (m["natsServerMonitoringEndpoint"], m["account"]) == (same["metadata"]["natsServerMonitoringEndpoint"],
                                                                 same["metadata"]["account"])
    (c,) = by_kind("Deployment")["rlboost-env-worker"]["spec"]["template"]["spec"]["containers"]
    assert int(m["lagThreshold"]) == settings_from(_env(c)).env.pool_slots  # one env worker per episodes it runs at once
    assert so["spec"]["minReplicaCount"] == 0 < so["spec"]["maxReplicaCount"]


def test_k8s_keda_scales_workers_on_the_pool_consumers():
    so = by_kind("ScaledObject")["rlboost-worker"]
    assert so["spec"]["scaleTargetRef"]["name"] == "rlboost-worker"
    assert so["spec"]["scaleTargetRef"]["name"] in by_kind("Deployment")
    worker_cmd = by_kind("Deployment")["rlboost-worker"]["spec"]["template"]["spec"]["containers"][0]["command"]
    pool = worker_cmd[worker_cmd.index("--pool") + 1]
    everything = so["spec"]["triggers"]
    assert {t["type"] for t in everything} == {"nats-jetstream", "prometheus"}
    # the fleet policy's target (rlboost/fleet_policy.py), exported by the trainer for this pool
    (fleet,) = [t for t in everything if t["type"] == "prometheus"]
    q = fleet["metadata"]["query"]
    assert "rlboost_fleet_desired_workers" in q and f'pool="{pool}"' in q
    assert metrics.FLEET_DESIRED._name == "rlboost_fleet_desired_workers" and float(fleet["metadata"]["threshold"]) == 1
    trainer = by_kind("Deployment")["rlboost-trainer"]["spec"]["template"]["spec"]["containers"][0]
    fs = settings_from(_env(trainer)).fleet
    assert fs.policy == "cost" and fs.max_instances == so["spec"]["maxReplicaCount"]
    triggers = [t for t in everything if t["type"] == "nats-jetstream"]
    assert {t["metadata"]["consumer"] for t in triggers} == {wire.consumer_name(pool), wire.resume_consumer_name(pool)}
    nats_svc = by_kind("Service")["nats"]
    monitor = next(p["port"] for p in nats_svc["spec"]["ports"] if p["name"] == "monitor")
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for t in triggers:
        m = t["metadata"]
        assert m["stream"] == wire.STREAM_REQUESTS and m["account"] == "$G"
        assert m["natsServerMonitoringEndpoint"] == f"nats.{kust['namespace']}.svc.cluster.local:{monitor}"
        assert int(m["lagThreshold"]) > 0
    assert so["spec"]["minReplicaCount"] == 0 < so["spec"]["maxReplicaCount"]


# ---------------------------------------------------------------- the committed server files run


def _wait_port(port: int, proc: subprocess.Popen, deadline: float) -> None:
    import socket

    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("server did not start")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


PASSWORDS = {auth.ENV_TRAINER_PASSWORD: "t-infra-pw", auth.ENV_WORKER_PASSWORD: "w-infra-pw",
             auth.ENV_ENV_PASSWORD: "e-infra-pw"}


async def test_committed_nats_conf_runs(tmp_path):
    from rlboost import bus

    port, mport = free_port(), free_port()
    conf = (INFRA / "nats" / "nats.conf").read_text()
    assert '"/data/jetstream"' in conf  # the compose/k8s volume; here a temporary dir instead
    (tmp_path / "nats.conf").write_text(conf.replace('"/data/jetstream"', f'"{tmp_path / "js"}"'))
    proc = subprocess.Popen([find_binary("nats-server"), "-c", str(tmp_path / "nats.conf"), "-a", "127.0.0.1",
                             "-p", str(port), "-m", str(mport)],
                            env={**os.environ, **PASSWORDS}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, proc, time.monotonic() + 15)
        tr = await bus.connect(f"nats://trainer:t-infra-pw@127.0.0.1:{port}")
        await bus.provision(tr.jetstream(), pools=("spot",))
        errors: list[str] = []

        async def cb(e: Exception) -> None:
            errors.append(str(e).lower())

        wk = await bus.connect(f"nats://worker:w-infra-pw@127.0.0.1:{port}", error_cb=cb)
        assert (await wk.jetstream().publish("rb.tok.1.x", b"t")).seq > 0
        await wk.publish("rb.req.spot", b"nope")
        await wk.flush()
        for _ in range(60):
            if errors:
                break
            await asyncio.sleep(0.05)
        assert errors and "permissions violation" in errors[0]
        await wk.close()
        env_errors: list[str] = []

        async def env_cb(e: Exception) -> None:
            env_errors.append(str(e).lower())

        ev = await bus.connect(f"nats://env:e-infra-pw@127.0.0.1:{port}", error_cb=env_cb)
        assert (await ev.jetstream().publish(wire.resume_subject("spot"), b"back")).seq > 0
        await ev.publish(wire.env_subject("spot"), b"nope")  # the env lane is the generation workers'
        await ev.flush()
        for _ in range(60):
            if env_errors:
                break
            await asyncio.sleep(0.05)
        assert env_errors and "permissions violation" in env_errors[0] and "rb.req.spot.env" in env_errors[0]
        await ev.close()
        await tr.close()
        with pytest.raises(ConnectionError, match="refused the credentials"):
            await bus.connect(f"nats://worker:t-infra-pw@127.0.0.1:{port}")
    finally:
        _stop(proc)


def test_committed_redis_start_script_runs(tmp_path):
    redis = pytest.importorskip("redis")
    port = free_port()
    bindir = Path(find_binary("redis-server")).parent
    env = {**os.environ, **PASSWORDS, "REDIS_ACL_FILE": str(tmp_path / "users.acl"),
           "PATH": f"{bindir}:{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(["/bin/sh", str(INFRA / "redis" / "start-redis.sh"), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, proc, time.monotonic() + 15)
        assert (tmp_path / "users.acl").stat().st_mode & 0o077 == 0
        w = redis.Redis(port=port, username="worker", password="w-infra-pw")
        assert w.append("rb:{x}:tok", b"12345678") == 8
        with pytest.raises(redis.exceptions.NoPermissionError):
            w.flushall()
        w.close()
        e = redis.Redis(port=port, username="env", password="e-infra-pw")
        assert e.append("rb:{x}:tok", b"1234") == 12
        with pytest.raises(redis.exceptions.NoPermissionError):
            e.set("not-a-checkpoint", b"1")
        e.close()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, username="worker", password="t-infra-pw").ping()
        t = redis.Redis(port=port, username="trainer", password="t-infra-pw")
        assert t.ping()
        t.close()
    finally:
        _stop(proc)
    # the script refuses to start without the passwords
    bad = subprocess.run(["/bin/sh", str(INFRA / "redis" / "start-redis.sh")], env={"PATH": env["PATH"]},
                         capture_output=True, text=True, timeout=10)
    assert bad.returncode != 0 and auth.ENV_TRAINER_PASSWORD in bad.stderr


def test_settings_roundtrip_of_auth_section():
    s = load_settings(environ={"RLBOOST_SERVICES__AUTH__WORKER_POOLS": "spot,gpu", **PASSWORDS})
    assert auth.roles_configured(s.services.auth) and auth.worker_pools(s.services.auth) == ["spot", "gpu"]
    assert msgspec.to_builtins(Settings())["services"]["auth"]["worker_password"] == ""


# ---------------------------------------------------------------- the clustered variants

K8S_CLUSTER = INFRA / "k8s-cluster"
SENTINEL_URL = re.compile(r"redis\+sentinel://([^/@]+)/(\w+)/0$")


def _merge(base, patch):
    """A strategic merge patch, the part kustomize applies here: maps merge, lists of named
    items (containers, env, ports) merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: _merge(base[k], v) if k in base else v for k, v in patch.items()}}
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(x, dict) and "name" in x for x in base + patch):
        out = {x["name"]: x for x in base}
        for x in patch:
            out[x["name"]] = _merge(out[x["name"]], x) if x["name"] in out else x
        return list(out.values())
    return patch


def k8s_cluster_docs() -> list[dict]:
    """infra/k8s-cluster rendered offline: the base's documents, its own, then its patches."""
    kust = yaml.safe_load((K8S_CLUSTER / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization" and kust["namespace"] == "rlboost" and "../k8s" in kust["resources"]
    docs = k8s_docs()
    for r in kust["resources"]:
        if r != "../k8s":
            docs += [{**d, "_file": r} for d in yaml.safe_load_all((K8S_CLUSTER / r).read_text()) if d]
    for p in kust["patches"]:
        for patch in yaml.safe_load_all((K8S_CLUSTER / p["path"]).read_text()):
            (i,) = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])]
            docs[i] = _merge(docs[i], patch)
    return docs


def _cluster(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in k8s_cluster_docs() if d["kind"] == kind}


def _nats_args(args: list[str]) -> dict[str, str]:
    return {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--")}


def test_k8s_cluster_schema_and_references():
    docs = k8s_cluster_docs()
    for d in docs:
        assert d.get("apiVersion") == API_VERSIONS.get(d["kind"]), d["_file"]
        for field in REQUIRED_SPEC.get(d["kind"], ()):
            assert field in d["spec"], f"{d['_file']}: spec.{field}"
    services = _cluster("Service")
    for name, sts in _cluster("StatefulSet").items():  # pod DNS names need a headless governing Service
        assert services[sts["spec"]["serviceName"]]["spec"].get("clusterIP") == "None", name
        assert sts["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
        named = {p["name"] for c in containers(sts) for p in c.get("ports", [])}
        for c in containers(sts):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                assert not ref or (ref["name"] == "rlboost-auth" and ref["key"] in PASSWORDS), (name, e)
        for svc in services.values():
            if svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items():
                assert {p["targetPort"] for p in svc["spec"]["ports"]} <= named, (name, svc["metadata"]["name"])


def test_k8s_cluster_nats_three_routed_nodes():
    nats = _cluster("StatefulSet")["nats"]
    n, headless = nats["spec"]["replicas"], nats["spec"]["serviceName"]
    assert n == 3
    (c,) = nats["spec"]["template"]["spec"]["containers"]
    a = _nats_args(c["args"])
    assert c["args"][:2] == ["-c", "/etc/nats/nats.conf"]  # the generated config, users and store
    assert a["--server_name"] == "$(POD_NAME)" and _env(c)["POD_NAME"] == "from-secret"  # a fieldRef
    assert next(e for e in c["env"] if e["name"] == "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    port = int(a["--cluster"].rsplit(":", 1)[1])
    assert port in {p["containerPort"] for p in c["ports"]}
    assert sorted(a["--routes"].split(",")) == [f"nats://nats-{i}.{headless}:{port}" for i in range(n)]
    assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"  # JetStream on a PVC each


def test_k8s_cluster_sentinel_watches_the_primary():
    sts = _cluster("StatefulSet")
    redis, sentinel = sts["redis"], sts["redis-sentinel"]
    assert redis["spec"]["replicas"] == 2 and sentinel["spec"]["replicas"] == 3
    script = "\n".join(redis["spec"]["template"]["spec"]["containers"][0]["command"])
    assert f"--replicaof redis-0.{redis['spec']['serviceName']} 6379" in script and "/scripts/start-redis.sh" in script
    conf = "\n".join(sentinel["spec"]["template"]["spec"]["containers"][0]["command"])
    assert f"sentinel monitor rb redis-0.{redis['spec']['serviceName']} 6379 2" in conf  # quorum 2 of 3
    assert "sentinel auth-user rb trainer" in conf and "auth-pass rb $RLBOOST_SERVICES__AUTH__TRAINER_PASSWORD" in conf


def test_k8s_cluster_clients_know_every_node():
    sts = _cluster("StatefulSet")
    nats, sentinel = sts["nats"], sts["redis-sentinel"]
    for name in ("rlboost-trainer", "rlboost-worker", "rlboost-env-worker"):
        (c,) = _cluster("Deployment")[name]["spec"]["template"]["spec"]["containers"]
        s = settings_from(_env(c))
        assert s.services.nats_replicas == nats["spec"]["replicas"]
        assert sorted(s.services.nats_url.split(",")) == [
            f"nats://nats-{i}.{nats['spec']['serviceName']}:4222" for i in range(nats["spec"]["replicas"])]
        hosts, master = SENTINEL_URL.match(s.services.redis_url).groups()
        assert master == "rb" and sorted(hosts.split(",")) == [
            f"redis-sentinel-{i}.{sentinel['spec']['serviceName']}:26379" for i in range(sentinel["spec"]["replicas"])]


def test_k8s_cluster_matches_kustomize_when_available():
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl not installed (rendered offline above)")
    r = subprocess.run([kubectl, "kustomize", str(K8S_CLUSTER)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    built = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(r.stdout) if d}
    ours = {(d["kind"], d["metadata"]["name"]): d for d in k8s_cluster_docs()}
    assert set(built) == set(ours)
    for key in (("StatefulSet", "nats"), ("StatefulSet", "redis"), ("Deployment", "rlboost-worker")):
        assert built[key]["spec"]["replicas"] == ours[key]["spec"]["replicas"]
        bc, oc = built[key]["spec"]["template"]["spec"]["containers"][0], ours[key]["spec"]["template"]["spec"]["containers"][0]
        assert (bc.get("args"), bc["command"] if "command" in bc else None, _env(bc)) == (
            oc.get("args"), oc["command"] if "command" in oc else None, _env(oc))


def test_compose_cluster_override():
    env = env_example()
    base, over = compose()["services"], yaml.safe_load((INFRA / "compose.cluster.yaml").read_text())
    svc = {k: {**base.get(k, {}), **v} for k, v in over["services"].items()}
    nodes = sorted(k for k in svc if k.startswith("nats"))
    assert len(nodes) == 3
    for k in nodes:
        a = _nats_args(svc[k]["command"])
        assert svc[k]["command"][:2] == ["-c", "/etc/nats/nats.conf"] and "healthcheck" in svc[k]
        assert sorted(a["--routes"].split(",")) == sorted(f"nats://{n}:6222" for n in nodes)
    assert len({_nats_args(svc[k]["command"])["--server_name"] for k in nodes}) == 3
    assert "--replicaof redis 6379" in " ".join(svc["redis-replica"]["entrypoint"])
    assert "sentinel monitor rb redis 6379 1" in " ".join(svc["redis-sentinel"]["entrypoint"])
    for k in ("redis-replica", "redis-sentinel", "nats-2", "nats-3"):
        assert "healthcheck" in svc[k] and svc[k]["restart"] == "unless-stopped", k
    for k in ("nats-2", "nats-3", "redis-replica"):  # the generated configs name every role's password
        assert set(svc[k]["environment"]) >= set(PASSWORDS), k
    for name in ("trainer", "worker", "env-worker"):
        e = {**base[name]["environment"], **over["services"][name]["environment"]}
        s = settings_from({k: interpolate(str(v), env) for k, v in e.items()})
        assert sorted(s.services.nats_url.split(",")) == sorted(f"nats://{n}:4222" for n in nodes)
        assert SENTINEL_URL.match(s.services.redis_url).groups() == ("redis-sentinel:26379", "rb")
        assert s.services.nats_replicas == 3
        assert set(over["services"][name]["depends_on"]) >= {"nats-2", "nats-3", "redis-sentinel"}
    text = (INFRA / "compose.cluster.yaml").read_text()
    for m in _VAR.finditer(text):
        assert ":-" in m.group(0) or m.group(1) in env, m.group(0)


@pytest.mark.slow
async def test_committed_nats_cluster_args_run(tmp_path):
    """The overlay's NATS flags on the committed nats.conf, 3 servers on loopback (the routes
    rewritten to their ports): they form one JetStream cluster and take the streams at R3."""
    from rlboost import bus
    from rlboost.services import provision_cluster

    (c,) = _cluster("StatefulSet")["nats"]["spec"]["template"]["spec"]["containers"]
    ports = [(free_port(), free_port(), free_port()) for _ in range(3)]  # client, route, monitor
    hosts = {f"nats-{i}.nats-headless:6222": f"127.0.0.1:{r}" for i, (_, r, _) in enumerate(ports)}
    procs = []
    try:
        for i, (port, route, mport) in enumerate(ports):
            conf = (INFRA / "nats" / "nats.conf").read_text().replace('"/data/jetstream"', f'"{tmp_path / f"js{i}"}"')
            (tmp_path / f"n{i}.conf").write_text(conf)
            args = [a.replace("$(POD_NAME)", f"nats-{i}").replace("0.0.0.0:6222", f"127.0.0.1:{route}") for a in c["args"]]
            for h, loop in hosts.items():
                args = [a.replace(h, loop) for a in args]
            args[1] = str(tmp_path / f"n{i}.conf")
            procs.append(subprocess.Popen([find_binary("nats-server"), *args, "-a", "127.0.0.1", "-p", str(port),
                                           "-m", str(mport)], env={**os.environ, **PASSWORDS},
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for (port, _, _), p in zip(ports, procs):
            _wait_port(port, p, time.monotonic() + 15)
        url = ",".join(f"nats://trainer:t-infra-pw@127.0.0.1:{p}" for p, _, _ in ports)
        assert await provision_cluster(url, 3) == 3
        nc = await bus.connect(url)
        try:
            info = await nc.jetstream().stream_info(wire.STREAM_REQUESTS)
            assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2  # a leader + 2 replicas
        finally:
            await nc.close()
    finally:
        for p in procs:
            _stop(p)


@pytest.mark.slow
async def test_committed_redis_sentinel_scripts_run(tmp_path):
    """The overlay's replica and Sentinel scripts on real servers (pod names rewritten to loopback
    ports)."""
    pytest.importorskip("redis")
    sts = _cluster("StatefulSet")
    (rc,) = sts["redis"]["spec"]["template"]["spec"]["containers"]
    (sc,) = sts["redis-sentinel"]["spec"]["template"]["spec"]["containers"]
    primary, replica, sport = free_port(), free_port(), free_port()
    bindir = Path(find_binary("redis-server")).parent
    env = {**os.environ, **PASSWORDS, "PATH": f"{bindir}:{os.environ.get('PATH', '')}"}

    def loopback(text: str) -> str:
        return (text.replace("redis-0.redis-headless 6379", f"127.0.0.1 {primary}").replace("/scripts/", f"{INFRA}/redis/")
                .replace('"$HOSTNAME.redis-headless"', "127.0.0.1").replace("$HOSTNAME.redis-sentinel", "127.0.0.1")
                .replace("/data/", f"{tmp_path}/").replace("port 26379", f"port {sport}"))

    def redis_node(i: int, port: int) -> subprocess.Popen:
        d = tmp_path / f"r{i}"
        d.mkdir()
        *sh, script, name = rc["command"]
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(d)]
        return subprocess.Popen([*sh, loopback(script), name, *args],
                                env={**env, "HOSTNAME": f"redis-{i}", "REDIS_ACL_FILE": str(d / "users.acl")},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    procs = [redis_node(0, primary), redis_node(1, replica)]
    try:
        for port, p in zip((primary, replica), procs):
            _wait_port(port, p, time.monotonic() + 15)
        procs.append(subprocess.Popen([*sc["command"][:2], loopback(sc["command"][2])], env={**env, "HOSTNAME": "redis-sentinel-0"},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        await _sentinel_serves(tmp_path, primary, replica, sport, procs[-1])
    finally:
        for p in procs:
            _stop(p)


async def _sentinel_serves(tmp_path: Path, primary: int, replica: int, sport: int, sentinel: subprocess.Popen) -> None:
    """The replica is in sync as the trainer's ACL user, the Sentinel (its config 0600) names the
    primary, and a client of the redis+sentinel URL writes through it to both nodes."""
    import redis

    from rlboost.checkpoint import _connect

    _wait_port(sport, sentinel, time.monotonic() + 15)
    assert (tmp_path / "sentinel.conf").stat().st_mode & 0o077 == 0  # it holds the trainer's password
    r = redis.Redis(port=replica, username="trainer", password="t-infra-pw")
    s = redis.Redis(port=sport)
    try:
        for _ in range(200):
            if r.info("replication").get("master_link_status") == "up":
                break
            time.sleep(0.05)
        assert r.info("replication")["master_link_status"] == "up"
        assert s.sentinel_get_master_addr_by_name("rb") == (b"127.0.0.1", primary)
        client = _connect(f"redis+sentinel://trainer:t-infra-pw@127.0.0.1:{sport}/rb/0", 2, 5.0)
        await client.set("rb:{x}:probe", b"1")
        await client.aclose()
        for _ in range(100):
            if r.get("rb:{x}:probe") == b"1":
                break
            time.sleep(0.05)
        assert r.get("rb:{x}:probe") == b"1"  # written to the primary, replicated
    finally:
        r.close()
        s.close()


@pytest.mark.slow
async def test_committed_compose_sentinel_scripts_run(tmp_path):
    """compose.cluster.yaml's replica and Sentinel entrypoints on real servers (service names
    rewritten to loopback ports, compose's `$$` to `$`)."""
    pytest.importorskip("redis")
    svc = yaml.safe_load((INFRA / "compose.cluster.yaml").read_text())["services"]
    primary, replica, sport = free_port(), free_port(), free_port()
    bindir = Path(find_binary("redis-server")).parent
    env = {**os.environ, **PASSWORDS, "PATH": f"{bindir}:{os.environ.get('PATH', '')}"}

    def loopback(text: str, d: Path) -> str:
        return (text.replace("$$", "$").replace("redis 6379", f"127.0.0.1 {primary}")
                .replace("/usr/local/bin/start-redis.sh", str(INFRA / "redis" / "start-redis.sh"))
                .replace("--appendonly yes --dir /data", f"--appendonly no --save '' --dir {d} --bind 127.0.0.1 --port {replica}")
                .replace("--replica-announce-ip redis-replica", "--replica-announce-ip 127.0.0.1")
                .replace("/data/", f"{tmp_path}/").replace("port 26379", f"port {sport}"))

    for d in ("r0", "r1"):
        (tmp_path / d).mkdir()
    procs = [subprocess.Popen(["/bin/sh", str(INFRA / "redis" / "start-redis.sh"), "--port", str(primary), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no", "--dir", str(tmp_path / "r0")],
                              env={**env, "REDIS_ACL_FILE": str(tmp_path / "r0" / "users.acl")},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait_port(primary, procs[0], time.monotonic() + 15)
        *sh, script = svc["redis-replica"]["entrypoint"]
        procs.append(subprocess.Popen([*sh, loopback(script, tmp_path / "r1")],
                                      env={**env, "REDIS_ACL_FILE": str(tmp_path / "r1" / "users.acl")},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_port(replica, procs[1], time.monotonic() + 15)
        *sh, script = svc["redis-sentinel"]["entrypoint"]
        procs.append(subprocess.Popen([*sh, loopback(script, tmp_path)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        await _sentinel_serves(tmp_path, primary, replica, sport, procs[2])
    finally:
        for p in procs:
            _stop(p)
