"""The cluster files: the job runtime env, the launcher configs and the KubeRay manifests.

Checked against what Ray and KubeRay themselves read (Ray's runtime-env parsing and packaging, the cluster
launcher's JSON schema and validator, the fields KubeRay's CRDs require) and against configs/gpu-*.yaml.
No cluster is started and nothing leaves the machine.
"""

from __future__ import annotations

import copy
import json
import shlex
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray._private.runtime_env.packaging import _get_excludes, _zip_files
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args
from ray.runtime_env import RuntimeEnv

from configs.loader import SECRET_ENV_VARS, load_config

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
RUNTIME_ENV = CLUSTER / "runtime_env.yaml"
LAUNCHERS = sorted((CLUSTER / "launcher").glob("*.yaml"))
GPU_CONFIGS = sorted((REPO / "configs").glob("gpu-*.yaml"))
GPU_RESOURCE, TOOL_RESOURCE = "mcprl_gpu_worker", "mcprl_tool_worker"

# Paths of a checkout that must never be uploaded with a job, and paths a job needs.
NOT_UPLOADED = [
    ".git/HEAD",
    ".venv/bin/python",
    "runs/ci-tiny/checkpoints/step-1/state.pt",
    "runs/ci-tiny/wandb/run-1/files/config.yaml",
    "data/tasks.train.jsonl",
    "bench_results/train.json",
    "wandb/latest-run/run.wandb",
    "jobs/__pycache__/train.cpython-311.pyc",
    "mcprl.egg-info/PKG-INFO",
    ".pytest_cache/v/cache/nodeids",
    ".ruff_cache/0.6.0/123",
    ".env",
]
UPLOADED = [
    "configs/gpu-1.5b-lora.yaml",
    "configs/schema.py",
    "jobs/train.py",
    "cluster/runtime_env.yaml",
    "pyproject.toml",
    ".env.example",
]


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


# --- runtime env ---------------------------------------------------------------------------------------------


def test_runtime_env_is_what_ray_job_submit_accepts():
    env = _yaml(RUNTIME_ENV)
    assert set(env) <= RuntimeEnv.known_fields, set(env) - RuntimeEnv.known_fields
    # The job CLI's own parsing of `--working-dir . --runtime-env cluster/runtime_env.yaml`.
    submitted = parse_runtime_env_args(runtime_env=str(RUNTIME_ENV), working_dir=str(REPO))
    assert RuntimeEnv(**submitted)["working_dir"] == str(REPO)
    assert env["env_vars"]["PYTHONUNBUFFERED"] == "1"
    # The dashboard shows a job's runtime env: no secret may be set there.
    assert not set(env["env_vars"]) & set(SECRET_ENV_VARS)


def test_runtime_env_excludes_keep_outputs_caches_and_secrets_out(tmp_path):
    root = tmp_path / "checkout"
    for rel in NOT_UPLOADED + UPLOADED:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    # Ray's own packaging of a working dir, with our excludes only (.gitignore not consulted).
    out = tmp_path / "pkg.zip"
    _zip_files(str(root), _yaml(RUNTIME_ENV)["excludes"], str(out), include_gitignore=False)
    packed = set(zipfile.ZipFile(out).namelist())
    assert set(UPLOADED) <= packed, set(UPLOADED) - packed
    assert not set(NOT_UPLOADED) & packed, set(NOT_UPLOADED) & packed


def test_runtime_env_excludes_cover_gitignore():
    """What .gitignore keeps out stays out even with RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1."""
    excluded = _get_excludes(REPO, _yaml(RUNTIME_ENV)["excludes"])
    patterns = [p.strip() for p in (REPO / ".gitignore").read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]
    assert patterns
    for pattern in patterns:
        # A path the pattern matches: `*` becomes a name, a directory gets a file inside.
        example = pattern.lstrip("/").replace("*", "mcprl")
        example += "f" if example.endswith("/") else ""
        assert excluded(REPO / example), f"cluster/runtime_env.yaml excludes: nothing covers {pattern!r}"


