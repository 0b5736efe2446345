"""The config tree: YAML + overrides, and errors that name the key and the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from configs.loader import (
    CONFIG_DIR,
    ConfigError,
    dump_config,
    load_config,
    load_dotenv_file,
    parse_override,
    set_args,
    set_items,
)

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_defaults_are_offline_and_loopback():
    cfg = load_config()
    assert cfg.tools.servers.polygon.backend == "offline"
    assert cfg.tools.http.host == "127.0.0.1"
    assert cfg.model.name == "tiny-random"


def test_offline_tools_reach_nothing_outside_and_leave_no_traces():
    """Task generation and the warm start's expert play both play on `tools.offline()`."""
    cfg = load_config(
        None,
        [
            "tools.servers.polygon.backend=live",
            "tools.servers.slack.db_path=/tmp/shared.db",
        ],
    )
    tools = cfg.tools.offline()
    assert all(getattr(tools.servers, n).backend == "offline" for n in ("polygon", "fmp", "tavily", "slack"))
    assert tools.servers.slack.db_path == ""  # a fresh in-memory workspace
    # the caller's config is untouched
    assert (cfg.tools.servers.polygon.backend, cfg.tools.servers.slack.db_path) == ("live", "/tmp/shared.db")


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    load_config(path)


def test_yaml_and_typed_overrides(tmp_path):
    p = write(tmp_path, "tools:\n  servers:\n    python:\n      replicas: 2\n")
    cfg = load_config(p, ["tools.servers.python.sandbox.memory_mb=128", "tools.servers.fmp.enabled=false"])
    assert cfg.tools.servers.python.replicas == 2
    assert cfg.tools.servers.python.sandbox.memory_mb == 128
    assert cfg.tools.servers.fmp.enabled is False


def test_unknown_key_names_key_and_file(tmp_path):
    p = write(tmp_path, "tools:\n  servers:\n    polygon:\n      bakend: live\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "tools.servers.polygon.bakend: unknown key" in str(e.value)
    assert str(p) in str(e.value)


def test_unknown_key_suggests_the_nearest_key_path(tmp_path):
    p = write(tmp_path, "tools:\n  servers:\n    polygon:\n      bakend: live\n")
    with pytest.raises(ConfigError, match=r"bakend: unknown key; did you mean tools\.servers\.polygon\.backend\?"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"train\.wandb: unknown key; did you mean logging\.wandb\?"):
        load_config(None, ["train.wandb=off"])  # the right key in another section
    item = "tools.external=[{name: x, url: 'http://127.0.0.1:1/mcp', tymeout_s: 3}]"
    with pytest.raises(ConfigError, match=r"did you mean tools\.external\.0\.timeout_s\?"):
        load_config(None, [item])
    with pytest.raises(ConfigError) as e:
        load_config(None, ["zzzz=1"])
    assert "zzzz: unknown key" in str(e.value) and "did you mean" not in str(e.value)


def test_unknown_key_from_the_command_line_names_a_suggestion() -> None:
    """As a user meets it: a fresh process, a typo in --set, exit 2 with the suggestion and no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.train", "--config", "configs/ci-tiny.yaml", "--set", "train.stpes=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "train.stpes: unknown key; did you mean train.steps?" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("text", "mode"), [("off", "off"), ("false", "off"), ("on", "auto"), ("true", "auto")])
def test_wandb_takes_yaml_booleans(tmp_path: Path, text: str, mode: str) -> None:
    """YAML reads a bare off/on as a boolean: the mode field takes them as off and auto."""
    assert load_config(write(tmp_path, f"logging:\n  wandb: {text}\n")).logging.wandb == mode
    assert load_config(None, [f"logging.wandb={text}"]).logging.wandb == mode
    with pytest.raises(ConfigError, match=r"logging\.wandb: Input should be 'auto', 'online', 'offline' or 'off'"):
        load_config(None, ["logging.wandb=maybe"])


@pytest.mark.slow
def test_preflight_takes_wandb_off_as_typed() -> None:
    """`--set logging.wandb=off` as a user types it, through jobs.train's preflight: accepted, and the plan says so."""
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.train", "--config", "configs/ci-tiny.yaml", "--set", "logging.wandb=off"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": ""},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "W&B: off (logging.wandb: off)" in proc.stdout


def test_wrong_type_names_key_and_value(tmp_path):
    p = write(tmp_path, "tools:\n  http:\n    port: eighty\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "tools.http.port" in str(e.value) and "'eighty'" in str(e.value)


def test_a_python_timeout_shorter_than_its_sandbox_may_take_is_refused():
    """The pool's clock counts against the model: it must outlast a slot's wait and the sandbox's own limit."""
    assert load_config().tools.servers.python.timeout_s == 90  # 60 s queue + 10 s wall time, with room
    with pytest.raises(ConfigError, match=r"tools\.servers\.python.*timeout_s \(10 s\) must exceed .*\(70 s\)"):
        load_config(None, ["tools.servers.python.timeout_s=10"])
    with pytest.raises(ConfigError, match=r"tool_timeouts\.run_python \(20 s\)"):
        load_config(None, ["tools.servers.python.tool_timeouts={run_python: 20}"])
    cfg = load_config(None, ["tools.servers.python.timeout_s=20", "tools.servers.python.sandbox.queue_timeout_s=5"])
    assert cfg.tools.servers.python.timeout_s == 20


def test_bad_literal_from_override_names_the_override():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["tools.servers.slack.backend=online"])
    assert "tools.servers.slack.backend" in str(e.value) and "--set" in str(e.value)


