"""``kvrl/math-v0``: verifiable math problems from one local JSONL or parquet file.

Each row becomes a :class:`~kvrl.envs.Task`; the column layout is recognised per row:

=============  =============================  ==========================================
layout         question column                answer column
=============  =============================  ==========================================
generic        ``question``                   ``answer``
GSM8K          ``question``                   ``answer``, final answer after ``####``
MATH-500       ``problem``                    ``answer``, else last ``\\boxed{}`` of ``solution``
AIME           ``problem`` / ``Problem``      ``answer`` / ``Answer``
DeepScaleR     ``problem``                    ``answer`` (``solution`` ignored)
=============  =============================  ==========================================

The id comes from ``id`` / ``ID`` / ``unique_id``, else ``{file stem}-{row}``. A malformed
row raises ``ValueError`` naming ``file:line`` and what is missing.

Rewards: ``correct`` (weight 1): math-verify equality of the gold answer and the last
``\\boxed{}`` of the completion (0 without one; ``info["verify_timeout"]`` says whether
checking timed out); ``has_boxed`` (weight 0, a metric only).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvrl.envs.base import Reward, Task, TextEnv
from kvrl.envs.verify import check_answer, extract_boxed

FIXTURE = Path(__file__).parent / "data" / "math_fixture.jsonl"
DEFAULT_TEMPLATE = "{question}\nPut the final answer in \\boxed{}."

QUESTION_KEYS = ("question", "problem", "Problem", "Question")
ANSWER_KEYS = ("answer", "Answer")
ID_KEYS = ("id", "ID", "unique_id")
ACCEPTED = (
    f"question: one of {list(QUESTION_KEYS)}; answer: one of {list(ANSWER_KEYS)} "
    "(GSM8K: after '####') or a 'solution' containing \\boxed{...}; id (optional): "
    f"one of {list(ID_KEYS)}"
)


class MathEnv(TextEnv):
    """Math word problems with a math-verify reward.

    Parameters
    ----------
    path : str | Path, optional
        A ``.jsonl`` / ``.json`` (one object per line) or ``.parquet`` file. Defaults to the
        12-problem fixture shipped with kvrl (smoke tests only).
    template : str
        Prompt template; ``{question}`` is replaced by the question (other braces are literal).
    shuffle : bool
        Shuffle the order each epoch with ``np_random``.
    limit : int, optional
        Keep only the first ``limit`` rows.
    timeout : float
        Hard per-answer verification timeout in seconds.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        template: str = DEFAULT_TEMPLATE,
        shuffle: bool = True,
        limit: int | None = None,
        timeout: float = 5.0,
    ) -> None:
        if "{question}" not in template:
            raise ValueError(f"template {template!r} must contain '{{question}}'")
        if not timeout > 0:  # 0 would time every check out: reward 0 for every answer, silently
            raise ValueError(
                f"timeout={timeout!r}: the per-answer verification timeout must be > 0 seconds, "
                "e.g. env.kwargs.timeout=5"
            )
        self.path = Path(path) if path is not None else FIXTURE
        self.template = template
        self.timeout = timeout
        super().__init__(
            math_tasks(self.path, template, limit),
            rewards=[Reward(self.correct, 1.0, "correct"), Reward(has_boxed, 0.0, "has_boxed")],
            shuffle=shuffle,
        )

    def correct(self, task: Task, completion: str) -> tuple[float, dict]:
        """1.0 when the completion's last ``\\boxed{}`` equals ``task.answer``."""
        pred = extract_boxed(completion)
        if pred is None or task.answer is None:
            return 0.0, {"verify_timeout": False}
        verdict = check_answer(task.answer, pred, self.timeout)
        return float(verdict.equal), {"verify_timeout": verdict.timed_out}


def has_boxed(task: Task, completion: str) -> float:
    """1.0 when the completion contains a complete ``\\boxed{...}``."""
    return float(extract_boxed(completion) is not None)


# ---- loading ---------------------------------------------------------------------------


def load_math_tasks(path: str | Path, template: str = DEFAULT_TEMPLATE) -> list[Task]:
    """Read ``path`` and turn each row into a Task (see the module docstring for layouts).
    Every row is held in memory: :func:`math_tasks` is what the environment uses."""
    return list(math_tasks(path, template))


