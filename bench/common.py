"""What the benchmark scripts share."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def emit(results: dict[str, Any], json_path: str | None, started: float) -> int:
    """Add the total time, print the results as JSON and write them to `json_path` when given."""
    results["total_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(results, indent=1)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
    return 0
