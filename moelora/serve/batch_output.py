"""The output file of `moelora run-batch`: checked and emptied before the model loads (an older
file never stays behind looking current), then one complete JSON line per finished request,
each written by one os.write of the whole encoded line (no Python buffer), so a job stopped at
any moment leaves only whole lines behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import ConfigError

FLAG = "--output-file"


class ResultFile:
    """An open output file and what was written to it (`written` records, `failed` of them
    error records)."""

    def __init__(self, path: Path, fd: int, created: bool) -> None:
        self.path, self._fd, self._created = path, fd, created
        self.written = self.failed = 0

    @classmethod
    def create(cls, path: Path, input_file: Path) -> ResultFile:
        """`path` opened empty (created or truncated); ConfigError naming --output-file when
        it cannot be: a directory, a missing folder, the input file, not writable."""
        _check(path, input_file)
        created = not path.exists()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        except OSError as err:
            raise ConfigError(FLAG, str(path), f"a file this user can write ({err.strerror})",
                              "choose a writable path or change the permissions") from None  # fmt: skip
        return cls(path, fd, created)

    def write(self, record: dict) -> None:
        """One record as one JSON line; os.write may take part of it: the rest follows."""
        line = memoryview((json.dumps(record) + "\n").encode())
        while line:
            line = line[os.write(self._fd, line) :]
        self.written += 1
        self.failed += record["error"] is not None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        """Nothing ran (the model did not load): closed, and removed if this job created it."""
        self.close()
        if self._created:
            self.path.unlink(missing_ok=True)


def _check(path: Path, input_file: Path) -> None:
    folder = path.parent
    if path.is_dir():
        raise ConfigError(FLAG, str(path), "a file path, not a directory",
                          f"name a file in it, e.g. {FLAG} {path / 'results.jsonl'}")  # fmt: skip
    if not folder.exists():
        raise ConfigError(FLAG, str(path), f"a file in an existing folder ({folder} does not "
                          f"exist)", f"create it first (mkdir -p {folder}) or name a file in an "
                          "existing folder")  # fmt: skip
    if not folder.is_dir():
        raise ConfigError(FLAG, str(path), f"a file in a folder ({folder} is a file)",
                          "name a file in an existing folder")  # fmt: skip
    if path.exists() and path.samefile(input_file):
        raise ConfigError(FLAG, str(path), "a file other than --input-file (the output file is "
                          "emptied when the job starts)", "name another file")  # fmt: skip