def test_tool_format_is_compact_unless_json_and_refuses_others(tmp_path):
    assert load_config().env.tool_format == "compact"
    assert load_config(None, ["env.tool_format=json"]).env.tool_format == "json"
    p = write(tmp_path, "env:\n  tool_format: yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    # The key, the value and the choices: enough to fix the file without reading the schema.
    assert "env.tool_format" in str(e.value) and "'yaml'" in str(e.value) and str(p) in str(e.value)
    assert "'compact'" in str(e.value) and "'json'" in str(e.value)


def test_set_args_write_values_that_parse_back_as_they_were() -> None:
    values = {
        "a.none": None,
        "a.off": "off",  # YAML would read a bare off as false
        "a.null_text": "null",  # a string, not None
        "a.path": Path("/tmp/x y"),
        "a.float": 1e-4,
        "a.flag": True,
        "a.list": [1, "x"],
        "a.map": {"k": None},
        "a.name": "smollm2-135m-instruct",
        "a.empty": "",
    }
    args = set_args(values)
    assert args[0::2] == ["--set"] * len(values)
    back = {".".join(keys): value for keys, value in map(parse_override, args[1::2])}
    assert back == {**values, "a.path": "/tmp/x y"}
    # Through a whole config: a null where the schema takes one.
    cfg = load_config(None, set_items({"algorithm.outcome_first": None, "logging.wandb": "off"}))
    assert cfg.algorithm.outcome_first is None and cfg.logging.wandb == "off"


def test_override_errors():
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a=") == (["a"], "")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("no-equals-sign")
    with pytest.raises(ConfigError, match="not a section"):
        load_config(None, ["run_name=x", "run_name.sub=1"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "tools: [unclosed\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- a list\n"))


def test_external_server_needs_exactly_one_transport():
    with pytest.raises(ConfigError, match="exactly one"):
        load_config(None, ["tools.external=[{name: x}]"])
    with pytest.raises(ConfigError, match="unique"):
        load_config(None, ["tools.external=[{name: polygon, url: 'http://127.0.0.1:1/mcp'}]"])


def test_secrets_never_printed(monkeypatch):
    monkeypatch.setenv("POLYGON_API_KEY", "pk-very-secret-123")
    cfg = load_config(
        None,
        [
            "tools.external=[{name: x, url: 'http://127.0.0.1:1/mcp?key=pk-very-secret-123',"
            " headers: {Authorization: 'Bearer abc'}}]"
        ],
    )
    text = dump_config(cfg)
    assert "pk-very-secret-123" not in text and "Bearer abc" not in text
    assert "***" in text


def test_dotenv_is_read_and_environment_wins(tmp_path, monkeypatch):
    env = tmp_path / ".env"
    env.write_text("FMP_API_KEY=from-dotenv\nTAVILY_API_KEY=from-dotenv\n")
    monkeypatch.setenv("FMP_API_KEY", "from-env")
    monkeypatch.delenv("TAVILY_API_KEY", raising=False)
    load_dotenv_file(env)
    import os

    assert os.environ["FMP_API_KEY"] == "from-env"
    assert os.environ["TAVILY_API_KEY"] == "from-dotenv"
    monkeypatch.delenv("TAVILY_API_KEY")


def test_algorithm_options_and_a_group_of_one_only_for_ppo() -> None:
    cfg = load_config(overrides=["algorithm.advantage=dr_grpo", "algorithm.dr_grpo_norm_tokens=512"])
    assert cfg.algorithm.name == "grpo" and cfg.algorithm.dr_grpo_norm_tokens == 512
    ppo = load_config(overrides=["algorithm.name=ppo", "train.group_size=1", "algorithm.value_clip=null"])
    assert (ppo.algorithm.gamma, ppo.algorithm.lam, ppo.algorithm.value_loss_coef) == (0.99, 0.95, 0.5)
    assert ppo.train.group_size == 1 and ppo.algorithm.value_clip is None
    with pytest.raises(ConfigError, match=r"train\.group_size is 1: GRPO needs at least 2"):
        load_config(overrides=["train.group_size=1"])
    with pytest.raises(ConfigError, match=r"algorithm\.lam"):
        load_config(overrides=["algorithm.name=ppo", "algorithm.lam=1.5"])
    with pytest.raises(ConfigError, match=r"algorithm\.name"):
        load_config(overrides=["algorithm.name=a2c"])


DS = ["learner.backend=deepspeed", "learner.workers=2"]


def test_config_refuses_what_deepspeed_cannot_do() -> None:
    with pytest.raises(ConfigError, match=r"learner\.deepspeed\.config.*gradient_clipping.*learner\.optim"):
        load_config(None, [*DS, 'learner.deepspeed.config={"gradient_clipping": 2.0}'])
    with pytest.raises(ConfigError, match=r"learner\.deepspeed\.stage"):
        load_config(None, [*DS, "learner.deepspeed.stage=1"])
    assert load_config(None, [*DS, "learner.deepspeed.stage=3"]).learner.deepspeed.stage == 3
    assert load_config(None, ["learner.backend=deepspeed", "learner.workers=1", "finetune.mode=full"])
