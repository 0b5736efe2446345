"""The chat template as the episode runner needs it: prompt ids, end-of-turn ids, observation deltas.

Tools are shown as the chat template wants them (`envs.prompting`): a template that renders `tools`
gets the episode's definitions as `tools=` in every rendering (prompt and observation deltas alike),
with the env's `tool_prompt` set to "template"; any other gets the env's tool block in the system
message.

Token exactness (see actors/trajectory.py for the layout):
- Generated ids are the engine's, never retokenized; the env reads their decoded text.
- After a turn the sequence must end right after the assistant's end-of-turn token (the template's
  token closing an assistant message; `<|im_end|>` for ChatML). An engine that stopped on EOS has
  generated it (it stays a trained token, mask 1). One that stopped on a stop string
  (`</tool_call>`, kept in the output) or on the length limit has not: the runner appends the
  template's end-of-turn ids, mask 0.
- Observation ids are the chat template's delta: render the conversation up to and with the
  assistant message (the rendering cut right after its end-of-turn token), render it again with
  the observations and the generation prompt; the delta is the ids of the longer text past the
  shorter one. When the end-of-turn is a single special token (ChatML's `<|im_end|>`), tokenizers
  split there before anything else, so the delta text is tokenized alone (cheap: the tests check
  it against the whole conversation's ids). Otherwise both texts are tokenized and the longer's
  ids kept past the shorter's; if those are not a prefix (a token straddles the cut) the delta
  text is tokenized alone (counted in stats as `delta_fallbacks`). The assistant content rendered
  here is the decoded text, which may retokenize differently from the engine's ids; it only
  matters up to the cut, which is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from configs.schema import EnvConfig
from envs import prompting
from envs.prompting import ToolPrompt, tool_prompt_for

_MARK = "\x00MCPRL-ASSISTANT-CONTENT\x00"  # placeholder used once to find the template's turn suffix
Tools = Sequence[dict[str, Any]]  # tool definitions, as `MCPToolEnv.init` returns them in `tool_definitions`


class ChatTemplate:
    """The tokenizer's chat template as the runner needs it: prompt ids, end-of-turn ids, deltas."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        # Where prompts show the tools (EnvConfig.tool_prompt): the template's `tools=` when it renders them.
        self.tool_prompt: ToolPrompt = tool_prompt_for(tokenizer)
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
        rendered = self.render(probe, False)
        suffix = rendered[rendered.index(_MARK) + len(_MARK) :]
        eos = tokenizer.eos_token or ""
        # The end-of-turn text: the template's suffix after the content up to and including EOS
        # ("<|im_end|>"); what follows it ("\n") belongs to the observation delta.
        cut = suffix.find(eos) + len(eos) if eos and eos in suffix else len(suffix)
        self.eot_text = suffix[:cut]
        self.after_eot_text = suffix[cut:]
        self.eot_ids: list[int] = self.encode(self.eot_text)
        self.eos_ids: set[int] = set()
        for ids in (tokenizer.eos_token_id, *self.eot_ids[-1:]):
            if isinstance(ids, int):
                self.eos_ids.add(ids)
        self.delta_fallbacks = 0
        # Tokenizers split text at special tokens before anything else: when the end-of-turn is one,
        # the ids after it depend only on the text after it, so the delta text can be tokenized
        # alone (no re-tokenizing the whole conversation every turn).
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.eot_is_special = len(self.eot_ids) == 1 and self.eot_ids[0] in special

    def render(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool, tools: Tools | None = None
    ) -> str:
        return prompting.render(self.tok, messages, tools, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return prompting.encode(self.tok, text)

    def prompt_ids(self, messages: Sequence[dict[str, Any]], tools: Tools | None = None) -> list[int]:
        """Ids of an episode's first messages (`MCPToolEnv.init`'s) with its `tool_definitions`."""
        return self.encode(self.render(messages, True, tools))

    def ends_turn(self, ids: Sequence[int]) -> bool:
        """Whether generated ids already close the assistant turn (the engine stopped on EOS)."""
        n = len(self.eot_ids)
        return bool(ids) and (ids[-1] in self.eos_ids or (n > 0 and list(ids[-n:]) == self.eot_ids))

    def observation_delta(
        self, before: Sequence[dict[str, Any]], observations: Sequence[dict[str, Any]], tools: Tools | None = None
    ) -> list[int]:
        """Ids after the last assistant message's end-of-turn token, through the next generation prompt.

        `before` ends with that assistant message; `tools`: the episode's, as given to `prompt_ids`.
        """
        base = self.render(before, False, tools)
        if self.after_eot_text and base.endswith(self.after_eot_text):
            base = base[: len(base) - len(self.after_eot_text)]
        full = self.render([*before, *observations], True, tools)
        if not full.startswith(base):
            raise ValueError("chat template is not prefix-stable: the conversation renders differently once extended")
        if self.eot_is_special and base.endswith(self.eot_text):
            return self.encode(full[len(base) :])
        base_ids, full_ids = self.encode(base), self.encode(full)
        if full_ids[: len(base_ids)] == base_ids:
            return full_ids[len(base_ids) :]
        self.delta_fallbacks += 1  # a token straddles the cut: tokenize the delta text alone
        return self.encode(full[len(base) :])


def env_config_for(env: EnvConfig, template: ChatTemplate) -> EnvConfig:
    """`env` with the tool_prompt this chat template needs (its own `tools=` rendering when it has one)."""
    return env.model_copy(update={"tool_prompt": template.tool_prompt})
