"""Play one step of MCPToolEnv on a task row and print what the env returns.

python -m jobs.env_check --tasks FILE [--row N] [--action TEXT] [--config ...] [--set ...]

The env is built from row N (default 0) with the configured servers in this process (a
LocalToolPool, no Ray), `init()` is called, then one `step()` with the action: by default a
plain-JSON call, with no arguments, of the task's first expected tool (the one `must_call_tool`
names, or, when it names only a server, the first step's tool): `{"tool": "server.tool",
"arguments": {}}`. Prints reward, done, the observation keys and the reward components.
Exit status: 0 it ran; 2 a usage error (no such file, bad row number, a row the env rejects, bad config).
"""

from __future__ import annotations

import json
from pathlib import Path

from jobs.cli import base_parser, setup, usage_error
from tasks.io import FORMATS, TaskFileError, read_rows
from tasks.schema import GroundTruth


def default_action(ground_truth: GroundTruth) -> str:
    """A plain-JSON call, without arguments, of the first step's tool: the one must_call_tool asks for
    (its `server.tool`, or a tool of its `server`; the model checks that the first step is it)."""
    first = ground_truth.tool_sequence[0]
    return json.dumps({"tool": f"{first.server}.{first.tool}", "arguments": {}})


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tasks", required=True, metavar="FILE", help=f"task file ({', '.join(FORMATS)})")
    parser.add_argument("--row", type=int, default=0, help="which row (0-based)")
    parser.add_argument("--action", help="the model turn to step with (default: a call of the first step's tool)")
    args = parser.parse_args(argv)
    cfg = setup(args)

    path = Path(args.tasks)
    if not path.is_file():
        usage_error(f"{path}: no such file")
    try:
        rows = read_rows(path)
    except TaskFileError as e:
        usage_error(str(e))
    if not 0 <= args.row < len(rows):
        usage_error(f"{path}: no row {args.row} (the file has {len(rows)})")
    row = rows[args.row]

    import envs
    from envs.mcp_tool_env import MCPToolEnv, run_sync
    from serve_apps.tool_pool import LocalToolPool

    envs.register_env()  # as a SkyRL trainer would, though the env is built directly below
    pool = run_sync(LocalToolPool.create(cfg.tools))
    try:
        try:
            env = MCPToolEnv(cfg, row, tool_client=pool)
        except (ValueError, KeyError, TypeError) as e:
            usage_error(f"{path}: row {args.row} cannot make an env: {e}")
        conversation, init_meta = env.init(row.get("prompt"))
        action = args.action if args.action is not None else default_action(env.ground_truth)
        out = env.step(action)
        env.close()
    finally:
        run_sync(pool.close())

    meta = out["metadata"]
    print(f"task: {init_meta['task_id']}  (max_turns {init_meta['max_turns']}, {len(init_meta['tools'])} tools shown)")
    print(f"prompt: {len(conversation)} messages, {sum(len(m['content']) for m in conversation):,} characters")
    print(f"action: {action[:300]}")
    print(f"reward: {out['reward']:+.3f}")
    print(f"done: {out['done']}" + (f" ({meta.get('done_reason')})" if out["done"] else ""))
    for i, obs in enumerate(out["observations"]):
        print(f"observation {i}: keys {sorted(obs)}; role {obs['role']}; {obs['content'][:200]!r}")
    if not out["observations"]:
        print("observations: none")
    for call in meta.get("calls", []):
        print(f"call: {call['name']} ok={call['ok']} error_kind={call['error_kind']} infra_fault={call['infra_fault']}")
    for err in meta.get("parse_errors", []):
        print(f"parse error ({err['kind']}): {err['message']}")
    components = {k: v for k, v in meta.get("reward_components", {}).items() if v}
    print("reward components: " + (", ".join(f"{k} {v:+.2f}" for k, v in components.items()) or "all zero"))


if __name__ == "__main__":
    main()