def math_tasks(path: str | Path, template: str = DEFAULT_TEMPLATE, limit: int | None = None) -> Sequence[Task]:
    """The tasks of ``path`` (its first ``limit``), read when drawn: a JSONL file as a
    :class:`JsonlTasks`, a parquet file as a :class:`ParquetTasks`."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"math dataset {str(path)!r} is a directory: give one .jsonl or .parquet file in it")
    if not path.is_file():
        raise FileNotFoundError(f"math dataset {str(path)!r} not found (give one .jsonl or .parquet file)")
    kinds = {".parquet": ParquetTasks, ".jsonl": JsonlTasks, ".json": JsonlTasks}
    if path.suffix not in kinds:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")
    tasks = kinds[path.suffix](path, template, limit)
    if not len(tasks) and limit != 0:  # limit=0 asked for none (and gets an empty data set, as before)
        raise ValueError(f"{path}: no rows")
    return tasks


class FileTasks(Sequence):
    """The tasks of a data file, each read from the file when it is indexed.

    Holding every row as a Task (and the driver tokenising them all) would make a 200 MB file
    cost the driver 4.2 GB and each rollout actor 1.3 GB. A subclass makes one
    streaming pass at construction that checks every row as :func:`row_to_task` would (a
    malformed row fails now, naming ``file:line``) and keeps where each row is, and calls
    :meth:`_add` for each row it keeps: that builds ``tasks_sha256``, the digest
    :meth:`TextEnv.state_dict` saves, the same one a list of these tasks gives, so a file
    edited between a run and its resume is refused. A file changed while it is being read is
    refused at the next read.
    """

    def __init__(self, path: str | Path, template: str) -> None:
        self.path, self.template = Path(path), template
        self._digest = hashlib.sha256()
        self._stamp = None  # the subclass's pass takes it from the file it reads

    @property
    def tasks_sha256(self) -> str:
        return self._digest.hexdigest()

    def _add(self, task: Task) -> None:
        self._digest.update(json.dumps([task.id, task.prompt, task.answer]).encode())

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._checked_read(range(*i.indices(len(self))))
        if not -len(self) <= i < len(self):
            raise IndexError(f"task {i} of {len(self)}")
        return self._checked_read([i % len(self)])[0]

    def __iter__(self):  # a chunk per read, not a read per row
        for start in range(0, len(self), 256):
            yield from self[start : start + 256]

    def _checked_read(self, indices) -> list[Task]:
        with open(self.path, "rb") as f:
            if _stamp(f) != self._stamp:
                raise ValueError(
                    f"{self.path} changed while this run reads it (size or modification time differ "
                    "from when it was opened): restore it, or start a new run to train on the new one"
                )
            return self._read(f, indices)

    def _read(self, f, indices) -> list[Task]:
        """The tasks at ``indices``, from the open file ``f``."""
        raise NotImplementedError


class JsonlTasks(FileTasks):
    """A JSONL file's tasks; keeps each row's byte offset and line number (12 bytes a row)."""

    def __init__(self, path: str | Path, template: str = DEFAULT_TEMPLATE, limit: int | None = None) -> None:
        super().__init__(path, template)
        self._offsets, self._lines = array("q"), array("i")
        with open(self.path, "rb") as f:
            self._stamp = _stamp(f)
            for index, (lineno, offset, row) in enumerate(_jsonl_rows(self.path, f)):
                task = self._task(row, lineno, index)
                if limit is None or index < limit:  # rows past the limit are still checked, as before
                    self._offsets.append(offset)
                    self._lines.append(lineno)
                    self._add(task)

    def __len__(self) -> int:
        return len(self._offsets)

    def _task(self, row: dict, lineno: int, index: int) -> Task:
        """Row ``index`` (at line ``lineno``) as a Task; a subclass reads its own row format."""
        return row_to_task(row, f"{self.path}:{lineno}", f"{self.path.stem}-{index}", self.template)

    def _read(self, f, indices) -> list[Task]:
        tasks = []
        for i in indices:
            f.seek(self._offsets[i])
            lineno, _, row = next(_jsonl_rows(self.path, f, self._lines[i]))
            tasks.append(self._task(row, lineno, i))
        return tasks


class ParquetTasks(FileTasks):
    """A parquet file's tasks, read a row group at a time; the last group read is kept (as
    Arrow columns, not Tasks), so rows drawn from one group cost one read."""

    def __init__(self, path: str | Path, template: str = DEFAULT_TEMPLATE, limit: int | None = None) -> None:
        import pyarrow.parquet as pq

        super().__init__(path, template)
        self._group: tuple[int, Any] | None = None
        with open(self.path, "rb") as f:
            self._stamp = _stamp(f)
            file = pq.ParquetFile(f)
            self._starts = [0]  # the first row of each row group, then the row count
            for g in range(file.metadata.num_row_groups):
                self._starts.append(self._starts[-1] + file.metadata.row_group(g).num_rows)
            self._len = self._starts[-1] if limit is None else min(limit, self._starts[-1])
            i = 0
            for batch in file.iter_batches(batch_size=1024):  # a batch of rows as dicts at a time
                for row in batch.to_pylist():
                    task = self._task(row, i)  # rows past the limit are still checked, as JSONL's are
                    if i < self._len:
                        self._add(task)
                    i += 1

    def __len__(self) -> int:
        return self._len

    def _task(self, row: dict, i: int) -> Task:
        return row_to_task(row, f"{self.path}:{i + 1}", f"{self.path.stem}-{i}", self.template)

    def _read(self, f, indices) -> list[Task]:
        import pyarrow.parquet as pq

        tasks = []
        for i in indices:
            g = bisect.bisect_right(self._starts, i) - 1
            if self._group is None or self._group[0] != g:
                self._group = (g, pq.ParquetFile(f).read_row_group(g))
            tasks.append(self._task(self._group[1].slice(i - self._starts[g], 1).to_pylist()[0], i))
        return tasks


def _stamp(f) -> tuple[int, int, int]:
    st = os.fstat(f.fileno())
    return st.st_ino, st.st_size, st.st_mtime_ns


def _jsonl_rows(path: Path, f, first: int = 1):
    """Yield ``(line number, byte offset, dict)`` for each non-empty line of ``f`` from its
    position on (line ``first``); errors name ``file:line``."""
    offset = f.tell()
    for lineno, raw in enumerate(iter(f.readline, b""), start=first):
        start, offset = offset, offset + len(raw)
        try:  # a byte-order mark may open the file
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                "re-encode the file as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        yield lineno, start, row


def row_to_task(row: dict, where: str, default_id: str, template: str = DEFAULT_TEMPLATE) -> Task:
    """One row -> Task. ``where`` (``file:line``) prefixes every error."""
    question = _first(row, QUESTION_KEYS)
    if question is None:
        raise ValueError(f"{where}: missing question field (columns: {sorted(row)}); accepted: {ACCEPTED}")
    if not isinstance(question, str):
        raise ValueError(f"{where}: the question is a {type(question).__name__} ({question!r:.60}); it must be text")
    answer = _first(row, ANSWER_KEYS)
    if answer is not None:
        # a number is an answer (AIME's are ints); a list, a mapping, a bool or NaN is a broken row,
        # which str() would silently turn into a gold answer such as "[1, 2]"
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or answer != answer:
            raise ValueError(
                f"{where}: the answer is {answer!r:.60} ({type(answer).__name__}); it must be text or a number"
            )
        answer = str(answer).strip()
        if "####" in answer:  # GSM8K: reasoning, then "#### 72"
            answer = answer.rsplit("####", 1)[1].strip().replace(",", "")
    elif isinstance(row.get("solution"), str):  # MATH: the answer is boxed in the solution
        answer = extract_boxed(row["solution"])
        if answer is None:
            raise ValueError(f"{where}: missing answer field and no \\boxed{{}} in 'solution'; accepted: {ACCEPTED}")
    else:
        raise ValueError(f"{where}: missing answer field (columns: {sorted(row)}); accepted: {ACCEPTED}")
    if not answer:
        raise ValueError(f"{where}: empty answer")
    for name, text in (("question", question), ("answer", answer)):
        try:  # JSON's "\ud800" decodes to a lone surrogate, which no tokenizer (nor UTF-8) encodes
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{where}: the {name} holds a lone surrogate {text[e.start]!r} at character {e.start + 1} "
                "(a \\uXXXX escape of half a UTF-16 pair), which is no text a tokenizer encodes; fix the "
                "escape or drop the row"
            ) from None
    task_id = _first(row, ID_KEYS)
    used = {*QUESTION_KEYS, *ANSWER_KEYS, *ID_KEYS, "solution"}
    meta = {k: v for k, v in row.items() if k not in used and _is_small(v)}
    meta["source"] = where
    return Task(
        id=str(task_id) if task_id is not None else default_id,
        prompt=template.replace("{question}", str(question).strip()),
        answer=answer,
        meta=meta,
    )


def _first(row: dict, keys: tuple[str, ...]) -> Any:
    """The first present, non-null, non-empty value among ``keys``."""
    for k in keys:
        v = row.get(k)
        if v is not None and v != "":
            return v
    return None


def _is_small(v: Any) -> bool:
    """Scalars worth keeping in Task.meta (level, subject, year, ...)."""
    return isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 200)
