"""Tool calling: parsers turning model output into OpenAI-shaped tool calls (see docs/tool_calling.md)."""
from fastdeploy.tool_parsers.calls import (
    call_deltas, call_dict, check_tool_choice, check_tools, join_call_deltas, new_call_id)
from fastdeploy.tool_parsers.parsers import (
    ParsedCall, ToolCallSplit, ToolParser, get_tool_parser, known_tool_parsers, register_tool_parser)

__all__ = ["ParsedCall", "ToolCallSplit", "ToolParser", "call_deltas", "call_dict", "check_tool_choice",
           "check_tools", "get_tool_parser", "join_call_deltas", "known_tool_parsers", "new_call_id",
           "register_tool_parser"]
