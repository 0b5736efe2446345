"""The benchmark's options: one validated model, set from the command line as `--set SUITE.KEY=VALUE`.

    python -m bench --suite train --set train.pushes=3 --set train.vllm=off

Every suite reads its sizes from its own section here, so a typo or a bad value fails before anything
starts, with the key named (as `jobs.*` do for configs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from configs.loader import ConfigError, apply_override, format_errors, load_config, parse_override, set_items
from configs.schema import Config

SUITES = (
    "tools", "env", "prompt", "rollout", "train", "job", "e2e", "quality", "scale", "cplane", "gpu", "learning", "chaos"
)  # fmt: skip
Suite = Literal[
    "tools", "env", "prompt", "rollout", "train", "job", "e2e", "quality", "scale", "cplane", "gpu", "learning",
    "chaos", "all",
]  # fmt: skip
# cplane runs inside scale; gpu is for a GPU box (its 1.7B shape crawls on a CPU); learning is 6 whole demo
# runs (~2 h on a 2-core CPU), quality two trainings and a dozen evaluations (~1 h); chaos counts what faults
# cost, not speed
NOT_IN_ALL = ("quality", "cplane", "gpu", "learning", "chaos")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def unless_set(self, sizes: dict[str, Any]) -> Any:
        """A copy with `sizes` (a suite's `--quick` ones) where `--set` did not choose."""
        return self.model_copy(update={k: v for k, v in sizes.items() if k not in self.model_fields_set})


class SeededSection(Section):
    """A section run once per seed in `seeds`."""

    seeds: list[int]

    @model_validator(mode="after")
    def _distinct_seeds(self) -> SeededSection:
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            suite = type(self).__name__.removesuffix("Options").lower()
            raise ValueError(f"{suite}.seeds {self.seeds}: expected a non-empty list of distinct seeds")
        return self


class CallsOptions(Section):
    calls: int = Field(300, ge=1, description="calls per measurement (suites tools, env, rollout)")


class RolloutOptions(Section):
    """Suite `rollout`: engines, push modes, async against lockstep."""

    vllm: Literal["auto", "on", "off"] = Field("auto", description="the vLLM parts: auto = if installed, not --quick")


class TrainOptions(Section):
    """Suite `train`: the learner's tokens/s and the weight push."""

    model: str = Field("smollm2-135m-instruct", description="model name (a built-in, a folder or an HF id)")
    samples: int = Field(16, ge=1, description="samples per train_step")
    prompt_tokens: int = Field(900, ge=1, description="mean prompt length of the synthetic batch")
    gen_tokens: int = Field(100, ge=1, description="mean generated length of the synthetic batch")
    group_size: int = Field(4, ge=1, description="samples sharing a prompt (a GRPO group)")
    long_prompt_tokens: int = Field(400, ge=1, description="the long-response batch's mean prompt length")
    long_gen_tokens: int = Field(
        700, ge=1, description="the long-response batch's mean response length (a big tool result in each episode)"
    )
    train_warmup: int = Field(2, ge=0, description="train steps left out of the timing")
    train_steps: int = Field(3, ge=1, description="train steps measured")
    pushes: int = Field(5, ge=1, description="LoRA pushes measured per path")
    weight_pushes: int = Field(5, ge=1, description="full-weight syncs measured")
    engines: int = Field(2, ge=1, description="HF engines in the rollout group")
    vllm: Literal["auto", "on", "off"] = Field("auto", description="1 vLLM engine too: auto = if installed, in budget")
    budget_s: float = Field(600.0, gt=0, description="the whole suite's time budget")
    seed: int = 0


class JobOptions(Section):
    """Suite `job`: `ray job submit` against the same run started locally."""

    config: str = Field("configs/ci-tiny.yaml", description="the run to time (relative to the checkout)")
    head_cpus: int = Field(4, ge=1, description="the loopback head's logical CPUs (ci-tiny's embedded Ray has 4)")


class E2EOptions(Section):
    """Suite `e2e`: mcprl's GRPO step against TRL's GRPOTrainer on the same work (`--quick`: tiny-random,
    2 steps, 8 new tokens, mcprl on its HF engine, 1 repeat)."""

    model: str = Field("smollm2-135m-instruct", description="the policy both trainers start from")
    steps: int = Field(5, ge=2, description="GRPO steps per trainer and repeat (the first is left out of step time)")
    tasks_per_step: int = Field(2, ge=1, description="prompts per step")
    group_size: int = Field(4, ge=2, description="completions per prompt (G)")
    max_new_tokens: int = Field(64, ge=1, description="new tokens per turn")
    max_turns: int = Field(2, ge=1, description="assistant turns per episode")
    lora_r: int = Field(16, ge=1, description="LoRA rank, on q,k,v,o for both (alpha = 2r)")
    lr: float = Field(1e-4, gt=0, description="learning rate of both (constant, no warm-up)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of both")
    observation_tokens: int = Field(
        512, ge=0, description="TRL: room for tool results in its whole-completion budget (see bench/trl_baseline.py)"
    )
    mcprl_backend: Literal["vllm", "hf"] = Field("vllm", description="mcprl's rollout engine (TRL uses HF generate)")
    config: str = Field("configs/bench-e2e.yaml", description="mcprl's run config; the sizes above are --set on it")
    tasks: int = Field(32, ge=1, description="rule tasks (polygon, simple) generated for both trainers")
    seed: int = 0


class QualityOptions(Section):
    """Suite `quality`: training minutes until held-out success passes the warm start + `target_points`, on
    suite e2e's work (its section) from one warm start (bench/quality.py)."""

    steps: int = Field(30, ge=1, description="GRPO steps per side, at most")
    eval_every: int = Field(
        5, ge=1, description="each side's adapter is scored every N steps (and the steps before its first pass)"
    )
    warm_steps: int = Field(10, ge=1, description="SFT steps of the warm start both sides train on")
    warm_lr: float = Field(1e-3, gt=0, description="the warm start's learning rate")
    train_tasks: int = Field(128, ge=1, description="rule tasks to train on (seed)")
    held_out_tasks: int = Field(64, ge=1, description="held-out rule tasks (seed + 1, no training prompt among them)")
    target_points: float = Field(10.0, gt=0, description="the goal: held-out success ≥ the warm start's + this")
    seed: int = 0
    mcprl_sets: dict[str, Any] = Field(
        {},
        description="config overrides (`--set` of jobs.train) of mcprl's GRPO run alone, not of its warm start or "
        "the evaluator: an ablation from the same warm start, scored alike",
    )
    trl: bool = Field(True, description="train TRL's side too (false: mcprl alone, e.g. for an ablation)")

    def smoke(self) -> QualityOptions:
        """`--quick`: 2 steps, each evaluated, 1 SFT step and 4 held-out tasks, where `--set` did not choose."""
        return self.unless_set({"steps": 2, "eval_every": 1, "warm_steps": 1, "train_tasks": 8, "held_out_tasks": 4})


class ScaleOptions(Section):
    """Suite `scale`: sweeps, each plotted."""

    group_sizes: list[int] = Field([2, 4, 8, 16], description="G values of the step-time sweep")
    tasks_per_step: list[int] = Field([1, 2, 4], description="tasks-per-step values of the step-time sweep")
    replicas: list[int] = Field([1, 2, 4], description="python tool replicas of the tool-pool sweep")
    in_flight: list[int] = Field([10, 100, 1000], description="episodes in flight of the control-plane sweep")
    train_config: str = Field(
        "configs/ci-tiny.yaml", description="the run the step-time sweep times (`python -m jobs.train`, one per point)"
    )
    sweep_tasks: int = Field(2, ge=1, description="tasks per step while G varies")
    sweep_group: int = Field(4, ge=1, description="G while tasks per step varies")
    vllm: Literal["auto", "on", "off"] = Field(
        "auto", description="the async-vs-lockstep sweep on a vLLM engine: auto = when vLLM is installed"
    )
    vllm_model: str = Field("tiny-random", description="the vLLM engine's model (tiny-random or smollm2-135m-instruct)")
    vllm_tasks: int = Field(8, ge=1, description="rule tasks of the async-vs-lockstep sweep (x 4 episodes each)")
    vllm_tokens: tuple[int, int] = Field((16, 96), description="real new tokens per turn, uniform (low, high)")
    vllm_in_flight: int = Field(16, ge=1, description="episodes in flight at most (both modes)")

    @model_validator(mode="after")
    def _check(self) -> ScaleOptions:
        lo, hi = self.vllm_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"scale.vllm_tokens {list(self.vllm_tokens)}: expected 1 <= low <= high")
        for key in ("group_sizes", "tasks_per_step"):
            values = getattr(self, key)
            if not values or min(values) < 1:
                raise ValueError(f"scale.{key} {values}: expected a non-empty list of positive integers")
        return self

    def smoke(self) -> ScaleOptions:
        """`--quick`: the smallest sizes that still run every sweep: 1 jobs.train process (G 2 at 1 task per step,
        each sweep's one point: a curve's second point and the row comparing them are the same code over more
        points, tested in-process), 2 tasks x 4 episodes a mode."""
        return self.model_copy(
            update={
                "group_sizes": [2],
                "tasks_per_step": [1],
                "sweep_tasks": 1,
                "sweep_group": 2,
                "vllm_tasks": 2,
                "vllm_tokens": (4, 8),
                "vllm_in_flight": 4,
            }
        )


