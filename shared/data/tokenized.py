"""Records to token ids with loss targets, cached on disk, with the statistics of the pass.

The training ranks and the plan endpoint run the same code (the API in a child process, as
the tokenizer brings torch in), so a plan's numbers are a real run's. Nothing here imports
transformers: callers pass a loaded tokenizer.

A tokenized dataset is three flat arrays: every sample's ids back to back, a 0/1 target per
token (1 where the token is predicted and counted in the loss), and the sample offsets. The
cache key is (dataset content, tokenizer, format, sequence length, this code's version), so a
re-run or a resume finds the arrays and never tokenizes again; ranks and concurrent jobs
serialise on a file lock, and the first builds what the others then read.

Preference pairs (``shared.data.preference``, for preference tuning) are kept the same way, two
samples a pair (``PreferenceSamples``): the prompt then the chosen answer, the prompt then the
rejected one, the prompt's tokens never targets. The preference recipe reads them with
``prepare_preference_tokenized``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from shared.data.preference import PreferencePair, PreferenceRecords, read_preference_records
from shared.data.records import DatasetFormat, Records, SftFormat, call_arguments, is_trained_turn

logger = logging.getLogger(__name__)

# Bump when the way records become ids or targets changes: old cache entries are then unused.
TOKENIZATION_VERSION = 2  # 2: OpenAI's chat format (tools, tool_calls, developer, weight)
BATCH = 1000  # records per tokenizer call: fast tokenizers work through a batch in parallel


class TokenizationError(ValueError):
    """The records cannot be tokenized as asked (e.g. a chat format without a chat template)."""


class DatasetStats(BaseModel):
    """What the validation pass found. ``tokens`` and ``target_tokens`` count after truncation."""

    format: DatasetFormat
    records: int
    samples: int  # records kept: a record with nothing to predict after truncation is dropped
    tokens: int
    target_tokens: int
    truncated: int  # records longer than max_seq_length, cut to it
    dropped: int
    longest: int  # tokens in the longest record, before truncation
    max_seq_length: int
    cached: bool = False  # found in the cache, not tokenized in this run


@dataclass(frozen=True)
class TokenizedSamples:
    tokens: np.ndarray  # int32, every sample's ids back to back
    targets: np.ndarray  # uint8, 1 where the token is a label
    offsets: np.ndarray  # int64, len(samples) + 1
    # The tokenized cache's key of the whole file these samples are (``cache_key``): what the
    # samples were made from. None for a selection of a file's samples (a validation split).
    key: str | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.tokens[start:end], self.targets[start:end]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def select(self, indices: np.ndarray) -> TokenizedSamples:
        """A new set of the given samples, in that order (used for the validation split)."""
        pieces = [self.sample(int(i)) for i in indices]
        lengths = np.array([len(ids) for ids, _ in pieces], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate([ids for ids, _ in pieces]) if pieces else np.zeros(0, np.int32)
        targets = np.concatenate([t for _, t in pieces]) if pieces else np.zeros(0, np.uint8)
        return TokenizedSamples(tokens.astype(np.int32), targets.astype(np.uint8), offsets)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def dataset_sha256(path: Path, *, memo_dir: Path) -> str:
    """The file's SHA-256, read once per version of the file.

    Every rank of every attempt (and the API's plan) asks; hashing a multi-GB dataset each
    time would hold up every start. A version is (path, size, mtime, inode): a file rewritten
    or replaced gets a new one and so is hashed again.
    """
    st = path.stat()
    version = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    memo = memo_dir / f"{hashlib.sha256(version.encode()).hexdigest()[:32]}.sha256"
    with _locked(memo.with_suffix(".lock")):  # one rank hashes, the others wait and read
        if memo.is_file():
            known = memo.read_text(encoding="ascii").strip()
            if len(known) == 64:
                return known
        digest = file_sha256(path)
        staging = memo.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(digest, encoding="ascii")
        os.replace(staging, memo)
        return digest


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Identifies what the tokenizer does to text: vocabulary, rules, special tokens, template."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps([tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.chat_template]).encode())
    return digest.hexdigest()


# --- records to (ids, targets) ---------------------------------------------------------------


def _text_samples(
    tokenizer: Any, rows: list[dict[str, Any]], where: list[str]
) -> Iterator[tuple[list[int], list[int]]]:
    eos = tokenizer.eos_token_id
    for ids in tokenizer([r["text"] for r in rows], add_special_tokens=True)["input_ids"]:
        # End each sample with EOS so the model learns where a text stops.
        if eos is not None and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        yield ids, [1] * len(ids)


def _prompt_completion_samples(
    tokenizer: Any, rows: list[dict[str, Any]], where: list[str]
) -> Iterator[tuple[list[int], list[int]]]:
    eos = tokenizer.eos_token_id
    prompts = tokenizer([r["prompt"] for r in rows], add_special_tokens=True)["input_ids"]
    completions = tokenizer([r["completion"] for r in rows], add_special_tokens=False)["input_ids"]
    for prompt, completion in zip(prompts, completions, strict=True):
        if eos is not None:
            completion = [*completion, eos]
        yield [*prompt, *completion], [0] * len(prompt) + [1] * len(completion)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """One record message (OpenAI's chat format) as transformers' chat templates take it.

    ``developer`` becomes ``system``, which templates know. A tool call's ``arguments`` become
    the object their JSON text holds: transformers' tool-use guide passes them as a dict, and
    templates write them with ``tojson``, which would quote OpenAI's string a second time.
    Null fields are left out (``content`` of a tool-calling turn), as transformers does.
    ``weight`` is tuneq's to read, not the template's.
    """
    rendered: dict[str, Any] = {"role": "system" if message["role"] == "developer" else message["role"]}
    for name in ("content", "name", "tool_call_id"):
        if message.get(name) is not None:
            rendered[name] = message[name]
    if message.get("tool_calls"):
        rendered["tool_calls"] = [
            {
                **({"id": call["id"]} if call.get("id") is not None else {}),
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": call_arguments(call["function"]["arguments"]),
                },
            }
            for call in message["tool_calls"]
        ]
    return rendered


def _names(template: str, variable: str) -> bool:
    return re.search(rf"(?<!\w){variable}(?!\w)", template) is not None


def _chat_template(tokenizer: Any, tools: list[dict[str, Any]] | None, where: str) -> str:
    """The template source that renders a record with these tools (a tokenizer may keep a
    ``tool_use`` template beside its default one)."""
    try:
        template = tokenizer.get_chat_template(None, tools)
    except ValueError as e:  # several named templates and none is the default
        raise TokenizationError(f"{where}: the model's chat template cannot be chosen ({e})") from None
    assert isinstance(template, str)
    return template


def _refuse_unrendered_tool_use(
    template: str, tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]], where: str
) -> None:
    """A template can only render what it names: the ``tools`` variable, a message's
    ``tool_calls``. One that never names them drops them without an error, and the model would
    learn to answer as if it had called nothing; so such a record is refused."""
    unrendered, unnamed = [], []
    if tools and not _names(template, "tools"):
        unrendered.append("a tools list")
        unnamed.append("tools")
    if any(m.get("tool_calls") for m in messages) and not _names(template, "tool_calls"):
        unrendered.append("tool calls")
        unnamed.append("tool_calls")
    if unrendered:
        raise TokenizationError(
            f"{where} has {' and '.join(unrendered)}, but the model's chat template does not support tools "
            f"(it never mentions {' or '.join(unnamed)}): pick a model whose chat template supports tools, "
            "or drop the tool calls and tools from the dataset"
        )


def assistant_spans(tokenizer: Any, record: dict[str, Any], *, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its trained assistant turns.

    A turn's span is what rendering it adds to the conversation before it (with the
    generation prompt), so the template's own markup around the reply is not trained on, and
    a tool-calling turn's span holds the calls as the template writes them. Turns with
    ``weight: 0`` are rendered but not trained on. ``where`` names the record in errors.
    """
    tools = record.get("tools") or None  # an empty list offers no tools: no tools section
    template = _chat_template(tokenizer, tools, where)
    _refuse_unrendered_tool_use(template, tools, record["messages"], where)
    messages = [template_message(m) for m in record["messages"]]

    def render(upto: int, *, generation_prompt: bool = False) -> str:
        return render_chat(
            tokenizer, messages[:upto], tools=tools, template=template, generation_prompt=generation_prompt, where=where
        )

    full = render(len(messages))
    spans = []
    for i, message in enumerate(record["messages"]):
        if not is_trained_turn(message):
            continue
        before, through = render(i, generation_prompt=True), render(i + 1)
        if not (full.startswith(through) and through.startswith(before)):
            raise TokenizationError(
                f"{where}: the model's chat template does not render a conversation turn by turn, so "
                "assistant turns cannot be found: use the prompt_completion format instead"
            )
        spans.append((len(before), len(through)))
    return full, spans


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    template: str,
    generation_prompt: bool,
    where: str,
) -> str:
    """``messages`` (already in the template's shape: ``template_message``) as the chat template
    writes them, with the assistant's generation prompt after them when asked; "" for none."""
    from jinja2 import TemplateError  # transformers renders chat templates with jinja2

    if not messages:
        return ""
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
        )
    except TemplateError as e:  # the template's raise_exception, or a field it needs and lacks
        raise TokenizationError(
            f"{where} cannot be rendered by the model's chat template ({e}): pick a model whose chat "
            "template takes these roles and fields, or change the record"
        ) from None
    assert isinstance(text, str)
    return text


