"""Load the configured rollout engine, generate 16 tokens from a short chat prompt, print what came back.

python -m jobs.engine_check [--config FILE] [--set rollout.backend=hf] [--prompt TEXT] [--tokens N]

Prints the backend, the token count, whether logprobs came back, the load time and the generation
time. Exit status: 0 it generated; 1 the engine failed; 2 a usage error (bad config).
"""

from __future__ import annotations

import asyncio
import math
import sys
import time

from configs.schema import Config
from jobs.cli import base_parser, setup


async def check(cfg: Config, prompt: str, tokens: int) -> int:
    from actors.engine_api import EngineError, choose_backend
    from actors.engines import make_engine
    from actors.models import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if not isinstance(prompt_ids, list):  # some tokenizers return a BatchEncoding
        prompt_ids = list(prompt_ids["input_ids"])
    sampling = cfg.rollout.sampling.model_copy(update={"max_new_tokens": tokens})
    engine = make_engine(cfg)
    t0 = time.monotonic()
    try:
        await engine.start()
        load_s = time.monotonic() - t0
        t1 = time.monotonic()
        gen = await engine.generate(list(prompt_ids), sampling)
        gen_s = time.monotonic() - t1
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        await engine.shutdown()
    good = len(gen.logprobs) == len(gen.token_ids) and all(math.isfinite(x) for x in gen.logprobs)
    print(f"backend:        {choose_backend(cfg)}")
    print(f"model:          {cfg.model.name}")
    print(f"prompt tokens:  {len(prompt_ids)}")
    print(f"tokens:         {len(gen.token_ids)} (finish: {gen.finish_reason})")
    print(f"logprobs:       {'yes' if good else 'no'} (missing {gen.missing_logprobs})")
    print(f"load time:      {load_s:.2f} s")
    print(f"generate time:  {gen_s:.2f} s")
    print(f"text:           {tokenizer.decode(gen.token_ids)!r}")
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="What is the capital of France?", help="the user message")
    parser.add_argument("--tokens", type=int, default=16, help="max new tokens")
    args = parser.parse_args(argv)
    cfg = setup(args)
    sys.exit(asyncio.run(check(cfg, args.prompt, args.tokens)))


if __name__ == "__main__":
    main()