class CplaneOptions(Section):
    """Suite `cplane` (and suite `scale`'s tool-pool and control-plane sweeps): what each point of the
    sweeps in `scale.replicas` and `scale.in_flight` runs."""

    python_calls: int = Field(12, ge=1, description="CPU-bound python-tool calls per replica count and repeat")
    rounds: int = Field(2, ge=1, description="episodes per in-flight slot: N in flight plays rounds x N episodes")
    reference_episodes: int = Field(12, ge=1, description="episodes played one at a time: the per-call reference")
    engines: int = Field(2, ge=1, description="scripted engine actors the runner routes across")
    gen_ms: float = Field(20.0, ge=0, description="the scripted engines' time per generation")
    tasks: int = Field(24, ge=1, description="rule tasks generated; those without a python call are played")


class GpuOptions(Section):
    """Suite `gpu`: learner, HF engine and weight sync on one accelerator, without Ray (bench/gpu.py)."""

    shapes: list[Literal["tiny", "135m", "1.7b"]] = Field(["135m", "1.7b"], description="model shapes measured")
    samples: int = Field(16, ge=1, description="samples per train_step")
    prompt_tokens: int = Field(900, ge=1, description="mean prompt length (learner batch and engine requests)")
    gen_tokens: int = Field(100, ge=1, description="mean generated length of the learner batch")
    group_size: int = Field(4, ge=1, description="samples sharing a prompt (a GRPO group)")
    micro_batch_tokens: int = Field(16384, ge=64, description="learner.micro_batch_tokens")
    train_warmup: int = Field(2, ge=0, description="train steps left out of the timing")
    train_steps: int = Field(2, ge=1, description="train steps measured per repeat")
    batch: int = Field(32, ge=1, description="concurrent engine requests")
    new_tokens: int = Field(128, ge=1, description="tokens each engine request generates")
    pushes: int = Field(5, ge=1, description="adapter and full-weight syncs measured")
    seed: int = 0


