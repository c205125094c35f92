"""``gridserve bench agent-parsing`` in its tiny mode: it runs (on the demo tokenizer) and writes
the report's shape: ms per token for every tool and reasoning parser, and the constraint's cost."""

from __future__ import annotations

import json
import math
from pathlib import Path

from gridserve.benchmarks import agent_parsing
from gridserve.cli import main


def test_tiny_run_writes_every_parser_and_the_constraint(tmp_path: Path) -> None:
    out = tmp_path / "agent_parsing.json"
    assert main(["bench", "agent-parsing", "--tiny", "--tokenizers", "demo", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "agent-parsing" and report["unit"] == "ms per output token"
    assert len(report["load_average_before"]) == len(report["load_average_after"]) == 3
    demo = report["tokenizers"]["demo"]
    assert demo["vocab_size"] == 4096
    assert set(demo["tool_parsers"]) == set(agent_parsing.TOOL_PARSER_NAMES)
    assert set(demo["reasoning_parsers"]) == set(agent_parsing.REASONING_PARSER_NAMES)
    for row in [*demo["tool_parsers"].values(), *demo["reasoning_parsers"].values()]:
        assert row["tokens"] > 0
        for key in ("plain_chat_stream_ms_per_token", "chat_stream_with_parser_ms_per_token",
                    "parser_stream_ms_per_token", "parser_extract_ms_per_token",
                    "ratio_chat_stream_with_parser_vs_plain"):
            assert math.isfinite(row[key]) and row[key] > 0, key
    structured = demo["structured_output"]
    assert structured["vocab_size"] == 4096 and structured["accepted_tokens"]
    (one,) = structured["per_batch"].values()
    assert one["structured_rows"] == 1
    assert 0 < one["llguidance_mask_ms_per_token"] and 0 < one["total_ms_per_token"]
    assert one["total_ms_per_token"] == one["apply_bitmask_ms_per_token"] + one["accept_tokens_ms_per_token"]
