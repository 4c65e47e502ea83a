"""The Grafana dashboard (infra/grafana) is provisioned in compose and only plots metrics that
rlboost/metrics.py declares: a renamed metric cannot leave an empty panel behind."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from rlboost import metrics

INFRA = Path(__file__).parents[1] / "infra"
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def _declared() -> set[str]:
    names = set()
    for family in metrics.REGISTRY.collect():
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


def test_every_panel_plots_a_declared_metric_from_the_provisioned_datasource():
    dash = json.loads((INFRA / "grafana" / "dashboards" / "rlboost.json").read_text())
    ds = yaml.safe_load((INFRA / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    uids = {d["uid"] for d in ds["datasources"]}
    declared = _declared()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    rows = {p["title"] for p in dash["panels"] if p["type"] == "row"}
    assert {"Fleet", "Queues", "Hand-offs", "Training"} <= rows
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in panels:
        assert p["datasource"]["uid"] in uids and p["targets"], p["title"]
        for t in p["targets"]:
            used = re.findall(r"rlboost_[a-z_]+", t["expr"])
            assert used, t["expr"]
            for name in used:
                base = next((name[: -len(s)] for s in _SUFFIXES if name.endswith(s) and name[: -len(s)] in declared), name)
                assert name in declared or base in declared, f"{p['title']}: {name} is not in rlboost/metrics.py"
    # the four metrics that used to be declared and never emitted are on the board now
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for name in ("rlboost_regenerated_tokens_total", "rlboost_cost_dollars_total", "rlboost_workers_live",
                 "rlboost_trainer_checkpoint_seconds"):
        assert name in exprs


def test_compose_provisions_grafana_and_prometheus_scrapes_the_metrics_port():
    c = yaml.safe_load((INFRA / "compose.yaml").read_text())
    g = c["services"]["grafana"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in g["volumes"]}
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    dash_path = yaml.safe_load((INFRA / "grafana" / "provisioning" / "dashboards" / "rlboost.yaml").read_text())[
        "providers"][0]["options"]["path"]
    assert mounts["./grafana/dashboards"] == dash_path
    assert all(p.startswith("127.0.0.1:") for p in g["ports"] + c["services"]["prometheus"]["ports"])
    prom = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    port = c["x-rlboost-env"]["RLBOOST_METRICS__PORT"]
    targets = json.dumps(prom["scrape_configs"])
    assert f"trainer:{port}" in targets and '"port": ' + port in targets
    ds = yaml.safe_load((INFRA / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ds["datasources"][0]["url"].endswith(":9090") and "prometheus" in c["services"]