def _require_chat_template(tokenizer: Any, needed_by: str, instead: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizationError(
            f"the model's tokenizer has no chat template, which {needed_by} needs: use a chat model, or {instead}"
        )


def _messages_samples(
    tokenizer: Any, rows: list[dict[str, Any]], where: list[str]
) -> Iterator[tuple[list[int], list[int]]]:
    _require_chat_template(tokenizer, "the messages format", "the prompt_completion format")
    rendered = [assistant_spans(tokenizer, row, where=at) for row, at in zip(rows, where, strict=True)]
    # The template writes the special tokens (BOS and turn markers) itself.
    encoded = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    for ids, offsets, (_, spans) in zip(encoded["input_ids"], encoded["offset_mapping"], rendered, strict=True):
        targets = [int(any(start <= begin < end for start, end in spans)) for begin, _ in offsets]
        yield list(ids), targets


SAMPLERS = {"text": _text_samples, "prompt_completion": _prompt_completion_samples, "messages": _messages_samples}


def tokenize_records(records: Records, tokenizer: Any, *, max_seq_length: int) -> tuple[TokenizedSamples, DatasetStats]:
    to_samples = SAMPLERS[records.format]
    tokens: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    lengths: list[int] = []
    truncated = dropped = longest = 0
    for start in range(0, len(records.rows), BATCH):
        batch = slice(start, start + BATCH)
        for ids, target in to_samples(tokenizer, records.rows[batch], records.where[batch]):
            longest = max(longest, len(ids))
            if len(ids) > max_seq_length:
                truncated += 1
                ids, target = ids[:max_seq_length], target[:max_seq_length]
            # The first token is never predicted (nothing comes before it).
            if len(ids) < 2 or not any(target[1:]):
                dropped += 1
                continue
            tokens.append(np.asarray(ids, dtype=np.int32))
            targets.append(np.asarray(target, dtype=np.uint8))
            lengths.append(len(ids))
    samples = TokenizedSamples(
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
        targets=np.concatenate(targets) if targets else np.zeros(0, np.uint8),
        offsets=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
    )
    stats = DatasetStats(
        format=records.format,
        records=len(records),
        samples=len(samples),
        tokens=int(samples.tokens.size),
        target_tokens=int(samples.targets.sum()),
        truncated=truncated,
        dropped=dropped,
        longest=longest,
        max_seq_length=max_seq_length,
    )
    return samples, stats


# --- the cache -------------------------------------------------------------------------------

ARRAYS = ("tokens", "targets", "offsets")


def cache_key(*, data_sha256: str, tokenizer: Any, dataset_format: str, max_seq_length: int) -> str:
    parts = {
        "version": TOKENIZATION_VERSION,
        "data": data_sha256,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "format": dataset_format,
        "max_seq_length": max_seq_length,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load(entry: Path) -> tuple[TokenizedSamples, DatasetStats] | None:
    if not (entry / "stats.json").is_file():
        return None
    # Memory-mapped: ranks on one host share the pages instead of holding a copy each.
    arrays = {name: np.load(entry / f"{name}.npy", mmap_mode="r") for name in ARRAYS}
    stats = DatasetStats.model_validate_json((entry / "stats.json").read_text(encoding="utf-8"))
    return TokenizedSamples(**arrays, key=entry.name), stats.model_copy(update={"cached": True})


def _store(entry: Path, samples: TokenizedSamples, stats: DatasetStats) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        for name in ARRAYS:
            np.save(staging / f"{name}.npy", getattr(samples, name))
        (staging / "stats.json").write_text(stats.model_dump_json(), encoding="utf-8")
        os.replace(staging, entry)  # readers see a whole entry or none
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def prepare_tokenized(
    path: Path,
    tokenizer: Any,
    *,
    dataset_format: SftFormat | None,
    max_seq_length: int,
    cache_root: Path,
    max_line_bytes: int,
) -> tuple[TokenizedSamples, DatasetStats]:
    """The dataset's samples from the cache, or read, checked, tokenized and cached now.

    Raises DatasetError for bad records (and for a file of preference records, which SFT
    cannot train on) and TokenizationError for a format the tokenizer cannot serve; both
    carry messages for the user.
    """
    from shared.data.records import detect_sft_format, read_records

    # The format is part of the key; when it is detected, detection is cheap next to hashing.
    # Detected before the cache is looked in: a preference file's entry is never SFT samples.
    chosen = dataset_format or detect_sft_format(path, max_line_bytes=max_line_bytes)

    def tokenize() -> tuple[TokenizedSamples, DatasetStats]:
        records = read_records(path, dataset_format=chosen, max_line_bytes=max_line_bytes)
        return tokenize_records(records, tokenizer, max_seq_length=max_seq_length)

    return _cached(
        path, tokenizer, dataset_format=chosen, max_seq_length=max_seq_length, cache_root=cache_root, build=tokenize
    )


def _cached(
    path: Path,
    tokenizer: Any,
    *,
    dataset_format: DatasetFormat,
    max_seq_length: int,
    cache_root: Path,
    build: Callable[[], tuple[TokenizedSamples, DatasetStats]],
) -> tuple[TokenizedSamples, DatasetStats]:
    """The cache's entry for this file, tokenizer, format and length, or ``build``'s, stored."""
    data_sha256 = dataset_sha256(path, memo_dir=cache_root / "hashes")
    key = cache_key(
        data_sha256=data_sha256, tokenizer=tokenizer, dataset_format=dataset_format, max_seq_length=max_seq_length
    )
    entry = cache_root / key
    with _locked(cache_root / f"{key}.lock"):
        cached = _load(entry)
        if cached is not None:
            logger.info("tokenized %s found in the cache (%s)", path.name, key)
            return cached
        try:
            samples, stats = build()
        except TokenizationError as e:  # named like a DatasetError: "data.jsonl: line 3 ..."
            raise TokenizationError(f"{path.name}: {e}") from None
        _store(entry, samples, stats)
        logger.info("tokenized %s: %d samples, %d tokens (%s)", path.name, stats.samples, stats.tokens, key)
        return replace(samples, key=key), stats


# --- preference pairs ------------------------------------------------------------------------
#
# As TRL's DPOTrainer tokenizes them: the prompt rendered with the generation prompt after it,
# each answer being what rendering prompt + answer adds to that; text pairs as prompt_completion
# is, the prompt with the tokenizer's special tokens and each answer then EOS. The prompt and the
# answers are tokenized apart (as prompt_completion is), so both sequences share the prompt's
# ids exactly; this equals TRL's slicing of the whole whenever the prompt's ids are the start of
# the whole's (TRL warns when they are not). Truncation is TRL's default, truncation_mode
# "keep_start" on max_length: each sequence keeps its first max_seq_length tokens, so the prompt
# is kept whole and the answers lose their ends, and a pair whose prompt leaves no answer token
# (TRL drops a prompt of max_length or more) is dropped.


@dataclass(frozen=True)
class PreferenceSamples:
    """Tokenized preference pairs: ``sequences`` holds two samples per pair, the prompt then the
    chosen answer at ``2 * i`` and the prompt then the rejected answer at ``2 * i + 1``, each
    targeted on its answer's tokens only (the prompt's are masked)."""

    sequences: TokenizedSamples

    def __len__(self) -> int:
        return len(self.sequences) // 2

    def chosen(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The chosen sequence's ids and targets (0 on the prompt, 1 on the answer)."""
        return self.sequences.sample(2 * index)

    def rejected(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.sequences.sample(2 * index + 1)

    def pair(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(prompt ids, chosen answer ids, rejected answer ids), as TRL's DPO columns hold them."""
        chosen, chosen_targets = self.chosen(index)
        rejected, rejected_targets = self.rejected(index)
        prompt_length = len(chosen) - int(chosen_targets.sum())
        return chosen[:prompt_length], chosen[prompt_length:], rejected[len(rejected) - int(rejected_targets.sum()) :]

    def select(self, indices: np.ndarray) -> PreferenceSamples:
        """The given pairs, in that order (a validation split)."""
        rows = np.stack([2 * indices, 2 * indices + 1], axis=1).reshape(-1)
        return PreferenceSamples(self.sequences.select(rows))


def pair_ids(tokenizer: Any, pair: PreferencePair, *, where: str) -> tuple[list[int], list[int], list[int]]:
    """One pair's prompt ids and its two answers' ids, untruncated."""
    if isinstance(pair.prompt, str):
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        prompt = tokenizer(pair.prompt, add_special_tokens=True)["input_ids"]
        chosen, rejected = tokenizer([pair.chosen, pair.rejected], add_special_tokens=False)["input_ids"]
        return list(prompt), [*chosen, *eos], [*rejected, *eos]
    # The template writes the special tokens (BOS and turn markers) itself.
    texts = _pair_texts(tokenizer, pair, where=where)
    prompt, chosen, rejected = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return list(prompt), list(chosen), list(rejected)


def _pair_texts(tokenizer: Any, pair: PreferencePair, *, where: str) -> tuple[str, str, str]:
    """A conversational pair through the chat template: the prompt with the generation prompt,
    and what rendering the prompt and each answer adds to it."""
    assert isinstance(pair.prompt, list) and isinstance(pair.chosen, list) and isinstance(pair.rejected, list)
    template = _chat_template(tokenizer, pair.tools, where)
    _refuse_unrendered_tool_use(template, pair.tools, [*pair.prompt, *pair.chosen, *pair.rejected], where)
    prompt_messages = [template_message(m) for m in pair.prompt]

    def render(messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        return render_chat(
            tokenizer, messages, tools=pair.tools, template=template, generation_prompt=generation_prompt, where=where
        )

    prompt = render(prompt_messages, generation_prompt=True)
    answers = []
    for answer in (pair.chosen, pair.rejected):
        whole = render([*prompt_messages, *(template_message(m) for m in answer)], generation_prompt=False)
        if not whole.startswith(prompt):
            raise TokenizationError(
                f"{where}: the model's chat template does not render the prompt the same with an answer after it, "
                "so the answer cannot be told from the prompt: pick a model whose template renders turn by turn"
            )
        answers.append(whole[len(prompt) :])
    return prompt, answers[0], answers[1]


def tokenize_preference_records(
    records: PreferenceRecords, tokenizer: Any, *, max_seq_length: int
) -> tuple[PreferenceSamples, DatasetStats]:
    """Every pair as two sequences (see ``PreferenceSamples``), truncated to ``max_seq_length``
    as TRL's default truncates. ``DatasetStats`` counts pairs as records and samples, and both
    sequences' tokens; ``truncated`` counts the pairs with a sequence cut."""
    if any(isinstance(p.prompt, list) for p in records.pairs):
        _require_chat_template(tokenizer, "a conversational preference pair", "pairs of text")
    tokens: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    truncated = dropped = longest = 0
    for pair, where in zip(records.pairs, records.where, strict=True):
        prompt, *answers = pair_ids(tokenizer, pair, where=where)
        longest = max(longest, *(len(prompt) + len(answer) for answer in answers))
        room = max_seq_length - len(prompt)
        # The first token is never predicted (nothing comes before it).
        if room <= 0 or (not prompt and min(len(answer) for answer in answers) < 2):
            dropped += 1
            continue
        truncated += any(len(answer) > room for answer in answers)
        for answer in answers:
            kept = answer[:room]
            tokens.append(np.asarray([*prompt, *kept], dtype=np.int32))
            targets.append(np.asarray([0] * len(prompt) + [1] * len(kept), dtype=np.uint8))
    lengths = [len(ids) for ids in tokens]
    sequences = TokenizedSamples(
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
        targets=np.concatenate(targets) if targets else np.zeros(0, np.uint8),
        offsets=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
    )
    stats = DatasetStats(
        format="preference",
        records=len(records),
        samples=len(sequences) // 2,
        tokens=int(sequences.tokens.size),
        target_tokens=int(sequences.targets.sum()),
        truncated=truncated,
        dropped=dropped,
        longest=longest,
        max_seq_length=max_seq_length,
    )
    return PreferenceSamples(sequences), stats


def prepare_preference_tokenized(
    path: Path, tokenizer: Any, *, max_seq_length: int, cache_root: Path, max_line_bytes: int
) -> tuple[PreferenceSamples, DatasetStats]:
    """A preference file's pairs from the tokenized cache (as SFT data is kept, under the format
    ``preference``), or read, checked, tokenized and cached now. Raises DatasetError for bad
    records and TokenizationError for pairs the tokenizer cannot render."""

    def tokenize() -> tuple[TokenizedSamples, DatasetStats]:
        records = read_preference_records(path, max_line_bytes=max_line_bytes)
        samples, stats = tokenize_preference_records(records, tokenizer, max_seq_length=max_seq_length)
        return samples.sequences, stats

    sequences, stats = _cached(
        path,
        tokenizer,
        dataset_format="preference",
        max_seq_length=max_seq_length,
        cache_root=cache_root,
        build=tokenize,
    )
    return PreferenceSamples(sequences), stats
