"""Chat templates, read by training and by serving alike: the ChatML template of the tokenizers
we train, rendering conversations with a tokenizer's template and the assistant spans the loss
covers (docs/METHOD.md §1.3: from after the assistant header through the end-of-turn string),
and generation prompts (docs/METHOD.md §6.1).

Conversations and messages are duck-typed (`train.data.Conversation` / `Message` or anything with
`as_dicts()` / `role` and `content`), so this module needs nothing but numpy.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# The chat template of the byte-level BPE tokenizers train/tokenizer.py trains (ChatML).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# ------------------------------------------------------------------------------------------------
# Rendering and the supervised spans (docs/METHOD.md §1.3)


@dataclasses.dataclass(frozen=True)
class RenderConfig:
    """How conversations become training sequences.

    max_length: right-truncation length in tokens (docs/METHOD.md §1.3: 4096; the demo: 256–512).
    min_loss_tokens: samples with fewer supervised tokens are dropped (docs/METHOD.md §1.3: 14).
    enable_thinking: passed to the chat template; ``None`` passes nothing (template default).
    default_system_prompt: inserted when a conversation has no system message (Qwen3 reference:
        "You are a helpful assistant."; our tiny tokenizer: none).
    assistant_header / end_of_turn: the strings that open and close an assistant turn in the
        rendered text; the mask runs from after the header to and including the end of turn.
    assistant_content_prefix: prepended to every assistant content and skipped by the mask
        (Gemma4's empty thought channel); empty for ChatML templates.
    """

    max_length: int = 4096
    min_loss_tokens: int = 14
    enable_thinking: bool | None = False
    default_system_prompt: str | None = None
    assistant_header: str = "<|im_start|>assistant\n"
    end_of_turn: str = "<|im_end|>\n"
    assistant_content_prefix: str = ""

    def __post_init__(self):
        if self.max_length < 1:
            raise ValueError(f"RenderConfig.max_length must be ≥ 1, got {self.max_length}")
        if self.min_loss_tokens < 0:
            raise ValueError(
                f"RenderConfig.min_loss_tokens must be ≥ 0, got {self.min_loss_tokens}"
            )
        if not self.assistant_header or not self.end_of_turn:
            raise ValueError("RenderConfig.assistant_header and end_of_turn must be non-empty")

    @classmethod
    def qwen3(cls, **overrides: Any) -> RenderConfig:
        """The reference Qwen3 setting: default system prompt, 4096 tokens, ≥ 14 loss tokens."""
        return cls(**{"default_system_prompt": "You are a helpful assistant.", **overrides})

    @classmethod
    def gemma4(cls, **overrides: Any) -> RenderConfig:
        """The reference Gemma4 setting: no system prompt, model turns, empty thought channel."""
        base = {
            "assistant_header": "<|turn>model\n",
            "end_of_turn": "<turn|>\n",
            "assistant_content_prefix": "<|channel>thought\n<channel|>",
        }
        return cls(**{**base, **overrides})

    @classmethod
    def for_target(cls, architecture: str | None, **overrides: Any) -> RenderConfig:
        """The reference setting of a target checkpoint by its `TargetConfig.architecture`:
        "gemma4" -> `gemma4()`, "qwen3" / "qwen2" -> `qwen3()`; other checkpoints and None (the
        target the demo trains on its ChatML tokenizer) -> ChatML without a system prompt."""
        if architecture == "gemma4":
            return cls.gemma4(**overrides)
        if architecture in ("qwen3", "qwen2"):
            return cls.qwen3(**overrides)
        return cls(**overrides)


def _template_kwargs(enable_thinking: bool | None) -> dict[str, Any]:
    return {} if enable_thinking is None else {"enable_thinking": enable_thinking}


def render_conversation(tokenizer: Any, conversation: Any, cfg: RenderConfig) -> str:
    """The full training text: system prompt rule, content prefix, chat template, no gen prompt."""
    messages = conversation.as_dicts()
    if cfg.default_system_prompt is not None and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": cfg.default_system_prompt})
    if cfg.assistant_content_prefix:
        pre = cfg.assistant_content_prefix
        for m in messages:
            if m["role"] == "assistant" and not m["content"].startswith(pre):
                m["content"] = pre + m["content"]
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=False,
        **_template_kwargs(cfg.enable_thinking),
    )


def assistant_char_spans(text: str, cfg: RenderConfig) -> list[tuple[int, int]]:
    """Character spans `[start, end)` of supervised text: after each assistant header (and the
    optional content prefix) up to and including the next end-of-turn string, or to end of text."""
    pattern = (
        re.escape(cfg.assistant_header)
        + (
            f"(?:{re.escape(cfg.assistant_content_prefix)})?"
            if cfg.assistant_content_prefix
            else ""
        )
        + r"(.*?)(?:"
        + re.escape(cfg.end_of_turn)
        + r"|\Z)"
    )
    return [(m.start(1), m.end()) for m in re.finditer(pattern, text, flags=re.DOTALL)]


# ------------------------------------------------------------------------------------------------
# Prompts for generation / evaluation


def _as_messages(prompt: str | Sequence[Any]) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    out = []
    for m in prompt:
        if isinstance(m, Mapping) and "role" in m and "content" in m:
            out.append({"role": m["role"], "content": m["content"]})
        elif hasattr(m, "role") and hasattr(m, "content"):  # train.data.Message
            out.append({"role": m.role, "content": m.content})
        else:
            raise TypeError(
                "format_prompt takes a user message string or a list of {role, content} messages; "
                f"got an element of type {type(m).__name__}"
            )
    if not out or out[-1]["role"] != "user":
        raise ValueError("format_prompt: the message list must end with a user message")
    return out


def format_prompt(
    tokenizer: Any, prompt: str | Sequence[Any], *, enable_thinking: bool | None = False
) -> str:
    """Generation prompt text (docs/METHOD.md §6.1): the chat template over one user message (or a
    running message list ending in a user turn, for multi-turn), `add_generation_prompt=True`,
    no system prompt added."""
    return tokenizer.apply_chat_template(
        _as_messages(prompt),
        tokenize=False,
        add_generation_prompt=True,
        **_template_kwargs(enable_thinking),
    )


def encode_prompt(
    tokenizer: Any, prompt: str | Sequence[Any], *, enable_thinking: bool | None = False
) -> np.ndarray:
    """`format_prompt` tokenized without extra special tokens → int32 [T]."""
    text = format_prompt(tokenizer, prompt, enable_thinking=enable_thinking)
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
