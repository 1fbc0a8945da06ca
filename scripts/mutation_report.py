"""Survivors of `make mutation`, each with the line it changed: reads mutmut's results (mutants/*.meta)
and the mutated sources, so hundreds of survivors need no `mutmut show` each.

    python scripts/mutation_report.py             # score and survivors, one line each
    python scripts/mutation_report.py --counts    # the score only
    python scripts/mutation_report.py --markdown  # docs/mutation-survivors.md: every survivor and why

Why a survivor is equivalent or accepted is written once per kind in REASONS below (matched on the file,
the function and, optionally, a piece of the changed line); a survivor no reason matches is printed as
UNEXPLAINED, which is work to do: a test to write, or a reason to add here after reading the mutant.
"""

from __future__ import annotations

import ast
import difflib
import json
import sys
from pathlib import Path

# mutmut's exit codes (mutmut/stats.py): 0 survived; 5 and 33 no test reaches the mutant; None not checked
# yet; 34 skipped; anything else (1, 3, timeouts, signals) killed.
SURVIVED, NO_TESTS, NOT_CHECKED, SKIPPED = {0}, {5, 33}, {None}, {34}


# (file, function name as mutmut spells it, a piece of the changed line or "", why it is not killed)
REASONS: list[tuple[str, str, str, str]] = []


def reason_for(path: str, key: str, change: str) -> str:
    function = key.rpartition(".")[2].rpartition("__mutmut_")[0]
    for file, name, piece, why in REASONS:
        if path == file and function == name and piece in change:
            return why
    return "UNEXPLAINED"


def _functions(path: Path) -> dict[str, str]:
    source = path.read_text()
    lines = source.splitlines()
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and "__mutmut_" in node.name:
            found[node.name] = "\n".join(lines[node.lineno - 1:node.end_lineno])
    return found


def survivors(root: Path = Path("mutants")):
    totals = {"killed": 0, "survived": 0, "no_tests": 0, "not_checked": 0}
    rows = []
    for meta in sorted(root.rglob("*.py.meta")):
        results = json.loads(meta.read_text())["exit_code_by_key"]
        functions = _functions(meta.with_suffix(""))
        for key, code in sorted(results.items()):
            if code in SURVIVED:
                totals["survived"] += 1
            elif code in NO_TESTS:
                totals["no_tests"] += 1
            elif code in NOT_CHECKED or code in SKIPPED:
                totals["not_checked"] += 1
                continue
            else:
                totals["killed"] += 1
                continue
            name = key.rpartition(".")[2]
            original = functions.get(name.rpartition("__mutmut_")[0] + "__mutmut_orig", "")
            changed = [line[1:].strip() for line in difflib.unified_diff(
                original.splitlines()[1:], functions.get(name, "").splitlines()[1:], lineterm="", n=0)
                if line.startswith("+") and not line.startswith("+++")]
            rows.append((str(meta.relative_to(root).with_suffix("")), key, "survived" if code in SURVIVED
                         else "no test", " / ".join(changed)[:160]))
    return totals, rows


def main() -> None:
    totals, rows = survivors()
    checked = totals["killed"] + totals["survived"] + totals["no_tests"]
    score = 100 * totals["killed"] / checked if checked else 0
    print(f"mutation score: {score:.1f} % ({totals['killed']} killed, {totals['survived']} survived, "
          f"{totals['no_tests']} reached by no test, of {checked}; {totals['not_checked']} not checked)")
    if "--markdown" in sys.argv:
        print("\n| file | mutant | state | the changed line | why it is not killed |\n|---|---|---|---|---|")
        for path, key, state, change in rows:
            cell = change.replace("|", "\\|")
            print(f"| `{path}` | `{key.rpartition('.')[2]}` | {state} | `{cell}` | {reason_for(path, key, change)} |")
    elif "--counts" not in sys.argv:
        for path, key, state, change in rows:
            print(f"{path}\t{key.rpartition('.')[2]}\t{state}\t{reason_for(path, key, change)}\t{change}")


if __name__ == "__main__":
    main()
