"""Role resources from the config, and preflight's verdict per role: fits now, must grow, or never (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.placement import ClusterView, NodeType, Role, fit_roles, fit_table, node_types_from_file
from configs.loader import ConfigError, load_config
from configs.schema import Config, Resources
from jobs.preflight import Preflight, check_resources, run_roles

ROOT = Path(__file__).resolve().parents[2]


def test_resources_become_actor_options_and_bundles() -> None:
    res = Resources(num_cpus=4, num_gpus=1, accelerator_type="A100", resources={"mcprl_gpu_worker": 0.01})
    assert res.actor_options() == {
        "num_cpus": 4.0,
        "num_gpus": 1.0,
        "accelerator_type": "A100",
        "resources": {"mcprl_gpu_worker": 0.01},
    }
    assert res.bundle() == {"CPU": 4.0, "GPU": 1.0, "accelerator_type:A100": 0.001, "mcprl_gpu_worker": 0.01}
    assert Resources(num_cpus=0.1).actor_options() == {"num_cpus": 0.1, "num_gpus": 0.0}  # today's defaults
    assert Resources(num_cpus=0.1).bundle() == {"CPU": 0.1}


def test_every_role_reads_its_resources_and_the_older_flat_keys() -> None:
    cfg = load_config(
        None,
        [
            "rollout.engine_resources={num_cpus: 2, num_gpus: 1, accelerator_type: L4}",
            "rollout.num_cpus_per_runner=0.2",  # the older spelling still reads
            "learner.worker_resources.resources={mcprl_gpu_worker: 1}",
            "tools.servers.fmp.num_cpus=0.3",
            "tools.servers.python.autoscaling={min_replicas: 1, max_replicas: 2}",
            "reward.backend=llm_judge",
            "reward.judge.replica_resources.resources={mcprl_tool_worker: 0.01}",
        ],
    )
    roles = {r.name: r for r in run_roles(cfg)}
    assert roles["engines"].resources.accelerator_type == "L4" and roles["engines"].key == "rollout.engine_resources"
    assert roles["runners"].resources.num_cpus == 0.2
    assert roles["learner workers"].resources.resources == {"mcprl_gpu_worker": 1}
    assert roles["tool fmp"].resources.num_cpus == 0.3
    assert roles["tool python"].shown_count == "1-2"  # autoscaled: counted at its most
    assert roles["judge"].resources.resources == {"mcprl_tool_worker": 0.01}
    with pytest.raises(ConfigError, match=r"rollout.engine_resources.resources: .*'GPU' is not a custom resource"):
        load_config(None, ["rollout.engine_resources.resources={GPU: 1}"])
    with pytest.raises(ConfigError, match="older spelling num_cpus_per_engine"):
        load_config(None, ["rollout.engine_resources.num_cpus=2", "rollout.num_cpus_per_engine=3"])


def _roles(gpu_engine: Resources) -> list[Role]:
    return [
        Role("engines", 2, gpu_engine, key="rollout.engine_resources"),
        Role("runners", 2, Resources(num_cpus=0.5)),
        Role("tool polygon", 2, Resources(num_cpus=0.1), "1-2"),
    ]


HEAD = NodeType("head", {"CPU": 2.0})
GPU_TYPE = NodeType("gpu_worker", {"CPU": 8.0, "GPU": 1.0, "accelerator_type:A10G": 1.0}, max_workers=4)


def test_a_cluster_that_can_grow_must_grow_and_one_that_cannot_refuses() -> None:
    engine = Resources(num_cpus=4, num_gpus=1)
    grows = fit_roles(_roles(engine), ClusterView("c", [HEAD], [HEAD, GPU_TYPE]))
    assert [f.verdict for f in grows.fits] == ["must grow", "fits now", "fits now"]
    assert grows.ok and grows.must_grow and "2 of 2 wait for new nodes" in grows.fits[0].why

    fixed = fit_roles(_roles(engine), ClusterView("c", [HEAD]))  # no autoscaler: never
    assert not fixed.ok and fixed.fits[0].verdict == "never"
    assert fixed.fits[0].why == "no node has CPU 4 (has 2), GPU"

    # One GPU node there now, but two engines: the second does not fit, and nothing can be added.
    one_gpu = NodeType("n1", dict(GPU_TYPE.resources))
    tight = fit_roles(_roles(engine), ClusterView("c", [HEAD, one_gpu]))
    assert tight.fits[0].verdict == "never" and "1 of 2 do not fit" in tight.fits[0].why
    assert fit_roles(_roles(engine), ClusterView("c", [HEAD, one_gpu, one_gpu])).fits[0].verdict == "fits now"


def test_a_role_no_node_type_could_hold_is_never_and_named() -> None:
    h100 = Resources(num_cpus=4, num_gpus=1, accelerator_type="H100")
    view = ClusterView("c", [HEAD], [HEAD, GPU_TYPE])
    report = fit_roles(_roles(h100), view)
    assert not report.ok
    assert report.fits[0].verdict == "never" and report.fits[0].why == "no node type has accelerator_type:H100"
    table = fit_table(report, view)
    assert table[0].split() == ["role", "count", "each", "total", "cluster"]
    assert table[1].split()[:3] == ["engines", "2", "4"] and "never: no node type has" in table[1]
    assert "1-2" in table[3] and "gpu_worker (CPU 8, GPU 1" in table[-1]


def test_the_launcher_node_types_hold_the_gpu_config(tmp_path: Path) -> None:
    """The AWS launcher file's node types, read as preflight reads an autoscaler's config."""
    types = node_types_from_file(str(ROOT / "cluster/launcher/aws.yaml"))
    cfg = load_config(ROOT / "configs/gpu-1.5b-lora.yaml")
    head = next(t for t in types if t.resources.get("CPU", 1) == 0)
    report = fit_roles(run_roles(cfg), ClusterView("aws", [NodeType("head", head.resources)], types))
    assert report.ok and {f.role.name for f in report.fits if f.verdict == "must grow"} >= {
        "engines",
        "learner workers",
    }


def test_preflight_refuses_on_the_embedded_ray_naming_the_role_and_key() -> None:
    cfg = Config()
    cfg.cluster.num_cpus = 4
    cfg.learner.worker_resources = Resources(num_cpus=1, resources={"mcprl_gpu_worker": 1})
    pf = Preflight()
    check_resources(cfg, pf)
    [check] = pf.checks
    assert not check.ok and check.detail.startswith("embedded Ray on this machine can never hold learner workers")
    assert "learner.worker_resources" in check.fix
    cfg.learner.worker_resources = Resources(num_cpus=0.5)
    pf = Preflight()
    check_resources(cfg, pf)
    assert pf.checks[0].ok and "holds every role now" in pf.checks[0].detail
