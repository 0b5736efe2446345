"""TRL's side of suite `e2e`: TRL 1.16's GRPOTrainer on mcprl's work, in its own process.

    python -m bench.trl_baseline --tasks tasks.jsonl --out trl.json [--model smollm2-135m-instruct] [--steps 5] ...

What it shares with `python -m jobs.train --config configs/bench-e2e.yaml`:
- the model (a built-in, loaded as actors/models.py loads it, offline), LoRA r/alpha on q,k,v,o, bf16;
- the task rows (the file the suite wrote) and the offline tool servers, called in this process
  (serve_apps/tool_pool.py LocalToolPool): each tool is a plain callable named `server.tool`, so the
  prompt shows exactly the tool names and compact signatures mcprl shows;
- the prompt: SmolLM2's template with mcprl's tool block in front (envs/chat_template.py, the template
  mcprl exports), which renders TRL's `tools=` as mcprl's env does, and is prefix-preserving as TRL's
  multi-turn loop needs; TRL parses calls with its own `<tool_call>` JSON parser (its Qwen3 response template);
- the reward: each completion is replayed through MCPToolEnv (the same parser, tool calls and heuristic
  reward as an mcprl episode), the episode's reward being the sum of its turns' rewards as in mcprl;
- group size, tasks per step, temperature, lr, clip range (0.2 / 0.28), token-mean loss, no KL.

`--init-adapter DIR` trains a PEFT LoRA folder on (suite `quality` gives it mcprl's warm start) instead of a
fresh adapter; `--save-every N` keeps the adapter every N steps and at the end (`step_<N>/`, after the step's
clock stopped), for `jobs.evaluate --adapter`.

Per step (a TrainerCallback): wall time, episodes, assistant turns per episode, tokens (prompt + completion
of every episode, tool results included, as mcprl's `rollout/episode_tokens` counts them) and the mean
reward; written as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envs.mcp_tool_env import run_sync

TURN_NOTE = "TRL's max_completion_length bounds a whole multi-turn completion, tool results included"


class PoolTool(dict):
    """A tool TRL can both show and call: the dict is the OpenAI function schema the chat template
    renders (mcprl's compacted schema), `__name__` the name TRL dispatches on ("server.tool"), and a
    call runs it on the in-process pool (synchronously: TRL calls sync tools from its training loop)."""

    def __init__(self, definition: dict[str, Any], call: Callable[[str, str, dict[str, Any]], str]) -> None:
        from envs.prompting import _as_function

        super().__init__(_as_function(definition))
        self.__name__ = definition["name"]
        self._server, self._tool = definition["name"].split(".", 1)
        self._call = call

    def __call__(self, **arguments: Any) -> str:
        return self._call(self._server, self._tool, arguments)

    def __hash__(self) -> int:  # TRL keeps tools in lists and compares them by identity
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


def pool_tools(pool: Any, servers: set[str], env_cfg: Any) -> list[PoolTool]:
    """The servers' tools as PoolTools; a result is the text mcprl's env shows as the observation
    (`tasks.observation.result_text`, cut at `env_cfg.max_observation_chars` by the env's own `_message`)."""
    from types import SimpleNamespace

    from envs.mcp_tool_env import MCPToolEnv
    from tasks.inventory import inventory_tools_for_prompt
    from tasks.observation import result_text

    holder = SimpleNamespace(env_cfg=env_cfg)  # all `_message` reads of its env

    def call(server: str, tool: str, arguments: dict[str, Any]) -> str:
        result = run_sync(pool.call_tool(server, tool, arguments))
        return MCPToolEnv._message(holder, result_text(f"{server}.{tool}", result))["content"]

    listing = run_sync(pool.list_tools())
    return [PoolTool(d, call) for d in inventory_tools_for_prompt(listing, servers)]


def assistant_text(message: dict[str, Any]) -> str:
    """A parsed assistant message back to the text the model wrote (calls in mcprl's call syntax)."""
    from envs.parsing import format_tool_call

    calls = [c.get("function", c) for c in message.get("tool_calls") or []]
    return (message.get("content") or "") + "".join(
        format_tool_call(c["name"], c.get("arguments") or {}) for c in calls
    )


def episode_reward(row: dict[str, Any], completion: list[dict[str, Any]], pool: Any, env_config: dict) -> float:
    """mcprl's reward for a TRL completion: its assistant turns played through MCPToolEnv, rewards summed."""
    import math

    from envs.mcp_tool_env import MCPToolEnv

    env = MCPToolEnv(env_config, row, tool_client=pool)
    env.init()
    rewards = []
    try:
        for message in completion:
            if message.get("role") != "assistant":
                continue
            out = env.step(assistant_text(message))
            rewards.append(out["reward"])
            if out["done"]:
                break
    finally:
        env.close()
    return math.fsum(rewards)


def options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.trl_baseline", description=__doc__.splitlines()[0])
    p.add_argument("--tasks", required=True, help="task rows (.jsonl), the file mcprl trains on")
    p.add_argument("--out", required=True, help="JSON file for the per-step figures")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tasks-per-step", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--observation-tokens", type=int, default=512, help="room for tool results in a completion")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--init-adapter", help="a PEFT LoRA folder to train on from (e.g. mcprl's warm start); r/alpha are its own"
    )
    p.add_argument("--save-every", type=int, default=0, help="save the adapter every N steps and at the end (0: never)")
    p.add_argument("--save-dir", help="where --save-every writes step_<N>/ (default: beside --out)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.monotonic()
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from actors.models import load_causal_lm, load_tokenizer
    from actors.precision import compute_dtype
    from configs.schema import BuiltinServers, EnvConfig, ModelConfig, ToolsConfig
    from envs.chat_template import served_chat_template
    from envs.prompting import encode
    from serve_apps.tool_pool import LocalToolPool
    from tasks.io import read_rows

    rows = [r if isinstance(r, dict) else r.model_dump() for r in read_rows(Path(args.tasks))]
    if not rows:
        raise SystemExit(f"error: --tasks {args.tasks}: no task rows")
    servers = {s["server"] for r in rows for s in r["reward_spec"]["ground_truth"]["tool_sequence"]}
    unknown = servers - set(BuiltinServers.model_fields)
    if unknown:
        raise SystemExit(f"error: --tasks {args.tasks}: tasks use servers {sorted(unknown)}; only built-ins can be run")
    tools_cfg = ToolsConfig.model_validate(
        {"servers": {n: {"enabled": n in servers} for n in BuiltinServers.model_fields}}
    )
    pool = run_sync(LocalToolPool.create(tools_cfg))
    env_cfg = EnvConfig()
    tools = pool_tools(pool, servers, env_cfg)
    env_config = {"env": env_cfg, "tools": tools_cfg}

    # The dtype mcprl's learner computes in on this CPU (float32 where torch has no bf16 kernels): the same work.
    args.dtype = compute_dtype(args.dtype)
    model_cfg = ModelConfig(name=args.model, dtype=args.dtype)
    tokenizer = load_tokenizer(model_cfg)
    tokenizer.chat_template = served_chat_template(tokenizer, env_cfg)
    tokenizer.response_template = qwen3_template  # TRL's parser of `<tool_call>{json}</tool_call>` turns
    model = load_causal_lm(model_cfg).train()
    lora = None
    if args.init_adapter:  # trains the warm start's adapter on, as mcprl's finetune.init_adapter does
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.init_adapter, is_trainable=True)
    else:
        lora = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
    save_dir = Path(args.save_dir or Path(args.out).with_suffix("")) if args.save_every else None

    # The row's own messages; the template adds the tool block from `tools=` as mcprl's env does.
    dataset = Dataset.from_list([{"prompt": r["prompt"], "task": json.dumps(r)} for r in rows])
    steps: list[dict[str, Any]] = []
    pending: dict[str, Any] = {"tokens": 0, "episodes": 0, "turns": 0, "rewards": []}

    def prompt_tokens(prompt: list[dict[str, Any]]) -> int:
        return len(
            encode(
                tokenizer,
                tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False),
            )
        )

    def mcprl_reward(prompts: list, completions: list, completion_ids: list, task: list[str], **_: Any) -> list[float]:
        rewards = [episode_reward(json.loads(t), c, pool, env_config) for t, c in zip(task, completions, strict=True)]
        pending["tokens"] += sum(prompt_tokens(p) + len(ids) for p, ids in zip(prompts, completion_ids, strict=True))
        pending["episodes"] += len(completions)
        pending["turns"] += sum(m.get("role") == "assistant" for c in completions for m in c)
        pending["rewards"] += rewards
        return rewards

    class StepTimes(TrainerCallback):
        """Each optimizer step's wall time (generation, tools, reward and update), tokens and rewards."""

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = time.monotonic()

        def on_step_end(self, _args: Any, state: Any, _control: Any, model: Any = None, **k: Any) -> None:
            rewards = pending["rewards"]
            step = {
                "step_s": time.monotonic() - self.t0,
                "episodes": pending["episodes"],
                "tokens": pending["tokens"],
                "turns": pending["turns"] / max(pending["episodes"], 1),
                "reward": sum(rewards) / len(rewards) if rewards else float("nan"),
            }
            n = state.global_step
            if save_dir and (n % args.save_every == 0 or n == args.steps):  # after the step's clock stopped
                model.save_pretrained(save_dir / f"step_{n}")
                step["adapter"] = str(save_dir / f"step_{n}")
            steps.append(step)
            pending.update(tokens=0, episodes=0, turns=0, rewards=[])

    batch = args.tasks_per_step * args.group_size
    config = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix("")) + "-trainer",
        max_steps=args.steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        # One call per turn but the last; each generation may use what is left of the completion budget.
        max_tool_calling_iterations=args.max_turns - 1,
        max_completion_length=args.max_new_tokens * args.max_turns + args.observation_tokens,
        generation_kwargs={"max_new_tokens": args.max_new_tokens},  # per turn, as mcprl's sampling.max_new_tokens
        temperature=args.temperature,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",  # token mean over the batch, as mcprl's loss_reduction "token"
        scale_rewards="group",
        bf16=args.dtype == "bfloat16",
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
        shuffle_dataset=True,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=mcprl_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        tools=tools,
        callbacks=[StepTimes()],
    )
    startup_s = time.monotonic() - t_start
    trainer.train()
    run_sync(pool.close())
    return {
        "startup_s": startup_s,
        "wall_s": time.monotonic() - t_start,
        "generation": "transformers generate (HF, no vLLM), in the trainer's process",
        "dtype": args.dtype,
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> None:
    args = options(argv)
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
