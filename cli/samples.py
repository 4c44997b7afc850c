"""A tiny GPT-Neo-shaped model, tokenizer and dataset, built locally (no hub downloads).

Used by ``tuneq demo`` and by the tests. transformers and tokenizers are imported inside the
functions: ``shared`` must stay light at import time.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED_DEEPSPEED_CONFIG: dict[str, object] = {
    "train_batch_size": 1,
    "fp16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "fast_init": True},
    },
    "optimizer": {"type": "Adam", "params": {"lr": 3e-05, "betas": [0.9, 0.999], "eps": 1e-8}},
}

# A ChatML-style template that supports tools, so the tiny model can train on every kind of
# chat record: the tools offered in a system turn first, tool calls as JSON after an assistant's
# content, a tool's result with the id of the call it answers. Conversations without tools render
# as plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['tool_call_id'] is defined %}<tool_response id={{ message['tool_call_id'] }}>{% endif %}"
    "{% if message['content'] is defined %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_call_id'] is defined %}</tool_response>{% endif %}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_TOOL: dict[str, object] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

_SUBJECTS = ["the cat", "a dog", "the model", "my friend", "the engine", "a bird", "the teacher", "our team"]
_VERBS = ["sees", "likes", "trains", "finds", "builds", "reads", "follows", "paints"]
_OBJECTS = ["the ball", "a tree", "the data", "a song", "the river", "a book", "the light", "a plan"]


def seed_config(*, fp16: bool, train_batch_size: int = 1, zero_stage: int = 2, lr: float = 3e-5) -> dict[str, object]:
    """The core issue's reference config, with the knobs tests and the demo need to vary."""
    config = json.loads(json.dumps(SEED_DEEPSPEED_CONFIG))
    config["fp16"] = {"enabled": fp16}
    config["train_batch_size"] = train_batch_size
    config["zero_optimization"]["stage"] = zero_stage
    config["optimizer"]["params"]["lr"] = lr
    return config


def sample_texts(n: int, *, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}." for _ in range(rng.randint(1, 3))
        )
        for _ in range(n)
    ]


def write_text_dataset(path: Path, *, records: int = 64, seed: int = 0, vary: bool = True) -> Path:
    """JSON Lines of short sentences; ``vary=False`` repeats one, so loss falls with no noise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    texts = sample_texts(records, seed=seed) if vary else sample_texts(1, seed=seed) * records
    with path.open("w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return path


def write_prompt_completion_dataset(path: Path, *, records: int = 64, seed: int = 0) -> Path:
    """Questions and answers: the completion repeats the prompt's subject, so it can be learned."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(records):
            subject, verb, obj = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
            f.write(json.dumps({"prompt": f"who {verb} {obj}?", "completion": f" {subject} {verb} {obj}."}) + "\n")
    return path


def write_messages_dataset(path: Path, *, records: int = 64, seed: int = 0) -> Path:
    """Conversations of a system, a user and an assistant turn, sometimes two rounds; every
    fourth is OpenAI's tool-calling kind (``weather_conversation``)."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for index in range(records):
            if index % 4 == 3:
                f.write(json.dumps(weather_conversation(rng)) + "\n")
                continue
            messages = [{"role": "system", "content": "answer briefly."}]
            for _ in range(rng.randint(1, 2)):
                subject, verb, obj = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
                messages.append({"role": "user", "content": f"who {verb} {obj}?"})
                messages.append({"role": "assistant", "content": f"{subject} {verb} {obj}."})
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def write_preference_dataset(path: Path, *, records: int = 64, seed: int = 0, shape: str = "trl") -> Path:
    """Preference pairs with a signal a tiny model learns in a few steps: the same answer,
    ended politely (preferred) or rudely. ``shape``: TRL's text form (``prompt``, ``chosen``,
    ``rejected``) or OpenAI's DPO format (``openai``), where every fourth pair prefers calling
    the weather tool to guessing."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for index in range(records):
            subject, verb, obj = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
            prompt, answer = f"who {verb} {obj}?", f" {subject} {verb} {obj}"
            if shape == "trl":
                record: dict[str, object] = {
                    "prompt": prompt,
                    "chosen": f"{answer}, thank you.",
                    "rejected": f"{answer}, go away.",
                }
            elif index % 4 == 3:
                record = _weather_preference(rng)
            else:
                record = {
                    "input": {"messages": [{"role": "user", "content": prompt}]},
                    "preferred_output": [{"role": "assistant", "content": f"{answer.strip()}, thank you."}],
                    "non_preferred_output": [{"role": "assistant", "content": f"{answer.strip()}, go away."}],
                }
            f.write(json.dumps(record) + "\n")
    return path


def _weather_preference(rng: random.Random) -> dict[str, object]:
    city = rng.choice(["Oslo", "Lima", "Pune", "Kyiv"])
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    return {
        "input": {"messages": [{"role": "user", "content": f"weather in {city}?"}], "tools": [WEATHER_TOOL]},
        "preferred_output": [{"role": "assistant", "content": None, "tool_calls": [call]}],
        "non_preferred_output": [{"role": "assistant", "content": f"it is sunny in {city}, go away."}],
    }


def weather_conversation(rng: random.Random) -> dict[str, object]:
    """A chat record with everything OpenAI's chat format has: a developer message, a turn not
    trained on (``weight: 0``), a tool call (``content: null``) and its result, and the tools."""
    city, celsius = rng.choice(["Oslo", "Lima", "Pune", "Kyiv"]), rng.randint(-5, 30)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    return {
        "messages": [
            {"role": "system", "content": "answer briefly."},
            {"role": "developer", "content": "use the tools."},
            {"role": "user", "content": f"weather in {city}?"},
            {"role": "assistant", "content": "let me see.", "weight": 0},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"celsius": celsius})},
            {"role": "assistant", "content": f"{celsius} degrees in {city}."},
        ],
        "tools": [WEATHER_TOOL],
    }


def build_tiny_model(
    directory: Path,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    seed: int = 0,
    heads: int = 4,
    vocab_size: int | None = None,
    max_positions: int = 256,
    window_size: int = 64,
) -> Path:
    """A randomly initialised GPT-Neo with a BPE tokenizer trained on the sample texts.

    The defaults make a model small enough for any test; the GPU benchmark passes GPT-Neo
    2.7B's shape (``vocab_size`` larger than the tokenizer's is allowed: ids stay below it).
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from tokenizers import decoders as tok_decoders
    from transformers import GPTNeoConfig, GPTNeoForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as transformers_logging

    torch.manual_seed(seed)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tok_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, so no text is <unk>
        show_progress=False,  # its bars, or a blank line each where stdout is no terminal
    )
    tokenizer.train_from_iterator(sample_texts(500, seed=seed), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    eos_id = tokenizer.token_to_id("<|endoftext|>")
    config = GPTNeoConfig(
        vocab_size=max(vocab_size or 0, tokenizer.get_vocab_size()),
        hidden_size=hidden_size,
        num_layers=layers,
        num_heads=heads,
        attention_types=[[["global", "local"], layers // 2 or 1]],
        max_position_embeddings=max_positions,
        intermediate_size=hidden_size * 4,
        window_size=window_size,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    model = GPTNeoForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # "Writing model shards", for a file of a few MB
    try:
        model.save_pretrained(directory)
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
    fast.save_pretrained(directory)
    return directory