class LearningOptions(SeededSection):
    """Suite `learning`: per seed, the demo recipe (warm start, then GRPO) against the warm start alone trained
    longer for GRPO's wall time (`--quick`: configs/ci-tiny.yaml, seed 0, its own small steps)."""

    config: str = Field("configs/demo-cpu.yaml", description="the recipe run per seed (relative to the checkout)")
    seeds: list[int] = Field([0, 1, 2], description="train.seed of each pair of runs (rollout.sampling.seed: +1)")
    run_timeout_s: float = Field(7200.0, gt=0, description="the most one jobs.train process may take")
    sets: dict[str, Any] = Field({}, description="config overrides of every run (`--set` of jobs.train)")
    reuse: bool = Field(
        True,
        description="keep a seed's finished result (learning-work/seed-<s>.json) when the loaded config and the "
        "overrides are unchanged, so the seeds can be run one invocation at a time; false reruns every seed",
    )

    def smoke(self) -> LearningOptions:
        """`--quick`: the tiny random model's recipe and one seed, where `--set` did not choose; one GRPO step
        and 2 evaluation tasks are enough to produce every figure (the SFT-more run is then shorter too)."""
        return self.unless_set(
            {"config": "configs/ci-tiny.yaml", "seeds": [0], "sets": {"train.steps": 1, "train.eval_tasks": 2}}
        )