# --- cluster launcher ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_schema() -> dict[str, Any]:
    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def _node_types(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(head, GPU worker, tool worker) node types, found by their resources."""
    types = config["available_node_types"]
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    gpu = [t for t in workers if GPU_RESOURCE in t["resources"]]
    tool = [t for t in workers if TOOL_RESOURCE in t["resources"]]
    assert len(gpu) == 1 and len(tool) == 1, f"one {GPU_RESOURCE} and one {TOOL_RESOURCE} worker type"
    return types[config["head_node_type"]], gpu[0], tool[0]


def test_there_is_a_launcher_config_per_cloud():
    assert [p.stem for p in LAUNCHERS] == ["aws", "gcp"]


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.stem)
def test_launcher_config_passes_rays_schema_and_validator(path, ray_schema):
    config = _yaml(path)
    assert config["provider"]["type"] == path.stem
    jsonschema.validate(config, ray_schema)
    # What `ray up` does before it starts anything: merge the provider's defaults, then validate.
    validate_config(prepare_config(copy.deepcopy(config)))


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.stem)
def test_launcher_node_types_and_setup(path):
    config = _yaml(path)
    head, gpu, tool = _node_types(config)
    assert head["resources"] == {"CPU": 0}  # the driver's node runs no task or actor
    assert gpu["resources"]["GPU"] >= 1 and gpu["resources"][GPU_RESOURCE] == 1
    assert "GPU" not in tool["resources"] and tool["resources"][TOOL_RESOURCE] == 1
    for t in (gpu, tool):
        assert 0 <= t["min_workers"] <= t["max_workers"] <= config["max_workers"]
    assert config["idle_timeout_minutes"] > 0
    # The checkout reaches every node, and the setup commands install it: the CUDA extra on GPU workers only.
    assert config["file_mounts"]["~/mcprl"] == "."
    assert any('"mcprl @ ' in c for c in config["setup_commands"])
    assert any('"mcprl[gpu] @ ' in c for c in gpu["worker_setup_commands"])
    assert any("bubblewrap" in c for c in config["setup_commands"])
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        assert any("RAY_AUTH_MODE=token ray start" in c for c in commands)


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.stem)
@pytest.mark.parametrize("config_path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_launcher_gpu_workers_can_hold_the_gpu_configs(path, config_path):
    node = _node_types(_yaml(path))[1]
    _assert_gpu_nodes_hold(config_path, node["resources"]["GPU"], node["resources"]["CPU"], node["max_workers"])


def _assert_gpu_nodes_hold(config_path: Path, gpus: float, cpus: float, max_nodes: int) -> None:
    """Each engine and learner worker fits on one GPU node, and max_nodes of them hold the whole run."""
    cfg = load_config(config_path)
    r, lrn = cfg.rollout, cfg.learner
    engine, worker = r.engine_resources, lrn.worker_resources
    actors = [(engine.num_gpus, engine.num_cpus)] * r.engines + [(worker.num_gpus, worker.num_cpus)] * lrn.workers
    assert all(g <= gpus and c <= cpus for g, c in actors), (config_path.name, actors, gpus, cpus)
    assert sum(g for g, _ in actors) <= gpus * max_nodes, (config_path.name, actors, max_nodes)


# --- KubeRay -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raycluster() -> dict[str, Any]:
    return _yaml(CLUSTER / "kuberay" / "raycluster.yaml")


@pytest.fixture(scope="module")
def rayjob() -> dict[str, Any]:
    return _yaml(CLUSTER / "kuberay" / "rayjob.yaml")


def _containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    containers = group["template"]["spec"]["containers"]
    assert containers
    for c in containers:
        assert c["name"] and c["image"], c
        assert c["resources"]["limits"]["cpu"] and c["resources"]["limits"]["memory"], c["name"]
    return containers


def _custom_resources(group: dict[str, Any]) -> dict[str, float]:
    # KubeRay pastes the value into the pod's shell command `ray start --resources=<value>`: a JSON object,
    # shell-quoted.
    (arg,) = shlex.split(group["rayStartParams"].get("resources", "{}"))
    return json.loads(arg)


def test_raycluster_has_what_the_crd_requires(raycluster):
    assert raycluster["apiVersion"] == "ray.io/v1" and raycluster["kind"] == "RayCluster"
    assert raycluster["metadata"]["name"]
    spec = raycluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())  # map[string]string in the CRD
    assert head["rayStartParams"]["num-cpus"] == "0"
    _containers(head)
    groups = spec["workerGroupSpecs"]
    assert len({g["groupName"] for g in groups}) == len(groups)
    for g in groups:
        assert all(isinstance(v, str) for v in g["rayStartParams"].values()), g["groupName"]
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g["groupName"]
        _containers(g)


def test_raycluster_groups_match_the_launchers_and_gpu_configs(raycluster):
    groups = raycluster["spec"]["workerGroupSpecs"]
    gpu = [g for g in groups if GPU_RESOURCE in _custom_resources(g)]
    tool = [g for g in groups if TOOL_RESOURCE in _custom_resources(g)]
    assert len(gpu) == 1 and len(tool) == 1
    (gpu_container,) = _containers(gpu[0])
    limits = gpu_container["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= 1
    assert all("nvidia.com/gpu" not in c["resources"]["limits"] for c in _containers(tool[0]))
    for config_path in GPU_CONFIGS:
        _assert_gpu_nodes_hold(config_path, int(limits["nvidia.com/gpu"]), int(limits["cpu"]), gpu[0]["maxReplicas"])


def test_rayjob_runs_jobs_train_on_the_same_cluster_and_runtime_env(rayjob, raycluster):
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    spec = rayjob["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:3] == ["python", "-m", "jobs.train"] and "--run" in argv
    config_path = REPO / argv[argv.index("--config") + 1]
    assert config_path.is_file(), config_path
    load_config(config_path)
    assert spec["shutdownAfterJobFinishes"] is True
    # One cluster definition: the RayJob's is the RayCluster's.
    assert spec["rayClusterSpec"] == raycluster["spec"]
    # cluster/runtime_env.yaml, with the image's checkout as the working dir.
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert env.pop("working_dir") == "/home/ray/mcprl"
    assert env == _yaml(RUNTIME_ENV)
    RuntimeEnv(**env)


def test_image_build_leaves_out_what_jobs_leave_out():
    """cluster/kuberay/Dockerfile copies the checkout: its ignore file names the same paths as the runtime env."""
    lines = (CLUSTER / "kuberay" / "Dockerfile.dockerignore").read_text().splitlines()
    ignored = {_bare(p) for p in lines if p.strip() and not p.startswith("#")}
    excluded = {_bare(p) for p in _yaml(RUNTIME_ENV)["excludes"]}
    assert excluded <= ignored, excluded - ignored


def _bare(pattern: str) -> str:
    """`/runs/`, `**/wandb` → `runs`, `wandb`; `*.pyc` → `.pyc`: the two syntaxes compared by the name they hit."""
    return pattern.strip().removeprefix("**/").strip("/").removeprefix("*")
