"""Scores of the long-context suite, as lm-eval's `process_results` calls them: (doc, [generation]) ->
{metric: value}, averaged by lm-eval over a task's samples.

- `recall`: the share of a sample's expected answers (`doc["outputs"]`) that appear in the
  generation, case-insensitive: RULER's `string_match_all` (Hsieh et al., 2024). With one expected
  answer it is 1 or 0.
- `exact_match`: the first number in the generation is the expected one itself (the passkey's rule,
  `kitty_core.passkey.retrieved`: a longer or shorter number does not count).

Standard library only: `kitty_core.lm_eval_tasks` copies this file into every task folder it
writes, so `lm_eval --include_path <folder>` scores the suite with any model lm-eval runs.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean(text: str) -> str:
    """The generation as scored: control characters as line breaks, outer whitespace stripped."""
    return _CONTROL.sub("\n", text.strip()).strip()


def recall(doc: dict, results: list[str]) -> dict[str, float]:
    answer = clean(results[0]).lower()
    expected = doc["outputs"]
    return {"recall": sum(str(e).lower() in answer for e in expected) / len(expected)}


def exact_match(doc: dict, results: list[str]) -> dict[str, float]:
    found = re.search(r"\d+", clean(results[0]))
    return {"exact_match": float(bool(found) and found.group() == str(doc["outputs"][0]))}
