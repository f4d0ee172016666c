"""The checkout itself: no committed merge conflicts in any tracked text file."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^(<<<<<<< |>>>>>>> |=======$)", re.MULTILINE)


def test_no_tracked_file_holds_a_merge_conflict() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    conflicted = []
    for name in files:
        path = ROOT / name
        if path.suffix in {".py", ".md", ".toml", ".json", ".yaml", ".yml", ""} and path.is_file():
            text = path.read_text(errors="replace")
            if MARKER.search(text):
                conflicted.append(name)
    assert conflicted == []
