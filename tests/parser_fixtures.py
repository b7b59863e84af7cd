"""Model outputs in each tool-call / reasoning format, with what they must parse to.

Written for these tests from the formats as their model cards and chat
templates describe them (Qwen3 / Qwen3-Coder, DeepSeek-V3 / V3.1, Kimi-K2,
GLM-4.5, Llama 3.1/3.2 JSON tool calling, Mistral's v3 and v11 tokenizer
formats, OpenAI's harmony for gpt-oss), including what real outputs do:
text before calls, several calls, multi-line code in arguments, markup-like
text inside string values, non-ASCII, and outputs that are not calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KIMI_SECTION, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                   "unit": {"type": "string", "enum": ["c", "f"]}}}
FILE_SCHEMA = {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
    "overwrite": {"type": "boolean"}, "tags": {"type": "array"}, "options": {"type": ["object", "null"]}}}
TOOLS = {"get_weather": WEATHER_SCHEMA, "write_file": FILE_SCHEMA, "run": {"type": "object", "properties": {
    "command": {"type": "string"}, "timeout": {"type": "number"}}}}

CODE = 'def area(r):\n    """Area of a circle; r < 0 is an error."""\n    if r < 0:\n        raise ValueError("<0")\n    return 3.14159 * r ** 2\n'


@dataclass
class Case:
    name: str
    tool_parser: str | None
    text: str
    calls: list[tuple[str, dict[str, Any] | str]] = field(default_factory=list)  # (name, arguments)
    content: str | None = None
    reasoning: str | None = None
    reasoning_parser: str | None = None
    call_ids: list[str | None] | None = None  # the model's own ids, when the format carries them


CASES = [
    # ---- Hermes / Qwen2.5 / Qwen3 -----------------------------------------------------------------
    Case("qwen3_think_then_call", "hermes",
         '<think>\nThe user wants the weather in Paris for 3 days. I will call get_weather.\n</think>\n\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
         [("get_weather", {"city": "Paris", "days": 3})],
         reasoning="The user wants the weather in Paris for 3 days. I will call get_weather.",
         reasoning_parser="qwen3"),
    Case("qwen25_text_and_two_calls", "qwen",
         'I will look up both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "unit": "c"}}\n</tool_call>',
         [("get_weather", {"city": "Zürich"}), ("get_weather", {"city": "東京", "unit": "c"})],
         content="I will look up both cities."),
    Case("hermes_code_in_arguments", "hermes",
         '<tool_call>\n{"name": "write_file", "arguments": {"path": "geo.py", "content": ' + json.dumps(CODE) +
         ', "mode": 420}}\n</tool_call>',
         [("write_file", {"path": "geo.py", "content": CODE, "mode": 420})]),
    Case("hermes_plain_answer", "hermes", "The capital of France is Paris.", content="The capital of France is Paris."),
    # ---- Qwen3-Coder --------------------------------------------------------------------------------
    Case("qwen3_coder_write_file", "qwen3_coder",
         "I'll create the module.\n\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/geo.py\n</parameter>\n"
         "<parameter=content>\n" + CODE + "\n</parameter>\n<parameter=mode>\n420\n</parameter>\n"
         "<parameter=overwrite>\nTrue\n</parameter>\n<parameter=tags>\n[\"math\", \"geometry\"]\n</parameter>\n"
         "</function>\n</tool_call>",
         [("write_file", {"path": "src/geo.py", "content": CODE, "mode": 420, "overwrite": True,
                          "tags": ["math", "geometry"]})],
         content="I'll create the module."),
    Case("qwen3_coder_two_calls_and_markup_in_values", "qwen3_coder",
         "<tool_call>\n<function=run>\n<parameter=command>\necho '<parameter=x>' && ls </tmp\n</parameter>\n"
         "<parameter=timeout>\n2.5\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
         "<parameter=city>\n123\n</parameter>\n</function>\n</tool_call>",
         [("run", {"command": "echo '<parameter=x>' && ls </tmp", "timeout": 2.5}),
          ("get_weather", {"city": "123"})]),
    # ---- DeepSeek-V3 / V3.1 -------------------------------------------------------------------------
    Case("deepseek_v3_fenced", "deepseek_v3",
         "Let me check." + DS_CALLS + DS_CALL + "function" + DS_SEP + "get_weather\n```json\n"
         '{"city": "Paris"}\n```' + DS_CALL_END + "\n" + DS_CALL + "function" + DS_SEP + "get_weather\n```json\n"
         '{"city": "Lyon", "days": 2}\n```' + DS_CALL_END + DS_CALLS_END,
         [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon", "days": 2})], content="Let me check."),
    Case("deepseek_v31_bare", "deepseek_v3",
         DS_CALLS + DS_CALL + "run" + DS_SEP + '{"command": "pytest -q"}' + DS_CALL_END + DS_CALLS_END,
         [("run", {"command": "pytest -q"})]),
    Case("deepseek_r1_reasoning", None, "First, 2 + 2 = 4.\n</think>\n\nThe answer is 4.",
         content="The answer is 4.", reasoning="First, 2 + 2 = 4.", reasoning_parser="deepseek_r1"),
    # ---- Kimi-K2 ------------------------------------------------------------------------------------
    Case("kimi_k2_two_calls", "kimi_k2",
         "I'll check both." + KIMI_SECTION + KIMI_CALL + "functions.get_weather:0" + KIMI_ARGS +
         '{"city": "Beijing"}' + KIMI_CALL_END + KIMI_CALL + "functions.run:1" + KIMI_ARGS +
         '{"command": "date"}' + KIMI_CALL_END + KIMI_SECTION_END,
         [("get_weather", {"city": "Beijing"}), ("run", {"command": "date"})], content="I'll check both.",
         call_ids=["functions.get_weather:0", "functions.run:1"]),
    Case("kimi_k2_thinking_ends_at_tool_section", "kimi_k2",
         "The user needs the weather; call the tool." + KIMI_SECTION + KIMI_CALL + "functions.get_weather:2" +
         KIMI_ARGS + '{"city": "Shanghai"}' + KIMI_CALL_END + KIMI_SECTION_END,
         [("get_weather", {"city": "Shanghai"})], reasoning="The user needs the weather; call the tool.",
         reasoning_parser="kimi_k2", call_ids=["functions.get_weather:2"]),
    # ---- GLM-4.5 ------------------------------------------------------------------------------------
    Case("glm45_think_and_call", "glm45",
         "<think>Need the forecast.</think>\nLet me look it up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
         "<arg_value>北京</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
         [("get_weather", {"city": "北京", "days": 3})], content="Let me look it up.",
         reasoning="Need the forecast.", reasoning_parser="glm45"),
    Case("glm45_json_values_and_no_arguments", "glm45",
         "<tool_call>write_file\n<arg_key>path</arg_key>\n<arg_value>a.txt</arg_value>\n<arg_key>options</arg_key>\n"
         '<arg_value>{"encoding": "utf-8"}</arg_value>\n<arg_key>content</arg_key>\n<arg_value>x < y\n</arg_value>\n'
         "</tool_call><tool_call>list_files\n</tool_call>",
         [("write_file", {"path": "a.txt", "options": {"encoding": "utf-8"}, "content": "x < y\n"}),
          ("list_files", {})]),
    # ---- Llama 3.1 / 3.2 JSON -----------------------------------------------------------------------
    Case("llama3_single", "llama3_json", '{"name": "get_weather", "parameters": {"city": "San Francisco"}}',
         [("get_weather", {"city": "San Francisco"})]),
    Case("llama3_python_tag_and_two_calls", "llama3_json",
         '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
         '{"name": "run", "parameters": {"command": "uptime"}}',
         [("get_weather", {"city": "Oslo"}), ("run", {"command": "uptime"})]),
    Case("llama3_json_answer_is_not_a_call", "llama3_json", '{"answer": 42, "unit": "none"}',
         content='{"answer": 42, "unit": "none"}'),
    # ---- Mistral ------------------------------------------------------------------------------------
    Case("mistral_v11", "mistral",
         'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]run[ARGS]{"command": "ls -la"}',
         [("get_weather", {"city": "Paris"}), ("run", {"command": "ls -la"})], content="Checking."),
    Case("mistral_v3_list", "mistral",
         '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice", "days": 1}}, '
         '{"name": "get_weather", "arguments": {"city": "Brest"}}]',
         [("get_weather", {"city": "Nice", "days": 1}), ("get_weather", {"city": "Brest"})]),
    Case("mistral_v7_call_id", "mistral", '[TOOL_CALLS]run[CALL_ID]a1B2c3D4e[ARGS]{"command": "pwd"}',
         [("run", {"command": "pwd"})], call_ids=["a1B2c3D4e"]),
    Case("magistral_reasoning", None, "[THINK]Two plus two is four.[/THINK]4", content="4",
         reasoning="Two plus two is four.", reasoning_parser="mistral"),
    # ---- OpenAI harmony (gpt-oss) -------------------------------------------------------------------
    Case("harmony_analysis_then_call", "openai",
         "<|channel|>analysis<|message|>User asks for weather; use the tool.<|end|><|start|>assistant"
         '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Tokyo","days":2}<|call|>',
         [("get_weather", {"city": "Tokyo", "days": 2})], reasoning="User asks for weather; use the tool."),
    Case("harmony_final_answer", "openai",
         "<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final<|message|>"
         "Hello! How can I help?<|return|>",
         content="Hello! How can I help?", reasoning="Simple greeting."),
    Case("harmony_preamble_and_recipient_first", "openai",
         "<|channel|>analysis<|message|>Plan: tell the user, then run.<|end|><|start|>assistant<|channel|>commentary"
         "<|message|>Running the tests now.<|end|><|start|>assistant to=functions.run<|channel|>commentary json"
         '<|message|>{"command": "pytest"}<|call|>',
         [("run", {"command": "pytest"})], content="Running the tests now.",
         reasoning="Plan: tell the user, then run."),
    Case("harmony_reasoning_parser_only", None,
         "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
         content="Done.", reasoning="Think.", reasoning_parser="openai_gptoss"),
]