class ChaosOptions(SeededSection):
    """Suite `chaos`: ci-tiny runs under a seeded schedule of faults, against one unbroken run (bench/chaos.py)."""

    seeds: list[int] = Field(list(range(10)), description="one run under faults per seed (the seed draws its moments)")
    steps: int = Field(6, ge=2, description="GRPO steps of every run (a checkpoint after each)")
    run_timeout_s: float = Field(900.0, gt=0, description="a run not finished by then counts as hung")
    adapter_atol: float = Field(1e-6, ge=0, description="how far a final adapter may be from the unbroken run's")

    def smoke(self) -> ChaosOptions:
        """`--quick`: one seed and 3 steps, where `--set` did not choose."""
        return self.unless_set({"seeds": [0], "steps": 3})


class BenchOptions(Section):
    suite: Suite = "tools"
    repeats: int = Field(3, ge=1, description="each side-by-side comparison is repeated this many times")
    out: Path = Field(Path("bench_results"), description="folder for each suite's JSON, markdown table and chart")
    config: str | None = Field(None, description="the mcprl config the suites read tools and tasks from")
    quick: bool = Field(False, description="smoke sizes: every figure present, none meaningful (the tests use it)")
    tools: CallsOptions = CallsOptions()
    env: CallsOptions = CallsOptions()
    rollout: RolloutOptions = RolloutOptions()
    train: TrainOptions = TrainOptions()
    job: JobOptions = JobOptions()
    e2e: E2EOptions = E2EOptions()
    quality: QualityOptions = QualityOptions()
    scale: ScaleOptions = ScaleOptions()
    cplane: CplaneOptions = CplaneOptions()
    gpu: GpuOptions = GpuOptions()
    learning: LearningOptions = LearningOptions()
    chaos: ChaosOptions = ChaosOptions()

    @classmethod
    def parse(cls, fields: dict[str, Any], overrides: list[str] = ()) -> BenchOptions:
        """Options from top-level fields plus `SECTION.KEY=VALUE` overrides; bad ones raise ConfigError by key."""
        tree = {k: v for k, v in fields.items() if v is not None}
        for item in overrides:
            keys, value = parse_override(item)
            apply_override(tree, keys, value, f"--set {item}")
        try:
            opts = cls.model_validate(tree)
        except ValidationError as e:
            raise ConfigError(format_errors(e, "bench options")) from None
        # Overrides of the runs a suite starts fail here, by key, rather than in a run an hour in.
        for key, config, sets in (
            ("quality.mcprl_sets", opts.e2e.config, opts.quality.mcprl_sets),
            ("learning.sets", opts.learning.config, opts.learning.sets),
        ):
            if sets:
                try:
                    load_config(config, set_items(sets))
                except ConfigError as e:
                    raise ConfigError(f"{key}: {e}") from None
        return opts

    def mcprl_config(self) -> Config:
        """The mcprl config the suites read tools, tasks and the model from (`--config`; built-in defaults)."""
        return load_config(self.config)
