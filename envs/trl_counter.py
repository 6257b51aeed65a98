"""GRPO with TRL on a served counter: a tiny random model whose tool calls are forced.

Run a counter server, then this script::

    gym-sessions serve envs.counter:CounterEnv --workers 4 --port 8000
    HF_HUB_OFFLINE=1 python -m envs.trl_counter http://127.0.0.1:8000

Nothing is downloaded: the model is a 2-layer Qwen2 with random weights made
from a config, the tokenizer a byte-level BPE trained here on a few strings
with TRL's Qwen2.5 chat template (so TRL installs its tool-call parser). A
random model never writes a valid tool call, so `ForcedToolCalls` (a logits
processor the model's ``generate`` gets, inside TRL's own generation) makes
each completion call ``step`` a set number of times and then answer; parsing
the call, running it, appending the result and scoring are TRL's code.
Needs ``pip install 'gym-sessions[trl]'``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from trl.chat_template_utils import qwen2_5_chat_template

__all__ = ["ForcedToolCalls", "force_tool_calls", "main", "tiny_model", "tiny_tokenizer"]

_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TOOL_MARKS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (any text round-trips) with Qwen2.5's chat template and tool marks."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [
        '<tool_call>\n{"name": "step", "arguments": {"action": 3}}\n</tool_call>',
        '{"observation": 13, "reward": 0.0, "terminated": false, "truncated": false, "info": {}}',
        "system user assistant tool You are a helpful assistant. done count 0123456789",
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_tokens(_TOOL_MARKS)
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


def tiny_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Qwen2ForCausalLM:
    """A Qwen2 with random weights: hidden size 64, 2 layers."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


class ForcedToolCalls(LogitsProcessor):
    """Forces each sequence's continuation: a ``step`` call while it has had fewer than
    ``calls`` tool results in this conversation, else the answer ``done``.

    One instance per ``generate`` call: the first call sees the prompt length.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, action: int, calls: int) -> None:
        call = json.dumps({"name": "step", "arguments": {"action": action}})
        text = f"<tool_call>\n{call}\n</tool_call>"
        self._call = tokenizer.encode(text, add_special_tokens=False)
        self._answer = tokenizer.encode("done", add_special_tokens=False)
        self._eos = tokenizer.eos_token_id
        self._response = tokenizer.convert_tokens_to_ids("<tool_response>")
        self._calls = calls
        self._plans: list[list[int]] | None = None
        self._start = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._plans is None:
            self._start = input_ids.shape[1]
            self._plans = [
                (self._call if int((row == self._response).sum()) < self._calls else self._answer)
                + [self._eos]
                for row in input_ids
            ]
        offset = input_ids.shape[1] - self._start
        forced = torch.full_like(scores, -float("inf"))
        for row, plan in enumerate(self._plans):
            forced[row, plan[min(offset, len(plan) - 1)]] = 0.0
        return forced


def force_tool_calls(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, action: int, calls: int
) -> None:
    """Make every ``model.generate`` (as TRL calls it) use `ForcedToolCalls`."""
    generate: Any = model.generate

    def forced_generate(*args: Any, **kwargs: Any) -> Any:
        kwargs["logits_processor"] = LogitsProcessorList(
            [ForcedToolCalls(tokenizer, action, calls)]
        )
        return generate(*args, **kwargs)

    setattr(model, "generate", forced_generate)  # noqa: B010  # nn.Module's __setattr__ typing


def main(argv: Sequence[str] | None = None) -> None:
    """Train 2 GRPO steps on the counter at ``argv[0]`` and print the logged rewards."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from gym_sessions.integrations.trl import environment_class

    url = (list(argv) if argv is not None else sys.argv[1:] or ["http://127.0.0.1:8000"])[0]
    action, calls = 3, 2
    rows = [
        {
            "prompt": [{"role": "user", "content": "Add 3 twice. The count is "}],
            "options": {"initial_count": start, "expected_count": start + action * calls},
        }
        for start in (10, 20)
    ]
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    force_tool_calls(model, tokenizer, action, calls)
    counter = environment_class(url, name="Counter")
    args = GRPOConfig(
        output_dir="/tmp/trl-counter",
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=256,
        max_tool_calling_iterations=calls,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list(rows),
        environment_factory=counter,
    )
    trainer.train()
    counter.close_all()
    for entry in trainer.state.log_history:
        if "rewards/Counter/mean" in entry:
            print(f"step {entry['step']}: reward {entry['rewards/Counter/mean']}")


if __name__ == "__main__":
    main()
