"""Wording lint: the project's files speak of the code, not of how or when it was made.

Fails (exit 1), printing ``file:line: reason: text`` for every hit, on:

- the forbidden word ``FORBIDDEN`` (any case, singular or plural, as a whole word);
- a calendar date (``2026-12-03``, ``3 December 2026``, ``Dec 3, 2026``): a timing or a note
  tied to a date goes stale without saying so; measurements belong in docs/tuning.md;
- a commit hash (7 to 40 hex digits, with at least one digit and one letter): comments state
  invariants and reasons, and a hash points into history instead. Except in ``docs/tuning.md``,
  the evidence file, where each measurement names the build it timed.

Checked: every text file under ``kda/``, ``tests/`` and ``docs/``, and ``README.md``.

    python .ci/lint_wording.py [PATH ...]      # the paths above by default
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PATHS = ('kda', 'tests', 'docs', 'README.md')
SUFFIXES = {'.py', '.md', '.txt', '.rst', '.toml', '.cfg', '.sh'}

MONTH = (r'(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?'
         r'|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)')
HASH = 'a commit hash'
# The one file whose lines may name a commit (the build a measurement timed).
HASHES_ALLOWED = frozenset({Path('docs/tuning.md')})
# Spelled in two parts so that this file does not carry the word it forbids.
FORBIDDEN = 'sess' + 'ion'
RULES = (
    (f'the word "{FORBIDDEN}"', re.compile(rf'\b{FORBIDDEN}s?\b', re.IGNORECASE)),
    ('a date', re.compile(r'\b\d{4}-\d{2}-\d{2}\b'
                          rf'|\b\d{{1,2}} {MONTH}\.? \d{{4}}\b'
                          rf'|\b{MONTH}\.? \d{{1,2}},? \d{{4}}\b')),
    (HASH, re.compile(r'\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b')),
)


def files_under(path: Path):
    """``path`` itself, or the text files below it, skipping caches."""
    if path.is_file():
        yield path
        return
    for p in sorted(path.rglob('*')):
        if p.is_file() and p.suffix in SUFFIXES and '__pycache__' not in p.parts:
            yield p


def hits(path: Path):
    """``(line number, reason, line)`` for every rule a line of ``path`` breaks."""
    rules = [(r, p) for r, p in RULES if r != HASH or path.relative_to(ROOT) not in HASHES_ALLOWED]
    text = path.read_text(encoding='utf-8', errors='replace')
    for number, line in enumerate(text.splitlines(), 1):
        for reason, pattern in rules:
            if pattern.search(line):
                yield number, reason, line.strip()


def main(argv: list[str]) -> int:
    paths = [ROOT / p for p in (argv or DEFAULT_PATHS)]
    missing = [str(p.relative_to(ROOT)) for p in paths if not p.exists()]
    if missing:
        print(f"lint_wording: no such path: {', '.join(missing)}")
        return 2
    count = 0
    for root in paths:
        for path in files_under(root):
            for number, reason, line in hits(path):
                count += 1
                print(f"{path.relative_to(ROOT)}:{number}: {reason}: {line[:100]}")
    if count:
        print(f"lint_wording: {count} line(s) to reword (see .ci/lint_wording.py for why)")
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
