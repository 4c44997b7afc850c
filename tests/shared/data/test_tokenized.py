"""Records to ids and targets with the tiny model's real tokenizer, and the tokenized cache."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cli.samples import WEATHER_TOOL, write_messages_dataset
from shared.data import tokenized
from shared.data.preference import PreferencePair, PreferenceRecords, read_preference_records
from shared.data.records import DatasetError, Records, read_records
from shared.data.tokenized import (
    PreferenceSamples,
    TokenizationError,
    TokenizedSamples,
    prepare_preference_tokenized,
    prepare_tokenized,
    tokenize_preference_records,
    tokenize_records,
)
from shared.settings import DEFAULT_MAX_LINE_BYTES
from tests.shared.data.chat_records import OPENAI_CHAT
from tests.shared.data.preference_records import OTHER, PREFERRED, PROMPT, SHAPES


@pytest.fixture(scope="module")
def tokenizer(tiny_model_template: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_template)


def targets_text(tokenizer: Any, ids: np.ndarray, targets: np.ndarray) -> str:
    return str(tokenizer.decode([int(i) for i, t in zip(ids, targets, strict=True) if t]))


def test_text_trains_on_everything_and_ends_with_eos(tokenizer: Any) -> None:
    records = Records(format="text", rows=[{"text": "the cat sees a tree."}], where=["line 1"])
    samples, stats = tokenize_records(records, tokenizer, max_seq_length=64)
    ids, targets = samples.sample(0)
    assert ids[-1] == tokenizer.eos_token_id and targets.all()
    assert tokenizer.decode(ids[:-1]) == "the cat sees a tree."
    assert (stats.records, stats.samples, stats.tokens, stats.target_tokens) == (1, 1, len(ids), len(ids))
    assert stats.truncated == 0 and stats.longest == len(ids)


def test_truncation_and_drops_are_counted(tokenizer: Any) -> None:
    long_text = " ".join(["the cat sees the ball."] * 20)
    records = Records(format="text", rows=[{"text": long_text}, {"text": "a"}], where=["line 1", "line 2"])
    samples, stats = tokenize_records(records, tokenizer, max_seq_length=16)
    assert stats.truncated == 1 and stats.longest > 16
    assert samples.lengths.max() == 16
    # "a" + EOS is two tokens: kept. A record cut to nothing to predict is dropped:
    records = Records(
        format="prompt_completion",
        rows=[{"prompt": long_text, "completion": " yes"}, {"prompt": "who?", "completion": " a dog."}],
        where=["line 1", "line 2"],
    )
    samples, stats = tokenize_records(records, tokenizer, max_seq_length=16)
    assert (stats.records, stats.samples, stats.dropped, stats.truncated) == (2, 1, 1, 1)


def test_prompt_completion_trains_on_the_completion_only(tokenizer: Any) -> None:
    records = Records(
        format="prompt_completion", rows=[{"prompt": "who sees a tree?", "completion": " the cat."}], where=["line 1"]
    )
    samples, stats = tokenize_records(records, tokenizer, max_seq_length=64)
    ids, targets = samples.sample(0)
    assert targets_text(tokenizer, ids, targets) == " the cat.<|endoftext|>"
    assert tokenizer.decode(ids[targets == 0]) == "who sees a tree?"
    assert stats.target_tokens == int(targets.sum()) < stats.tokens


def test_messages_train_on_assistant_turns_only(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "be brief."},
        {"role": "user", "content": "who sees a tree?"},
        {"role": "assistant", "content": "the cat."},
        {"role": "user", "content": "who reads a book?"},
        {"role": "assistant", "content": "my friend."},
    ]
    records = Records(format="messages", rows=[{"messages": messages}], where=["line 1"])
    samples, _ = tokenize_records(records, tokenizer, max_seq_length=256)
    ids, targets = samples.sample(0)
    assert targets_text(tokenizer, ids, targets) == "the cat.<|im_end|>\nmy friend.<|im_end|>\n"
    untrained = tokenizer.decode(ids[targets == 0])
    assert "who sees a tree?" in untrained and "be brief." in untrained and "<|im_start|>assistant" in untrained


def test_messages_need_a_chat_template(tiny_model_template: Path) -> None:
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(tiny_model_template)
    plain.chat_template = None
    records = Records(format="messages", rows=[{"messages": [{"role": "assistant", "content": "x"}]}], where=["line 1"])
    with pytest.raises(TokenizationError, match="no chat template"):
        tokenize_records(records, plain, max_seq_length=64)


# The ChatML template before tool support: it names neither tools nor tool_calls.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenize_chat(tokenizer: Any, *rows: dict[str, Any]) -> TokenizedSamples:
    where = [f"line {i}" for i in range(1, len(rows) + 1)]
    samples, _ = tokenize_records(
        Records(format="messages", rows=list(rows), where=where), tokenizer, max_seq_length=512
    )
    return samples


def test_tool_calls_are_rendered_by_the_template_and_trained_on(tokenizer: Any) -> None:
    ids, targets = tokenize_chat(tokenizer, OPENAI_CHAT).sample(0)
    # The call's arguments reach the template as an object (written once as JSON, not a quoted
    # string); the call is trained on, and so is the answer after the tool's result.
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call><|im_end|>\n'
    assert targets_text(tokenizer, ids, targets) == call + "3 degrees.<|im_end|>\n"
    untrained = tokenizer.decode(ids[targets == 0])
    assert untrained.startswith('<|im_start|>system\n<tools>{"type": "function", "function": {"name": "get_weather"')
    assert "<|im_start|>system\nUse the tools.<|im_end|>" in untrained  # developer, rendered as system
    assert '<|im_start|>tool\n<tool_response id=call_1>{"celsius": 3}</tool_response>' in untrained


def test_a_weight_0_turn_is_not_trained_on_and_a_later_turn_is(tokenizer: Any) -> None:
    ids, targets = tokenize_chat(tokenizer, OPENAI_CHAT).sample(0)
    text = tokenizer.decode(ids)
    unweighted = tokenizer.encode("Let me think.", add_special_tokens=False)
    start = next(i for i in range(len(ids)) if list(ids[i : i + len(unweighted)]) == unweighted)
    assert "Let me think." in text and not targets[start : start + len(unweighted)].any()
    answer = tokenizer.encode("3 degrees.", add_special_tokens=False)
    start = next(i for i in range(len(ids)) if list(ids[i : i + len(answer)]) == answer)
    assert targets[start : start + len(answer)].all()


@pytest.fixture
def plain(tiny_model_template: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_template)
    tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    return tokenizer


def test_a_template_without_tool_support_refuses_tool_records_by_line(plain: Any) -> None:
    conversation = {"messages": [*OPENAI_CHAT["messages"][2:4], {"role": "assistant", "content": "sunny."}]}
    assert len(tokenize_chat(plain, conversation)) == 1  # weights and plain turns need no tool support
    with pytest.raises(TokenizationError) as e:
        tokenize_chat(plain, conversation, OPENAI_CHAT, OPENAI_CHAT)
    assert str(e.value).startswith("line 2 has a tools list and tool calls, but the model's chat template")
    assert "pick a model whose chat template supports tools, or drop the tool calls" in str(e.value)
    calls_only = {"messages": OPENAI_CHAT["messages"]}
    with pytest.raises(TokenizationError, match=r"^line 1 has tool calls, but"):
        tokenize_chat(plain, calls_only)


def test_a_template_that_refuses_a_conversation_names_the_record(plain: Any) -> None:
    plain.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(TokenizationError, match=r"^line 2 cannot be rendered by the model's chat template \(no system"):
        tokenize_chat(plain, {"messages": OPENAI_CHAT["messages"][2:4]}, {"messages": OPENAI_CHAT["messages"][:4]})


def test_the_sample_chat_dataset_trains_with_tool_calls(tokenizer: Any, plain: Any, tmp_path: Path) -> None:
    data = write_messages_dataset(tmp_path / "chat.jsonl", records=8)
    assert sum("tools" in r for r in read_records(data, max_line_bytes=DEFAULT_MAX_LINE_BYTES).rows) == 2
    samples, stats = prepare_tokenized(
        data,
        tokenizer,
        dataset_format=None,
        max_seq_length=512,
        cache_root=tmp_path,
        max_line_bytes=DEFAULT_MAX_LINE_BYTES,
    )
    assert stats.samples == 8 and '"arguments": {"city": ' in targets_text(tokenizer, *samples.sample(3))
    # Named like a bad record: the file, then the line.
    with pytest.raises(TokenizationError, match=r"^chat.jsonl: line 4 has a tools list and tool calls"):
        prepare_tokenized(
            data,
            plain,
            dataset_format=None,
            max_seq_length=512,
            cache_root=tmp_path,
            max_line_bytes=DEFAULT_MAX_LINE_BYTES,
        )


def write_texts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def test_cache_is_hit_by_content_and_missed_on_any_input_change(tokenizer: Any, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    data = write_texts(tmp_path / "a.jsonl", ["the cat sees a tree.", "a dog likes the ball."])
    first, stats = prepare_tokenized(
        data, tokenizer, dataset_format=None, max_seq_length=32, cache_root=cache, max_line_bytes=DEFAULT_MAX_LINE_BYTES
    )
    assert not stats.cached and stats.format == "text"
    copy = write_texts(tmp_path / "elsewhere.jsonl", ["the cat sees a tree.", "a dog likes the ball."])
    again, stats = prepare_tokenized(
        copy, tokenizer, dataset_format=None, max_seq_length=32, cache_root=cache, max_line_bytes=DEFAULT_MAX_LINE_BYTES
    )
    assert stats.cached  # same content under another name
    assert np.array_equal(first.tokens, again.tokens) and np.array_equal(first.offsets, again.offsets)
    _, stats = prepare_tokenized(
        copy, tokenizer, dataset_format=None, max_seq_length=8, cache_root=cache, max_line_bytes=DEFAULT_MAX_LINE_BYTES
    )
    assert not stats.cached  # another sequence length
    write_texts(copy, ["the cat sees a tree."])
    _, stats = prepare_tokenized(
        copy, tokenizer, dataset_format=None, max_seq_length=32, cache_root=cache, max_line_bytes=DEFAULT_MAX_LINE_BYTES
    )
    assert not stats.cached and stats.records == 1  # other content
    entries = [p for p in cache.iterdir() if p.is_dir() and p.name != "hashes"]  # hashes: the sha memo
    assert len(entries) == 3 and not any(p.name.startswith(".") for p in entries)


def _prepare_in_child(args: tuple[str, str, str]) -> tuple[bool, list[int]]:
    from transformers import AutoTokenizer

    model, data, cache = args
    tok = AutoTokenizer.from_pretrained(model)
    samples, stats = prepare_tokenized(
        Path(data),
        tok,
        dataset_format="text",
        max_seq_length=32,
        cache_root=Path(cache),
        max_line_bytes=DEFAULT_MAX_LINE_BYTES,
    )
    return stats.cached, samples.tokens.tolist()


def test_concurrent_preparers_tokenize_once(tiny_model_template: Path, tmp_path: Path) -> None:
    data = write_texts(tmp_path / "d.jsonl", [f"the cat sees {i} trees." for i in range(2000)])
    args = (str(tiny_model_template), str(data), str(tmp_path / "cache"))
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        results = pool.map(_prepare_in_child, [args] * 3)
    assert sorted(cached for cached, _ in results) == [False, True, True]
    assert results[0][1] == results[1][1] == results[2][1]


def test_records_and_stats_agree_with_the_reader(tokenizer: Any, tmp_path: Path) -> None:
    data = write_texts(tmp_path / "d.jsonl", ["a b c", "the cat."])
    records = read_records(data, max_line_bytes=DEFAULT_MAX_LINE_BYTES)
    samples, stats = tokenize_records(records, tokenizer, max_seq_length=32)
    assert stats.samples == len(samples) == 2 and stats.tokens == int(samples.lengths.sum())


def test_a_dataset_is_hashed_once_per_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "one"}\n')
    hashed: list[Path] = []
    real = tokenized.file_sha256
    monkeypatch.setattr(tokenized, "file_sha256", lambda p: hashed.append(p) or real(p))
    memo = tmp_path / "hashes"
    first = tokenized.dataset_sha256(data, memo_dir=memo)
    assert tokenized.dataset_sha256(data, memo_dir=memo) == first == hashlib.sha256(data.read_bytes()).hexdigest()
    assert len(hashed) == 1  # the second rank (or attempt) read the memo
    data.write_text('{"text": "three"}\n')  # rewritten: a new version
    assert tokenized.dataset_sha256(data, memo_dir=memo) == hashlib.sha256(data.read_bytes()).hexdigest()
    assert len(hashed) == 2


# --- preference pairs ------------------------------------------------------------------------


def tokenize_pairs(tokenizer: Any, *pairs: PreferencePair, max_seq_length: int = 256) -> PreferenceSamples:
    records = PreferenceRecords(shape="trl", pairs=list(pairs), where=[f"line {i}" for i in range(1, len(pairs) + 1)])
    samples, _ = tokenize_preference_records(records, tokenizer, max_seq_length=max_seq_length)
    return samples


def test_a_conversational_pair_is_two_sequences_masked_on_the_prompt(tokenizer: Any) -> None:
    prompt = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "who sees a tree?"}]
    chosen, rejected = [{"role": "assistant", "content": "the cat."}], [{"role": "assistant", "content": "a dog."}]
    samples = tokenize_pairs(tokenizer, PreferencePair(prompt, chosen, rejected))
    assert len(samples) == 1 and len(samples.sequences) == 2
    for (ids, targets), answer in ((samples.chosen(0), chosen), (samples.rejected(0), rejected)):
        # The answer's tokens are exactly those of the assistant turn, as the messages format trains it.
        sft = tokenize_chat(tokenizer, {"messages": prompt + answer})
        assert np.array_equal(ids, sft.sample(0)[0]) and np.array_equal(targets, sft.sample(0)[1])
        assert targets_text(tokenizer, ids, targets) == f"{answer[0]['content']}<|im_end|>\n"
        assert tokenizer.decode(ids[targets == 0]).endswith("who sees a tree?<|im_end|>\n<|im_start|>assistant\n")
    prompt_ids, chosen_ids, rejected_ids = samples.pair(0)
    assert (
        tokenizer.decode(chosen_ids) == "the cat.<|im_end|>\n"
        and tokenizer.decode(rejected_ids) == "a dog.<|im_end|>\n"
    )
    assert np.array_equal(samples.chosen(0)[0], np.concatenate([prompt_ids, chosen_ids]))


def test_the_same_pair_in_openai_s_and_trl_s_shapes_renders_identically(tokenizer: Any, tmp_path: Path) -> None:
    rendered = []
    for shape, record in SHAPES.items():
        path = tmp_path / f"{shape}.jsonl"
        path.write_text(json.dumps(record) + "\n", encoding="utf-8")
        samples, stats = tokenize_preference_records(
            read_preference_records(path, max_line_bytes=DEFAULT_MAX_LINE_BYTES), tokenizer, max_seq_length=512
        )
        rendered.append((samples.sequences.tokens.tolist(), samples.sequences.targets.tolist(), stats))
    assert rendered[0] == rendered[1] == rendered[2] and rendered[0][2].samples == 1
    samples = tokenize_pairs(tokenizer, PreferencePair(PROMPT, PREFERRED, OTHER, [WEATHER_TOOL]), max_seq_length=512)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call><|im_end|>\n'
    assert targets_text(tokenizer, *samples.chosen(0)) == call
    assert targets_text(tokenizer, *samples.rejected(0)) == "It is sunny.<|im_end|>\n"
    assert tokenizer.decode(samples.pair(0)[0]).startswith('<|im_start|>system\n<tools>{"type": "function"')


def test_a_text_pair_is_prompt_then_answer_and_eos(tokenizer: Any) -> None:
    samples = tokenize_pairs(tokenizer, PreferencePair("who sees a tree?", " the cat.", " a dog."))
    ids, targets = samples.chosen(0)
    assert targets_text(tokenizer, ids, targets) == " the cat.<|endoftext|>"
    assert tokenizer.decode(ids[targets == 0]) == "who sees a tree?"
    assert targets_text(tokenizer, *samples.rejected(0)) == " a dog.<|endoftext|>"


def test_truncation_keeps_the_prompt_and_the_answers_start_and_drops_a_pair_with_no_room(tokenizer: Any) -> None:
    long_answer = " " + " ".join(["the cat sees the ball."] * 20)
    kept = PreferencePair("who sees a tree?", long_answer, " a dog.")
    no_room = PreferencePair(" ".join(["the cat sees the ball."] * 20), " yes.", " no.")
    records = PreferenceRecords(shape="trl", pairs=[kept, no_room], where=["line 1", "line 2"])
    samples, stats = tokenize_preference_records(records, tokenizer, max_seq_length=16)
    assert (stats.records, stats.samples, stats.truncated, stats.dropped) == (2, 1, 1, 1)
    assert stats.longest > 16 and samples.sequences.lengths.max() == 16
    prompt, chosen, rejected = samples.pair(0)
    assert tokenizer.decode(prompt) == "who sees a tree?"  # whole
    assert len(prompt) + len(chosen) == 16 and tokenizer.decode(chosen) == tokenizer.decode(
        tokenizer.encode(long_answer, add_special_tokens=False)[: 16 - len(prompt)]
    )
    assert tokenizer.decode(rejected) == " a dog.<|endoftext|>"  # short enough: untouched
    assert stats.tokens == int(samples.sequences.lengths.sum()) and stats.target_tokens == len(chosen) + len(rejected)


def test_a_template_without_tool_support_refuses_a_pair_with_tool_calls(plain: Any) -> None:
    with pytest.raises(TokenizationError, match=r"^line 1 has a tools list and tool calls, but the model's chat"):
        tokenize_pairs(plain, PreferencePair(PROMPT, PREFERRED, OTHER, [WEATHER_TOOL]))


def test_pairs_are_cached_and_an_sft_job_never_reads_them(tokenizer: Any, tmp_path: Path) -> None:
    data = tmp_path / "pairs.jsonl"
    pairs = [{"prompt": f"who sees {'a ' * i}tree?", "chosen": " the cat.", "rejected": " a dog."} for i in range(3)]
    data.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    prepare = {"max_seq_length": 64, "cache_root": tmp_path / "cache", "max_line_bytes": DEFAULT_MAX_LINE_BYTES}
    first, stats = prepare_preference_tokenized(data, tokenizer, **prepare)
    assert not stats.cached and stats.format == "preference" and len(first) == stats.samples == 3
    again, stats = prepare_preference_tokenized(data, tokenizer, **prepare)
    assert stats.cached and np.array_equal(first.sequences.tokens, again.sequences.tokens)
    picked = again.select(np.array([2, 0]))
    assert len(picked) == 2 and all(
        np.array_equal(a, b)
        for a, b in zip(picked.pair(0) + picked.pair(1), first.pair(2) + first.pair(0), strict=True)
    )
    assert not np.array_equal(first.pair(2)[0], first.pair(0)[0])
    # The pairs are in the cache now; an SFT job on the same file still refuses it, naming the method.
    with pytest.raises(DatasetError, match=r"^pairs.jsonl holds preference records .* for preference tuning \(DPO\)"):
        prepare_tokenized(data, tokenizer, dataset_format=None, **prepare)
